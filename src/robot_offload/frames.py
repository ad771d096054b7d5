"""A one-slot mailbox between a subscriber callback and the inference worker.

The client always works on the newest frame: a frame that arrives while another is
waiting replaces it and is counted as dropped. Counting here, rather than relying on
rospy's queue_size=1 (which drops silently), is what lets the stats account for every
frame: received = processed + dropped + (at most one waiting) + (at most one in flight).

:func:`check_pairing` bounds the parameters of pairing one frame's messages by stamp
(:mod:`robot_offload.ros.stamp_sync`).
"""

import math
import threading
import time
from typing import Any, Optional, Tuple

from robot_offload.errors import ConfigError


def check_pairing(queue_size, slop_s) -> Tuple[int, float]:
    """``(sync_queue_size, sync_slop_s)`` as (int, float), or :class:`ConfigError`: the
    messages kept per input while their partners are awaited (1..1000) and the stamp
    difference that still counts as one frame (0 <= slop < 1 s)."""
    if isinstance(queue_size, bool) or not isinstance(queue_size, int) or not 1 <= queue_size <= 1000:
        raise ConfigError(f"sync_queue_size must be an integer in 1..1000, got {queue_size!r}")
    if isinstance(slop_s, bool) or not isinstance(slop_s, (int, float)) or not (math.isfinite(slop_s)
                                                                               and 0.0 <= slop_s < 1.0):
        raise ConfigError(f"sync_slop_s must be a number in [0, 1) s, got {slop_s!r}")
    return int(queue_size), float(slop_s)


class LatestFrame:
    def __init__(self, clock=time.monotonic):
        self._cond = threading.Condition()
        self._item: Optional[Tuple[Any, float]] = None
        self.clock = clock
        self.received = 0
        self.dropped = 0

    def put(self, frame: Any) -> bool:
        """Store ``frame`` with its arrival time; True when it replaced an unprocessed one."""
        with self._cond:
            replaced = self._item is not None
            self._item = (frame, self.clock())
            self.received += 1
            if replaced:
                self.dropped += 1
            self._cond.notify()
        return replaced

    def get(self, timeout_s: float) -> Optional[Tuple[Any, float]]:
        """Take ``(frame, arrival_time)``, waiting up to ``timeout_s``; None if none came."""
        with self._cond:
            if self._item is None:
                self._cond.wait(timeout_s)
            item, self._item = self._item, None
            return item
