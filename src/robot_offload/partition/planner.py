"""The layer-partition planner: per bandwidth bucket, the cut and the transfer encoding that
minimise predicted latency or robot energy, subject to an output-error tolerance. Pure:
it reads a :class:`~robot_offload.partition.profile.Profile` and does arithmetic.

Each (cut, encoding) is predicted by the one cost model, :func:`robot_offload.partition.cost.predict_cut`
(latency: head, encode, up, RTT, server tail, down; energy: the state model).

Constraint: ``error_tolerance`` bounds the relative L-infinity error
(:func:`~robot_offload.partition.profile.output_error`) of what the backend returns against
the local outputs. Two encodings contribute: the robot's activation codec at the cut, whose
error is profiled (the maximum over the calibration inputs, which include the first real
frame) and taken ``error_safety`` times, and the server's ``output_codec``, whose error has
a known bound (:func:`output_error_bound`: 0 for raw, 2**-11 for float16, 1/(2**b - 1) for
the b-bit integer codecs). An encoding qualifies at an offloading cut if
``error * error_safety <= (error_tolerance - e_out) / (1 + e_out)`` with ``e_out`` the output
codec's bound (the two errors add, the second on outputs up to ``1 + error`` times as
large); lossless activation encodings qualify whenever the output codec alone fits, and
the output cut (all local) always. Only the profile's candidate cuts are considered. The
backend keeps a frame within the same budget when its crossing tensors range wider than in
calibration (see :meth:`~robot_offload.partition.profile.CutProfile.range_ratio`).

``robot_load`` and ``server_load`` are DynO's run-time scaling factors (measured / profiled
time); :class:`DriftTracker` maintains them and says when the plans must be rebuilt.
"""

import bisect
import math
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Tuple

from robot_offload import background, codec
from robot_offload.errors import ConfigError
from robot_offload.partition.cost import Prediction, objective_cost, output_bytes, predict_cut
from robot_offload.partition.graph import INPUT_CUT, OUTPUT_CUT
from robot_offload.partition.profile import (CutProfile, Profile, encoding_key, split_encoding)
from robot_offload.power import COMPUTE_W, IDLE_W, TRANSMIT_W

#: what plans minimise (:func:`~robot_offload.partition.cost.objective_cost`)
OBJECTIVES = ("latency", "energy", "deadline")


def bandwidth_buckets(lo_bps: float = 1e6, hi_bps: float = 200e6, n: int = 24) -> Tuple[float, ...]:
    """``n`` log-spaced bandwidths from ``lo_bps`` to ``hi_bps`` inclusive (bit/s)."""
    if not (0 < lo_bps < hi_bps) or n < 2:
        raise ConfigError("need 0 < lo_bps < hi_bps and n >= 2")
    r = (hi_bps / lo_bps) ** (1.0 / (n - 1))
    return tuple(lo_bps * r ** i for i in range(n))


@dataclass(frozen=True)
class PlannerConfig:
    objective: str = "latency"          # latency | energy | deadline (see cost.objective_cost)
    deadline_s: float = 0.1             # objective deadline: the latency a frame must meet
    error_tolerance: float = 0.005      # max relative output error (profile.output_error) of
                                        # the returned outputs: activation + output codec
    error_safety: float = 2.0           # profiled activation error * this must fit error_budget
    server_speedup: float = 10.0        # server time = robot time / speedup, until measured
    rtt_s: float = 0.002                # round-trip time of one request (s)
    compute_w: float = COMPUTE_W
    transmit_w: float = TRANSMIT_W
    idle_w: float = IDLE_W
    output_codec: str = "raw"           # how the server encodes the outputs
    buckets: Tuple[float, ...] = field(default_factory=bandwidth_buckets)
    encodings: Optional[Tuple[str, ...]] = None   # "codec/compression" keys; None: all profiled
    robot_load: float = 1.0             # measured / profiled robot time
    server_load: float = 1.0            # measured / estimated server time
    stripe_robot_load: float = 1.0      # lop: measured / predicted stripe times, on top of
    stripe_server_load: float = 1.0     # the load factors (see backends.lop.StripeCalibration)
    #: lop: (first cut id, last cut id, robot, server) stripe factors of the regions whose
    #: own stripes were measured; the two above serve every other region
    stripe_region_loads: Tuple[Tuple[str, str, float, float], ...] = ()
    tie_margin: float = 0.01            # objectives within this fraction of the best are
                                        # equal: the lowest profiled error among them wins
    spatial_overhead_s: float = 0.005   # lop: what a spatial frame costs beyond its modelled
                                        # transfers and stripes (see cost.predict_schedule)

    def validate(self) -> "PlannerConfig":
        if self.objective not in OBJECTIVES:
            raise ConfigError(f"unknown objective {self.objective!r}; known: {list(OBJECTIVES)}")
        if not self.deadline_s > 0:
            raise ConfigError("deadline_s must be > 0")
        if not self.error_tolerance >= 0 or not self.error_safety >= 1:
            raise ConfigError("error_tolerance must be >= 0 and error_safety >= 1")
        if not self.server_speedup > 0 or not self.rtt_s >= 0:
            raise ConfigError("server_speedup must be > 0 and rtt_s >= 0")
        if not (self.robot_load > 0 and self.server_load > 0 and self.stripe_robot_load > 0
                and self.stripe_server_load > 0
                and all(r > 0 and v > 0 for _, _, r, v in self.stripe_region_loads)):
            raise ConfigError("load factors must be > 0")
        if not 0 <= self.tie_margin < 1:
            raise ConfigError("tie_margin must be in [0, 1)")
        if not self.spatial_overhead_s >= 0:
            raise ConfigError("spatial_overhead_s must be >= 0")
        if self.output_codec not in codec.CODECS:
            raise ConfigError(f"unknown output codec {self.output_codec!r}")
        b = list(self.buckets)
        if not b or any(not v > 0 for v in b) or b != sorted(b):
            raise ConfigError("buckets must be increasing positive bandwidths")
        return self

    def stripe_loads(self, first_id: str, last_id: str) -> Tuple[float, float]:
        """(robot, server) stripe factors of the spatial region from cut ``first_id`` to
        cut ``last_id``: its own, if its stripes were measured, else the general ones."""
        for first, last, robot, server in self.stripe_region_loads:
            if first == first_id and last == last_id:
                return robot, server
        return self.stripe_robot_load, self.stripe_server_load


@dataclass(frozen=True)
class Plan:
    cut_id: str
    kind: str                 # input | inner | output
    label: str
    crossing: Tuple[str, ...]
    codec: str
    compression: str
    error: float              # profiled output error of this codec at this cut
    bandwidth_bps: float      # the bucket it was planned for
    prediction: Prediction

    @property
    def encoding(self) -> str:
        return encoding_key(self.codec, self.compression)

    @property
    def key(self) -> Tuple[str, str]:
        return (self.cut_id, self.encoding)

    @property
    def latency_s(self) -> float:
        """Predicted latency (s)."""
        return self.prediction.latency_s

    @property
    def link_free(self) -> bool:
        """Nothing crosses the link (all on the robot): its latency does not depend on
        the bandwidth, so a measurement in one bucket holds in all."""
        return self.kind == OUTPUT_CUT

    def describe(self) -> str:
        if self.kind == OUTPUT_CUT:
            return f"cut={self.label}"
        return f"cut={self.label} enc={self.codec}/{self.compression}"


def output_error_bound(output_codec: str) -> float:
    """Largest relative error (max|dy| / max|y|) the server's output encoding can add: 0 for
    raw, 2**-11 for float16 (round to nearest), and for the b-bit integer codecs half a step
    of a range that is at most 2 max|y| wide, 1/(2**b - 1), plus float32 rounding (as
    :func:`robot_offload.codec.tolerance`). Non-floating outputs are always sent raw."""
    if output_codec == "raw":
        return 0.0
    if output_codec == "float16":
        return 2.0 ** -11
    bits = codec.quant_bits(output_codec)
    if bits is not None:     # per channel: each range is narrower
        return (1.0 + 2e-3) / ((1 << bits) - 1)
    raise ConfigError(f"unknown output codec {output_codec!r}")


def error_budget(cfg: PlannerConfig) -> float:
    """What the activation encoding may err (after ``error_safety``) so that, with the
    output codec's error on top, the returned outputs stay within ``error_tolerance``:
    ``(tolerance - e_out) / (1 + e_out)``; negative when the output codec alone exceeds it."""
    e_out = output_error_bound(cfg.output_codec)
    return (cfg.error_tolerance - e_out) / (1.0 + e_out)


def admits(cfg: PlannerConfig, error: float) -> bool:
    """Whether an activation encoding with (profiled or estimated) output error ``error``
    qualifies at an offloading cut under ``cfg`` (see the module docstring)."""
    return error * cfg.error_safety <= error_budget(cfg)


def options(profile: Profile, cfg: PlannerConfig) -> List[Tuple[CutProfile, str, float]]:
    """Every (candidate cut, encoding, error) the planner may choose: the output cut, and
    the encodings measured at an offloading cut that :func:`admits` -- profiled error times
    ``error_safety`` (the profile's errors are maxima over a few calibration inputs; other
    inputs do worse) within what the output codec leaves of the tolerance."""
    encs = list(cfg.encodings) if cfg.encodings is not None else profile.encodings
    out = []
    for c in profile.candidates:
        if c.kind == OUTPUT_CUT:
            out.append((c, encoding_key("raw", "none"), 0.0))
            continue
        for e in encs:
            if c.wire_bytes(e) is None:
                continue
            err = c.codec_error(split_encoding(e)[0])
            if admits(cfg, err):
                out.append((c, e, err))
    return out


def _ranked(profile: Profile, bandwidth_bps: float, cfg: PlannerConfig,
            choices: Optional[List[Tuple[CutProfile, str, float]]] = None) -> List[tuple]:
    """(cut, encoding, error, prediction) of every choice (default :func:`options`) at
    ``bandwidth_bps``, best first. Choices whose objective is within ``cfg.tie_margin`` of
    the lowest come first, lowest error first: a prediction cannot tell 1 % apart (the
    measured prediction error is 5-15 %), while the error is what the application sees.
    Per-tensor ``int8`` and per-channel ``int8c`` of a camera image differ by 24 bytes,
    and ``int8c`` returns the image exactly where ``int8`` flipped ConvNeXt's top-1 on 3
    of 200 natural-statistics frames. The rest follow by objective, then fewer bytes up,
    then lower error (a stable sort: the earlier choice wins a full tie)."""
    choices = options(profile, cfg) if choices is None else choices
    if not choices:
        raise ConfigError(f"{profile.model}: no plan satisfies the constraints")
    down = output_bytes(profile, cfg.output_codec)
    scored = []
    for c, e, err in choices:
        background.checkpoint()         # hundreds of these make a re-plan's bucket
        p = predict_cut(profile, c, e, bandwidth_bps, cfg, down)
        obj = objective_cost(cfg, p.latency_s, p.energy_j)
        scored.append((obj, p.bytes_up, err, (c, e, err, p)))
    best = min(obj for obj, _, _, _ in scored)
    tied = best + cfg.tie_margin * abs(best)
    scored.sort(key=lambda s: (0, s[2], s[0], s[1]) if s[0] <= tied else (1, s[0], s[1], s[2]))
    return [entry for _, _, _, entry in scored]


def _first(ranked: List[tuple], bandwidth_bps: float, exclude_cut: Optional[str] = None,
           kind: Optional[str] = None) -> Optional[Plan]:
    """The first of :func:`_ranked`'s entries at another cut than ``exclude_cut`` (and of
    ``kind``), as a Plan; None if there is none."""
    for c, e, err, p in ranked:
        if c.id != exclude_cut and (kind is None or c.kind == kind):
            cd, z = split_encoding(e)
            return Plan(cut_id=c.id, kind=c.kind, label=c.label, crossing=tuple(c.crossing), codec=cd,
                        compression=z, error=err, bandwidth_bps=bandwidth_bps, prediction=p)
    return None


def best_plan(profile: Profile, bandwidth_bps: float, cfg: PlannerConfig,
              choices: Optional[List[Tuple[CutProfile, str, float]]] = None,
              exclude_cut: Optional[str] = None, kind: Optional[str] = None) -> Optional[Plan]:
    """The plan with the lowest objective at ``bandwidth_bps`` (within ``tie_margin`` of
    it: the lowest error; see :func:`_ranked`). ``exclude_cut`` / ``kind``: the best plan
    at any other cut / at a cut of that kind (None if there is none)."""
    return _first(_ranked(profile, bandwidth_bps, cfg, choices), bandwidth_bps, exclude_cut, kind)


def plan_for(profile: Profile, cut_id: str, encoding: str, bandwidth_bps: float,
             cfg: PlannerConfig) -> Plan:
    """A plan for a given cut and encoding (no optimisation, no tolerance check): to force
    a split, e.g. in tests and benchmarks."""
    c = profile.cut(cut_id)
    if c.kind == OUTPUT_CUT:
        encoding = encoding_key("raw", "none")
    p = predict_cut(profile, c, encoding, bandwidth_bps, cfg)
    cd, z = split_encoding(encoding)
    return Plan(cut_id=c.id, kind=c.kind, label=c.label, crossing=tuple(c.crossing), codec=cd,
                compression=z, error=c.codec_error(cd), bandwidth_bps=bandwidth_bps, prediction=p)


class PlanTable:
    """Plans computed once per bandwidth bucket; :meth:`lookup` is a bisection per frame."""

    def __init__(self, profile: Profile, cfg: PlannerConfig):
        self.profile = profile
        self.cfg = cfg.validate()
        choices = options(profile, cfg)
        self.buckets: Tuple[float, ...] = tuple(cfg.buckets)
        self.plans: List[Plan] = []
        #: per bucket, what :class:`MeasuredChoice` may try instead of the plan: the best
        #: plan at another cut, all local, and the best full offload (the input cut)
        self.alternatives: List[List[Plan]] = []
        for b in self.buckets:
            ranked = _ranked(profile, b, cfg, choices)    # one prediction per choice
            p = _first(ranked, b)
            alts = {}
            for a in (_first(ranked, b, p.cut_id), _first(ranked, b, p.cut_id, OUTPUT_CUT),
                      _first(ranked, b, p.cut_id, INPUT_CUT)):
                if a is not None:
                    alts.setdefault(a.key, a)
            self.plans.append(p)
            self.alternatives.append(list(alts.values()))

    def index(self, bandwidth_bps: float) -> int:
        """The bucket of ``bandwidth_bps``: the highest not above it (conservative); the
        lowest below the range, the highest above it."""
        if not bandwidth_bps > 0 or math.isnan(bandwidth_bps):
            return 0
        i = bisect.bisect_right(self.buckets, bandwidth_bps * (1 + 1e-9)) - 1
        return max(0, min(i, len(self.plans) - 1))

    def lookup(self, bandwidth_bps: float) -> Plan:
        """The plan of :meth:`index`'s bucket."""
        return self.plans[self.index(bandwidth_bps)]

    def chosen_cuts(self) -> List[str]:
        """Distinct cut ids over all buckets, in bucket order."""
        return list(dict.fromkeys(p.cut_id for p in self.plans))

    def predictions(self) -> Dict[Tuple[str, str], Dict[int, float]]:
        """Plan key -> {bucket index: predicted latency (s)}, plans and alternatives (what
        :meth:`MeasuredChoice.carry_errors` compares across a re-plan)."""
        out: Dict[Tuple[str, str], Dict[int, float]] = {}
        for i, (p, alts) in enumerate(zip(self.plans, self.alternatives)):
            for q in [p] + list(alts):
                out.setdefault(q.key, {})[i] = q.latency_s
        return out

    def rows(self) -> List[Dict]:
        """One dict per bucket, for logs and tables."""
        return [{"bandwidth_mbps": b / 1e6, "plan": p.describe(), "latency_ms": 1e3 * p.prediction.latency_s,
                 "energy_mj": 1e3 * p.prediction.energy_j, "bytes_up": p.prediction.bytes_up,
                 "error": p.error} for b, p in zip(self.buckets, self.plans)]


class DriftTracker:
    """DynO's run-time profiler: the ratio of measured to predicted compute time, for the
    robot and the server. :meth:`observe` returns True when a side's ratio moved more than
    ``threshold`` (relative) away from the one the current plans were made with, after
    ``min_samples`` of evidence since then: time to re-plan with :meth:`apply`.
    Measurements whose profiled time is below ``min_s`` are ignored: timer noise on
    sub-millisecond work would otherwise look like drift.

    The ratio is the weighted median of the side's recent samples, each weighing its
    profiled time against ``reference_s`` (the side's whole forward; at most 1), over the
    newest ``window`` of weight. Evidence counts the same way: a sample of a fifth of the
    model is a fifth of one. Why not a smoothed mean of the ratios, one per frame: a short
    piece of work errs far more than a whole forward, and errs the same way every time
    (its share of the profile's anchored total, fixed per-call costs, and under a CPU
    quota a burst that runs at full speed where the profile's back-to-back nodes ran
    throttled), so it is no sign of the device's load. With one vote per frame,
    DenseNet-121's head to ``features_pool0`` (profiled 25 ms, measured 8-9 ms on the
    0.5-CPU robot) set the robot's factor at 0.3 whenever layer_partition ran that cut,
    its whole forward (1.0) set it back, and the plans were rebuilt again and again in
    one benchmark run, each time with a near-local cut newly predicted fast enough to be run
    (120-150 ms where the bucket's plan ran 70-75); the robot factors of MobileNetV2
    swung between 0.65 and 2.0 and KAPAO's between 1.5 and 6.4.
    A median, unlike a mean, also takes one throttled frame for what it is; and a ratio
    that moved is drift only when the planned factor has left the samples' interquartile
    range (:meth:`drifted`)."""

    def __init__(self, threshold: float = 0.3, min_samples: float = 3.0, min_s: float = 1e-3,
                 window: float = 4.0, reference_s: Optional[Dict[str, float]] = None):
        if not threshold > 0 or not min_samples > 0 or min_s < 0 or not window >= min_samples:
            raise ConfigError("need threshold > 0, min_samples > 0, min_s >= 0 and window >= min_samples")
        self.threshold, self.min_samples, self.min_s, self.window = threshold, min_samples, min_s, window
        #: side -> its whole forward's profiled time (s); a sample weighs its own against it
        self.reference_s = {s: float(v) for s, v in (reference_s or {}).items() if v and v > 0}
        self.ratio = {"robot": 1.0, "server": 1.0}      # weighted median, measured / profiled
        self.planned = {"robot": 1.0, "server": 1.0}    # factors the current plans use
        self.samples = {"robot": 0, "server": 0}        # samples since the plans were made
        self.evidence = {"robot": 0.0, "server": 0.0}   # their weight
        self._recent: Dict[str, deque] = {"robot": deque(), "server": deque()}  # (ratio, weight)
        self._moved: set = set()     # sides that drifted since the last accept()

    def weight(self, side: str, predicted_s: float) -> float:
        """What one sample of ``predicted_s`` profiled seconds counts for (0-1]."""
        ref = self.reference_s.get(side)
        return 1.0 if ref is None else min(1.0, predicted_s / ref)

    def observe(self, side: str, predicted_s: float, measured_s: float, contended: bool = False) -> bool:
        """Fold in one measurement of ``side`` ("robot" or "server") whose profile-based
        time (load factor 1) is ``predicted_s``. ``contended``: it was timed while
        background work (planning) ran on the robot, so it is left out: it measures
        that work's share of the CPU, which ends with it, not the robot's load, and
        folded in it re-planned toward offloading (and started more background work)."""
        if side not in self.ratio:
            raise ConfigError(f"unknown side {side!r}")
        if contended or not (predicted_s > max(self.min_s, 1e-9) and measured_s >= 0
                             and math.isfinite(measured_s)):
            return False
        w = self.weight(side, predicted_s)
        recent = self._recent[side]
        recent.append((measured_s / predicted_s, w))
        held = sum(x[1] for x in recent)
        while len(recent) > 1 and held - recent[0][1] >= self.window:
            held -= recent.popleft()[1]
        self.ratio[side] = weighted_median(recent)
        self.samples[side] += 1
        self.evidence[side] += w
        moved = self.evidence[side] >= self.min_samples - 1e-9 and self.drifted(side)
        if moved:
            self._moved.add(side)
        return moved

    def drifted(self, side: str) -> bool:
        """The ratio moved more than ``threshold`` from the planned factor, and the planned
        factor is outside the interquartile range of the recent samples: three quarters
        of their weight on one side of it. Frames of 20-30 ms under a CPU quota are
        throttled once or twice, so their ratios fall in two clusters (MobileNetV2 0.7 and
        1.4), and a median of a few of them hops from one to the other: one benchmark run rebuilt
        MobileNetV2's plans 33 times on a robot whose load never changed."""
        planned = self.planned[side]
        if abs(self.ratio[side] / planned - 1.0) <= self.threshold:
            return False
        recent = self._recent[side]
        if not recent:
            return True
        return not weighted_quantile(recent, 0.25) <= planned <= weighted_quantile(recent, 0.75)

    def assume(self, side: str, factor: float) -> None:
        """Start ``side`` at ``factor`` (plans are being made with it)."""
        self.ratio[side] = self.planned[side] = factor
        self._recent[side].clear()

    def accept(self) -> Dict[str, float]:
        """The plans are being rebuilt: the sides that drifted (every side when none has,
        e.g. a forced re-plan) take their current ratios; returns the factors to plan
        with. A side that has not drifted keeps its factor: adopting its latest median
        too re-based it at every re-plan the other side caused, on noise (MobileNetV2:
        the robot factor moved 0.39-1.15 over 15 re-plans, most of them the
        server's)."""
        for side in self._moved or tuple(self.ratio):
            self.planned[side] = self.ratio[side]
            self.samples[side], self.evidence[side] = 0, 0.0
        self._moved.clear()
        return dict(self.planned)

    def apply(self, cfg: PlannerConfig) -> PlannerConfig:
        return replace(cfg, robot_load=self.planned["robot"], server_load=self.planned["server"])


def weighted_quantile(samples, q: float) -> float:
    """The ``q`` quantile (0-1) of ``(value, weight)`` pairs: the value at that share of
    their total weight (the mean of the two values either side when it falls exactly
    between them)."""
    items = sorted(samples)
    at = q * sum(w for _, w in items)
    acc = 0.0
    for k, (v, w) in enumerate(items):
        acc += w
        if acc > at + 1e-12:
            return v
        if abs(acc - at) <= 1e-12 and k + 1 < len(items):
            return (v + items[k + 1][0]) / 2.0
    return items[-1][0]


def weighted_median(samples) -> float:
    return weighted_quantile(samples, 0.5)
