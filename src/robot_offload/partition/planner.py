"""The layer-partition planner: per bandwidth bucket, the cut and the transfer encoding that
minimise predicted latency or robot energy, subject to an output-error tolerance. Pure:
it reads a :class:`~robot_offload.partition.profile.Profile` and does arithmetic.

Latency model of one inference with cut ``c`` and encoding ``e`` at bandwidth ``B``::

    head   = robot_load * head_s(c)                      robot computes the head
    encode = robot_load * encode_s(c, e)                 robot quantises / shuffles / compresses
    up     = bytes(c, e) * 8 / B                         crossing tensors go up
    server = measured tail time of c on the server, else tail_s(c) / server_speedup * server_load
    down   = output bytes * 8 / B                        outputs come down
    latency = head + encode + up + rtt + server + down   (the output cut: robot_load * forward_s)

Energy (the state model of :mod:`robot_offload.power`, phases in sequence)::

    energy = compute_w * (head + encode) + transmit_w * (up + down) + idle_w * (rtt + server)

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
import statistics
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Tuple

import torch

from robot_offload import codec
from robot_offload.errors import ConfigError
from robot_offload.partition.graph import INPUT_CUT, OUTPUT_CUT
from robot_offload.partition.profile import (CutProfile, Profile, encoding_key, split_encoding)
from robot_offload.power import COMPUTE_W, IDLE_W, TRANSMIT_W

OBJECTIVES = ("latency", "energy")


def bandwidth_buckets(lo_bps: float = 1e6, hi_bps: float = 200e6, n: int = 24) -> Tuple[float, ...]:
    """``n`` log-spaced bandwidths from ``lo_bps`` to ``hi_bps`` inclusive (bit/s)."""
    if not (0 < lo_bps < hi_bps) or n < 2:
        raise ConfigError("need 0 < lo_bps < hi_bps and n >= 2")
    r = (hi_bps / lo_bps) ** (1.0 / (n - 1))
    return tuple(lo_bps * r ** i for i in range(n))


@dataclass(frozen=True)
class PlannerConfig:
    objective: str = "latency"          # latency | energy
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
                                        # transfers and stripes (see loss.predict)

    def validate(self) -> "PlannerConfig":
        if self.objective not in OBJECTIVES:
            raise ConfigError(f"unknown objective {self.objective!r}; known: {list(OBJECTIVES)}")
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
class Prediction:
    latency_s: float
    energy_j: float
    head_s: float
    encode_s: float
    up_s: float
    server_s: float
    down_s: float
    bytes_up: float
    bytes_down: float


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


def output_bytes(profile: Profile, output_codec: str) -> float:
    """Bytes of the outputs as the server encodes them (uncompressed; without a per-channel
    codec's 8 bytes per channel, which the profile's leaf sizes do not give)."""
    bits = 16 if output_codec == "float16" else codec.quant_bits(output_codec)
    total = 0
    for numel, dtype in profile.output_leaves:
        floating = dtype in ("float32", "float64", "float16", "bfloat16")
        if bits is None or not floating:
            total += numel * torch.empty((), dtype=getattr(torch, dtype)).element_size()
        else:
            total += (numel * bits + 7) // 8
    return float(total)


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


def server_time(profile: Profile, cut: CutProfile, cfg: PlannerConfig) -> float:
    """The server's time for ``cut``'s tail: measured in this run if it was, else the
    robot's tail time / ``server_speedup`` x ``server_load``. (Times saved by an earlier
    run are not used per cut: a cut measured under another load would keep that time until
    chosen again; they seed ``server_load`` instead, see Profile.server_factor.)"""
    measured = profile.fresh_tail_s.get(cut.id)
    if measured is not None:
        return measured
    return cut.tail_s / cfg.server_speedup * cfg.server_load


def predict(profile: Profile, cut: CutProfile, encoding: str, bandwidth_bps: float,
            cfg: PlannerConfig, down_bytes: Optional[float] = None,
            up_bytes: Optional[float] = None, server_s: Optional[float] = None) -> Prediction:
    """Predicted latency and energy of ``cut`` with ``encoding`` at ``bandwidth_bps``.
    ``up_bytes`` / ``down_bytes`` / ``server_s``: what crosses the link and the server's
    time when the caller knows better than the profile (``auto``'s full offload of the
    camera image: the image's bytes, the server time its frames measured)."""
    if not bandwidth_bps > 0:
        raise ConfigError("bandwidth must be positive")
    if cut.kind == OUTPUT_CUT:
        t = profile.forward_s * cfg.robot_load
        return Prediction(t, cfg.compute_w * t, t, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    up_bytes = cut.wire_bytes(encoding) if up_bytes is None else up_bytes
    if up_bytes is None:
        raise ConfigError(f"cut {cut.id[:60]!r} has no measurement for {encoding}")
    down = output_bytes(profile, cfg.output_codec) if down_bytes is None else down_bytes
    head = cut.head_s * cfg.robot_load
    enc = cut.encode_s.get(encoding, 0.0) * cfg.robot_load
    up = up_bytes * 8.0 / bandwidth_bps
    dn = down * 8.0 / bandwidth_bps
    srv = server_time(profile, cut, cfg) if server_s is None else server_s
    latency = head + enc + up + cfg.rtt_s + srv + dn
    energy = cfg.compute_w * (head + enc) + cfg.transmit_w * (up + dn) + cfg.idle_w * (cfg.rtt_s + srv)
    return Prediction(latency, energy, head, enc, up, srv, dn, float(up_bytes), float(down))


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
        p = predict(profile, c, e, bandwidth_bps, cfg, down)
        obj = p.latency_s if cfg.objective == "latency" else p.energy_j
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
    p = predict(profile, c, encoding, bandwidth_bps, cfg)
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

    def observe(self, side: str, predicted_s: float, measured_s: float) -> bool:
        """Fold in one measurement of ``side`` ("robot" or "server") whose profile-based
        time (load factor 1) is ``predicted_s``."""
        if side not in self.ratio:
            raise ConfigError(f"unknown side {side!r}")
        if not (predicted_s > max(self.min_s, 1e-9) and measured_s >= 0 and math.isfinite(measured_s)):
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


def _describe(plan) -> str:
    describe = getattr(plan, "describe", None)
    return describe() if callable(describe) else str(plan.key)


class MeasuredChoice:
    """Measured latency decides between the planned plan and its alternatives when the
    prediction cannot.

    DynO's re-planning (:class:`DriftTracker`) corrects the profile from what frames
    measure, but a plan only times the side it runs on: the input cut never times the
    robot, the output cut never the server, so a stale profile of the other side is never
    corrected, and the planner's 3-49 % prediction error decides close calls at random
    (a planner choosing full offload at 1.43 s predicted against 1.50 s for a local
    forward that now takes 1.26 s). Per bandwidth bucket, the alternatives predicted
    within ``margin`` of the plan (:attr:`PlanTable.alternatives`: the best plan at another
    cut, all local, the best full offload), those predicted faster than the plan measures,
    and all local whatever its prediction (:meth:`candidate`), are run and timed too: each
    as a probe until it has ``min_samples`` measurements (once the plan has one), then one
    of them in turn every ``every`` frames of the bucket; an alternative that has run
    elsewhere is no probe in a new bucket when its prediction, corrected by the error it
    measured, is more than ``known_margin`` slower than the plan's corrected the same way
    (:meth:`ruled_out`); a new bucket starts from the plan, or from an alternative whose
    corrected prediction is more than ``known_margin`` faster (:meth:`lead`); between
    probes the bucket serves
    the candidate whose median of the last ``window`` measured latencies is lowest. A probe
    is a real frame (its outputs are used); it costs at most ``margin`` more than the
    prediction said, or less than the plan measures. Once a candidate has its samples in
    a bucket, its median there, not its prediction, keeps it a candidate; the plan a
    neighbouring bucket serves as its fastest is timed in a bucket that has not run it
    (:meth:`nearby_best`). Measurements are kept per plan key
    (cut and encoding), so they survive re-plans that keep the plan, and a plan whose ``link_free`` is true
    (all local) is measured once for every bucket: its latency does not depend on the link,
    and a noisy bandwidth estimate that hops between buckets would otherwise make each new
    bucket probe it again. A plan is anything with a ``key`` and a predicted
    ``latency_s``: lop uses it between a spatial schedule and the layer partition of the
    same bucket."""

    def __init__(self, margin: float = 0.25, every: int = 20, window: int = 3, min_samples: int = 2,
                 known_margin: float = 0.10):
        if (not margin >= 0 or not known_margin >= 0 or every < 1 or window < 1
                or not 1 <= min_samples <= window):
            raise ConfigError("need margin >= 0, known_margin >= 0, every >= 1, window >= 1 and "
                              "1 <= min_samples <= window")
        self.margin, self.every, self.window, self.min_samples = margin, every, window, min_samples
        self.known_margin = known_margin
        self._latency: Dict[Tuple[object, object], deque] = {}
        #: plan key -> measured / predicted latency of its last frames, in any bucket
        self._error: Dict[object, deque] = {}
        self._since: Dict[object, int] = {}    # bucket -> frames since its last probe
        self._turn: Dict[object, int] = {}     # bucket -> periodic probes so far
        self._best: Dict[object, object] = {}  # bucket -> key of its fastest measured plan
        self.probes = 0
        #: why the last :meth:`choose` picked what it did, for the frame's stats: ``reason``
        #: (planned, lead, fewer samples, periodic probe, fastest measured) and the
        #: candidates' measured medians in the bucket (ms; None before their first frame)
        self.last: Dict[str, object] = {}

    def close_call(self, plan, alternative) -> bool:
        """``alternative`` is predicted within ``margin`` of ``plan``."""
        return (alternative is not None and alternative.key != plan.key
                and alternative.latency_s <= plan.latency_s * (1 + self.margin))

    def candidate(self, bucket, plan, alternative) -> bool:
        """Whether ``alternative`` is run and timed beside ``plan`` in ``bucket``.

        Measured here (``min_samples`` frames): while its median is within ``margin`` of
        the plan's. Its latency in this bucket is the best evidence there is, whatever was
        predicted: an alternative that ran faster than the plan here used to be dropped
        when it was no close call by prediction, and the bucket went back to the slower
        plan (MobileNetV2 at 100 Mbit/s on the testbed: the input cut measured
        25 ms, served a cut measured 30).

        Not yet measured here: the plan a neighbouring bucket serves as the fastest it
        measured (:meth:`nearby_best`); a close call; one predicted faster than the plan's
        measured median; all local whatever its prediction -- unless :meth:`ruled_out`
        (never for the neighbour's pick).

        All local is the one alternative measured whatever its prediction, because being
        wrong about it is what costs most on the small models (MobileNetV2, RegNetY: a
        profile that predicted all local 1.3x slower than the plan while it ran 1.3x
        faster, so it was never timed and the bucket kept offloading) and because timing
        it is cheap: its measurements serve every bucket (see :meth:`_mkey`), so a run
        pays ``min_samples`` frames of it once, not once per bucket."""
        if alternative is None or alternative.key == plan.key:
            return False
        n = self._count(bucket, alternative)
        ref = self.median_s(bucket, plan)
        if n >= self.min_samples:
            return ref is None or self.median_s(bucket, alternative) <= ref * (1 + self.margin)
        if self.nearby_best(bucket, alternative):
            return True
        if n == 0 and self.ruled_out(plan, alternative):
            return False
        if self.close_call(plan, alternative):
            return True
        if not getattr(alternative, "link_free", False):
            # Or the plan measures slower than the alternative is predicted: the
            # prediction that ruled it out is wrong (lop's LOSS chose all local under a
            # robot load factor of 0.5, measured 80 ms, while the layer partition it
            # ruled out, predicted 50 ms, ran 55 ms and was never timed).
            return ref is not None and alternative.latency_s < ref
        return True

    def nearby_best(self, bucket, plan) -> bool:
        """``plan`` is what a neighbouring bucket (index +-1, one bandwidth step) served
        last as the fastest it measured. The bandwidth estimate hops between neighbouring
        buckets every few frames, and their plans' latencies differ by a bandwidth step
        at most; a bucket that had never timed its neighbour's fastest plan kept serving
        its own plan, measured slower (DenseNet-121 at 50 Mbit/s on the testbed:
        lop's spatial schedule at 86 ms for 7 frames while the input cut ran 74 ms in the
        next bucket). Buckets that are not integers have no neighbours."""
        if not isinstance(bucket, int):
            return False
        return any(self._best.get(b) == plan.key for b in (bucket - 1, bucket + 1))

    def corrected_s(self, plan) -> Optional[float]:
        """``plan``'s prediction times the median measured / predicted ratio of its last
        frames in any bucket (None before ``min_samples`` of them)."""
        errors = self._error.get(plan.key)
        if not errors or len(errors) < self.min_samples:
            return None
        return plan.latency_s * statistics.median(errors)

    def ruled_out(self, plan, alternative) -> bool:
        """Both plans have run, in this bucket or others, and ``alternative``'s prediction
        corrected by its measured error is more than ``known_margin`` slower than the plan's
        corrected the same way: not worth a first probe in a bucket where it has not run
        (once it has, its latency there decides, see :meth:`candidate`).

        A plan's prediction errs by about the same factor in every bucket (its compute
        times, its per-call costs; the bandwidth is what changes), while its latency does
        not carry over. On a bandwidth trace the estimate crosses a bucket every few
        frames, and each new bucket used to time every close call again: ConvNeXt-T's
        frames on the indoor trace were probes in 7 of 10, of cuts
        predicted within 25 % of the bucket's plan and measured 25 % slower in the buckets
        before."""
        ap, pp = self.corrected_s(alternative), self.corrected_s(plan)
        return ap is not None and pp is not None and ap > pp * (1 + self.known_margin)

    @staticmethod
    def _mkey(bucket, plan) -> Tuple[object, object]:
        return (None if getattr(plan, "link_free", False) else bucket, plan.key)

    def median_s(self, bucket, plan) -> Optional[float]:
        d = self._latency.get(self._mkey(bucket, plan))
        return statistics.median(d) if d else None

    def _count(self, bucket, plan) -> int:
        return len(self._latency.get(self._mkey(bucket, plan), ()))

    def lead(self, bucket, plan, alternatives):
        """The plan ``bucket`` is judged from: ``plan``, unless it has not run in this
        bucket and an alternative is predicted, both corrected by their measured errors
        (:meth:`corrected_s`), more than ``known_margin`` faster; then the fastest such
        alternative leads, and ``plan`` is a candidate beside it only as :meth:`candidate`
        allows (so not while it is ruled out).

        Without this the planned plan ran first in every new bucket however it had
        measured elsewhere, and the bandwidth estimate crosses buckets every few frames (on
        the testbed's constant 100 Mbit/s link too, MobileNetV2's estimates ranged
        0.6-169 Mbit/s, and lop's spatial schedule at 50 Mbit/s,
        predicted at least 5 % faster than the layer partition, ran 55 % slower in 5 of
        21 frames)."""
        pp = self.corrected_s(plan)
        if pp is None or self._count(bucket, plan):
            return plan
        best, best_s = plan, pp
        for a in alternatives or ():
            if a.key == plan.key:
                continue
            s = self.corrected_s(a)
            if s is not None and s * (1 + self.known_margin) < pp and s < best_s:
                best, best_s = a, s
        return best

    def choose(self, bucket, plan, alternatives,
               handicap: Optional[Dict[object, float]] = None) -> Tuple[object, bool]:
        """(the plan to run, whether it is a probe). ``handicap``: plan key -> a factor
        (>= 1) its measured median is multiplied by when the candidates are ranked: a plan
        that must measure that much faster than the others to be served (lop gives its
        spatial schedules one, see :class:`~robot_offload.backends.lop.LopBackend`)."""
        alternatives = list(alternatives or ())
        lead = self.lead(bucket, plan, alternatives)
        led = lead is not plan
        if led:
            alternatives, plan = [plan] + [a for a in alternatives if a is not lead], lead
        cands = {plan.key: plan}
        for a in alternatives:
            if self.candidate(bucket, plan, a):
                cands.setdefault(a.key, a)
        medians = {k: self.median_s(bucket, c) for k, c in cands.items()}
        self.last = {"led": led, "medians_ms": {
            _describe(c): (None if medians[k] is None else round(medians[k] * 1e3, 1))
            for k, c in cands.items()}}
        if len(cands) == 1 or medians[plan.key] is None:
            self.last["reason"] = "lead" if led else "planned"
            return plan, False
        handicap = handicap or {}
        best = min((c for k, c in cands.items() if medians[k] is not None),
                   key=lambda c: medians[c.key] * max(1.0, handicap.get(c.key, 1.0)))
        self._best[bucket] = best.key
        others = [c for c in cands.values() if c.key != best.key]
        under = [c for c in others if self._count(bucket, c) < self.min_samples]
        if under or self._since.get(bucket, 0) >= self.every:
            self._since[bucket] = 0
            self.probes += 1
            if under:
                self.last["reason"] = "probe: fewer than min_samples"
                return under[0], True
            turn = self._turn.get(bucket, 0)
            self._turn[bucket] = turn + 1
            self.last["reason"] = "probe: periodic"
            return others[turn % len(others)], True
        self._since[bucket] = self._since.get(bucket, 0) + 1
        self.last["reason"] = "fastest measured"
        return best, False

    def carry_errors(self, old: Dict[object, Dict[int, float]], new: Dict[object, Dict[int, float]]) -> None:
        """The plans were predicted again (new load or stripe factors): ``old`` and ``new``
        map plan keys to {bucket index: predicted latency} of the tables before and after.
        The measured / predicted ratios of a key ``old`` predicted are moved onto the new
        predictions (times the median old / new prediction over the buckets where both
        predict it), or dropped where ``new`` does not predict it there; other keys' stay.

        A plan keeps its key across re-plans while its prediction moves with the factors.
        KAPAO's spatial schedule with no saved profile (a KAPAO-only run) was predicted at
        106-206 ms under the speed-up guess and measured 320-390 ms; once the server's load
        factor was measured, the same schedule was predicted at 295 ms, but the old ratios
        (2-3x) corrected that to 800 ms and the layer partition led every bucket of the
        indoor and outdoor traces. Dropping them instead cost the small models their
        errors at every re-plan (MobileNetV2: 29 in one run), and with them the rule that
        keeps known slow alternatives from being probed in each new bucket."""
        for key in [k for k in self._error if k in old]:
            o, n = old[key], new.get(key, {})
            scale = [o[b] / n[b] for b in o if b in n and o[b] > 0 and n[b] > 0]
            if not scale:
                del self._error[key]
                continue
            f = statistics.median(scale)
            errors = self._error[key]
            self._error[key] = deque((e * f for e in errors), maxlen=errors.maxlen)

    def observe(self, bucket, plan, latency_s: float) -> None:
        """A frame of ``plan`` in ``bucket`` took ``latency_s`` (leave out frames that did
        more than infer, e.g. the one that measured the profile)."""
        if math.isfinite(latency_s) and latency_s >= 0:
            self._latency.setdefault(self._mkey(bucket, plan), deque(maxlen=self.window)).append(latency_s)
            if plan.latency_s > 0 and math.isfinite(plan.latency_s):
                self._error.setdefault(plan.key, deque(maxlen=2 * self.window)).append(
                    latency_s / plan.latency_s)
