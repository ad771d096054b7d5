"""Bandwidth estimation from real transfers, and prediction of the next interval's rate.

Pure (no rospy, no sockets). Rates are bit/s of goodput.

- :class:`TransferSample` + :class:`PassiveEstimator`: every real transfer the client makes
  (bytes, how long it took) becomes a measured rate; transfers too small or too short to
  show the link's rate are ignored, a transfer the robot stalled during (a frame beside
  background planning) or one far below the estimate lowers it only when others agree, one
  round trip is taken off the duration when an RTT estimate is known, and (opt-in) what the
  link let through at line rate after an idle moment (a shaper's bucket, learned by
  :class:`LinkBurst`) is added back.
- Predictors share one interface (``update(t_s, measured_bps, duration_s=None)``,
  ``predict()``, ``reset()``, ``name``): :class:`KalmanLevel` (weighs each sample by how
  long its transfer lasted, follows steps at once), :class:`LastValue` (the default),
  :class:`Ewma`, :class:`HarmonicMean` (the FESTIVE / MPC video-streaming estimator),
  :class:`MedianOfN`, :class:`LogEwma`, :class:`Ar1`; :func:`make_predictor` builds one
  from its name ("ewma(0.3)").
- :func:`evaluate_predictors` replays a trace and scores each predictor's forecast
  ``horizon_s`` ahead (MAE, RMSE, MAPE, bias); :func:`best_predictor` picks the lowest
  mean score over several traces. ``python -m robot_offload.bench.predictors`` scores
  them on traces and on real transfers through the shaped testbed.
"""

import abc
import collections
import json
import math
import re
from dataclasses import dataclass, replace
from typing import Optional

import numpy as np

from robot_offload import checks
from robot_offload.errors import ConfigError

#: Transfers smaller than this are latency-bound and say little about bandwidth (bytes):
#: a call's fixed costs (ROS serialisation, a robot under a CPU quota) took 10-20 ms on the
#: testbed, so a 16 KB activation at 100 Mbit/s read 5-12 Mbit/s and moved the plans of a
#: whole run to the robot. A 224 x 224 camera image (150 KB) still counts.
MIN_TRANSFER_BYTES = 64 * 1024
#: Transfers whose time on the link (less the RTT) is shorter than this show a burst, not a
#: rate (s). A token-bucket shaper lets its bucket through at line rate (the testbed's htb
#: holds 20 ms of the rate: 250 KB at 100 Mbit/s), and a radio aggregates frames: such
#: transfers read 1.2-6x the link's rate, which moved plans between bandwidth buckets.
MIN_TRANSFER_S = 0.005
#: What a link may pass at line rate after an idle moment, as time at its rate (s): a
#: token-bucket shaper's bucket (the testbed's htb holds 20 ms), a radio's aggregate. A
#: transfer that lasted d s on the link then reads up to (1 + BURST_S / d) times the rate:
#: 600 KB at 50 Mbit/s lasts 75 ms instead of 96 and reads 64 Mbit/s.
BURST_S = 0.02
#: The bursts :class:`LinkBurst` tells apart, as time at the link's rate (s): 0-100 ms in
#: 2.5 ms steps.
BURST_GRID_S = tuple(i * 0.0025 for i in range(41))
#: Rates are floored at this before 1/x or log(x) (bit/s).
RATE_FLOOR_BPS = 1e3
#: MAPE ignores instants whose actual rate is below this (bit/s): a relative error against
#: ~0 is meaningless. The count used is reported as ``mape_n``.
MAPE_FLOOR_BPS = 1e6


@dataclass(frozen=True)
class TransferSample:
    """One transfer: ``bytes`` moved, finishing at ``t_s``, taking ``duration_s`` from the
    first byte sent until the peer confirmed the last one (so it contains one RTT).

    ``floor_only``: the duration may hold more than the link's time (the sender stalled
    during it), so the rate it shows is only a floor of the link's (see
    :meth:`PassiveEstimator.add`).

    ``acked``: the bytes are what the peer's TCP acknowledged of an upload still under way
    (a stalled upload, see :func:`frame_transfer`), over at least 100 ms: no per-call
    costs stand in its duration but the RTT, so it shows a rate however few they are."""

    t_s: float
    bytes: int
    duration_s: float
    floor_only: bool = False
    acked: bool = False


def frame_transfer(stats, end_s: float) -> Optional[TransferSample]:
    """The transfer a frame's stats (an ``InferenceStats`` or a ``FrameStats``) measured,
    ending at ``end_s``, or None when they measured none: a frame of several requests
    (``lop``'s spatial schedules, op by op) overlaps its transfers with computing, so bytes
    over transfer time is no rate of the link; and a hedge the robot answered
    (``executed_mode`` ``local`` with a round trip) left its call unfinished -- unless the
    robot started because the upload had stalled: then the bytes the server's host had
    acknowledged by then, over that time, are the sample (``hedge.upload`` in the
    details, see :mod:`robot_offload.local_hedge`; counted by TCP acknowledgements, it
    shows a rate under ``min_bytes`` too), as they are where the call was late while its
    upload was still under way (``hedge.upload_under_way``); or because the answer had
    stalled: the bytes of it received, over the time since its first (``hedge.download``).

    A frame that ran beside background work on the robot (planning; ``background`` in its
    details, see :mod:`robot_offload.background`) gives a ``floor_only`` sample: its call
    waited for the robot's CPU too. On the testbed's fast links such frames read medians
    2-9x below the others', and as rates they sent ``auto`` off the image offload for
    frames that took 2-5x as long."""
    if stats.round_trips != 1 or not stats.transfer_s > 0:
        return None
    if stats.executed_mode == "local":
        hedge = _details(stats).get("hedge")
        hedge = hedge if isinstance(hedge, dict) else {}
        try:
            upload = hedge.get("upload", hedge.get("upload_under_way"))
            if upload is not None:
                acked, after_s = int(upload["acked_bytes"]), float(upload["after_ms"]) / 1e3
            else:
                acked, after_s = int(hedge["download"]["received_bytes"]), float(hedge["download"]["for_ms"]) / 1e3
        except (TypeError, KeyError, ValueError):
            return None
        if acked <= 0 or not after_s > 0:
            return None
        return TransferSample(t_s=end_s, bytes=acked, duration_s=after_s,
                              floor_only=ran_beside_background(stats), acked=True)
    return TransferSample(t_s=end_s, bytes=stats.bytes_up + stats.bytes_down, duration_s=stats.transfer_s,
                          floor_only=ran_beside_background(stats))


def ran_beside_background(stats) -> bool:
    """Whether a frame's stats say background work ran on the robot during it: ``extra``'s
    ``background`` (a ``FrameStats``), or ``detail_json``'s (an ``InferenceStats``
    message, a bench row)."""
    extra = getattr(stats, "extra", None)
    if isinstance(extra, dict):
        return bool(extra.get("background"))
    text = getattr(stats, "detail_json", "")
    return isinstance(text, str) and '"background"' in text and _details(stats).get("background") is True


def _details(stats) -> dict:
    """A frame's details: ``extra`` of a ``FrameStats``, the parsed ``detail_json`` of an
    ``InferenceStats`` message or a bench row ({} when neither holds a dict)."""
    extra = getattr(stats, "extra", None)
    if isinstance(extra, dict):
        return extra
    text = getattr(stats, "detail_json", "")
    if not isinstance(text, str) or not text:
        return {}
    try:
        detail = json.loads(text)
    except ValueError:
        return {}
    return detail if isinstance(detail, dict) else {}


@dataclass(frozen=True)
class BandwidthEstimate:
    """What a bandwidth monitor publishes (DESIGN.md section 5)."""

    t_s: float
    measured_bps: Optional[float]
    predicted_bps: Optional[float]
    rtt_s: Optional[float]
    source: str  # "passive" (real transfers), "probe" (active), "none"
    predictor: str = ""


class Predictor(abc.ABC):
    """Forecasts the next rate from the rates measured so far."""

    name = "predictor"

    @abc.abstractmethod
    def update(self, t_s, measured_bps, duration_s=None):
        """Feed one measured rate (bit/s) observed at time t_s, from a transfer that was
        ``duration_s`` on the link (None: a rate measured over a saturated interval, as
        a trace's samples are). Only :class:`KalmanLevel` uses the duration."""

    @abc.abstractmethod
    def predict(self):
        """Forecast rate (bit/s), or None before the first update."""

    @abc.abstractmethod
    def reset(self):
        """Forget everything seen."""

    def __repr__(self):
        return f"<{self.name}>"


class LastValue(Predictor):
    """The last measured rate."""

    name = "last"

    def __init__(self):
        self._last = None

    def update(self, t_s, measured_bps, duration_s=None):
        self._last = float(measured_bps)

    def predict(self):
        return self._last

    def reset(self):
        self._last = None


class Ewma(Predictor):
    """Exponentially weighted moving average, weight ``alpha`` on the newest sample."""

    def __init__(self, alpha=0.3):
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.alpha = float(alpha)
        self.name = f"ewma({alpha:g})"
        self._value = None

    def update(self, t_s, measured_bps, duration_s=None):
        x = float(measured_bps)
        self._value = x if self._value is None else self._value + self.alpha * (x - self._value)

    def predict(self):
        return self._value

    def reset(self):
        self._value = None


class LogEwma(Predictor):
    """EWMA of log(rate): a geometric mean that a single fade to ~0 pulls down hard but
    briefly, and that a burst pulls up only a little."""

    def __init__(self, alpha=0.5):
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.alpha = float(alpha)
        self.name = f"log-ewma({alpha:g})"
        self._log = None

    def update(self, t_s, measured_bps, duration_s=None):
        x = math.log(max(float(measured_bps), RATE_FLOOR_BPS))
        self._log = x if self._log is None else self._log + self.alpha * (x - self._log)

    def predict(self):
        return None if self._log is None else math.exp(self._log)

    def reset(self):
        self._log = None


class _Window(Predictor):
    def __init__(self, n):
        if int(n) < 1:
            raise ValueError(f"window must be >= 1 sample, got {n}")
        self.n = int(n)
        self._window = collections.deque(maxlen=self.n)

    def update(self, t_s, measured_bps, duration_s=None):
        self._window.append(max(float(measured_bps), 0.0))

    def reset(self):
        self._window.clear()


class HarmonicMean(_Window):
    """Harmonic mean of the last ``n`` rates (FESTIVE; MPC's throughput predictor):
    robust to single high outliers, conservative after a drop."""

    def __init__(self, n=5):
        super().__init__(n)
        self.name = f"harmonic({self.n})"

    def predict(self):
        if not self._window:
            return None
        return len(self._window) / sum(1.0 / max(x, RATE_FLOOR_BPS) for x in self._window)


class MedianOfN(_Window):
    """Median of the last ``n`` rates: ignores isolated spikes and single-sample fades."""

    def __init__(self, n=5):
        super().__init__(n)
        self.name = f"median({self.n})"

    def predict(self):
        return float(np.median(self._window)) if self._window else None


class Ar1(Predictor):
    """Mean-reverting forecast: least-squares fit of x[k+1] = a + b * x[k] over the last
    ``n`` samples, predicting a + b * x_last (b clipped to [0, 1]). Assumes roughly evenly
    spaced samples (the 0.1 s trace step, or a steady inference rate); with fewer than
    ``min_fit`` samples, or a flat window, it falls back to the last value."""

    def __init__(self, n=50, min_fit=10):
        if int(n) < 3 or int(min_fit) < 3:
            raise ValueError("n and min_fit must be >= 3")
        self.n = int(n)
        self.min_fit = int(min_fit)
        self.name = f"ar1({self.n})"
        self._window = collections.deque(maxlen=self.n)

    def update(self, t_s, measured_bps, duration_s=None):
        self._window.append(max(float(measured_bps), 0.0))

    def predict(self):
        if not self._window:
            return None
        last = self._window[-1]
        if len(self._window) < self.min_fit:
            return last
        x = np.asarray(self._window)
        prev, nxt = x[:-1], x[1:]
        var = prev.var()
        if var <= 0:
            return last
        b = float(np.clip(np.mean((prev - prev.mean()) * (nxt - nxt.mean())) / var, 0.0, 1.0))
        a = nxt.mean() - b * prev.mean()
        return max(0.0, float(a + b * last))

    def reset(self):
        self._window.clear()


class KalmanLevel(Predictor):
    """A Kalman filter of log(rate) as a level that drifts, fed samples whose noise grows
    as their transfers get shorter, and that restarts from a sample far outside what it
    expected.

    - Level: log(rate) drifts as a random walk of variance ``q`` per second between
      samples (``q`` 0.1: about 10 % in 100 ms, 30 % in a second).
    - A sample from a transfer that lasted ``d`` s on the link is off by up to
      ``burst_s / d`` in log (a burst passed at line rate, see :data:`BURST_S`): its noise
      variance is (``burst_s`` / d)^2, inverse-variance weighting. A 6 ms transfer in a
      shaper's bucket barely moves the level; a 1 s transfer sets it. A sample without a
      duration (a trace's, measured over a saturated interval) has a floor of 1 %.
    - Change: an innovation beyond ``k`` (3) standard deviations of what the filter
      expected adds its square to the level's variance, so that the level goes (almost)
      all the way to a sample that can be trusted: a step or a fade is followed by the
      first long transfer after it; a short burst, whose own noise is large, is not a
      change.

    On noise-free samples (a trace) it is the last value; on real transfers it averages
    over about as many samples as their noise needs. The forecast is exp(level) for every
    horizon. Never None after an update, never NaN, inf or <= 0; non-finite samples are
    ignored.
    """

    #: Variance floor of a sample (log units squared): 1 %.
    R_FLOOR = 1e-4
    #: Longest gap between samples that adds drift variance (s), and the largest
    #: variance of the level: they bound the arithmetic for any input; after such a gap
    #: the next sample sets the level anyway.
    MAX_GAP_S = 86400.0
    MAX_VAR = 1e6
    #: Rates are capped here (bit/s; 1 Pbit/s), so that exp(level) stays finite.
    MAX_BPS = 1e15

    def __init__(self, q=0.1, burst_s=BURST_S, k=3.0):
        if not (0 < q < math.inf and 0 <= burst_s < math.inf and 0 < k < math.inf):
            raise ValueError(f"need q > 0, burst_s >= 0, k > 0 (finite), got {q}, {burst_s}, {k}")
        self.q, self.burst_s, self.k = float(q), float(burst_s), float(k)
        if (self.burst_s, self.k) != (BURST_S, 3.0):   # not expressible by make_predictor
            self.name = f"kalman(q={q:g}, burst_s={burst_s:g}, k={k:g})"
        else:
            self.name = "kalman" if self.q == 0.1 else f"kalman({q:g})"
        self.reset()

    def reset(self):
        self._level = None   # log(rate)
        self._var = None     # variance of the level
        self._t = None
        self.changes = 0     # samples taken as a change of level

    def noise_var(self, duration_s):
        """Variance (log units squared) of a sample from a transfer ``duration_s`` long."""
        if duration_s is None:
            return self.R_FLOOR
        d = float(duration_s)
        if not d > 0:        # 0, negative, NaN: no duration to trust
            return math.inf
        rel = self.burst_s / max(d, 1e-9)
        return self.R_FLOOR + rel * rel

    def update(self, t_s, measured_bps, duration_s=None):
        x = float(measured_bps)
        t = float(t_s)
        if not (math.isfinite(x) and math.isfinite(t)):
            return
        y = math.log(min(max(x, RATE_FLOOR_BPS), self.MAX_BPS))
        r = self.noise_var(duration_s)
        if self._level is None:
            if math.isinf(r):
                r = 1.0      # the first sample sets the level whatever its noise
            self._level, self._var, self._t = y, min(r, 1.0), t
            return
        gap = t - self._t
        gap = min(max(gap, 0.0), self.MAX_GAP_S) if math.isfinite(gap) else self.MAX_GAP_S
        self._t = max(self._t, t)
        var = min(self._var + self.q * gap, self.MAX_VAR)
        if math.isinf(r):
            self._var = var
            return
        innov = y - self._level
        if innov * innov > self.k * self.k * (var + r):
            var += innov * innov
            self.changes += 1
        gain = var / (var + r)
        self._level += gain * innov
        self._var = (1.0 - gain) * var

    def predict(self):
        return None if self._level is None else math.exp(self._level)


def default_predictors():
    """A fresh set of the predictors worth comparing."""
    return [KalmanLevel(), LastValue(), Ewma(0.3), Ewma(0.7), LogEwma(0.5), LogEwma(0.8),
            HarmonicMean(5), HarmonicMean(3), MedianOfN(3), MedianOfN(5), Ar1(50)]


class LinkBurst:
    """What the link lets through at line rate after an idle moment, as time at its rate
    (``burst_s``), learned from the transfers themselves.

    A token-bucket shaper (the testbed's htb holds 20 ms; an operator's rate limit) credits
    a transfer that starts after ``idle`` s with ``min(burst, idle)`` s of its rate: B bits
    spend ``B / rate - min(burst, idle)`` on the link. Read as B over the time on the link,
    a 600 KB transfer at 50 Mbit/s shows 64 Mbit/s, and on the testbed every rate the
    monitor measured was 1.4-1.7x the rate the trace set (median).

    Two transfers close in time (``pair_gap_s``) share a rate, so with the right burst each
    one's time on the link follows from the other's: ``d_b = B_b / B_a * (d_a + k_a) - k_b``
    (d: time on the link, k: the credit). Pairs that differ in size or in idle time tell
    bursts apart; pairs alike in both fit every burst alike and are not kept (whose
    residual varies by less than ``informative`` over the grid), so a burst learned stays
    while such transfers follow. The burst is the :data:`BURST_GRID_S` value whose residual
    (both ways, relative to the times measured; each pair's capped at ``cap``, so that a
    pair across a change of rate counts little) summed over the last ``pairs`` pairs of
    sizes apart and the last ``pairs`` others is lowest. Ties (within 1 %) go to the
    smallest, so a link without a bucket, or transfers that cannot tell, keep 0: rates as
    bytes over time on the link. ``min_pairs`` pairs are needed before the first fit."""

    #: two transfers are of sizes apart when one is at least 1.5x the other
    SIZES_APART = math.log(1.5)

    def __init__(self, pairs=32, min_pairs=4, pair_gap_s=0.5, cap=0.2, informative=0.05,
                 grid_s=BURST_GRID_S):
        if not (pairs >= min_pairs >= 1 and pair_gap_s > 0 and cap > 0 and informative >= 0
                and len(grid_s)):
            raise ValueError("need pairs >= min_pairs >= 1, pair_gap_s > 0, cap > 0, "
                             "informative >= 0, a grid")
        self.min_pairs, self.pair_gap_s, self.cap = int(min_pairs), float(pair_gap_s), float(cap)
        self.informative = float(informative)
        self._grid = np.asarray(sorted(grid_s), dtype=float)
        # pairs of sizes apart, and the others: a pair alike in size tells only an idle
        # time below the burst from one above it (every burst shorter than both fits it
        # alike), so a run of those must not push out the pairs that measured the burst
        self._pairs = collections.deque(maxlen=int(pairs))
        self._sized = collections.deque(maxlen=int(pairs))
        self._prev = None       # (end t_s, bits, on-link s, idle s) of the last transfer observed
        self.burst_s = 0.0
        self.fits = 0

    def credit_s(self, idle_s) -> float:
        """The time at the rate a transfer starting after ``idle_s`` of idle link got free."""
        return min(self.burst_s, max(0.0, float(idle_s)))

    def observe(self, t_s, bits, on_link_s, idle_s) -> None:
        """A transfer long enough on the link to show its rate (not itself a burst):
        ``bits`` in ``on_link_s``, ending at ``t_s``, after ``idle_s`` of idle link."""
        cur = (float(t_s), float(bits), float(on_link_s), max(0.0, float(idle_s)))
        if not all(math.isfinite(v) for v in cur[:3]) or cur[1] <= 0 or cur[2] <= 0:
            return
        prev, self._prev = self._prev, cur
        if prev is None or not 0.0 <= cur[0] - prev[0] <= self.pair_gap_s:
            return
        pair = prev[1:] + cur[1:]
        if np.ptp(self._residuals(np.asarray([pair]))) < self.informative:
            return      # alike in size and idle time: every burst fits it (nearly) alike
        sized = abs(math.log(pair[3] / pair[0])) >= self.SIZES_APART
        (self._sized if sized else self._pairs).append(pair)
        if len(self._pairs) + len(self._sized) >= self.min_pairs:
            self._fit()

    def _residuals(self, p):
        """[grid, pair] residual of each burst on the pairs ``p`` (bits, on-link, idle of a
        then b)."""
        g = self._grid[:, None]
        bits_a, on_a, credit_a = p[None, :, 0], p[None, :, 1], np.minimum(g, p[None, :, 2])
        bits_b, on_b, credit_b = p[None, :, 3], p[None, :, 4], np.minimum(g, p[None, :, 5])
        # each transfer's time on the link as the other's rate predicts it, against what it
        # measured: relative to the measurement, so that no burst shrinks the residuals of
        # transfers alike in size and idle time (a ratio of times plus the burst would)
        b_from_a = (bits_b / bits_a) * (on_a + credit_a) - credit_b
        a_from_b = (bits_a / bits_b) * (on_b + credit_b) - credit_a
        return np.abs(b_from_a - on_b) / on_b + np.abs(a_from_b - on_a) / on_a

    def _fit(self) -> None:
        pairs = np.asarray(list(self._pairs) + list(self._sized), dtype=float)
        cost = np.minimum(self._residuals(pairs), self.cap).sum(axis=1)
        # the smallest burst within rounding (and 1 %) of the lowest cost
        best = cost.min()
        self.burst_s = float(self._grid[int(np.argmax(cost <= best + max(1e-9, 0.01 * best)))])
        self.fits += 1

    def reset(self) -> None:
        self._pairs.clear()
        self._sized.clear()
        self._prev = None
        self.burst_s = 0.0


class PassiveEstimator:
    """Turns real transfers into measured rates and keeps a predictor up to date.

    ``measured = bytes * 8 / (duration - rtt + credit)``; a transfer is ignored (returns
    None) when it is smaller than ``min_bytes``, when the RTT leaves less than
    ``min_effective_fraction`` of its duration (latency-bound: the bytes/time ratio would
    be mostly noise), or when what remains is shorter than ``min_duration_s`` (a burst:
    see :data:`MIN_TRANSFER_S`; a link too fast for the client's transfers to last that
    long keeps its last estimate, and an active probe grows until it lasts long enough).
    The RTT is the one passed with the sample, else the minimum of the recent RTTs from
    :meth:`observe_rtt` (the base RTT; ``srtt_s``, RFC 6298 smoothing with gain 1/8, is
    kept for reporting), else none (no correction). With ``burst="learn"`` (or a
    :class:`LinkBurst`), the credit is what the link let through at line rate after the
    idle time before the transfer (since the end of the last transfer of at least
    ``min_bytes``), as :class:`LinkBurst` learns it; by default (None) there is none:
    bytes over time on the link. Learn it from clean transfers of different sizes close in
    time (request/reply traffic; periodic probes, of one size and far apart, teach it
    nothing); a robot's frames also carry its own stalls (a CPU quota, planning beside
    them), and from those a bench run learned 85-100 ms on a 20 ms bucket and held a
    100 Mbit/s link at 13 Mbit/s.

    A ``floor_only`` transfer (the robot stalled during it: see :func:`frame_transfer`) is
    taken as a floor of the rate, as a burst is (see :meth:`add`).

    The predictor gets each rate with the time it stands for (on the link plus the
    credit). The default predictor is :data:`DEFAULT_PREDICTOR`.
    """

    def __init__(self, predictor=None, *, min_bytes=MIN_TRANSFER_BYTES, rtt_gain=0.125,
                 min_effective_fraction=0.1, min_duration_s=MIN_TRANSFER_S, burst=None,
                 floors_to_lower=3, drops_to_lower=2, drop_fraction=0.5):
        self.predictor = predictor if predictor is not None else make_predictor()
        if not (int(floors_to_lower) >= 1 and int(drops_to_lower) >= 1 and 0 < drop_fraction <= 1):
            raise ValueError("need floors_to_lower >= 1, drops_to_lower >= 1 and 0 < drop_fraction <= 1")
        self.floors_to_lower, self.drops_to_lower = int(floors_to_lower), int(drops_to_lower)
        self.drop_fraction = float(drop_fraction)
        # (rate, time it stands for, floor_only) of the samples since the last rate fed
        # that said the link is much slower, held until others agree (see add)
        self._below = []
        self.min_bytes = int(min_bytes)
        self.min_duration_s = float(min_duration_s)
        if not self.min_duration_s >= 0:
            raise ValueError(f"min_duration_s must be >= 0, got {min_duration_s!r}")
        self.rtt_gain = float(rtt_gain)
        self.min_effective_fraction = float(min_effective_fraction)
        self.burst = LinkBurst() if burst == "learn" else burst
        self.srtt_s = None
        # The base (propagation) RTT: the minimum of recent RTTs. Under load an RTT probe
        # waits behind queued data, so the smoothed RTT grows with the queue; subtracting
        # it from a transfer's duration would inflate the measured rate (BBR's reasoning).
        self._recent_rtts = collections.deque(maxlen=32)
        self._link_free_since = None     # end (t_s) of the last transfer of >= min_bytes
        self.last_measured_bps = None
        self.last_t_s = None
        self.used = 0
        self.ignored = 0

    def observe_rtt(self, rtt_s):
        """Fold an RTT measurement (s) into the smoothed RTT."""
        rtt_s = float(rtt_s)
        if rtt_s < 0 or not math.isfinite(rtt_s):
            raise ValueError(f"rtt must be a finite number of seconds >= 0, got {rtt_s}")
        self.srtt_s = rtt_s if self.srtt_s is None else (
            self.srtt_s + self.rtt_gain * (rtt_s - self.srtt_s))
        self._recent_rtts.append(rtt_s)

    @property
    def min_rtt_s(self):
        """Minimum of the last 32 RTTs (s), or None: what a transfer's duration includes
        besides the bytes themselves."""
        return min(self._recent_rtts) if self._recent_rtts else None

    @property
    def burst_s(self) -> float:
        """The burst learned so far (s at the link's rate; 0 without)."""
        return 0.0 if self.burst is None else self.burst.burst_s

    def _time_less_rtt_s(self, sample, rtt_s):
        """A sample's duration less the RTT (s), or None when it is too small or
        latency-bound to show anything of the link (bursts included)."""
        if (sample.bytes < self.min_bytes and not (sample.acked and sample.bytes > 0)
                or not 0 < sample.duration_s < math.inf):
            return None
        rtt = self.min_rtt_s if rtt_s is None else float(rtt_s)
        effective = sample.duration_s - (rtt or 0.0)
        return effective if effective >= self.min_effective_fraction * sample.duration_s else None

    def _idle_s(self, sample) -> float:
        """How long the link was idle before the sample's transfer started (s; inf before
        the first)."""
        if self._link_free_since is None:
            return math.inf
        return max(0.0, sample.t_s - sample.duration_s - self._link_free_since)

    def _credit_s(self, sample) -> float:
        return 0.0 if self.burst is None else self.burst.credit_s(self._idle_s(sample))

    def measure(self, sample, rtt_s=None):
        """The rate a sample shows (bit/s), or None if it cannot show one (too small,
        latency-bound, or a burst). Pure: the burst as learned so far."""
        on_link = self._time_less_rtt_s(sample, rtt_s)
        if on_link is None or on_link < self.min_duration_s:
            return None
        return sample.bytes * 8.0 / (on_link + self._credit_s(sample))

    def burst_floor_bps(self, sample, rtt_s=None):
        """For a burst (a transfer of at least ``min_bytes`` whose time on the link is
        under ``min_duration_s``): the rate it shows were it ``min_duration_s`` long (plus
        the credit), the least that such a burst says of the link. None for any other
        sample."""
        return self._floor_bps(sample, self._time_less_rtt_s(sample, rtt_s), self._credit_s(sample))

    def _floor_bps(self, sample, on_link_s, credit_s):
        """:meth:`burst_floor_bps` from the sample's time on the link and its credit."""
        if on_link_s is None or on_link_s >= self.min_duration_s:
            return None
        return sample.bytes * 8.0 / (self.min_duration_s + credit_s)

    def add(self, sample, rtt_s=None):
        """Measure a transfer and feed the predictor (the rate and the time it stands
        for); returns the rate or None (ignored). A transfer that shows its rate also
        teaches the burst (:class:`LinkBurst`).

        A burst is ignored, unless the prediction is below even its floor
        (:meth:`burst_floor_bps`): then the floor is fed. On a fast link every transfer of
        the client may be a burst (a 150 KB camera image through a 100 Mbit/s shaper that
        holds 250 KB), and the estimate of a slower link before stayed for good: the
        monitor said 5.8 Mbit/s for a whole 100 Mbit/s run.

        A ``floor_only`` sample is a floor too: fed only when the prediction is below the
        rate it shows (or there is none yet), and it teaches no burst. A clean sample that
        shows less than ``drop_fraction`` of the prediction is not fed alone either. Once
        ``drops_to_lower`` such samples have come with no rate fed between, the latest
        clean one is fed (the link did drop, and an earlier one may straddle the change);
        when all are floor-only (they come in runs while the robot plans), it takes
        ``floors_to_lower`` of them, and the highest is fed: the link does at least that.
        One transfer that stalled (a GC pause, a radio's retries) moved ``auto`` off the
        image offload of a 100 Mbit/s link for five frames; a real drop costs one transfer
        more to follow (BBR keeps the highest delivery rate of the last round trips for
        the same reason). A sample held so is still the last measured rate
        (``last_measured_bps``), and counts as ignored until it is fed."""
        on_link = self._time_less_rtt_s(sample, rtt_s)
        idle_s = self._idle_s(sample)
        credit_s = self._credit_s(sample)
        floor = self._floor_bps(sample, on_link, credit_s)
        if sample.bytes >= self.min_bytes and math.isfinite(sample.t_s):
            self._link_free_since = (sample.t_s if self._link_free_since is None
                                     else max(self._link_free_since, sample.t_s))
        if on_link is None:
            self.ignored += 1
            return None
        if floor is not None:
            bps, stands_for_s = floor, self.min_duration_s + credit_s
        else:
            bps, stands_for_s = sample.bytes * 8.0 / (on_link + credit_s), on_link + credit_s
        if floor is None and not sample.floor_only and self.burst is not None:
            self.burst.observe(sample.t_s, sample.bytes * 8.0, on_link, idle_s)
        predicted = self.predict_bps()
        if predicted is not None:
            if floor is not None and predicted >= bps:
                self.ignored += 1        # a burst below the estimate: says nothing new
                return None
            if bps < predicted * (1.0 if sample.floor_only else self.drop_fraction):
                self._below.append((bps, stands_for_s, sample.floor_only))
                self.last_measured_bps, self.last_t_s = bps, sample.t_s    # measured, not fed yet
                clean = [x for x in self._below if not x[2]]
                if len(self._below) < (self.drops_to_lower if clean else self.floors_to_lower):
                    self.ignored += 1
                    return None
                bps, stands_for_s, _ = clean[-1] if clean else max(self._below)
        self._below.clear()
        self.used += 1
        self.last_measured_bps = bps
        self.last_t_s = sample.t_s
        self.predictor.update(sample.t_s, bps, stands_for_s)
        return bps

    def predict_bps(self):
        return self.predictor.predict()

    def estimate(self, t_s):
        """A :class:`BandwidthEstimate` for publishing."""
        return BandwidthEstimate(t_s, self.last_measured_bps, self.predict_bps(),
                                 self.srtt_s, "passive" if self.used else "none",
                                 self.predictor.name)


def evaluate_predictors(trace, predictors, horizon_s=0.1, mape_floor_bps=MAPE_FLOOR_BPS,
                        target="point"):
    """Score each predictor on a trace: at every sample i it has seen samples 0..i and
    predicts the rate ``horizon_s`` later (sample i + h; ``target="mean"``: the mean of
    samples i+1..i+h, the rate a transfer starting then and lasting ``horizon_s`` sees;
    the same for one step). Samples are fed without a duration (each is a rate measured
    over a saturated interval). Predictors are reset first.

    Returns one dict per predictor: predictor, trace, n, mae_bps, rmse_bps, mape_pct,
    mape_n, bias_bps (mean of predicted - actual)."""
    if target not in ("point", "mean"):
        raise ValueError(f"target must be 'point' or 'mean', got {target!r}")
    rates = np.asarray(trace.rates_bps, dtype=float)
    h = max(1, int(round(horizon_s / trace.step_s)))
    if rates.size <= h:
        raise ValueError(f"trace {trace.name!r} is shorter than the horizon")
    if target == "point":
        actual = rates[h:]
    else:
        cum = np.concatenate([[0.0], np.cumsum(rates)])
        actual = (cum[h + 1:] - cum[1:-h]) / h
    rows = []
    for p in predictors:
        p.reset()
        pred = np.empty(actual.size)
        for i in range(actual.size):
            p.update((i + 1) * trace.step_s, rates[i])
            pred[i] = p.predict()
        err = pred - actual
        ok = actual >= mape_floor_bps
        rows.append({
            "predictor": p.name, "trace": trace.name, "n": int(actual.size),
            "mae_bps": float(np.mean(np.abs(err))),
            "rmse_bps": float(np.sqrt(np.mean(err ** 2))),
            "mape_pct": float(100 * np.mean(np.abs(err[ok]) / actual[ok])) if ok.any()
            else float("nan"),
            "mape_n": int(ok.sum()),
            "bias_bps": float(np.mean(err)),
        })
        p.reset()
    return rows


def score_predictors(traces, predictors=None, metric="mae_bps", horizon_s=0.1):
    """[(mean metric over traces, predictor), ...] best first, and all the rows."""
    predictors = default_predictors() if predictors is None else list(predictors)
    rows = [r for t in traces for r in evaluate_predictors(t, predictors, horizon_s)]
    if rows and metric not in rows[0]:
        raise ValueError(f"unknown metric {metric!r}; use one of mae_bps, rmse_bps, mape_pct")
    scored = []
    for p in predictors:
        values = [r[metric] for r in rows if r["predictor"] == p.name]
        scored.append((float(np.mean(values)), p))
    scored.sort(key=lambda sp: sp[0])
    return scored, rows


def best_predictor(traces, predictors=None, metric="mae_bps", horizon_s=0.1):
    """The predictor with the lowest mean ``metric`` over the traces (reset, ready)."""
    scored, _ = score_predictors(traces, predictors, metric, horizon_s)
    return scored[0][1]


#: Predictor names a user can configure (``~predictor``), with their constructors. A
#: parameter is written in parentheses, as the predictors name themselves: "ewma(0.3)".
PREDICTOR_KINDS = {"kalman": KalmanLevel, "last": LastValue, "ewma": Ewma,
                   "log-ewma": LogEwma, "harmonic": HarmonicMean, "median": MedianOfN,
                   "ar1": Ar1}
#: What "default" means: ``last``. Without the burst learned (the monitor's default),
#: ``kalman`` errs less on request/reply transfers through the shaped testbed (``python -m
#: robot_offload.bench.predictors --online --burst none``): it discounts short transfers.
#: But the client's own transfers on a fast link are short and it discounts them all: after
#: a step from 5 to 100 Mbit/s its estimate stayed at 7-32 Mbit/s for 30 frames of an
#: interleaved bench run, while ``last`` reads the step at once (high, by the shaper's
#: bucket). With the burst learned (clean transfers), ``last`` is about as close as
#: ``kalman``, closer on a random walk.
DEFAULT_PREDICTOR = "last"


#: The type of each kind's one optional argument (none for "last").
_ARG_TYPES = {"kalman": float, "ewma": float, "log-ewma": float, "harmonic": int,
              "median": int, "ar1": int}
_SPEC_RE = re.compile(r"^\s*([a-z0-9-]+)\s*(?:\(\s*([^)]*?)\s*\))?\s*$")


def make_predictor(spec: str = "default") -> Predictor:
    """A fresh predictor from its name, e.g. ``kalman``, ``last``, ``ewma(0.3)``,
    ``harmonic(5)``, ``log-ewma`` (no argument: the class default; ``kalman(Q)``: another
    drift variance per second), ``default``. Anything else raises ValueError naming the
    known kinds."""
    spec = (spec or "default").strip()
    if spec == "default":
        spec = DEFAULT_PREDICTOR
    known = "known: default, " + ", ".join(sorted(PREDICTOR_KINDS))
    m = _SPEC_RE.match(spec)
    if not m or m.group(1) not in PREDICTOR_KINDS:
        raise ValueError(f"unknown predictor {spec!r}; {known} (an argument goes in "
                         "parentheses, e.g. ewma(0.3))")
    kind, arg = m.group(1), m.group(2)
    if not arg:
        return PREDICTOR_KINDS[kind]()
    if kind not in _ARG_TYPES:
        raise ValueError(f"predictor {kind!r} takes no argument, got {spec!r}")
    try:
        return PREDICTOR_KINDS[kind](_ARG_TYPES[kind](arg))
    except ValueError as e:
        raise ValueError(f"bad predictor {spec!r}: {e}") from e


@dataclass
class BandwidthMonitorConfig:
    """Settings of bandwidth_monitor (its ``~`` parameters)."""

    predictor: str = "default"          # make_predictor's spec
    rate_hz: float = 10.0               # BandwidthEstimate publishing rate (Hz)
    probe_period_s: float = 0.0         # active probe period (s); 0 = passive only
    probe_bytes: int = 256 * 1024       # probe payload, echoed back (bytes)
    probe_bytes_max: int = 4 * 1024 * 1024  # a too-short probe doubles up to this (bytes)
    probe_timeout_s: float = 2.0        # deadline of one probe (s)
    min_sample_s: float = MIN_TRANSFER_S    # shorter transfers on the link are ignored (s)
    learn_burst: bool = False           # learn a shaper's burst and add it back (LinkBurst)
    server_ns: str = "/offload_server"  # whom to probe

    def validate(self) -> "BandwidthMonitorConfig":
        checks.text("predictor", self.predictor)
        try:
            make_predictor(self.predictor)
        except ValueError as e:
            raise ConfigError(f"predictor: {e}") from e
        probe_bytes = checks.integer("probe_bytes", self.probe_bytes, 1, 1 << 30)
        return replace(
            self, rate_hz=checks.number("rate_hz", self.rate_hz, 0.0, 1000.0, low_open=True),
            probe_period_s=checks.number("probe_period_s", self.probe_period_s, 0.0, 86400.0),
            probe_bytes=probe_bytes,
            # a maximum below the start size means "do not grow"
            probe_bytes_max=max(probe_bytes, checks.integer("probe_bytes_max", self.probe_bytes_max, 1, 1 << 30)),
            probe_timeout_s=checks.number("probe_timeout_s", self.probe_timeout_s, 0.0, 3600.0, low_open=True),
            min_sample_s=checks.number("min_sample_s", self.min_sample_s, 0.0, 60.0),
            learn_burst=checks.flag("learn_burst", self.learn_burst),
            server_ns=checks.ros_namespace("server_ns", self.server_ns))
