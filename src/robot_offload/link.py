"""The client's connection to one offload server: model loading, health and reconnect.

A :class:`ServerLink` is shared by every server-using backend of a client. It knows
whether the server is usable right now. When a call fails, the link is marked down and a
background prober pings the server every ``retry_interval_s``; frames meanwhile go to the
local model without waiting for any deadline. When a ping answers, the model is loaded
again (the server may have restarted and lost it) and offloading resumes, so recovery
takes at most one retry interval plus one load.

A server can answer pings yet miss every compute deadline (overloaded GPU, a link too slow
for the tensors). So a link is only offered again once the back-off after the last failure
has passed too: ``retry_interval_s`` doubled per consecutive failure, capped at
``max_backoff_s``. Such a server then costs one missed deadline per back-off period, not
one per frame; a success resets the back-off.

A server that refuses the client's authentication (UNAUTHORIZED: no or wrong secret, clocks
too far apart, model not allowed for this client) is treated as down: frames run locally
and the prober keeps trying, so fixing the server's configuration and restarting it brings
offloading back. The refusal is logged as an error once per change of reason.

Every connection starts with a ping that carries the client's versions
(:mod:`robot_offload.compat`); the server answers with its own. A server of another
protocol version disables offloading for good, like a weights hash mismatch (logged as an
error naming both versions; every frame's fallback_reason says it). Operators whose schema
differs between the two torch versions are kept in :attr:`ServerLink.refused_ops` for the
operator modes, which refuse to send them.
"""

import concurrent.futures
import logging
import threading
import time
from typing import Callable, Dict, List, Optional

from robot_offload import compat
from robot_offload.errors import (HashMismatch, Incompatible, ModelNotLoaded, OffloadError,
                                   TransportError, Unauthorized)
from robot_offload.protocol import (ComputeRequest, ComputeResponse, LoadModelRequest,
                                    PingRequest, raise_for_status)
from robot_offload.transport.base import Transport

log = logging.getLogger(__name__)

#: Where a compute call may run when several servers stand behind the link (a
#: :class:`~robot_offload.pool.ServerPool`): on ``ANY_SERVER`` with the model (the call
#: keeps nothing on the server: balanced and hedged), on the ``HOME_SERVER``, which holds
#: this client's state (sessions, the first half of a paired request), or on
#: ``EVERY_SERVER`` up (a preparation each of them should have; the home's answer is
#: returned). One server is all three.
ANY_SERVER, HOME_SERVER, EVERY_SERVER = "any", "home", "every"
PLACEMENTS = (ANY_SERVER, HOME_SERVER, EVERY_SERVER)


class ServerLink:
    def __init__(self, transport: Transport, client_id: str, model: str, weights_hash: str,
                 load_timeout_s: float = 30.0, retry_interval_s: float = 0.5,
                 max_backoff_s: float = 1.5, clock: Callable[[], float] = time.monotonic):
        self.transport = transport
        self.client_id = client_id
        self.model = model
        self.weights_hash = weights_hash
        self.load_timeout_s = load_timeout_s
        self.retry_interval_s = retry_interval_s
        self.max_backoff_s = max(max_backoff_s, retry_interval_s)
        self.clock = clock
        self.consecutive_failures = 0
        self._retry_at = 0.0
        self.server_id = ""
        self.device = ""
        self.last_error = "not connected yet"
        #: this client's versions, sent with the first ping of every connection
        self.versions = compat.local_versions()
        #: the server's, from its answer (None before the first one)
        self.server_versions: Optional[compat.Versions] = None
        #: operators the operator modes must not send to this server -> why
        self.refused_ops: Dict[str, str] = {}
        self._up = threading.Event()
        self._refused = False          # hash or protocol mismatch: never offload
        self._stop = threading.Event()
        self._prober: Optional[threading.Thread] = None
        self._lock = threading.Lock()
        self.listeners: List[Callable[[str], None]] = []   # told "up"/"down" on changes
        self._auth_refusal = ""        # last UNAUTHORIZED text logged

    @property
    def available(self) -> bool:
        return self._up.is_set() and not self._refused and self.clock() >= self._retry_at

    @property
    def state(self) -> str:
        """``up`` (offloading), ``connecting`` (before the first answer or failure),
        ``recovering`` (answering again, in the back-off after failures), ``down`` or
        ``refused`` (the server has other weights: offloading is off for good)."""
        if self._refused:
            return "refused"
        if self._up.is_set():
            return "up" if self.clock() >= self._retry_at else "recovering"
        return "connecting" if self.consecutive_failures == 0 else "down"

    def connect(self, timeout_s: Optional[float] = None) -> bool:
        """Try once to reach the server, exchange versions and load the model; start
        probing on failure."""
        timeout_s = timeout_s or self.load_timeout_s
        deadline = self.clock() + timeout_s
        try:
            self._hello(timeout_s)
            self._load(max(deadline - self.clock(), 0.001))
        except (TransportError, OffloadError) as e:
            self.mark_down(str(e))
            return False
        self._set_up()
        return True

    def compute(self, request: ComputeRequest, timeout_s: float,
                placement: Optional[str] = None) -> ComputeResponse:
        """One compute call within ``timeout_s``; reloads the model once if the server lost
        it. Raises TransportError / RemoteError; the caller falls back and calls
        :meth:`mark_down`. ``placement`` (see :data:`PLACEMENTS`) only matters to a pool."""
        deadline = self.clock() + timeout_s
        return self.checked(self.transport.call("compute", request, timeout_s), request, deadline)

    def checked(self, response: ComputeResponse, request: ComputeRequest,
                deadline: float) -> ComputeResponse:
        """The server's ``response`` to ``request``, its status checked (raises
        RemoteError); when the server had lost the model, it is loaded again and the
        request sent again, before ``deadline`` (:attr:`clock`)."""
        try:
            raise_for_status(response.status, response.status_text)
        except ModelNotLoaded:
            self._load(deadline - self.clock())
            response = self.transport.call("compute", request, deadline - self.clock())
            raise_for_status(response.status, response.status_text)
        self.consecutive_failures = 0
        return response

    def submit(self, request: ComputeRequest, timeout_s: float,
               placement: Optional[str] = None) -> "concurrent.futures.Future":
        """One compute call started on a transport worker: a future of the server's
        response, whose status the caller checks (``raise_for_status``)."""
        return self.transport.submit("compute", request, timeout_s)

    def upload_acked(self, request: ComputeRequest) -> Optional[int]:
        """Bytes of ``request`` (in flight, from :meth:`submit`) the server's host has
        acknowledged so far, or None where the transport cannot tell."""
        return self.transport.upload_acked(request.request_id) if request.request_id else None

    def download_received(self, request: ComputeRequest) -> Optional[int]:
        """Bytes of the answer to ``request`` (in flight, from :meth:`submit`) that have
        arrived so far, or None where the transport cannot tell."""
        return self.transport.download_received(request.request_id) if request.request_id else None

    def abandon(self, request: ComputeRequest) -> bool:
        """Stop sending what is left of ``request`` (in flight, from :meth:`submit`; its
        answer no longer wanted); True where the transport did (see
        :meth:`Transport.abandon`)."""
        return self.transport.abandon(request.request_id) if request.request_id else False

    def query_load(self, timeout_s: float) -> float:
        """The server's wait for a compute slot now (s, as it reports it), by a plain
        ping. Raises TransportError / RemoteError."""
        ping = self.transport.call("ping", PingRequest(client_id=self.client_id), timeout_s)
        raise_for_status(ping.status, ping.status_text)
        return ping.server_backlog_s

    def mark_down(self, reason: str) -> None:
        """Record a failure and start probing in the background (idempotent)."""
        self.last_error = reason
        self.consecutive_failures += 1
        backoff = self.retry_interval_s * 2 ** (self.consecutive_failures - 1)
        self._retry_at = self.clock() + min(backoff, self.max_backoff_s)
        was_up = self._up.is_set()
        self._up.clear()
        if was_up:
            log.warning("offload server unavailable: %s", reason)
            self._notify("down")
        if self._refused:
            return
        with self._lock:
            if self._prober is None or not self._prober.is_alive():
                self._prober = threading.Thread(target=self._probe_loop, name="server-prober",
                                                daemon=True)
                self._prober.start()

    def take_frame_report(self) -> Optional[dict]:
        """What the link did for this thread's frame beyond its calls: nothing for one
        server (a :class:`~robot_offload.pool.ServerPool` reports its servers and hedges)."""
        return None

    def close(self) -> None:
        self._stop.set()
        if self._prober is not None:
            self._prober.join(timeout=2.0)

    # -- internals --------------------------------------------------------------------
    def _hello(self, timeout_s: float):
        """The first ping of a connection: send this client's versions, check the
        server's (robot_offload.compat); returns the ping's response. Raises Incompatible
        (and disables offloading) for a server of another protocol."""
        ping = self.transport.call("ping", PingRequest(client_id=self.client_id,
                                                       versions_json=self.versions.to_json()), timeout_s)
        try:
            raise_for_status(ping.status, ping.status_text)
            server = compat.checked_server_versions(self.versions, ping.versions_json)
        except Incompatible as e:
            self._refused = True
            log.error("offloading disabled: %s", e.text)
            raise
        except Unauthorized as e:
            self._log_auth_refusal(e.text)
            raise
        refused = compat.op_refusals(self.versions, server)
        if refused and refused != self.refused_ops:
            log.warning("the server runs torch %s, the robot torch %s: transparent and record_replay "
                        "refuse frames that use %d operators whose schemas differ: %s",
                        server.torch, self.versions.torch, len(refused), ", ".join(sorted(refused)))
        self.server_versions, self.refused_ops = server, refused
        self.server_id = ping.server_id
        return ping

    def _load(self, timeout_s: float) -> None:
        response = self.transport.call("load_model", LoadModelRequest(
            client_id=self.client_id, model=self.model, weights_hash=self.weights_hash), timeout_s)
        try:
            raise_for_status(response.status, response.status_text)
        except HashMismatch:
            self._refused = True
            log.error("offloading disabled: %s", response.status_text)
            raise
        except Unauthorized:
            self._log_auth_refusal(response.status_text)
            raise
        self._auth_refusal = ""
        self.device = response.device

    def _probe_loop(self) -> None:
        # Pings start every retry_interval_s, not retry_interval_s after the last one
        # ended: a ping lost in a dead link's queue times out after retry_interval_s and
        # the next one leaves at once, so recovery is noticed within about one interval.
        next_at = self.clock() + self.retry_interval_s
        while not self._stop.wait(max(0.0, next_at - self.clock())):
            if self._up.is_set() or self._refused:
                return
            next_at = self.clock() + self.retry_interval_s
            try:
                ping = self._hello(max(self.retry_interval_s, 0.2))
                # A server that still holds the model answers a load at once: do not let
                # one lost packet on a flaky link hold the prober for load_timeout_s.
                loaded = self.model in (ping.loaded_models or ())
                self._load(min(self.load_timeout_s, max(4 * self.retry_interval_s, 2.0))
                           if loaded else self.load_timeout_s)
            except (TransportError, OffloadError) as e:
                self.last_error = str(e)
                if isinstance(e, Unauthorized):
                    self._log_auth_refusal(e.text)
                if self._refused:
                    return
                continue
            self.server_id = ping.server_id
            self._set_up()
            return

    def _log_auth_refusal(self, text: str) -> None:
        if text != self._auth_refusal:
            self._auth_refusal = text
            log.error("offload server refused this client (computing locally, still probing): %s", text)

    def _set_up(self) -> None:
        if not self._up.is_set():
            self._up.set()
            log.info("offload server available (%s)", self.device)
            self._notify("up")

    def _notify(self, state: str) -> None:
        for fn in list(self.listeners):
            fn(state)
