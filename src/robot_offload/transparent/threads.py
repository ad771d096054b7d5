"""Interception that follows the program's threads.

A ``TorchDispatchMode`` is per thread; :func:`follow_threads` makes the threads an
intercepted thread starts intercepted too. (Which thread a replayed sequence belongs to
is the replay's business: ``ReplayMixin._follows_thread``.)
"""

import _thread
import contextlib
import functools
import threading
from typing import TYPE_CHECKING

from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from robot_offload.transparent.proxy import Interceptor

if TYPE_CHECKING:
    from robot_offload.transparent.session import RemoteSession


def _intercepted_by(session) -> bool:
    """Whether this thread's operators reach ``session`` now (its Interceptor is active)."""
    return any(isinstance(m, Interceptor) and m.session is session
               for m in _get_current_dispatch_mode_stack())


@contextlib.contextmanager
def follow_threads(session: "RemoteSession"):
    """While active, a thread started by an intercepted thread is intercepted too.

    A ``TorchDispatchMode`` is per thread, and a program's inference often runs in one
    it starts (a rospy subscriber callback, a thread pool): without this its operators
    would silently run on the robot. ``threading.Thread.start`` (and the low-level
    ``_thread.start_new_thread``) wrap the thread's ``run`` in the session's Interceptor
    when the starting thread is itself intercepted. Threads the session starts from
    inside an operator (its early-replay sender, its server prober) are started where the
    mode is suspended, so they stay outside, as they must."""
    orig_start, orig_new = threading.Thread.start, _thread.start_new_thread

    def entering(fn):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            with Interceptor(session):
                return fn(*args, **kwargs)
        return run

    def start(self):
        if _intercepted_by(session):
            self.run = entering(self.run)
        return orig_start(self)

    def start_new_thread(function, args, kwargs=None):
        if _intercepted_by(session):
            function = entering(function)
        return orig_new(function, args, kwargs or {})

    threading.Thread.start, _thread.start_new_thread = start, start_new_thread
    try:
        yield session
    finally:
        threading.Thread.start, _thread.start_new_thread = orig_start, orig_new
