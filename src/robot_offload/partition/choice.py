"""Measured latency settles what predictions cannot: :class:`MeasuredChoice` times the
close calls among plans (or modes) on real frames and serves the fastest, per bandwidth
bucket. ``layer_partition`` and ``lop`` choose among plans with it, ``auto`` among its
candidates."""

import math
import statistics
from collections import deque
from typing import Dict, Optional, Tuple

from robot_offload.errors import ConfigError


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
    that measures faster than that median is timed again on the next frames, until its
    window holds only fresh samples or one is not faster: a candidate probed every
    ``every`` frames keeps old samples for long, and two slow ones kept it out
    (``auto`` on MobileNetV2 at 100 Mbit/s: two early image offloads at 44 and 53 ms
    left lop serving at 35 ms, while its probes of the image measured 28 ms). A probe
    is a real frame (its outputs are used); it costs at most ``margin`` more than the
    prediction said, or less than the plan measures. Once a candidate has its samples in
    a bucket, its median there, not its prediction, keeps it a candidate; the plan a
    neighbouring bucket serves as its fastest is timed in a bucket that has not run it
    (:meth:`nearby_best`), and a candidate that measures slower here than in a neighbouring
    bucket, more recently timed there, is probed again (:meth:`contradicted`). Measurements are kept per plan key
    (cut and encoding), so they survive re-plans that keep the plan, and a plan whose ``link_free`` is true
    (all local) is measured once for every bucket: its latency does not depend on the link,
    and a noisy bandwidth estimate that hops between buckets would otherwise make each new
    bucket probe it again. A plan is anything with a ``key`` and a predicted
    ``latency_s``: lop uses it between a spatial schedule and the layer partition of the
    same bucket.

    A frame timed while background work ran on the robot (planning, see
    :mod:`robot_offload.background`; ``contended`` to :meth:`observe`) is a sample like
    the others until the first frame without it; then every such sample is dropped
    (:meth:`_drop_contended`), and the candidates left with fewer than ``min_samples``
    are timed again. The background slows the robot's compute more than a wait for the
    server, so its samples favour offloading, and they would decide for as long as
    nothing timed the candidates again (``every`` frames)."""

    def __init__(self, margin: float = 0.25, every: int = 20, window: int = 3, min_samples: int = 2,
                 known_margin: float = 0.10):
        if (not margin >= 0 or not known_margin >= 0 or every < 1 or window < 1
                or not 1 <= min_samples <= window):
            raise ConfigError("need margin >= 0, known_margin >= 0, every >= 1, window >= 1 and "
                              "1 <= min_samples <= window")
        self.margin, self.every, self.window, self.min_samples = margin, every, window, min_samples
        self.known_margin = known_margin
        #: (bucket, plan key) -> (latency_s, contended) of its last frames there
        self._latency: Dict[Tuple[object, object], deque] = {}
        #: plan key -> (measured / predicted latency, contended) of its last frames, in any bucket
        self._error: Dict[object, deque] = {}
        self._contended = False  # some samples (of either kind) were taken beside background work
        #: error group -> the plan keys observed in it (see :meth:`corrected_s`)
        self._groups: Dict[object, set] = {}
        self._since: Dict[object, int] = {}    # bucket -> frames since its last probe
        self._turn: Dict[object, int] = {}     # bucket -> periodic probes so far
        self._best: Dict[object, object] = {}  # bucket -> key of its fastest measured plan
        self._best_s: Dict[object, float] = {}  # ... and that plan's median there (s)
        #: bucket -> (key, probes left): a plan whose probe measured faster than the
        #: bucket's fastest, timed again until its window is all fresh samples
        self._confirm: Dict[object, Tuple[object, int]] = {}
        #: observations so far, and (bucket, plan key) -> the count at its last one (see
        #: :meth:`contradicted`)
        self._observed = 0
        self._last_at: Dict[Tuple[object, object], int] = {}
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
        the plan's; on fewer frames: unless they measured more than ``(1 + margin) ** 2``
        times the plan's median. Its latency in this bucket is the best evidence there is,
        whatever was predicted: an alternative that ran faster than the plan here used to be dropped
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
        if n and self.far_slower(bucket, plan, alternative):
            # Its first frame here measured slower than the plan by more than ``margin``
            # twice over: a second probe to confirm it costs as much again (KAPAO-L at
            # 50 Mbit/s: a cut probed at 729 ms beside a spatial schedule at 395, then
            # probed again at 707 ms).
            return False
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

    def far_slower(self, bucket, plan, alternative) -> bool:
        """Both have measured in ``bucket``, and ``alternative``'s median there is more
        than ``(1 + margin) ** 2`` times ``plan``'s: not worth a second probe."""
        ref, measured = self.median_s(bucket, plan), self.median_s(bucket, alternative)
        return ref is not None and measured is not None and measured > ref * (1 + self.margin) ** 2

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

    @classmethod
    def from_client_config(cls, c, measures_energy: bool = False) -> Optional["MeasuredChoice"]:
        """The measured choice a client's backends use (``probe_margin``, ``probe_every``,
        ``probe_known_margin``), or None where there is none: probing off
        (``probe_every`` 0), or the energy and deadline objectives for a caller that times
        its frames only (``measures_energy``: it observes each frame's cost by the
        objective, and gives the predicted costs as the plans' ``latency_s``)."""
        if int(c.probe_every) > 0 and (c.objective == "latency" or measures_energy):
            return cls(margin=c.probe_margin, every=int(c.probe_every), known_margin=c.probe_known_margin)
        return None

    def error_samples(self, plan) -> int:
        """How many measured / predicted ratios ``plan`` has, from frames in any bucket."""
        return len(self._error.get(plan.key, ()))

    def corrected_s(self, plan) -> Optional[float]:
        """``plan``'s prediction times the median measured / predicted ratio of its last
        frames in any bucket; with fewer than ``min_samples`` of them, of the last frames
        of every plan in its ``error_group`` where it has one; else None.

        A group is plans the cost model errs on alike: lop's spatial schedules (see
        :attr:`~robot_offload.partition.loss.LopPlan.error_group`). Each bucket's schedule
        has its own split and key, so a bucket reached for the first time ran its
        schedule uncorrected, and its first run is the slowest (new slab shapes): AGRNav
        on the indoor trace ran one predicted at 0.84 s in 3.4 s, beside layer partitions
        measured at 0.85 s, after another schedule had measured 1.8x its prediction."""
        errors = self._error.get(plan.key)
        if not errors or len(errors) < self.min_samples:
            group = getattr(plan, "error_group", None)
            errors = [x for key in self._groups.get(group, ()) for x in self._error.get(key, ())]
            if group is None or len(errors) < self.min_samples:
                return None
        return plan.latency_s * statistics.median(e for e, _ in errors)

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

    def contradicted(self, bucket, best, cands: Dict[object, object]):
        """A candidate of ``bucket`` whose median there is slower than ``best``'s, while in a
        neighbouring bucket it measured more than ``margin`` faster than ``best`` measures
        here, later than its last frame here; or None. At most one such probe every
        ``max(window, every // 2)`` frames per candidate and bucket.

        The bandwidth estimate hovers at a bucket's edge, and each bucket keeps its own
        samples: a few frames slowed by something else (the robot's CPU stalled for a
        moment: local took 60-130 ms against 28) left a candidate's median in one bucket at
        68 ms, and that bucket served the image offload at 53 ms for 40 of its frames,
        while the same candidate measured 28 ms in the next bucket, one bandwidth step
        away (MobileNetV2 at 20 Mbit/s on the testbed). A periodic probe every ``every``
        frames corrects it only when it lands on a quiet frame."""
        best_s = self.median_s(bucket, best) if isinstance(bucket, int) else None
        if best_s is None:
            return None
        gap = max(self.window, self.every // 2)
        for key, c in cands.items():
            here_s = self.median_s(bucket, c)
            if key == best.key or here_s is None or here_s <= best_s:
                continue
            here_at = self._last_at.get(self._mkey(bucket, c), -1)
            if self._observed - here_at < gap:
                continue
            for b in (bucket - 1, bucket + 1):
                there_s = self.median_s(b, c)
                if (there_s is not None and self._count(b, c) >= self.min_samples
                        and there_s * (1 + self.margin) < best_s
                        and self._last_at.get(self._mkey(b, c), -1) > here_at):
                    return c
        return None

    @staticmethod
    def _mkey(bucket, plan) -> Tuple[object, object]:
        return (None if getattr(plan, "link_free", False) else bucket, plan.key)

    def median_s(self, bucket, plan) -> Optional[float]:
        d = self._latency.get(self._mkey(bucket, plan))
        return statistics.median(s for s, _ in d) if d else None

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
        self._best[bucket], self._best_s[bucket] = best.key, medians[best.key]
        others = [c for c in cands.values() if c.key != best.key]
        under = [c for c in others if self._count(bucket, c) < self.min_samples]
        confirm = self._confirm.pop(bucket, None)
        if confirm is not None and not under and confirm[0] in cands and confirm[0] != best.key:
            key, left = confirm
            if left > 1:
                self._confirm[bucket] = (key, left - 1)
            self.probes += 1
            self.last["reason"] = "probe: confirming a faster measurement"
            return cands[key], True
        hint = None if under else self.contradicted(bucket, best, cands)
        if hint is not None:
            self._since[bucket] = 0
            self.probes += 1
            self.last["reason"] = "probe: faster in a neighbouring bucket"
            return hint, True
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
            self._error[key] = deque(((e * f, c) for e, c in errors), maxlen=errors.maxlen)

    def observe(self, bucket, plan, latency_s: float, contended: bool = False) -> None:
        """A frame of ``plan`` in ``bucket`` took ``latency_s`` (leave out frames that did
        more than infer, e.g. the one that measured the profile); ``contended``: background
        work ran on the robot during it (kept until a frame without, see the class)."""
        if not (math.isfinite(latency_s) and latency_s >= 0):
            return
        contended = bool(contended)
        if not contended and self._contended:
            self._drop_contended()
        self._latency.setdefault(self._mkey(bucket, plan), deque(maxlen=self.window)).append(
            (latency_s, contended))
        self._observed += 1
        self._last_at[self._mkey(bucket, plan)] = self._observed
        best = self._best.get(bucket)
        if best is not None and plan.key != best and latency_s < self._best_s[bucket]:
            # Faster than the bucket's fastest: its older samples (a probe every
            # ``every`` frames) may be stale spikes, so it is timed again at once.
            self._confirm.setdefault(bucket, (plan.key, self.window - 1))
        elif self._confirm.get(bucket, (None,))[0] == plan.key:
            del self._confirm[bucket]        # confirmed it is not faster: back to serving
        if plan.latency_s > 0 and math.isfinite(plan.latency_s):
            self._error.setdefault(plan.key, deque(maxlen=2 * self.window)).append(
                (latency_s / plan.latency_s, contended))
            group = getattr(plan, "error_group", None)
            if group is not None:
                self._groups.setdefault(group, set()).add(plan.key)
        self._contended = self._contended or contended

    def _drop_contended(self) -> None:
        """Forget every sample taken beside background work (latencies and errors), and
        the fastest plans and confirmations judged from them: the next :meth:`choose`
        of each bucket ranks what is left, and times again what has too few samples."""
        for samples in (self._latency, self._error):
            for key in list(samples):
                kept = [x for x in samples[key] if not x[1]]
                if kept:
                    samples[key] = deque(kept, maxlen=samples[key].maxlen)
                else:
                    del samples[key]
        self._best.clear()
        self._best_s.clear()
        self._confirm.clear()
        self._contended = False
