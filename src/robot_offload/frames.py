"""A one-slot mailbox between a subscriber callback and the inference worker.

The client always works on the newest frame: a frame that arrives while another is
waiting replaces it and is counted as dropped. Counting here, rather than relying on
rospy's queue_size=1 (which drops silently), is what lets the stats account for every
frame: received = processed + dropped + (at most one waiting) + (at most one in flight).
"""

import threading
import time
from typing import Any, Optional, Tuple


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
