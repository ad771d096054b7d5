"""``auto``: per frame, the fastest way to run it (or the cheapest in joules).

Two kinds of candidate:

* what ``lop`` runs for the frame's predicted bandwidth: its own choice among every
  layer partition (all local and full offload of the input tensor included) and its
  spatial schedules, with their profiles, drift factors and measured latencies (shared
  with ``layer_partition`` and ``lop`` of the same client, see
  :class:`~robot_offload.backends.layer_partition.PartitionKnowledge`);
* for image models fed camera frames, ``full_offload`` of the camera image itself (uint8,
  preprocessing on the server): a quarter of the float tensor's bytes; as JPEG when the
  user asked for lossy frames (``input_jpeg_quality``), its bytes then the JPEG's.

Both are predicted with the one cost model (:mod:`robot_offload.partition.cost`:
the image's bytes up, the outputs' bytes down, the server time its frames measured), each
kind of prediction corrected by its own measured error (:class:`PredictionErrors`). The
frame's bucket is layer partitioning's bandwidth bucket; within a bucket the choice is
:class:`~robot_offload.partition.choice.MeasuredChoice`'s: the candidates predicted close
to each other are timed on real frames and the fastest median serves, with periodic
probes -- hysteresis that does not thrash on one noisy frame and follows a step change of
the bandwidth as soon as the estimate crosses into another bucket. With the energy
objective the choice is the same on each frame's joules (the client's: a power sensor's
where it has one, else the state model's over what the frame did) against the predicted
joules: the cost model's energy errs as its latency does, and only a frame's measurement
corrects it. With ``~objective: deadline`` it is on each frame's joules where the frame met
``~deadline_s``, and on its latency, ranked after every frame that met it, where it did not
(:func:`~robot_offload.partition.cost.objective_cost`): the fewest joules of the
candidates whose median frame meets the deadline, else the fastest. With probing off the
lower prediction serves.

A candidate that fails (server down, deadline) raises like any backend: the client
computes the frame locally, so a switch never loses a frame. The frame's stats say what
ran and why: ``plan`` starts with ``auto:`` and ``detail_json`` holds ``auto``: the
candidate, the reason, and the predicted cost of each candidate.
"""

import logging
import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Dict, Optional

from robot_offload import background, frame_codec
from robot_offload.backends.base import Backend, register_backend
from robot_offload.backends.full_offload import FullOffloadBackend
from robot_offload.backends.local import LocalBackend
from robot_offload.backends.lop import LopBackend
from robot_offload.partition.cost import objective_cost, predict_cut
from robot_offload.partition.graph import INPUT_CUT, OUTPUT_CUT
from robot_offload.partition.choice import MeasuredChoice
from robot_offload.partition.profile import encoding_key

log = logging.getLogger(__name__)

#: candidate keys (what ``detail_json``'s ``auto.candidate`` names)
LOP = "lop"
IMAGE = "full_offload_image"
LOCAL = "local"     # only while a shape's schedules are prepared
#: what a lop frame runs, for the prediction errors (see :class:`PredictionErrors`)
LOP_PARTITION = "lop:layer_partition"
LOP_SPATIAL = "lop:spatial"


@dataclass(frozen=True)
class _Option:
    """A candidate as :class:`MeasuredChoice` sees it: a key and a prediction. ``kind``
    says what the prediction is of (:data:`IMAGE`, :data:`LOP_PARTITION` or
    :data:`LOP_SPATIAL`); ``raw_latency_s`` is the cost model's latency before the
    correction by measured errors (``latency_s`` after it)."""

    key: str
    latency_s: float
    energy_j: float
    link_free: bool = False
    kind: str = ""
    raw_latency_s: float = 0.0

    def describe(self) -> str:
        return self.key


class PredictionErrors:
    """Measured / predicted latency of the last frames, per kind of prediction.

    ``lop`` is one candidate to the measured choice (lop makes its own choice between its
    spatial schedule and layer partitions), but the cost model errs differently on the
    two: on the testbed, MobileNetV2's layer partitions ran at 0.87x their prediction and
    the image offload at 0.84x, while a spatial schedule never run before took 2.5x. With
    one error for ``lop`` the partitions' corrected the spatial schedule's prediction, and
    in a bucket no frame had timed, the schedule (predicted 38 ms, below the image's 42)
    was run and took 94 ms where the image, corrected by its own error, was the better
    guess (35 ms). Each kind is corrected by its own frames only, and a kind with fewer
    than ``min_samples`` is taken as predicted."""

    def __init__(self, window: int = 6, min_samples: int = 2):
        self.window, self.min_samples = window, min_samples
        self._ratios: Dict[str, deque] = {}

    def factor(self, kind: str) -> float:
        ratios = self._ratios.get(kind)
        if not ratios or len(ratios) < self.min_samples:
            return 1.0
        return statistics.median(ratios)

    def correct(self, option: _Option) -> _Option:
        raw_s = option.raw_latency_s or option.latency_s
        return replace(option, latency_s=raw_s * self.factor(option.kind), raw_latency_s=raw_s)

    def observe(self, kind: str, predicted_s: float, measured_s: float, contended: bool = False) -> None:
        """``contended``: background work ran on the robot during the frame: left out
        (:mod:`robot_offload.background`); the kind keeps its last factor meanwhile."""
        if predicted_s > 0 and measured_s >= 0 and not contended:
            self._ratios.setdefault(kind, deque(maxlen=self.window)).append(measured_s / predicted_s)


@register_backend
class AutoBackend(Backend):
    name = "auto"
    needs_server = True

    #: a candidate never measured is timed when predicted at most this many times the
    #: leader's latency (see :meth:`_first_probe`): the cost model's error on a candidate
    #: no frame has timed, about 1.5x at most on the testbed, with room to spare. At 3x,
    #: KAPAO-L at 20 Mbit/s timed the image offload twice (1.22 s each, predicted 2.9x
    #: lop's 0.41 s), and the cell's mean came out 14 % above lop's.
    first_probe_factor = 2.0
    #: while a shape's plans are prepared, the image is offloaded when its upload takes at
    #: most this share of the deadline (see :meth:`_while_preparing`)
    prepare_upload_share = 0.5
    #: while frames compute, a shape's preparation runs at most this share of the time
    #: (see :mod:`robot_offload.background`)
    prepare_cpu_share = 0.25

    def __init__(self, ctx):
        super().__init__(ctx)
        self.lop = LopBackend(ctx)
        self.full = FullOffloadBackend(ctx)
        self.local = LocalBackend(ctx)
        self.choice: Optional[MeasuredChoice] = MeasuredChoice.from_client_config(ctx.config, measures_energy=True)
        self.errors = PredictionErrors()
        # bytes sent / image bytes of the last image offload (compression); None: none yet
        self._up_ratio: Optional[float] = None
        self._preparing: Dict[tuple, threading.Thread] = {}   # shape -> its background preparation
        self._prepare_failed: set = set()                      # shapes whose preparation failed (logged)

    # -- tensors: only lop's candidates exist ------------------------------------------
    def infer(self, x, stats, timeout_s):
        y = self.lop.infer(x, stats, timeout_s)
        self._mark(stats, LOP, "only candidate (a tensor, not a camera image)", {})
        return y

    # -- camera frames ----------------------------------------------------------------------
    def infer_frame(self, frame, stats, timeout_s):
        if self.ctx.spec.input_kind != "image":
            return self._run_lop(frame, stats, timeout_s, "only candidate (not an image model)")
        why_not = self.full.frame_refusal(frame)
        if why_not:     # full offload would send the tensor: one of lop's own cuts
            return self._run_lop(frame, stats, timeout_s, f"only candidate (image offload: {why_not})")
        shape = self._shape()
        st = self.lop._states.get(shape)
        if st is None or shape not in self.lop._lop:
            return self._while_preparing(frame, stats, timeout_s)
        bw = self.lop.frame_bandwidth(stats)
        i = st.table.index(bw)
        lop_options = self._lop_options(st, bw)
        options = {LOP: self._best(lop_options.values()),
                   IMAGE: self.errors.correct(self._image_option(st, frame, bw))}
        predicted = {k: {"latency_ms": round(o.raw_latency_s * 1e3, 2),
                         "corrected_latency_ms": round(o.latency_s * 1e3, 2),
                         "energy_mj": round(o.energy_j * 1e3, 2), "of": o.kind}
                     for k, o in options.items()}
        # what the measured choice compares: the options' predicted cost by the objective
        ranked = sorted((self._judged(o) for o in options.values()), key=lambda o: o.latency_s)
        if self.choice is None:
            chosen, reason = ranked[0], self._predicted_reason(options[ranked[0].key])
        else:
            chosen, reason = self._first_probe(ranked, i), "probe: never measured"
            if chosen is None:
                chosen, _probe = self.choice.choose(i, ranked[0], ranked[1:])
                reason = str(self.choice.last.get("reason", ""))
        chosen = options[chosen.key]
        t0 = time.perf_counter()
        if chosen.key == IMAGE:
            y = self.full.infer_frame(frame, stats, timeout_s)
            stats.predicted_latency_s = chosen.raw_latency_s
            # the server's whole forward, measured: the input cut's tail time in the profile
            # (DynO's run-time profiler), so lop's full offload is predicted from it too
            if stats.executed_mode != "local":       # not a frame the robot's hedge answered
                st.profile.record_server_tail(self._input_cut(st).id, stats.server_compute_s,
                                              device=self.ctx.link.device)
            if frame.nbytes:
                self._up_ratio = max(1e-3, stats.bytes_up / frame.nbytes)
        else:
            y = self.lop.infer(self.ctx.preprocess(frame, stats), stats, timeout_s)
        # a lop frame that solved its schedules or set up new slab shapes is no sample of
        # what lop costs (one such frame, 323 ms against 60, kept MobileNetV2 at 5 Mbit/s
        # on the image offload for a whole run)
        if stats.extra.get("lop", {}).get("timed", True):
            measured_s = time.perf_counter() - t0
            contended = background.contended()
            ran = chosen if chosen.key == IMAGE else lop_options.get(
                LOP_SPATIAL if stats.extra["lop"].get("spatial") else LOP_PARTITION)
            if ran is not None:
                self.errors.observe(ran.kind, ran.raw_latency_s, measured_s, contended)
            if self.choice is not None:
                energy_j = (self.ctx.frame_energy_j(stats, t0, t0 + measured_s)
                            if self.ctx.config.objective != "latency" else None)
                self.choice.observe(i, self._judged(chosen),
                                    objective_cost(self.ctx.config, measured_s, energy_j), contended)
        detail = {"predicted": predicted, "bucket": i, "bandwidth_bps": bw}
        if self.choice is not None:
            # the choice's medians: of the frames' joules with the energy and deadline
            # objectives (a frame past the deadline: MISSED_DEADLINE_J per deadline of latency)
            unit = "medians_ms" if self.ctx.config.objective == "latency" else "medians_mj"
            detail[unit] = self.choice.last.get("medians_ms", {})
        self._mark(stats, chosen.key, reason, detail)
        return y

    def _while_preparing(self, frame, stats, timeout_s):
        """A frame of a shape whose schedules are not there yet. Profile and schedules
        take seconds on an idle robot (minutes on an oversubscribed one), so they are
        prepared on a background thread meanwhile. Once the profile is there (at once when
        it was cached), the cost model picks between the local model and the camera
        image's offload; before, the image is offloaded when its upload at the predicted
        bandwidth takes at most :attr:`prepare_upload_share` of the deadline. Otherwise (a
        slow link, or preparing failed) the frame is lop's first, which prepares them
        itself, as a frame that cannot be offloaded must wait for them."""
        shape = self._shape()
        bw = self.lop.frame_bandwidth(stats)
        upload_s = 8.0 * self._upload_bytes(frame) / bw
        st = self.lop._states.get(shape)        # made before the schedules are solved
        if shape not in self._prepare_failed and (
                st is not None or upload_s <= self.prepare_upload_share * timeout_s):
            self._start_preparing(shape, frame)
            why = "the schedules of this input shape are being prepared in the background"
            if st is not None:
                local = self._local_option(st, bw)
                image = self.errors.correct(self._image_option(st, frame, bw))
                predicted = {o.key: {"latency_ms": round(o.latency_s * 1e3, 2),
                                     "energy_mj": round(o.energy_j * 1e3, 2)} for o in (local, image)}
                if self._cost(local) < self._cost(image):
                    y = self.local.infer(self.ctx.preprocess(frame, stats), stats, timeout_s)
                    self._mark(stats, LOCAL, f"{why}: the local model is predicted cheaper than "
                               "the image's offload", {"bandwidth_bps": bw, "predicted": predicted})
                    return y
            y = self.full.infer_frame(frame, stats, timeout_s)
            self._mark(stats, IMAGE, f"{why}: the camera image is offloaded meanwhile",
                       {"bandwidth_bps": bw})
            return y
        preparing = self._preparing.get(shape)
        if preparing is not None and preparing.is_alive():
            with background.GATE.waiting():     # it must not yield to this frame
                preparing.join()           # not twice at once: wait for the one under way
            if shape in self.lop._lop:
                return self.infer_frame(frame, stats, timeout_s)
        return self._run_lop(frame, stats, timeout_s, "first frame (prepares the profile and schedules)")

    def _start_preparing(self, shape, frame) -> None:
        if shape in self._preparing:
            return
        # the model input made now, on the frame's thread: the caller may reuse its buffer
        x = self.ctx.spec.preprocess(frame, self.ctx.input_size).clone()

        def prepare():
            t0 = time.perf_counter()
            try:
                self.lop.lop_state(x)
            except Exception:  # noqa: BLE001 - a failure must reach the frames, not kill the node
                log.exception("auto: preparing the plans of %s failed; its next frame prepares them", shape)
                self._prepare_failed.add(shape)
                return
            log.info("auto: plans of %s prepared in the background in %.1f s", shape, time.perf_counter() - t0)
        self._preparing[shape] = background.start(prepare, "auto-prepare", self.prepare_cpu_share)

    def _first_probe(self, ranked, bucket):
        """A candidate measured on fewer than ``min_samples`` frames in any bucket and
        predicted within :attr:`first_probe_factor` of the leader, or None. The cost model
        errs most on what a frame has never timed (the image's server time before any image
        went up: MobileNetV2's predicted 45-50 ms on the testbed, measured 32), and only
        measured ratios correct it (:meth:`MeasuredChoice.lead`); a candidate predicted far
        slower (an upload over a dead link) is not worth the frame. Nor is a second probe
        of one whose first, in this ``bucket``, measured more than ``(1 + margin) ** 2``
        times the leader's median there (:meth:`MeasuredChoice.far_slower`, as
        :meth:`MeasuredChoice.candidate` rules for its own probes) (KAPAO-L at 20 Mbit/s: the image probed at 1.51 s beside lop's
        0.75, then again at 1.47)."""
        lead = ranked[0]
        for o in ranked[1:]:
            n = self.choice.error_samples(o)
            if (n < self.choice.min_samples and o.latency_s <= lead.latency_s * self.first_probe_factor
                    and not (n and self.choice.far_slower(bucket, lead, o))):
                return o
        return None

    # -- predictions ----------------------------------------------------------------------
    def _lop_options(self, st, bw: float) -> Dict[str, _Option]:
        """What lop may run here, predicted at the frame's bandwidth by the cost model and
        corrected by each kind's measured errors: :data:`LOP_PARTITION`, the best, by
        the objective, of layer partitioning's plan for the bucket and its alternatives
        (all local, the best full offload of the tensor, the best plan at another cut:
        lop's measured choice serves the fastest of them); and :data:`LOP_SPATIAL`, lop's
        spatial schedule for the bucket, where the bucket has one."""
        i = st.table.index(bw)
        best = None
        for plan in [st.table.plans[i]] + list(st.table.alternatives[i]):
            p = predict_cut(st.profile, st.profile.cut(plan.cut_id), plan.encoding, bw, st.cfg)
            if best is None or self._cost(p) < self._cost(best):
                best = p
        options = {LOP_PARTITION: _Option(LOP, best.latency_s, best.energy_j, kind=LOP_PARTITION,
                                          raw_latency_s=best.latency_s)}
        ls = self.lop._lop.get(self._shape())
        if ls is not None and ls.table is not None:
            lp = ls.table.plans[ls.table.index(bw)]
            if lp.spatial:
                options[LOP_SPATIAL] = _Option(LOP, lp.latency_s, lp.energy_j, kind=LOP_SPATIAL,
                                               raw_latency_s=lp.latency_s)
        return {k: self.errors.correct(o) for k, o in options.items()}

    def _cost(self, prediction) -> float:
        """What the client's objective minimises, of a prediction (an :class:`_Option` or
        the cost model's): its latency, its joules, or under a deadline its joules where
        it meets the deadline (:func:`~robot_offload.partition.cost.objective_cost`)."""
        return objective_cost(self.ctx.config, prediction.latency_s, prediction.energy_j)

    def _judged(self, option: _Option) -> _Option:
        """``option`` as the measured choice sees it: its ``latency_s`` is its predicted
        cost by the objective (with the energy and deadline objectives, not its latency,
        and the choice observes each frame's cost the same way)."""
        return option if self.ctx.config.objective == "latency" else replace(option, latency_s=self._cost(option))

    def _best(self, options) -> _Option:
        """The lop option the frame is judged by: the lower by the objective."""
        return min(options, key=self._cost)

    def _predicted_reason(self, option: _Option) -> str:
        """Why a prediction alone chose ``option`` (probing off)."""
        objective = self.ctx.config.objective
        if objective != "deadline":
            return f"lowest predicted {objective}"
        if option.latency_s <= self.ctx.config.deadline_s:
            return "lowest predicted energy within the deadline"
        return "lowest predicted latency (none predicted within the deadline)"

    @staticmethod
    def _local_option(st, bw: float) -> _Option:
        """The whole model on the robot, as the profile and the robot's drift predict it."""
        output = next(c for c in st.profile.candidates if c.kind == OUTPUT_CUT)
        p = predict_cut(st.profile, output, encoding_key("raw", "none"), bw, st.cfg)
        return _Option(LOCAL, p.latency_s, p.energy_j, kind=LOCAL, raw_latency_s=p.latency_s)

    def _image_option(self, st, frame, bw: float) -> _Option:
        """Full offload of the camera image, with the one cost model: the image's bytes
        (times the compression the last ones got), the server's whole forward (as the last
        full offload measured it, else the profile's estimate), the outputs back."""
        p = predict_cut(st.profile, self._input_cut(st), encoding_key("raw", "none"), bw, st.cfg,
                        up_bytes=self._upload_bytes(frame))
        return _Option(IMAGE, p.latency_s, p.energy_j, kind=IMAGE, raw_latency_s=p.latency_s)

    def _upload_bytes(self, frame) -> float:
        """The bytes the image's offload sends: the frame's times the ratio the last one
        got; before any, the frame's, or with ``input_jpeg_quality`` its JPEG's (encoded
        once to know)."""
        if self._up_ratio is None:
            quality = self.ctx.config.input_jpeg_quality
            if not quality or not frame_codec.encodable(frame) or not frame.nbytes:
                return float(frame.nbytes)
            enc = frame_codec.encode(frame, "frame", quality)
            self._up_ratio = 1.0 if enc is None else enc.nbytes / frame.nbytes
        return frame.nbytes * self._up_ratio

    @staticmethod
    def _input_cut(st):
        return next(c for c in st.profile.candidates if c.kind == INPUT_CUT)

    # -- helpers --------------------------------------------------------------------------
    def _shape(self):
        """The model input's shape for a camera image (what lop keeps its state under)."""
        return (1, 3, *self.ctx.input_size)

    def _run_lop(self, frame, stats, timeout_s, reason):
        y = self.lop.infer(self.ctx.preprocess(frame, stats), stats, timeout_s)
        self._mark(stats, LOP, reason, {})
        return y

    @staticmethod
    def _mark(stats, candidate: str, reason: str, detail: Dict) -> None:
        stats.plan = f"auto:{candidate}" + (f" {stats.plan}" if stats.plan else "")
        stats.extra["auto"] = {"candidate": candidate, "reason": reason, **detail}

    def close(self) -> None:
        self.lop.close()
        self.full.close()
