"""Planner (pure arithmetic on synthetic profiles), drift tracking, and profiles: measured
on a small model, cached on disk, refreshed on request."""

import json
import math
import os

import pytest
import torch
from torch import nn

from robot_offload.errors import ConfigError
from robot_offload.partition import profile as prof
from robot_offload.partition.graph import capture
from robot_offload.partition.choice import MeasuredChoice
from robot_offload.partition.planner import (DriftTracker, PlannerConfig, weighted_median,
                                             weighted_quantile,
                                             PlanTable, bandwidth_buckets, best_plan, options,
                                             output_error_bound)
from robot_offload.partition.cost import MISSED_DEADLINE_J, objective_cost, predict_cut
from robot_offload.partition.profile import CutProfile, Profile, output_error

pytestmark = pytest.mark.robot_side

MB = 1e6


def _profile(**kw):
    """Three cuts: everything on the server, a small tensor after 30 ms, everything local.
    100 ms of robot compute in all; 4000 output bytes."""
    raw = {"raw/none": 600_000.0, "raw/zstd": 500_000.0, "int8/none": 150_000.0, "int8/zstd": 90_000.0}
    mid = {"raw/none": 40_000.0, "raw/zstd": 30_000.0, "int8/none": 10_000.0, "int8/zstd": 6_000.0}
    cuts = [
        CutProfile("input", "input", ["x"], "input (all on server)", 0.0, 0.100, 600_000, True,
                   raw, dict.fromkeys(raw, 0.001), {"int8": 0.002}),
        CutProfile("a,b", "inner", ["a", "b"], "after b (2 tensors)", 0.030, 0.070, 40_000, True,
                   mid, dict.fromkeys(mid, 0.0005), {"int8": 0.004}),
        CutProfile("c", "inner", ["c"], "after c (1 tensor)", 0.050, 0.050, 30_000, False),
        CutProfile("output", "output", ["y"], "output (all on robot)", 0.100, 0.0, 0, True,
                   dict.fromkeys(raw, 0.0), dict.fromkeys(raw, 0.0)),
    ]
    d = dict(model="m", key="k", weights_hash="w", machine={}, input_shape=[1, 3, 8, 8],
             traced=True, trace_error="", codecs=["raw", "int8"], compressions=["none", "zstd"],
             forward_s=0.100, output_leaves=[(1000, "float32")], cuts=cuts)
    d.update(kw)
    return Profile(**d)


def test_buckets_are_log_spaced_over_1_to_200_mbit():
    b = bandwidth_buckets()
    assert len(b) == 24 and b[0] == pytest.approx(1e6) and b[-1] == pytest.approx(200e6)
    ratios = [y / x for x, y in zip(b, b[1:])]
    assert max(ratios) == pytest.approx(min(ratios))
    with pytest.raises(ConfigError):
        bandwidth_buckets(10e6, 1e6)


def test_latency_and_energy_model_by_hand():
    p = _profile()
    cfg = PlannerConfig(server_speedup=10.0, rtt_s=0.002)
    c = p.cut("a,b")
    pr = predict_cut(p, c, "int8/zstd", 8 * MB, cfg)
    up, down, server = 6_000 * 8 / 8e6, 4_000 * 8 / 8e6, 0.070 / 10
    assert pr.latency_s == pytest.approx(0.030 + 0.0005 + up + 0.002 + server + down)
    assert pr.energy_j == pytest.approx(13.35 * 0.0305 + 4.25 * (up + down) + 4.04 * (0.002 + server))
    local = predict_cut(p, p.cut("output"), "raw/none", 8 * MB, cfg)
    assert local.latency_s == pytest.approx(0.100) and local.energy_j == pytest.approx(1.335)
    assert local.bytes_up == 0 and local.bytes_down == 0
    # The robot's load factor scales robot times; a measured server time replaces the estimate.
    slow = predict_cut(p, c, "int8/zstd", 8 * MB, PlannerConfig(robot_load=2.0))
    assert slow.head_s == pytest.approx(0.060)
    p.record_server_tail("a,b", 0.5)
    assert predict_cut(p, c, "int8/zstd", 8 * MB, cfg).server_s == pytest.approx(0.5)
    with pytest.raises(ConfigError):
        predict_cut(p, c, "int4/zstd", 8 * MB, cfg)     # not measured


def test_plan_follows_the_bandwidth():
    table = PlanTable(_profile(), PlannerConfig(error_tolerance=0.0))
    kinds = [p.kind for p in table.plans]
    assert kinds[0] == "output" and kinds[-1] == "input" and "inner" in kinds
    # monotone: once offloading wins, more bandwidth never brings the work back
    order = {"output": 0, "inner": 1, "input": 2}
    assert [order[k] for k in kinds] == sorted(order[k] for k in kinds)
    assert all(p.codec == "raw" for p in table.plans)          # lossless only at tolerance 0
    assert "c" not in table.chosen_cuts()                      # not a candidate
    # lookup: the highest bucket not above the prediction; clamped outside the range
    assert table.lookup(0.1 * MB) is table.plans[0]
    assert table.lookup(1e12) is table.plans[-1]
    assert table.lookup(float("nan")) is table.plans[0]
    for b, plan in zip(table.buckets, table.plans):
        assert table.lookup(b) is plan
        assert table.lookup(b * 1.01) is plan
    assert len(table.rows()) == 24 and "cut=" in table.rows()[0]["plan"]


def test_error_tolerance_gates_lossy_codecs():
    p = _profile()
    # int8 errors: 0.002 at the input, 0.004 at the inner cut; the safety factor is 2.
    allowed = {(c.id, e) for c, e, _ in options(p, PlannerConfig(error_tolerance=0.005))}
    assert ("input", "int8/zstd") in allowed and ("a,b", "int8/zstd") not in allowed
    allowed = {(c.id, e) for c, e, _ in options(p, PlannerConfig(error_tolerance=0.008))}
    assert ("a,b", "int8/zstd") in allowed
    plan = best_plan(p, 8 * MB, PlannerConfig(error_tolerance=0.01))
    assert plan.codec == "int8" and plan.error <= 0.01 / 2
    assert plan.describe().startswith("cut=") and "int8/zstd" in plan.describe()
    # restricting the encodings
    plan = best_plan(p, 8 * MB, PlannerConfig(error_tolerance=0.01, encodings=("raw/none",)))
    assert plan.encoding == "raw/none" or plan.kind == "output"


def test_output_codec_error_counts_against_the_tolerance():
    """The tolerance is on what the backend returns: the server's lossy output encoding
    adds its own (known, bounded) error to the activation codec's."""
    p = _profile()      # int8 error at the input: 0.002

    def allowed(**kw):
        return {(c.id, e) for c, e, _ in options(p, PlannerConfig(error_tolerance=0.005, **kw))}
    assert ("input", "int8/zstd") in allowed()
    assert output_error_bound("raw") == 0.0
    assert output_error_bound("float16") == 2.0 ** -11
    assert 1 / 255 < output_error_bound("int8") < 1.01 / 255
    # int8 outputs add up to 1/255 of max|y|: 2 * 0.002 + 0.0039 > 0.005; lossless stays
    assert ("input", "int8/zstd") not in allowed(output_codec="int8")
    assert ("input", "raw/none") in allowed(output_codec="int8")
    # float16 outputs add 2**-11: 2 * 0.002 + 0.00049 <= 0.005
    assert ("input", "int8/zstd") in allowed(output_codec="float16")
    # an output codec alone beyond the tolerance leaves only the local plan
    assert {c for c, _ in allowed(output_codec="int4")} == {"output"}


def test_energy_objective_offloads_where_latency_does_not():
    p = _profile()
    # At 2 Mbit/s the inner cut takes 175 ms against 100 ms locally, but while the robot
    # waits and transmits it draws 4 W instead of 13 W.
    lat = best_plan(p, 2 * MB, PlannerConfig(error_tolerance=0.0))
    en = best_plan(p, 2 * MB, PlannerConfig(objective="energy", error_tolerance=0.0))
    assert lat.cut_id == "output" and en.cut_id == "a,b"
    assert lat.prediction.latency_s < en.prediction.latency_s
    assert en.prediction.energy_j < lat.prediction.energy_j


def test_deadline_objective_spends_the_fewest_joules_that_meet_it():
    p = _profile()
    # At 2 Mbit/s: all local 100 ms, the inner cut 175 ms at a fraction of the joules.
    lat = best_plan(p, 2 * MB, PlannerConfig(error_tolerance=0.0)).prediction
    en = best_plan(p, 2 * MB, PlannerConfig(objective="energy", error_tolerance=0.0)).prediction
    assert lat.latency_s < 0.15 < en.latency_s < 0.2 and en.energy_j < lat.energy_j
    for deadline_s, cut in ((0.2, "a,b"),       # both meet it: the fewer joules
                            (0.15, "output"),   # only all local meets it
                            (0.05, "output")):  # none does: the fastest
        plan = best_plan(p, 2 * MB, PlannerConfig(objective="deadline", deadline_s=deadline_s,
                                                  error_tolerance=0.0))
        assert plan.cut_id == cut, (deadline_s, plan.cut_id)
    # the cost itself: joules when met, and past the deadline more than any frame's joules,
    # ordered by latency; arrays as scalars
    np = pytest.importorskip("numpy")
    cfg = PlannerConfig(objective="deadline", deadline_s=0.1)
    lat_s, en_j = np.array([0.05, 0.1, 0.11, 0.5]), np.array([40.0, 0.2, 0.1, 0.1])
    cost = objective_cost(cfg, lat_s, en_j, np.where)
    assert list(cost) == [objective_cost(cfg, t, e) for t, e in zip(lat_s, en_j)]
    assert list(cost[:2]) == [40.0, 0.2] and cost[1] < cost[0] < cost[2] < cost[3]
    assert cost[2] == pytest.approx(MISSED_DEADLINE_J * 1.1)
    assert objective_cost(PlannerConfig(), 0.3, 2.0) == 0.3
    assert objective_cost(PlannerConfig(objective="energy"), 0.3, 2.0) == 2.0


def test_planner_config_is_validated():
    for bad in (dict(objective="speed"), dict(deadline_s=0), dict(error_tolerance=-1), dict(server_speedup=0),
                dict(rtt_s=-1), dict(robot_load=0), dict(output_codec="jpeg"),
                dict(buckets=(2e6, 1e6)), dict(error_safety=0.5)):
        with pytest.raises(ConfigError):
            PlannerConfig(**bad).validate()


def test_alternatives_are_another_cut_local_and_full_offload():
    table = PlanTable(_profile(), PlannerConfig())
    for b, plan, alts in zip(table.buckets, table.plans, table.alternatives):
        assert alts and all(a.cut_id != plan.cut_id for a in alts)
        assert len({a.key for a in alts}) == len(alts)
        assert all(a.latency_s >= plan.latency_s for a in alts)
        kinds = {a.kind for a in alts}
        assert (plan.kind == "output") != ("output" in kinds) and (plan.kind == "input") != ("input" in kinds)
        assert table.lookup(b) is plan and table.plans[table.index(b * 1.01)] is plan
    assert table.index(0.5 * table.buckets[0]) == 0 and table.index(1e12) == len(table.plans) - 1


def test_measured_choice_settles_close_calls_by_measurement():
    table = PlanTable(_profile(), PlannerConfig())
    i = table.index(20 * MB)
    plan, alt = table.plans[i], table.alternatives[i][0]
    m = MeasuredChoice(margin=10.0, every=4, window=3, min_samples=2)
    latency = {plan.cut_id: 0.050, alt.cut_id: 0.020}     # the alternative is really faster
    ran, reasons = [], []
    for _ in range(14):
        p, probe = m.choose(i, plan, [alt])
        ran.append(("alt" if p is alt else "plan", probe))
        reasons.append(m.last["reason"])
        m.observe(i, p, latency[p.cut_id])
    # each frame says why it ran what it ran, with the medians it was judged on
    assert reasons[:4] == ["planned", "probe: fewer than min_samples", "probe: fewer than min_samples",
                           "fastest measured"], reasons
    assert reasons[7] == "probe: periodic", reasons
    assert m.last["medians_ms"] == {plan.describe(): 50.0, alt.describe(): 20.0}, m.last
    # the plan first; the alternative as a probe (now the faster); the plan's second
    # sample as a probe; then the faster one, with a probe of the other every 4 frames
    assert ran == ([("plan", False), ("alt", True), ("plan", True)] + [("alt", False)] * 4
                   + [("plan", True)] + [("alt", False)] * 4 + [("plan", True)] + [("alt", False)]), ran
    assert m.probes == 4 and m.median_s(i, alt) == 0.020 and m.median_s(i, plan) == 0.050
    # Several alternatives: each is timed, the fastest serves, periodic probes take turns.
    j = table.index(5 * MB)
    plan2, alts = table.plans[j], table.alternatives[j]
    assert len(alts) >= 2
    truth = {a.key: 0.030 + 0.010 * k for k, a in enumerate(alts)}
    truth[plan2.key] = 0.100
    m2 = MeasuredChoice(margin=1e9, every=3, window=3, min_samples=1)
    served = []
    for _ in range(20):
        p, probe = m2.choose(j, plan2, alts)
        served.append((p.key, probe))
        m2.observe(j, p, truth[p.key])
    assert all(m2.median_s(j, a) is not None for a in alts)
    assert [k for k, probe in served[-8:] if not probe] == [alts[0].key] * sum(not pr for _, pr in served[-8:])
    assert {k for k, probe in served[len(alts) + 1:] if probe} >= {plan2.key} | {a.key for a in alts[1:]}
    # Not a close call (runner-up predicted beyond the margin): the plan, never probed.
    far = MeasuredChoice(margin=0.0)
    if alt.latency_s > plan.latency_s:
        assert [far.choose(i, plan, [alt]) for _ in range(5)] == [(plan, False)] * 5
    assert far.choose(i, plan, []) == (plan, False)
    with pytest.raises(ConfigError):
        MeasuredChoice(window=1, min_samples=2)


def test_measured_choice_times_all_local_once_for_every_bucket():
    """All local crosses no link, so its measurements in one bucket serve the others: a
    bandwidth estimate hopping to a new bucket does not make it a probe again there."""
    table = PlanTable(_profile(), PlannerConfig())
    pairs = []
    for i in range(len(table.plans)):
        local = [a for a in table.alternatives[i] if a.kind == "output"]
        if table.plans[i].kind != "output" and local:
            pairs.append((i, table.plans[i], local[0]))
    assert len(pairs) >= 2, "need two buckets that offload with all local as the alternative"
    (i, plan_i, local), (j, plan_j, _) = pairs[0], pairs[-1]
    m = MeasuredChoice(margin=1e9, every=100, window=3, min_samples=2)
    for _ in range(4):
        p, _probe = m.choose(i, plan_i, [local])
        m.observe(i, p, 0.020 if p.kind == "output" else 0.050)
    assert m.median_s(j, local) == 0.020            # measured in bucket i, known in j
    ran = []
    for _ in range(3):
        p, probe = m.choose(j, plan_j, [local])
        ran.append(("local" if p.kind == "output" else "plan", probe))
        m.observe(j, p, 0.020 if p.kind == "output" else 0.050)
    # The bucket's own plan gets its samples; all local is never a probe here (kept per
    # bucket, it would be: plan, local as a probe, plan as a probe, then local).
    assert ran == [("plan", False), ("plan", True), ("local", False)], ran
    # An offloading plan's measurements stay in their bucket.
    assert m.median_s(i, plan_i) is not None and m.median_s(j + 1000, plan_i) is None


def test_measured_choice_times_all_local_whatever_its_prediction():
    """All local predicted beyond the margin is still timed (``min_samples`` frames, once
    for every bucket): served if it measures faster, never run again if it measures
    slower. Other alternatives beyond the margin are timed only once the plan measures
    slower than they are predicted."""
    table = PlanTable(_profile(), PlannerConfig())
    for i in range(len(table.plans)):
        plan = table.plans[i]
        local = [a for a in table.alternatives[i] if a.link_free]
        other = [a for a in table.alternatives[i] if not a.link_free]
        if plan.kind != "output" and local and other:
            local, other = local[0], other[0]
            break
    else:
        pytest.fail("need a bucket that offloads, with all local and another alternative")
    assert local.latency_s > plan.latency_s and other.latency_s > plan.latency_s
    for local_s, expect_served in ((0.020, True), (0.200, False)):
        m = MeasuredChoice(margin=0.0, every=3, window=3, min_samples=2)
        assert not m.close_call(plan, local) and not m.close_call(plan, other)
        ran = []
        for _ in range(12):
            p, probe = m.choose(i, plan, [local, other])
            ran.append(("local" if p is local else "plan" if p is plan else "other", probe))
            m.observe(i, p, local_s if p is local else 0.050)
        assert ("other", True) not in ran and ("other", False) not in ran, ran
        if expect_served:
            # the plan, all local as a probe (now the faster), the plan's second sample
            # as a probe, then all local served, with a probe of the plan every 3 frames
            assert ran[:3] == [("plan", False), ("local", True), ("plan", True)], ran
            assert ran[-1] == ("local", False) and m.median_s(i, local) == local_s
            assert sum(r == ("local", False) for r in ran) >= 6, ran
        else:
            # timed once (4x the plan's median: far slower, see
            # test_a_probe_measured_far_slower_is_not_probed_again), then dropped: no
            # periodic probe of it ever after
            assert [r for r in ran if r[0] == "local"] == [("local", True)], ran
            assert ran[-4:] == [("plan", False)] * 4, ran
    # Predicted beyond the margin and not link-free: not a candidate while the plan
    # measures no slower than the alternative is predicted...
    m = MeasuredChoice(margin=0.0, min_samples=1)
    m.observe(i, plan, other.latency_s)
    assert not m.candidate(i, plan, other) and m.candidate(i, plan, local)
    # ... and one once it does (the prediction that ruled it out was wrong): timed as a
    # probe, then served if it measures faster.
    m = MeasuredChoice(margin=0.0, every=100, min_samples=1)
    m.observe(i, plan, 2 * other.latency_s)
    assert m.candidate(i, plan, other)
    assert m.choose(i, plan, [other]) == (other, True)
    m.observe(i, other, other.latency_s)
    assert m.choose(i, plan, [other]) == (other, False)


def _two_buckets_sharing_plans():
    """A plan table and two of its buckets i < j with the same plan and a common
    alternative, both crossing the link: (table, i, j, plan_i, plan_j, alt_i, alt_j)."""
    table = PlanTable(_profile(), PlannerConfig())
    for i in range(len(table.plans)):
        for j in range(i + 1, len(table.plans)):
            if table.plans[i].key == table.plans[j].key and not table.plans[i].link_free:
                common = ({a.key for a in table.alternatives[i] if not a.link_free}
                          & {a.key for a in table.alternatives[j]})
                if common:
                    key = min(common)
                    alt_i = next(a for a in table.alternatives[i] if a.key == key)
                    alt_j = next(a for a in table.alternatives[j] if a.key == key)
                    return table, i, j, table.plans[i], table.plans[j], alt_i, alt_j
    pytest.fail("need two buckets with the same plan and a common alternative")


def test_measured_choice_carries_prediction_errors_to_new_buckets():
    """What a plan measured against its prediction in one bucket corrects its prediction in
    the next: an alternative that measured far slower than predicted is no probe in a new
    bucket, one that measured faster still is (MeasuredChoice.ruled_out)."""
    table, i, j, plan_i, plan_j, alt_i, alt_j = _two_buckets_sharing_plans()
    for rel in (1.3, 0.8):          # alt's corrected prediction in j, relative to the plan's
        alt_error = rel * plan_j.latency_s / alt_j.latency_s
        m = MeasuredChoice(margin=1e9, every=100, window=3, min_samples=2, known_margin=0.10)
        truth = {plan_i.key: 1.0, alt_i.key: alt_error}     # measured / predicted
        for _ in range(6):
            p, _probe = m.choose(i, plan_i, [alt_i])
            m.observe(i, p, p.latency_s * truth[p.key])
        assert m.median_s(i, alt_i) is not None and m.median_s(j, alt_j) is None
        assert m.corrected_s(alt_j) == pytest.approx(alt_j.latency_s * alt_error)
        # alt predicted within ``margin`` (huge here): a candidate unless ruled out, i.e.
        # unless its corrected prediction is over known_margin slower than the plan's
        expected = rel <= 1.10
        assert m.ruled_out(plan_j, alt_j) == (not expected)
        assert m.candidate(j, plan_j, alt_j) == expected
        ran = []
        for _ in range(3):
            p, probe = m.choose(j, plan_j, [alt_j])
            ran.append((p.key == alt_j.key, probe))
            m.observe(j, p, p.latency_s * truth[p.key])
        assert any(a for a, _ in ran) == expected, ran
    # measured in this bucket already (and faster than the plan here): a candidate whatever
    # the corrected predictions say, so that its latency here decides
    m = MeasuredChoice(margin=1e9, every=100, window=3, min_samples=2, known_margin=0.10)
    for _ in range(2):
        m.observe(i, plan_i, plan_i.latency_s)
        m.observe(i, alt_i, alt_i.latency_s * 3 * plan_i.latency_s / alt_i.latency_s)
    m.observe(j, alt_j, 0.5 * plan_j.latency_s)
    assert m.ruled_out(plan_j, alt_j) and m.candidate(j, plan_j, alt_j)
    m.observe(j, plan_j, plan_j.latency_s)
    m.observe(j, plan_j, plan_j.latency_s)
    assert m.choose(j, plan_j, [alt_j]) == (alt_j, False)    # measured faster here: served
    # errors known for one side only: the margin decides as before
    m = MeasuredChoice(margin=1e9, min_samples=2)
    m.observe(i, alt_i, alt_i.latency_s * 3)
    m.observe(i, alt_i, alt_i.latency_s * 3)
    assert m.corrected_s(plan_i) is None and not m.ruled_out(plan_i, alt_i)
    with pytest.raises(ConfigError):
        MeasuredChoice(known_margin=-0.1)


def test_drift_tracker_replans_after_sustained_drift():
    t = DriftTracker(threshold=0.3, min_samples=3)
    assert not any(t.observe("robot", 0.010, 0.011) for _ in range(5))    # 10 %: noise
    t.accept()
    fired = [t.observe("robot", 0.010, 0.030) for _ in range(4)]
    assert fired == [False, False, True, True] and t.ratio["robot"] > 2
    factors = t.accept()
    cfg = t.apply(PlannerConfig())
    assert cfg.robot_load == factors["robot"] > 2 and cfg.server_load == 1.0
    assert not any(t.observe("robot", 0.010, 0.010 * factors["robot"]) for _ in range(4))
    assert not t.observe("server", 0.0, 1.0)                             # nothing to compare
    with pytest.raises(ConfigError):
        t.observe("moon", 1, 1)


def test_drift_tracker_leaves_out_samples_timed_beside_background_work():
    t = DriftTracker(threshold=0.3, min_samples=3)
    assert not any(t.observe("robot", 0.010, 0.030, contended=True) for _ in range(6))
    assert t.ratio["robot"] == 1.0 and t.samples["robot"] == 0
    assert [t.observe("robot", 0.010, 0.030) for _ in range(3)] == [False, False, True]


def test_measured_choice_drops_samples_timed_beside_background_work_when_it_ends():
    """The testbed's AGRNav at 20 Mbit/s: while re-planning ran in the background, all
    local measured 1.5 s and the offloading plan 1.45 s, so the plan served; once the
    background work ended, all local took 1.2 s, but the plan kept serving on the old
    samples until a periodic probe. Now the first frame without background work drops
    them, and all local is timed again at once."""
    table = PlanTable(_profile(), PlannerConfig())
    i = next(k for k, p in enumerate(table.plans)
             if p.kind != "output" and any(a.kind == "output" for a in table.alternatives[k]))
    plan = table.plans[i]
    local = next(a for a in table.alternatives[i] if a.kind == "output")

    def run(m, frames, contended, latency):
        served = []
        for _ in range(frames):
            p, _probe = m.choose(i, plan, [local])
            served.append("local" if p is local else "plan")
            m.observe(i, p, latency[p.key], contended=contended)
        return served

    during = {plan.key: 1.45, local.key: 1.50}
    after = {plan.key: 1.45, local.key: 1.20}
    m = MeasuredChoice(margin=1e9, every=20, window=3, min_samples=2)
    assert run(m, 8, True, during)[-3:] == ["plan"] * 3
    served = run(m, 8, False, after)
    # the plan's frame that found no background (its sample kept), then both timed again
    # (fewer than min_samples), then all local served from then on
    assert served == ["plan", "local", "plan"] + ["local"] * 5, served
    assert m.median_s(i, local) == pytest.approx(1.20)
    # without the flag, the old samples decided until the periodic probe
    old = MeasuredChoice(margin=1e9, every=20, window=3, min_samples=2)
    run(old, 8, False, during)
    assert run(old, 8, False, after) == ["plan"] * 8
    # the error ratios go too: corrected predictions start again from clean frames
    assert all(not c for d in m._error.values() for _e, c in d)


def test_a_schedule_never_measured_is_corrected_by_its_groups_errors():
    """AGRNav on the indoor trace: a bucket reached for the first time ran its spatial
    schedule (predicted 0.84 s) in 3.4 s, beside a layer partition measured at 0.85 s,
    after another spatial schedule had measured 1.8x its prediction. Spatial schedules
    are one error group: the new one is corrected by the other's errors, so the layer
    partition leads the bucket and the schedule is not even a probe."""
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class P:
        key: str
        latency_s: float
        error_group: object = None

    m = MeasuredChoice(margin=0.25, every=100, window=3, min_samples=2, known_margin=0.10)
    old = P("spatial-a", 1.13, "spatial")
    cut = P("cut", 0.85)
    for _ in range(2):
        m.observe(0, old, 2.04)
        m.observe(0, cut, 0.85)
    new = P("spatial-b", 0.84, "spatial")
    assert m.corrected_s(new) == pytest.approx(0.84 * 2.04 / 1.13)
    chosen, probe = m.choose(5, new, [cut])
    assert chosen is cut and not probe and m.last["reason"] == "lead", m.last
    # no group: uncorrected, it runs as planned
    lone = P("other", 0.84)
    assert m.corrected_s(lone) is None
    assert m.choose(6, lone, [cut]) == (lone, False)
    # its own frames, once it has them, count over the group's
    m.observe(7, new, 0.80)
    m.observe(7, new, 0.82)
    assert m.corrected_s(new) == pytest.approx(0.84 * (0.80 + 0.82) / 2 / 0.84)


def test_drift_tracker_weighs_short_work_against_the_whole_forward():
    """Short heads that run faster than profiled (a burst under a CPU quota) are no load
    change: they count by their share of the forward, so the forwards decide; one throttled
    frame moves a median no more than it should; a real slowdown of the whole forward
    still re-plans after min_samples forwards."""
    fwd = 0.100
    t = DriftTracker(threshold=0.3, min_samples=3, reference_s={"robot": fwd, "server": fwd / 5})
    assert t.weight("robot", 0.020) == pytest.approx(0.2) and t.weight("robot", 0.5) == 1.0
    fired = []
    for _ in range(6):
        fired.append(t.observe("robot", fwd, fwd * 1.02))
        fired += [t.observe("robot", 0.020, 0.020 * 0.35) for _ in range(3)]
    assert not any(fired) and t.ratio["robot"] == pytest.approx(1.02)
    assert t.samples["robot"] == 24 and t.evidence["robot"] == pytest.approx(6 * 1.6)
    assert not t.observe("robot", fwd, fwd * 2.5)                        # one throttled frame
    assert t.ratio["robot"] == pytest.approx(1.02)
    # the same short heads alone, as many as three forwards' worth, do move it
    u = DriftTracker(threshold=0.3, min_samples=3, reference_s={"robot": fwd})
    fired = [u.observe("robot", 0.020, 0.020 * 0.35) for _ in range(15)]
    assert fired.index(True) == 14 and u.ratio["robot"] == pytest.approx(0.35)
    # a real slowdown: three whole forwards at 1.6x
    t.accept()
    fired = [t.observe("robot", fwd, fwd * 1.6) for _ in range(4)]
    assert fired == [False, False, True, True] and t.ratio["robot"] == pytest.approx(1.6)
    with pytest.raises(ConfigError):
        DriftTracker(min_samples=3, window=2)


def test_drift_tracker_does_not_hop_between_two_clusters_of_ratios():
    """Whole forwards throttled once or twice under a CPU quota: ratios 0.7 and 1.4 in
    turn, in runs of two. The median hops between the clusters; the planned factor stays
    inside the samples' interquartile range, so nothing is re-planned."""
    fwd = 0.020
    t = DriftTracker(threshold=0.3, min_samples=3, reference_s={"robot": fwd})
    fired = [t.observe("robot", fwd, fwd * r) for r in [0.7, 0.7, 1.4, 1.4] * 10]
    assert not any(fired)
    t.ratio["robot"] = 1.4                       # where a median of the last four can be
    assert not t.drifted("robot")
    # a real change: every forward now takes 2.5x
    fired = [t.observe("robot", fwd, fwd * 2.5) for _ in range(4)]
    assert fired[-1] and t.ratio["robot"] == pytest.approx(2.5)


def test_drift_tracker_replan_of_one_side_keeps_the_other_sides_factor():
    t = DriftTracker(threshold=0.3, min_samples=3)
    for r in (1.2, 1.2, 1.2):           # the robot: 20 % off, within the threshold
        assert not t.observe("robot", 0.010, 0.010 * r)
    assert not t.observe("server", 0.010, 0.030) and not t.observe("server", 0.010, 0.030)
    assert t.observe("server", 0.010, 0.030)
    factors = t.accept()
    assert factors == {"robot": 1.0, "server": pytest.approx(3.0)}
    assert t.evidence["robot"] == 3.0 and t.evidence["server"] == 0.0
    # with no side drifted (a forced re-plan) every side takes its ratio
    assert t.accept() == {"robot": pytest.approx(1.2), "server": pytest.approx(3.0)}


def test_weighted_median():
    assert weighted_median([(1.0, 1.0), (3.0, 1.0), (2.0, 1.0)]) == 2.0
    assert weighted_median([(1.0, 1.0), (3.0, 1.0)]) == 2.0
    assert weighted_median([(1.0, 0.2), (3.0, 1.0), (0.5, 0.2)]) == 3.0
    assert weighted_median([(5.0, 0.1)]) == 5.0
    assert weighted_quantile([(1.0, 1.0), (2.0, 1.0), (3.0, 1.0), (4.0, 1.0)], 0.25) == 1.5
    assert weighted_quantile([(1.0, 1.0), (2.0, 1.0), (3.0, 1.0), (4.0, 1.0)], 0.9) == 4.0


def test_output_error():
    y = {"a": torch.tensor([1.0, -2.0]), "b": [torch.tensor([3, 4])]}
    assert output_error(y, y) == 0.0
    z = {"a": torch.tensor([1.0, -2.1]), "b": [torch.tensor([3, 4])]}
    assert output_error(z, y) == pytest.approx(0.05)
    assert math.isinf(output_error({"a": y["a"], "b": [torch.tensor([3, 5])]}, y))
    assert math.isinf(output_error([y["a"]], y))
    assert math.isinf(output_error(torch.tensor([float("nan"), 1.0]), torch.tensor([1.0, 1.0])))


# --- profiles of a real (small) graph ----------------------------------------------------
class _Small(nn.Module):
    """A residual conv net small enough to profile in a blink."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.c2 = nn.Conv2d(8, 8, 3, padding=1)
        self.pool = nn.AdaptiveMaxPool2d(4)
        self.fc = nn.Linear(8 * 4 * 4, 10)

    def forward(self, x):
        a = torch.relu(self.c1(x))
        b = torch.relu(self.c2(a)) + a
        return self.fc(torch.flatten(self.pool(b), 1))


@pytest.fixture(scope="module")
def small():
    torch.manual_seed(0)
    model = _Small().eval()
    graph = capture(model)
    xs = [torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    return model, graph, xs


def test_build_profile_measures_cuts_bytes_and_errors(small):
    model, graph, xs = small
    p = prof.build_profile(graph, "small", "hash", xs, codecs=("raw", "float16", "int8", "int4"),
                           compressions=("none", "zstd"), repeats=1)
    assert p.cuts[0].kind == "input" and p.cuts[-1].kind == "output"
    assert p.cuts[0].candidate and p.cuts[-1].candidate
    assert p.forward_s > 0 and p.cuts[-1].head_s == p.forward_s == p.cuts[0].tail_s
    heads = [c.head_s for c in p.cuts]
    assert heads == sorted(heads)
    assert p.output_leaves == [(10, "float32")] and p.output_raw_bytes == 40
    for c in p.candidates:
        if c.kind == "output":
            continue
        assert c.bytes["raw/none"] == c.raw_bytes
        assert c.bytes["int8/none"] == pytest.approx(c.raw_bytes / 4, abs=len(c.crossing))
        assert c.bytes["int4/none"] <= c.raw_bytes / 8 + len(c.crossing)
        assert 0 < c.error["float16"] < c.error["int8"] < c.error["int4"] < 1
        assert c.codec_error("raw") == 0.0
    residual = [c for c in p.cuts if len(c.crossing) == 2]
    assert residual, "the skip connection crosses some cut"
    # The widest range of each crossing tensor over the calibration inputs, and a frame's
    # ratio to it: 1 within calibration, the widening factor beyond.
    inp = p.cuts[0]
    assert inp.ranges == [max(prof.quant_range(x) for x in xs)]
    assert inp.range_ratio([xs[0]]) == 1.0 and inp.range_ratio([xs[1] * 0.5]) == 1.0
    assert inp.range_ratio([xs[0] * 3]) == pytest.approx(3 * prof.quant_range(xs[0]) / inp.ranges[0])
    assert math.isinf(inp.range_ratio([]))
    assert prof.quant_range(torch.tensor([1.0, 3.0])) == 3.0          # widened to include 0
    assert prof.quant_range(torch.tensor([-2.0, 3.0])) == 5.0
    assert prof.quant_range(torch.tensor([1, 7])) == 0.0               # integers go raw
    assert all(len(c.ranges) == len(c.crossing) for c in p.candidates if c.kind != "output")


class _Masked(nn.Module):
    """An attention's -inf mask crosses a cut (AGRNav's criss-cross attention)."""

    def __init__(self):
        super().__init__()
        self.c = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x):
        e = self.c(x)
        return torch.softmax(e.masked_fill(e < e.mean(), float("-inf")).flatten(1), dim=1)


def test_a_tensor_the_codec_cannot_take_is_measured_raw():
    """Frames send a tensor an integer codec cannot encode (non-finite values) or float16
    cannot hold raw (``codec.encode_or_raw``): the profile measures it so, with no error,
    instead of failing on it."""
    torch.manual_seed(0)
    graph = capture(_Masked().eval())
    x = torch.randn(1, 3, 8, 8)
    p = prof.build_profile(graph, "masked", "hash", [x], codecs=("raw", "float16", "int8c", "int8"),
                           compressions=("none",), repeats=1)
    masked = [c for c in p.cuts if list(c.crossing) == ["masked_fill"]]
    assert masked and masked[0].bytes, "the mask's cut is measured"
    for k in ("float16/none", "int8c/none", "int8/none"):
        assert masked[0].bytes[k] == masked[0].raw_bytes
    if masked[0].candidate:
        assert masked[0].error["int8"] == masked[0].error["float16"] == 0.0
    conv = next(c for c in p.cuts if list(c.crossing) == ["c"])
    assert conv.bytes["int8/none"] < conv.raw_bytes / 3                # finite: quantised


def test_profile_cache_key_and_refresh(small, tmp_path):
    model, graph, xs = small
    kw = dict(codecs=("raw", "int8"), compressions=("none",), repeats=1)
    p1 = prof.load_or_build(str(tmp_path), graph, "small", "hash", xs, **kw)
    files = os.listdir(tmp_path)
    assert len(files) == 1 and files[0].startswith("small-") and files[0].endswith(".json")
    p2 = prof.load_or_build(str(tmp_path), graph, "small", "hash", xs, **kw)
    assert p2.created == p1.created and p2.to_json() == p1.to_json()      # loaded
    p3 = prof.load_or_build(str(tmp_path), graph, "small", "hash", xs, refresh=True, **kw)
    assert p3.created > p1.created
    # Other weights, another input shape, other options: other keys, other files.
    prof.load_or_build(str(tmp_path), graph, "small", "other-hash", xs, **kw)
    prof.load_or_build(str(tmp_path), graph, "small", "hash", [torch.randn(1, 3, 8, 8)], **kw)
    prof.load_or_build(str(tmp_path), graph, "small", "hash", xs, codecs=("raw",),
                       compressions=("none",), repeats=1)
    assert len(os.listdir(tmp_path)) == 4
    m1, m2 = prof.machine_id("cpu"), dict(prof.machine_id("cpu"), host="elsewhere")
    assert prof.profile_key("h", m1, [1], {}) != prof.profile_key("h", m2, [1], {})
    # A corrupt or foreign file is measured again, not trusted.
    path = prof.profile_path(str(tmp_path), "small", p3.key)
    with open(path, "w") as f:
        f.write("{not json")
    p4 = prof.load_or_build(str(tmp_path), graph, "small", "hash", xs, **kw)
    assert p4.created > p3.created
    d = json.loads(p4.to_json())
    d["version"] = 99
    with open(path, "w") as f:
        json.dump(d, f)
    assert prof.load_or_build(str(tmp_path), graph, "small", "hash", xs, **kw).created > p4.created


def test_profile_json_round_trip_and_server_times(small):
    model, graph, xs = small
    p = prof.build_profile(graph, "small", "hash", xs[:1], codecs=("raw",), compressions=("none",),
                           repeats=1)
    p.record_server_tail("input", 0.010, device="cuda:0")
    p.record_server_tail("input", 0.020, device="cuda:0", alpha=0.5)
    assert p.server["tail_s"]["input"] == pytest.approx(0.015)
    q = Profile.from_json(p.to_json())
    assert q.to_json() == p.to_json() and q.cut("output").kind == "output"
    # Saved server times seed the server's load factor; per cut the planner uses only
    # times measured since loading (a saved time may be from another load).
    t_in = q.cut("input").tail_s
    assert q.fresh_tail_s == {} and q.server_factor(10.0, min_s=0) == pytest.approx(0.015 / (t_in / 10))
    assert q.server_factor(10.0, device="cpu", min_s=0) is None
    cfg = PlannerConfig(server_speedup=10.0)
    assert predict_cut(q, q.cut("input"), "raw/none", 8 * MB, cfg).server_s == pytest.approx(t_in / 10)
    q.record_server_tail("input", 0.004, device="cuda:0")
    assert predict_cut(q, q.cut("input"), "raw/none", 8 * MB, cfg).server_s == pytest.approx(0.004)
    p.record_server_tail("input", 0.5, device="cpu")           # another server: start over
    assert p.server == {"device": "cpu", "tail_s": {"input": 0.5}} and p.fresh_tail_s == {"input": 0.5}
    with pytest.raises(ConfigError):
        q.cut("nope")
    for bad in ('{"version": 1}', "[]", '{"version": 1, "cuts": [{"id": 1}]}'):
        with pytest.raises((ConfigError, ValueError)):
            Profile.from_json(bad)


def test_near_ties_go_to_the_lower_error():
    """Two encodings of the input 24 bytes apart (int8 per tensor, int8c per channel): the
    predictions cannot tell them apart, so the exact one wins; with tie_margin 0 the few
    bytes decide, and a lower-error choice more than the margin slower never wins."""
    p = _profile()
    inp = p.cut("input")
    inp.bytes["int8c/zstd"] = inp.bytes["int8/zstd"] + 24
    inp.encode_s["int8c/zstd"] = inp.encode_s["int8/zstd"]
    inp.error["int8c"] = 1e-6
    p.codecs = ["raw", "int8", "int8c"]
    cfg = PlannerConfig(error_tolerance=0.01)
    assert best_plan(p, 100 * MB, cfg).encoding == "int8c/zstd"
    assert best_plan(p, 100 * MB, PlannerConfig(error_tolerance=0.01, tie_margin=0.0)).encoding == "int8/zstd"
    # int8c 30 KB larger: at 8 Mbit/s that is 30 ms on ~0.2 s, far beyond 1 %.
    inp.bytes["int8c/zstd"] = inp.bytes["int8/zstd"] + 30_000
    assert best_plan(p, 8 * MB, cfg).encoding == "int8/zstd"
    with pytest.raises(ConfigError):
        PlannerConfig(tie_margin=1.0).validate()


def test_measured_choice_carries_errors_onto_predictions_made_again():
    """A plan measured at 3x a prediction made under stale factors leads nowhere; when a
    re-plan predicts it at 3x, its ratios move onto the new prediction (1x) and it leads
    again in a bucket where it has not run. A key the new table does not predict loses
    its ratios; keys the old table did not predict keep theirs; latencies stay."""
    _table, i, j, plan_i, plan_j, alt_i, alt_j = _two_buckets_sharing_plans()
    alt_error = plan_j.latency_s / alt_j.latency_s
    truth = {plan_i.key: 3.0, alt_i.key: alt_error}
    m = MeasuredChoice(margin=1e9, every=100, window=3, min_samples=2, known_margin=0.10)
    for _ in range(6):
        p, _probe = m.choose(i, plan_i, [alt_i])
        m.observe(i, p, p.latency_s * truth[p.key])
    assert m.lead(j, plan_j, [alt_j]) is alt_j
    assert m.corrected_s(plan_j) == pytest.approx(3.0 * plan_j.latency_s)
    before, alt_before = m.median_s(i, plan_i), m.corrected_s(alt_j)
    m.carry_errors({plan_i.key: {i: 1.0, j: 2.0}}, {plan_i.key: {i: 3.0, j: 6.0}})
    assert m.corrected_s(plan_j) == pytest.approx(plan_j.latency_s)
    assert m.lead(j, plan_j, [alt_j]) is plan_j
    assert m.corrected_s(alt_j) == alt_before and m.median_s(i, plan_i) == before
    m.carry_errors({alt_i.key: {i: 1.0}}, {alt_i.key: {j: 1.0}})   # not in the same bucket
    assert m.corrected_s(alt_j) is None and m.corrected_s(plan_j) is not None


def test_measured_choice_leads_a_new_bucket_with_the_fastest_corrected_prediction():
    """A plan that measured far slower than predicted, against an alternative that measured
    as predicted, does not run first in the next bucket: the alternative leads there (not a
    probe) and the plan, ruled out, is not run at all. With no errors measured, or errors
    within ``known_margin``, the plan leads as before."""
    _table, i, j, plan_i, plan_j, alt_i, alt_j = _two_buckets_sharing_plans()
    for plan_error, alt_leads in ((3.0, True), (1.0, False)):
        # the alternative's error puts its corrected prediction in j at 1.0x the plan's
        # predicted latency there; the plan's corrected one is plan_error times that
        alt_error = plan_j.latency_s / alt_j.latency_s
        truth = {plan_i.key: plan_error, alt_i.key: alt_error}
        m = MeasuredChoice(margin=1e9, every=100, window=3, min_samples=2, known_margin=0.10)
        assert m.lead(j, plan_j, [alt_j]) is plan_j          # nothing measured yet
        for _ in range(6):
            p, _probe = m.choose(i, plan_i, [alt_i])
            m.observe(i, p, p.latency_s * truth[p.key])
        assert m.median_s(j, plan_j) is None and m.median_s(j, alt_j) is None
        assert (m.lead(j, plan_j, [alt_j]) is alt_j) == alt_leads
        ran = []
        for _ in range(4):
            p, probe = m.choose(j, plan_j, [alt_j])
            ran.append(("alt" if p.key == alt_j.key else "plan", probe))
            m.observe(j, p, p.latency_s * truth[p.key])
        if alt_leads:
            assert ran == [("alt", False)] * 4, ran
        else:
            # the plan first, then the alternative (a close call, not ruled out) as a probe
            assert ran[0] == ("plan", False) and ("alt", True) in ran, ran


class _Plan:
    """What MeasuredChoice needs of a plan: a key, a predicted latency, whether it crosses
    the link."""

    def __init__(self, key, latency_s, link_free=False):
        self.key, self.latency_s, self.link_free = key, latency_s, link_free

    def describe(self):
        return self.key


def test_an_alternative_measured_faster_here_stays_a_candidate():
    """Once an alternative has its samples in a bucket, its measured median decides whether
    it stays a candidate, not its prediction: one predicted far slower than the plan but
    measured faster is served; one measured more than ``margin`` slower is dropped."""
    plan, alt = _Plan("plan", 0.030), _Plan("alt", 0.060)     # alt: no close call
    m = MeasuredChoice(margin=0.0, every=100, window=3, min_samples=2)
    for _ in range(2):
        m.observe(0, plan, 0.030)
        m.observe(0, alt, 0.025)
    assert not m.close_call(plan, alt) and alt.latency_s > m.median_s(0, plan)
    assert m.candidate(0, plan, alt)
    assert m.choose(0, plan, [alt]) == (alt, False)
    slow = MeasuredChoice(margin=0.25, every=100, window=3, min_samples=2)
    for _ in range(2):
        slow.observe(0, plan, 0.030)
        slow.observe(0, _Plan("alt", 0.031), 0.040)      # a close call, measured 1.33x
    assert not slow.candidate(0, plan, _Plan("alt", 0.031))
    assert slow.choose(0, plan, [_Plan("alt", 0.031)]) == (plan, False)


def test_a_probe_measured_far_slower_is_not_probed_again():
    """A close call whose first probe measured more than ``(1 + margin) ** 2`` times the
    plan's median is no candidate in that bucket any more; one measured slower by less is
    probed again to confirm (a single frame may be a spike)."""
    plan, alt = _Plan("plan", 0.400), _Plan("alt", 0.450)      # a close call by prediction
    for first_s, probed_again in ((0.729, False), (0.550, True)):
        m = MeasuredChoice(margin=0.25, every=100, window=3, min_samples=2)
        for _ in range(2):
            m.observe(0, plan, 0.395)
        assert m.choose(0, plan, [alt]) == (alt, True)
        m.observe(0, alt, first_s)
        assert m.candidate(0, plan, alt) is probed_again
        assert m.choose(0, plan, [alt]) == ((alt, True) if probed_again else (plan, False))
        assert m.candidate(1, plan, alt)        # another bucket has not measured it


def test_a_neighbouring_buckets_fastest_plan_is_timed_in_a_new_bucket():
    """The bandwidth estimate hops between neighbouring buckets: the plan a neighbour serves
    as its fastest is timed in a bucket whose own plan measures slower, though it is no
    close call there and its corrected prediction rules it out; buckets that are not
    neighbours (or not integers) are not affected."""
    plan, alt = _Plan("plan", 0.030), _Plan("alt", 0.060)
    truth = {"plan": 0.030, "alt": 0.024}

    def run(bucket_seen, bucket_new):
        m = MeasuredChoice(margin=0.0, every=100, window=3, min_samples=2, known_margin=0.10)
        # in bucket_seen alt is the plan (as the input cut is where the estimate is higher)
        for _ in range(3):
            p, _probe = m.choose(bucket_seen, alt, [plan])
            m.observe(bucket_seen, p, truth[p.key])
        for _ in range(2):
            m.observe(bucket_new, plan, truth["plan"])
        ran = []
        for _ in range(5):
            p, probe = m.choose(bucket_new, plan, [alt])
            ran.append((p.key, probe))
            m.observe(bucket_new, p, truth[p.key])
        return m, ran

    m, ran = run(4, 5)
    assert not m.close_call(plan, alt) and m.nearby_best(5, alt) and not m.nearby_best(5, plan)
    # one probe, then served: it measured faster than the plan
    assert ran == [("alt", True)] + [("alt", False)] * 4, ran
    for seen, new in ((4, 6), ("a", "b")):
        _m, ran = run(seen, new)
        assert all(k == "plan" for k, _ in ran), ran


def test_a_handicapped_plan_must_measure_that_much_faster():
    """``handicap`` (lop's spatial schedules): served only where its median times the factor
    is below the others'."""
    plan, alt = _Plan("spatial", 0.030), _Plan("cut", 0.030)
    for spatial_s, served in ((0.0295, "cut"), (0.0285, "spatial")):
        m = MeasuredChoice(margin=1e9, every=100, window=3, min_samples=2)
        for _ in range(2):
            m.observe(0, plan, spatial_s)
            m.observe(0, alt, 0.030)
        p, probe = m.choose(0, plan, [alt], handicap={"spatial": 1.03})
        assert (p.key, probe) == (served, False)
        assert m.choose(0, plan, [alt]) == (plan, False)      # no handicap: the faster median


def test_a_probe_faster_than_the_served_plan_is_timed_again_at_once():
    """A candidate probed every ``every`` frames keeps old samples for long: two slow
    ones must not keep it out once a probe measures it faster. It is timed again until
    its window is fresh, then serves; a confirming sample that is not faster stops it."""
    table = PlanTable(_profile(), PlannerConfig())
    i = table.index(20 * MB)
    plan, alt = table.plans[i], table.alternatives[i][0]
    m = MeasuredChoice(margin=1e9, every=5, window=3, min_samples=2)
    truth = {plan.key: 0.035, alt.key: 0.029}
    spikes = iter([0.053, 0.044])        # the alternative's first two frames are slow
    ran = []
    for _ in range(16):
        p, probe = m.choose(i, plan, [alt])
        ran.append((p is alt, probe, m.last["reason"]))
        m.observe(i, p, next(spikes, truth[p.key]) if p is alt else truth[p.key])
    reasons = [r for _, _, r in ran]
    assert "probe: confirming a faster measurement" in reasons, ran
    assert all(a for a, probe, _ in ran[-4:] if not probe), ran      # the alternative serves
    assert m.median_s(i, alt) == pytest.approx(0.029)
    # without a faster probe there is nothing to confirm: a slower one stops at once
    m2 = MeasuredChoice(margin=1e9, every=2, window=3, min_samples=1)
    slow = {plan.key: 0.020, alt.key: 0.040}
    seen = []
    for _ in range(12):
        p, probe = m2.choose(i, plan, [alt])
        seen.append(m2.last["reason"])
        m2.observe(i, p, slow[p.key])
    assert "probe: confirming a faster measurement" not in seen, seen


def test_a_candidate_faster_in_the_neighbouring_bucket_is_timed_again_here():
    """A few stalled frames left a candidate's median slow in one bucket; it measures fast
    in the neighbouring bucket since. The bucket probes it again (not only every ``every``
    frames), the probe is confirmed, and it serves; a candidate that is truly slower here
    is probed at most once every ``every // 2`` frames."""
    fast, other = _Plan("lop", 0.030), _Plan("image", 0.055)

    def run(here_truth_s):
        m = MeasuredChoice(margin=0.25, every=20, window=3, min_samples=2)
        for _ in range(3):                         # stalled frames of lop in bucket 15
            m.observe(15, fast, 0.068)
        for _ in range(3):
            m.observe(15, other, 0.053)
        for _ in range(3):                         # lop fast in bucket 14 since
            m.observe(14, fast, 0.028)
        ran = []
        for _ in range(24):
            p, probe = m.choose(15, fast, [other])       # lop is predicted faster
            ran.append((p.key, probe, m.last["reason"]))
            m.observe(15, p, here_truth_s if p is fast else 0.053)
            m.observe(14, fast, 0.028)             # the estimate hops back and forth
        return ran

    ran = run(0.027)
    first = next(i for i, (_k, _p, r) in enumerate(ran) if r == "probe: faster in a neighbouring bucket")
    assert first <= 5 and ran[first + 1][2] == "probe: confirming a faster measurement", ran
    assert [k for k, probe, _ in ran[first + 3:]] == ["lop"] * len(ran[first + 3:]), ran
    slow = run(0.068)                              # lop is really slower here
    hints = [i for i, (_k, _p, r) in enumerate(slow) if r == "probe: faster in a neighbouring bucket"]
    assert hints and all(b - a >= 5 for a, b in zip(hints, hints[1:])), slow
    assert sum(k == "image" for k, _p, _r in slow) >= 18, slow
