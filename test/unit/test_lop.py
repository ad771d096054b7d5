"""lop (local-operator parallelism) end to end through the in-process transport.

* the operator analysis: which operators are local, and row slabs computed with halos equal
  the whole tensors for every region of every lop model;
* every schedule LOSS produces at 5, 20, 50 and 100 Mbit/s (and, so that the spatial path
  is exercised on every model whatever the planner prefers, spatial schedules at three
  shares on the largest regions) gives the local outputs with lossless encodings;
* LOSS: the grid solver is never worse than differential evolution, plans are cached on
  disk and switch with the bandwidth, and a model without local operators degrades to
  layer partitioning;
* the server refuses malformed lop requests and a finish without its part.
"""

import copy
import dataclasses
import glob
import json
import math
import os
import threading
import time

import pytest
import torch
from torch import nn

from robot_offload import backends, codec, structure
from robot_offload.client import ClientConfig, OffloadClient
from robot_offload.errors import ConfigError
from robot_offload.models import get_spec
from robot_offload.server.executors import lop as lop_executor
from robot_offload.partition.graph import INPUT_CUT, OUTPUT_CUT, CutError, capture
from robot_offload.partition.loss import (MIN_SPATIAL_GAIN, ROBOT_TAIL_MAX_SHARE, LopPlan, LopTable, Loss,
                                          RegionChoice, encodings_for,
                                          compare_solvers, load_or_solve, solve_buckets, solve_grid,
                                          table_key)
from robot_offload.partition.cost import join_encoding, objective_cost, predict_schedule
from robot_offload.partition.choice import MeasuredChoice
from robot_offload.partition.planner import PlannerConfig, plan_for
from robot_offload.partition.profile import build_profile, encoding_key
from robot_offload.partition.spatial import SpatialGraph
from robot_offload.protocol import ComputeRequest, StatusCode
from robot_offload.server import RequestRejected
from robot_offload.stats import FrameStats
from robot_offload.transport.inproc import InProcessTransport

from devices import assert_same_up_to_summation_order

LOP_MODELS = ("vgg19", "resnet101", "densenet121", "regnet_y_400mf", "convnext_tiny",
              "mobilenet_v2", "kapao_l", "agrnav")
BUCKETS = (5e6, 20e6, 50e6, 100e6)
#: the robot's forward time the plans-switch test scales its profile to (s)
PLANS_SWITCH_ROBOT_S = 0.04


@pytest.fixture(scope="module")
def profile_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("profiles"))


def _client(server, model, profile_dir, transport=None, **kw):
    """A connected lop client of ``server`` (through ``transport``, by default in-process)."""
    spec = get_spec(model)
    cfg = ClientConfig(model=model, mode="lop", input_size=spec.test_input_size, load_timeout_s=120,
                       timeout_s=120, profile_dir=profile_dir, **kw)
    client = OffloadClient(cfg, transport or InProcessTransport(server))
    assert client.connect(), client.link.last_error
    return client


def _backend(client):
    b = backends.make_backend("lop", backends.BackendContext(
        client.spec, client.model, client.link, client.config))
    b.calibration_inputs, b.profile_repeats = 1, 1
    return b


def _planned(client, seed: int):
    """A lop backend of ``client`` with its states for a seeded input: (backend, input,
    local outputs, lop state, layer-partition state)."""
    backend = _backend(client)
    x = client.spec.example_input(client.input_size, seed=seed)
    with torch.inference_mode():
        ref = client.model(x)
    return backend, x, ref, backend.lop_state(x), backend.state(x)


def _slab_check(sg, region, x_first, full_last, share):
    robot_rows, server_rows = sg.split_rows(region, share)
    parts = {}
    for rows in (robot_rows, server_rows):
        need = sg.needs(region, rows)
        held = {}
        for n in region.inputs:
            if n in need:
                a, b = need[n]
                held[n] = (x_first[n].narrow(sg.axis(n), a, b - a).clone(), a)
        out = sg.run(region, need, held)
        for n in region.outputs:
            a, b = rows[n]
            if a < b:
                t, r0 = out[n]
                parts.setdefault(n, []).append(t.narrow(sg.axis(n), a - r0, b - a))
    for n in region.outputs:
        ref = full_last[n]
        torch.testing.assert_close(torch.cat(parts[n], dim=sg.axis(n)), ref, rtol=1e-4,
                                   atol=1e-5 * max(1.0, float(ref.abs().max())))


@pytest.mark.parametrize("model", LOP_MODELS)
def test_stripes_with_halos_equal_the_whole_tensors(model):
    spec = get_spec(model)
    m = spec.build().eval()
    g = capture(m)
    x = spec.example_input(spec.test_input_size, seed=3)
    metas, _ = g.record(x)
    sg = SpatialGraph(g, metas)
    kinds = sg.kinds()
    assert sum(k != "global" for k in kinds.values()) > 0.5 * len(kinds)
    cuts = g.enumerate_cuts(metas)
    regions = sorted(sg.local_regions(cuts[:: max(1, len(cuts) // 24)]), key=lambda r: -len(r.nodes))
    assert regions
    for region in regions[:4]:
        with torch.inference_mode():
            first = dict(zip(region.first.crossing, g.head_module(region.first)(x))) \
                if region.first.kind != "input" else {g.inputs[0]: x}
            last = dict(zip(region.last.crossing, g.head_module(region.last)(x)))
        for share in (0.0, 0.3, 0.5, 0.81, 1.0):
            _slab_check(sg, region, first, last, share)


def test_operator_classes():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3, padding=1)
            self.pool = nn.MaxPool2d(3, 2, 1)
            self.up = nn.Upsample(scale_factor=2)
            self.tconv = nn.ConvTranspose2d(4, 4, 2, stride=2)
            self.bn = nn.BatchNorm2d(4)
            self.fc = nn.Linear(8, 2)
            self.ceil = nn.MaxPool2d(2, 2, ceil_mode=True)

        def forward(self, x):
            a = self.bn(self.conv(x)).relu()
            b = self.up(self.pool(a))
            c = torch.cat([a, b], 1) + torch.cat([b, a], 1)
            d = self.tconv(self.ceil(a))
            e = torch.cat([a, d], 2)                   # along the rows: global
            s = torch.softmax(e, dim=2)                # not in the known set: global
            f = self.fc(c.permute(0, 2, 3, 1))         # channels last: row-wise
            return s, f, x.mean((2, 3))

    net = Net().eval()
    g = capture(net, leaf_modules=())
    metas, _ = g.record(torch.randn(1, 3, 16, 16))
    kinds = SpatialGraph(g, metas).kinds()
    assert kinds["conv"] == kinds["pool"] == kinds["up"] == kinds["tconv"] == "block"
    assert kinds["bn"] == kinds["relu"] == kinds["cat"] == kinds["add"] == kinds["permute"] == "elementwise"
    assert kinds["fc"] == "rowwise"
    assert kinds["ceil"] == kinds["cat_2"] == kinds["softmax"] == kinds["mean"] == "global"


def test_volume_rows_and_indexing_of_other_dimensions():
    """An N x 1 x X x Z x Y volume's rows are X (its first spatial axis), followed through
    the reshape and permute into N x Z x X x Y. Indexing with integers and constant slices
    keeps the rows when it leaves their dimension whole; indexing the rows, ``None``, ``...``,
    and bounds computed from a shape are global. The stripes of the local part join."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(4, 6, 3, padding=1)

        def forward(self, v):
            n, _, sx, z, sy = v.shape
            x = self.conv(v.reshape(n, sx, z, sy).permute(0, 2, 1, 3))
            kept = x[:, 1:4] - x[:, :1] + x[0][2:5].reshape(1, 3, sx, sy)   # channels: rows kept
            rows = x[:, :, 2:5]                              # the rows themselves
            computed = x[:, :x.shape[1] // 2]                # bounds read from a shape
            return kept.amax(1, keepdim=True), rows, computed, x[..., 0], x[:, None]

    torch.manual_seed(0)
    net = Net().eval()
    g = capture(net, leaf_modules=())
    v = torch.randn(1, 1, 12, 4, 6)
    metas, _ = g.record(v)
    sg = SpatialGraph(g, metas)
    kinds = sg.kinds()
    assert sg.axis("v") == 2 and sg.axis("reshape") == 1 and sg.axis("permute") == sg.axis("conv") == 2
    assert kinds["getitem_5"] == kinds["getitem_6"] == "rowwise"         # x[:, 1:4], x[:, :1]
    assert kinds["getitem_7"] == kinds["getitem_8"] == "rowwise"         # x[0], then its [2:5]: one axis fewer
    assert sg.axis("getitem_7") == sg.axis("getitem_8") == 1 and sg.axis("reshape_1") == 2
    assert kinds["sub"] == kinds["add"] == "elementwise" and kinds["amax"] == "rowwise"
    assert kinds["getitem_9"] == kinds["getitem_11"] == "global"         # the rows; computed bounds
    assert kinds["getitem_12"] == kinds["getitem_13"] == "global"        # ..., None
    first, last = g.cut(["permute"]), g.cut(["conv", "amax"])
    region = sg.region(first, last)
    with torch.inference_mode():
        x = g.head_module(first)(v)[0]
        want = dict(zip(last.crossing, g.head_module(last)(v)))
    for share in (0.0, 0.25, 0.5, 1.0):
        _slab_check(sg, region, {"permute": x}, want, share)


def test_agrnav_attention_is_global_and_the_3d_head_local():
    """AGRNav's criss-cross attention and MobileViTv2 blocks mix whole rows (einsum,
    softmax and flatten over positions): global, so no region crosses them. Every
    convolution is local, and the largest region ends at the outputs: the 3D head, the
    occupancy logit and the labels run in stripes."""
    spec = get_spec("agrnav")
    g = capture(spec.build())
    metas, _ = g.record(spec.example_input(spec.test_input_size, seed=1))
    sg = SpatialGraph(g, metas)
    kinds = sg.kinds()
    attention = [n for n in kinds if n.startswith(("einsum", "softmax", "flatten", "masked_fill"))]
    assert len(attention) == 4 + 5 + 8 + 1 and all(kinds[n] == "global" for n in attention)
    convs = [n for n in kinds if g.by_name[n].op == "call_module" and isinstance(
        g.gm.get_submodule(g.by_name[n].target), (nn.Conv2d, nn.Conv3d, nn.ConvTranspose2d))]
    assert len(convs) > 50 and all(kinds[n] == "block" for n in convs)
    regions = sg.local_regions(g.enumerate_cuts(metas))
    assert regions and not any(set(r.nodes) & set(attention) for r in regions)
    largest = max(regions, key=lambda r: len(r.nodes))
    assert largest.last.kind == OUTPUT_CUT
    assert {"model_head_classify", "amax", "argmax", "sub"} <= set(largest.nodes)


def _spatial_plan(loss, st, region_index: int, step: int, bw: float = 20e6, encoding: str = "raw/none"):
    """A spatial schedule of region ``region_index`` with the robot's share ``step`` / 16."""
    from robot_offload.partition.loss import _lop_plan
    cand = loss.candidate(region_index, step)
    return _lop_plan(cand, encoding, predict_schedule(st.profile, cand, encoding, bw, st.cfg), bw)



def test_a_3d_head_with_reshape_and_argmax_is_local_and_its_stripes_join():
    """AGRNav's semantic head: BEV channels reshaped into C x Z (rows move from dim 2 to 3),
    dilated 3D convolutions along those rows, a per-voxel argmax over the classes and a
    cast; and a reduction over Z. All keep rows apart, so the region reaches the outputs,
    and the stripes, joined, are the whole outputs. A flatten mixes the rows: global."""
    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.lift = nn.Conv2d(4, 6, 1)
            self.c3 = nn.Conv3d(2, 2, 3, padding=2, dilation=2)
            self.cls = nn.Conv3d(2, 5, (1, 3, 1), padding=(0, 1, 0))

        def forward(self, x):
            n, _, h, w = x.shape
            v = self.lift(x).reshape(n, 2, 3, h, w)
            v = v + self.c3(v).relu()
            return self.cls(v).argmax(1).to(torch.uint8), v.sum(2)

    class Flat(nn.Module):
        def forward(self, x):
            return x.reshape(x.shape[0], -1), x.reshape(1, 2, 2, 13, 7).permute(0, 1, 3, 2, 4).reshape(1, 4, 13, 7)

    torch.manual_seed(0)
    net = Head().eval()
    g = capture(net, leaf_modules=())
    x = torch.randn(1, 4, 13, 7)
    metas, _ = g.record(x)
    sg = SpatialGraph(g, metas)
    kinds = sg.kinds()
    assert kinds["reshape"] == kinds["to"] == kinds["add"] == "elementwise"
    assert kinds["c3"] == kinds["cls"] == kinds["lift"] == "block"
    assert kinds["argmax"] == kinds["sum_1"] == "rowwise"
    assert (sg.axis("reshape"), sg.axis("c3"), sg.axis("argmax"), sg.axis("sum_1")) == (3, 3, 2, 2)
    g_flat = capture(Flat(), leaf_modules=())
    flat_kinds = SpatialGraph(g_flat, g_flat.record(x)[0]).kinds()
    assert flat_kinds["reshape"] == "global"                        # rows into one axis
    assert flat_kinds["reshape_1"] == flat_kinds["permute"] == "elementwise"
    assert flat_kinds["reshape_2"] == "global"     # 2 x R x 2 x W into 4 x R x W mixes rows
    region = sg.region(g.input_cut(), g.output_cut())
    with torch.inference_mode():
        labels, z_sum = net(x)
    for share in (0.0, 0.3, 0.5, 0.81, 1.0):
        _slab_check(sg, region, {g.inputs[0]: x}, {"to": labels, "sum_1": z_sum}, share)
    # LOSS: a region ending at the outputs sends nothing back up (no transfer B), and only
    # the server's rows of the outputs come down
    from robot_offload.partition.loss import stripe_cost
    cost = stripe_cost(sg, region, 0.3, {})
    server_rows = 13 - int(round(0.3 * 13))
    assert cost.b_raw_bytes == 0 and cost.a_raw_bytes > 0
    assert cost.down_share == pytest.approx(server_rows / 13)
    inner = stripe_cost(sg, sg.region(g.input_cut(), g.cut(["add"])), 0.3, {})
    assert inner.b_raw_bytes > 0 and inner.down_share == 1.0

@pytest.mark.parametrize("model", LOP_MODELS)
def test_every_plan_loss_produces_equals_local(shared_server, profile_dir, model):
    """Each lop model: each distinct schedule of the lossless table at 5/20/50/100 Mbit/s,
    plus spatial schedules at shares 1/4, 1/2 and 3/4 on the two largest regions."""
    client = _client(shared_server, model, profile_dir, partition_codecs=("raw",))
    try:
        backend, x, ref, ls, st = _planned(client, seed=11)
        plans = {}
        for bw in BUCKETS:
            p = ls.table.lookup(bw)
            plans.setdefault(p.key, p)
        loss = Loss(backend.graph, ls.spatial, st.profile, backend.share_steps)
        assert loss.regions, f"{model}: no local region between candidate cuts"
        for i in sorted(range(len(loss.regions)), key=lambda i: -len(loss.regions[i][0].nodes))[:2]:
            for step in (4, 8, 12):
                p = _spatial_plan(loss, st, i, step)
                plans.setdefault(p.key, p)
        assert any(p.spatial for p in plans.values())
        for p in plans.values():
            stats = FrameStats()
            y = backend.run_schedule(x, p, stats, 120)
            assert_same_up_to_summation_order(y, ref, f"{model} {p.describe()}")
            if p.spatial and p.robot_joins:
                # one request: the server's rows come down, the robot joins them
                assert stats.round_trips == 1 and stats.extra["lop"]["bytes_b"] == 0
                assert stats.extra["lop"]["join"] == "robot"
                if backend.region_of(ls.spatial, p)[2].kind == OUTPUT_CUT:
                    full = sum(t.numel() * t.element_size() for t in structure.flatten(ref)[0])
                    assert stats.bytes_down < full, (stats.bytes_down, full)
            elif p.spatial:
                assert backend.region_of(ls.spatial, p)[2].kind != OUTPUT_CUT
                assert stats.round_trips == 2
                assert stats.extra["lop"]["bytes_a"] + stats.extra["lop"]["bytes_b"] > 0
            if p.spatial:
                assert math.isfinite(stats.predicted_latency_s)
    finally:
        client.close()


def _latency_at(loss: Loss, plan: LopPlan, bandwidth_bps: float, cfg: PlannerConfig) -> float:
    """LOSS's predicted latency of ``plan`` were the link at ``bandwidth_bps``."""
    if not plan.spatial:
        p = plan.partition
        return plan_for(loss.profile, p.cut_id, p.encoding, bandwidth_bps, cfg).prediction.latency_s
    for cand in loss.candidates():
        if (tuple(cand.region.inputs), tuple(cand.region.outputs)) == (plan.first, plan.last) \
                and round(cand.share, 6) == round(plan.share, 6):
            enc = encoding_key(plan.codec, plan.compression)
            return predict_schedule(loss.profile, cand, enc, bandwidth_bps, cfg).latency_s
    raise AssertionError(f"no candidate for {plan.describe()}")


def test_plans_switch_with_bandwidth_and_are_cached(shared_server, profile_dir, tmp_path):
    client = _client(shared_server, "vgg19", profile_dir)
    try:
        backend = _backend(client)
        x = client.spec.example_input(client.input_size, seed=1)
        st = backend.state(x)
        ls = backend.lop_state(x)
        # Which schedule wins depends on the robot's speed against the link; this machine's
        # speed (and its load when the profile was measured) must not decide whether plans
        # switch (a fresh-clone CI run got one int8/zstd schedule in every bucket). So the
        # robot's whole forward pass is scaled to PLANS_SWITCH_ROBOT_S (40 ms), the server
        # to a quarter of it (load factors; server tails estimated, not the in-process
        # server's measured ones), and transfers are raw: the 64x64 input then takes 79 ms
        # at 5 Mbit/s, so no plan that gives the server most of the work beats local there,
        # and 4 ms at 100 Mbit/s, where such a plan beats local. Checked over 30 random
        # +-50 % perturbations of the node times: 2-4 distinct plans each time. No fixed
        # cost of a spatial frame: 5 ms of a 40 ms model would leave no spatial schedule
        # worth a bucket, and the switching is what is tested here.
        profile = copy.copy(st.profile)
        profile.fresh_tail_s = {}
        load = PLANS_SWITCH_ROBOT_S / profile.forward_s
        cfg = PlannerConfig(server_speedup=4.0, robot_load=load, server_load=load,
                            encodings=(encoding_key("raw", "none"),),
                            buckets=BUCKETS, spatial_overhead_s=0.0).validate()
        calls = []

        def factory():
            calls.append(1)
            return Loss(backend.graph, ls.spatial, profile)

        t1 = load_or_solve(str(tmp_path), factory, profile, cfg)
        t2 = load_or_solve(str(tmp_path), factory, profile, cfg)
        assert len(calls) == 1 and [p.key for p in t1.plans] == [p.key for p in t2.plans]
        assert t1.solve_s > 0
        # Each bucket's schedule is the best of the table at its own bandwidth (within the
        # planner's tie margin), so the plans switch with the link for a reason. Bytes sent
        # are not monotonic in the bandwidth here: with transfer and compute overlapped,
        # a slower link can prefer a deeper region that sends a little more.
        assert len({p.key for p in t1.plans}) >= 2, [p.describe() for p in t1.plans]
        loss = factory()
        for own in t1.plans:
            bw = own.bandwidth_bps
            own_s = _latency_at(loss, own, bw, cfg)
            assert own_s == pytest.approx(own.latency_s, rel=1e-9)
            for other in t1.plans:
                # A layer partition stays unless a spatial schedule beats it by MIN_SPATIAL_GAIN.
                gain = MIN_SPATIAL_GAIN if other.spatial and not own.spatial else 0.0
                assert own_s * (1 - gain) <= _latency_at(loss, other, bw, cfg) * (1 + cfg.tie_margin) + 1e-12, (
                    f"at {bw / 1e6:g} Mbit/s {own.describe()} is worse than {other.describe()}")
        # The gain rule itself: per bucket, the best spatial schedule (no gain asked) serves
        # only where it beats the layer partition (a gain of 100 %: never spatial) by it.
        spatial_somewhere = False
        for b in cfg.buckets:
            free = solve_grid(loss, b, cfg, min_gain=0.0)
            lp = solve_grid(loss, b, cfg, min_gain=1.0)
            kept = solve_grid(loss, b, cfg)
            assert not lp.spatial
            spatial_somewhere |= free.spatial
            wins = free.spatial and free.latency_s < lp.latency_s * (1 - MIN_SPATIAL_GAIN)
            assert kept.key == (free.key if wins else lp.key), (b, kept.describe(), free.describe())
        assert spatial_somewhere
        # A re-plan (new load factors) is solved in the background: the frame gets the
        # current table at once, the new one replaces it when ready.
        old_table = ls.table
        st.tracker.ratio["server"] = 7.0
        backend._replan(st)
        assert backend.lop_state(x).table is old_table
        for _ in range(600):
            if not ls.solving:
                break
            time.sleep(0.05)
        assert ls.cfg == st.cfg and ls.table is not old_table and ls.table.plans
        # ... and not written to the cache (its key holds per-frame server times).
        cached = glob.glob(os.path.join(profile_dir, "lop", "*.json"))
        assert not any(table_key(st.profile, st.cfg, backend.share_steps) in f for f in cached)
        # The table on disk is data: JSON that names cuts and numbers.
        text = LopTable.from_json(t1.to_json())
        assert [p.key for p in text.plans] == [p.key for p in t1.plans]
    finally:
        client.close()


def test_grid_solver_matches_or_beats_differential_evolution(shared_server, profile_dir):
    client = _client(shared_server, "resnet101", profile_dir)
    try:
        backend = _backend(client)
        x = client.spec.example_input(client.input_size, seed=1)
        st = backend.state(x)
        loss = Loss(backend.graph, backend.lop_state(x).spatial, st.profile)
        for row in compare_solvers(loss, st.cfg, [10e6, 100e6]):
            assert row["grid_objective"] <= row["de_objective"] + 1e-9, row
        # The vectorised table solver finds the scalar grid's optimum in every bucket.
        cfg = dataclasses.replace(st.cfg, buckets=(2e6, 10e6, 40e6, 150e6))
        for objective in ("latency", "energy", "deadline"):
            # deadline: met in the faster buckets only
            cfg = dataclasses.replace(cfg, objective=objective, deadline_s=0.6 * solve_grid(loss, 10e6, cfg).latency_s)
            for b, p in zip(cfg.buckets, solve_buckets(loss, cfg)):
                g = solve_grid(loss, b, cfg)
                key = lambda q: objective_cost(cfg, q.latency_s, q.energy_j)   # noqa: E731
                assert key(p) == pytest.approx(key(g), rel=1e-9), (b, p.describe(), g.describe())
        # What does not depend on the load factors is made once; a new admission rule
        # (error tolerance) makes it again, and the solvers still agree under it.
        encs = st.profile.encodings
        kept = loss.solver_arrays(cfg, encs)
        assert loss.solver_arrays(dataclasses.replace(cfg, robot_load=2.0, server_load=0.5), encs) is kept
        strict = dataclasses.replace(cfg, objective="latency", error_tolerance=1e-4)
        assert loss.solver_arrays(strict, encs) is not kept
        for b, p in zip(strict.buckets, solve_buckets(loss, strict)):
            assert p.latency_s == pytest.approx(solve_grid(loss, b, strict).latency_s, rel=1e-9)
        # ... and with a region's own stripe factors (a measured region, see
        # StripeCalibration), which its schedules alone are predicted with.
        c0 = loss.candidates()[0]
        own = dataclasses.replace(cfg, objective="latency",
                                  stripe_region_loads=((c0.first.id, c0.last.id, 0.3, 0.2),))
        for b, p in zip(own.buckets, solve_buckets(loss, own)):
            assert p.latency_s == pytest.approx(solve_grid(loss, b, own).latency_s, rel=1e-9)
        enc0 = encodings_for(loss.profile, c0, own)[0][0]
        assert (predict_schedule(loss.profile, c0, enc0, 20e6, own).robot_stripe_s
                == pytest.approx(0.3 / cfg.stripe_robot_load
                                 * predict_schedule(loss.profile, c0, enc0, 20e6, cfg).robot_stripe_s))
        # Every spatial schedule carries the fixed cost of a spatial frame
        # (spatial_overhead_s): predicted exactly that much slower, and under a large one
        # LOSS keeps the layer partitions everywhere.
        cfg = dataclasses.replace(st.cfg, objective="latency", buckets=(2e6, 10e6, 40e6, 150e6))
        cand, enc = next((c, e[0][0]) for c in loss.candidates()
                         for e in [encodings_for(loss.profile, c, cfg)] if e)
        free = dataclasses.replace(cfg, spatial_overhead_s=0.0)
        dear = dataclasses.replace(cfg, spatial_overhead_s=0.25)
        assert (predict_schedule(loss.profile, cand, enc, 20e6, dear).latency_s
                == pytest.approx(predict_schedule(loss.profile, cand, enc, 20e6, free).latency_s + 0.25))
        assert any(p.spatial for p in solve_buckets(loss, free, min_gain=0.0))
        assert not any(p.spatial for p in solve_buckets(loss, dataclasses.replace(cfg, spatial_overhead_s=10.0),
                                                         min_gain=0.0))
        with pytest.raises(ConfigError):
            dataclasses.replace(cfg, spatial_overhead_s=-0.001).validate()
    finally:
        client.close()


def test_no_local_operators_degrades_to_layer_partitioning():
    class Dense(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(64, 64), nn.Linear(64, 8)

        def forward(self, x):
            return self.b(torch.relu(self.a(x.flatten(1))))

    g = capture(Dense().eval(), leaf_modules=())
    x = torch.randn(1, 4, 4, 4)
    metas, _ = g.record(x)
    sg = SpatialGraph(g, metas)
    prof = build_profile(g, "dense", "h", [x], codecs=("raw",), compressions=("none",), repeats=1)
    loss = Loss(g, sg, prof)
    assert loss.regions == []
    cfg = PlannerConfig(buckets=BUCKETS).validate()
    plan = solve_grid(loss, 20e6, cfg)
    assert not plan.spatial and plan.partition is not None


def test_the_robot_runs_a_cheap_tail_whose_outputs_are_large(shared_server, profile_dir):
    """KAPAO: its decoder (a leaf, global) takes milliseconds and turns the head maps into
    as many decoded values. Joining the maps on the robot and decoding there sends the
    server's rows of the maps down instead of the robot's rows up and the whole
    predictions down; LOSS lists both joins of a region and prices this one lower at a
    low bandwidth; run, it is one request whose outputs equal local's, with fewer bytes
    down than the predictions. A region joined on the server can hand the decoder back
    too (``until``): two requests, the maps come down instead of the predictions."""
    client = _client(shared_server, "kapao_l", profile_dir, partition_codecs=("raw",))
    try:
        backend, x, ref, ls, st = _planned(client, seed=12)
        loss = Loss(backend.graph, ls.spatial, st.profile, backend.share_steps)
        inner = [i for i, rc in enumerate(loss.regions)
                 if rc.robot_joins and rc.last.kind != OUTPUT_CUT]
        assert inner, "no region joined on the robot before the outputs"
        i = max(inner, key=lambda i: len(loss.regions[i].region.nodes))
        region, p2 = loss.regions[i].region, loss.regions[i].last
        head = backend.graph.cut(p2.crossing).head
        assert any("detect" in n for n in backend.graph.order if n not in head), p2.label
        # the same region joined on the server is listed too
        j, = [k for k, rc in enumerate(loss.regions)
              if rc.region is region and not rc.robot_joins and rc.until is None]
        robot_join = loss.candidate(i, 8)
        server_join = loss.candidate(j, 8)
        assert robot_join.cost.b_raw_bytes == 0 and robot_join.cost.down_share == 0
        assert 0 < robot_join.cost.join_raw_bytes < server_join.cost.b_raw_bytes * 1.5
        at_5 = [predict_schedule(st.profile, c, "raw/none", 5e6, st.cfg).latency_s for c in (robot_join, server_join)]
        assert at_5[0] < at_5[1], at_5
        plan = _spatial_plan(loss, st, i, 8)
        assert plan.robot_joins and "robot joins" in plan.describe()
        stats = FrameStats()
        y = backend.run_schedule(x, plan, stats, 120)
        assert_same_up_to_summation_order(y, ref, plan.describe())
        lop = stats.extra["lop"]
        assert stats.round_trips == 1 and lop["bytes_b"] == 0 and lop["join"] == "robot", lop
        full = sum(t.numel() * t.element_size() for t in structure.flatten(ref)[0])
        assert 0 < stats.bytes_down < full, (stats.bytes_down, full)
        # share 0, joined on the robot: a full offload whose end the robot runs
        zero = _spatial_plan(loss, st, i, 0)
        assert zero.share == 0 and zero.robot_stripe_s == 0
        stats = FrameStats()
        assert_same_up_to_summation_order(backend.run_schedule(x, zero, stats, 120), ref, zero.describe())
        assert stats.round_trips == 1 and stats.extra["lop"]["join"] == "robot"
        # a lossy plan's rows come down as float16 (its integer codec's range guard needs
        # the tensors before encoding, which are on the server); a lossless plan's raw
        assert [join_encoding(e) for e in ("int8/zstd", "float16/none", "raw/bitshuffle_zstd")] == \
            ["float16/zstd", "float16/none", "raw/bitshuffle_zstd"]
        # joined on the server, which stops before the decoder: the region to the
        # second-to-last candidate cut, the server running on to the last (at this size
        # LOSS's own regions all reach the last; at 384x384 they do not)
        g = backend.graph
        first = loss.regions[i].first
        c1 = g.input_cut() if first.kind == INPUT_CUT else g.cut(first.crossing)
        cuts = [c for c in st.profile.cuts if c.kind == "inner" and c.bytes]
        c3 = cuts[-1]
        assert c3.tail_s <= ROBOT_TAIL_MAX_SHARE * st.profile.forward_s, (c3.label, c3.tail_s)
        for p2 in reversed(cuts[:-1]):
            try:
                region2 = ls.spatial.region(c1, g.cut(p2.crossing))
                break
            except CutError:
                continue
        loss.regions.append(RegionChoice(region2, first, p2, False, c3))
        k = len(loss.regions) - 1
        assert any("detect" in n for n in backend.graph.order
                   if n not in backend.graph.cut(c3.crossing).head), c3.label
        plan = _spatial_plan(loss, st, k, 8)
        assert plan.until == tuple(c3.crossing) and "robot from" in plan.describe()
        stats = FrameStats()
        y = backend.run_schedule(x, plan, stats, 120)
        assert_same_up_to_summation_order(y, ref, plan.describe())
        lop = stats.extra["lop"]
        assert stats.round_trips == 2 and lop["join"] == "server" and lop["until"] == c3.label, lop
        # raw head maps hold as many values as the predictions: the saving is in float16
        # and compression (the maps compress, the decoded boxes far less)
        assert lop["bytes_b"] > 0 and 0 < stats.bytes_down <= full, (stats.bytes_down, full)
    finally:
        client.close()


def _lop_request(args, tensors=(), client_id="t"):
    return ComputeRequest(client_id=client_id, model="vgg19", entry="lop_part",
                          tensors=list(tensors), args_json=json.dumps(args))


def test_server_refuses_bad_lop_requests(shared_server, profile_dir):
    client = _client(shared_server, "vgg19", profile_dir)
    try:
        loaded = shared_server.load("vgg19")
        shape = [1, 3] + list(client.input_size)
        g = capture(loaded.module)
        first, last = list(g.inputs), ["features_36"]
        good = {"phase": "part", "frame": "00ff00ff00ff", "first": first, "last": last,
                "split": {"features_36": 1}, "input_shape": shape}
        bad = [
            {**good, "phase": "run"},
            {**good, "frame": "../../etc"},
            {**good, "extra": 1},
            {**good, "first": ["nope"]},
            {**good, "last": ["avgpool"]},                    # a global node
            {**good, "first": ["features_36"], "last": first},  # backwards
            {**good, "split": {"features_36": 99}},
            {**good, "split": {}},
            {**good, "input_shape": [1, 3, -4, 4]},
            {**good, "join": "sideways"},
            {**good, "join": 1},
        ]
        # the arguments alone: the good ones parse, a frame id is matched whole
        assert lop_executor.parse_args(json.dumps(good), 10 ** 8)["frame"] == good["frame"]
        for frame in ("00ff00ff00ff\n", "00FF00FF00FF", "00ff", "0" * 65, 12345678):
            with pytest.raises(RequestRejected):
                lop_executor.parse_args(json.dumps({**good, "frame": frame}), 10 ** 8)
        for i, args in enumerate(bad):
            args = {**args, "frame": args["frame"] if args["frame"] != good["frame"] else f"{i:08x}"}
            with pytest.raises(RequestRejected) as e:
                shared_server.executors["lop_part"](loaded, _lop_request(args))
            assert e.value.code == StatusCode.BAD_REQUEST, args
        # Right names, wrong tensor shape: refused, and the finish learns it at once.
        x = torch.zeros(1, 3, 2, client.input_size[1])
        args = {**good, "frame": "aaaaaaaaaaaa"}
        with pytest.raises(RequestRejected):
            shared_server.executors["lop_part"](loaded, _lop_request(args, [codec.encode(x, first[0])]))
        fin = {"phase": "finish", "frame": "aaaaaaaaaaaa", "last": last, "input_shape": shape}
        for until in (5, [], [""], {"a": 1}):
            with pytest.raises(RequestRejected):
                lop_executor.parse_args(json.dumps({**fin, "until": until}), 10 ** 8)
        with pytest.raises(RequestRejected) as e:
            shared_server.executors["lop_part"](loaded, _lop_request(fin))
        assert "failed" in e.value.text
        # A finish whose part never came is refused after the wait.
        lop = shared_server.executors["lop_part"]
        old = lop.wait_s
        lop.wait_s = 0.05
        try:
            with pytest.raises(RequestRejected) as e:
                shared_server.executors["lop_part"](loaded, _lop_request({**fin, "frame": "bbbbbbbbbbbb"}))
            assert "no lop part" in e.value.text
        finally:
            lop.wait_s = old
    finally:
        client.close()


def test_one_client_cannot_keep_others_out_of_lop(shared_server, profile_dir):
    """Parts whose finish never comes (refused ones cost the server nothing to send) are
    kept for their finish; one client's many cannot fill the server's frames: it holds at
    most MAX_FRAMES_PER_CLIENT, a new part drops its oldest (whose finish says why), and
    another client's part is still taken, not answered BUSY."""
    client = _client(shared_server, "vgg19", profile_dir)
    lop = shared_server.executors["lop_part"]
    try:
        loaded = shared_server.load("vgg19")
        shape = [1, 3] + list(client.input_size)
        g = capture(loaded.module)
        first, last = list(g.inputs), ["features_36"]
        wrong = [codec.encode(torch.zeros(1, 3, 2, client.input_size[1]), first[0])]

        def part(frame, client_id):
            args = {"phase": "part", "frame": frame, "first": first, "last": last,
                    "split": {"features_36": 1}, "input_shape": shape}
            with pytest.raises(RequestRejected) as e:
                lop(loaded, _lop_request(args, wrong, client_id=client_id))
            return e.value

        for i in range(lop_executor.MAX_FRAMES + 4):
            assert part(f"{i:012x}", "hog").code == StatusCode.BAD_REQUEST
        assert sum(k[0] == "hog" for k in lop.frames) == lop_executor.MAX_FRAMES_PER_CLIENT
        refused = part("c0ffee00c0ffee00", "another-robot")
        assert refused.code == StatusCode.BAD_REQUEST, refused.text     # checked, not BUSY
        fin = {"phase": "finish", "frame": f"{0:012x}", "last": last, "input_shape": shape}
        old, lop.wait_s = lop.wait_s, 0.5
        try:
            t0 = time.monotonic()
            with pytest.raises(RequestRejected) as e:
                lop(loaded, _lop_request(fin, client_id="hog"))
            assert "no lop part" in e.value.text
            # a part still running when its frame is dropped: a finish waiting for it
            # wakes and says why
            with lop.frames_lock:
                frame = lop_executor._Frame()
                lop.frames[("late", "dddddddddddd")] = frame
            for i in range(lop_executor.MAX_FRAMES_PER_CLIENT):
                part(f"{i + 1:012x}", "late")
            assert frame.done.is_set() and frame.error.startswith("dropped"), frame.error
        finally:
            lop.wait_s = old
    finally:
        with lop.frames_lock:
            for key in [k for k in lop.frames if k[0] in ("hog", "another-robot", "late")]:
                del lop.frames[key]
        client.close()


def test_three_lines_hook_an_existing_model(shared_server, profile_dir):
    """Fig. 5's usage: the application's own model, hooked; calls return local's outputs
    through lop, the hook is removable, and a dead server falls back to local."""
    from robot_offload.lop import IntraDP

    spec = get_spec("mobilenet_v2")
    model = spec.build().eval()
    x = spec.example_input((128, 128), seed=2)
    with torch.inference_mode():
        ref = model(x)
    transport = InProcessTransport(shared_server)
    idp = IntraDP(transport=transport, input_size=(128, 128), profile_dir=profile_dir,
                  timeout_s=120, load_timeout_s=120, partition_codecs=("raw",),
                  partition_compressions=("none",), server_speedup=1000.0,
                  bandwidth_bps_default=1e9)
    idp.start_client(model, name="mobilenet_v2")
    try:
        with torch.inference_mode():
            y = model(x)
        assert idp.last_stats.executed_mode == "lop", idp.last_stats.fallback_reason
        assert idp.last_stats.plan.startswith("lop")
        assert idp.last_stats.round_trips >= 1      # a fast server: the plan uses it
        assert_same_up_to_summation_order(y, ref, "hooked model")
        # The server goes away: the hooked call still answers, locally.
        transport.server = None
        with torch.inference_mode():
            y = model(x)
        assert idp.last_stats.executed_mode == "local"
        assert_same_up_to_summation_order(y, ref, "fallback")
    finally:
        idp.stop_client()
    assert "forward" not in vars(model)


class _SlowLink(InProcessTransport):
    """The in-process server behind a link that carries one request at a time and adds
    ``delay_s`` (300 ms) to each: a spatial schedule's two requests cost twice a layer
    partition's one, which LOSS's model of this link (2 ms RTT, overlapped transfers) does
    not know."""

    def __init__(self, server, delay_s: float = 0.3):
        super().__init__(server)
        self._one_at_a_time = threading.Lock()
        self.delay_s = delay_s

    def _call(self, method, request, timeout_s):
        with self._one_at_a_time:
            time.sleep(self.delay_s)
            return super()._call(method, request, timeout_s)


def _frames_at(backend, x, ref, n: int, bandwidth_bps: float, what: str):
    """The stats of ``n`` frames of ``backend`` on ``x`` at a predicted ``bandwidth_bps``,
    each frame's outputs checked against ``ref``."""
    frames = []
    for _ in range(n):
        stats = FrameStats()
        stats.predicted_bandwidth_bps = bandwidth_bps
        assert_same_up_to_summation_order(backend.infer(x, stats, 120), ref, what)
        frames.append(stats)
    return frames


def test_measured_choice_between_a_spatial_schedule_and_the_layer_partition(shared_server, profile_dir):
    """A spatial schedule predicted 10 % faster than the layer partition of the same
    bandwidth, really slower: it, the layer partition and all local are timed (each first
    run left out, it sets kernels up), a layer partition serves the bucket, the spatial
    schedule is probed again every probe_every frames, and every frame equals local."""
    client = _client(shared_server, "vgg19", profile_dir, transport=_SlowLink(shared_server),
                     partition_codecs=("raw",), probe_every=5, replan_threshold=1e9)
    try:
        backend, x, ref, ls, st = _planned(client, seed=5)
        loss = Loss(backend.graph, ls.spatial, st.profile, backend.share_steps)
        i = max(range(len(loss.regions)), key=lambda i: len(loss.regions[i][0].nodes))
        spatial = _spatial_plan(loss, st, i, 8)
        lp = st.table.lookup(20e6)
        spatial = dataclasses.replace(spatial, latency_s=0.9 * lp.latency_s)
        ls.table = LopTable((1e6,), [spatial], 0.0)
        frames = _frames_at(backend, x, ref, 14, 20e6, "measured choice")
        ran = [("S" if s.extra["lop"]["spatial"] else "L", s.extra["lop"]["probe"]) for s in frames]
        schedules = {s.extra["lop"]["schedule"] for s in frames}
        # all local, predicted beyond the margin, is timed too (MeasuredChoice.candidate)
        assert any("all on robot" in sch for sch in schedules), schedules
        # after the first runs and probes of the three (their order depends on the
        # timings), a layer partition serves; the spatial schedule runs only as a probe
        assert sum(r == ("L", False) for r in ran[8:]) >= 4, ran
        assert all(probe for kind, probe in ran[8:] if kind == "S") and ("S", True) in ran[4:], ran
        key = st.table.index(20e6)      # layer partitioning's bucket
        served = [c for c in (lp,) + tuple(st.table.alternatives[st.table.index(20e6)])
                  if st.measured.median_s(key, c) is not None]
        assert min(st.measured.median_s(key, c) for c in served) < st.measured.median_s(key, spatial)
    finally:
        client.close()


def test_spatial_frames_feed_the_drift_tracker_only_after_the_join(shared_server, profile_dir):
    """A stripe's prediction (node times scaled by rows) misses per-node costs, so its
    measured / predicted ratio says more about the stripe than about the device's load;
    fed to the tracker it raised lop's load factors until its layer partitions left the
    robot. Spatial frames feed the tracker only with the whole layers after the join (here
    the server's tail; the robot computes nothing but its stripe); a layer-partition frame
    of lop feeds it as layer partitioning does."""
    client = _client(shared_server, "vgg19", profile_dir, partition_codecs=("raw",),
                     probe_every=0, replan_threshold=1e9)
    try:
        backend, x, ref, ls, st = _planned(client, seed=6)
        loss = Loss(backend.graph, ls.spatial, st.profile, backend.share_steps)
        i = max(range(len(loss.regions)), key=lambda i: len(loss.regions[i][0].nodes))
        plan = _spatial_plan(loss, st, i, 8)
        assert not plan.robot_joins and not plan.until and plan.last_label != "outputs"
        ls.table = LopTable((1e6,), [plan], 0.0)
        before = dict(st.tracker.samples)
        for _ in range(3):
            frame, = _frames_at(backend, x, ref, 1, 20e6, "spatial frames")
            assert frame.extra["lop"]["spatial"]
        assert st.tracker.samples["robot"] == before["robot"]
        assert st.tracker.samples["server"] >= before["server"] + 2   # the warm frames' tails
        by_kind = {c.kind: c for c in st.profile.cuts}
        local = plan_for(st.profile, by_kind[OUTPUT_CUT].id, "raw/none", 20e6, st.cfg)
        frame = FrameStats()
        y = backend.run_schedule(x, LopPlan(bandwidth_bps=1e6, latency_s=local.latency_s,
                                            energy_j=0.0, partition=local), frame, 120)
        assert_same_up_to_summation_order(y, ref, "all local")
        assert not frame.extra["lop"]["spatial"]
        assert st.tracker.samples["robot"] == before["robot"] + 1
    finally:
        client.close()


def test_all_local_is_a_latency_sample_from_its_first_frame(shared_server, profile_dir):
    """A schedule's first run is no latency sample (it sets kernels up), except all local:
    the model's own forward, nothing new to set up, and a wasted sample costs a whole
    local inference. Here the measured choice of a spatial bucket probes layer
    partitioning's plan (all local, or full offload) on its first run."""
    client = _client(shared_server, "vgg19", profile_dir, partition_codecs=("raw",),
                     probe_every=5, replan_threshold=1e9)
    try:
        backend, x, ref, ls, st = _planned(client, seed=7)
        loss = Loss(backend.graph, ls.spatial, st.profile, backend.share_steps)
        i = max(range(len(loss.regions)), key=lambda i: len(loss.regions[i][0].nodes))
        by_kind = {c.kind: c for c in st.profile.cuts}
        j = st.table.index(20e6)

        def probe(part, what):
            # the spatial schedule measured 10 s twice, predicted slower than ``part``:
            # ``part`` is the close call still to be timed, so the next frame probes it
            spatial = dataclasses.replace(_spatial_plan(loss, st, i, 8), latency_s=10 * part.latency_s)
            ls.table, ls.current = LopTable((1e6,), [spatial], 0.0), None
            st.table.plans[j], st.table.alternatives[j] = part, []
            st.measured = MeasuredChoice(margin=0.25, every=100)
            for _ in range(2):
                st.measured.observe(j, spatial, 10.0)
            frame, = _frames_at(backend, x, ref, 1, 20e6, what)
            return frame

        for kind, sampled in ((OUTPUT_CUT, True), (INPUT_CUT, False)):
            part = plan_for(st.profile, by_kind[kind].id, "raw/none", 20e6, st.cfg)
            frame = probe(part, kind)
            assert not frame.extra["lop"]["spatial"] and frame.extra["lop"]["probe"], kind
            assert frame.extra["partition"]["cut"] == by_kind[kind].label
            assert (st.measured.median_s(j, part) is not None) == sampled, kind
        # A layer partition this client ran before, in any backend (here layer_partition),
        # is warm: lop's first run of it is a sample.
        middle = next(c for c in st.profile.candidates if c.kind not in (INPUT_CUT, OUTPUT_CUT))
        part = plan_for(st.profile, middle.id, "raw/none", 20e6, st.cfg)
        assert part.key not in st.ran
        y = backends.make_backend("layer_partition", backend.ctx).run_plan(x, part, FrameStats(), 120)
        assert_same_up_to_summation_order(y, ref, "layer_partition")
        assert part.key in st.ran
        frame = probe(part, "middle cut run by layer_partition")
        assert frame.extra["lop"]["probe"] and st.measured.median_s(j, part) is not None
    finally:
        client.close()


def test_a_bucket_without_a_spatial_schedule_runs_layer_partitions_frames(shared_server, profile_dir):
    """Where LOSS degrades to layer partitioning, the frame is layer_partition's own: its
    plan for the bandwidth (not LOSS's copy), its alternatives and its measurements, keyed
    by its bucket. Here layer partitioning's full offload, predicted as fast as all local,
    is really slower (every request waits 0.3 s): all local is timed too and serves the
    bucket, and every frame equals local. (No periodic probes here: which alternatives are
    close calls depends on this machine's profile.)"""
    client = _client(shared_server, "vgg19", profile_dir, transport=_SlowLink(shared_server),
                     partition_codecs=("raw",), probe_every=1000, replan_threshold=1e9)
    try:
        backend, x, ref, ls, st = _planned(client, seed=6)
        by_kind = {c.kind: c for c in st.profile.cuts}
        local = plan_for(st.profile, by_kind[OUTPUT_CUT].id, "raw/none", 20e6, st.cfg)
        offload = plan_for(st.profile, by_kind[INPUT_CUT].id, "raw/none", 20e6, st.cfg)
        offload = dataclasses.replace(offload, prediction=dataclasses.replace(
            offload.prediction, latency_s=local.latency_s))
        # LOSS's table says all local; layer partitioning's says full offload, and wins
        ls.table = LopTable((1e6,), [LopPlan(bandwidth_bps=20e6, latency_s=local.latency_s,
                                             energy_j=0.0, partition=local)], 0.0)
        j = st.table.index(20e6)
        st.table.plans[j], st.table.alternatives[j] = offload, [local]
        frames = _frames_at(backend, x, ref, 12, 20e6, "layer-partition bucket")
        assert not any(s.extra["lop"]["spatial"] for s in frames)
        served = [(s.extra["partition"]["cut"], s.extra["lop"]["probe"]) for s in frames]
        local_label, offload_label = by_kind[OUTPUT_CUT].label, by_kind[INPUT_CUT].label
        assert served[0] == (offload_label, False), served
        assert served[-4:] == [(local_label, False)] * 4, served
        assert all(s.plan.startswith("lop:") for s in frames)
        assert st.measured.median_s(j, local) < st.measured.median_s(j, offload)
    finally:
        client.close()


def test_layer_partition_and_lop_of_one_client_share_what_they_measured(shared_server, profile_dir):
    """The client's ``layer_partition`` and ``lop`` keep one graph, one profile and one
    measured choice per shape: what layer_partition measured in a bucket (its full offload,
    predicted as fast as all local, is really slower: every request waits 1 s) is what
    lop's layer-partition frames are served by after a switch, with no second profile and
    no probe of the offload again. Two separate backends would each time the slow offload
    themselves (see the test above)."""
    # 1 s per request: the offload stays slower than all local with the robot's forward
    # as slow as a loaded machine makes it (VGG-19 at 64 x 64 took 0.3 s beside a CI run)
    client = _client(shared_server, "vgg19", profile_dir, transport=_SlowLink(shared_server, 1.0),
                     partition_codecs=("raw",), probe_every=1000, replan_threshold=1e9)
    try:
        lp, lop = client._get_backend("layer_partition"), client._get_backend("lop")
        assert lp.graph is lop.graph and lp.known is lop.known
        for b in (lp, lop):
            b.calibration_inputs, b.profile_repeats = 1, 1
        x = client.spec.example_input(client.input_size, seed=7)
        with torch.inference_mode():
            ref = client.model(x)
        st = lp.state(x)
        by_kind = {c.kind: c for c in st.profile.cuts}
        local = plan_for(st.profile, by_kind[OUTPUT_CUT].id, "raw/none", 20e6, st.cfg)
        offload = plan_for(st.profile, by_kind[INPUT_CUT].id, "raw/none", 20e6, st.cfg)
        offload = dataclasses.replace(offload, prediction=dataclasses.replace(
            offload.prediction, latency_s=local.latency_s))
        j = st.table.index(20e6)
        st.table.plans[j], st.table.alternatives[j] = offload, [local]
        frames = _frames_at(lp, x, ref, 12, 20e6, "layer_partition")
        assert frames[-1].extra["partition"]["cut"] == by_kind[OUTPUT_CUT].label
        assert lop.state(x) is st                     # no second profile, table or tracker
        ls = lop.lop_state(x)
        # LOSS says the same offload here (a layer partition, no spatial region)
        ls.table = LopTable((1e6,), [LopPlan(bandwidth_bps=20e6, latency_s=offload.latency_s,
                                             energy_j=0.0, partition=offload)], 0.0)
        after = _frames_at(lop, x, ref, 4, 20e6, "lop after layer_partition")
        served = [(s.extra["partition"]["cut"], s.extra["lop"]["probe"]) for s in after]
        assert served == [(by_kind[OUTPUT_CUT].label, False)] * 4, served
        assert all(s.plan.startswith("lop:") for s in after)
        # A spatial bucket: its schedule (predicted faster than all local, two requests
        # of 1 s each) is timed against layer_partition's candidates of the same
        # bucket, whose latencies layer_partition's frames measured: the slow offload is
        # not timed again, and all local serves once the schedule has measured slower.
        loss = Loss(lop.graph, ls.spatial, st.profile, lop.share_steps)
        r = max(range(len(loss.regions)), key=lambda r: len(loss.regions[r][0].nodes))
        spatial = dataclasses.replace(_spatial_plan(loss, st, r, 8), latency_s=0.5 * local.latency_s)
        ls.table, ls.current = LopTable((1e6,), [spatial], 0.0), None
        spatial_frames = _frames_at(lop, x, ref, 6, 20e6, "lop, spatial bucket")
        ran = [s.extra["lop"]["spatial"] or s.extra["partition"]["cut"] for s in spatial_frames]
        assert by_kind[INPUT_CUT].label not in ran, ran
        assert ran[0] is True and ran[-2:] == [by_kind[OUTPUT_CUT].label] * 2, ran
    finally:
        client.close()


def test_plan_switching_has_hysteresis():
    """The plan in use is kept while the predicted bandwidth stays within one bucket of the
    one it was chosen for; a bigger move, or a new table, switches."""
    from robot_offload.backends.lop import LopBackend, _LopState
    buckets = (1e6, 2e6, 4e6, 8e6, 16e6)
    plans = [LopPlan(bandwidth_bps=b, latency_s=1.0, energy_j=1.0, share=i / 8)
             for i, b in enumerate(buckets)]
    table = LopTable(buckets, plans, 0.0)
    ls = _LopState(None, None, None, table)
    pick = lambda bw: LopBackend._sticky(None, ls, bw)   # noqa: E731 - no backend state used
    assert pick(4.1e6) is plans[2]
    assert pick(2.5e6) is plans[2] and pick(9e6) is plans[2]     # one bucket either way
    assert pick(17e6) is plans[4]                                 # two buckets: switch
    assert pick(1.2e6) is plans[0]
    ls.table = LopTable(buckets, list(reversed(plans)), 0.0)      # re-planned: look up again
    assert pick(1.2e6) is ls.table.plans[0]


R1 = ("input", "cut_a")          # two spatial regions, by first and last cut id
R2 = ("cut_a", "cut_b")


def test_stripe_calibration_folds_in_a_side_that_is_off_its_prediction():
    from robot_offload.backends.lop import StripeCalibration
    cal = StripeCalibration(threshold=0.15, window=5, min_samples=3)
    solved = PlannerConfig()
    for measured in (1.3, 1.5, 1.4):
        assert not cal.update(solved)
        cal.observe(R1, "robot", 1.0, measured)
        cal.observe(R1, "server", 0.5, 0.52)           # within the threshold: kept
    assert cal.update(solved)
    assert cal.total == {"robot": pytest.approx(1.4), "server": None}
    assert cal.regions == {R1: {"robot": pytest.approx(1.4), "server": None}}
    assert not cal.update(solved)                    # samples start over with the new plans
    cal.observe(R1, "robot", 1.0, 0.0)
    cal.observe(R1, "robot", 0.0, 5.0)               # no prediction: ignored
    cfg = cal.apply(PlannerConfig())
    assert cfg.stripe_region_loads == ((*R1, pytest.approx(1.4), 1.0),)
    assert cfg.stripe_loads(*R1) == (pytest.approx(1.4), 1.0)
    # another region takes the multiple measured, being above the load factor
    assert (cfg.stripe_robot_load, cfg.stripe_server_load) == (pytest.approx(1.4), 1.0)
    assert cfg.stripe_loads(*R2) == (pytest.approx(1.4), 1.0)


def test_stripe_calibration_does_not_count_a_load_factor_twice():
    """Stripes fitted while the server's load factor was still the speed-up guess (1.0),
    measured 5x their prediction (folded in at the x4 bound): when the drift tracker later
    puts the server's load factor at 5, the stripes stay at the x4 they were measured at
    (stripe factor 0.8), not x20; the next fit moves them to what they measure."""
    from robot_offload.backends.lop import StripeCalibration
    cal = StripeCalibration(threshold=0.15, window=5, min_samples=3, bounds=(0.25, 4.0))
    solved = cal.apply(PlannerConfig())
    for _ in range(3):
        cal.observe(R1, "server", 0.1, 0.5)
    assert cal.update(solved)
    assert cal.apply(PlannerConfig()).stripe_loads(*R1)[1] == pytest.approx(4.0)
    measured_load = dataclasses.replace(PlannerConfig(), server_load=5.0)
    solved = cal.apply(measured_load)
    assert solved.stripe_loads(*R1)[1] == pytest.approx(0.8)
    assert solved.server_load * solved.stripe_loads(*R1)[1] == pytest.approx(4.0)
    for _ in range(3):                                   # predicted x4, measured x5
        cal.observe(R1, "server", 0.4, 0.5)
    assert cal.update(solved)
    assert cal.regions[R1]["server"] == pytest.approx(5.0)
    assert cal.apply(measured_load).stripe_loads(*R1) == (1.0, pytest.approx(1.0))


def test_stripe_calibration_is_kept_per_region():
    """A region's stripes are predicted with its own measured multiple; a region that has
    not run takes the last one measured only where that is above the load factor, so a
    stripe measured faster than the load factor says (or clamped at the bound while the
    load factor was a guess) never makes untried regions look faster than it."""
    from robot_offload.backends.lop import StripeCalibration
    cal = StripeCalibration(threshold=0.15, window=5, min_samples=3, bounds=(0.25, 4.0))
    solved = cal.apply(PlannerConfig())
    for _ in range(3):
        cal.observe(R1, "server", 0.1, 0.5)              # x5, clamped at x4
        cal.observe(R1, "robot", 1.0, 0.7)               # the robot's stripe x0.7
    assert cal.update(solved)
    loaded = cal.apply(dataclasses.replace(PlannerConfig(), server_load=5.0))
    assert loaded.stripe_loads(*R1) == (pytest.approx(0.7), pytest.approx(0.8))
    assert loaded.stripe_loads(*R2) == (1.0, 1.0)        # neither below its load factor
    for _ in range(3):
        cal.observe(R2, "robot", 1.0, 2.0)
    assert cal.update(loaded)
    again = cal.apply(loaded)
    assert again.stripe_loads(*R2) == (pytest.approx(2.0), 1.0)
    assert again.stripe_loads(*R1) == (pytest.approx(0.7), pytest.approx(0.8))   # its own
    assert again.stripe_loads("x", "y") == (pytest.approx(2.0), 1.0)   # the last, above 1
    with pytest.raises(ConfigError):
        dataclasses.replace(PlannerConfig(), stripe_region_loads=(("a", "b", 0.0, 1.0),)).validate()


def test_stripes_of_plans_solved_before_a_replan_are_not_folded_in(shared_server, profile_dir):
    """A spatial frame whose schedules were solved again while it ran (new load factors):
    its stripe times were predicted under the old factors, so they are dropped, and a new
    table starts the samples over; frames of the current table are folded in."""
    client = _client(shared_server, "agrnav", profile_dir, partition_codecs=("raw",))
    try:
        backend, x, ref, ls, st = _planned(client, seed=5)
        loss = Loss(backend.graph, ls.spatial, st.profile, backend.share_steps)
        plan = solve_grid(loss, 50e6, ls.cfg, spatial_only=True)
        assert plan.spatial
        plan = dataclasses.replace(plan, robot_stripe_s=0.05, server_stripe_s=0.03)   # timeable
        _, c1, c2 = backend.region_of(ls.spatial, plan)
        stale = ls.cfg
        ls.cfg = dataclasses.replace(stale, server_load=stale.server_load * 5)   # solved again
        for _ in range(3):
            backend._calibrate(ls, plan, stale, plan.robot_stripe_s * 3, plan.server_stripe_s * 6)
        assert not ls.calibration.update(ls.cfg)
        assert ls.calibration.total == {"robot": None, "server": None}
        for _ in range(2):
            backend._calibrate(ls, plan, ls.cfg, plan.robot_stripe_s, plan.server_stripe_s * 2)
        ls.calibration.restart()                    # what swapping a new table in does
        backend._calibrate(ls, plan, ls.cfg, plan.robot_stripe_s, plan.server_stripe_s * 2)
        assert ls.calibration.total == {"robot": None, "server": None}
        for _ in range(2):
            backend._calibrate(ls, plan, ls.cfg, plan.robot_stripe_s, plan.server_stripe_s * 2)
        stripe = ls.cfg.stripe_loads(c1.id, c2.id)[1]
        assert ls.calibration.regions[(c1.id, c2.id)]["server"] == pytest.approx(
            2 * ls.cfg.server_load * stripe)
    finally:
        client.close()


def test_a_new_table_carries_the_spatial_schedules_prediction_errors_over(shared_server, profile_dir):
    """The measured choice's measured / predicted ratios of spatial schedules are relative
    to the table that predicted them: the first frame after a new table is swapped in
    moves them onto the new predictions (the layer partitions' stay: their predictions
    did not change), so a schedule measured against predictions made under a stale load
    factor is not ruled out by them."""
    from collections import deque
    client = _client(shared_server, "agrnav", profile_dir, partition_codecs=("raw",))
    try:
        backend, x, ref, ls, st = _planned(client, seed=5)
        assert st.measured is not None
        loss = Loss(backend.graph, ls.spatial, st.profile, backend.share_steps)
        spatial = solve_grid(loss, 50e6, ls.cfg, spatial_only=True)
        assert spatial.spatial
        ls.table = LopTable(ls.table.buckets, [spatial] * len(ls.table.buckets), 0.0)
        lp_key = st.table.plans[0].key
        stats = FrameStats()
        stats.predicted_bandwidth_bps = spatial.bandwidth_bps
        assert_same_up_to_summation_order(backend.infer(x, stats, 120), ref, "agrnav")
        st.measured._error[spatial.key] = deque([(3.0, False), (3.0, False)])
        st.measured._error[lp_key] = deque([(2.0, False), (2.0, False)])

        def ratios(key):
            return [e for e, _contended in st.measured._error[key]][:2]
        stats = FrameStats()
        stats.predicted_bandwidth_bps = spatial.bandwidth_bps
        assert_same_up_to_summation_order(backend.infer(x, stats, 120), ref, "agrnav")
        assert ratios(spatial.key) == [3.0, 3.0]   # the same table
        # a re-plan's table, which predicts the same schedule 3x slower
        again = dataclasses.replace(spatial, latency_s=3 * spatial.latency_s)
        assert again.key == spatial.key
        ls.table = LopTable(ls.table.buckets, [again] * len(ls.table.buckets), 0.0)
        ls.cfg = ls.calibration.apply(st.cfg)          # as solved: no re-plan starts
        stats = FrameStats()
        stats.predicted_bandwidth_bps = spatial.bandwidth_bps
        assert_same_up_to_summation_order(backend.infer(x, stats, 120), ref, "agrnav")
        assert ratios(spatial.key) == [pytest.approx(1.0)] * 2
        assert ratios(lp_key) == [2.0, 2.0]   # (+ this frame's, if it ran)
    finally:
        client.close()


def test_the_replan_thread_alone_runs_at_the_lowest_priority():
    from robot_offload.backends.lop import _lowest_priority_for_this_thread
    seen = {}

    def replan():
        _lowest_priority_for_this_thread()
        seen["replan"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    t = threading.Thread(target=replan)
    t.start()
    t.join()
    assert seen["replan"] == 19
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before


def test_a_slow_robot_stripe_moves_the_split_toward_the_server(shared_server, profile_dir):
    """AGRNav's schedules that end at the outputs (its 3D head). Spatial frames whose robot
    stripe is predicted at an eighth of what it takes (a margin for a profile measured
    while the machine was busier) make the backend solve again with the robot's stripes
    scaled up, and the new schedule gives the robot a smaller share
    (LOSS itself: a robot stripe twice as slow never gets a larger share). The next re-plan
    waits long enough that solving takes at most ``replan_cpu_share`` of the robot's time."""
    client = _client(shared_server, "agrnav", profile_dir, partition_codecs=("raw",))
    try:
        backend, x, ref, ls, st = _planned(client, seed=5)
        loss = Loss(backend.graph, ls.spatial, st.profile, backend.share_steps)
        head = [c for c in loss.candidates() if c.region.last.kind == OUTPUT_CUT]
        base = solve_grid(loss, 50e6, st.cfg, candidates=head, spatial_only=True)
        slow = solve_grid(loss, 50e6, dataclasses.replace(st.cfg, stripe_robot_load=2.0), candidates=head,
                          spatial_only=True)
        assert base.spatial and slow.spatial and slow.share <= base.share
        assert slow.server_stripe_s > 0
        # the robot may get no rows at all (how far the split moves depends on the profile
        # measured on this machine); then it has no stripe to time
        assert (base.robot_stripe_s > 0) == (base.share > 0) and (slow.robot_stripe_s > 0) == (slow.share > 0)
        # half the head's rows on the robot, its stripe predicted at an eighth of its time
        i = max((i for i, rc in enumerate(loss.regions) if rc.region.last.kind == OUTPUT_CUT),
                key=lambda i: len(loss.regions[i].region.nodes))
        half = _spatial_plan(loss, st, i, loss.share_steps // 2, bw=50e6)
        assert half.robot_stripe_s > 0 and half.server_stripe_s > 0
        plan = dataclasses.replace(half, robot_stripe_s=half.robot_stripe_s / 8)
        for _ in range(3):
            y = backend.run_schedule(x, plan, FrameStats(), 120)
            assert_same_up_to_summation_order(y, ref, "agrnav")
        _, c1, c2 = backend.region_of(ls.spatial, plan)
        region = (c1.id, c2.id)
        assert ls.calibration.factor(st.cfg, "robot", region) > 2.0
        backend.replan_cpu_share = 0.01               # a hold-off of 99x the solve's time
        ls = backend.lop_state(x)                     # starts the re-solve
        deadline = time.monotonic() + 60
        while ls.solving and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ls.cfg.stripe_loads(*region)[0] == ls.calibration.factor(st.cfg, "robot", region)
        # A re-plan bounds the robot's time spent solving: the next waits
        # (1 / replan_cpu_share - 1) times as long as this one took.
        assert ls.next_solve_at > time.monotonic()
        ls.calibration.regions[region]["robot"] *= 2
        assert backend.lop_state(x) is ls and not ls.solving
        assert ls.cfg.stripe_loads(*region)[0] != ls.calibration.factor(st.cfg, "robot", region)
        ls.next_solve_at = 0.0
        backend.lop_state(x)
        deadline = time.monotonic() + 60
        while ls.solving and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ls.cfg.stripe_loads(*region)[0] == ls.calibration.factor(st.cfg, "robot", region)
    finally:
        client.close()
