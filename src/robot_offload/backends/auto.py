"""``auto``: per frame, the fastest way to run it (or the cheapest in joules).

Two kinds of candidate:

* what ``lop`` runs for the frame's predicted bandwidth: its own choice among every
  layer partition (all local and full offload of the input tensor included) and its
  spatial schedules, with their profiles, drift factors and measured latencies (shared
  with ``layer_partition`` and ``lop`` of the same client, see
  :class:`~robot_offload.backends.layer_partition.PartitionKnowledge`);
* for image models fed camera frames, ``full_offload`` of the camera image itself (uint8,
  preprocessing on the server): a quarter of the float tensor's bytes.

Both are predicted with the one cost model (:mod:`robot_offload.partition.cost`:
the image's bytes up, the outputs' bytes down, the server time its frames measured). The
frame's bucket is layer partitioning's bandwidth bucket; within a bucket the choice is
:class:`~robot_offload.partition.choice.MeasuredChoice`'s (latency objective): the
candidates predicted close to each other are timed on real frames and the fastest median
serves, with periodic probes -- hysteresis that does not thrash on one noisy frame and
follows a step change of the bandwidth as soon as the estimate crosses into another bucket.
With the energy objective (or probing off) the lower prediction serves.

A candidate that fails (server down, deadline) raises like any backend: the client
computes the frame locally, so a switch never loses a frame. The frame's stats say what
ran and why: ``plan`` starts with ``auto:`` and ``detail_json`` holds ``auto``: the
candidate, the reason, and the predicted cost of each candidate.
"""

import logging
import threading
import time
from dataclasses import dataclass
from typing import Dict, Optional

from robot_offload.backends.base import Backend, register_backend
from robot_offload.backends.full_offload import FullOffloadBackend
from robot_offload.backends.lop import LopBackend
from robot_offload.partition.cost import predict_cut
from robot_offload.partition.graph import INPUT_CUT
from robot_offload.partition.choice import MeasuredChoice
from robot_offload.partition.profile import encoding_key

log = logging.getLogger(__name__)

#: candidate keys (what ``detail_json``'s ``auto.candidate`` names)
LOP = "lop"
IMAGE = "full_offload_image"


@dataclass(frozen=True)
class _Option:
    """A candidate as :class:`MeasuredChoice` sees it: a key and a prediction."""

    key: str
    latency_s: float
    energy_j: float
    link_free: bool = False

    def describe(self) -> str:
        return self.key


@register_backend
class AutoBackend(Backend):
    name = "auto"
    needs_server = True

    #: a candidate never measured is timed when predicted at most this many times the
    #: leader's latency (see :meth:`_first_probe`)
    first_probe_factor = 3.0
    #: while a shape's plans are prepared, the image is offloaded when its upload takes at
    #: most this share of the deadline (see :meth:`_while_preparing`)
    prepare_upload_share = 0.5

    def __init__(self, ctx):
        super().__init__(ctx)
        self.lop = LopBackend(ctx)
        self.full = FullOffloadBackend(ctx)
        self.choice: Optional[MeasuredChoice] = MeasuredChoice.from_client_config(ctx.config)
        self._up_ratio = 1.0    # bytes sent / image bytes of the last image offload (compression)
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
        objective = "energy_j" if self.ctx.config.objective == "energy" else "latency_s"
        options = {LOP: self._lop_option(st, bw, objective), IMAGE: self._image_option(st, frame, bw)}
        predicted = {k: {"latency_ms": round(o.latency_s * 1e3, 2), "energy_mj": round(o.energy_j * 1e3, 2)}
                     for k, o in options.items()}
        ranked = sorted(options.values(), key=lambda o: getattr(o, objective))
        if self.choice is None:
            chosen, reason = ranked[0], f"lowest predicted {objective[:-2]}"
        else:
            chosen, reason = self._first_probe(ranked), "probe: never measured"
            if chosen is None:
                chosen, _probe = self.choice.choose(i, ranked[0], ranked[1:])
                reason = str(self.choice.last.get("reason", ""))
        t0 = time.perf_counter()
        if chosen.key == IMAGE:
            y = self.full.infer_frame(frame, stats, timeout_s)
            stats.predicted_latency_s = chosen.latency_s
            # the server's whole forward, measured: the input cut's tail time in the profile
            # (DynO's run-time profiler), so lop's full offload is predicted from it too
            st.profile.record_server_tail(self._input_cut(st).id, stats.server_compute_s,
                                          device=self.ctx.link.device)
            if frame.nbytes:
                self._up_ratio = max(1e-3, stats.bytes_up / frame.nbytes)
        else:
            y = self.lop.infer(self.ctx.preprocess(frame, stats), stats, timeout_s)
        # a lop frame that solved its schedules or set up new slab shapes is no sample of
        # what lop costs (one such frame, 323 ms against 60, kept MobileNetV2 at 5 Mbit/s
        # on the image offload for a whole run)
        if self.choice is not None and stats.extra.get("lop", {}).get("timed", True):
            self.choice.observe(i, chosen, time.perf_counter() - t0)
        detail = {"predicted": predicted, "bucket": i, "bandwidth_bps": bw}
        if self.choice is not None:
            detail["medians_ms"] = self.choice.last.get("medians_ms", {})
        self._mark(stats, chosen.key, reason, detail)
        return y

    def _while_preparing(self, frame, stats, timeout_s):
        """A frame of a shape whose profile and schedules are not there yet. They take
        seconds on an idle robot (minutes on an oversubscribed one), so they are prepared
        on a background thread while the camera image is offloaded, when its upload at the
        predicted bandwidth takes at most :attr:`prepare_upload_share` of the deadline.
        Otherwise (a slow link, or preparing failed) the frame is lop's first, which
        prepares them itself, as a frame that cannot be offloaded must wait for them."""
        shape = self._shape()
        bw = self.lop.frame_bandwidth(stats)
        upload_s = 8.0 * frame.nbytes / bw
        if shape not in self._prepare_failed and upload_s <= self.prepare_upload_share * timeout_s:
            self._start_preparing(shape, frame)
            y = self.full.infer_frame(frame, stats, timeout_s)
            self._mark(stats, IMAGE, "the plans of this input shape are being prepared in the "
                       "background (profile, schedules): the camera image is offloaded meanwhile",
                       {"bandwidth_bps": bw})
            return y
        preparing = self._preparing.get(shape)
        if preparing is not None and preparing.is_alive():
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
        thread = threading.Thread(target=prepare, name="auto-prepare", daemon=True)
        self._preparing[shape] = thread
        thread.start()

    def _first_probe(self, ranked):
        """A candidate measured on fewer than ``min_samples`` frames in any bucket and
        predicted within :attr:`first_probe_factor` of the leader, or None. The cost model
        errs most on what a frame has never timed (the image's server time before any image
        went up: MobileNetV2's predicted 45-50 ms on the testbed, measured 32), and only
        measured ratios correct it (:meth:`MeasuredChoice.lead`); a candidate predicted far
        slower (an upload over a dead link) is not worth the frame."""
        lead = ranked[0]
        for o in ranked[1:]:
            if (self.choice.error_samples(o) < self.choice.min_samples
                    and o.latency_s <= lead.latency_s * self.first_probe_factor):
                return o
        return None

    # -- predictions ----------------------------------------------------------------------
    def _lop_option(self, st, bw: float, objective: str) -> _Option:
        """What lop would run here, predicted at the frame's bandwidth by the cost model:
        the best, by ``objective``, of layer partitioning's plan for the bucket and its
        alternatives (all local, the best full offload of the tensor, the best plan at
        another cut: lop's measured choice serves the fastest of them), or lop's spatial
        schedule for the bucket when that is predicted better."""
        i = st.table.index(bw)
        best = None
        for plan in [st.table.plans[i]] + list(st.table.alternatives[i]):
            p = predict_cut(st.profile, st.profile.cut(plan.cut_id), plan.encoding, bw, st.cfg)
            if best is None or getattr(p, objective) < getattr(best, objective):
                best = p
        option = _Option(LOP, best.latency_s, best.energy_j)
        ls = self.lop._lop.get(self._shape())
        if ls is not None and ls.table is not None:
            lp = ls.table.plans[ls.table.index(bw)]
            if lp.spatial and getattr(lp, objective) < getattr(option, objective):
                option = _Option(LOP, lp.latency_s, lp.energy_j)
        return option

    def _image_option(self, st, frame, bw: float) -> _Option:
        """Full offload of the camera image, with the one cost model: the image's bytes
        (times the compression the last ones got), the server's whole forward (as the last
        full offload measured it, else the profile's estimate), the outputs back."""
        p = predict_cut(st.profile, self._input_cut(st), encoding_key("raw", "none"), bw, st.cfg,
                        up_bytes=frame.nbytes * self._up_ratio)
        return _Option(IMAGE, p.latency_s, p.energy_j)

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
