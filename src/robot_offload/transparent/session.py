"""Robot side of transparent offloading: operator interception, proxies, record and replay.

:class:`Interceptor` is a ``TorchDispatchMode``: while it is active, every aten operator
the program calls reaches :meth:`RemoteSession.dispatch` -- the Python counterpart of the
paper's LD_PRELOAD shim around the CUDA runtime. An operator runs on the server when one
of its tensors already lives there (a :class:`RemoteTensor` proxy) or is a model weight
(``nn.Parameter``) -- what a CUDA program would have put on the GPU; the program's own
tensor work (building the input, bookkeeping, factories) runs on the robot as before, and
its results are uploaded when an offloaded operator reads them. Views of robot tensors
stay robot-side views even of weights (a program may write through them; the server gets
the view's base once and makes the same view). A proxy has the shape, strides and dtype of the server tensor and no storage;
reading its values (``.cpu()``, ``.numpy()``, ``.tolist()``, ``.item()``, printing, a
branch on a value) downloads it -- the counterpart of ``cudaMemcpyDtoH``. Operators that
write into a robot tensor run on the robot, after downloading their remote arguments.

Robot tensors an operator needs are uploaded once and used again while they are known to
be unchanged: weights (``nn.Parameter``) by identity, version counter, storage, the
in-place writes the session saw and ``.data`` assignments, so they cross once and again
only if modified; any other robot tensor only while its bytes equal those uploaded (the
program may write into it through numpy). Weights are first offered by content digest,
which the server resolves from its own copy of a registry model without any upload.

What the program can observe stays the program's: random operators draw from its
generator on the robot, an operator that writes a robot tensor (declared in its schema or
hidden, as batch norm's running statistics in training mode) runs on the robot, and a
weight never holds a proxy. :func:`follow_threads` extends interception to the threads
the program starts.

Modes:

``transparent`` (the Cricket-style baseline) -- one request per operator.

``record_replay`` (RRTO) -- operators are sent one by one and recorded
(:mod:`~robot_offload.transparent.recorder`) until an inference's operator sequence is
identified. From then on, an operator that starts a known sequence starts a *speculation*:
each intercepted call is compared with the next recorded operator (name, non-tensor
arguments, which tensors it reads, the shapes of fresh inputs) and answered from the
record -- proxies with the recorded shapes -- without a round trip. The calls are sent as
one ``replay`` request (with the fresh inputs and the list of outputs the program still
holds) when the sequence ends, when the program needs a value, or at an operator whose
result shape depends on data; the outputs the program read during recording come back
in the same reply. A call that differs from the record ends the speculation: the
operators matched so far are replayed (they are exactly what the program asked for), this
one and the rest go one by one, and recording starts again. So a divergence costs time,
never a wrong result.

Early replay (``early_replay=True``, the default): in a sequence without sync points the
whole replay is sent as soon as the last fresh input has been seen, as the paper's robot
does. It asks the server to keep the outputs the program held when the previous replay of
the sequence ended, and to send back the ones it read during recording. The robot then checks the rest of the calls against the record while the
request crosses the link and the server runs it. On 0.5 CPU those checks took 20-150 ms
per frame, which was on the critical path when the request waited for the end of the
sequence. The early reply is used only when every call matched and the program holds no
other output of the sequence. Otherwise (a divergence, a value wanted mid-sequence, an
intermediate tensor kept) it is dropped, its handles released, and the usual replay is
sent, so the fallback costs one round trip more and never a wrong result.
"""

import _thread
import concurrent.futures
import contextlib
import functools
import json
from collections import OrderedDict
import logging
import threading
import time
import uuid
import weakref
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import numpy
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack
from torch.utils._pytree import tree_flatten, tree_map

from robot_offload import codec
from robot_offload.errors import OffloadError, RemoteError, TransportError
from robot_offload.protocol import ComputeRequest, StatusCode, raise_for_status
from robot_offload.transparent import allowlist, wire
from robot_offload.transparent.recorder import (RecordedOp, Recorder, Sequence, frame_return,
                                                resolve_sizes)
from robot_offload.transparent.wire import ENTRY, content_digest

log = logging.getLogger(__name__)

MODES = ("transparent", "record_replay")
#: Robot tensors at least this large are offered by content digest before their bytes.
DIGEST_MIN_BYTES = 64 * 1024
#: Fresh inputs of a sequence up to this size are compared by content digest between
#: replays; one whose content repeats (anchors, constants the program builds each frame)
#: is kept on the server and predicted (see RemoteSession._input_ref).
STABLE_MAX_BYTES = 4 * 1024 * 1024
#: A robot tensor other than a weight is used again on the server only while its bytes are
#: those uploaded: up to this size a copy of them is kept and compared, beyond it a digest.
SNAPSHOT_MAX_BYTES = 16 * 1024 * 1024
#: At most this many such inputs are kept per session (oldest dropped first).
STABLE_MAX_INPUTS = 64
#: An input whose content changed in this many replays in a row is taken for a fresh
#: frame each time and digested only every VOLATILE_RECHECK replays (see _input_ref).
VOLATILE_AFTER = 3
VOLATILE_RECHECK = 16
#: Tensor methods that need the values on the robot.
_MATERIALIZING = frozenset({"numpy", "tolist", "__array__", "__repr__", "__format__", "cpu",
                            "__reduce_ex__", "data_ptr", "untyped_storage", "storage",
                            "__dlpack__", "pin_memory", "__deepcopy__"})

_current: "Optional[RemoteSession]" = None
#: Argument types the record holds as they are (wire.encode returns them unchanged; a float
#: only when finite, and an equal float is finite since the record holds others as dicts).
_PLAIN_SCALARS = (int, bool, str, float)


class RemoteTensor(torch.Tensor):
    """Stands in for a tensor on the server: metadata only; values on demand."""

    @staticmethod
    def __new__(cls, session, meta: dict, handle=None):
        t = torch.Tensor._make_wrapper_subclass(
            cls, meta["s"], strides=meta["st"], storage_offset=meta.get("o", 0),
            dtype=wire.meta_dtype(meta["d"]), device="cpu", requires_grad=False)
        t._session = session
        t._cell = [handle, session._generation]   # server handle (filled later for replayed
        t._recipe = None              # outputs) and the session generation it belongs to
        t._pending = None             # (speculation, j, k) while only the record knows it
        t._origin = None              # (speculation, j, k) of a replayed output, for matching
        t._value = None               # downloaded values (a plain tensor)
        t._meta = meta
        weakref.finalize(t, session._forget, t._cell)
        return t

    @property
    def handle(self):
        return self._cell[0]

    def __repr__(self, *, tensor_contents=None):
        return repr(self._session.materialize(self))

    # No Python __torch_function__: torch then treats a proxy as a plain tensor until the
    # dispatcher, which calls __torch_dispatch__. A Python one ran for every operator and
    # every .shape on a proxy, about a sixth of the robot's time in a replayed frame; the
    # few methods that need the values on the robot are overridden below instead.
    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        for a in args:          # usually a positional argument: no walk of the whole tree
            if type(a) is RemoteTensor:
                return a._session.dispatch(func, args, kwargs or {})
        sess = next(a._session for a in wire.leaves((args, kwargs or {})) if isinstance(a, RemoteTensor))
        return sess.dispatch(func, args, kwargs or {})


def _materializing(name: str):
    """A Tensor method that reads values: run on the proxy's values, on the robot."""
    def method(self, *args, **kwargs):
        return getattr(self._session.materialize(self), name)(*args, **kwargs)
    method.__name__ = method.__qualname__ = name
    return method


for _name in _MATERIALIZING - {"__repr__"}:
    setattr(RemoteTensor, _name, _materializing(_name))
del _name


class Interceptor(TorchDispatchMode):
    """While active, the session sees every aten operator of this thread."""

    def __init__(self, session: "RemoteSession"):
        super().__init__()
        self.session = session

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.session.dispatch(func, args, kwargs or {})


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


class Mismatch(Exception):
    """An operator call that differs from the recorded sequence."""


@dataclass
class InferenceCount:
    phase: str
    round_trips: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    ops: int = 0
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
    ops_replayed: int = 0
    server_losses: int = 0
    replays: int = 0
    early_replays: int = 0        # replays sent before the sequence ended, reply used
    early_dropped: int = 0        # early replays whose reply could not be used
    early_sync_answers: int = 0   # sync points answered from an early reply (no round trip)
    early_refused: int = 0        # early replays the server refused (counted in early_dropped)
    divergences: int = 0
    sequences_identified: int = 0
    inferences: List[InferenceCount] = field(default_factory=list)

    def summary(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k != "inferences"}
        d["inferences"] = [{k: v for k, v in i.__dict__.items() if k != "started"}
                           for i in self.inferences[-1000:]]
        return d


class _Speculation:
    """A sequence being answered from the record."""

    def __init__(self, seq: Sequence):
        self.seq = seq
        self.thread = threading.current_thread()   # the program thread it answers
        self.pos = 0            # operators matched so far
        self.sent = 0           # operators already replayed by the server
        self.proxies: Dict[tuple, "weakref.ref"] = {}    # (j, k) -> proxy
        self.inputs: Dict[int, torch.Tensor] = {}        # input index -> robot tensor / proxy
        self.inputs_sent = set()
        self.early: Optional[concurrent.futures.Future] = None  # the early replay's reply
        self.early_keep: List[tuple] = []                      # outputs it keeps
        self.early_fetch: List[tuple] = []                     # ... and sends back
        self.predicted: Dict[int, str] = {}    # inputs the early replay took from the server's
                                               # copy of the previous frame's: index -> digest
        self.early_stale = False               # a predicted input came out different
        self.sizes: Dict[int, list] = {}       # op -> the integers it returned this frame
                                               # (wire.size_leaves), for its size symbols


class RemoteSession:
    """One program's (or one backend's) tensors on one server.

    ``call(request, timeout_s)`` sends a ComputeRequest and returns the response (a
    transport with a deadline; :class:`~robot_offload.errors.TransportError` on failure).
    """

    def __init__(self, call, mode: str = "record_replay", client_id: str = "",
                 timeout_s: float = 10.0, output_codec: str = "raw", local_fallback: bool = False,
                 retry_interval_s: float = 0.5, early_replay: bool = True):
        if mode not in MODES:
            raise OffloadError(f"unknown transparent mode {mode!r}; known: {list(MODES)}")
        self._call = call
        self.mode = mode
        self.client_id = client_id or "transparent-" + uuid.uuid4().hex[:8]
        self.timeout_s = timeout_s
        self.deadline = None              # absolute perf_counter deadline (backends set it)
        self.output_codec = output_codec
        self.stats = SessionStats()
        self.frame_stats = None           # a FrameStats to account calls into, if any
        self._lock = threading.RLock()
        self._schema_cache: Dict[object, tuple] = {}
        self._static_cache: Dict[tuple, bool] = {}
        self._allowed_cache: Dict[object, bool] = {}
        # local_fallback (the launcher): when the server fails, finish the program on the
        # robot -- remote values are recomputed from each proxy's recipe -- and offload
        # again once a background probe reaches the server. Without it (the client's
        # backends) failures propagate: OffloadClient recomputes the frame locally.
        self.local_fallback = local_fallback
        self.retry_interval_s = retry_interval_s
        self.down = threading.Event()
        self.last_error = ""
        self._prober: Optional[threading.Thread] = None
        self._generation = 0
        # One worker sends early replays; the program's thread goes on checking calls. At
        # most one request of this session is in flight: every other send first settles
        # the early one (_settle_early).
        self.early_replay = early_replay
        self._early_sender: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._warned_threads = set()
        self.reset()

    # -- life cycle ----------------------------------------------------------------------
    def reset(self) -> None:
        """Forget every server-side object (after a server restart or a failure)."""
        self.session_id = ""       # the server issues one with its first answer
        # cache key -> (weakref, stamp, handle, content check: None for trusted tensors);
        # see _cached_handle
        self._uploaded: Dict[tuple, tuple] = {}
        self._digests: Dict[int, tuple] = {}      # id(weight) -> (weakref, stamp, sha)
        # storage address -> writes the session saw robot-side operators make into it
        # (in place, declared or hidden): in-place writes into inference tensors and
        # through ``.data`` change no version counter the cache could see
        self._writes: Dict[int, int] = {}
        # digest -> a robot tensor of that content, kept alive so that its upload stays on
        # the server (stable inputs, see _input_ref)
        self._stable: "OrderedDict[str, torch.Tensor]" = OrderedDict()
        self._releases: List[int] = []
        self._spec: Optional[_Speculation] = None
        self._defined = set()
        self.recorder = Recorder()
        self._generation += 1

    def _forget(self, cell) -> None:
        # Handles of an older generation (before a reset) mean nothing to the new session.
        if cell[0] is not None and cell[1] == self._generation:
            self._releases.append(cell[0])

    def __enter__(self):
        global _current
        _install_hooks()
        self._prev, _current = _current, self
        self._mode_ctx = Interceptor(self)
        self._mode_ctx.__enter__()
        return self

    def __exit__(self, *exc):
        global _current
        self._mode_ctx.__exit__(*exc)
        _current = self._prev
        return False

    # -- the interception point ----------------------------------------------------------
    def dispatch(self, func, args, kwargs):
        with self._lock:
            spec = self._spec
            # The record and the speculation follow one thread (see _follows_thread); the
            # operators of any other go one by one.
            own = self.mode != "record_replay" or self._follows_thread()
            # The next recorded call, verified by its compiled check: a replayed operator on
            # this sequence's proxies (so remote, current, writing no robot tensor), which
            # the generic checks below would pass too.
            checked = (own and spec is not None and not kwargs and not self.down.is_set()
                       and self._compiled_match(spec, func, args))
            if not checked:
                if _is_random(func, args, kwargs):
                    return self._run_random(func, args, kwargs)
                flat = wire.leaves((args, kwargs))
                if any(isinstance(a, RemoteTensor) and a._cell[1] != self._generation for a in flat):
                    # Proxies from before a reset: their server tensors are gone; recompute.
                    args, kwargs = tree_map(lambda a: self.materialize(a) if isinstance(a, RemoteTensor)
                                            and a._cell[1] != self._generation else a, (args, kwargs))
                    flat = wire.leaves((args, kwargs))
                remote = any(isinstance(a, RemoteTensor) for a in flat)
                if not remote and (self._schema(func)[4] or not any(isinstance(a, torch.nn.Parameter) for a in flat)):
                    # Robot tensors only and no weight: the program's own work (building the
                    # input, bookkeeping) stays on the robot; and a view of a weight stays a view
                    # of robot memory (programs write through them: YOLO's bias initialisation).
                    self.stats.ops_local += 1
                    if self._schema(func)[0] or _short_name(func) in HIDDEN_WRITES:
                        if self._spec is not None:
                            self._keep_written_inputs(func, args, kwargs)
                        self._note_writes(func, args, kwargs)
                    return func(*args, **kwargs)
                if (self._writes_robot_tensor(func, args, kwargs) or self.down.is_set()
                        or not self._server_runs(func)):
                    return self._run_locally(func, args, kwargs)
            try:
                if checked:
                    return self._speculate(func, None, args, kwargs, checked=True)
                if not own:
                    return self._transparent(func, args, kwargs)
                if self.mode == "record_replay":
                    return self._record_replay(func, args, kwargs)
                return self._transparent(func, args, kwargs)
            except (TransportError, RemoteError) as e:
                if not self.local_fallback:
                    raise
                self._server_lost(e)
            return self._run_locally(func, args, kwargs)

    def _server_runs(self, func) -> bool:
        """Whether the server runs ``func`` (:mod:`~robot_offload.transparent.allowlist`).
        One it refuses runs on the robot, like an argument the wire cannot carry: counted
        in ``ops_not_allowed`` (and ``ops_local``), logged once per operator."""
        allowed = self._allowed_cache.get(func)
        if allowed is None:
            allowed = self._allowed_cache[func] = allowlist.is_allowed(func)
            if not allowed:
                log.warning("%s is not on the server's allow-list: it runs on the robot",
                            wire.op_name(func))
        if not allowed:
            self.stats.ops_not_allowed += 1
        return allowed

    def _follows_thread(self) -> bool:
        """Whether this thread's operators may be recorded and replayed: a speculation
        belongs to the thread that began it, and while it is open the operators of other
        threads (another subscriber's callback) go one by one, unrecorded, through the same
        lock. A speculation whose thread has ended is closed (replayed so far, then
        recorded again)."""
        spec = self._spec
        if spec is None:
            return True
        cur = threading.current_thread()
        if spec.thread is cur:
            return True
        if not spec.thread.is_alive():
            self._diverge(f"thread {spec.thread.name} ended inside a replayed sequence")
            return True
        if cur.ident not in self._warned_threads:
            self._warned_threads.add(cur.ident)
            log.warning("record_replay: thread %s runs operators while thread %s is inside a "
                        "replayed sequence; they go one by one (one request each)",
                        cur.name, spec.thread.name)
        return False

    # -- server loss (local_fallback) --------------------------------------------------
    def _server_lost(self, error) -> None:
        """Forget the server's state, compute on the robot, probe in the background."""
        self.last_error = f"{type(error).__name__}: {error}"
        log.warning("offload server lost (%s): computing on the robot until it answers again",
                    self.last_error)
        self.stats.server_losses += 1
        self._spec = None
        self.reset()
        self.down.set()
        if self._prober is None or not self._prober.is_alive():
            self._prober = threading.Thread(target=self._probe, name="transparent-prober", daemon=True)
            self._prober.start()

    def _probe(self) -> None:
        while self.down.is_set():
            time.sleep(self.retry_interval_s)
            req = ComputeRequest(client_id=self.client_id, model="", entry=ENTRY, args_json="{}",
                                 session=self.session_id)
            try:
                raise_for_status(*_status_of(self._call(req, max(self.retry_interval_s, 0.5))))
            except (TransportError, RemoteError):
                continue
            log.info("offload server answers again: offloading from the next operator")
            self.down.clear()

    def _attach_recipe(self, func, args, kwargs, out) -> None:
        """Remember how each output proxy was computed (the call, with proxy arguments
        replaced by their own recipes -- never by the proxies, which must stay free to be
        released), so its values can be recomputed on the robot if the server is lost. A
        proxy argument with neither a recipe nor downloaded values leaves the outputs
        without one (recomputing them then fails with a clear error)."""
        if not kwargs and type(out) is RemoteTensor:
            # The usual call, flat positional arguments and one output: no tree walks
            # (two maps and two flattens cost about a tenth of the robot's time per
            # replayed call).
            r_args = []
            for a in args:
                if type(a) in (list, tuple, dict):
                    break
                a = _ingredient(a)
                if type(a) is RemoteTensor:
                    return
                r_args.append(a)
            else:
                out._recipe = (_Recipe(func, r_args, {}), 0)
                return
        r_args, r_kwargs = tree_map(_ingredient, (list(args), kwargs))
        if any(isinstance(a, RemoteTensor) for a in tree_flatten((r_args, r_kwargs))[0]):
            return
        recipe = _Recipe(func, r_args, r_kwargs)
        for k, t in enumerate(t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)):
            if isinstance(t, RemoteTensor):
                t._recipe = (recipe, k)

    def _recompute(self, t: "RemoteTensor") -> torch.Tensor:
        if t._recipe is None:
            raise OffloadError("a remote tensor whose server is gone cannot be recomputed "
                               "(no recipe; was local_fallback off?)")
        recipe, k = t._recipe
        memo = {}
        return self._to_robot(recipe.evaluate(memo)[k].clone(), t)

    def _run_locally(self, func, args, kwargs):
        self._end_speculation_before_local()
        self.stats.ops_local += 1
        args, kwargs = tree_map(lambda a: self.materialize(a) if isinstance(a, RemoteTensor) else a,
                                (args, kwargs))
        self._note_writes(func, args, kwargs)
        return func(*args, **kwargs)

    def _run_random(self, func, args, kwargs):
        """A random operator runs on the robot, on the program's generator, so that
        ``torch.manual_seed`` and generator objects mean what they mean in a plain run.
        Its remote arguments are downloaded (a ``*_like`` factory and a fill such as
        ``bernoulli_`` read only their shape); a remote tensor it fills in place gets the
        robot's values by a ``copy_`` on the server."""
        self.stats.ops_local += 1
        name = _short_name(func)
        written = {i for i, _ in self._schema(func)[0]}
        shape_only = name.endswith("_like") or name in _RANDOM_FILLS
        remote_out = []

        def local(a, i=None):
            if not isinstance(a, RemoteTensor):
                return a
            if i is not None and i in written:
                value = (torch.empty_strided(a.shape, a.stride(), dtype=a.dtype) if shape_only
                         else self.materialize(a).clone())
                remote_out.append((a, value))
                return value
            if shape_only:
                return torch.empty_strided(a.shape, a.stride(), dtype=a.dtype)
            return self.materialize(a)
        l_args = [local(a, i) if isinstance(a, RemoteTensor) else tree_map(local, a)
                  for i, a in enumerate(args)]
        l_kwargs = tree_map(local, kwargs)
        if any(isinstance(a, torch.Tensor) and not isinstance(a, RemoteTensor)
               for a in wire.leaves((args, kwargs))):
            self._note_writes(func, args, kwargs)
        out = func(*l_args, **l_kwargs)
        for proxy, value in remote_out:
            self.dispatch(torch.ops.aten.copy_.default, (proxy, value), {})
            if out is value:
                out = proxy
        return out

    def _end_speculation_before_local(self):
        if self._spec is not None:
            self._diverge("a robot-side write")

    def _schema(self, func):
        info = self._schema_cache.get(func)
        if info is None:
            schema = func._schema
            written = [(i, a.name) for i, a in enumerate(schema.arguments)
                       if a.alias_info is not None and a.alias_info.is_write]
            returns_alias = []
            for r in schema.returns:
                src = None
                if r.alias_info is not None and r.alias_info.is_write:
                    for i, a in enumerate(schema.arguments):
                        if a.alias_info is not None and set(a.alias_info.before_set) & set(r.alias_info.before_set):
                            src = (i, a.name)
                            break
                returns_alias.append(src)
            sync = any(str(r.type) not in ("Tensor", "Tensor[]", "Optional[Tensor]") for r in schema.returns)
            is_view = bool(schema.returns) and all(
                r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)
            info = (written, returns_alias, sync, len(schema.returns), is_view)
            self._schema_cache[func] = info
        return info

    @staticmethod
    def _arg(args, kwargs, pos_name):
        i, name = pos_name
        if i < len(args):
            return args[i]
        return kwargs.get(name)

    def _keep_written_inputs(self, func, args, kwargs) -> None:
        """A robot-side operator is about to write into a robot tensor the replay has
        bound as an input (``x.mul_(2)`` between two reads of ``x``): the replay sends
        inputs when it is sent (and again after a dropped early reply), and it must send
        what the program passed, so it keeps a copy of that. (Recording uploaded the
        tensor at the read, before the write; the read after it is another input.)"""
        spec = self._spec
        for pn in self._schema(func)[0]:
            v = self._arg(args, kwargs, pn)
            for t in (v if isinstance(v, (list, tuple)) else [v]):
                if not isinstance(t, torch.Tensor) or isinstance(t, RemoteTensor):
                    continue
                ptr = t.untyped_storage().data_ptr()
                for idx, bound in list(spec.inputs.items()):
                    if (not isinstance(bound, RemoteTensor)
                            and bound.untyped_storage().data_ptr() == ptr):
                        spec.inputs[idx] = bound.clone()

    def _writes_robot_tensor(self, func, args, kwargs) -> bool:
        """Whether ``func`` writes a robot tensor (declared or hidden write): it then runs
        on the robot, so the program's own tensor (a module's running statistics) changes
        exactly as in a plain run."""
        return any(not isinstance(t, RemoteTensor) for t in self._written_tensors(func, args, kwargs))

    # -- transparent: one request per operator -------------------------------------------
    def _transparent(self, func, args, kwargs, record: bool = False):
        uploads: List[tuple] = []          # (tensor, spec dict)

        def ref(t):
            if isinstance(t, RemoteTensor):
                if t._pending is not None:
                    self._flush("an operator outside the recorded sequence")
                if t.handle is None:
                    raise OffloadError("a remote tensor of a failed or reset session was used")
                return {"h": t.handle}
            return self._upload_ref(t, uploads)

        try:
            a_tree = wire.encode(list(args), ref)
            k_tree = {k: wire.encode(v, ref) for k, v in kwargs.items()}
        except wire.Unsupported:
            return self._run_locally(func, args, kwargs)
        name = wire.op_name(func)
        req_args = {"ops": [{"op": name, "a": a_tree, "k": k_tree}]}
        result, _ = self._send(req_args, uploads)
        self.stats.ops_remote += 1
        ret = result["ops"][0]
        out = self._decode_return(func, args, kwargs, ret)
        if self.local_fallback:
            self._attach_recipe(func, args, kwargs, out)
        if record:
            self._record(func, name, a_tree, k_tree, ret, out, args, kwargs)
        return out

    @staticmethod
    def _cache_key(t: torch.Tensor):
        """(key, owner) of a robot tensor in the upload cache. A view of a contiguous robot
        tensor (``weight.t()`` in every Linear call, ``bias.view(...)``) is keyed by its base
        and its view geometry, so a fresh view object of the same weight hits the cache."""
        base = t._base
        if base is not None and base.dtype == t.dtype and base.is_contiguous() and base._base is None:
            return (id(base), tuple(t.shape), tuple(t.stride()), t.storage_offset() - base.storage_offset()), base
        return (id(t),), t

    def _same_view(self, a, b) -> bool:
        """Two robot tensors that are the same view of the same base (``widths[:, None]``
        written twice): one upload in the record, one input of the sequence."""
        if isinstance(a, RemoteTensor) or isinstance(b, RemoteTensor):
            return False
        (key_a, base_a), (key_b, base_b) = self._cache_key(a), self._cache_key(b)
        return base_a is base_b and base_a is not a and key_a == key_b

    def _stamp(self, t: torch.Tensor) -> tuple:
        """What says a robot tensor is unchanged without reading its bytes: its version
        counter (-1 for inference tensors, which have none), its storage (``.data =``
        swaps it and keeps the version), the writes this session saw robot-side
        operators make into that storage, and how often ``.data`` was assigned."""
        ptr = _storage_ptr(t)
        return (_version_of(t), ptr, self._writes.get(ptr, 0), getattr(t, "_ro_data_epoch", 0))

    def _cached_handle(self, t: torch.Tensor):
        """The server handle of ``t``'s upload while its content is known to be the same,
        else None.

        Weights (``nn.Parameter``) and the session's own private copies are trusted by
        :meth:`_stamp`: the program changes them with torch operators, which the session
        sees. Any other robot tensor may be written behind torch's back (numpy writes into
        ``torch.from_numpy`` memory, a camera driver's buffer, an inference tensor): its
        upload is used again only while its bytes are still those uploaded
        (:func:`_content_check`)."""
        key, owner = self._cache_key(t)
        entry = self._uploaded.get(key)
        if entry is None or entry[0]() is not owner or entry[1] != self._stamp(owner):
            return None
        if entry[3] is not None and not _content_same(owner, entry[3]):
            return None               # written since its upload
        return entry[2]

    def _upload_ref(self, t: torch.Tensor, uploads: list) -> dict:
        h = self._cached_handle(t)
        if h is not None:
            return {"h": h}
        for i, (u, _) in enumerate(uploads):
            if u is t:
                return {"u": i}
        key, owner = self._cache_key(t)
        if owner is not t:
            # Upload the base once; the server makes the view (as_strided) without a copy.
            base_ref = self._upload_ref(owner, uploads)
            uploads.append((t, {"of": base_ref, "view": [list(t.shape), list(t.stride()), key[3]]}))
        else:
            uploads.append((t, {}))
        return {"u": len(uploads) - 1}

    def _digest(self, t: torch.Tensor) -> str:
        """The content digest of ``t``: remembered for trusted tensors (see
        :meth:`_cached_handle`), computed each time for any other."""
        if not _trusted(t):
            return content_digest(t)
        entry = self._digests.get(id(t))
        stamp = self._stamp(t)
        if entry is not None and entry[0]() is t and entry[1] == stamp:
            return entry[2]
        sha = content_digest(t)
        self._digests[id(t)] = (weakref.ref(t), stamp, sha)
        return sha

    def _send(self, req_args: dict, uploads: list, take_releases: bool = True):
        """One round trip. Uploads go by digest first (big robot tensors), then by value.
        ``take_releases=False``: the caller put the pending releases in ``req_args`` itself
        (a worker thread must not swap the list the program's thread appends to)."""
        # Weights (nn.Parameter) of some size are offered by digest: the server may hold
        # them already. Frames and other tensors go by value at once.
        by_digest = [isinstance(t, torch.nn.Parameter) and t.numel() * t.element_size() >= DIGEST_MIN_BYTES
                     for t, _ in uploads]
        while True:
            specs, tensors = [], []
            checks = {}     # id(owner) -> content check of the bytes sent (see _cached_handle)
            for (t, extra), dig in zip(uploads, by_digest):
                if extra:
                    specs.append(extra)
                    continue
                digest = self._digest(t) if isinstance(t, torch.nn.Parameter) and \
                    t.numel() * t.element_size() >= DIGEST_MIN_BYTES else ""
                if dig:
                    specs.append({"sha": digest})
                else:
                    specs.append({"n": len(tensors), "sha": digest})
                    if not _trusted(t):     # taken with the bytes, not after the reply
                        checks[id(t)] = _content_check(t)
                    tensors.append(codec.encode(t.detach().contiguous(), f"u{len(tensors)}"))
            body = dict(req_args)
            if specs:
                body["uploads"] = specs
            if take_releases and self._releases:
                body["release"], self._releases = self._releases, []
            response = self._roundtrip(body, tensors)
            result = json.loads(response.result_json or "{}")
            if "missing" in result:
                for i in result["missing"]:
                    by_digest[i] = False
                continue
            for (t, _), h in zip(uploads, result.get("uploaded", [])):
                self._remember_upload(t, h, checks)
            return result, response

    def _remember_upload(self, t: torch.Tensor, h: int, checks: Optional[dict] = None) -> None:
        """Cache the upload of ``t`` under handle ``h``; ``checks``: the content checks
        taken as the bytes were encoded (a view's is its base's)."""
        key, owner = self._cache_key(t)
        sess_gen = self._generation

        def dead(_, key=key, h=h):
            if self._generation == sess_gen:
                self._releases.append(h)
                self._uploaded.pop(key, None)
        check = None
        if not _trusted(owner):
            check = (checks or {}).get(id(owner))
            if check is None:      # a view of a base uploaded before: the server has its bytes
                base = self._uploaded.get((id(owner),))
                check = base[3] if base is not None and base[0]() is owner else _content_check(owner)
        self._uploaded[key] = (weakref.ref(owner, dead), self._stamp(owner), h, check)
        self.recorder.note_upload(h)

    def _note_writes(self, func, args, kwargs) -> None:
        """Count the writes of a robot-side operator into robot tensors (see _stamp)."""
        for t in self._written_tensors(func, args, kwargs):
            if not isinstance(t, RemoteTensor):
                ptr = _storage_ptr(t)
                self._writes[ptr] = self._writes.get(ptr, 0) + 1

    def _written_tensors(self, func, args, kwargs) -> list:
        """The tensors ``func`` writes: those its schema marks ``(a!)`` and those it writes
        without saying so (:data:`HIDDEN_WRITES`: batch norm's running statistics in
        training mode)."""
        out = []
        for pn in self._schema(func)[0] + _hidden_writes(func, args, kwargs):
            v = self._arg(args, kwargs, pn)
            for t in (v if isinstance(v, (list, tuple)) else [v]):
                if isinstance(t, torch.Tensor):
                    out.append(t)
        return out

    def _roundtrip(self, body: dict, tensors: list):
        timeout = self.timeout_s
        if self.deadline is not None:
            timeout = min(timeout, self.deadline - time.perf_counter())
        req = ComputeRequest(client_id=self.client_id, model="", entry=ENTRY, tensors=tensors,
                             args_json=json.dumps(body), session=self.session_id,
                             output_codec=self.output_codec)
        t0 = time.perf_counter()
        response = self._call(req, timeout)
        t1 = time.perf_counter()
        raise_for_status(response.status, response.status_text)
        if not self.session_id:
            self.session_id = json.loads(response.result_json or "{}").get("session", "")
        up, down = req.payload_bytes + len(req.args_json), response.payload_bytes + len(response.result_json)
        self.stats.round_trips += 1
        self.stats.bytes_up += up
        self.stats.bytes_down += down
        if self.stats.inferences:
            cur = self.stats.inferences[-1]
            cur.round_trips += 1
            cur.bytes_up += up
            cur.bytes_down += down
        if self.frame_stats is not None:
            self.frame_stats.add_call(t0, t1, response.server_total_s or response.server_compute_s, up, down)
        return response

    def _decode_return(self, func, args, kwargs, ret, from_record: bool = False):
        """Proxies for the tensors of a server return tree; in-place returns give back the
        argument object itself."""
        _, returns_alias, _, n_returns, _ = self._schema(func)
        inputs = None

        def build(node, top_index=None):
            nonlocal inputs
            if isinstance(node, dict) and len(node) == 1 and "t" in node:
                meta = node["t"]
                if "a" in meta:       # the operator returned one of its inputs
                    if inputs is None:
                        inputs = wire.tensor_leaves(args, kwargs)
                    obj = inputs[meta["a"]]
                    if isinstance(obj, RemoteTensor) and top_index is not None \
                            and top_index < len(returns_alias) and returns_alias[top_index] is not None:
                        obj._value = None     # written in place: cached values are stale
                    return obj
                return RemoteTensor(self, meta, None if from_record else meta.get("h"))
            if isinstance(node, dict) and len(node) == 1 and "l" in node:
                return [build(v) for v in node["l"]]
            if isinstance(node, dict) and len(node) == 1 and "f" in node:
                return float(node["f"])
            return node
        try:
            if n_returns > 1 and isinstance(ret, dict) and "l" in ret:
                return tuple(build(v, i) for i, v in enumerate(ret["l"]))
            return build(ret, 0)
        finally:
            # A recursive closure is a reference cycle (function -> cell -> function) that
            # would keep this operator's arguments alive until the garbage collector runs:
            # proxies the program has dropped would still count as held (replay keeps,
            # early replay's coverage check) and server tensors would be released late.
            build = None

    # -- materialising ---------------------------------------------------------------------
    def materialize(self, t):
        """The values of a proxy as a robot tensor (downloaded once, then cached)."""
        if not isinstance(t, RemoteTensor):
            return t
        with self._lock:
            if t._value is not None:
                return t._value
            if self.local_fallback and (self.down.is_set() or t._cell[1] != self._generation):
                t._value = self._recompute(t)
                return t._value
            try:
                return self._download(t)
            except (TransportError, RemoteError) as e:
                if not self.local_fallback:
                    raise
                self._server_lost(e)
                t._value = self._recompute(t)
                return t._value

    def _download(self, t):
        if t._pending is not None:
            self._flush("the program reads a value", want=t)
            if t._value is not None:
                return t._value
        if t.handle is None:
            raise OffloadError("a remote tensor of a failed or reset session was read")
        _, response = self._send({"fetch": [t.handle]}, [])
        if self.mode == "record_replay":
            self.recorder.note_fetch(t.handle)
            if t._origin is not None:   # read after a replay: prefetch it next time
                seq = t._origin[0].seq
                if tuple(t._origin[1:]) not in set(map(tuple, seq.prefetch)):
                    seq.prefetch.append(tuple(t._origin[1:]))
        t._value = self._to_robot(codec.decode(response.tensors[0]), t)
        return t._value

    @staticmethod
    def _to_robot(value: torch.Tensor, proxy: RemoteTensor) -> torch.Tensor:
        value = value.reshape(proxy.shape)
        if tuple(proxy.stride()) != tuple(value.stride()) and value.numel() > 0:
            try:
                value = torch.empty_strided(proxy.shape, proxy.stride(), dtype=value.dtype).copy_(value)
            except RuntimeError:
                pass
        return value

    # -- record / replay -------------------------------------------------------------------
    def _tensor_rec_ref(self, t) -> tuple:
        """Recorder reference for a tensor argument of an operator being recorded."""
        if isinstance(t, RemoteTensor):
            return self.recorder.ref_of_handle(t.handle)
        return ("up", self._cached_handle(t), wire.tensor_meta(t))

    def _record(self, func, name, a_tree, k_tree, ret, out, args, kwargs):
        def rec(node, value):
            if isinstance(node, dict) and len(node) == 1 and "t" in node:
                return {"t": self._tensor_rec_ref(value)}
            if isinstance(node, dict) and len(node) == 1 and "l" in node:
                return {"l": [rec(n, v) for n, v in zip(node["l"], value)]}
            return node
        try:
            a_rec = rec(a_tree, list(args))
            k_rec = {k: rec(v, kwargs[k]) for k, v in k_tree.items()}
        finally:
            rec = None  # break the closure's reference cycle (see _decode_return)
        out_tensors = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        metas = [wire.tensor_meta(t) for t in out_tensors]
        _, _, value_return, _, _ = self._schema(func)
        sync = value_return or not self._shapes_static(func, args, kwargs, metas)
        op = RecordedOp(name, a_rec, k_rec, metas, ret, sync)
        # In-place results ({"a": 1}) produce no new tensor: their producer stays the same.
        self.recorder.add(op, [m.get("h") for m in _metas_in(ret)])

    def _shapes_static(self, func, args, kwargs, metas) -> bool:
        """Whether the output shapes follow from the input shapes alone: the operator's meta
        kernel computes them without data. If it cannot (``nonzero``, ``unique``, boolean
        masks, NMS), the operator is a sync point of its sequence: replaying stops there
        and the real shapes are compared with the record. (Where a meta kernel runs but
        reports other auxiliary shapes than the CPU kernel -- ``native_batch_norm``'s saved
        statistics in eval mode -- the shapes still depend on input shapes only.)"""
        key = (func, tuple((tuple(a.shape), a.dtype) for a in tree_flatten((args, kwargs))[0]
                           if isinstance(a, torch.Tensor)))
        known = self._static_cache.get(key)
        if known is not None:
            return known
        try:
            m_args, m_kwargs = tree_map(
                lambda a: torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="meta")
                if isinstance(a, torch.Tensor) else a, (args, kwargs))
            func(*m_args, **m_kwargs)
            static = True
        except Exception:  # noqa: BLE001 - no meta kernel or data-dependent output shape
            static = False
        self._static_cache[key] = static
        return static

    def _record_replay(self, func, args, kwargs):
        name = wire.op_name(func)
        if self._spec is not None:
            try:
                return self._speculate(func, name, args, kwargs)
            except Mismatch as e:
                self._diverge(str(e))
                return self._transparent(func, args, kwargs, record=True)
        # Not in a sequence: does this operator start one?
        if self.recorder.sequences or self.recorder.ops:
            probe = self._probe_key(name, args, kwargs)
            if probe is not None:
                if self.recorder.ops and probe[1]:
                    seq = self.recorder.identify()
                    if seq is not None:
                        self.stats.sequences_identified += 1
                        log.info("identified an operator sequence of %d operators (%s%s)", seq.n_ops,
                                 seq.seq_id, ", with size symbols" if seq.has_sizes else "")
                    elif self.recorder.not_unified:
                        log.debug("two inferences differ: %s", self.recorder.not_unified)
                        self.recorder.not_unified = ""
                seq = self.recorder.sequences.get(probe[0])
                if seq is None and probe[1]:
                    # The program may pass a robot tensor it passed before (the same input
                    # object again): its upload is cached, so the key above took it for a
                    # constant. Try it as the sequence's input.
                    alt = self._probe_key(name, args, kwargs, reused_as_input=True)
                    seq = self.recorder.sequences.get(alt[0]) if alt is not None else None
                if seq is not None:
                    self._spec = _Speculation(seq)
                    self.stats.inferences.append(InferenceCount("replaying"))
                    try:
                        return self._speculate(func, name, args, kwargs)
                    except Mismatch as e:
                        self._diverge(str(e))
                        return self._transparent(func, args, kwargs, record=True)
                if probe[1]:
                    self.stats.inferences.append(InferenceCount("recording"))
        elif not self.stats.inferences:
            self.stats.inferences.append(InferenceCount("recording"))
        return self._transparent(func, args, kwargs, record=True)

    def _probe_key(self, name, args, kwargs, reused_as_input: bool = False):
        """(start key, is_root) of an operator about to be recorded, or None when one of
        its tensors cannot be referenced without a round trip. With ``reused_as_input``,
        robot tensors other than parameters count as new in this inference even when
        their upload is cached."""
        root = True

        def ref(t):
            nonlocal root
            if isinstance(t, RemoteTensor):
                if t.handle is None:
                    raise wire.Unsupported("pending")
                r = self.recorder.ref_of_handle(t.handle)
                if r[0] == "op":
                    root = False
                return r
            h = None if reused_as_input and not isinstance(t, torch.nn.Parameter) else self._cached_handle(t)
            return ("up", -1 if h is None else h, wire.tensor_meta(t))
        try:
            a = wire.encode(list(args), ref)
            k = {kk: wire.encode(v, ref) for kk, v in kwargs.items()}
        except wire.Unsupported:
            return None
        if not root:
            return None, False
        key = self.recorder.start_key(name, a, k, lambda h: h == -1 or self.recorder.uploaded_at.get(h, -1) >= len(self.recorder.ops))
        return key, True

    def _speculate(self, func, name, args, kwargs, checked: bool = False):
        """Answer the next call of the sequence from the record. ``checked``: the call
        passed its compiled check (:meth:`_compiled_match`); otherwise it is matched here
        argument by argument (Mismatch if it differs)."""
        spec = self._spec
        seq = spec.seq
        j = spec.pos
        bind = {} if checked else self._match_call(spec, j, name, args, kwargs)
        for idx, t in bind.items():
            spec.inputs[idx] = t
            if idx in spec.predicted and not spec.early_stale:
                d = self._stable_digest(t)
                if d != spec.predicted[idx]:
                    # the early replay ran with last frame's content: it cannot be used
                    spec.early_stale = True
                    seq.input_digests[idx] = d
        # The whole sequence leaves as soon as its inputs are known (or predicted). A
        # sequence with size symbols goes early before its first replay has ended too: only
        # the early reply says this frame's sizes without a round trip per sync point.
        if (self.early_replay and spec.early is None and spec.sent == 0 and seq.early_ok
                and (seq.early_keep is not None or seq.has_sizes) and j + 1 < seq.n_ops
                and all(i in spec.inputs or self._stable_handle(seq, i) is not None
                        for i in range(len(seq.input_metas)))):
            self._send_early(spec)
        # Answer from the record.
        ret = seq.rets[j]
        sized = actual = None
        if seq.sized[j]:
            # Shapes that change with the data: this frame's, from the early reply, or for
            # an operator that is no sync point, from its meta kernel on this call's arguments.
            if spec.early is not None:
                sized, actual = self._sized_from_early(spec, j)
            if sized is None and not seq.sync[j]:
                sized = self._sized_by_meta(spec, j, func, args, kwargs)
            # otherwise: stand-ins of the recorded shapes until the replay up to this
            # operator returns the real ones (below), as for a sync point
            ret = sized if sized is not None else seq.recorded_rets[j]
        meta = _single_new_tensor(ret)
        if meta is not None:
            # The usual return, one new tensor: its proxy without the generic decoding.
            out = RemoteTensor(self, meta, None)
            out_tensors = [out]
        else:
            out = self._decode_return(func, args, kwargs, ret, from_record=True)
            out_tensors = [t for t in wire.leaves(out) if isinstance(t, RemoteTensor)]
        if self.local_fallback:
            self._attach_recipe(func, args, kwargs, out)
        for k, (t, m) in enumerate(zip(out_tensors, _metas_in(ret) if meta is None else [meta])):
            if "a" not in m:
                t._pending = t._origin = (spec, j, k)
                spec.proxies[(j, k)] = weakref.ref(t)
        spec.pos = j + 1
        self.stats.ops_replayed += 1
        if self.stats.inferences:
            self.stats.inferences[-1].ops += 1
        if sized is not None and seq.sync[j] and not out_tensors:
            out = self._decode_return(func, args, kwargs, actual)     # values: this frame's
        if (seq.sync[j] or seq.sized[j]) and sized is None:
            actual = (self._early_sync_result(spec, j, ret)
                      if spec.early is not None and not seq.sized[j] else None)
            if actual is None:
                actual = self._flush("a value or data-dependent shape", sync_op=j)
            if seq.sized[j]:
                out = self._sized_after_flush(spec, j, func, args, kwargs, actual, out_tensors)
                if out is not None:
                    if spec.pos == seq.n_ops and self._spec is spec:
                        self._flush("end of the sequence")
                        self._spec = None
                    return out
            if not _same_shapes(actual, ret):
                # The data made the shapes differ from the record: hand out proxies with the
                # real shapes (same server tensors) and record again from here.
                self._spec = None
                self._note_divergence(spec, f"operator {j} returned other shapes than recorded")
                if len(_metas_in(actual)) != len(_metas_in(ret)):
                    # another number of tensors (unbind of a data-dependent length): the
                    # replay kept only the recorded ones, so run the operator again
                    return self._transparent(func, args, kwargs, record=True)
                return self._decode_return(func, args, kwargs, self._rebuild_ret(actual, out_tensors))
            if not out_tensors:
                out = self._decode_return(func, args, kwargs, actual)
        if spec.pos == seq.n_ops and self._spec is spec:
            self._flush("end of the sequence")
            self._spec = None
        return out

    def _sized_from_early(self, spec, j: int):
        """(operator ``j``'s return with this frame's shapes, the server's return) from the
        early reply, which carries the return of every sync and sized operator; (None,
        None), with the early reply dropped, when the reply cannot be used or differs from
        the record in structure or dtype."""
        seq = spec.seq
        result, _ = self._early_reply(spec)
        if result is None:
            return None, None
        actual = result["replay"]["rets"].get(str(j))
        resolved = None
        if actual is not None and not spec.early_stale:
            try:
                if j in seq.size_ops:
                    spec.sizes[j] = wire.size_leaves(actual)
                resolved = frame_return(seq.rets[j], actual)
            except (KeyError, IndexError, TypeError, ValueError):
                resolved = None
        if resolved is None:
            self._drop_early(spec, result)
            return None, None
        if seq.sync[j]:
            self.stats.early_sync_answers += 1
        return resolved, actual

    def _sized_by_meta(self, spec, j: int, func, args, kwargs):
        """Operator ``j``'s return with this frame's shapes where no reply says them: its
        meta kernel's on this call's arguments (None without one). It is no sync point, so
        its shapes follow from its arguments' shapes."""
        try:
            m_args, m_kwargs = tree_map(
                lambda a: torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="meta")
                if isinstance(a, torch.Tensor) else a, (args, kwargs))
            out = func(*m_args, **m_kwargs)
            return frame_return(spec.seq.rets[j], wire.encode(out, wire.tensor_meta))
        except Exception:  # noqa: BLE001 - no meta kernel, another structure: a round trip
            return None

    def _sized_after_flush(self, spec, j: int, func, args, kwargs, actual, stand_ins):
        """After the replay up to sized operator ``j`` (no early reply): its outputs as
        proxies of the real shapes (the stand-ins' server tensors moved into them); None
        where its return differs from the record in structure or dtype (the caller
        diverges)."""
        seq = spec.seq
        try:
            if j in seq.size_ops:
                spec.sizes[j] = wire.size_leaves(actual)
            resolved = frame_return(seq.rets[j], actual)
        except (KeyError, IndexError, TypeError, ValueError):
            return None
        metas = _metas_in(resolved)
        if not any("a" not in m for m in metas):
            return self._decode_return(func, args, kwargs, resolved)   # values, or its input
        # the stand-ins of the new tensors, in order (an in-place result is its input)
        olds = [t for t, m in zip(stand_ins, _metas_in(seq.recorded_rets[j])) if "a" not in m]
        out = self._decode_return(func, args, kwargs, self._rebuild_ret(resolved, olds))
        leaves = [t for t in wire.leaves(out) if isinstance(t, RemoteTensor)]
        news = iter(olds)
        for k, (t, m) in enumerate(zip(leaves, metas)):
            if "a" not in m:
                t._origin = (spec, j, k)
                spec.proxies[(j, k)] = weakref.ref(t)
                old = next(news, None)
                fetched = getattr(old, "_fetched", None)
                if fetched is not None and fetched.numel() == t.numel():
                    t._value = self._to_robot(fetched, t)
        return out

    def _match_call(self, spec, j, name, args, kwargs) -> dict:
        """Check call ``j`` against the record argument by argument; the inputs it binds
        (input index -> tensor). Mismatch if it differs."""
        expected = spec.seq.ops[j]
        if expected["op"] != name:
            raise Mismatch(f"operator {j}: {name} where the record has {expected['op']}")
        bind = {}
        try:
            self._match(expected["a"], list(args), spec, bind, j)
            if set(expected["k"]) != set(kwargs):
                raise Mismatch(f"operator {j}: keyword arguments differ")
            for k, v in kwargs.items():
                self._match(expected["k"][k], v, spec, bind, j)
        except wire.Unsupported as e:
            raise Mismatch(f"operator {j}: {e}") from None
        return bind

    def _compiled_match(self, spec, func, args) -> bool:
        """Whether positional call ``args`` of ``func`` is exactly the sequence's next
        recorded call, by the check compiled for it (:func:`_compile_check`). False means
        "not decided here": the generic path matches it (and reports a divergence).

        Why: on a GPU server the robot's checks, not the server, set record_replay's
        latency (ResNet-101 on 0.5 CPU: 40-70 ms of checks against a 45-60 ms round trip),
        and the generic match walks each argument's JSON tree."""
        seq = spec.seq
        j = spec.pos
        if j >= seq.n_ops:
            return False
        compiled = seq.robot_checks
        if compiled is None:
            compiled = seq.robot_checks = [_compile_check(op, self._schema) for op in seq.ops]
        check = compiled[j]
        if check is None or check[0] is not func or len(args) != check[1]:
            return False
        for pos, kind, want in check[2]:
            if not self._compiled_arg(spec, kind, want, args[pos]):
                return False
        return True

    def _compiled_arg(self, spec, kind, want, a) -> bool:
        """One argument against its compiled check (see _compile_check)."""
        if kind is _OUT:
            if type(a) is not RemoteTensor:
                return False
            origin = a._origin
            return origin is not None and origin[0] is spec and origin[1] == want[0] and origin[2] == want[1]
        if kind is _CONST:
            if type(a) is RemoteTensor:
                return a._cell[0] == want and a._cell[1] == self._generation
            return isinstance(a, torch.Tensor) and self._cached_handle(a) == want
        if kind is _LIST:
            return type(a) in (list, tuple) and len(a) == len(want) and all(
                self._compiled_arg(spec, k, w, v) for (k, w), v in zip(want, a))
        if kind is _SIZE:
            return _size_matches(spec, want, a)
        if kind is _VALUES:   # element types first: a tensor equal to 2 must not pass as 2
            values, types = want
            return type(a) is list and tuple(map(type, a)) == types and a == values
        return type(a) is type(want) and a == want    # _VALUE

    def _rebuild_ret(self, actual, old_tensors):
        """A return tree with the server's values/metas and the handles of the kept outputs
        (moved from the old proxies, which must not release them)."""
        olds = iter(old_tensors)

        def walk(node):
            if isinstance(node, dict) and len(node) == 1 and "t" in node:
                if "a" in node["t"]:
                    return node       # the operator's input, handed back
                meta = dict(node["t"])
                old = next(olds, None)
                meta["h"] = old.handle if old is not None else None
                if old is not None:
                    old._cell[0] = None
                return {"t": meta}
            if isinstance(node, dict) and len(node) == 1 and "l" in node:
                return {"l": [walk(v) for v in node["l"]]}
            return node
        try:
            return walk(actual)
        finally:
            walk = None  # break the closure's reference cycle (see _decode_return)

    def _note_divergence(self, spec, why: str) -> None:
        self.stats.divergences += 1
        if self.stats.inferences:
            self.stats.inferences[-1].phase = "fallback"
        log.info("record/replay: %s (sequence %s, operator %d); finishing op by op and "
                 "recording again", why, spec.seq.seq_id, spec.pos)
        self.recorder.sequences.pop(spec.seq.key, None)
        self.recorder.reset()

    def _match(self, expected, actual, spec, bind, j):
        """Compare one argument with the record; Mismatch if it differs."""
        if type(expected) is type(actual) and type(actual) in _PLAIN_SCALARS and expected == actual:
            return     # the common case (strides, paddings, flags), without encoding it
        if isinstance(expected, dict) and len(expected) == 1 and "t" in expected:
            if not isinstance(actual, torch.Tensor):
                raise Mismatch(f"operator {j}: a tensor argument is now {type(actual).__name__}")
            ref = expected["t"]
            (kind, val), = ref.items()
            if kind == "o":
                if not (isinstance(actual, RemoteTensor) and actual._origin is not None
                        and actual._origin[0] is spec and list(actual._origin[1:]) == val):
                    raise Mismatch(f"operator {j}: reads another tensor than recorded output {val}")
                return
            if kind == "c":
                if isinstance(actual, RemoteTensor):
                    if actual.handle != val:
                        raise Mismatch(f"operator {j}: another remote tensor than the recorded constant")
                    return
                if self._cached_handle(actual) != val:
                    raise Mismatch(f"operator {j}: a constant (weight) changed or was replaced")
                return
            if kind == "i":
                if isinstance(actual, RemoteTensor) and actual._pending is not None:
                    raise Mismatch(f"operator {j}: an input is now computed inside the sequence")
                want = spec.seq.input_metas[val]
                if spec.seq.size_ops:      # an input whose shape is a size of this frame
                    try:
                        want = resolve_sizes(want, spec.sizes)
                    except (KeyError, IndexError, ValueError):
                        raise Mismatch(f"operator {j}: input {val}'s size is not known yet") from None
                if wire.tensor_meta(actual) != want:
                    raise Mismatch(f"operator {j}: input {val} has shape {list(actual.shape)} {actual.dtype}")
                prev = spec.inputs.get(val, bind.get(val))
                if prev is not None and prev is not actual and not self._same_view(prev, actual):
                    raise Mismatch(f"operator {j}: input {val} is another tensor than before")
                bind[val] = actual
                return
            raise Mismatch(f"operator {j}: unknown reference {kind}")
        if isinstance(expected, dict) and len(expected) == 1 and "l" in expected:
            if not isinstance(actual, (list, tuple)) or len(actual) != len(expected["l"]):
                raise Mismatch(f"operator {j}: a list argument differs")
            for e, a in zip(expected["l"], actual):
                self._match(e, a, spec, bind, j)
            return
        if isinstance(expected, dict) and len(expected) == 1 and isinstance(expected.get("z"), list):
            if _size_matches(spec, expected["z"], actual):
                return
            raise Mismatch(f"operator {j}: {str(actual)[:20]} is not the size operator "
                           f"{expected['z'][0]} returned in this frame")
        if isinstance(actual, torch.Tensor):
            raise Mismatch(f"operator {j}: a tensor where the record has a value")
        enc = wire.encode(actual, lambda t: None)
        if enc != expected:
            raise Mismatch(f"operator {j}: argument {str(enc)[:40]} differs from the record {str(expected)[:40]}")

    def _flush(self, why: str, want: Optional[RemoteTensor] = None, sync_op: Optional[int] = None):
        """Send the matched but unsent operators of the speculation as one replay (or use
        the early replay's reply, when it covers what the program holds)."""
        spec = self._spec
        if spec is None:
            return None
        if spec.early is not None and self._settle_early(spec, want, sync_op):
            return None
        if spec.pos == spec.sent:
            return None
        seq = spec.seq
        alive = self._alive_proxies(spec)
        keep = sorted(alive)
        prefetch = set(map(tuple, seq.prefetch))
        fetch = [key for key in keep if key in prefetch or (want is not None and alive[key] is want)]
        body, uploads = self._replay_body(spec, spec.pos, keep, fetch,
                                          [sync_op] if sync_op is not None else [])
        result, response = self._send(body, uploads)
        self._apply_replay(spec, result, response, alive, fetch)
        if spec.pos == seq.n_ops and sync_op is None and want is None and spec.sent == spec.pos:
            # What the program holds at the end, including outputs handed over at a sync
            # point before: what the next early replay keeps.
            held = {key for key, r in spec.proxies.items() if r() is not None}
            seq.early_keep = sorted(set(keep) | held | prefetch)
        if sync_op is not None:
            return result["replay"]["rets"].get(str(sync_op))
        return None

    @staticmethod
    def _alive_proxies(spec) -> dict:
        """(j, k) -> proxy of the sequence's outputs the program still holds, unsent."""
        alive = {key: r() for key, r in spec.proxies.items()}
        return {key: p for key, p in alive.items() if p is not None and p._pending is not None}

    def _replay_body(self, spec, upto: int, keep, fetch, sync_ops=()):
        """The ``replay`` request for operators ``spec.sent`` .. ``upto``-1 (and its uploads:
        the fresh inputs not sent yet); ``sync_ops``: the operators whose return values the
        reply must carry."""
        seq = spec.seq
        uploads: List[tuple] = []
        inputs = []
        for idx, t in sorted(spec.inputs.items()):
            if idx in spec.inputs_sent:
                continue
            if isinstance(t, RemoteTensor):
                inputs.append([idx, {"h": t.handle}])
            else:
                inputs.append([idx, self._input_ref(seq, idx, t, uploads)])
            spec.inputs_sent.add(idx)
        if upto == seq.n_ops:
            # Inputs the program has not produced yet: an early replay predicts those whose
            # content repeated (the server still has it); the robot checks them when they come.
            for idx in range(len(seq.input_metas)):
                if idx not in spec.inputs and idx not in spec.inputs_sent:
                    h = self._stable_handle(seq, idx)
                    if h is not None:
                        inputs.append([idx, {"h": h}])
                        spec.inputs_sent.add(idx)
                        spec.predicted[idx] = seq.input_digests[idx]
        body = {"replay": {"id": seq.seq_id, "from": spec.sent, "n": upto, "inputs": inputs,
                           "keep": [list(k) for k in keep], "fetch": [list(k) for k in fetch],
                           "sync": list(sync_ops)}}
        if seq.seq_id not in self._defined:
            body["define"] = {"id": seq.seq_id, "ops": seq.ops, "n_inputs": len(seq.input_metas)}
            self._defined.add(seq.seq_id)
        return body, uploads

    def _stable_digest(self, t) -> Optional[str]:
        if isinstance(t, RemoteTensor) or t.numel() * t.element_size() > STABLE_MAX_BYTES:
            return None
        return self._digest(t)

    def _input_ref(self, seq, idx: int, t: torch.Tensor, uploads: list) -> dict:
        """The reference of fresh input ``idx`` of ``seq`` in a replay request. Its content
        digest is compared with the previous replay's: content that repeats (RetinaNet's
        anchors and box-coder constants are rebuilt by the program every frame, after the
        first sync point) is kept on the server under one robot tensor of that content,
        uploaded once, so that the next early replay can name it before the program has
        built it again (:meth:`_stable_handle`).

        An input that changed in :data:`VOLATILE_AFTER` replays in a row (a camera frame)
        is digested only every :data:`VOLATILE_RECHECK` replays: the digest (a sha256 of
        the frame, 1-2 ms a megabyte on the robot) sits before the early replay can leave,
        and a frame never repeats."""
        changes = seq.input_changes.get(idx, 0)
        if changes >= VOLATILE_AFTER and changes % VOLATILE_RECHECK:
            seq.input_changes[idx] = changes + 1
            seq.input_digests[idx] = None
            return self._upload_ref(t, uploads)
        d = self._stable_digest(t)
        stable = d is not None and seq.input_digests.get(idx) == d
        seq.input_digests[idx] = d
        seq.input_changes[idx] = 0 if stable else changes + 1
        if not stable:
            return self._upload_ref(t, uploads)
        keeper = self._stable.get(d)
        if keeper is None:
            # a private copy: the program may write into its own tensor behind torch's back
            keeper = t.detach().clone()
            keeper._ro_private = True
            self._stable[d] = keeper
            while len(self._stable) > STABLE_MAX_INPUTS:
                self._stable.popitem(last=False)   # its upload is released when it dies
        self._stable.move_to_end(d)
        return self._upload_ref(keeper, uploads)

    def _stable_handle(self, seq, idx: int) -> Optional[int]:
        """The server handle of input ``idx``'s content when it repeated in the last two
        replays and is still kept; else None."""
        d = seq.input_digests.get(idx)
        keeper = self._stable.get(d) if d is not None else None
        return self._cached_handle(keeper) if keeper is not None else None

    def _apply_replay(self, spec, result, response, alive: dict, fetch) -> None:
        """Hand the reply's handles and values to the proxies the program holds."""
        self.stats.replays += 1
        spec.sent = spec.pos
        for j, k, h in result["replay"]["kept"]:
            p = alive.get((j, k))
            if p is not None:
                p._cell[0] = h
                p._pending = None
            else:  # kept for a proxy the program has dropped meanwhile
                self._releases.append(h)
        for key, enc in zip(fetch, response.tensors):
            p = alive.get(key)
            if p is not None:
                value = codec.decode(enc)
                if value.numel() == p.numel():
                    p._value = self._to_robot(value, p)
                else:   # a stand-in of a sized operator: the proxy that replaces it takes it
                    p._fetched = value

    def _send_early(self, spec) -> None:
        """Send the whole sequence now, on the worker thread (see the module docstring)."""
        seq = spec.seq
        spec.early_fetch = sorted(set(map(tuple, seq.prefetch)))
        spec.early_keep = sorted(set(map(tuple, seq.early_keep or ())) | set(spec.early_fetch))
        body, uploads = self._replay_body(spec, seq.n_ops, spec.early_keep, spec.early_fetch,
                                          [j for j in seq.answered_ops if j >= spec.pos])
        if self._early_sender is None:
            self._early_sender = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="rr-early-replay")
        if self._releases:
            body["release"], self._releases = self._releases, []
        spec.early = self._early_sender.submit(self._send, body, uploads, take_releases=False)
        if self.stats.inferences:
            cur = self.stats.inferences[-1]
            cur.mark("early_sent_ms")
            spec.early.add_done_callback(lambda _f, cur=cur: cur.mark("reply_ms"))

    def _settle_early(self, spec, want=None, sync_op=None) -> bool:
        """Wait for the early replay's reply. True when it answers the flush: the whole
        sequence matched, no value or sync result is asked for, and the program holds only
        outputs the reply kept. Otherwise release what it kept and make the next replay
        start from the first operator again (False)."""
        if self.stats.inferences and spec.pos == spec.seq.n_ops:   # not a value asked mid-way
            self.stats.inferences[-1].mark("checks_end_ms")
        result, response = self._early_reply(spec)
        if result is None:
            return False
        alive = self._alive_proxies(spec)
        at_end = spec.pos == spec.seq.n_ops and want is None and sync_op is None
        if at_end and set(alive) <= set(spec.early_keep) and not spec.early_stale:
            spec.early = None
            self._apply_replay(spec, result, response, alive, spec.early_fetch)
            self.stats.early_replays += 1
            spec.seq.early_misses = 0
            return True
        self._drop_early(spec, result)
        return False

    def _early_reply(self, spec):
        """The early replay's (result, response); (None, None) when the server refused it
        (the early request is then dropped). A request refused with BAD_REQUEST ran past a
        sync point into operators the data made invalid (an index beyond a size the record
        did not foresee); anything else (a lost server, a stale session) is the program's
        error as for any other request."""
        try:
            return spec.early.result()  # _send's own deadline bounds the wait
        except RemoteError as e:
            if e.code != StatusCode.BAD_REQUEST:
                spec.early = None
                raise
            log.info("early replay refused (%s); replaying as the program goes", e)
            self.stats.early_refused += 1
            self._drop_early(spec, None)
            return None, None

    def _drop_early(self, spec, result) -> None:
        """Give up the early reply: release what it kept; the next replay starts from the
        first operator again. (At the end of the sequence, the replay _flush sends next
        records what the program holds as the sequence's early_keep.)"""
        spec.early = None
        spec.seq.early_misses += 1
        if result is not None:
            self._releases.extend(h for _, _, h in result["replay"]["kept"])
        spec.sent = 0
        spec.inputs_sent.clear()
        spec.predicted.clear()
        spec.early_stale = False
        self.stats.early_dropped += 1

    def _early_sync_result(self, spec, j: int, ret):
        """The return value of sync operator ``j`` from the early replay's reply, when its
        shapes are the recorded ones; else None, with the early reply dropped (the caller
        replays up to ``j`` as without early replay). The early request ran the whole
        sequence with the record's arguments; while every later call and sync result
        matches the record, the program is exactly what the server ran."""
        result, _ = self._early_reply(spec)
        if result is None:
            return None
        if spec.early_stale:
            self._drop_early(spec, result)
            return None
        actual = result["replay"]["rets"].get(str(j))
        if actual is not None and _same_shapes(actual, ret):
            self.stats.early_sync_answers += 1
            return actual
        self._drop_early(spec, result)
        return None

    def _diverge(self, why: str) -> None:
        spec = self._spec
        if spec is None:
            return
        self._flush(why)
        self._spec = None
        self._note_divergence(spec, why)

    @property
    def not_static(self) -> bool:
        """True once inferences keep differing (3 times without an identified sequence):
        the program's operator sequence is not static and it runs op by op."""
        return not self.recorder.sequences and max(self.recorder.differing.values(), default=0) >= 3

    def frame_phase(self, n_before: int, divergences_before: int) -> str:
        """The phase of one frame (one or more inferences through this session), given
        ``len(self.stats.inferences)`` and ``self.stats.divergences`` taken before it:
        ``"transparent"``, ``"fallback"``, ``"replaying"`` or ``"recording"``.

        The precedence says what the frame cost. A divergence during the frame comes first:
        part of the frame ran op by op after a replay had begun, and the sequence was
        dropped, even if the frame then went on to replay another one. The divergence
        counter is the signal, not the records' phases, because a divergence marks the
        latest record, which may predate the frame (a speculation still open at the end of
        the previous frame). Otherwise the frame is ``"replaying"`` only when it began at
        least one inference and every inference it began was answered from a record;
        anything else (a new record, or no new inference at all) is ``"recording"``.
        """
        if self.mode == "transparent":
            return "transparent"
        if self.stats.divergences > divergences_before:
            return "fallback"
        new = self.stats.inferences[n_before:]
        if new and all(i.phase == "replaying" for i in new):
            return "replaying"
        return "recording"

    # -- whole results ----------------------------------------------------------------------
    def materialize_tree(self, tree):
        return tree_map(lambda a: self.materialize(a) if isinstance(a, RemoteTensor) else a, tree)


#: Kinds of a compiled argument check (see _compile_check).
_OUT, _CONST, _VALUE, _VALUES, _LIST, _SIZE = "out", "const", "value", "values", "list", "size"


def _compile_arg(e):
    """(kind, wanted) for one recorded argument, or None (the generic match)."""
    if type(e) in _PLAIN_SCALARS or e is None:
        return _VALUE, e
    if isinstance(e, dict) and len(e) == 1 and isinstance(e.get("z"), list):
        return _SIZE, tuple(e["z"])
    if isinstance(e, dict) and len(e) == 1 and "t" in e:
        (kind, val), = e["t"].items()
        if kind == "o":
            return _OUT, tuple(val)
        if kind == "c":
            return _CONST, val
        return None           # an input of the sequence: the generic match binds it
    if isinstance(e, dict) and len(e) == 1 and isinstance(e.get("l"), list):
        if all(type(v) in _PLAIN_SCALARS for v in e["l"]):
            return _VALUES, (list(e["l"]), tuple(type(v) for v in e["l"]))
        items = [_compile_arg(v) for v in e["l"]]
        if all(i is not None and i[0] is not _LIST for i in items):
            return _LIST, items     # a list of tensors (cat, stack, index)
    return None


def _compile_check(op: dict, schema_of):
    """The check of one recorded call that the robot runs on every replay, or None where
    the generic match must do it: (OpOverload, number of positional arguments, [(position,
    kind, wanted)]) with kinds _OUT (a proxy of this speculation's output (j, k)), _CONST (a
    tensor the server holds under handle h: a cached robot upload or a remote constant)
    _VALUE (a plain value, compared by type and equality), _VALUES (a list of them: its
    element types, then equality) and _LIST (a list of such checks: the tensors of cat,
    stack or index).

    Only calls with positional arguments alone, at least one _OUT argument (so the call is
    remote in any case) and only _OUT arguments in the positions the operator writes (so
    it writes no robot tensor) are compiled. Anything else -- an input of the sequence, a
    keyword argument, a nested or special value -- goes to the generic match, which is
    slower and gives the divergence its message."""
    if op["k"]:
        return None
    try:
        func = wire.resolve_op(op["op"])
    except wire.WireError:
        return None
    a_tree = op["a"]      # the positional arguments, as the list node {"l": [...]}
    if not (isinstance(a_tree, dict) and len(a_tree) == 1 and isinstance(a_tree.get("l"), list)):
        return None
    hidden = HIDDEN_WRITES.get(_short_name(func))
    if hidden is not None and (len(a_tree["l"]) <= hidden[0][0] or a_tree["l"][hidden[0][0]] is not False):
        return None      # recorded writing (or unknown): the generic path decides each time
    checks, has_out = [], False
    for pos, e in enumerate(a_tree["l"]):
        compiled = _compile_arg(e)
        if compiled is None:
            return None
        kind, want = compiled
        checks.append((pos, kind, want))
        has_out = has_out or kind is _OUT or (kind is _LIST and any(k is _OUT for k, _ in want))
    written = {i for i, _ in schema_of(func)[0]}
    kinds = {pos: kind for pos, kind, _ in checks}
    if not has_out or any(kinds.get(i) is not _OUT for i in written):
        return None
    return func, len(a_tree["l"]), checks


def _size_matches(spec, symbol, a) -> bool:
    """Whether int ``a`` is what size symbol (op, i[, factor]) stands for in this frame."""
    known = spec.sizes.get(symbol[0])
    return (type(a) is int and known is not None and symbol[1] < len(known)
            and a == known[symbol[1]] * (symbol[2] if len(symbol) > 2 else 1))


#: Operators that write arguments their schema does not mark ``(a!)``: name -> (the flag
#: argument under which they write, the arguments written). Batch norm in training mode
#: updates ``running_mean`` and ``running_var`` in place (test-time adaptation).
HIDDEN_WRITES = {
    name: ((5, flag), [(3, "running_mean"), (4, "running_var")])
    for name, flag in (("native_batch_norm", "training"), ("batch_norm", "training"),
                       ("_batch_norm_impl_index", "training"), ("cudnn_batch_norm", "training"),
                       ("miopen_batch_norm", "training"), ("instance_norm", "use_input_stats"))
}
#: Random operators that overwrite their first argument without reading its values.
_RANDOM_FILLS = frozenset({"bernoulli_", "normal_", "uniform_", "random_", "exponential_",
                           "geometric_", "cauchy_", "log_normal_"})


_short_names: Dict[object, str] = {}


def _short_name(func) -> str:
    """``native_batch_norm`` for ``aten.native_batch_norm.default``."""
    name = _short_names.get(func)
    if name is None:
        name = _short_names[func] = func._schema.name.split("::")[-1]
    return name


def _hidden_writes(func, args, kwargs) -> list:
    """The (position, name) of arguments ``func`` writes without its schema saying so."""
    spec = HIDDEN_WRITES.get(_short_name(func))
    if spec is None:
        return []
    (i, flag), written = spec
    on = args[i] if i < len(args) else kwargs.get(flag)
    return list(written) if on else []


#: Random operators that draw nothing when a flag is off (dropout in eval mode): name ->
#: (position, name) of the flag.
_RANDOM_ONLY_IF = {"dropout": (2, "train"), "feature_dropout": (2, "train"),
                   "alpha_dropout": (2, "train"), "feature_alpha_dropout": (2, "train"),
                   "native_dropout": (2, "train"), "rrelu": (3, "training"),
                   "rrelu_with_noise": (4, "training")}
_random_cache: Dict[object, bool] = {}


def _is_random(func, args, kwargs) -> bool:
    """Whether this call of ``func`` draws random numbers (a ``Generator?`` argument, or
    the ``nondeterministic_seeded`` tag; dropout only in training): it must draw from the
    program's generator."""
    random = _random_cache.get(func)
    if random is None:
        random = _random_cache[func] = (
            torch.Tag.nondeterministic_seeded in func.tags
            or any(str(a.type).startswith("Generator") for a in func._schema.arguments))
    if random:
        flag = _RANDOM_ONLY_IF.get(_short_name(func))
        if flag is not None:
            i, name = flag
            on = args[i] if i < len(args) else kwargs.get(name, False)
            return bool(on)
    return random


def _content_check(t: torch.Tensor):
    """What :func:`_content_same` compares later to know that ``t``'s bytes are still the
    ones uploaded now: a copy of them up to :data:`SNAPSHOT_MAX_BYTES` (a copy and a
    comparison cost about 0.1 ms each for a 1x3x224x224 float frame), else their sha256
    (about 1 ms for the same frame, 1-2 ms a megabyte)."""
    if t.numel() * t.element_size() <= SNAPSHOT_MAX_BYTES:
        return _bytes_of(t).copy()
    return content_digest(t)


def _content_same(t: torch.Tensor, check) -> bool:
    if isinstance(check, str):
        return content_digest(t) == check
    return numpy.array_equal(_bytes_of(t), check)


def _bytes_of(t: torch.Tensor):
    """A tensor's bytes as a flat uint8 numpy array (no copy when it is contiguous)."""
    if not t.requires_grad and t.is_contiguous():
        try:     # the short way (a few microseconds less for the many small buffers)
            return t.numpy().reshape(-1).view(numpy.uint8)
        except (TypeError, RuntimeError):
            pass     # no numpy dtype (bfloat16), a conjugate view: through torch
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()


def _trusted(t: torch.Tensor) -> bool:
    """Weights and the session's private copies: changed only through torch operators."""
    return isinstance(t, torch.nn.Parameter) or getattr(t, "_ro_private", False)


_HOOKS_INSTALLED = False


def _install_hooks() -> None:
    """Keep ``nn.Parameter`` data on the robot and make ``.data =`` visible to the upload
    cache. A module conversion (``model.half()``) computes each new weight with an
    operator that reads a weight, which runs on the server, and stores the result with
    ``param.data = new``; a fusion (``conv.weight = nn.Parameter(w * scale)``) wraps one.
    A weight must hold robot memory (the program reads and writes it), so a proxy
    stored there is downloaded first. ``.data =`` keeps the version counter: the
    assignment also counts in ``_ro_data_epoch`` (see RemoteSession._stamp)."""
    global _HOOKS_INSTALLED
    if _HOOKS_INSTALLED:
        return
    _HOOKS_INSTALLED = True
    base_data = torch._C.TensorBase.data

    def get_data(self):
        return base_data.__get__(self)

    def set_data(self, value):
        if isinstance(value, RemoteTensor):
            value = value._session.materialize(value)
        base_data.__set__(self, value)
        try:
            self._ro_data_epoch = getattr(self, "_ro_data_epoch", 0) + 1
        except AttributeError:
            pass
    torch.Tensor.data = property(get_data, set_data, doc=base_data.__doc__)

    param_new = torch.nn.Parameter.__new__

    def new_parameter(cls, data=None, requires_grad=True):
        if isinstance(data, RemoteTensor):
            data = data._session.materialize(data)
        return param_new(cls, data, requires_grad)
    torch.nn.Parameter.__new__ = staticmethod(new_parameter)

def _storage_ptr(t: torch.Tensor) -> int:
    """The address of ``t``'s storage (shared by its views); its id where it has none
    (sparse and other layouts, which are not uploaded)."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return id(t)


def _version_of(t: torch.Tensor) -> int:
    """The tensor's in-place version counter; inference tensors have none (-1): they can
    only be modified inside inference mode, where the change is not seen."""
    try:
        return t._version
    except RuntimeError:
        return -1


def _same_shapes(actual, recorded) -> bool:
    """Whether two return trees hold tensors of the same shapes and dtypes, in order."""
    def shapes(tree):
        return [(m.get("s"), m.get("d")) for m in _metas_in(tree)]
    return shapes(actual) == shapes(recorded)


def _single_new_tensor(ret):
    """The meta of a return tree that is one new tensor (not one of the call's inputs), or
    None (any other return: the generic decoding)."""
    if type(ret) is dict and len(ret) == 1:
        meta = ret.get("t")
        if meta is not None and "a" not in meta:
            return meta
    return None


def _metas_in(tree) -> list:
    """The tensor metas of a return tree, depth first (no recursive closure: see
    _decode_return)."""
    out = []
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, dict) and len(node) == 1 and "t" in node:
            out.append(node["t"])
        elif isinstance(node, dict) and len(node) == 1 and "l" in node:
            stack.extend(reversed(node["l"]))
    return out


def _ingredient(a):
    """A call argument as a recipe holds it: a proxy becomes its own recipe's output, or
    its downloaded values; a proxy with neither stays a proxy (then no recipe is made)."""
    if type(a) is RemoteTensor:
        if a._recipe is not None:
            return _Ingredient(a._recipe)
        return a if a._value is None else a._value
    return a


class _Ingredient:
    """A recipe argument: output ``k`` of another recipe."""
    __slots__ = ("ref",)

    def __init__(self, ref):
        self.ref = ref


class _Recipe:
    """One intercepted call, replayable on the robot (see ``_attach_recipe``)."""
    __slots__ = ("func", "args", "kwargs", "__weakref__")

    def __init__(self, func, args, kwargs):
        self.func, self.args, self.kwargs = func, args, kwargs

    def evaluate(self, memo: dict) -> list:
        """The call's tensor outputs, recomputed on the robot (shared ancestors once)."""
        hit = memo.get(id(self))
        if hit is not None:
            return hit[1]

        def value(a):
            if isinstance(a, _Ingredient):
                recipe, k = a.ref
                return recipe.evaluate(memo)[k]
            return a
        args, kwargs = tree_map(value, (self.args, self.kwargs),
                                is_leaf=lambda a: isinstance(a, _Ingredient))
        out = self.func(*args, **kwargs)
        tensors = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        memo[id(self)] = (self, tensors)
        return tensors


def _status_of(response):
    return response.status, response.status_text
