"""Background work beside the frames, without slowing them down.

A Python thread that computes (a re-plan solving schedules, ``auto`` preparing a new
input shape's plans) holds the GIL, and a frame's thread needs the GIL back after each
torch operator. While the background thread is busy, the frame waits up to the GIL's
switch interval (5 ms) per operator: the convoy effect. On the 2-core testbed,
MobileNetV2's 20 ms forward took 926 ms beside one busy Python thread (138 ms with a
0.5 ms switch interval). Nice levels do not help: the OS does not schedule the GIL.

So frames are the foreground: the client enters :meth:`ForegroundGate.frame` around
every frame, and a frame's thread leaves it while it waits for the network
(:meth:`ForegroundGate.waiting`). Threads started with :func:`start` yield to them at
each :func:`checkpoint` their work passes (the planners' inner loops call it, every
fraction of a millisecond): after a slice of :data:`SLICE_S` the thread waits until no
frame computes, or at most as long as keeps it to its ``share`` of the time (so that
work the frames wait for still finishes under a camera that never pauses). It begins
with such a wait, so that its first slice does not fall on the frame that started it. A profiling
hook would need no checkpoints, but it made a schedule solve 3.3x slower.
"""

import contextlib
import threading
import time
from typing import Callable

#: how long a background thread runs before it checks whether a frame computes (s)
SLICE_S = 0.005


class ForegroundGate:
    """Counts the threads computing a frame now (the foreground)."""

    def __init__(self):
        self._cond = threading.Condition()
        self._computing = 0
        self._local = threading.local()
        self._started = 0       # background threads started with this gate, ever
        self._running = 0       # ... and alive now

    @property
    def computing(self) -> int:
        """How many threads compute a frame now."""
        return self._computing

    @contextlib.contextmanager
    def frame(self):
        """The calling thread computes a frame inside this block."""
        self._enter()
        depth = getattr(self._local, "depth", 0)
        if depth == 0:
            with self._cond:
                self._local.mark = (self._started, self._running > 0)
        self._local.depth = depth + 1
        try:
            yield
        finally:
            self._local.depth -= 1
            self._leave()

    def contended(self) -> bool:
        """Whether background work of this gate ran at any time during the calling
        thread's frame so far (outside a frame: whether any runs now). Alive counts,
        paused for the frame or not: it takes its share meanwhile."""
        with self._cond:
            if self._running:
                return True
            if not getattr(self._local, "depth", 0):
                return False
            started, was_running = self._local.mark
            return was_running or self._started != started

    def _began(self) -> None:
        """A background thread of this gate starts (see :meth:`contended`)."""
        with self._cond:
            self._started += 1
            self._running += 1

    def _ended(self) -> None:
        with self._cond:
            self._running -= 1

    @contextlib.contextmanager
    def waiting(self):
        """Inside a frame, the calling thread waits (for the network) in this block:
        background work may run meanwhile. Outside a frame (a transport worker) a no-op."""
        if not getattr(self._local, "depth", 0):
            yield
            return
        self._leave()
        try:
            yield
        finally:
            self._enter()

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no thread computes a frame, at most ``timeout_s``; True if none does."""
        with self._cond:
            return self._cond.wait_for(lambda: self._computing == 0, timeout_s)

    def _enter(self) -> None:
        with self._cond:
            self._computing += 1

    def _leave(self) -> None:
        with self._cond:
            self._computing -= 1
            if self._computing == 0:
                self._cond.notify_all()


#: the process's gate: the GIL is one per process
GATE = ForegroundGate()


_background = threading.local()   # .resumed, .wait_s, .gate: set on threads of start()


def checkpoint() -> None:
    """Where background work may pause for the frames (a no-op on other threads, and
    while no frame computes): cheap enough for a loop's every iteration."""
    gate = getattr(_background, "gate", None)
    if gate is None or not gate.computing:
        return
    if time.perf_counter() - _background.resumed >= SLICE_S:
        gate.wait_idle(_background.wait_s)
        _background.resumed = time.perf_counter()


def start(target: Callable[[], None], name: str, share: float,
          gate: ForegroundGate = GATE) -> threading.Thread:
    """Run ``target`` on a daemon thread that yields to the frames of ``gate`` at each
    :func:`checkpoint`: while a frame computes, it runs at most ``share`` (0-1] of the
    time, in slices of :data:`SLICE_S`."""
    if not 0.0 < share <= 1.0:
        raise ValueError(f"share must be in (0, 1], not {share!r}")

    gate._began()       # counted from now: a frame that starts it is contended

    def run():
        try:
            _background.gate, _background.wait_s = gate, SLICE_S * (1.0 / share - 1.0)
            # not in the frame that started it: its first slice would be that frame's
            gate.wait_idle(_background.wait_s)
            _background.resumed = time.perf_counter()
            target()
        finally:
            gate._ended()

    thread = threading.Thread(target=run, name=name, daemon=True)
    try:
        thread.start()
    except BaseException:
        gate._ended()
        raise
    return thread


def contended() -> bool:
    """:meth:`ForegroundGate.contended` of the process's gate."""
    return GATE.contended()
