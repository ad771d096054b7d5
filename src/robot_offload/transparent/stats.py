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
    inferences: List[InferenceCount] = field(default_factory=list)

    def summary(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k != "inferences"}
        d["inferences"] = [{k: v for k, v in i.__dict__.items() if k != "started"}
                           for i in self.inferences[-1000:]]
        return d
