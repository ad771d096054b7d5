"""Intra-DP's three lines (its Fig. 5): apply ``lop`` to a model the application already has.

    from robot_offload.lop import IntraDP
    IntraDP(server_ns="/offload_server").start_client(model, name="vgg19")
    result = model(x)                      # parallelised with the server from now on

:meth:`IntraDP.start_client` hooks the model's ``forward`` (an instance attribute, so the
class and other instances are untouched): every call goes through an
:class:`~robot_offload.client.OffloadClient` in ``lop`` mode -- profiled and scheduled on
the first call, the schedule looked up per call from the predicted bandwidth, local
inference when the server is unreachable or misses the deadline. Calls the client makes
itself (local fallback, profiling) reach the original ``forward``; torch.fx traces the
class's ``forward``, so the hook never ends up in a graph.

Unlike the paper's prototype, the model is not shipped to the server: nothing executable
crosses the network. ``name`` must be a registry model (``rosrun robot_offload bench
--help`` lists them, see the README's Models) and the instance's weights must hash like
the server's copy (the same weights file on both sides, or the registry's seeded
weights). Without a ``transport`` the ROS services under ``server_ns`` are used, and a ROS
node is initialised if the process has none.
"""

import threading
from typing import Optional

import torch

from robot_offload.client import ClientConfig, OffloadClient
from robot_offload.stats import FrameStats


class IntraDP:
    """Holds the settings; :meth:`start_client` applies them to a model."""

    def __init__(self, server_ns: str = "/offload_server", transport=None, mode: str = "lop",
                 **config):
        self.server_ns = server_ns
        self.transport = transport
        self.mode = mode
        self.config = config
        self.client: Optional[OffloadClient] = None
        self.last_stats: Optional[FrameStats] = None
        self._model = None
        self._inside = threading.local()

    def start_client(self, model: torch.nn.Module, name: str) -> OffloadClient:
        """Hook ``model.forward``; returns the client (its ``link``, ``mode`` and the
        per-call :class:`FrameStats` in :attr:`last_stats`)."""
        if self.client is not None:
            raise RuntimeError("this IntraDP already drives a model; stop_client() first")
        transport = self.transport
        if transport is None:
            from robot_offload.ros.transport import connect
            transport = connect(self.server_ns)
        cfg = ClientConfig(model=name, mode=self.mode, **self.config)
        self._inside.active = True          # the client builds backends (fx capture) now
        try:
            client = OffloadClient(cfg, transport, model=model)
        finally:
            self._inside.active = False
        client.connect()
        original = type(model).forward

        def forward(*args, **kwargs):
            if getattr(self._inside, "active", False) or len(args) != 1 or kwargs:
                return original(model, *args, **kwargs)
            self._inside.active = True
            try:
                y, self.last_stats = client.infer(args[0])
            finally:
                self._inside.active = False
            return y

        model.forward = forward
        self.client, self._model = client, model
        return client

    def stop_client(self) -> None:
        """Restore the model's own ``forward`` and close the client."""
        if self._model is not None and "forward" in vars(self._model):
            del self._model.forward
        if self.client is not None:
            self.client.close()
        self.client = self._model = None
