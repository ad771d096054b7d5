"""Protocol requests over rospy services, with persistent connections and deadlines.

rospy service calls have no timeout, so each call runs on a worker thread and the caller
waits at most ``timeout_s``; on a miss the connection is closed (which unblocks the worker)
and :class:`~robot_offload.errors.OffloadTimeout` is raised. Connections are persistent
(``persistent=True`` saves a TCP and header handshake per call: 1.0 ms -> 0.18 ms for
100 KB here) and pooled, one per concurrent caller, because a persistent ServiceProxy
must not be used by two threads at once. A broken connection is dropped and the next call
opens a new one, which is all "reconnect" needs: the master resolves the server's new
address after a restart.

While a compute request with a ``request_id`` is on its connection, :meth:`upload_acked`
reads how much of it the server's host has acknowledged (the kernel's ``TCP_INFO`` of that
connection, counted from just before the request was written), and :meth:`abandon` resets
that connection, dropping what it has not sent.
"""

import concurrent.futures
import socket
import threading
from collections import defaultdict

import rospy

from robot_offload.errors import OffloadTimeout, ServerUnavailable
from robot_offload.ros import conversions as conv
from robot_offload.srv import Compute, LoadModel, Ping
from robot_offload.transport.base import Transport, shutdown_now
from robot_offload.transport.tcp import abort, bytes_acked, bytes_received

# method -> (service name under the server's namespace, srv type, to_srv, from_srv)
SERVICES = {
    "load_model": ("load_model", LoadModel, conv.load_req_to_srv, conv.load_resp_from_srv),
    "compute": ("compute", Compute, conv.compute_req_to_srv, conv.compute_resp_from_srv),
    "ping": ("ping", Ping, conv.ping_req_to_srv, conv.ping_resp_from_srv),
}

_CALL_ERRORS = (rospy.ServiceException, rospy.exceptions.TransportException, OSError, socket.error)


class RosServiceTransport(Transport):
    def __init__(self, server_ns: str = "/offload_server", max_parallel_calls: int = 4,
                 auth_secret=None):
        super().__init__(max_parallel_calls, auth_secret=auth_secret)
        self.server_ns = server_ns.rstrip("/")
        self._free = defaultdict(list)
        self._in_use = 0
        self._lock = threading.Lock()
        self._uploads = {}    # request_id of a compute call in flight -> (proxy, bytes acked, bytes received before it)
        # Callers wait on these workers; a worker stuck on a dead socket is freed by close().
        self._workers = self._executor(self._max_workers(), "call")

    def _max_workers(self) -> int:
        return 2 * self.max_parallel_calls + 2

    def _connections(self) -> int:
        with self._lock:
            return sum(len(ps) for ps in self._free.values()) + self._in_use

    def _connection_limit(self) -> int:
        # idle connections are kept up to one per call worker and method (more are closed
        # when their call ends), so at rest this bounds them
        return len(SERVICES) * self._max_workers()

    def service_name(self, method: str) -> str:
        return f"{self.server_ns}/{SERVICES[method][0]}"

    def _call(self, method, request, timeout_s):
        _, srv_type, to_srv, from_srv = SERVICES[method]
        proxy = self._acquire(method, srv_type)
        upload = self._watch_upload(method, request, proxy)
        try:
            try:
                reply = self._workers.submit(proxy.call, to_srv(request)).result(timeout=timeout_s)
            except concurrent.futures.TimeoutError:
                proxy.close()
                raise OffloadTimeout(f"{self.service_name(method)} did not answer within "
                                     f"{timeout_s:.3f} s") from None
            except _CALL_ERRORS as e:
                proxy.close()
                raise ServerUnavailable(f"{self.service_name(method)}: {e}") from e
            except BaseException:
                proxy.close()
                raise
            with self._lock:
                # An abandoned call's proxy is closed (or being closed) by abandon(): never
                # back to the pool, where the next call would write to it. Otherwise it stops
                # being abandonable here, before another call can take it from the pool.
                watched = upload is not None and self._uploads.get(upload[0]) is upload[1]
                if watched:
                    del self._uploads[upload[0]]
                keep = (upload is None or watched) and len(self._free[method]) < self._max_workers()
                if keep:
                    self._free[method].append(proxy)
            if not keep:
                proxy.close()
        finally:
            with self._lock:
                self._in_use -= 1
                if upload is not None and self._uploads.get(upload[0]) is upload[1]:
                    del self._uploads[upload[0]]
        return from_srv(reply)

    def _watch_upload(self, method, request, proxy):
        """Note where ``request``'s upload and its answer start on ``proxy``'s connection:
        the bytes it has acknowledged and received so far. On a connection this call
        opens: none acknowledged (its count starts at 1, the SYN, and its first bytes are
        the connection header, a few hundred), and the answer not watched (the server's
        connection header comes first, and its size is not known here)."""
        request_id = getattr(request, "request_id", "") if method == "compute" else ""
        if not request_id:
            return None
        sock = _socket_of(proxy)
        entry = (proxy, 1, None) if sock is None else (proxy, bytes_acked(sock), bytes_received(sock))
        if entry[1] is None:              # the kernel does not say
            return None
        with self._lock:
            self._uploads[request_id] = entry
        return request_id, entry

    def upload_acked(self, request_id):
        return self._counted_since(request_id, 1, bytes_acked)

    def download_received(self, request_id):
        return self._counted_since(request_id, 2, bytes_received)

    def _counted_since(self, request_id, i, count):
        """A TCP counter (``count`` of the socket) of ``request_id``'s connection since
        the call began (its baseline: ``i`` in the watch entry), or None."""
        with self._lock:
            entry = self._uploads.get(request_id)
        if entry is None or entry[i] is None:
            return None
        now = count(_socket_of(entry[0]))
        return None if now is None else max(0, now - entry[i])

    def abandon(self, request_id):
        with self._lock:
            entry = self._uploads.get(request_id)
            if entry is None or getattr(entry[0], "transport", None) is None:
                return False           # not connected yet: nothing sent to stop
            del self._uploads[request_id]
        abort(_socket_of(entry[0]))   # drop the unsent rest, do not send it
        entry[0].close()          # the worker's call raises; _call closes the proxy for good
        return True

    def _acquire(self, method, srv_type):
        with self._lock:
            self._in_use += 1
            if self._free[method]:
                return self._free[method].pop()
        try:
            return rospy.ServiceProxy(self.service_name(method), srv_type, persistent=True)
        except BaseException:
            with self._lock:
                self._in_use -= 1
            raise

    def close(self):
        super().close()
        with self._lock:
            proxies = [p for ps in self._free.values() for p in ps]
            self._free.clear()
        for p in proxies:
            p.close()
        shutdown_now(self._workers)


def _socket_of(proxy):
    """The TCP socket of a persistent ServiceProxy's connection (None before it connects)."""
    return getattr(getattr(proxy, "transport", None), "socket", None)


def connect(server_ns: str = "/offload_server", **kw) -> RosServiceTransport:
    """A transport to the server under ``server_ns`` for a program that may not be a ROS
    node yet (:mod:`robot_offload.lop`'s hook): initialises an anonymous node first."""
    if not rospy.core.is_initialized():
        rospy.init_node("robot_offload_client", anonymous=True, disable_signals=True)
    return RosServiceTransport(server_ns, **kw)
