"""``full_offload``: the input goes up, the whole model runs on the server, the output
comes down (NNTO / the papers' "ALL" baseline)."""

import time

from robot_offload import codec, structure
from robot_offload.backends.base import Backend, register_backend
from robot_offload.protocol import ComputeRequest


@register_backend
class FullOffloadBackend(Backend):
    name = "full_offload"
    needs_server = True

    def infer(self, x, stats, timeout_s):
        cfg = self.ctx.config
        link = self.ctx.link
        t0 = time.perf_counter()
        request = ComputeRequest(
            client_id=link.client_id, model=link.model, entry="forward",
            tensors=[codec.encode(x, "input", cfg.codec, cfg.compression)],
            output_codec=cfg.output_codec, output_compression=cfg.compression)
        t1 = time.perf_counter()
        response = link.compute(request, timeout_s - (t1 - t0))
        t2 = time.perf_counter()
        outputs = structure.unflatten([codec.decode(t) for t in response.tensors],
                                      response.structure_json)
        t3 = time.perf_counter()
        stats.add_compute(t0, t1)
        stats.add_compute(t2, t3)
        stats.add_call(t1, t2, response.server_total_s or response.server_compute_s,
                       request.payload_bytes, response.payload_bytes)
        stats.plan = f"codec={cfg.codec}/{cfg.compression}"
        return outputs
