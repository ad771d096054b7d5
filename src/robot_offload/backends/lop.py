"""``lop``: local-operator parallelism with a bandwidth-aware schedule (Intra-DP).

Per input shape the backend takes the layer-partition profile (the client's
:class:`~robot_offload.backends.layer_partition.PartitionKnowledge`: the same graph,
profile, load factors and measured choices as its ``layer_partition``), analyses the
graph's operators (:mod:`robot_offload.partition.spatial`), and solves LOSS for every bandwidth bucket
(:mod:`robot_offload.partition.loss`; plans cached on disk next to the profiles). Per
frame it looks up the schedule for the predicted bandwidth, so plans switch as the
bandwidth changes:

* where no local region pays off, LOSS degrades to layer partitioning and the frame is
  ``layer_partition``'s own (:meth:`~LayerPartitionBackend.partition_frame`: its bucket,
  plan, measured choice and measurements, shared with the client's ``layer_partition``);
* a spatial schedule runs the head to the region's first cut, starts transfer A (the rows
  of the first cut's tensors the server's stripe needs) on a transport worker thread,
  computes the robot's stripe meanwhile, then sends transfer B (the robot's rows of the
  last cut's tensors); the server joins the rows and runs the rest
  (:mod:`robot_offload.server.executors.lop`). Two round trips, overlapped with the
  robot's computation. When the robot joins (LOSS's choice, always when the region
  reaches the model's outputs) there is no B: the server answers A with its rows of the
  last cut's tensors, the robot puts them under its own and runs the rest itself (one
  round trip; only the server's share of those tensors comes down).

With one server a spatial frame is hedged by the robot (:mod:`robot_offload.local_hedge`):
when its transfers are late, or their uploads stall, the robot runs the rest of the model
from the region's first cut on its own tensors, and the first answer wins.

The layer-partition frames lop runs feed the same drift tracker as layer partitioning,
and so do the whole layers of spatial frames (what runs after the join; their stripes do
not: stripe predictions are biased, see ``_run_spatial``, and calibrate the stripes
instead), and the schedules are solved again when the load factors move. A bucket's spatial schedule
and what ``layer_partition`` would consider there (its plan, the best plan at another cut,
all local, full offload) are timed against each other when their predictions are within
``probe_margin`` (layer_partition's measured choice; all local whatever its prediction),
and the fastest serves the bucket.
"""

import concurrent.futures
import logging
import math
import os
import secrets
import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Dict, Optional, Tuple

import torch

from robot_offload import background, codec, structure
from robot_offload.backends.base import register_backend
from robot_offload.backends.layer_partition import (LayerPartitionBackend, _encode, _json,
                                                    frame_codec)
from robot_offload.errors import OffloadTimeout, RemoteError
from robot_offload.link import ANY_SERVER, EVERY_SERVER, HOME_SERVER
from robot_offload.local_hedge import computed_here
from robot_offload.partition.graph import INPUT_CUT, OUTPUT_CUT, Cut
from robot_offload.partition.cost import join_encoding
from robot_offload.partition.loss import LopPlan, LopTable, Loss, held_from, load_or_solve
from robot_offload.partition.planner import PlannerConfig
from robot_offload.partition.profile import DEFAULT_PROFILE_DIR, encoding_key, split_encoding
from robot_offload.partition.spatial import Region, SpatialGraph
from robot_offload.protocol import ComputeRequest, raise_for_status

log = logging.getLogger(__name__)


class StripeCalibration:
    """Measured / predicted time of the stripes that spatial frames run, per region and
    side, folded into the plans' stripe factors (:attr:`PlannerConfig.stripe_region_loads`
    for the regions measured, ``stripe_robot_load`` / ``stripe_server_load`` for the rest).

    A stripe's prediction is the profile's node times scaled by the rows each side
    computes. It misses what a slab costs beyond its share of rows (new slab shapes for
    the kernels, per-node overheads, receiving the server's answer on the robot's CPU
    while the stripe runs), so the split LOSS balances is off by that much: AGRNav's
    robot stripe measured 1.3x its prediction on the testbed, and the robot, given 44 %
    of the rows, finished 200 ms after the server. These factors are kept apart from the
    load factors of the drift tracker (which layer partitions share; see ``_run_spatial``)
    and only scale the stripes, so the schedules are solved again with the split moved
    toward the side that is faster than predicted. The median of the last ``window``
    ratios of a region's side is folded in once it is more than ``threshold`` away from 1,
    after ``min_samples`` frames of the current schedules.

    What is kept is the whole multiple (``total``: a side's measured stripe time over the
    profile's, whatever part of it the drift tracker's load factor explains), and a plan's
    stripe factor is that multiple over the side's load factor of the moment. Keeping only
    the factor on top of the load factor counted the server's speed twice on a machine
    with no saved server times: lop's first spatial frames ran
    under the guess ``server_speedup`` = 10 and their stripe factor took the server's
    real x5 (x4, its bound); layer partitions then measured the server, its load factor
    became x5, and the stripes were predicted at x20. No spatial schedule ran again above
    10 Mbit/s.

    The multiple is kept per region (first and last cut), because what a slab costs
    beyond its rows depends on the region's operators and how thin its stripes are. A
    region whose stripes never ran takes the last multiple measured anywhere, but only
    where it is above the load factor (a stripe is assumed to cost at least its rows'
    share of the layer): one below it would make untried regions look faster than the
    measured one. With a single pooled factor, KAPAO with no saved profile
    (a KAPAO-only run) had its server stripes folded in at x4 (the bound, while the load
    factor was still the guess); once layer partitions put the server at x5, every
    region's server stripes were predicted at 0.8 of the server's speed, LOSS chose a
    region covering nearly the whole model on the server (predicted 252 ms, like a full
    offload measured at 470), and its measured error ruled spatial schedules out for the
    whole indoor trace."""

    def __init__(self, threshold: float = 0.15, window: int = 5, min_samples: int = 3,
                 bounds: Tuple[float, float] = (0.25, 4.0)):
        self.threshold, self.window, self.min_samples, self.bounds = (threshold, window,
                                                                      min_samples, bounds)
        #: side -> the last multiple folded in, any region (measured stripe time / the
        #: profile's; the server's profile: the robot's time / server_speedup, as LOSS
        #: predicts it); None until a side is folded in
        self.total: Dict[str, Optional[float]] = {"robot": None, "server": None}
        #: (first cut id, last cut id) -> side -> that region's own multiple
        self.regions: Dict[Tuple[str, str], Dict[str, Optional[float]]] = {}
        self._ratios: Dict[Tuple[Tuple[str, str], str], deque] = {}

    @staticmethod
    def _load(cfg: PlannerConfig, side: str) -> float:
        """The side's load factor in ``cfg``."""
        return cfg.robot_load if side == "robot" else cfg.server_load

    def restart(self) -> None:
        """Drop the samples: new plans were swapped in (their predictions use other factors)."""
        self._ratios.clear()

    def observe(self, region: Tuple[str, str], side: str, predicted_s: float, measured_s: float,
                contended: bool = False) -> None:
        """A stripe of ``region`` (first and last cut id) on ``side``; left out when
        ``contended`` (timed beside background work on the robot, see
        :mod:`robot_offload.background`)."""
        if predicted_s > 1e-3 and math.isfinite(measured_s) and measured_s >= 0 and not contended:
            self._ratios.setdefault((region, side), deque(maxlen=self.window)).append(
                measured_s / predicted_s)

    def update(self, solved: PlannerConfig) -> bool:
        """Fold in the region sides that moved, against ``solved`` (the configuration the
        observed plans were predicted with); True when the schedules must be solved again
        (the samples then start over: they were relative to these plans). The stripe factor
        stays within ``bounds`` at each step."""
        moved = False
        for (region, side), ratios in self._ratios.items():
            if len(ratios) >= self.min_samples:
                m = statistics.median(ratios)
                if abs(m - 1.0) > self.threshold:
                    stripe = solved.stripe_loads(*region)[0 if side == "robot" else 1]
                    lo, hi = self.bounds
                    total = self._load(solved, side) * min(hi, max(lo, stripe * m))
                    self.regions.setdefault(region, {"robot": None, "server": None})[side] = total
                    self.total[side] = total
                    moved = True
        if moved:
            self.restart()
        return moved

    def factor(self, cfg: PlannerConfig, side: str, region: Optional[Tuple[str, str]] = None) -> float:
        """The stripe factor of ``side`` under ``cfg``'s load factors: ``region``'s own
        when its stripes were measured, else the last measured anywhere, not below 1."""
        load = self._load(cfg, side)
        own = self.regions.get(region, {}).get(side) if region is not None else None
        if own is not None:
            return own / load
        pooled = self.total[side]
        return 1.0 if pooled is None else max(1.0, pooled / load)

    def apply(self, cfg: PlannerConfig) -> PlannerConfig:
        own = tuple((first, last, self.factor(cfg, "robot", (first, last)),
                     self.factor(cfg, "server", (first, last)))
                    for first, last in sorted(self.regions))
        return replace(cfg, stripe_robot_load=self.factor(cfg, "robot"),
                       stripe_server_load=self.factor(cfg, "server"), stripe_region_loads=own)


def _lowest_priority_for_this_thread() -> None:
    """Nice 19 for the calling thread only (Linux applies setpriority to the one thread
    whose id it is given): a background re-plan then takes the robot's CPU only when the
    frames leave it idle, instead of half of a CPU quota beside them."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):      # not Linux, or not allowed: run as is
        pass


def _answer_to(fut, done, deadline: float, transfer: str = "A"):
    """The answer to ``transfer`` (raising its error status) and when it arrived."""
    try:
        resp = fut.result(timeout=max(0.0, deadline - time.perf_counter()))
    except concurrent.futures.TimeoutError:     # not the built-in TimeoutError before Python 3.11
        raise OffloadTimeout(f"lop: the answer to transfer {transfer} did not arrive before the deadline") from None
    raise_for_status(resp.status, resp.status_text)
    return resp, (done[0] if done else time.perf_counter())


@dataclass
class _LopState:
    spatial: SpatialGraph
    loss: Optional[Loss]         # stripe geometry (built lazily, kept across re-plans)
    cfg: PlannerConfig
    table: LopTable
    prepared: bool = False       # the server has its graph and record for this shape
    solving: bool = False        # a re-plan is being solved in the background
    next_solve_at: float = 0.0   # time.monotonic() before which no re-plan starts
    current: Optional[Tuple] = None   # (table, bucket index, plan) in use (hysteresis)
    judged: Optional[LopTable] = None  # the table the measured choice's errors are against
    calibration: StripeCalibration = field(default_factory=StripeCalibration)


@register_backend
class LopBackend(LayerPartitionBackend):
    name = "lop"
    needs_server = True

    #: robot shares LOSS considers: multiples of 1 / share_steps
    share_steps = 16
    #: at most this share of the robot's time goes to solving schedules again: after a
    #: re-plan that took s seconds the next starts no sooner than s * (1 / share - 1)
    #: later. Load factors of a small model under a CPU quota move at every frame (the
    #: testbed's MobileNetV2: a 1.3-3.4 s re-solve every 2 s on a 0.5-CPU robot, its
    #: frames slowed by the solver running beside them).
    replan_cpu_share = 0.1

    def __init__(self, ctx):
        super().__init__(ctx)
        self._lop: Dict[Tuple[int, ...], _LopState] = self.known.lop     # the client's
        self._regions: Dict[Tuple, Tuple[Region, Cut, Cut]] = {}

    # -- schedules ------------------------------------------------------------------------
    def lop_state(self, x: torch.Tensor) -> _LopState:
        """Operator analysis and plan table for ``x``'s shape. The first table is solved
        before the first frame can use it; after a re-plan (new load factors) the table is
        solved again on a background thread and swapped in when ready, so that no frame
        waits for planning (a second or more on a 0.5-CPU robot)."""
        st = self.state(x)
        shape = self.shape_key(x)
        ls = self._lop.get(shape)
        if ls is None:
            metas, _ = self.graph.record(torch.zeros_like(x))
            ls = _LopState(SpatialGraph(self.graph, metas), None, st.cfg, None)
            cfg = ls.calibration.apply(st.cfg)
            self._solve(ls, st, cfg)
            self._lop[shape] = ls
        else:
            cfg = ls.calibration.apply(st.cfg)
            if ls.cfg != cfg and not ls.solving and time.monotonic() >= ls.next_solve_at:
                ls.solving = True
                background.start(lambda: self._solve(ls, st, cfg, False), "lop-replan",
                                 self.replan_cpu_share)
        return ls

    def _solve(self, ls: _LopState, st, cfg: PlannerConfig, cached: bool = True) -> None:
        """Solve (or load from the plan cache) the table for ``cfg``. Re-plans go without
        the cache (``cached=False``, see :func:`load_or_solve`); after one, the next may
        start no sooner than ``replan_cpu_share`` allows."""
        t0 = time.monotonic()
        if not cached:
            _lowest_priority_for_this_thread()
        try:
            if ls.loss is None or ls.loss.profile is not st.profile:
                ls.loss = Loss(self.graph, ls.spatial, st.profile, self.share_steps)
            loss = ls.loss
            directory = self.ctx.config.profile_dir or DEFAULT_PROFILE_DIR
            table = load_or_solve(directory, lambda: loss, st.profile, cfg, self.share_steps,
                                  cached=cached)
            log.info("lop: %d schedules for %s solved in %.2f s (load robot x%.2f, server "
                     "x%.2f; stripes x%.2f, x%.2f, %d regions measured)", len(table.plans),
                     self.ctx.spec.name, table.solve_s, cfg.robot_load, cfg.server_load,
                     cfg.stripe_robot_load, cfg.stripe_server_load, len(cfg.stripe_region_loads))
            ls.table, ls.cfg = table, cfg
            ls.calibration.restart()    # its samples were stripes of the previous plans
        except Exception:  # noqa: BLE001 - a background re-plan must not kill the node
            if ls.table is None:
                raise
            log.exception("lop: re-planning failed; keeping the previous schedules")
        finally:
            if not cached:      # a background re-plan (the first solve blocks its frame)
                now = time.monotonic()
                ls.next_solve_at = now + (now - t0) * (1.0 / self.replan_cpu_share - 1.0)
            ls.solving = False

    def _prepare(self, ls: _LopState, shape, timeout_s: float) -> None:
        """Have the server capture and record the graph at this shape before the first
        spatial frame: it costs the server a whole forward pass, which would otherwise
        fall on that frame (and, with the in-process transport, torch.fx's tracing patches
        nn.Module.__call__ process-wide, so it must not overlap the robot's stripe)."""
        link = self.ctx.link
        link.compute(ComputeRequest(client_id=link.client_id, model=link.model, entry="lop_part",
                                    tensors=[], args_json=_json({"phase": "prepare",
                                                                 "input_shape": list(shape)})),
                     timeout_s, placement=EVERY_SERVER)
        ls.prepared = True

    def region_of(self, spatial: SpatialGraph, plan: LopPlan) -> Tuple[Region, Cut, Cut]:
        key = (id(spatial), plan.first, plan.last)
        r = self._regions.get(key)
        if r is None:
            c1 = (self.graph.input_cut() if plan.first == self.graph.inputs
                  else self.graph.cut(plan.first))
            c2 = self.graph.cut(plan.last)
            r = self._regions[key] = (spatial.region(c1, c2), c1, c2)
        return r

    # -- inference ------------------------------------------------------------------------
    def infer(self, x, stats, timeout_s):
        bw = self.frame_bandwidth(stats)
        profiled_now = self.shape_key(x) not in self._lop
        ls = self.lop_state(x)
        plan = self._sticky(ls, bw)
        st = self.state(x)
        if not plan.spatial:
            # LOSS degraded to layer partitioning here: the frame is layer_partition's own
            # (its bucket, plan, alternatives and measurements), not a second copy of it
            # keyed by LOSS's bucket. The copy probed the same alternatives again in its
            # own buckets and could settle on another cut: lop ran
            # 5-23 % behind layer_partition in 7 cells of MobileNetV2 and RegNetY (30-45
            # ms frames); RegNetY at 10 Mbit/s served a float16 cut at 44 ms against
            # layer_partition's all local at 41.5 ms.
            y, ran = self.partition_frame(x, st, stats, timeout_s, bw, sample=not profiled_now)
            self._as_lop(stats, ran, stats.extra["partition"]["probe"])
            stats.extra["lop"]["timed"] = not profiled_now
            return y
        chosen, probe = plan, False
        table = self.table_of(st)
        j = table.index(bw)
        if st.measured is not None:
            if ls.judged is not ls.table:
                # a new table predicts the spatial schedules anew; done here, on the
                # frame's thread, as the measured choice is not shared with the re-plan thread
                if ls.judged is not None:
                    st.measured.carry_errors(ls.judged.predictions(), ls.table.predictions())
                ls.judged = ls.table
            # LOSS's spatial schedule against what layer_partition would consider in this
            # bucket: its plan and that plan's alternatives (the best plan at another cut,
            # all local, full offload). Measured latency settles the close calls (robot
            # stripes on new slab shapes, a shared server, passive bandwidth estimates:
            # the predictions err most here), so lop is never left on a schedule that
            # layer_partition has measured to be slower than one of these. Keyed by
            # layer_partition's bucket: a layer partition's latency there is the same
            # whichever mode ran it, so what layer_partition's frames measured counts here
            # and lop does not time those candidates again (and the bucket's periodic
            # probes are shared too). Under a key of lop's own, DenseNet-121 (70 ms frames)
            # ran all local and a cut before the classifier (120 ms) in 5 of 34 frames at
            # 100 Mbit/s where layer_partition ran them in 1.
            # The spatial schedule must measure lop_spatial_margin faster than the
            # bucket's best layer partition to be served: where the two are within noise
            # of each other, lop runs what layer_partition runs. Without the margin,
            # MobileNetV2 at 100 Mbit/s served a spatial schedule whose median of three
            # dipped under the input cut's, and the cell ended 1.07x layer_partition.
            chosen, probe = st.measured.choose(
                j, plan, [table.plans[j]] + table.alternatives[j],
                handicap={plan.key: 1.0 + self.ctx.config.lop_spatial_margin})
        # The first run of a schedule sets up kernels for its slab shapes (and the first
        # spatial frame has the server record the graph): not what it costs after, so it
        # is no latency sample. All local is never cold: it is the model's own forward,
        # which every mode's local fallback has run, and a sample wasted on it costs a
        # whole local inference.
        # What this client ran before is warm whichever backend ran it: ``auto`` has a lop
        # of its own, and with a set per backend every layer partition its lop probed
        # was a cold, unsampled run first and had to be probed again (ResNet-101 at
        # 5 Mbit/s: 7 of 30 frames probes at 300-340 ms beside a schedule at 275).
        cold = chosen.key not in st.ran and not getattr(chosen, "link_free", False)
        warm = not profiled_now and not cold and (chosen is not plan or ls.prepared)
        st.ran.add(chosen.key)
        t0 = time.perf_counter()
        if chosen is plan:
            y = self.run_schedule(x, plan, stats, timeout_s, bw, observe_drift=warm)
        else:
            y = self._run_partition(x, chosen, stats, timeout_s, bw)
        if warm and st.measured is not None:
            st.measured.observe(j, chosen, time.perf_counter() - t0, contended=background.contended())
        stats.extra["lop"]["probe"] = probe
        # whether the frame's latency is what the schedule costs (no solving, profiling or
        # first run of new slab shapes in it): ``auto`` times lop by these frames only
        stats.extra["lop"]["timed"] = warm
        if st.measured is not None:
            stats.extra["lop"]["choice"] = st.measured.last
        return y

    def _sticky(self, ls: "_LopState", bw: float) -> LopPlan:
        """The table's plan for ``bw``, with hysteresis: the plan in use is kept while the
        predicted bandwidth stays within one bucket (x1.26) of the one it was chosen for.
        Passive bandwidth estimates are noisy, and a spatial plan with new row counts
        pays for new kernel set-ups the first time it runs (seconds on the robot)."""
        table = ls.table
        i = table.index(bw)
        cur = ls.current
        if cur is not None and cur[0] is table and abs(i - cur[1]) <= 1:
            return cur[2]
        plan = table.plans[i]
        ls.current = (table, i, plan)
        return plan

    def _run_partition(self, x: torch.Tensor, partition, stats, timeout_s: float, bw: float):
        """A layer-partition frame of ``lop`` (the measured choice's pick over a spatial
        schedule, or a schedule without a spatial region run directly), marked as lop's."""
        y = self.run_plan(x, partition, stats, timeout_s, bw)
        self._as_lop(stats, partition)
        return y

    @staticmethod
    def _as_lop(stats, partition, probe: bool = False) -> None:
        """A layer-partition frame's stats marked as one of ``lop``'s."""
        stats.plan = "lop:" + stats.plan
        stats.extra["lop"] = {"schedule": "layer_partition " + partition.describe(), "spatial": False,
                              "predicted_s": partition.latency_s, "probe": probe}

    def run_schedule(self, x: torch.Tensor, plan: LopPlan, stats, timeout_s: float,
                     bandwidth_bps: float = None, observe_drift: bool = True):
        """Run one frame with ``plan`` (any plan of this model's table, or one made by
        :mod:`robot_offload.partition.loss` for this shape). ``observe_drift=False``
        (a schedule's first, cold run): the server's tail time is not recorded either.
        Spatial frames never feed the drift tracker (see :meth:`_run_spatial`)."""
        bw = bandwidth_bps or plan.bandwidth_bps
        if not plan.spatial:
            return self._run_partition(x, plan.partition, stats, timeout_s, bw)
        ls = self.lop_state(x)
        t0 = time.perf_counter()
        if not ls.prepared:
            self._prepare(ls, x.shape, timeout_s)
        try:
            return self._run_spatial(x, ls, plan, stats, timeout_s - (time.perf_counter() - t0), bw,
                                     observe_drift)
        except Exception:
            ls.prepared = False     # the server may have restarted: prepare again
            raise

    def _run_spatial(self, x, ls: _LopState, plan: LopPlan, stats, timeout_s: float, bw: float,
                     observe_drift: bool = True):
        st = self.state(x)
        solved = ls.cfg     # what this frame's stripes are predicted under (see _calibrate)
        sg = ls.spatial
        region, c1, c2 = self.region_of(sg, plan)
        link, cfg = self.ctx.link, self.ctx.config
        stats.plan = plan.describe()
        stats.predicted_latency_s = plan.latency_s
        shape = [int(s) for s in x.shape]
        t0 = time.perf_counter()
        deadline = t0 + timeout_s
        with torch.inference_mode():
            if c1.kind == INPUT_CUT:
                first = {self.graph.inputs[0]: x}
            else:
                first = dict(zip(c1.crossing, self.graph.head_module(c1)(x)))
        robot_rows, server_rows = sg.split_rows(region, plan.share)
        need_r = sg.needs(region, robot_rows)
        need_s = sg.needs(region, server_rows)
        a_parts = {}
        for name in region.inputs:
            if name in need_s:
                a, b = need_s[name]
                a_parts[name] = first[name].narrow(sg.axis(name), a, b - a).contiguous()
        codec_a = frame_codec(plan, st.profile.cut(c1.id), a_parts, st.cfg) if a_parts else plan.codec
        a_tensors = [_encode(t, n, codec_a, plan.compression) for n, t in a_parts.items()]
        frame = secrets.token_hex(8)
        robot_joins = plan.robot_joins or c2.kind == OUTPUT_CUT
        args_a = {"phase": "part", "frame": frame, "first": list(region.inputs),
                  "last": list(region.outputs),
                  "split": {n: server_rows[n][0] for n in region.outputs}, "input_shape": shape}
        # What comes down travels as the client asks for outputs, or, before the outputs
        # (the robot joins at c2, or the server stops at c3), as LOSS priced it.
        outputs = (cfg.output_codec, cfg.compression)
        before_outputs = split_encoding(join_encoding(encoding_key(plan.codec, plan.compression)))
        down = outputs
        if robot_joins and c2.kind != OUTPUT_CUT:
            args_a["join"] = "robot"
            down = before_outputs
        hedge = self._hedge(x, st, c1, first, sg, stats, pair=not robot_joins)
        req_a = ComputeRequest(
            client_id=link.client_id, model=link.model, entry="lop_part", tensors=a_tensors,
            args_json=_json(args_a), output_codec=down[0], output_compression=down[1],
            request_id=secrets.token_hex(8) if hedge else "")
        t_a = time.perf_counter()
        stats.add_compute(t0, t_a)
        # A whose rows the robot joins is the whole frame, so any server may answer it
        # (balanced and hedged in a pool); A of a pair leaves the stripe on its server
        # for B, so both go to the home server.
        fut_a = link.submit(req_a, deadline - t_a, ANY_SERVER if robot_joins else HOME_SERVER)
        a_done = []      # when A's reply arrived: its transfer ends there, not when we look
        fut_a.add_done_callback(lambda _: a_done.append(time.perf_counter()))
        # The robot's stripe, while transfer A is on the wire.
        mine = sg.run(region, need_r, {n: (t, 0) for n, t in first.items()})
        t_stripe = time.perf_counter()
        hedge_key = f"lop:{c1.id}:{c2.id}:{'robot' if robot_joins else 'server'}"
        if robot_joins:
            if hedge is not None:
                y = hedge(hedge_key, [(req_a, fut_a)], t_a, deadline)
                if y is not None:
                    self._hedged(stats, plan, c1, c2, t0, t_a, t_stripe, [req_a])
                    return y
            return self._join_on_robot(ls, st, plan, stats, region, c1, c2, first, mine, robot_rows,
                                      fut_a, a_done, req_a, t0, t_a, t_stripe, deadline, (codec_a, bw),
                                      solved if observe_drift else None)
        b_parts = {}
        for name in region.outputs:
            upto = held_from(need_s, name, sg.rows(name))
            if upto > 0:
                src = first[name] if name in first else mine[name][0]
                b_parts[name] = src.narrow(sg.axis(name), 0, upto).contiguous()
        codec_b = frame_codec(plan, st.profile.cut(c2.id), b_parts, st.cfg) if b_parts else plan.codec
        b_tensors = [_encode(t, n, codec_b, plan.compression) for n, t in b_parts.items()]
        args_b = {"phase": "finish", "frame": frame, "last": list(region.outputs), "input_shape": shape}
        down = outputs
        if plan.until:
            args_b["until"] = list(plan.until)
            down = before_outputs
        req_b = ComputeRequest(
            client_id=link.client_id, model=link.model, entry="lop_part", tensors=b_tensors,
            args_json=_json(args_b), output_codec=down[0], output_compression=down[1],
            request_id=secrets.token_hex(8) if hedge else "")
        t_b = time.perf_counter()
        stats.add_compute(t_a, t_b)
        if hedge is None:
            resp_b = link.compute(req_b, deadline - t_b, placement=HOME_SERVER)
            t_b_done = time.perf_counter()
        else:
            fut_b = link.submit(req_b, deadline - t_b, HOME_SERVER)
            b_done = []
            fut_b.add_done_callback(lambda _: b_done.append(time.perf_counter()))
            y = hedge(hedge_key, [(req_a, fut_a), (req_b, fut_b)], t_a, deadline)
            if y is not None:
                self._hedged(stats, plan, c1, c2, t0, t_a, t_stripe, [req_a, req_b])
                return y
            resp_b, t_b_done = _answer_to(fut_b, b_done, deadline, "B")
        resp_a, t_a_done = _answer_to(fut_a, a_done, deadline)
        t_tail = time.perf_counter()
        if plan.until:
            y = self._robot_tail(plan.until, resp_b, sg)
        else:
            y = structure.unflatten([codec.decode(t) for t in resp_b.tensors], resp_b.structure_json)
        t_end = time.perf_counter()
        # Transfer time = wall time of each call minus the server's whole handling time
        # (B's includes waiting for A's stripe): what the bandwidth monitor divides the
        # bytes by. Compute time is the servers' own.
        stats.add_call(t_a, t_a_done, resp_a.server_total_s or resp_a.server_compute_s,
                       req_a.payload_bytes, 0)
        stats.add_call(t_b, t_b_done, resp_b.server_total_s or resp_b.server_compute_s,
                       req_b.payload_bytes, resp_b.payload_bytes)
        stats.server_compute_s += (resp_a.server_compute_s + resp_b.server_compute_s
                                   - (resp_a.server_total_s or resp_a.server_compute_s)
                                   - (resp_b.server_total_s or resp_b.server_compute_s))
        stats.add_compute(t_b_done, t_end)
        # No drift sample from a stripe: its prediction (each node's profiled time times
        # the share of rows computed) leaves out per-node costs that do not shrink with
        # the rows, so measured / predicted grows as stripes thin, whatever the device's
        # load. Fed to the tracker, that ratio raised the load factors of this backend
        # alone, and its re-plans moved its layer partitions, all local included, off the
        # robot (RegNetY at 100 Mbit/s: lop's layer partition a full offload predicted
        # 54 ms, layer_partition's an all-local-like cut predicted 38 ms). Whether a
        # spatial schedule pays is settled by its measured latency. What runs after the
        # join is whole layers, though: the server's tail (to the outputs, recorded as
        # layer partitioning records it, or to ``until``) and the robot's after
        # ``until`` are drift samples like a layer partition's head and tail, once the
        # schedule is warm. Without them a model whose every lop frame is spatial
        # (KAPAO) kept the ``server_speedup`` guess as its load factor, and its
        # schedules were predicted at 106-206 ms where they measured 320-390 ms.
        if observe_drift:
            tail_s = st.profile.cut(c2.id).tail_s
            drift = False
            if plan.until:
                until_s = st.profile.cut(self.cut_named(plan.until).id).tail_s
                tail_s -= until_s
                drift = st.tracker.observe("robot", until_s, t_end - t_tail,
                                           contended=background.contended())
            else:
                st.profile.record_server_tail(c2.id, resp_b.server_compute_s, device=link.device)
            drift |= st.tracker.observe("server", tail_s / st.cfg.server_speedup, resp_b.server_compute_s)
            if drift:
                self._replan(st)
            # the stripe alone: B's encoding, which follows it, is predicted apart
            self._calibrate(ls, plan, solved, t_stripe - t_a, resp_a.server_compute_s)
        stats.extra["lop"] = {
            "schedule": plan.describe(), "spatial": True, "share": plan.share,
            "first": c1.label, "last": c2.label, "codec": plan.codec,
            "codec_sent": [codec_a, codec_b], "guarded": (codec_a, codec_b) != (plan.codec,) * 2,
            "compression": plan.compression, "bandwidth_bps": bw,
            "predicted_s": plan.latency_s, "actual_s": t_end - t0,
            "bytes_a": req_a.payload_bytes, "bytes_b": req_b.payload_bytes, "join": "server",
            "until": plan.until_label, "robot_tail_s": (t_end - t_tail) if plan.until else 0.0,
            "server_stripe_s": resp_a.server_compute_s, "server_tail_s": resp_b.server_compute_s,
            "robot_stripe_s": t_stripe - t_a, "encode_b_s": t_b - t_stripe,
            "solve_s": ls.table.solve_s, "replans": self.replans}
        return y

    def _hedge(self, x, st, c1: Cut, first, sg: SpatialGraph, stats, pair: bool):
        """The robot's hedge of a spatial frame (:meth:`LocalHedge.race
        <robot_offload.local_hedge.LocalHedge.race>`): ``hedge(key, calls, sent, deadline)``
        returns the outputs of the rest of the model from ``c1`` on the robot's own
        ``first`` tensors (the whole model from the input cut) when the robot finished
        before the server's answers, else None; or None: no hedging (hedging off, or a
        frame the robot joins with several servers: the pool hedges its one request). A
        ``pair`` is bound to the home server, so only the robot can hedge it."""
        local_hedge = self.ctx.home_hedge if pair else self.ctx.local_hedge
        if local_hedge is None:
            return None
        if c1.kind == INPUT_CUT:
            compute = computed_here(self.ctx.model, lambda: [x], stats)
            robot_s = st.profile.forward_s * st.cfg.robot_load
        else:
            tail = self.graph.tail_module(c1)
            compute = computed_here(tail, lambda: [first[n] for n in c1.crossing]
                                    + list(self.graph.static_values(c1, sg.metas)), stats)
            robot_s = st.profile.cut(c1.id).tail_s * st.cfg.robot_load

        def race(key, calls, sent, deadline):
            return local_hedge.race(self.ctx.link, key, calls, sent, deadline - sent, stats, compute,
                                    local_s=robot_s)
        return race

    @staticmethod
    def _hedged(stats, plan: LopPlan, c1: Cut, c2: Cut, t0: float, t_a: float, t_stripe: float,
                requests) -> None:
        """The details of a spatial frame the robot's hedge answered (the server's answers
        were late or their uploads stalled): its outputs are the local model's, from
        ``c1`` on."""
        stats.extra["lop"] = {
            "schedule": plan.describe(), "spatial": True, "share": plan.share,
            "first": c1.label, "last": c2.label, "hedged": True,
            "join": "robot" if len(requests) == 1 else "server",
            "predicted_s": plan.latency_s, "actual_s": time.perf_counter() - t0,
            "bytes_a": requests[0].payload_bytes,
            "bytes_b": requests[1].payload_bytes if len(requests) > 1 else 0,
            "robot_stripe_s": t_stripe - t_a}

    def _robot_tail(self, until, resp, sg: SpatialGraph):
        """The rest of the model from cut ``until``, on the robot, on the tensors the
        server's answer carries (each by name, whole)."""
        c3 = self.cut_named(until)
        got = {t.name: t for t in resp.tensors}
        tensors = []
        for name in c3.crossing:
            enc = got.get(name)
            expected = list(sg.metas[name].shape)
            if enc is None or list(enc.shape) != expected:
                raise RemoteError(f"lop: the server's {name!r} is missing or has shape "
                                  f"{None if enc is None else list(enc.shape)}, not {expected}")
            tensors.append(codec.decode(enc).to(sg.metas[name].dtype))
        return self._tail_here(c3, tensors, sg)

    def _tail_here(self, cut: Cut, tensors, sg: SpatialGraph):
        """The model after ``cut`` on the robot, from its crossing ``tensors``."""
        with torch.inference_mode():
            return self.graph.tail_module(cut)(*tensors, *self.graph.static_values(cut, sg.metas))

    def _calibrate(self, ls: _LopState, plan: LopPlan, solved: PlannerConfig, robot_stripe_s: float,
                   server_stripe_s: float) -> None:
        """A warm spatial frame's stripe times against the plan's predictions, made under
        ``solved``. Dropped when the schedules were solved again while the frame ran:
        its ratio is to factors no longer in use, and folded in against the new ones it
        would move the stripes by the change of the load factor as well. In the first run
        with this module's anchored totals (VGG-19, no saved profile), stripes predicted
        under the ``server_speedup`` guess measured about 6x that (102 ms for 56 % of the
        rows); their samples were folded in after layer_partition's drift had put the
        server's load factor at 4.8, against it, and set the stripes at 19.3x the profile
        (the x4 bound on 4.8). No spatial schedule ran again above 10 Mbit/s."""
        if solved is not ls.cfg:
            return
        _, c1, c2 = self.region_of(ls.spatial, plan)
        ls.calibration.observe((c1.id, c2.id), "robot", plan.robot_stripe_s, robot_stripe_s,
                               contended=background.contended())
        ls.calibration.observe((c1.id, c2.id), "server", plan.server_stripe_s, server_stripe_s)
        if ls.calibration.update(ls.cfg):
            self.replans += 1
            total = ls.calibration.regions.get((c1.id, c2.id), {})
            log.info("lop: stripes of %s -> %s measured off their predictions; solving again "
                     "with them at robot x%s, server x%s of the profile", c1.label, c2.label,
                     *("%.2f" % total[s] if total.get(s) is not None else "-" for s in ("robot", "server")))

    def _join_on_robot(self, ls: _LopState, st, plan: LopPlan, stats, region: Region, c1: Cut, c2: Cut,
                       first, mine, robot_rows, fut_a, a_done, req_a, t0: float, t_a: float, t_r: float,
                       deadline: float, sent, solved: Optional[PlannerConfig]):
        """The end of a frame whose rows the robot joins: the server's answer to A carries
        its rows of every ``c2`` tensor (see :mod:`~robot_offload.server.executors.lop`);
        they go under the robot's own rows and the robot runs the tail after ``c2`` (when
        ``c2`` is the outputs, only their assembly). Nothing is sent after A, and only the
        server's share of ``c2`` comes down."""
        sg = ls.spatial
        stats.add_compute(t_a, t_r)         # the robot's stripe (``t_r``: when it ended)
        resp_a, t_a_done = _answer_to(fut_a, a_done, deadline)
        theirs = {t.name: codec.decode(t) for t in resp_a.tensors}
        joined = []
        for name in c2.crossing:
            if name in region.inputs:           # passes over the region: the robot has it
                joined.append(first[name])
                continue
            ax, s = sg.axis(name), robot_rows[name][1]
            parts = []
            if s > 0:
                t, r0 = mine[name]
                parts.append(t.narrow(ax, -r0, s))
            if s < sg.rows(name):
                part = theirs.get(name)
                expected = list(sg.metas[name].shape)
                expected[ax] = sg.rows(name) - s
                if part is None or list(part.shape) != expected:
                    raise RemoteError(f"lop: the server's rows of {name!r} are missing or have shape "
                                      f"{None if part is None else list(part.shape)}, not {expected}")
                parts.append(part.to(parts[0].dtype) if parts else part)
            joined.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=ax))
        t_join = time.perf_counter()
        y = self._tail_here(c2, joined, sg)
        t_end = time.perf_counter()
        if solved is not None:      # a warm frame
            if c2.kind != OUTPUT_CUT and st.tracker.observe("robot", st.profile.cut(c2.id).tail_s,
                                                            t_end - t_join,
                                                            contended=background.contended()):
                self._replan(st)    # the robot's tail is whole layers (see _run_spatial)
            self._calibrate(ls, plan, solved, t_r - t_a, resp_a.server_compute_s)
        stats.add_call(t_a, t_a_done, resp_a.server_total_s or resp_a.server_compute_s,
                       req_a.payload_bytes, resp_a.payload_bytes)
        stats.add_compute(max(t_r, t_a_done), t_end)
        codec_a, bw = sent
        stats.extra["lop"] = {
            "schedule": plan.describe(), "spatial": True, "share": plan.share,
            "first": c1.label, "last": c2.label, "codec": plan.codec,
            "codec_sent": [codec_a], "guarded": codec_a != plan.codec,
            "compression": plan.compression, "bandwidth_bps": bw,
            "predicted_s": plan.latency_s, "actual_s": t_end - t0,
            "bytes_a": req_a.payload_bytes, "bytes_b": 0, "bytes_down": resp_a.payload_bytes,
            "join": "robot",
            "server_stripe_s": resp_a.server_compute_s, "server_tail_s": 0.0,
            "robot_tail_s": t_end - t_join,
            "robot_stripe_s": t_r - t_a, "solve_s": ls.table.solve_s,
            "replans": self.replans}
        return y
