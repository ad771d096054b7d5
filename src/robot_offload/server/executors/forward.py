"""The ``forward`` entry: the whole registry model on the request's one input (full
offload)."""

import json
import time
from typing import List

import torch

from robot_offload import structure

from robot_offload.protocol import ComputeRequest, ComputeResponse, StatusCode
from robot_offload.server.base import Executor, LoadedModel, RequestRejected


class ForwardExecutor(Executor):
    ENTRY = "forward"
    QUEUED = True
    BATCHABLE = True

    def prepare(self, loaded: LoadedModel, req: ComputeRequest) -> torch.Tensor:
        if len(req.tensors) != 1:
            raise RequestRejected(StatusCode.BAD_REQUEST, f"forward takes 1 input tensor, got {len(req.tensors)}")
        (x,) = self.server.decode_inputs(req)
        if not x.is_floating_point():
            raise RequestRejected(StatusCode.BAD_REQUEST, f"forward needs a floating input, got {x.dtype}")
        return x

    def respond(self, loaded: LoadedModel, req: ComputeRequest, x: torch.Tensor, y,
                compute_s: float, **result) -> ComputeResponse:
        tensors, spec = self.server.encode_outputs(y, req)
        return ComputeResponse(status=StatusCode.OK, tensors=tensors, structure_json=spec,
                               result_json=json.dumps({"input_shape": list(x.shape), **result}),
                               server_compute_s=compute_s)

    def __call__(self, loaded: LoadedModel, req: ComputeRequest) -> ComputeResponse:
        x = self.prepare(loaded, req)
        t0 = time.perf_counter()
        y = run_model(self.server, loaded, x)
        return self.respond(loaded, req, x, y, time.perf_counter() - t0)


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


def run_batch(server, loaded: LoadedModel, xs: List[torch.Tensor]) -> list:
    """The model's outputs for each of ``xs`` (inputs of one shape and dtype, from several
    clients), from one forward of them stacked along the batch dimension. A model whose
    outputs are not all tensors batched along their first dimension (detectors' lists of
    boxes per image) runs them one by one instead."""
    if len(xs) == 1:
        return [run_model(server, loaded, xs[0])]
    sizes = [int(x.shape[0]) for x in xs]
    y = run_model(server, loaded, torch.cat(xs))
    leaves, spec = structure.flatten(y)
    if not all(isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == sum(sizes) for t in leaves):
        return [run_model(server, loaded, x) for x in xs]
    parts = [torch.split(t, sizes) for t in leaves]
    return [structure.unflatten([p[i] for p in parts], spec) for i in range(len(xs))]
