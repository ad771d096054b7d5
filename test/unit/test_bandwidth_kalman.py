"""KalmanLevel, the default bandwidth predictor: steps, bursts, reset, and sane output for
any input (pure)."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from robot_offload import bandwidth as bw
from robot_offload.testbed import traces

pytestmark = pytest.mark.robot_side
MBIT = 1e6


def feed(p, samples, t0=0.0, dt=0.1):
    """samples: (rate, duration or None); one every dt seconds."""
    for i, (x, d) in enumerate(samples):
        p.update(t0 + dt * i, x, d)
    return p.predict()


def test_noise_free_samples_are_followed_like_the_last_value():
    """A trace's samples carry no duration: exact rates, so the level is the last one."""
    t = traces.indoor(duration_s=30)
    k, last = bw.KalmanLevel(), bw.LastValue()
    for i, x in enumerate(t.rates_bps):
        k.update(0.1 * i, x)
        last.update(0.1 * i, x)
        assert k.predict() == pytest.approx(last.predict(), rel=0.02)


@pytest.mark.parametrize("duration_s", [None, 0.03, 0.2, 1.0])
def test_a_step_down_and_up_is_followed_within_two_samples(duration_s):
    """100 -> 5 -> 100 Mbit/s; a 0.03 s transfer is as noisy as the testbed's get at
    100 Mbit/s (600 KB), and still a 20x step is a change, not noise."""
    p = bw.KalmanLevel()
    feed(p, [(100 * MBIT, duration_s)] * 30)
    steps = []
    for level in (5 * MBIT, 100 * MBIT):
        for n in range(1, 10):
            p.update(p._t + 0.1, level, duration_s)
            if abs(p.predict() / level - 1) < 0.15:
                steps.append(n)
                break
        else:
            steps.append(None)
    assert steps[0] is not None and steps[0] <= 2, steps
    assert steps[1] is not None and steps[1] <= 2, steps
    assert p.changes >= 2


def test_a_smaller_change_is_followed_too():
    p = bw.KalmanLevel()
    feed(p, [(50 * MBIT, 0.1)] * 30)
    for i in range(10):
        p.update(3.0 + 0.1 * i, 35 * MBIT, 0.1)
    assert p.predict() == pytest.approx(35 * MBIT, rel=0.05)


def test_a_short_burst_is_discounted_a_long_transfer_is_not():
    """50 Mbit/s from 0.1 s transfers, then a 6 ms transfer that went through a shaper's
    bucket at line rate and read 200 Mbit/s: the level hardly moves (the last value jumps
    4x). The same reading from a 0.5 s transfer is a real change and is followed."""
    steady = [(50 * MBIT, 0.1)] * 30
    p = bw.KalmanLevel()
    feed(p, steady)
    p.update(3.0, 200 * MBIT, 0.006)
    assert p.predict() == pytest.approx(50 * MBIT, rel=0.05)
    assert p.changes == 0
    last = bw.LastValue()
    feed(last, steady)
    last.update(3.0, 200 * MBIT, 0.006)
    assert last.predict() == 200 * MBIT
    q = bw.KalmanLevel()
    feed(q, steady)
    q.update(3.0, 200 * MBIT, 0.5)
    assert q.predict() == pytest.approx(200 * MBIT, rel=0.1)


def test_noise_of_a_sample_falls_with_its_duration():
    p = bw.KalmanLevel()
    assert p.noise_var(None) == bw.KalmanLevel.R_FLOOR
    assert p.noise_var(0.005) > p.noise_var(0.02) > p.noise_var(0.2)
    assert p.noise_var(0.02) == pytest.approx(1.0 + bw.KalmanLevel.R_FLOOR)
    assert math.isinf(p.noise_var(0.0)) and math.isinf(p.noise_var(-1.0))
    assert math.isinf(p.noise_var(float("nan")))


def test_repeated_bursts_pull_less_than_with_the_last_value_or_harmonic_mean():
    """A simulated token bucket (rate R, bucket 20 ms of R, full after each idle gap):
    B bytes take B/R - 20 ms and read R / (1 - 0.02 R / B). On a 50 Mbit/s link with 150
    and 600 KB transfers the kalman level stays closer to R than last or harmonic(5)."""
    rate, bucket_s = 50 * MBIT, 0.02
    rng = np.random.default_rng(3)
    preds = {"kalman": bw.KalmanLevel(), "last": bw.LastValue(), "harmonic(5)": bw.HarmonicMean(5)}
    err = {k: [] for k in preds}
    for i in range(400):
        size = rng.choice([150_000, 600_000]) * 8.0
        jitter = rng.uniform(0.0, 0.004)  # a loaded host's scheduling
        on_link = size / rate - bucket_s + jitter
        for name, p in preds.items():
            p.update(0.05 * i, size / on_link, on_link)
            err[name].append(abs(p.predict() - rate))
    mae = {k: float(np.mean(v)) for k, v in err.items()}
    assert mae["kalman"] < 0.8 * mae["last"], mae
    assert mae["kalman"] < 0.8 * mae["harmonic(5)"], mae


def test_reset_forgets_everything():
    p = bw.KalmanLevel()
    feed(p, [(80 * MBIT, 0.1)] * 20 + [(1 * MBIT, 1.0)])
    assert p.changes == 1
    p.reset()
    assert p.predict() is None and p.changes == 0
    p.update(100.0, 7 * MBIT, 0.004)   # the first sample sets the level, however short
    assert p.predict() == pytest.approx(7 * MBIT)
    p.update(100.1, 7 * MBIT, 0.2)
    assert p.predict() == pytest.approx(7 * MBIT)


def test_invalid_samples_and_parameters():
    p = bw.KalmanLevel()
    p.update(0.0, float("nan"), 0.1)
    p.update(float("inf"), 5 * MBIT, 0.1)
    assert p.predict() is None
    p.update(0.0, 5 * MBIT, 0.0)   # no duration to trust: only the first sets the level
    p.update(0.1, 500 * MBIT, 0.0)
    assert p.predict() == pytest.approx(5 * MBIT)
    assert bw.KalmanLevel(burst_s=0.005).name == "kalman(q=0.1, burst_s=0.005, k=3)"
    for bad in ({"q": 0}, {"q": float("inf")}, {"burst_s": -1}, {"k": 0}):
        with pytest.raises(ValueError):
            bw.KalmanLevel(**bad)


def test_passive_estimator_gives_the_predictor_the_time_on_the_link():
    seen = []

    class Spy(bw.LastValue):
        def update(self, t_s, measured_bps, duration_s=None):
            seen.append(duration_s)
            super().update(t_s, measured_bps, duration_s)

    est = bw.PassiveEstimator(Spy())
    est.add(bw.TransferSample(1.0, 1_000_000, 0.1), rtt_s=0.02)
    assert seen == [pytest.approx(0.08)]


finite = st.floats(allow_nan=False, allow_infinity=False)
durations = st.one_of(st.none(), finite)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(finite, finite, durations), min_size=1, max_size=60),
       st.sampled_from([0.01, 0.1, 10.0]))
def test_never_nan_inf_or_nonpositive(samples, q):
    p = bw.KalmanLevel(q=q)
    for t, x, d in samples:
        p.update(t, x, d)
        got = p.predict()
        assert got is not None and math.isfinite(got) and got > 0, (t, x, d, got)
