"""``full_offload``: the input goes up, the whole model runs on the server, the output
comes down (NNTO / the papers' "ALL" baseline).

For image models a frame goes up as the camera gave it (uint8, 1 byte per pixel and
channel, compressed losslessly as ``compression`` says) to the server's
``forward_image`` entry, which preprocesses it with the registry's own function
(:func:`robot_offload.models.registry.preprocess_image_tensor`) and runs the model: a
quarter of the bytes of the float32 model input at the same size, and no preprocessing on
the robot. The preprocessed tensor goes up instead (the ``forward`` entry, in ``codec``)
where it is the smaller of the two (a camera much larger than the model input), for
point-cloud models, for callers that already hold a tensor (:meth:`infer`), and to a
server without ``forward_image`` (an older release of the same protocol: it answers
UNKNOWN_ENTRY, and the client remembers that server). ``stats.plan`` says which
(``input=frame uint8/zstd``, ``input=tensor raw/none``).

With ``input_jpeg_quality`` set (off by default) the frame goes up as JPEG instead, when
that is smaller (:mod:`robot_offload.frame_codec`): lossy, so the outputs are no longer
``local``'s; ``plan`` says ``input=frame jpeg q90`` and ``detail_json`` ``lossy_input``.
A server that refuses JPEG frames (``jpeg_frames: false``, an older release) gets the
lossless frame, and the client remembers it. A frame the robot's hedge answered is exact.

With one server, a call later than the client's recent round trips is hedged by the robot
computing the frame too (:mod:`robot_offload.local_hedge`).
"""

import json
import logging
import time

import numpy as np
import torch

from robot_offload import codec, frame_codec, structure
from robot_offload.backends.base import Backend, register_backend
from robot_offload.errors import RemoteError
from robot_offload.local_hedge import computed_here
from robot_offload.models import MAX_FRAME_SIDE, check_frame_shape
from robot_offload.protocol import ComputeRequest, StatusCode

log = logging.getLogger(__name__)

#: the server entry that preprocesses frames (robot_offload.server.executors.forward_image)
FRAME_ENTRY = "forward_image"
#: frames refused as too large by one server are remembered, at most this many shapes
_MAX_REFUSED_SHAPES = 64


@register_backend
class FullOffloadBackend(Backend):
    name = "full_offload"
    needs_server = True

    def __init__(self, ctx):
        super().__init__(ctx)
        # server_id -> why that server takes no frames (it has no forward_image entry)
        self._no_frames = {}
        # (server_id, frame shape) refused as too large by that server
        self._refused_shapes = set()
        # server_id -> why that server takes no JPEG frames
        self._no_jpeg = {}
        self._warned_lossy = False

    def infer(self, x, stats, timeout_s):
        cfg = self.ctx.config
        t0 = time.perf_counter()
        enc = codec.encode(x, "input", cfg.codec, cfg.compression)
        t1 = time.perf_counter()
        stats.plan = f"input=tensor {enc.codec}/{enc.compression}"
        return self._call("forward", enc, "{}", stats, t0, t1, timeout_s, lambda: x)

    def infer_frame(self, frame, stats, timeout_s):
        if self.ctx.spec.input_kind != "image":
            return super().infer_frame(frame, stats, timeout_s)
        why = self.frame_refusal(frame)
        if why:
            return self._tensor_instead(frame, stats, timeout_s, why)
        t0 = time.perf_counter()
        enc = self._jpeg(frame)
        if enc is None and self._input_bytes() < frame.nbytes:      # (with JPEG asked for only)
            return self._tensor_instead(frame, stats, timeout_s - (time.perf_counter() - t0),
                                        f"the {self.ctx.config.codec} model input is smaller than "
                                        "the frame and its JPEG")
        enc = enc or self._lossless(frame)
        args = json.dumps({"input_size": [int(s) for s in self.ctx.input_size]})
        t1 = time.perf_counter()
        try:
            outputs = self._call(FRAME_ENTRY, enc, args, stats, t0, t1, timeout_s,
                                 lambda: self.ctx.preprocess(frame, stats))
        except RemoteError as e:
            jpeg_refused = enc.codec == frame_codec.JPEG and e.code == StatusCode.BAD_REQUEST
            if jpeg_refused:
                self._no_jpeg[self.ctx.link.server_id] = e.text
                log.warning("the offload server refuses JPEG frames (%s): full_offload sends it "
                            "lossless frames", e.text[:200])
            elif e.code == StatusCode.UNKNOWN_ENTRY:
                self._no_frames[self.ctx.link.server_id] = e.text
                log.warning("the offload server has no %s entry (an older release): full_offload "
                            "sends it the preprocessed tensor instead of the camera image", FRAME_ENTRY)
            elif e.code == StatusCode.TOO_LARGE:
                if len(self._refused_shapes) >= _MAX_REFUSED_SHAPES:
                    self._refused_shapes.clear()
                self._refused_shapes.add((self.ctx.link.server_id, tuple(frame.shape)))
            else:
                raise
            # the refused upload (and the encoding before it) was this frame's time, and
            # so is its deadline
            t2 = time.perf_counter()
            stats.add_compute(t0, t1)
            stats.add_call(t1, t2, 0.0, enc.nbytes, 0)
            if jpeg_refused:
                return self.infer_frame(frame, stats, timeout_s - (t2 - t0))
            return self._tensor_instead(frame, stats, timeout_s - (t2 - t0),
                                        f"the server refused the frame: {e}")
        if enc.codec == frame_codec.JPEG:
            quality = int(enc.scale)
            stats.plan = f"input=frame jpeg q{quality}"
            if stats.executed_mode != "local":      # not the robot's own (exact) answer to a hedge
                stats.extra["lossy_input"] = {"codec": enc.codec, "quality": quality,
                                              "frame_bytes": int(enc.raw_size)}
        else:
            stats.plan = f"input=frame uint8/{enc.compression}"
        return outputs

    def _lossless(self, frame):
        # a read-only frame (a ROS message's buffer) is copied rather than shared with torch
        data = frame if frame.flags.c_contiguous and frame.flags.writeable else np.array(frame, order="C")
        return codec.encode(torch.from_numpy(data), "frame", "raw", self.ctx.config.compression)

    def _jpeg(self, frame):
        """The frame as JPEG when asked for (``input_jpeg_quality``), the server takes it
        and it is smaller than the frame and than the model input; else None."""
        quality = self._jpeg_quality(frame)
        if not quality:
            return None
        enc = frame_codec.encode(frame, "frame", quality)
        if enc is not None and enc.nbytes >= self._input_bytes():
            enc = None
        if enc is not None and not self._warned_lossy:
            self._warned_lossy = True
            log.warning("full_offload sends camera frames as JPEG (quality %d): lossy, its outputs "
                        "differ from local's", quality)
        return enc

    def frame_refusal(self, frame) -> str:
        """Why ``frame`` goes up as the preprocessed tensor rather than as it is ("" when
        it goes as it is). Raises ConfigError for an array that is no image."""
        if not isinstance(frame, np.ndarray) or frame.dtype != np.uint8:
            return "not a uint8 image"          # preprocessing refuses it, saying why
        check_frame_shape(frame.shape)
        server = self.ctx.link.server_id
        if server in self._no_frames:
            return f"the server has no {FRAME_ENTRY} entry"
        if (server, tuple(frame.shape)) in self._refused_shapes:
            return "the server refused frames of this size as too large"
        if max(frame.shape[:2]) > MAX_FRAME_SIDE:
            return f"a frame side above {MAX_FRAME_SIDE} px"
        if self._jpeg_quality(frame):
            return ""       # the JPEG is compared with the model input once encoded
        if self._input_bytes() < frame.nbytes:
            return f"the {self.ctx.config.codec} model input is smaller than the frame"
        return ""

    def _input_bytes(self) -> int:
        return codec.payload_size([1, 3, *self.ctx.input_size], "float32", self.ctx.config.codec)

    def _jpeg_quality(self, frame) -> int:
        """The JPEG quality ``frame`` goes at to this server; 0: it goes lossless."""
        quality = self.ctx.config.input_jpeg_quality
        if not quality or self.ctx.link.server_id in self._no_jpeg or not frame_codec.encodable(frame):
            return 0
        return quality

    def _tensor_instead(self, frame, stats, timeout_s, why):
        x = self.ctx.preprocess(frame, stats)
        outputs = self.infer(x, stats, timeout_s)
        stats.extra["full_offload"] = {"tensor_because": why}
        return outputs

    def _call(self, entry, enc, args_json, stats, t0, t1, timeout_s, local_input):
        """One compute call of ``entry`` on ``enc`` (encoded from t0 to t1), accounted;
        hedged by the robot on ``local_input()`` when it is late
        (:mod:`robot_offload.local_hedge`)."""
        cfg = self.ctx.config
        link = self.ctx.link
        request = ComputeRequest(
            client_id=link.client_id, model=link.model, entry=entry, tensors=[enc],
            args_json=args_json, output_codec=cfg.output_codec, output_compression=cfg.compression)
        remaining_s = timeout_s - (time.perf_counter() - t0)
        hedge = self.ctx.local_hedge
        if hedge is None:
            response = link.compute(request, remaining_s)
        else:
            response, outputs = hedge.call(link, entry, request, remaining_s, stats,
                                           computed_here(self.ctx.model, lambda: [local_input()], stats))
            if response is None:          # the robot answered first
                stats.add_compute(t0, t1)
                return outputs
        t2 = time.perf_counter()
        outputs = structure.unflatten([codec.decode(t) for t in response.tensors],
                                      response.structure_json)
        t3 = time.perf_counter()
        stats.add_compute(t0, t1)
        stats.add_compute(t2, t3)
        stats.add_call(t1, t2, response.server_total_s or response.server_compute_s,
                       request.payload_bytes, response.payload_bytes)
        return outputs
