"""A late offloaded frame hedged by the robot itself (one server, no second to ask).

With several servers a late call goes to a second one too (:mod:`robot_offload.pool`).
With one, the robot is the only other place the frame can run: when a ``full_offload``
call has not answered by the ``hedge_percentile`` of this client's recent round trips,
the robot starts the local model on the frame, and the first answer wins. When the
server answers first the local forward stops at its next module (a forward pre-hook on
the hedging thread), and when the robot finishes first the server's copy is cancelled
(taken back while it still waits for a compute slot). The frame's ``stats`` say so:
``executed_mode`` is ``local`` when the robot's outputs were used, and ``detail_json``
holds ``hedge``: who won and after how long the robot started.

The robot hedges only where it can win: its own recent forward (:meth:`observe_local`:
the local frames and fallbacks of the client, and its warm-up) must take at most
:data:`LOCAL_SHARE` of the round trip it waits for (a robot about as quick as the server
would finish about when a late answer comes anyway), and fit what is left of the
deadline; and in at most
``hedge_budget`` of the calls (over the last :data:`BUDGET_WINDOW`), so that a server
slow for good costs the robot a bounded share of its CPU before the frames fall back.
"""

import collections
import statistics
import threading
from typing import Callable, Optional

import torch

from robot_offload.pool import BUDGET_WINDOW, LATENCY_WINDOW, MIN_SAMPLES

#: local forwards kept (s): the median is the robot's expected time
LOCAL_WINDOW = 9
#: the robot hedges when its forward takes at most this share of the round trip it waits for
LOCAL_SHARE = 0.5


class LocalHedge:
    """When a client with one server starts the local model beside a late call."""

    def __init__(self, percentile: float = 95.0, budget: float = 0.1):
        self.percentile, self.budget = percentile, budget
        self._lock = threading.Lock()
        self._round_trips = collections.deque(maxlen=LATENCY_WINDOW)
        self._local_s = collections.deque(maxlen=LOCAL_WINDOW)
        self._hedged = collections.deque(maxlen=BUDGET_WINDOW)     # True: that call hedged
        self.figures = {"calls": 0, "hedges": 0, "local_won": 0, "server_won": 0}

    def observe_local(self, seconds: float) -> None:
        """The robot ran the whole model in ``seconds``."""
        with self._lock:
            self._local_s.append(float(seconds))

    def observe_round_trip(self, seconds: float) -> None:
        """A call the server answered, ``seconds`` after it was sent."""
        with self._lock:
            self._round_trips.append(float(seconds))

    def delay_s(self, remaining_s: float) -> Optional[float]:
        """How long to wait before the robot starts on a call with ``remaining_s`` left
        of its deadline, or None: not hedged (too few round trips measured, no local
        forward measured, the robot's forward over :data:`LOCAL_SHARE` of a late round trip,
        no time for it, or the budget spent)."""
        with self._lock:
            if len(self._round_trips) < MIN_SAMPLES or not self._local_s:
                return None
            trips = sorted(self._round_trips)
            late_s = trips[min(len(trips) - 1, int(round(self.percentile / 100.0 * (len(trips) - 1))))]
            local_s = statistics.median(self._local_s)
            if local_s > LOCAL_SHARE * late_s or late_s + local_s > remaining_s:
                return None
            if sum(self._hedged) + 1 > self.budget * max(len(self._hedged), 1):
                return None
            return late_s

    def count(self, hedged: bool, winner: str = "") -> None:
        """One call: whether the robot hedged it, and who answered first."""
        with self._lock:
            self._hedged.append(bool(hedged))
            self.figures["calls"] += 1
            if hedged:
                self.figures["hedges"] += 1
                self.figures[f"{winner}_won"] += 1


class _Answered(Exception):
    """The server answered while the robot was computing the frame."""


def forward_unless(model: torch.nn.Module, x, answered: Callable[[], bool]):
    """``model(x)``, or None when ``answered()`` turns true before it ends (checked before
    each module's forward, on this thread only)."""
    me = threading.get_ident()

    def check(_module, _args):
        if threading.get_ident() == me and answered():
            raise _Answered()
    handle = torch.nn.modules.module.register_module_forward_pre_hook(check)
    try:
        with torch.inference_mode():
            return model(x)
    except _Answered:
        return None
    finally:
        handle.remove()
