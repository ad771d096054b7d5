"""What a session counts: per inference (:class:`InferenceCount`) and in all
(:class:`SessionStats`, ``RemoteSession.stats``)."""

import time
from dataclasses import dataclass, field
from typing import List, Optional


@dataclass
class InferenceCount:
    phase: str
    round_trips: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    ops: int = 0
    server_lost: bool = False   # the server was lost during it: the rest ran on the robot
    # A replayed inference's timeline, ms after its first operator (None: did not happen).
    # Early replay hides the robot's checks only when checks_end_ms comes before reply_ms.
    started: float = field(default_factory=time.perf_counter, repr=False)
    early_sent_ms: Optional[float] = None   # the early replay left for the server
    checks_end_ms: Optional[float] = None   # the robot had checked the last operator
    reply_ms: Optional[float] = None        # the early replay's reply was in hand
    outputs_ms: Optional[float] = None      # the program had returned, its outputs on the robot

    def mark(self, what: str) -> None:
        setattr(self, what, round((time.perf_counter() - self.started) * 1e3, 2))

    def timeline(self) -> dict:
        return {k: getattr(self, k) for k in ("early_sent_ms", "checks_end_ms", "reply_ms", "outputs_ms")
                if getattr(self, k) is not None}


@dataclass
class SessionStats:
    round_trips: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    ops_remote: int = 0
    ops_local: int = 0
    ops_not_allowed: int = 0      # of which: operators the server does not run (allow-list)
    ops_refused: int = 0          # of which: operators whose schema differs on the server
    ops_replayed: int = 0
    server_losses: int = 0
    replays: int = 0
    early_replays: int = 0        # replays sent before the sequence ended, reply used
    early_dropped: int = 0        # early replays whose reply could not be used
    early_sync_answers: int = 0   # sync points answered from an early reply (no round trip)
    early_refused: int = 0        # early replays the server refused (counted in early_dropped)
    divergences: int = 0
    sequences_identified: int = 0
    robot_inferences: int = 0     # auto: inferences of an identified sequence the robot computed
    #: the latest inferences (at most 2 * KEEP_INFERENCES: a long run's memory stays bounded)
    inferences: List[InferenceCount] = field(default_factory=list)
    inferences_total: int = 0     # inferences begun since the start

    #: inferences kept once the list is trimmed
    KEEP_INFERENCES = 1000

    def begin(self, phase: str) -> InferenceCount:
        """A new inference, in ``phase``."""
        count = InferenceCount(phase)
        self.inferences.append(count)
        self.inferences_total += 1
        if len(self.inferences) > 2 * self.KEEP_INFERENCES:
            del self.inferences[:-self.KEEP_INFERENCES]
        return count

    def since(self, total_before: int) -> List[InferenceCount]:
        """The inferences begun since ``inferences_total`` was ``total_before`` (the
        latest kept ones, if more were begun)."""
        n = self.inferences_total - total_before
        return self.inferences[-n:] if n > 0 else []

    def summary(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k != "inferences"}
        d["inferences"] = [{k: v for k, v in i.__dict__.items() if k != "started"}
                           for i in self.inferences[-self.KEEP_INFERENCES:]]
        return d
