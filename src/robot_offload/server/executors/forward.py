"""The ``forward`` entry: the whole registry model on the request's one input (full
offload)."""

import json
import time

import torch

from robot_offload.protocol import ComputeRequest, ComputeResponse, StatusCode
from robot_offload.server.base import Executor, LoadedModel, RequestRejected


class ForwardExecutor(Executor):
    ENTRY = "forward"
    QUEUED = True

    def __call__(self, loaded: LoadedModel, req: ComputeRequest) -> ComputeResponse:
        server = self.server
        if len(req.tensors) != 1:
            raise RequestRejected(StatusCode.BAD_REQUEST, f"forward takes 1 input tensor, got {len(req.tensors)}")
        (x,) = server.decode_inputs(req)
        if not x.is_floating_point():
            raise RequestRejected(StatusCode.BAD_REQUEST, f"forward needs a floating input, got {x.dtype}")
        t0 = time.perf_counter()
        y = run_model(server, loaded, x)
        compute_s = time.perf_counter() - t0
        tensors, spec = server.encode_outputs(y, req)
        return ComputeResponse(status=StatusCode.OK, tensors=tensors, structure_json=spec,
                               result_json=json.dumps({"input_shape": list(x.shape)}),
                               server_compute_s=compute_s)


def run_model(server, loaded: LoadedModel, x: torch.Tensor):
    """The model's outputs for input ``x`` (on the server's device), synchronized. An input
    the model cannot take is the request's fault: RequestRejected (BAD_REQUEST)."""
    try:
        with torch.inference_mode():
            y = loaded.module(x)
        server.synchronize()
    except torch.cuda.OutOfMemoryError:
        raise
    except (RuntimeError, ValueError, IndexError, TypeError, AssertionError) as e:
        # Shape/dtype mismatches surface as these inside forward: the request is at fault.
        raise RequestRejected(StatusCode.BAD_REQUEST, f"{loaded.name} rejected the input "
                              f"{list(x.shape)}: {(str(e).splitlines() or [type(e).__name__])[0][:300]}") from e
    return y
