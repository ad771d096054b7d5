"""The server's compute slots, shared fairly among clients and given only to work that
can finish before its client stops waiting.

The entries that run a registry model or its tail (``forward``, ``forward_image``,
``partition_tail``: :attr:`~robot_offload.server.base.Executor.QUEUED`) take one of the
server's ``compute_slots`` while they compute (1 by default: one model at a time makes
the best use of one GPU, or of the CPU's threads).

* **Fair order.** Waiting requests are served client by client in turn (round robin over
  the clients that have one waiting). A robot that sends many requests at once, or simply
  more often, waits behind its own requests; any other client's request waits behind at
  most one of them per turn.
* **Admission.** A compute request says how long its client waits for the answer
  (``deadline_s``, set by the client's transport). Before queueing it, the scheduler
  predicts its wait: the requests ahead of it in that order and what is computing now,
  each at the median of the recent compute times of its entry and model. When there is a
  wait and it plus the request's own expected time passes the deadline, the answer is
  ``BUSY`` at once, so the client can send it to another server or compute it locally
  while there is still time. A server with a free slot and nobody waiting always tries.
* **Dropping.** A request still waiting when its deadline passes is dropped (``BUSY``):
  nobody waits for its answer any more, so it costs no compute. One that states no
  deadline waits at most ``max_wait_s``.
* **Batches** (``max_batch`` > 1). When a request of a batchable entry (``forward``,
  ``forward_image``) gets a slot, the first waiting request of each other client with the
  same model and input shape joins it, in turn order, up to ``max_batch`` in all: one
  forward for all of them, each client getting its own rows. By default a batch is what
  already waits when a slot frees, so an idle server adds no latency and a busy one
  batches the most; with ``batch_wait_s`` the request holds its slot up to that long
  (never past its own deadline) for other clients' requests to join.
* **Cancelling.** A client may take back a request of its own that still waits, by its
  ``request_id`` (:meth:`FairScheduler.cancel`, the ``cancel`` entry): the request answers
  ``BUSY`` at once and costs no compute. A client whose hedged copy answered first on
  another server does so, instead of leaving the loser to run. Once started, a request
  runs to its end.
* **Bounds.** At most ``max_queued_per_client`` requests of one client wait at once (a
  further one is BUSY), and per-client figures are kept for at most ``max_clients``
  clients (least recently seen dropped).

Clients are the identities authentication proved (:mod:`robot_offload.auth`): with
per-client keys one robot cannot pose as several to get more turns; with a shared secret
or none, the ids are as claimed.
"""

import threading
import time
from collections import OrderedDict, deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Deque, Dict, List, Optional, Tuple

from robot_offload.protocol import StatusCode
from robot_offload.server.base import RequestRejected

#: weight of the newest compute time in an entry's running mean
MEAN_WEIGHT = 0.2
#: compute times kept per (entry, model), for the expected time of the next
RECENT = 9
#: (entry, model) pairs whose compute times are kept (least recently used dropped)
MAX_KEYS = 256
#: clients listed by :meth:`FairScheduler.status` (the most recently seen)
STATUS_CLIENTS = 16


@dataclass(eq=False)
class _Ticket:
    client: str
    key: Tuple[str, str]
    expected_s: float
    deadline_at: float
    queued_at: float
    granted: threading.Event = field(default_factory=threading.Event)
    started_at: float = 0.0
    # batching: requests with one batch_key may run as one batch (its leader's)
    batch_key: Optional[tuple] = None
    payload: object = None
    leader: Optional["_Ticket"] = None
    done: threading.Event = field(default_factory=threading.Event)
    result: object = None
    error: Optional[BaseException] = None
    compute_s: float = 0.0
    batch_size: int = 1
    request_id: str = ""
    cancelled: bool = False

    @property
    def waited_s(self) -> float:
        return self.started_at - self.queued_at


@dataclass
class ClientFigures:
    """What one client asked of the compute slots and what it got."""
    requests: int = 0
    served: int = 0
    refused_busy: int = 0        # answered BUSY before queueing (admission, queue bound)
    dropped: int = 0             # waited past its deadline
    cancelled: int = 0           # taken back by the client while waiting
    mean_wait_s: float = 0.0     # running mean of the queue wait of served requests
    mean_compute_s: float = 0.0  # ... and of their compute time
    seen_at: float = 0.0

    def as_dict(self) -> dict:
        return {"requests": self.requests, "served": self.served, "busy": self.refused_busy,
                "dropped": self.dropped, "cancelled": self.cancelled,
                "mean_wait_s": round(self.mean_wait_s, 6), "mean_compute_s": round(self.mean_compute_s, 6)}


def _mean(old: float, new: float, first: bool) -> float:
    return new if first else (1 - MEAN_WEIGHT) * old + MEAN_WEIGHT * new


class FairScheduler:
    def __init__(self, slots: int = 1, max_queued_per_client: int = 4, max_wait_s: float = 60.0,
                 max_clients: int = 1024, clock: Callable[[], float] = time.monotonic):
        if slots <= 0 or max_queued_per_client <= 0 or not max_wait_s > 0 or max_clients <= 0:
            raise ValueError("slots, max_queued_per_client, max_wait_s and max_clients must be positive")
        self.slots = slots
        self.max_queued_per_client = max_queued_per_client
        self.max_wait_s = max_wait_s
        self.max_clients = max_clients
        self.clock = clock
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)     # notified when a request queues
        self._free = slots
        # clients with waiting requests, in turn order (the next served is the first)
        self._waiting: "OrderedDict[str, Deque[_Ticket]]" = OrderedDict()
        self._running: Dict[int, _Ticket] = {}
        self._recent: "OrderedDict[Tuple[str, str], Deque[float]]" = OrderedDict()
        self._clients: "OrderedDict[str, ClientFigures]" = OrderedDict()

    # -- the one entry point ------------------------------------------------------------
    @contextmanager
    def slot(self, client: str, key: Tuple[str, str], deadline_s: float = 0.0,
             batch_key: Optional[tuple] = None, payload=None, request_id: str = ""):
        """Hold a compute slot for the ``with`` body; yields the ticket (``waited_s``).
        Raises RequestRejected (BUSY) when the request cannot start in time.

        With a ``batch_key``, the request may instead be taken into another client's batch
        (:meth:`gather`): then the body gets the ticket with ``leader`` set and its
        ``result`` (or ``error``) already there, and holds no slot."""
        ticket = self._admit(client, key, deadline_s, batch_key, payload, request_id)
        self._wait(ticket)
        if ticket.leader is not None:
            if not ticket.done.wait(self.max_wait_s):
                raise RequestRejected(StatusCode.BUSY, "the batch this request was taken into never finished")
            if ticket.error is not None:
                raise ticket.error
            yield ticket
            return
        try:
            yield ticket
        finally:
            self._release(ticket)

    def gather(self, leader: _Ticket, most: int, wait_s: float = 0.0) -> List[_Ticket]:
        """Up to ``most`` requests of *other* clients waiting with ``leader``'s batch key,
        each the first in its client's queue, taken in the clients' turn order: they run
        in ``leader``'s batch (each client's own requests stay in order, and a batch gives
        every client in it its turn). While fewer are there, wait up to ``wait_s`` for more
        to arrive, but never so long that ``leader`` would miss its own deadline. The
        caller hands each its outcome with :meth:`finish`."""
        taken: List[_Ticket] = []
        if leader.batch_key is None or most <= 0:
            return taken
        with self._arrived:
            end = self.clock() + min(wait_s, leader.deadline_at - self.clock() - leader.expected_s)
            while True:
                now = self.clock()
                for client, queue in list(self._waiting.items()):
                    if len(taken) >= most:
                        break
                    if client == leader.client or queue[0].batch_key != leader.batch_key:
                        continue
                    ticket = queue.popleft()
                    if queue:
                        self._waiting.move_to_end(client)
                    else:
                        del self._waiting[client]
                    ticket.leader = leader
                    ticket.started_at = now
                    taken.append(ticket)
                if len(taken) >= most or now >= end:
                    break
                self._arrived.wait(end - now)
            leader.batch_size = 1 + len(taken)
            for ticket in taken:
                ticket.batch_size = leader.batch_size
                ticket.granted.set()
        return taken

    def finish(self, members: List[_Ticket], results=None, error: Optional[BaseException] = None,
               compute_s: float = 0.0) -> None:
        """Hand the requests taken into a batch their outputs (``results``, in order) or
        the batch's ``error``."""
        with self._lock:
            for i, ticket in enumerate(members):
                ticket.result = None if results is None else results[i]
                ticket.error = error
                ticket.compute_s = compute_s
                figures = self._figures(ticket.client)
                if error is None:
                    figures.served += 1
                    figures.mean_wait_s = _mean(figures.mean_wait_s, ticket.waited_s, figures.served == 1)
                    figures.mean_compute_s = _mean(figures.mean_compute_s, compute_s, figures.served == 1)
        for ticket in members:
            ticket.done.set()

    # -- figures ------------------------------------------------------------------------
    def expected_s(self, key: Tuple[str, str]) -> float:
        """The expected compute time of ``key`` (entry, model): the median of its last
        :data:`RECENT` (one slow first run does not stay for long); 0 before its first."""
        with self._lock:
            return self._expected_locked(key)

    def _expected_locked(self, key) -> float:
        recent = self._recent.get(key)
        if not recent:
            return 0.0
        ordered = sorted(recent)
        return ordered[len(ordered) // 2]

    def predicted_wait_s(self, client: str) -> float:
        """How long a new request of ``client`` would wait for a slot now (s)."""
        with self._lock:
            return self._predicted_wait_locked(client)

    def backlog_s(self) -> float:
        """How long a request of a client with nothing waiting would wait for a slot now
        (s): what clients learn of this server's load (``server_backlog_s`` in each compute
        and ping reply) to balance between servers."""
        with self._lock:
            return self._predicted_wait_locked(None)

    def status(self) -> dict:
        """Slots, queue and the most recently seen clients' figures (for the health
        report and /diagnostics)."""
        with self._lock:
            recent = list(self._clients.items())[-STATUS_CLIENTS:]
            return {"slots": self.slots, "running": len(self._running),
                    "queued": sum(len(q) for q in self._waiting.values()),
                    "clients": {c: f.as_dict() for c, f in reversed(recent)}}

    def client_figures(self, client: str) -> Optional[dict]:
        with self._lock:
            f = self._clients.get(client)
            return None if f is None else f.as_dict()

    # -- internals ----------------------------------------------------------------------
    def _figures(self, client: str) -> ClientFigures:
        f = self._clients.get(client)
        if f is None:
            f = self._clients[client] = ClientFigures()
            while len(self._clients) > self.max_clients:
                self._clients.popitem(last=False)
        self._clients.move_to_end(client)
        f.seen_at = self.clock()
        return f

    def _predicted_wait_locked(self, client: Optional[str]) -> float:
        if self._free > 0 and not self._waiting:
            return 0.0
        own = self._waiting.get(client, ()) if client is not None else ()
        ahead = sum(t.expected_s for t in own)
        for other, queue in self._waiting.items():
            if other != client:
                # round robin: as many of theirs as it has, and one more
                ahead += sum(t.expected_s for i, t in enumerate(queue) if i <= len(own))
        now = self.clock()
        # what is left of the running requests: their expected time, and for one already
        # past it as long again as it has run (it is slower than usual, by how much unknown)
        running = 0.0 if self._free > 0 else sum(
            max(t.expected_s - (now - t.started_at), now - t.started_at) for t in self._running.values())
        return (ahead + running) / self.slots

    def cancel(self, client: str, request_id: str) -> str:
        """Take back ``client``'s request ``request_id`` if it still waits: it answers BUSY
        at once. Returns ``"cancelled"``, ``"running"`` (started: it runs to its end) or
        ``"unknown"`` (finished, taken into another client's batch, never seen, or another
        client's)."""
        if not request_id:
            return "unknown"
        with self._lock:
            queue = self._waiting.get(client)
            for ticket in queue or ():
                if ticket.request_id == request_id:
                    queue.remove(ticket)
                    if not queue:
                        del self._waiting[client]
                    ticket.cancelled = True
                    self._figures(client).cancelled += 1
                    ticket.granted.set()          # wakes its waiter, which sees it cancelled
                    return "cancelled"
            if any(t.client == client and t.request_id == request_id for t in self._running.values()):
                return "running"
        return "unknown"

    def _admit(self, client: str, key: Tuple[str, str], deadline_s: float,
               batch_key: Optional[tuple] = None, payload=None, request_id: str = "") -> _Ticket:
        now = self.clock()
        with self._lock:
            figures = self._figures(client)
            figures.requests += 1
            queued = len(self._waiting.get(client, ()))
            if queued >= self.max_queued_per_client:
                figures.refused_busy += 1
                raise RequestRejected(StatusCode.BUSY, f"{queued} requests of this client are already "
                                      f"waiting for a compute slot (max_queued_per_client)")
            expected = self._expected_locked(key)
            wait = self._predicted_wait_locked(client)
            # an idle server always tries: a request may be faster than the last ones were
            if deadline_s > 0 and wait > 0 and wait + expected > deadline_s:
                figures.refused_busy += 1
                raise RequestRejected(StatusCode.BUSY, (
                    f"server busy: about {wait:.3f} s of queued work before this request and "
                    f"{expected:.3f} s of its own, past its deadline of {deadline_s:.3f} s"))
            bound = deadline_s if deadline_s > 0 else self.max_wait_s
            ticket = _Ticket(client, key, expected, now + bound, now, batch_key=batch_key, payload=payload,
                             request_id=request_id)
            self._waiting.setdefault(client, deque()).append(ticket)
            self._dispatch_locked()
            self._arrived.notify_all()
        return ticket

    def _wait(self, ticket: _Ticket) -> None:
        while not ticket.granted.is_set():
            left = ticket.deadline_at - self.clock()
            if left > 0:
                ticket.granted.wait(left)
                continue
            with self._lock:
                if ticket.granted.is_set():
                    break
                queue = self._waiting.get(ticket.client)
                if queue is not None and ticket in queue:
                    queue.remove(ticket)
                    if not queue:
                        del self._waiting[ticket.client]
                self._figures(ticket.client).dropped += 1
            raise RequestRejected(StatusCode.BUSY, (
                f"dropped after waiting {self.clock() - ticket.queued_at:.3f} s for a compute slot: "
                "past the time its client waits"))
        if ticket.cancelled:       # woken by cancel(), not by a slot
            raise RequestRejected(StatusCode.BUSY, "cancelled by its client while waiting for a compute slot")

    def _dispatch_locked(self) -> None:
        while self._free > 0 and self._waiting:
            client, queue = next(iter(self._waiting.items()))
            ticket = queue.popleft()
            if queue:
                self._waiting.move_to_end(client)
            else:
                del self._waiting[client]
            self._free -= 1
            ticket.started_at = self.clock()
            self._running[id(ticket)] = ticket
            ticket.granted.set()

    def _release(self, ticket: _Ticket) -> None:
        compute_s = self.clock() - ticket.started_at
        with self._lock:
            self._running.pop(id(ticket), None)
            self._free += 1
            recent = self._recent.get(ticket.key)
            if recent is None:
                recent = self._recent[ticket.key] = deque(maxlen=RECENT)
            recent.append(compute_s)
            self._recent.move_to_end(ticket.key)
            while len(self._recent) > MAX_KEYS:
                self._recent.popitem(last=False)
            figures = self._figures(ticket.client)
            figures.served += 1
            figures.mean_wait_s = _mean(figures.mean_wait_s, ticket.waited_s, figures.served == 1)
            figures.mean_compute_s = _mean(figures.mean_compute_s, compute_s, figures.served == 1)
            self._dispatch_locked()
