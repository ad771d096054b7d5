"""The ``forward_image`` entry: one camera frame as the robot got it (uint8), preprocessed
here with the registry's own function and run through the whole model (``full_offload``
of an image model).

Request: one uint8 tensor, raw (any compression) or a JPEG stream
(:mod:`robot_offload.frame_codec`, lossy: the robot asked for it), of shape ``[H, W, 3]``
(RGB), ``[H, W]`` (grey) or, raw only, ``[H, W, 4]`` (the fourth channel is dropped), H and W each
in 1..:data:`~robot_offload.models.registry.MAX_FRAME_SIDE` and H x W x C at most the
server's ``max_input_elements``; ``args_json`` ``{"input_size": [h, w]}``, the model input
size the client preprocesses to, h and w in 1..MAX_FRAME_SIDE and 3 x h x w at most
``max_input_elements``. Only for image models; everything is checked against the tensor's
header and the arguments before a byte is decoded.

The frame is resized and normalised on the server's device by
:func:`~robot_offload.models.registry.preprocess_image_tensor` with the registry spec's
mean and std, the function the robot's own preprocessing runs: on the same device both
sides compute the same input, bit for bit. ``server_compute_s`` covers preprocessing and
the model (in a batch: the batch's model time).
"""

import json
import time

import torch

from robot_offload.frame_codec import FRAME_CODECS
from robot_offload.models import MAX_FRAME_SIDE, get_spec, preprocess_image_tensor
from robot_offload.protocol import ComputeRequest, ComputeResponse, StatusCode
from robot_offload.server.base import Executor, LoadedModel, RequestRejected, bad_request
from robot_offload.server.executors.forward import run_model

ENTRY = "forward_image"


class ForwardImageExecutor(Executor):
    ENTRY = ENTRY
    QUEUED = True
    BATCHABLE = True

    def prepare(self, loaded: LoadedModel, req: ComputeRequest) -> torch.Tensor:
        """The model input: the frame checked, decoded and preprocessed on the device."""
        server = self.server
        spec = get_spec(loaded.name)
        if spec.input_kind != "image":
            raise bad_request(f"{ENTRY} takes camera images; {loaded.name} takes {spec.input_kind} "
                              f"input: send it preprocessed to the forward entry")
        if len(req.tensors) != 1:
            raise bad_request(f"{ENTRY} takes 1 uint8 frame, got {len(req.tensors)} tensors")
        max_elements = server.config.max_input_elements
        self._check_frame(req.tensors[0], max_elements)
        if req.tensors[0].codec in FRAME_CODECS and not server.config.jpeg_frames:
            raise bad_request(f"{ENTRY}: this server takes no JPEG frames (jpeg_frames: false); "
                              "send the frame raw")
        size = self._input_size(req.args_json, max_elements)
        (frame,) = server.decode_inputs(req, frames=True)
        with torch.inference_mode():
            return preprocess_image_tensor(frame, size, spec.mean, spec.std)

    def respond(self, loaded: LoadedModel, req: ComputeRequest, x: torch.Tensor, y,
                compute_s: float, **result) -> ComputeResponse:
        tensors, structure_json = self.server.encode_outputs(y, req)
        return ComputeResponse(status=StatusCode.OK, tensors=tensors, structure_json=structure_json,
                               result_json=json.dumps({"frame_shape": [int(s) for s in req.tensors[0].shape],
                                                       "input_shape": list(x.shape), **result}),
                               server_compute_s=compute_s)

    def __call__(self, loaded: LoadedModel, req: ComputeRequest) -> ComputeResponse:
        t0 = time.perf_counter()
        x = self.prepare(loaded, req)
        t1 = time.perf_counter()
        y = run_model(self.server, loaded, x)
        return self.respond(loaded, req, x, y, time.perf_counter() - t0, preprocess_s=t1 - t0)

    @staticmethod
    def _check_frame(enc, max_elements: int) -> list:
        """The frame's shape, from its (already well-formed) header; refused unless it is
        an image within the bounds."""
        if enc.dtype != "uint8" or enc.codec not in ("raw",) + FRAME_CODECS:
            raise bad_request(f"{ENTRY} takes a uint8 frame, raw or {'/'.join(FRAME_CODECS)}, got "
                              f"{enc.dtype[:20]}/{enc.codec[:20]}")
        shape = [int(s) for s in enc.shape]
        if len(shape) not in (2, 3) or (len(shape) == 3 and shape[2] not in (3, 4)):
            raise bad_request(f"{ENTRY} takes an [H, W, 3], [H, W] or [H, W, 4] frame, got {shape}")
        if min(shape[:2]) < 1:
            raise bad_request(f"{ENTRY}: an empty frame {shape}")
        if max(shape[:2]) > MAX_FRAME_SIDE:
            raise RequestRejected(StatusCode.TOO_LARGE, f"{ENTRY}: frame {shape} has a side above "
                                  f"{MAX_FRAME_SIDE} px")
        elements = shape[0] * shape[1] * (shape[2] if len(shape) == 3 else 1)
        if elements > max_elements:
            raise RequestRejected(StatusCode.TOO_LARGE, f"{ENTRY}: frame {shape} has {elements} "
                                  f"elements; max_input_elements is {max_elements}")
        return shape

    @staticmethod
    def _input_size(args_json: str, max_elements: int) -> tuple:
        """``input_size`` from the arguments: exactly [h, w], positive ints within bounds."""
        args = json.loads(args_json) if args_json.strip() else {}
        if set(args) != {"input_size"}:
            raise bad_request(f"{ENTRY} takes the argument input_size only, got "
                              f"{sorted(k[:40] for k in args)[:8]}")
        size = args["input_size"]
        if (not isinstance(size, list) or len(size) != 2
                or not all(type(s) is int and 1 <= s <= MAX_FRAME_SIDE for s in size)):
            raise bad_request(f"{ENTRY}: input_size must be [h, w], integers in 1..{MAX_FRAME_SIDE}, "
                              f"got {json.dumps(size)[:80]}")
        if 3 * size[0] * size[1] > max_elements:
            raise RequestRejected(StatusCode.TOO_LARGE, f"{ENTRY}: input_size {size} makes a model "
                                  f"input of {3 * size[0] * size[1]} elements; max_input_elements is "
                                  f"{max_elements}")
        return tuple(size)
