"""A late offloaded frame hedged by the robot itself (one server, no second to ask).

With several servers a late call goes to a second one too (:mod:`robot_offload.pool`).
With one, the robot is the only other place the frame can run: when a ``full_offload``
call, a ``layer_partition`` tail, or a spatial ``lop`` frame's transfers
(:meth:`LocalHedge.race`), has not answered by the ``hedge_percentile`` of this client's
recent round trips of its kind, the robot starts the local model on the frame (the rest of
the model on its own head tensors), and the first answer wins. When the
server answers first the local forward stops at its next module (a forward pre-hook on
the hedging thread), and when the robot finishes first the server's copy is cancelled
(taken back while it still waits for a compute slot). The frame's ``stats`` say so:
``executed_mode`` is ``local`` when the robot's outputs were used, and ``detail_json``
holds ``hedge``: who won and after how long the robot started.

The robot starts once the call is late for the server *and* for the robot: past the
percentile, and past its own work (:meth:`observe_local`: the local frames and fallbacks
of the client, and its warm-up) divided by :data:`LOCAL_SHARE`, so that what it
computes is at most that share of what the frame has waited (a robot about as quick as
the server would otherwise start beside every slightly late call and finish about when
its answer comes). It must fit what is left of the deadline, and the late rule hedges at
most ``hedge_budget`` of the calls (over the last :data:`BUDGET_WINDOW`), so that a server
slow for good costs the robot a bounded share of its CPU before the frames fall back.

It starts sooner when the link fades under the upload: where the transport can tell how
much of the request the server's host has acknowledged (:meth:`ServerLink.upload_acked`,
from the kernel's TCP counters), the robot watches the upload every :data:`POLL_S`, and
once the rate of the last :data:`STALL_WINDOW_S` would take longer to send what is left
than the robot takes for the whole frame, it starts then (``hedge.upload`` in the frame's
details: the bytes acknowledged and after how long). A fade that begins during a frame
then costs about the robot's own time, not that plus twice it. Once the upload has gone
through, the answer is watched the same way (the bytes received, against the size of the
last answer of the call's kind; ``hedge.download``), for a fade under a large answer
(KAPAO's 2 MB of predictions). When the robot answers a frame whose upload has not gone
through, or whose answer is still arriving, the call is abandoned (its connection reset,
the unsent rest dropped, ``hedge.upload_abandoned`` or ``hedge.answer_abandoned``): its
rest would otherwise hold the slow link against the next frames, whose hedges then won
too and left more behind, until calls missed their deadline.

A kind of call new to the client (``layer_partition`` and ``lop`` key their calls by the
cut, and ``auto`` moves between cuts as the bandwidth estimate does) is late by the
percentile of all the client's recent round trips until it has :data:`MIN_SAMPLES` of its
own. Keyed alone, each new cut went unwatched for its first calls: a MobileNetV2 frame
whose call took 980 ms (10 ms of it on the server) waited for it, where the robot takes
47 ms. A kind whose calls really take longer than the others' is still held back by the
robot's own work (twice it) and the budget.

A stalled transfer starts the robot whatever the budget, and before any round trip of
the call's kind was measured: it is no guess that the answer may be late but a reading
that the rest takes longer than the robot's whole frame. With the budget spent on an
earlier fade, a frame offloaded into the next one used to wait out the fade (MobileNetV2
on the outdoor trace: 1.3 s against 46 ms on the robot), as did the first frame of a new
`lop` schedule (ResNet-101: 1.28 s against 0.38).
"""

import collections
import concurrent.futures
import dataclasses
import secrets
import statistics
import threading
import time
from typing import Callable, Dict, Optional, Tuple

import torch

from robot_offload import background
from robot_offload.errors import OffloadTimeout
from robot_offload.pool import (BUDGET_WINDOW, CANCEL_TIMEOUT_S, LATENCY_WINDOW, MIN_SAMPLES, budget_allows,
                                cancel_request, percentile_of)
from robot_offload.protocol import ComputeRequest, ComputeResponse, StatusCode

#: local forwards kept (s): the median is the robot's expected time
LOCAL_WINDOW = 9
#: the robot starts no sooner than when its work is this share of the frame's wait
LOCAL_SHARE = 0.5
#: how often the upload of a call the robot may hedge is read (s)
POLL_S = 0.025
#: an upload's rate is read over at least this much of its latest progress (s)
STALL_WINDOW_S = 0.1


class LocalHedge:
    """When a client with one server starts the local model beside a late call."""

    def __init__(self, percentile: float = 95.0, budget: float = 0.1):
        self.percentile, self.budget = percentile, budget
        self._lock = threading.Lock()
        self._round_trips: Dict[str, collections.deque] = {}     # per kind of call
        self._local_s = collections.deque(maxlen=LOCAL_WINDOW)
        self._hedged = collections.deque(maxlen=BUDGET_WINDOW)     # True: that call hedged
        self._answer_bytes: Dict[str, int] = {}       # per kind of call: its last answer's size
        self.figures = {"calls": 0, "hedges": 0, "local_won": 0, "server_won": 0}

    def observe_local(self, seconds: float) -> None:
        """The robot ran the whole model in ``seconds``."""
        with self._lock:
            self._local_s.append(float(seconds))

    def observe_round_trip(self, key: str, seconds: float) -> None:
        """A call of kind ``key`` the server answered, ``seconds`` after it was sent."""
        with self._lock:
            self._round_trips.setdefault(key, collections.deque(maxlen=LATENCY_WINDOW)).append(float(seconds))

    def delay_s(self, key: str, remaining_s: float, local_s: Optional[float] = None) -> Optional[float]:
        """How long to wait before the robot starts on a call of kind ``key`` with
        ``remaining_s`` left of its deadline, when the robot's own work takes ``local_s``
        (None: the whole model, as measured): the later of the percentile of its recent
        round trips (of all kinds while it has too few of its own) and ``local_s /
        LOCAL_SHARE``; or None: not hedged (too few round trips measured, no local
        forward measured, no time left for the robot's work, or the budget spent)."""
        plan = self._plan(key, remaining_s, local_s)
        return None if plan is None else plan[0]

    def _plan(self, key: str, remaining_s: float, local_s: Optional[float]):
        """``(late_s, local_s)`` for :meth:`call`: when the call is late (None: waiting
        that long leaves the robot no time, too few round trips are measured, or the
        budget is spent: only a stalled transfer starts the robot) and the robot's work;
        or None: not hedged (no local forward measured, no time left for the robot's work
        even now). A kind of call with fewer than :data:`MIN_SAMPLES` round trips of its
        own is late by the percentile of all the client's kinds (see the module)."""
        with self._lock:
            trips = sorted(self._round_trips.get(key, ()))
            if len(trips) < MIN_SAMPLES:      # a kind new to the client: all its kinds' calls
                trips = sorted(t for kind in self._round_trips.values() for t in kind)
            if local_s is None:
                local_s = statistics.median(self._local_s) if self._local_s else None
            if local_s is None or local_s > remaining_s:
                return None
            if len(trips) < MIN_SAMPLES or not budget_allows(self._hedged, self.budget):
                return None, local_s      # a stalled transfer only (see the module)
            late_s = max(percentile_of(trips, self.percentile), local_s / LOCAL_SHARE)
            return (late_s if late_s + local_s <= remaining_s else None), local_s

    def count(self, hedged: bool, winner: str = "") -> None:
        """One call: whether the robot hedged it, and who answered first."""
        with self._lock:
            self._hedged.append(bool(hedged))
            self.figures["calls"] += 1
            if hedged:
                self.figures["hedges"] += 1
                self.figures[f"{winner}_won"] += 1

    def call(self, link, key: str, request: ComputeRequest, timeout_s: float, stats,
             compute_locally: Callable[[Callable[[], bool]], object],
             local_s: Optional[float] = None) -> Tuple[Optional[ComputeResponse], object]:
        """``request`` on ``link`` within ``timeout_s``, hedged when :meth:`delay_s` says
        so: ``(response, None)`` with the server's checked response, or ``(None, outputs)``
        when the robot's ``compute_locally(answered)`` finished first (it returns None
        when ``answered()`` turned true first, and accounts its robot time in ``stats``;
        the server's copy is cancelled). ``local_s``: as for :meth:`delay_s`; when None,
        the time ``compute_locally`` took is a sample of the whole model's."""
        plan = self._plan(key, timeout_s, local_s)
        sent = time.perf_counter()
        if plan is None:
            response = link.compute(request, timeout_s)
            self.observe_round_trip(key, time.perf_counter() - sent)
            with self._lock:
                self._answer_bytes[key] = response.payload_bytes
            self.count(False)
            return response, None
        request = dataclasses.replace(request, request_id=secrets.token_hex(8))
        deadline = link.clock() + timeout_s
        future = link.submit(request, timeout_s)
        outputs = self._race(link, key, [(request, future)], sent, timeout_s, plan, stats,
                             compute_locally, local_s)
        if outputs is not None:
            return None, outputs
        with background.GATE.waiting():
            try:
                response = future.result(timeout=max(0.0, deadline - link.clock()))
            except concurrent.futures.TimeoutError:
                raise OffloadTimeout(f"no answer within {timeout_s:.3f} s") from None
        return link.checked(response, request, deadline), None

    def race(self, link, key: str, calls, sent: float, timeout_s: float, stats,
             compute_locally: Callable[[Callable[[], bool]], object],
             local_s: Optional[float] = None) -> Optional[object]:
        """The hedge of :meth:`call` for calls a frame has already submitted (``lop``'s
        transfers, sent before the robot computed its own stripe): ``calls`` is
        ``[(request, future)]`` (each request with a ``request_id``, so that it can be
        abandoned or cancelled), the first sent at ``sent`` (:func:`time.perf_counter`),
        all due within ``timeout_s`` of it. A call of kind ``key`` is all of them answered;
        its round trip is from ``sent`` to the last answer. Returns the robot's outputs when
        ``compute_locally`` finished first (each unfinished upload abandoned, each other
        request cancelled, one call per request accounted in ``stats``), or None: the
        caller takes the answers from the futures (all done, a failure among them, or no
        time left for the robot)."""
        plan = self._plan(key, timeout_s, local_s)
        return self._race(link, key, calls, sent, timeout_s, plan, stats, compute_locally, local_s)

    def _race(self, link, key: str, calls, sent: float, timeout_s: float, plan, stats,
              compute_locally, local_s: Optional[float]) -> Optional[object]:
        """The wait of :meth:`call` and :meth:`race`, hedged under ``plan`` (of
        :meth:`_plan`; None: not hedged): the robot's outputs when it won, else None once
        every future is done or the time is up; counts the call, and observes its round
        trip when all answered."""
        answered_at = []
        futures = [f for _, f in calls]
        for f in futures:
            f.add_done_callback(lambda _: answered_at.append(time.perf_counter()))
        start = False
        if plan is not None:
            upload = _Upload(sum(r.payload_bytes for r, _ in calls), watch_from_s=time.perf_counter() - sent)
            with self._lock:
                answer_bytes = self._answer_bytes.get(key)
            download = _Download(answer_bytes) if answer_bytes else None
            with background.GATE.waiting():
                start = _wait_until_late(futures, (upload, lambda: _acked(link, calls)),
                                         (download, lambda: _received(link, calls)), sent, *plan, timeout_s)
        if start:
            started = time.perf_counter()
            outputs = compute_locally(lambda: all(_answered_ok(f) for f in futures))
            detail = {"robot_started_after_ms": round((started - sent) * 1e3, 1)}
            for name, watch in (("upload", upload), ("download", download)):
                if watch is not None and watch.stalled_at is not None:
                    detail[name] = watch.stalled_at
            under_way = None if "upload" in detail or "download" in detail else upload.under_way()
            if under_way is not None:
                detail["upload_under_way"] = under_way
            if outputs is not None:
                self.count(True, "local")
                if local_s is None:
                    self.observe_local(time.perf_counter() - started)
                for request, future in calls:
                    moving = _in_transfer(link, request, future)
                    if moving and link.abandon(request):
                        # the server never had it whole, or its answer was still arriving
                        detail[f"{moving}_abandoned"] = True
                    else:
                        _cancel(link, request)
                    stats.add_call(sent, started, 0.0, request.payload_bytes, 0)
                stats.executed_mode = "local"
                stats.extra["hedge"] = {**detail, "won": "local"}
                return outputs
            self.count(True, "server")
            stats.extra["hedge"] = {**detail, "won": "server"}
        else:
            self.count(False)
        with background.GATE.waiting():
            concurrent.futures.wait(futures, timeout=max(0.0, sent + timeout_s - time.perf_counter()))
        if len(answered_at) == len(futures):
            self.observe_round_trip(key, max(answered_at) - sent)
            if all(_answered_ok(f) for f in futures):
                with self._lock:
                    self._answer_bytes[key] = sum(f.result().payload_bytes for f in futures)
        return None


class _Upload:
    """A request's upload as the robot sees it: ``(waited s, bytes acknowledged)`` read
    while the call waits."""

    def __init__(self, size_bytes: int, watch_from_s: float = 0.0):
        self.size_bytes = int(size_bytes)
        self.watch_from_s = watch_from_s      # when the readings begin (s into the call)
        self.readings = collections.deque()
        self.readable = True            # False: the transport cannot tell, or the upload is over
        #: when the upload was found too slow: bytes acknowledged, of, after ms, rate
        self.stalled_at: Optional[dict] = None

    def stalled(self, waited_s: float, acked: Optional[int], local_s: float) -> bool:
        """Whether, at ``acked`` bytes acknowledged ``waited_s`` into the call, what is left
        of the upload would take longer than ``local_s`` at the rate of its latest
        :data:`STALL_WINDOW_S` (or more)."""
        if acked is None:
            if not self.readings and waited_s - self.watch_from_s >= STALL_WINDOW_S:
                self.readable = False          # no reading yet: the transport cannot tell
            return False
        if acked >= self.size_bytes:
            self.readable = False              # sent: what is slow now is not the upload
            return False
        self.readings.append((waited_s, acked))
        while len(self.readings) > 1 and waited_s - self.readings[1][0] >= STALL_WINDOW_S:
            self.readings.popleft()
        t0, acked0 = self.readings[0]
        if waited_s - t0 < STALL_WINDOW_S:
            return False
        rate_bps = (acked - acked0) * 8 / (waited_s - t0)
        if rate_bps * local_s >= (self.size_bytes - acked) * 8:
            return False
        self.stalled_at = {self.DONE_KEY: int(acked), "of_bytes": self.size_bytes,
                           "after_ms": round(waited_s * 1e3, 1), "rate_bps": round(rate_bps)}
        return True

    def under_way(self) -> Optional[dict]:
        """Where an upload still under way stood at its latest reading, in the terms of
        :attr:`stalled_at` (``rate_bps`` over the readings kept, 0 with one), or None: no
        reading, or it went through. For a robot the late rule started: the bytes over
        the time are a rate of the link all the same (MobileNetV2 at the rate-step trace's
        5 Mbit/s: every offload the late rule hedged gave no sample, and the estimate
        stayed at the 100 Mbit/s it had)."""
        if not self.readable or not self.readings:
            return None
        (t0, acked0), (t1, acked) = self.readings[0], self.readings[-1]
        rate_bps = (acked - acked0) * 8 / (t1 - t0) if t1 > t0 else 0.0
        return {self.DONE_KEY: int(acked), "of_bytes": self.size_bytes,
                "after_ms": round(t1 * 1e3, 1), "rate_bps": round(rate_bps)}

    DONE_KEY = "acked_bytes"


class _Download(_Upload):
    """The answer's arrival, read once the upload has gone through: the bytes received
    against the size of the last answer of the call's kind (the same rule as the upload's,
    from the answer's first bytes on; ``for_ms`` in the details: since then)."""

    DONE_KEY = "received_bytes"

    def stalled(self, waited_s: float, received: Optional[int], local_s: float) -> bool:
        if received is None:
            self.readable = False              # the transport cannot tell
            return False
        if received == 0:
            return False                       # not begun: the server is still at it
        first_s = self.readings[0][0] if self.readings else waited_s
        if not super().stalled(waited_s, received, local_s):
            return False
        self.stalled_at["for_ms"] = round((waited_s - first_s) * 1e3, 1)
        return True


def _wait_until_late(futures, upload, download, sent: float, late_s: Optional[float], local_s: float,
                     remaining_s: float) -> bool:
    """Wait for ``futures`` until the robot should start on the frame: True once the call
    is ``late_s`` old, or its transfer stalls with time left for the robot's ``local_s``:
    the upload (``upload``: an :class:`_Upload` and a reader of the bytes acknowledged),
    then, once it went through, the answer (``download``: a :class:`_Download`, or None
    where no answer's size is known, and a reader of the bytes received); False when all
    answered first, one failed (the frame falls back), or waiting left the robot no time."""
    (up, read_acked), (down, read_received) = upload, download
    while not all(f.done() for f in futures):
        if any(f.done() and not _answered_ok(f) for f in futures):
            return False
        waited = time.perf_counter() - sent
        if late_s is not None and waited >= late_s:
            return True
        if waited + local_s > remaining_s:
            return False
        if up.readable:
            if up.stalled(waited, read_acked(), local_s):
                return True
        elif down is not None and down.readable and down.stalled(waited, read_received(), local_s):
            return True
        polling = up.readable or (down is not None and down.readable)
        until = late_s if late_s is not None else remaining_s - local_s
        step = min(POLL_S, until - waited) if polling else until - waited
        concurrent.futures.wait([f for f in futures if not f.done()], timeout=max(step, 0.0),
                                return_when=concurrent.futures.FIRST_COMPLETED)
    return False


def _acked(link, calls) -> Optional[int]:
    """Bytes of the ``(request, future)`` calls' requests the server's host has
    acknowledged (an answered call's whole request), or None where the transport cannot
    tell for one still running."""
    total = 0
    for request, future in calls:
        acked = link.upload_acked(request)
        if acked is None:
            if not future.done():
                return None
            acked = request.payload_bytes
        total += min(acked, request.payload_bytes)
    return total


def _received(link, calls) -> Optional[int]:
    """Bytes of the ``(request, future)`` calls' answers that have arrived (an answered
    call's whole answer), or None where the transport cannot tell for one still running."""
    total = 0
    for request, future in calls:
        if future.done():
            if future.exception() is None:
                total += future.result().payload_bytes
            continue
        received = link.download_received(request)
        if received is None:
            return None
        total += received
    return total


def _in_transfer(link, request: ComputeRequest, future) -> Optional[str]:
    """``"upload"`` where the server's host is known not to have acknowledged all of
    ``request``, ``"answer"`` where its answer is known to be arriving, else None."""
    acked = link.upload_acked(request)
    if acked is not None and acked < request.payload_bytes:
        return "upload"
    received = link.download_received(request)
    return "answer" if received and not future.done() else None


def _answered_ok(future) -> bool:
    """The call has an answer the frame can use (a failure or a refusal is no reason to
    stop the robot: the frame would fall back to computing locally)."""
    return (future.done() and future.exception() is None
            and future.result().status == StatusCode.OK)


def _cancel(link, request: ComputeRequest) -> None:
    """Take ``request`` back from the server, where it may still wait for a compute slot:
    one small call, not waited for (its answer or failure changes nothing)."""
    link.submit(cancel_request(request), CANCEL_TIMEOUT_S).add_done_callback(lambda f: f.exception())


class _Answered(Exception):
    """The server answered while the robot was computing the frame."""


def computed_here(module: torch.nn.Module, inputs: Callable[[], list], stats):
    """The robot's side of a hedge, for :meth:`LocalHedge.call`: ``module(*inputs())``
    stopped when the server answers (:func:`forward_unless`), its forward's time
    accounted in ``stats`` (``inputs()`` accounts its own, e.g. preprocessing)."""
    def compute(answered):
        args = inputs()
        t0 = time.perf_counter()
        y = forward_unless(module, args[0], answered, *args[1:])
        stats.add_compute(t0, time.perf_counter())
        return y
    return compute


def forward_unless(model: torch.nn.Module, x, answered: Callable[[], bool], *more):
    """``model(x, *more)``, or None when ``answered()`` turns true before it ends
    (checked before each module's forward, on this thread only)."""
    me = threading.get_ident()

    def check(_module, _args):
        if threading.get_ident() == me and answered():
            raise _Answered()
    handle = torch.nn.modules.module.register_module_forward_pre_hook(check)
    try:
        with torch.inference_mode():
            return model(x, *more)
    except _Answered:
        return None
    finally:
        handle.remove()
