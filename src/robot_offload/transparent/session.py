"""Robot side of transparent offloading: operator interception, proxies, record and replay.

:class:`~robot_offload.transparent.proxy.Interceptor` is a ``TorchDispatchMode``: while it
is active, every aten operator the program calls reaches :meth:`RemoteSession.dispatch` --
the Python counterpart of the paper's LD_PRELOAD shim around the CUDA runtime. An operator
runs on the server when one of its tensors already lives there (a
:class:`~robot_offload.transparent.proxy.RemoteTensor` proxy) or is a model weight
(``nn.Parameter``) read inside a module's forward -- what a CUDA program would have put
on the GPU; the program's own tensor work (building the input, bookkeeping, factories,
and loading, converting or fusing weights outside any forward) runs on the robot as
before, and its results are uploaded when an offloaded operator reads them. Views of robot tensors
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
weight never holds a proxy. :func:`~robot_offload.transparent.threads.follow_threads` extends interception to the threads
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

Where each part lives: :mod:`~robot_offload.transparent.proxy` (proxies, the interceptor,
the weight hooks), :mod:`~robot_offload.transparent.threads` (interception of the
program's threads), :mod:`~robot_offload.transparent.uploads` (the upload cache),
:mod:`~robot_offload.transparent.remote_calls` (requests, replies, downloads),
:mod:`~robot_offload.transparent.fallback` (robot-side execution, recipes),
:mod:`~robot_offload.transparent.replay` (recording, speculation, matching),
:mod:`~robot_offload.transparent.replay_requests` (replay and early replay requests) and
:mod:`~robot_offload.transparent.stats`. This module composes them into
:class:`RemoteSession`: its life cycle, the dispatch of each operator, server loss.
"""

import concurrent.futures
import contextlib
import logging
import threading
import time
import uuid
from collections import OrderedDict
from typing import Dict, List, Optional

import torch
from torch.utils._pytree import tree_map

from robot_offload import compat
from robot_offload.errors import Incompatible, OffloadError, OffloadTimeout, RemoteError, TransportError
from robot_offload.protocol import ComputeRequest, PingRequest, StatusCode, raise_for_status
from robot_offload.transparent import allowlist, wire
from robot_offload.transparent.fallback import HIDDEN_WRITES, FallbackMixin, _is_random, _short_name
from robot_offload.transparent.proxy import (Interceptor, RemoteTensor, _install_hooks, end_forward_watch,
                                              in_module_forward, interception_suspended)
from robot_offload.transparent.recorder import Recorder
from robot_offload.transparent.remote_calls import RemoteCallsMixin, _status_of
from robot_offload.transparent.replay import ReplayMixin, _Speculation
from robot_offload.transparent.replay_requests import ReplayRequestsMixin
from robot_offload.transparent.robot_choice import RobotChoiceMixin
from robot_offload.transparent.stats import SessionStats
from robot_offload.transparent.uploads import UploadsMixin
from robot_offload.transparent.wire import ENTRY

log = logging.getLogger(__name__)

#: ``auto``: record_replay, each inference of an identified sequence on the robot or the
#: server, whichever measured faster (:mod:`~robot_offload.transparent.robot_choice`)
MODES = ("transparent", "record_replay", "auto")

_current: "Optional[RemoteSession]" = None


class RemoteSession(UploadsMixin, RemoteCallsMixin, FallbackMixin, ReplayMixin,
                    ReplayRequestsMixin, RobotChoiceMixin):
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
        self._init_robot_choice(mode == "auto")
        self.client_id = client_id or "transparent-" + uuid.uuid4().hex[:8]
        self.timeout_s = timeout_s
        self.deadline = None              # absolute perf_counter deadline of a frame (backends
                                          # set it; it replaces timeout_s for each call)
        self.output_codec = output_codec
        self.stats = SessionStats()
        self.frame_stats = None           # a FrameStats to account calls into, if any
        self._lock = threading.RLock()
        self._schema_cache: Dict[object, tuple] = {}
        self._static_cache: Dict[tuple, bool] = {}
        self._allowed_cache: Dict[object, bool] = {}
        #: operators the server would read differently (robot_offload.compat.op_refusals)
        #: -> why: never sent; Incompatible is raised, or with local_fallback they run on
        #: the robot
        self.refused_ops: Dict[str, str] = {}
        self._refusals_logged = set()
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
        # Weights by content (see UploadsMixin._weight_handle): what makes two robot weights
        # one server tensor -> its handle; handle -> live robot weights using it; handles
        # of weights no robot tensor uses any more, kept (bytes) for a model built again.
        self._weight_handles: Dict[tuple, int] = {}
        self._handle_users: Dict[int, int] = {}
        self._dropped_weights: "OrderedDict[int, int]" = OrderedDict()
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
        end_forward_watch()           # its interceptor back on the stack, if suspended
        self._mode_ctx.__exit__(*exc)
        _current = self._prev
        return False

    # -- the interception point ----------------------------------------------------------
    def dispatch(self, func, args, kwargs):
        if self._choosers is None:
            return self._dispatch(func, args, kwargs)
        with self._lock:
            return self._timed_call(self._dispatch_auto, func, args, kwargs)

    def _dispatch_auto(self, func, args, kwargs):
        if self._on_robot_run() and (self.down.is_set() or interception_suspended()
                                     or not self._starts_sequence(func, args, kwargs)):
            return self._run_on_robot(func, args, kwargs)
        return self._dispatch(func, args, kwargs)

    def materialize(self, t):
        if self._choosers is None:
            return super().materialize(t)
        return self._timed_call(super().materialize, t)

    def _dispatch(self, func, args, kwargs):
        with self._lock:
            spec = self._spec
            # The record and the speculation follow one thread (see _follows_thread); the
            # operators of any other go one by one.
            own = self.mode == "transparent" or self._follows_thread()
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
                if not remote and (self._schema(func)[4] or not in_module_forward()
                                   or not any(isinstance(a, torch.nn.Parameter) for a in flat)):
                    # Robot tensors only and no weight: the program's own work (building the
                    # input, bookkeeping) stays on the robot; so does work on weights outside
                    # a module's forward (loading, converting, fusing them: the robot keeps
                    # the results as weights); and a view of a weight stays a view of robot
                    # memory (programs write through them: YOLO's bias initialisation).
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
                if self.mode != "transparent":
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
        in ``ops_not_allowed`` (and ``ops_local``), logged once per operator. One whose
        schema differs on the server (:attr:`refused_ops`) raises Incompatible, or with
        ``local_fallback`` runs on the robot (``ops_refused``, logged once)."""
        allowed = self._allowed_cache.get(func)
        if allowed is None:
            allowed = self._allowed_cache[func] = allowlist.is_allowed(func)
            if not allowed:
                log.warning("%s is not on the server's allow-list: it runs on the robot",
                            wire.op_name(func))
        if not allowed:
            self.stats.ops_not_allowed += 1
            return False
        if self.refused_ops:
            why = self.refused_ops.get(wire.op_name(func))
            if why is not None:
                if not self.local_fallback:
                    raise Incompatible(StatusCode.INCOMPATIBLE, why)
                if why not in self._refusals_logged:
                    self._refusals_logged.add(why)
                    log.error("%s; it runs on the robot", why)
                self.stats.ops_refused += 1
                return False
        return True

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

    # -- server loss (local_fallback) --------------------------------------------------
    def _server_lost(self, error) -> None:
        """Forget the server's state, compute on the robot, probe in the background."""
        self.last_error = f"{type(error).__name__}: {error}"
        hint = ""
        if isinstance(error, OffloadTimeout):
            hint = (f"; if the server is only slow (a CPU server, a large model: a replay is a whole "
                    f"inference in one request), raise timeout_s (now {self.timeout_s:g} s)")
        log.warning("offload server lost (%s): computing on the robot until it answers again%s",
                    self.last_error, hint)
        self.stats.server_losses += 1
        self._spoil_timed()
        if self.stats.inferences:
            self.stats.inferences[-1].server_lost = True
        self._spec = None
        self.reset()
        self.down.set()
        if self._prober is None or not self._prober.is_alive():
            self._prober = threading.Thread(target=self._probe, name="transparent-prober", daemon=True)
            self._prober.start()

    def connect(self, timeout_s: float) -> None:
        """For a ``local_fallback`` session (the launcher): exchange versions with the
        server (:meth:`hello`); one that cannot be reached is probed in the background
        while the program starts on the robot. Raises Incompatible for a server of another
        protocol."""
        try:
            self.hello(timeout_s)
        except Incompatible:
            raise
        except (TransportError, RemoteError) as e:
            self._server_lost(e)

    def hello(self, timeout_s: float) -> None:
        """Exchange versions with the server (:mod:`robot_offload.compat`) through
        ``call`` (a ping): sets :attr:`refused_ops`. Raises Incompatible for a server of
        another protocol, TransportError / RemoteError when it does not answer."""
        mine = compat.local_versions()
        response = self._call(PingRequest(client_id=self.client_id, versions_json=mine.to_json()),
                              timeout_s)
        raise_for_status(*_status_of(response))
        server = compat.checked_server_versions(mine, response.versions_json)
        refused = compat.op_refusals(mine, server)
        if refused and refused != self.refused_ops:
            log.warning("the server runs torch %s, the robot torch %s: %d operators whose schemas "
                        "differ run on the robot: %s", server.torch, mine.torch, len(refused),
                        ", ".join(sorted(refused)))
        self.refused_ops = refused

    def _probe(self) -> None:
        while self.down.is_set():
            time.sleep(self.retry_interval_s)
            req = ComputeRequest(client_id=self.client_id, model="", entry=ENTRY,
                                 args_json=wire.request_json({}), session=self.session_id)
            try:
                self.hello(max(self.retry_interval_s, 0.5))
                raise_for_status(*_status_of(self._call(req, max(self.retry_interval_s, 0.5))))
            except Incompatible as e:
                log.error("%s: the program goes on on the robot", e.text)
                return
            except (TransportError, RemoteError):
                continue
            log.info("offload server answers again: offloading from the next operator")
            self.down.clear()

    @contextlib.contextmanager
    def frame(self, stats):
        """Account one frame of the program (one or more inferences through this session)
        in ``stats``, a :class:`~robot_offload.stats.FrameStats`. When the block ends
        without an exception, the frame's last inference is marked as having its outputs
        on the robot, ``stats.phase`` is set (:meth:`frame_phase`) and
        ``stats.extra["transparent"]`` holds the session's counters and, for a replayed
        inference, its timeline. The block ends once the program has its outputs."""
        n_before = self.stats.inferences_total
        divergences_before = self.stats.divergences
        yield
        began = self.stats.inferences_total > n_before
        if began:
            self.stats.inferences[-1].mark("outputs_ms")
        stats.phase = self.frame_phase(n_before, divergences_before)
        extra = {"divergences_total": self.stats.divergences,
                 "sequences_identified": self.stats.sequences_identified,
                 "ops_replayed_total": self.stats.ops_replayed,
                 "not_static": self.not_static}
        if self._choosers is not None and self.last_choice:
            extra["auto"] = self.last_choice
        timeline = self.stats.inferences[-1].timeline() if began else None
        if timeline:
            extra["timeline_ms"] = timeline
        stats.extra["transparent"] = extra

    def frame_phase(self, n_before: int, divergences_before: int) -> str:
        """The phase of one frame (one or more inferences through this session), given
        ``self.stats.inferences_total`` and ``self.stats.divergences`` taken before it:
        ``"transparent"``, ``"fallback"``, ``"replaying"``, ``"robot"`` or ``"recording"``.

        The precedence says what the frame cost. A divergence during the frame comes first:
        part of the frame ran op by op after a replay had begun, and the sequence was
        dropped, even if the frame then went on to replay another one. The divergence
        counter is the signal, not the records' phases, because a divergence marks the
        latest record, which may predate the frame (a speculation still open at the end of
        the previous frame). Otherwise the frame is ``"replaying"`` only when it began at
        least one inference and every inference it began was answered from a record,
        ``"robot"`` (``auto``) when the robot computed every one; anything else (a new
        record, or no new inference at all) is ``"recording"``.
        """
        if self.mode == "transparent":
            return "transparent"
        if self.stats.divergences > divergences_before:
            return "fallback"
        new = self.stats.since(n_before)
        if new and all(i.phase == "replaying" for i in new):
            return "replaying"
        if new and all(i.phase == "robot" for i in new):
            return "robot"
        return "recording"
