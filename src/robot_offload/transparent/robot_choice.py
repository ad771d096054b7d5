"""``auto`` for a program run through interception: per inference of an identified
operator sequence, compute it on the robot or replay it on the server, whichever has
measured faster.

:class:`RobotOrServer` makes the choice for one sequence from measured times. An
inference's time is what running the model costs the program, the same for both choices:
from the sequence's first operator until the next inference begins, the time the thread
spent inside operators and reading values, except that the rest of the module call the
first operator ran in (the model's forward, until its outermost module call returns)
counts whole, by the clock. The program's sleeps and its Python work outside the model
do not count; its operators between inferences (building the next input, reading the
outputs) count for both choices, and only their round trips differ.

:class:`RobotChoiceMixin` is the session's side: at a sequence's first operator it asks
the sequence's chooser. On the robot, the rest of the model's module call runs without
interception, as a plain program runs it
(:func:`~robot_offload.transparent.proxy.watch_forward`): the thread's interceptor is off
its dispatch stack until the call returns. The thread's operators after that run on the
robot, intercepted, until an operator starts an identified sequence again. A program
whose forwards write into their weights stays intercepted throughout, so that the upload
cache sees every write.
"""

import math
import statistics
import threading
import time
from collections import deque
from typing import Dict, Optional

import torch

from robot_offload.transparent import wire
from robot_offload.transparent.fallback import HIDDEN_WRITES, _short_name
from robot_offload.transparent.proxy import RemoteTensor, end_forward_watch, watch_forward

ROBOT, SERVER = "robot", "server"


class RobotOrServer:
    """Where the next inference of one sequence runs.

    The served choice keeps serving while its median of the last ``window`` inferences is
    within ``margin`` of the other's; the other is then timed again (a probe, a real
    inference) every ``probe_every`` inferences, or less often when it measured slower,
    so that probes cost about ``probe_cost`` of the served latency on average, but at
    least every ``probe_every_max`` inferences. A probe's time replaces the other's older
    ones (they are stale: the link or the load changed), so one probe that measures
    faster switches at once; the served choice's own median follows a change within
    ``window // 2 + 1`` inferences. The server serves first (its inferences were recorded
    there); the robot is timed once the server has two inferences."""

    def __init__(self, window: int = 5, margin: float = 0.05, probe_every: int = 10,
                 probe_every_max: int = 100, probe_cost: float = 0.05):
        self.margin, self.probe_every, self.probe_every_max = margin, probe_every, probe_every_max
        self.probe_cost = probe_cost
        self._times_s = {ROBOT: deque(maxlen=window), SERVER: deque(maxlen=window)}
        self.serving = SERVER
        self._since_probe = 0
        #: the last choice, for the stats: choice, reason, both medians (ms; None: not timed)
        self.last: Dict[str, object] = {}

    def median_s(self, where: str) -> Optional[float]:
        times = self._times_s[where]
        return statistics.median(times) if times else None

    def probe_interval(self, served_s: float, other_s: float) -> int:
        """Inferences between probes of the other choice, measured ``other_s`` where the
        served one takes ``served_s``: its extra time spread over the interval is about
        ``probe_cost`` of ``served_s``."""
        extra_s = max(0.0, other_s - served_s)
        wanted = math.ceil(extra_s / (self.probe_cost * served_s)) if served_s > 0 else self.probe_every_max
        return max(self.probe_every, min(self.probe_every_max, wanted))

    def choose(self) -> str:
        other = ROBOT if self.serving == SERVER else SERVER
        served_s, other_s = self.median_s(self.serving), self.median_s(other)
        choice, reason = self.serving, "served"
        if served_s is None:
            reason = "first"
        elif other_s is None:
            if len(self._times_s[self.serving]) >= 2:
                choice, reason = other, "first probe"
        elif other_s * (1 + self.margin) < served_s:
            self.serving = choice = other
            reason = "faster"
            # Its older times may predate a change; the newest is the probe's.
            last = self._times_s[other][-1]
            self._times_s[other].clear()
            self._times_s[other].append(last)
            self._since_probe = 0
        else:
            self._since_probe += 1
            if self._since_probe >= self.probe_interval(served_s, other_s):
                self._since_probe = 0
                choice, reason = other, "probe"
        self.last = {"choice": choice, "reason": reason,
                     "robot_ms": _ms(self.median_s(ROBOT)), "server_ms": _ms(self.median_s(SERVER))}
        return choice

    def observe(self, where: str, seconds: float) -> None:
        if where != self.serving:
            self._times_s[where].clear()
        self._times_s[where].append(seconds)


def _ms(s: Optional[float]) -> Optional[float]:
    return None if s is None else round(s * 1e3, 2)


class _Timed:
    """One inference being timed: its sequence, where it runs, its thread and the time
    the program spent in operators so far. ``valid`` turns false when it did not run as
    chosen (a divergence, a lost server)."""

    def __init__(self, key: str, where: str):
        self.key, self.where = key, where
        self.thread = threading.current_thread()
        self.op_s = 0.0
        self.valid = True


def _start_signature(func, args, kwargs) -> tuple:
    """What a sequence's first operator looks like, cheaply: the operator and the shapes of
    the weights it reads (a new model object with the same weights has the same)."""
    return func, tuple(tuple(a.shape) for a in wire.leaves((args, kwargs)) if isinstance(a, torch.nn.Parameter))


class RobotChoiceMixin:
    """The ``auto`` mode of a :class:`~robot_offload.transparent.session.RemoteSession`
    (``self._choosers`` is a dict there, None in the other modes)."""

    _in_timed = threading.local()

    def _init_robot_choice(self, auto: bool) -> None:
        #: sequence key -> its chooser (None: not auto)
        self._choosers: Optional[Dict[str, RobotOrServer]] = {} if auto else None
        #: the last choice, for the frame's stats
        self.last_choice: Dict[str, object] = {}
        self._timed: Optional[_Timed] = None
        #: the start signatures of the sequences chosen so far, and their operators
        self._start_signatures = set()
        self._start_funcs = set()
        #: a robot-side operator wrote into a weight inside a module's forward (see
        #: UploadsMixin._note_writes): robot inferences then stay intercepted
        self.weights_written_in_forward = False

    def _timed_call(self, fn, *args):
        """``fn(*args)``, its time counted in the thread's timed inference (outermost
        calls only: a read inside an operator counts once)."""
        t = self._timed
        if t is None or t.thread is not threading.current_thread() or getattr(self._in_timed, "on", False):
            return fn(*args)
        self._in_timed.on = True
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self._in_timed.on = False
            now = self._timed
            if now is not None and now.thread is threading.current_thread():
                now.op_s += time.perf_counter() - t0

    def _forward_region_started(self) -> None:
        """This thread's inference goes on in module calls timed as a whole
        (:func:`~robot_offload.transparent.proxy.watch_forward`): its operators are not
        timed one by one meanwhile."""
        self._in_timed.on = True

    def _forward_region_ended(self, elapsed_s: float) -> None:
        self._in_timed.on = False
        t = self._timed
        if t is not None and t.thread is threading.current_thread():
            t.op_s += elapsed_s

    def _end_timed(self) -> None:
        """The thread's timed inference ends (the next begins): its time goes to its
        sequence's chooser."""
        end_forward_watch()
        t = self._timed
        if t is None or t.thread is not threading.current_thread():
            return
        self._timed = None
        if t.valid:
            self._choosers[t.key].observe(t.where, t.op_s)

    def _spoil_timed(self) -> None:
        if self._timed is not None:
            self._timed.valid = False

    def _choose_where(self, seq, func, args, kwargs) -> str:
        """At the first operator of an inference of ``seq`` (``func`` on ``args`` and
        ``kwargs``): where it runs. The inference before it in this thread ends here."""
        self._end_timed()
        signature = _start_signature(func, args, kwargs)
        self._start_signatures.add(signature)
        self._start_funcs.add(func)
        if self._timed is not None and not self._timed.thread.is_alive():
            self._timed = None
        if self._timed is not None:
            return SERVER       # another thread's inference is being timed: replayed, untimed
        chooser = self._choosers.setdefault(seq.key, RobotOrServer())
        where = chooser.choose()
        self._timed = _Timed(seq.key, where)
        self.last_choice = dict(chooser.last, choice=where)
        if where == ROBOT:
            self.stats.robot_inferences += 1
            self.stats.begin("robot")
        watch_forward(self, suspend=where == ROBOT and not self.weights_written_in_forward)
        return where

    def _on_robot_run(self) -> bool:
        t = self._timed
        return t is not None and t.where == ROBOT and t.thread is threading.current_thread()

    def _starts_sequence(self, func, args, kwargs) -> bool:
        """Whether this operator (on the robot, in a robot inference) would start an
        identified sequence: then the robot inference has ended."""
        if func not in self._start_funcs or _start_signature(func, args, kwargs) not in self._start_signatures:
            return False
        probe = self._probe_key(wire.op_name(func), args, kwargs)
        return probe is not None and probe[0] in self.recorder.sequences

    def _run_on_robot(self, func, args, kwargs):
        """One operator of a robot inference, as a plain run computes it (values of older
        server tensors downloaded first); its writes into robot tensors are counted for the
        upload cache."""
        if any(isinstance(a, RemoteTensor) for a in wire.leaves((args, kwargs))):
            args, kwargs = self.materialize_tree((args, kwargs))
        self.stats.ops_local += 1
        if self.stats.inferences:
            self.stats.inferences[-1].ops += 1
        if self._schema(func)[0] or _short_name(func) in HIDDEN_WRITES:
            self._note_writes(func, args, kwargs)
        return func(*args, **kwargs)
