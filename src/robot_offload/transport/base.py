"""The transport seam between backends and the server (the tf2 BufferInterface shape).

A backend calls ``transport.call(method, request, timeout_s)`` for a blocking round trip,
or ``transport.submit(...)`` for a future, so that it can overlap several transfers with
its own computation (the lop backend streams spatial parts this way). Implementations:

* :class:`robot_offload.transport.inproc.InProcessTransport` -- the server object in the
  same process; unit tests run a client and a server with no roscore.
* :class:`robot_offload.ros.transport.RosServiceTransport` -- persistent rospy service
  connections with reconnect.

Every call has a deadline. A call that misses it raises
:class:`~robot_offload.errors.OffloadTimeout`; an unreachable server raises
:class:`~robot_offload.errors.ServerUnavailable`. Both are
:class:`~robot_offload.errors.TransportError`, which callers answer by computing locally.

A compute request carries the call's deadline to the server (``deadline_s``, set here),
which answers BUSY at once rather than start work the caller will no longer wait for.

Authentication lives here too, so that every backend (and every future one) gets it
without doing anything: a transport given a secret (``auth_secret=`` or
:meth:`Transport.set_auth_secret`) signs each request in :meth:`Transport.call` with a
fresh token (:mod:`robot_offload.auth`) just before it leaves.
"""

import abc
import concurrent.futures
import dataclasses
import queue
import sys
import threading

from typing import Optional

from robot_offload import auth, background
from robot_offload.errors import ConfigError, OffloadTimeout
from robot_offload.protocol import MAX_DEADLINE_S, METHODS


class Transport(abc.ABC):
    """Carries one request to the server and returns its response, within a deadline."""

    def __init__(self, max_parallel_calls: int = 4, auth_secret: Optional[bytes] = None):
        self.max_parallel_calls = max_parallel_calls
        self._executors = []      # (thread name prefix, max_workers) of every worker pool
        self._pool = self._executor(max_parallel_calls, "submit")
        self._closed = threading.Event()
        self._auth_secret = None
        self.set_auth_secret(auth_secret)

    def set_auth_secret(self, secret: Optional[bytes]) -> None:
        """Sign every request from now on with ``secret`` (None or empty: do not sign)."""
        self._auth_secret = bytes(secret) if secret else None

    @property
    def signs_requests(self) -> bool:
        return self._auth_secret is not None

    @abc.abstractmethod
    def _call(self, method: str, request, timeout_s: float):
        """Do the call. Implementations enforce ``timeout_s`` and raise TransportError."""

    def call(self, method: str, request, timeout_s: float):
        """Blocking round trip with a deadline of ``timeout_s`` seconds."""
        if method not in METHODS:
            raise ConfigError(f"unknown method {method!r}; known: {sorted(METHODS)}")
        if not timeout_s > 0:
            raise OffloadTimeout(f"{method}: no time left before the deadline")
        if method == "compute":
            # the server queues no work past the time this caller waits for it
            request = dataclasses.replace(request, deadline_s=min(float(timeout_s), MAX_DEADLINE_S))
        if self._auth_secret is not None:
            request = auth.sign_request(self._auth_secret, method, request)
        with background.GATE.waiting():     # a frame's thread computes nothing meanwhile
            return self._call(method, request, timeout_s)

    def submit(self, method: str, request, timeout_s: float) -> concurrent.futures.Future:
        """Start a call in the background; the future raises what :meth:`call` would."""
        return self._pool.submit(self.call, method, request, timeout_s)

    def _executor(self, max_workers: int, role: str) -> concurrent.futures.ThreadPoolExecutor:
        """A worker pool of this transport, its threads named after it so :meth:`held`
        can count them."""
        prefix = f"{type(self).__name__}-{role}-{id(self):x}"
        self._executors.append((prefix, max_workers))
        return concurrent.futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=prefix)

    def held(self) -> dict:
        """Worker threads and open connections this transport holds now. Both come from
        bounded pools that fill as calls overlap (a thread or connection is added only
        when every existing one is busy), so they grow under load without leaking; a leak
        check subtracts them (see :mod:`robot_offload.soak`) and compares them with
        :meth:`held_limits`."""
        return {"threads": sum(threads_named(p) for p, _ in self._executors),
                "connections": self._connections()}

    def held_limits(self) -> dict:
        """The most :meth:`held` can report."""
        return {"threads": sum(n for _, n in self._executors),
                "connections": self._connection_limit()}

    def upload_acked(self, request_id: str) -> Optional[int]:
        """Bytes of the compute request ``request_id``, now in flight, that the server's
        host has acknowledged; None where that is not known (no socket, the call not on
        its connection yet or over, a kernel that does not say)."""
        return None

    def download_received(self, request_id: str) -> Optional[int]:
        """Bytes of the answer to the compute request ``request_id``, now in flight, that
        have arrived so far; None where that is not known (as for :meth:`upload_acked`,
        and on a connection the call opened)."""
        return None

    def abandon(self, request_id: str) -> bool:
        """Stop sending what is left of the compute request ``request_id`` (in flight, its
        answer no longer wanted): its connection is reset, so the unsent rest of it does not hold
        a slow link against the next frames, and its call raises. True where that was done."""
        return False

    def _connections(self) -> int:
        """Open connections to the server (none: an in-process server)."""
        return 0

    def _connection_limit(self) -> int:
        return 0

    def close(self) -> None:
        self._closed.set()
        shutdown_now(self._pool)


def shutdown_now(pool: concurrent.futures.ThreadPoolExecutor) -> None:
    """Shut ``pool`` down without waiting, cancelling the calls that have not started:
    ``shutdown(wait=False, cancel_futures=True)``, which Python 3.8 (the robot's, on ROS
    Noetic) lacks -- there the queued calls are cancelled here the same way."""
    if sys.version_info >= (3, 9):
        pool.shutdown(wait=False, cancel_futures=True)
        return
    work_queue = getattr(pool, "_work_queue", None)
    while work_queue is not None:
        try:
            item = work_queue.get_nowait()
        except queue.Empty:
            break
        if item is not None:
            item.future.cancel()
    pool.shutdown(wait=False)


def threads_named(prefix: str) -> int:
    """Live threads of a ThreadPoolExecutor with ``thread_name_prefix=prefix`` (its
    workers are named ``prefix_N``)."""
    return sum(1 for t in threading.enumerate() if t.name.startswith(prefix + "_"))
