"""LinkBurst and the passive estimator on links with and without a token bucket: the
burst a shaper lets through at line rate is learned from the transfers and added back,
so measured rates are the link's, not 1 + burst / time of it (pure)."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from robot_offload import bandwidth as bw

pytestmark = pytest.mark.robot_side
MBIT = 1e6


class BucketLink:
    """A token-bucket link: ``rate_bps``, a bucket of ``burst_s`` at the rate, passed at
    ``line_bps``; ``jitter_s`` of uniform noise on each transfer's time."""

    def __init__(self, rate_bps, burst_s, line_bps=2e9, jitter_s=0.0, seed=0):
        self.rate, self.burst_s, self.line = rate_bps, burst_s, line_bps
        self.jitter_s, self.rng = jitter_s, np.random.default_rng(seed)
        self.tokens_bits, self.t = rate_bps * burst_s, 0.0

    def send(self, start_s, nbytes):
        """(end time, duration) of ``nbytes`` starting at ``start_s`` (after the last ended)."""
        start_s = max(start_s, self.t)
        cap = self.rate * self.burst_s
        self.tokens_bits = min(cap, self.tokens_bits + (start_s - self.t) * self.rate)
        bits = 8.0 * nbytes
        free = min(bits, self.tokens_bits)
        duration = free / self.line + (bits - free) / self.rate
        duration += self.rng.uniform(0.0, self.jitter_s)
        self.tokens_bits -= free
        self.t = start_s + duration
        return self.t, duration


def run(link, sizes, gaps_s, est, rate_of=None):
    """Send ``sizes`` with ``gaps_s`` of idle before each; feed ``est``; the rates it used
    over the link's rate at the time."""
    ratios, t = [], 0.0
    for i, (n, gap) in enumerate(zip(sizes, gaps_s)):
        if rate_of is not None:
            link.rate = rate_of(i)
        end, d = link.send(t + gap, n)
        got = est.add(bw.TransferSample(end, n, d), rtt_s=0.0)
        if got is not None and d >= est.min_duration_s:
            ratios.append(got / link.rate)
        t = end
    return np.array(ratios)


def mixed(n, seed=1):
    rng = np.random.default_rng(seed)
    return rng.choice([150_000, 600_000], n).tolist(), rng.uniform(0.005, 0.06, n).tolist()


@pytest.mark.parametrize("burst_s", [0.02, 0.05])
def test_a_shapers_bucket_is_learned_and_the_rate_comes_out_right(burst_s):
    sizes, gaps = mixed(200)
    est = bw.PassiveEstimator(bw.LastValue(), burst="learn")
    ratios = run(BucketLink(20 * MBIT, burst_s, jitter_s=0.002), sizes, gaps, est)
    assert est.burst_s == pytest.approx(burst_s, abs=0.0051)
    assert np.median(ratios[40:]) == pytest.approx(1.0, abs=0.03)
    # without it the same transfers read well above the rate
    raw = bw.PassiveEstimator(bw.LastValue(), burst=None)
    raw_ratios = run(BucketLink(20 * MBIT, burst_s, jitter_s=0.002), sizes, gaps, raw)
    assert np.median(raw_ratios) > 1.08 and np.percentile(raw_ratios, 90) > 1.4 and raw.burst_s == 0.0


def test_a_link_without_a_bucket_learns_none():
    sizes, gaps = mixed(200, seed=2)
    est = bw.PassiveEstimator(bw.LastValue(), burst="learn")
    ratios = run(BucketLink(20 * MBIT, 0.0, jitter_s=0.002), sizes, gaps, est)
    assert est.burst_s <= 0.0025
    assert np.median(ratios) == pytest.approx(1.0, abs=0.03)


@pytest.mark.parametrize("jitter_s", [0.0, 0.002])
def test_transfers_that_cannot_tell_give_no_credit(jitter_s):
    """One size, long idle before each: every burst fits them alike, noise or not (a
    residual that shrank as the burst grew once learned 100 ms from camera frames 40 ms on
    the link, and read a 20 Mbit/s link as 9); none is assumed."""
    est = bw.PassiveEstimator(bw.LastValue(), burst="learn")
    ratios = run(BucketLink(20 * MBIT, 0.02, jitter_s=jitter_s), [150_000] * 50, [0.2] * 50, est)
    assert est.burst_s == 0.0 and est.burst.fits == 0 and not est.burst._pairs and not est.burst._sized
    assert np.all(ratios > 1.3)        # bytes over time on the link, as without a burst


def test_a_burst_learned_stays_while_transfers_alike_follow():
    """Mixed sizes teach the burst; then a long run of camera frames alike in size and
    idle time (which cannot tell) keeps it, and their rates come out right."""
    link = BucketLink(20 * MBIT, 0.02, jitter_s=0.002)
    est = bw.PassiveEstimator(bw.LastValue(), burst="learn")
    sizes, gaps = mixed(60, seed=6)
    run(link, sizes, gaps, est)
    assert est.burst_s == pytest.approx(0.02, abs=0.0051)
    ratios = run(link, [150_000] * 100, [0.3] * 100, est)
    assert est.burst_s == pytest.approx(0.02, abs=0.0051)
    assert np.median(ratios) == pytest.approx(1.0, abs=0.03)


def test_idle_time_alone_tells_the_burst():
    """One size; idle before each varies below and above the bucket's 30 ms."""
    rng = np.random.default_rng(3)
    est = bw.PassiveEstimator(bw.LastValue(), burst="learn")
    ratios = run(BucketLink(20 * MBIT, 0.03, jitter_s=0.001), [600_000] * 150,
                 rng.uniform(0.0, 0.06, 150).tolist(), est)
    assert est.burst_s == pytest.approx(0.03, abs=0.0051)
    assert np.median(ratios[40:]) == pytest.approx(1.0, abs=0.03)


def test_rate_steps_do_not_throw_it_off():
    sizes, gaps = mixed(300, seed=4)
    est = bw.PassiveEstimator(bw.LastValue(), burst="learn")
    ratios = run(BucketLink(20 * MBIT, 0.02, jitter_s=0.002), sizes, gaps, est,
                 rate_of=lambda i: (50 if (i // 40) % 2 else 10) * MBIT)
    assert est.burst_s == pytest.approx(0.02, abs=0.0051)
    assert np.median(ratios[40:]) == pytest.approx(1.0, abs=0.05)


def test_a_burst_the_bucket_covered_is_a_floor_with_the_credit():
    """Once the bucket is known, a transfer it wholly covered (under 5 ms on the link)
    says only that the rate is at least bytes / (5 ms + credit)."""
    sizes, gaps = mixed(100, seed=5)
    est = bw.PassiveEstimator(bw.LastValue(), burst="learn")
    run(BucketLink(20 * MBIT, 0.02, jitter_s=0.002), sizes, gaps, est)
    assert est.burst_s == pytest.approx(0.02, abs=0.0051)
    last_end = est._link_free_since
    sample = bw.TransferSample(last_end + 1.0 + 0.001, 100_000, 0.001)   # 1 s idle: full credit
    assert est.burst_floor_bps(sample, 0.0) == pytest.approx(100_000 * 8 / (0.005 + est.burst_s))
    assert est.measure(sample, 0.0) is None


def test_the_predictor_gets_the_time_a_rate_stands_for():
    seen = []

    class Spy(bw.LastValue):
        def update(self, t_s, measured_bps, duration_s=None):
            seen.append((measured_bps, duration_s))
            super().update(t_s, measured_bps, duration_s)

    burst = bw.LinkBurst()
    burst.burst_s = 0.02        # as if learned
    est = bw.PassiveEstimator(Spy(), burst=burst)
    est.add(bw.TransferSample(1.0, 1_000_000, 0.1), rtt_s=0.0)     # first: a full bucket
    est.add(bw.TransferSample(1.105, 1_000_000, 0.1), rtt_s=0.0)   # 5 ms idle: 5 ms credit
    assert seen == [(pytest.approx(8e6 / 0.12), pytest.approx(0.12)),
                    (pytest.approx(8e6 / 0.105), pytest.approx(0.105))]


finite = st.floats(allow_nan=True, allow_infinity=True)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(finite, st.integers(0, 1 << 31), finite), min_size=1, max_size=60))
def test_any_transfers_leave_a_burst_on_the_grid_and_finite_rates(samples):
    est = bw.PassiveEstimator(bw.LastValue(), burst="learn")
    for t, n, d in samples:
        got = est.add(bw.TransferSample(t, n, d), rtt_s=0.0)
        assert got is None or (math.isfinite(got) and got > 0)
        assert est.burst_s in bw.BURST_GRID_S


def test_no_burst_is_learned_unless_asked():
    """The monitor's default: bytes over time on the link, no credit (a robot's frames
    carry its own stalls, from which a burst can be mislearned)."""
    est = bw.PassiveEstimator(bw.LastValue())
    assert est.burst is None
    sizes, gaps = mixed(100, seed=7)
    ratios = run(BucketLink(20 * MBIT, 0.02, jitter_s=0.002), sizes, gaps, est)
    assert est.burst_s == 0.0 and np.median(ratios) > 1.08
    assert bw.BandwidthMonitorConfig().validate().learn_burst is False
    assert bw.BandwidthMonitorConfig(learn_burst=True).validate().learn_burst is True


def test_bad_parameters_are_refused():
    for bad in ({"pairs": 2, "min_pairs": 4}, {"pair_gap_s": 0}, {"cap": 0}, {"grid_s": ()}):
        with pytest.raises(ValueError):
            bw.LinkBurst(**bad)
