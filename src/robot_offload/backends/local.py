"""``local``: the whole model on the robot (the baseline, and every fallback)."""

import time

import torch

from robot_offload.backends.base import Backend, register_backend


@register_backend
class LocalBackend(Backend):
    name = "local"

    def infer(self, x, stats, timeout_s):
        t0 = time.perf_counter()
        with torch.inference_mode():
            y = self.ctx.model(x)
        t1 = time.perf_counter()
        stats.add_compute(t0, t1)
        if self.ctx.local_hedge is not None:
            self.ctx.local_hedge.observe_local(t1 - t0)
        return y
