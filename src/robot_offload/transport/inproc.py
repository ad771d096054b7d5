"""A transport that hands requests to a server object in the same process.

It still encodes every tensor (requests carry :class:`~robot_offload.codec.EncodedTensor`),
so the codec and the server's validation run exactly as over ROS; only the socket is
missing. Used by unit tests and by single-process experiments.
"""

import concurrent.futures

from robot_offload.errors import OffloadTimeout, ServerUnavailable
from robot_offload.transport.base import Transport, shutdown_now


class InProcessTransport(Transport):
    """``server`` is an :class:`robot_offload.server.OffloadServer` (or None: unreachable)."""

    def __init__(self, server, max_parallel_calls: int = 4, auth_secret=None):
        super().__init__(max_parallel_calls, auth_secret=auth_secret)
        self.server = server
        self._runner = self._executor(max_parallel_calls, "server")

    def _call(self, method, request, timeout_s):
        server = self.server
        if server is None:
            raise ServerUnavailable("in-process server is not running")
        future = self._runner.submit(server.handle, method, request)
        try:
            return future.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            raise OffloadTimeout(f"{method} did not answer within {timeout_s:.3f} s") from None

    def close(self):
        super().close()
        shutdown_now(self._runner)
