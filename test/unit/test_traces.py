"""Synthetic traces match the papers' statistics; loaders resample to 0.1 s correctly."""

import json
import os

import numpy as np
import pytest

from robot_offload.errors import ConfigError
from robot_offload.testbed import traces

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures", "traces")
MBIT = 1e6


def test_indoor_mean_and_variance():
    t = traces.indoor()
    assert t.name == "indoor" and t.synthetic and "93" in t.source
    assert len(t) == 600 and t.step_s == pytest.approx(0.1)
    assert t.mean_bps == pytest.approx(93 * MBIT, rel=0.05)
    assert 5 * MBIT < t.rates_bps.std() < 30 * MBIT  # moderate
    assert t.fraction_below(5 * MBIT) == 0.0


def test_outdoor_mean_and_drops_to_zero():
    t = traces.outdoor()
    assert t.name == "outdoor" and t.synthetic and "73" in t.source
    assert t.mean_bps == pytest.approx(73 * MBIT, rel=0.05)
    assert t.fraction_below(5 * MBIT) > 0.05
    assert t.rates_bps.min() < 1 * MBIT
    assert t.rates_bps.std() > traces.indoor().rates_bps.std()


@pytest.mark.parametrize("make", [traces.indoor, traces.outdoor])
def test_fixed_default_seed_is_reproducible_and_other_seeds_keep_the_mean(make):
    np.testing.assert_array_equal(make().rates_bps, make().rates_bps)
    other = make(seed=7, duration_s=30)
    assert len(other) == 300
    assert not np.array_equal(other.rates_bps[:300], make().rates_bps[:300])
    assert other.mean_bps == pytest.approx(make().mean_bps, rel=0.05)


def test_constant_and_rate_at():
    t = traces.constant(20 * MBIT, 1.0)
    assert len(t) == 10 and np.all(t.rates_bps == 20 * MBIT)
    u = traces.Trace([1.0, 2.0, 3.0], 0.1)
    assert [u.rate_at(x) for x in (-1, 0.0, 0.1, 0.19, 0.25, 5.0)] == [1, 1, 2, 2, 3, 3]
    assert u.duration_s == pytest.approx(0.3)


def test_trace_rejects_bad_rates():
    with pytest.raises(ConfigError):
        traces.Trace([1.0, -1.0])
    with pytest.raises(ConfigError):
        traces.Trace([])
    with pytest.raises(ConfigError):
        traces.Trace([1.0, float("nan")])


def test_resample_piecewise_averages_by_time():
    # 10 on [0, .15), 30 on [.15, .3): bins of .1 -> 10, 20, 30
    out = traces.resample_piecewise([0.0, 0.15, 0.3], [10.0, 30.0], 0.1)
    np.testing.assert_allclose(out, [10, 20, 30])
    # coarser: one 0.3 s bin holds the mean
    np.testing.assert_allclose(traces.resample_piecewise([0, .15, .3], [10, 30], 0.3), [20])


def test_load_iperf3_json_fixture():
    t = traces.load_iperf3_json(os.path.join(FIXTURES, "iperf3_sample.json"))
    expected = [80] * 5 + [100] * 5 + [40] * 2 + [50] + [60] * 5
    np.testing.assert_allclose(t.rates_bps / MBIT, expected)
    assert t.name == "iperf3_sample" and not t.synthetic and "iperf3" in t.source


def test_load_iperf3_without_sum_sums_streams(tmp_path):
    doc = {"intervals": [{"streams": [
        {"start": 0, "end": 0.2, "bits_per_second": 1e6},
        {"start": 0, "end": 0.2, "bits_per_second": 2e6}]}]}
    p = tmp_path / "streams.json"
    p.write_text(json.dumps(doc))
    np.testing.assert_allclose(traces.load_iperf3_json(str(p)).rates_bps, [3e6, 3e6])


def test_load_iperf3_rejects_empty(tmp_path):
    p = tmp_path / "empty.json"
    p.write_text(json.dumps({"intervals": []}))
    with pytest.raises(ConfigError, match="bits_per_second"):
        traces.load_iperf3_json(str(p))


def test_load_csv_fixture_mbps():
    t = traces.load_csv(os.path.join(FIXTURES, "rates_mbps.csv"))
    np.testing.assert_allclose(t.rates_bps / MBIT,
                               [10, 10, 15, 20, 20, 30, 30, 30, 30, 30, 5, 5, 5])


def test_csv_round_trip(tmp_path):
    t = traces.outdoor(duration_s=5)
    path = traces.to_csv(t, str(tmp_path / "out.csv"))
    back = traces.load_csv(path)
    assert len(back) == len(t)
    np.testing.assert_allclose(back.rates_bps, t.rates_bps, atol=0.06)
    assert open(path).readline().startswith("# name=outdoor")


def test_load_csv_rejects_unknown_columns(tmp_path):
    p = tmp_path / "bad.csv"
    p.write_text("t,mbit\n0,1\n")
    with pytest.raises(ConfigError, match="time_s"):
        traces.load_csv(str(p))
    p.write_text("time_s,mbit\n0,1\n")
    with pytest.raises(ConfigError, match="rate_bps or rate_mbps"):
        traces.load_csv(str(p))


def test_resample_trace_to_coarser_step():
    t = traces.Trace([10.0, 20.0, 30.0, 40.0], 0.1)
    np.testing.assert_allclose(t.resample(0.2).rates_bps, [15, 35])


def test_steps_square_wave():
    t = traces.steps(duration_s=30)
    assert t.name == "steps" and t.synthetic and len(t) == 300
    r = t.rates_bps / MBIT
    np.testing.assert_array_equal(r[:50], 100)          # starts high for 5 s
    np.testing.assert_array_equal(r[50:100], 5)
    np.testing.assert_array_equal(r[100:150], 100)
    assert np.count_nonzero(np.diff(r)) == 5             # a switch every 5 s
    u = traces.steps(duration_s=4, high_bps=10 * MBIT, low_bps=0.0, period_s=1.0)
    np.testing.assert_array_equal(u.rates_bps[::10] / MBIT, [10, 0, 10, 0])
    with pytest.raises(ConfigError):
        traces.steps(period_s=0.01)


def test_walk_stays_in_bounds_jumps_and_is_reproducible():
    t = traces.walk()
    assert t.name == "walk" and t.synthetic and len(t) == 600
    assert t.rates_bps.min() >= 2 * MBIT - 1 and t.rates_bps.max() <= 200 * MBIT + 1
    steps = np.abs(np.diff(np.log(t.rates_bps)))
    # between jumps a step is a few sd of 0.05; a jump is far larger
    assert np.median(steps) < 0.1 and steps.max() > 0.5
    assert t.meta["jumps"] > 0
    np.testing.assert_array_equal(t.rates_bps, traces.walk().rates_bps)
    assert not np.array_equal(t.rates_bps, traces.walk(seed=5).rates_bps)
    flat = traces.walk(sd_log=0.0, p_jump=0.0)
    assert np.all(flat.rates_bps == flat.rates_bps[0])
    with pytest.raises(ConfigError):
        traces.walk(low_bps=0)


def test_from_spec_names_seeds_and_errors():
    assert set(traces.SYNTHETIC) >= {"indoor", "outdoor", "steps", "walk"}
    assert traces.from_spec("steps", 10).name == "steps"
    w = traces.from_spec("walk:7", 10)
    assert w.name == "walk:7" and len(w) == 100
    np.testing.assert_array_equal(w.rates_bps, traces.walk(10, seed=7).rates_bps)
    assert traces.from_spec("const:20", 1).rates_bps[0] == 20 * MBIT
    for bad in ("steps:3", "walk:x", "nope", "const:", "csv:"):
        with pytest.raises(ConfigError):
            traces.from_spec(bad, 10)
