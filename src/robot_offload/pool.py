"""Several offload servers behind one client: balanced, hedged against the slow one, and
surviving the loss of any of them.

A :class:`ServerPool` stands where a client's single :class:`~robot_offload.link.ServerLink`
would (``ctx.link`` of every backend): it holds one link per server its
:class:`ServerDirectory` lists (in a robot's node, the offload servers the ROS master
knows under one namespace, looked up again every ``rediscover_s``), each with its own
transport, model load, version check and reconnect prober.

* **Stateless work is balanced per call.** A whole model or a partition tail
  (:data:`BALANCED_ENTRIES`), or any call its backend places on
  :data:`~robot_offload.link.ANY_SERVER` (``lop``'s frames whose rows the robot joins:
  one request that leaves nothing on the server), can run on any server that has the
  model, so each call goes to the server the ``balance`` policy picks among those up:
  ``round_robin``,
  ``least_outstanding`` (fewest of this client's calls in flight) or
  ``least_predicted_latency`` (the default: this client's link time to that server, the
  server's own wait for a slot as it reports it in every reply and to a ping every
  ``load_probe_s`` (the other robots' work there), this client's calls in flight and the
  server's recent compute time; servers within :data:`NEAR_BEST` of the best are picked
  among at random, so robots reading the same reports do not all move at once; a server
  not used for ``explore_after_s`` is measured again, by a copy of a call while hedging
  is on, else by a call). A server that answers BUSY or
  fails is skipped for the rest of the call, which goes on to the next one while the
  frame's deadline allows; one that fails is marked down (its prober brings it back).
* **Hedging.** When a balanced call has not answered after the ``hedge_percentile`` of
  this client's recent round trips to the fastest server, and has already waited longer
  than a second server is predicted to take (its reported queue included: when every
  server is busy a copy only adds work, so the hedge waits until it would pay), the same
  request goes to that server and the first answer wins. The loser is cancelled: the client
  stops waiting and takes it back by its ``request_id`` (a ``cancel`` call, not waited
  for), so a server where it still waits for a slot drops it at once
  (:mod:`robot_offload.server.scheduler`); one already computing runs to its end. Hedges
  are at most ``hedge_budget`` of the calls (over the last :data:`BUDGET_WINDOW`); their
  count, wins and extra bytes are in :meth:`ServerPool.figures` and each frame's
  ``stats.extra["pool"]``.
* **Stateful work stays put.** Operator sessions (``transparent``, ``record_replay``),
  ``lop``'s paired requests and anything else sent through :attr:`ServerPool.transport`
  go to one *home* server, kept while it is up (a preparation every server should have,
  ``lop``'s graph capture at a new input shape, goes to the others too, not waited
  for). When it is lost, the next call moves the home to the best server up; the
  backend's session fails once there (its handles are unknown), that frame is computed
  locally, and the session is rebuilt on the new home.

No rospy here: the directory is given (:func:`robot_offload.ros.fleet.master_directory`
for a ROS master; a fixed list in tests).
"""

import collections
import concurrent.futures
import dataclasses
import itertools
import json
import logging
import random
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

from robot_offload.errors import OffloadError, OffloadTimeout, RemoteError, ServerUnavailable, TransportError
from robot_offload.link import ANY_SERVER, EVERY_SERVER, HOME_SERVER, PLACEMENTS, ServerLink
from robot_offload.protocol import ComputeRequest, ComputeResponse, StatusCode
from robot_offload.transport.base import Transport, shutdown_now

log = logging.getLogger(__name__)

POLICIES = ("least_predicted_latency", "least_outstanding", "round_robin")
#: compute entries any server with the model answers alike: balanced and hedged per call
BALANCED_ENTRIES = frozenset({"forward", "forward_image", "partition_tail"})
#: refusals after which a call tries another server (the request itself is fine)
_RETRY_CODES = frozenset({StatusCode.BUSY, StatusCode.INTERNAL, StatusCode.MODEL_NOT_LOADED})
#: a server that answered BUSY is not picked for at least this long (s)
BUSY_SKIP_S = 0.2
#: calls over which the hedge budget is counted
BUDGET_WINDOW = 200
#: the counters of :meth:`ServerPool.figures`
FIGURE_KEYS = ("calls", "hedges", "explored", "hedges_won", "cancelled", "hedge_bytes_up", "failovers")
#: how long a ``cancel`` of a hedge's loser may take (s); nobody waits for it
CANCEL_TIMEOUT_S = 1.0
#: round trips kept per server, for the hedge delay
LATENCY_WINDOW = 64
#: round trips of a server needed before hedging uses its percentile
MIN_SAMPLES = 8
#: weight of the newest round trip in a server's running mean
MEAN_WEIGHT = 0.3
#: a server's reported wait for a slot above this (s) is not believed
MAX_BACKLOG_S = 3600.0
#: a server's report of its wait older than this (s) is no longer used
BACKLOG_TTL_S = 2.0
#: servers predicted within this fraction of the best are picked among at random, so that
#: robots seeing the same reports do not all move to the same server at once
NEAR_BEST = 0.1


@dataclass
class ServerDirectory:
    """Where a client finds its servers: ``names()`` lists them now (unique names, e.g.
    ROS namespaces), ``connect(name)`` opens a transport to one."""
    names: Callable[[], Sequence[str]]
    connect: Callable[[str], Transport]


def budget_allows(hedged: Sequence[bool], share: float) -> bool:
    """Whether one more copy keeps the copies within ``share`` of the recent calls
    (``hedged``: per recent call, whether it was copied)."""
    return sum(hedged) + 1 <= share * max(len(hedged), 1)


def percentile_of(sorted_s: Sequence[float], percentile: float) -> float:
    """The ``percentile`` (0-100) of the non-empty, sorted ``sorted_s`` (nearest rank)."""
    return sorted_s[min(len(sorted_s) - 1, int(round(percentile / 100.0 * (len(sorted_s) - 1))))]


def cancel_request(request: ComputeRequest) -> ComputeRequest:
    """The ``cancel`` call that takes ``request`` back by its ``request_id``."""
    return ComputeRequest(client_id=request.client_id, model=request.model, entry="cancel",
                          args_json=json.dumps({"request_id": request.request_id}))


class _Member:
    def __init__(self, name: str, link: ServerLink):
        self.name = name
        self.link = link
        self.outstanding = 0
        self.mean_s = 0.0            # running mean round trip of this client's calls (s)
        self.net_s = 0.0             # ... of their time outside the server: link and codec (s)
        self.compute_s = 0.0         # ... of the server's time in them, less the queue (s)
        self.backlog_s = 0.0         # the server's wait for a slot, as it last reported it (s)
        self.backlog_at = float("-inf")   # ... and when that report came
        self.calls = 0
        self.last_used = 0.0
        self.skip_until = 0.0        # answered BUSY: not picked before this
        self.started: Dict[int, float] = {}   # calls in flight -> when they left
        #: recent round trips (s) per compute entry: a whole model and a partition tail
        #: take different times, and each call hedges on its own kind's
        self.windows: Dict[str, collections.deque] = collections.defaultdict(
            lambda: collections.deque(maxlen=LATENCY_WINDOW))

    def record(self, entry: str, round_trip_s: float, response: ComputeResponse, now: float) -> None:
        server_s = response.server_total_s or response.server_compute_s
        busy_s = max(0.0, server_s - max(0.0, response.server_queue_s))
        net_s = max(0.0, round_trip_s - server_s)
        first = self.calls == 0
        self.calls += 1
        self.mean_s = _mean(self.mean_s, round_trip_s, first)
        self.net_s = _mean(self.net_s, net_s, first)
        self.compute_s = _mean(self.compute_s, busy_s, first)
        self.last_used = now
        self.windows[entry].append(round_trip_s)
        self.note_backlog(response.server_backlog_s, now)

    def note_backlog(self, backlog_s, now: float) -> None:
        """Take a server's reported wait for a slot, if it is a sane number (a reply is
        data from the network: NaN, negative or huge values are ignored)."""
        if isinstance(backlog_s, float) and 0.0 <= backlog_s <= MAX_BACKLOG_S:
            self.backlog_s, self.backlog_at = backlog_s, now

    def predicted_s(self, now: float) -> float:
        """This client's next call here, predicted: its link time, the server's reported
        wait (while it is recent), this client's calls in flight and the call
        itself at the server's recent compute time; at least as long as the oldest call in
        flight has already taken (a server that fell silent is slower than its mean)."""
        # held, not drained, until the next report: other robots keep adding to it
        backlog = self.backlog_s if now - self.backlog_at <= BACKLOG_TTL_S else 0.0
        oldest = now - min(self.started.values()) if self.started else 0.0
        return max(self.net_s + backlog + (self.outstanding + 1) * self.compute_s, oldest)


class _Frame:
    """What the pool did for one frame: ``report`` (servers used, hedges, failovers; the
    frame's ``stats.extra["pool"]``) and whether a failure was already ``blamed`` on the
    servers that had it (the client's ``mark_down`` then blames no other)."""

    def __init__(self):
        self.report = {"servers": [], "hedged": 0, "explored": 0, "hedge_won": 0,
                       "hedge_bytes_up": 0, "failovers": 0}
        self.blamed = False


def _mean(old: float, new: float, first: bool) -> float:
    return new if first else (1 - MEAN_WEIGHT) * old + MEAN_WEIGHT * new


class _NoServer(Transport):
    """The home transport while no server is up: every call fails at once."""

    def __init__(self, why: str):
        super().__init__(max_parallel_calls=1)
        self.why = why

    def _call(self, method, request, timeout_s):
        raise ServerUnavailable(self.why)


class ServerPool:
    def __init__(self, directory: ServerDirectory, client_id: str, model: str, weights_hash: str,
                 balance: str = "least_predicted_latency", hedge: bool = True,
                 hedge_percentile: float = 95.0, hedge_budget: float = 0.1,
                 rediscover_s: float = 2.0, explore_after_s: float = 5.0, load_probe_s: float = 0.5,
                 clock: Callable[[], float] = time.monotonic, **link_kw):
        if balance not in POLICIES:
            raise ValueError(f"unknown balance {balance!r}; known: {list(POLICIES)}")
        self.directory = directory
        self.client_id = client_id
        self.model = model
        self.weights_hash = weights_hash
        self.balance = balance
        self.hedge = hedge
        self.hedge_percentile = hedge_percentile
        self.hedge_budget = hedge_budget
        self.rediscover_s = rediscover_s
        self.explore_after_s = explore_after_s
        self.load_probe_s = load_probe_s
        self.clock = clock
        self._link_kw = link_kw
        self._lock = threading.Lock()
        self._members: Dict[str, _Member] = {}
        self._home: Optional[_Member] = None
        self._rr = itertools.count()
        self._budget = collections.deque(maxlen=BUDGET_WINDOW)   # True: that call hedged
        self._figures = collections.Counter()
        self._tls = threading.local()
        self._random = random.Random(client_id)
        self._calls = concurrent.futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="pool-call")
        self._stop = threading.Event()
        self._watcher: Optional[threading.Thread] = None
        self._load_prober: Optional[threading.Thread] = None
        self.last_error = "no offload server found yet"
        self._no_server = _NoServer(self.last_error)

    # -- the link's surface, for backends and the client ---------------------------------
    @property
    def available(self) -> bool:
        return any(m.link.available for m in self._snapshot())

    @property
    def state(self) -> str:
        members = self._snapshot()
        if not members:
            return "connecting"
        up = sum(1 for m in members if m.link.available)
        if up:
            return "up"
        return "connecting" if all(m.link.state == "connecting" for m in members) else "down"

    @property
    def home(self) -> Optional[_Member]:
        """The server stateful work goes to: kept while it is up, else the best one up."""
        with self._lock:
            home = self._home
            if home is not None and home.link.available and home.name in self._members:
                return home
            up = [m for m in self._members.values() if m.link.available]
            if not up:
                return home if home is not None and home.name in self._members else None
            now = self.clock()
            new = min(up, key=lambda m: (self._predicted_locked(m, now), m.name))
            if home is not None and new is not home:
                log.warning("sessions and plans move from offload server %s to %s", home.name, new.name)
            self._home = new
            return new

    @property
    def transport(self) -> Transport:
        home = self.home
        if home is not None:
            return home.link.transport
        self._no_server.why = f"no offload server available: {self.last_error}"
        return self._no_server

    def _home_attr(self, name: str, default):
        home = self.home
        return getattr(home.link, name) if home is not None else default

    server_id = property(lambda self: self._home_attr("server_id", ""))
    device = property(lambda self: self._home_attr("device", ""))
    refused_ops = property(lambda self: self._home_attr("refused_ops", {}))
    server_versions = property(lambda self: self._home_attr("server_versions", None))

    def connect(self, timeout_s: Optional[float] = None) -> bool:
        """Look the servers up, connect to each (in parallel) and keep looking them up in
        the background; True when at least one is up."""
        self.refresh(connect_timeout_s=timeout_s)
        if self._watcher is None:
            self._watcher = threading.Thread(target=self._watch, name="pool-directory", daemon=True)
            self._watcher.start()
        if self._load_prober is None and self.balance == "least_predicted_latency" and self.load_probe_s > 0:
            self._load_prober = threading.Thread(target=self._probe_load, name="pool-load", daemon=True)
            self._load_prober.start()
        return self.available

    def compute(self, request: ComputeRequest, timeout_s: float,
                placement: Optional[str] = None) -> ComputeResponse:
        """One compute call within ``timeout_s`` where ``placement`` says
        (:data:`~robot_offload.link.PLACEMENTS`; by default, balanced and hedged for
        :data:`BALANCED_ENTRIES`, else on the home server)."""
        if placement is None:
            placement = ANY_SERVER if request.entry in BALANCED_ENTRIES else HOME_SERVER
        if placement not in PLACEMENTS:
            raise ValueError(f"unknown placement {placement!r}; known: {list(PLACEMENTS)}")
        if placement == ANY_SERVER:
            return self._balanced(request, timeout_s)
        home = self.home
        if home is None:
            raise ServerUnavailable(f"no offload server available: {self.last_error}")
        if placement == EVERY_SERVER:     # a preparation the others should have too
            self._send_aside([m for m in self._snapshot() if m is not home and m.link.available],
                             request, timeout_s)
        self._frame().report["servers"].append(home.name)
        return self._timed(home, request, timeout_s)

    def submit(self, request: ComputeRequest, timeout_s: float,
               placement: Optional[str] = None) -> concurrent.futures.Future:
        """:meth:`compute` started on a worker thread, for the calling thread's frame (its
        servers, hedges and failures are the frame's): a future of the response."""
        frame = self._frame()

        def call():
            self._tls.frame = frame
            try:
                return self.compute(request, timeout_s, placement)
            finally:
                self._tls.frame = None
        return self._calls.submit(call)

    def mark_down(self, reason: str) -> None:
        """A frame failed. A balanced call already marked the servers that failed it;
        otherwise the failure was the home server's (a session or a paired call)."""
        self.last_error = reason
        frame = getattr(self._tls, "frame", None)
        if frame is not None and frame.blamed:
            frame.blamed = False
            return
        home = self.home
        if home is not None:
            home.link.mark_down(reason)
            with self._lock:
                if self._home is home:
                    self._home = None

    def upload_acked(self, request: ComputeRequest) -> Optional[int]:
        """:meth:`ServerLink.upload_acked` on whichever server's link carries ``request``
        (by its ``request_id``), or None."""
        return self._on_its_link(lambda link: link.upload_acked(request))

    def download_received(self, request: ComputeRequest) -> Optional[int]:
        """:meth:`ServerLink.download_received` on whichever server's link carries
        ``request``, or None."""
        return self._on_its_link(lambda link: link.download_received(request))

    def abandon(self, request: ComputeRequest) -> bool:
        """:meth:`ServerLink.abandon` on whichever server's link carries ``request``."""
        return any(m.link.abandon(request) for m in self._snapshot())

    def _on_its_link(self, read: Callable[[ServerLink], Optional[int]]) -> Optional[int]:
        """``read(link)`` of the first server link that knows the request (not None)."""
        for m in self._snapshot():
            value = read(m.link)
            if value is not None:
                return value
        return None

    def take_frame_report(self) -> Optional[dict]:
        """What the pool did for this thread's frame since the last call (servers used,
        hedges, failovers), and start a new one."""
        frame = getattr(self._tls, "frame", None)
        self._tls.frame = None
        return frame.report if frame is not None else None

    def figures(self) -> dict:
        """The counters of :data:`FIGURE_KEYS` (calls, hedges sent, copies exploring,
        hedges won, losers cancelled, extra bytes up, failovers; those still 0 absent) and
        per server: calls, mean round trip, state."""
        with self._lock:
            out = dict(self._figures)
            out["servers"] = {m.name: {"calls": m.calls, "mean_s": round(m.mean_s, 6),
                                       "state": m.link.state, "outstanding": m.outstanding}
                              for m in self._members.values()}
        return out

    def close(self) -> None:
        self._stop.set()
        for thread in (self._watcher, self._load_prober):
            if thread is not None:
                thread.join(timeout=2.0)
        shutdown_now(self._calls)
        with self._lock:
            members, self._members = list(self._members.values()), {}
        for m in members:
            self._drop(m)
        self._no_server.close()

    # -- directory -------------------------------------------------------------------------
    def refresh(self, connect_timeout_s: Optional[float] = None) -> None:
        """Add the servers the directory lists now and drop those it no longer does."""
        try:
            names = list(dict.fromkeys(self.directory.names()))
        except Exception as e:  # noqa: BLE001 - a master that does not answer: keep what we have
            self.last_error = f"server directory: {type(e).__name__}: {e}"
            log.warning("cannot list offload servers: %s", e)
            return
        new = []
        with self._lock:
            gone = [m for n, m in self._members.items() if n not in names]
            for m in gone:
                del self._members[m.name]
            for name in names:
                if name not in self._members:
                    link = ServerLink(self.directory.connect(name), self.client_id, self.model,
                                      self.weights_hash, clock=self.clock, **self._link_kw)
                    self._members[name] = m = _Member(name, link)
                    new.append(m)
        for m in gone:
            log.warning("offload server %s left", m.name)
            self._drop(m)
        if not names:
            self.last_error = "no offload server found"
        threads = [threading.Thread(target=self._join, args=(m, connect_timeout_s), daemon=True) for m in new]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def _join(self, member: _Member, timeout_s: Optional[float]) -> None:
        if member.link.connect(timeout_s):
            log.info("offload server %s joined (%s)", member.name, member.link.device)
        else:
            self.last_error = f"{member.name}: {member.link.last_error}"

    def _watch(self) -> None:
        while not self._stop.wait(self.rediscover_s):
            self.refresh()

    def _probe_load(self) -> None:
        """Ask every server up for its wait for a slot every ``load_probe_s``: what the
        other robots' calls cost there, which this client's own round trips do not show
        for a server it has not used lately."""
        while not self._stop.wait(self.load_probe_s):
            for m in self._snapshot():
                if not m.link.available or self._stop.is_set():
                    continue
                try:
                    backlog_s = m.link.query_load(max(self.load_probe_s, 0.2))
                except (TransportError, OffloadError):
                    continue              # a compute call finds out, and marks it down
                except Exception as e:  # noqa: BLE001 - a server leaving mid-ping: never end the prober
                    log.debug("load probe of %s: %s: %s", m.name, type(e).__name__, e)
                    continue
                with self._lock:
                    m.note_backlog(backlog_s, self.clock())

    @staticmethod
    def _drop(member: _Member) -> None:
        member.link.close()
        member.link.transport.close()

    def _snapshot(self) -> List[_Member]:
        with self._lock:
            return list(self._members.values())

    # -- balancing and hedging ---------------------------------------------------------------
    def _predicted_locked(self, m: _Member, now: float) -> float:
        if m.calls == 0 and not m.started:
            return 0.0                       # never tried: try it
        if not self.hedge and not m.started and now - m.last_used > self.explore_after_s:
            return 0.0                       # not tried lately: without hedges, a frame explores
        return m.predicted_s(now)

    def _pick(self, exclude=()) -> Optional[_Member]:
        now = self.clock()
        with self._lock:
            up = [m for m in self._members.values()
                  if m.link.available and m not in exclude and m.skip_until <= now]
            if not up:
                return None
            up.sort(key=lambda m: m.name)
            if self.balance == "round_robin":
                if exclude:            # a hedge or failover: the turn stays where it was
                    return up[0]
                return up[next(self._rr) % len(up)]
            if self.balance == "least_outstanding":
                return min(up, key=lambda m: (m.outstanding, m.last_used))
            predicted = [(self._predicted_locked(m, now), m) for m in up]
            best = min(p for p, _ in predicted)
            return self._random.choice([m for p, m in predicted if p <= best * (1 + NEAR_BEST)])

    def _predicted_now(self, m: _Member) -> float:
        with self._lock:
            return m.predicted_s(self.clock())

    def _explore_locked(self, first: _Member, now: float) -> Optional[_Member]:
        """With hedging on, a server not used for ``explore_after_s`` is measured again by
        sending it a copy of a call (the first answer wins, so the frame does not wait for
        a server that may have become slow), while at most half the hedge budget is spent."""
        if not self.hedge or self.balance != "least_predicted_latency":
            return None
        if not self._budget_allows_locked(0.5 * self.hedge_budget):
            return None
        stale = [m for m in self._members.values()
                 if m is not first and m.link.available and m.skip_until <= now and not m.started
                 and m.calls > 0 and now - m.last_used > self.explore_after_s]
        return min(stale, key=lambda m: m.last_used) if stale else None

    def _budget_allows_locked(self, share: float) -> bool:
        return budget_allows(self._budget, share)

    def _hedge_delay_s(self, entry: str) -> Optional[float]:
        """When a call to ``entry`` is late enough to hedge: the ``hedge_percentile`` of the
        recent round trips there of the server that answers fastest (a slow server's own
        percentile would only say its calls are always late), or of all of them while no
        server has :data:`MIN_SAMPLES`; None when hedging is off, unmeasured or past its
        budget."""
        if not self.hedge:
            return None
        with self._lock:
            if not self._budget_allows_locked(self.hedge_budget):
                return None
            up = [m for m in self._members.values() if m.link.available]
            mine = [m.windows.get(entry, ()) for m in up]
            windows = [sorted(w) for w in mine if len(w) >= MIN_SAMPLES]
            if not windows:           # calls spread thin: all of this client's round trips
                pooled = sorted(t for w in mine for t in w)
                windows = [pooled] if len(pooled) >= MIN_SAMPLES else []
        if not windows:
            return None
        return min(percentile_of(w, self.hedge_percentile) for w in windows)

    def _frame(self) -> "_Frame":
        """The calling thread's frame (its worker calls share it, see :meth:`submit`)."""
        frame = getattr(self._tls, "frame", None)
        if frame is None:
            frame = self._tls.frame = _Frame()
        return frame

    def _send_aside(self, members: List[_Member], request: ComputeRequest, timeout_s: float,
                    answered: Optional[Callable[[ComputeResponse], None]] = None) -> None:
        """``request`` to each of ``members`` on a worker, not waited for; ``answered``
        gets each OK answer. A failure is only logged: the next real call finds it out."""
        def send(member):
            try:
                response = member.link.compute(request, timeout_s)
            except (TransportError, RemoteError) as e:
                log.debug("%s: %s not answered: %s", member.name, request.entry, e)
                return
            if answered is not None:
                answered(response)
        for member in members:
            self._calls.submit(send, member)

    def _count_hedge(self, report: dict, request: ComputeRequest, why: str = "") -> None:
        """A copy of ``request`` sent: in the frame's report and the pool's figures, also
        under ``why`` (e.g. ``explored``) when given."""
        report["hedged"] += 1
        report["hedge_bytes_up"] += request.payload_bytes
        if why:
            report[why] += 1
        with self._lock:
            self._figures["hedges"] += 1
            self._figures["hedge_bytes_up"] += request.payload_bytes
            if why:
                self._figures[why] += 1

    def _timed(self, member: _Member, request: ComputeRequest, timeout_s: float) -> ComputeResponse:
        token = object()
        t0 = self.clock()
        with self._lock:
            member.outstanding += 1
            member.started[id(token)] = t0
        try:
            response = member.link.compute(request, timeout_s)
        finally:
            with self._lock:
                member.outstanding -= 1
                member.started.pop(id(token), None)
        now = self.clock()
        with self._lock:
            member.record(request.entry, now - t0, response, now)
        return response

    def _cancel(self, losers: List[_Member], request: ComputeRequest) -> None:
        """Take ``request`` back from the servers that lost to another's answer (it may
        still wait there for a compute slot): one small call each, not waited for."""
        if not losers or not request.request_id:
            return

        def counted(response: ComputeResponse) -> None:
            try:
                state = json.loads(response.result_json).get("state")
            except (ValueError, AttributeError):     # a reply is data from the network
                return
            if state == "cancelled":
                with self._lock:
                    self._figures["cancelled"] += 1
        self._send_aside(losers, cancel_request(request), CANCEL_TIMEOUT_S, counted)

    def _failed(self, member: _Member, error: Exception) -> bool:
        """Note a failed call on ``member``; True when another server may answer it."""
        if isinstance(error, RemoteError) and error.code not in _RETRY_CODES:
            return False                          # the request's own fault: the same anywhere
        if isinstance(error, RemoteError) and error.code == StatusCode.BUSY:
            with self._lock:
                member.skip_until = self.clock() + max(member.compute_s, BUSY_SKIP_S)
        else:
            member.link.mark_down(f"{member.name}: {type(error).__name__}: {error}")
        self._frame().blamed = True
        return True

    def _balanced(self, request: ComputeRequest, timeout_s: float) -> ComputeResponse:
        deadline = self.clock() + timeout_s
        if self.hedge and not request.request_id:     # its name, should a copy win
            request = dataclasses.replace(request, request_id=secrets.token_hex(8))
        report = self._frame().report
        tried: List[_Member] = []
        running: Dict[concurrent.futures.Future, _Member] = {}
        last_error: Optional[Exception] = None
        hedge_at = None
        hedged = sent_hedge = False

        def start(member):
            tried.append(member)
            report["servers"].append(member.name)
            running[self._calls.submit(self._timed, member, request, deadline - self.clock())] = member

        first = self._pick()
        if first is None:
            raise ServerUnavailable(f"no offload server available: {self.last_error}")
        start(first)
        sent_at = self.clock()
        with self._lock:
            explore = self._explore_locked(first, self.clock())
        if explore is not None:
            hedged = sent_hedge = True
            self._count_hedge(report, request, "explored")
            start(explore)
        delay = None if hedged else self._hedge_delay_s(request.entry)
        if delay is not None:
            hedge_at = self.clock() + delay
        try:
            while running:
                now = self.clock()
                if now >= deadline:
                    break
                wake = deadline if hedge_at is None or hedged else min(deadline, hedge_at)
                done, _ = concurrent.futures.wait(list(running), timeout=max(0.0, wake - now),
                                                  return_when=concurrent.futures.FIRST_COMPLETED)
                for fut in done:
                    member = running.pop(fut)
                    try:
                        response = fut.result()
                    except (TransportError, RemoteError) as e:
                        last_error = e
                        if not self._failed(member, e):
                            raise
                        if not running:      # fail over while the deadline allows
                            nxt = self._pick(exclude=tried)
                            if nxt is not None and deadline - self.clock() > 0:
                                report["failovers"] += 1
                                with self._lock:
                                    self._figures["failovers"] += 1
                                start(nxt)
                        continue
                    if sent_hedge and member is not first:
                        report["hedge_won"] += 1
                        with self._lock:
                            self._figures["hedges_won"] += 1
                    self._cancel(list(running.values()), request)
                    return response
                now = self.clock()
                if not hedged and hedge_at is not None and now >= hedge_at and running:
                    second = self._pick(exclude=tried)
                    waited_s = now - sent_at
                    if second is None:
                        hedged = True
                    elif self._predicted_now(second) < waited_s:
                        hedged = sent_hedge = True
                        self._count_hedge(report, request)
                        start(second)
                    else:       # it would answer no sooner: look again as the call goes on
                        hedge_at = now + max(0.25 * (hedge_at - sent_at), 0.005)
        finally:
            with self._lock:
                self._figures["calls"] += 1
                self._budget.append(sent_hedge)
        if last_error is not None and not running:
            raise last_error
        for member in running.values():       # abandoned at the deadline: they missed it
            member.link.mark_down(f"{member.name}: no answer within {timeout_s:.3f} s")
        self._frame().blamed = True
        raise OffloadTimeout(f"no offload server answered within {timeout_s:.3f} s "
                             f"(tried {', '.join(m.name for m in tried)})")
