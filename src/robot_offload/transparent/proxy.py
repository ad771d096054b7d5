"""Proxies of server tensors and the hooks that keep them out of the program's weights.

A :class:`RemoteTensor` stands in for a tensor the server holds: shape, strides and dtype,
no storage; the few Tensor methods that need values download them. :class:`Interceptor`
routes every aten operator of a thread to its session. :func:`_install_hooks` keeps
``nn.Parameter`` data in robot memory, makes ``.data =`` visible to the upload cache and
tells the session whether an operator runs inside a module's forward
(:func:`in_module_forward`).
"""

import threading
import time
import weakref
from typing import TYPE_CHECKING

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode, _pop_mode, _push_mode

from robot_offload.transparent import wire

if TYPE_CHECKING:
    from robot_offload.transparent.session import RemoteSession


#: Tensor methods that need the values on the robot.
_MATERIALIZING = frozenset({"numpy", "tolist", "__array__", "__repr__", "__format__", "cpu",
                            "__reduce_ex__", "data_ptr", "untyped_storage", "storage",
                            "__dlpack__", "pin_memory", "__deepcopy__"})


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


_HOOKS_INSTALLED = False
_FORWARD = threading.local()


def in_module_forward() -> bool:
    """Whether this thread is inside an ``nn.Module`` call (its forward and hooks).

    Outside one, a program loads, converts and fuses its weights (``model.float()``,
    ``fuse()``): work whose results the robot keeps as weights, so it runs on the robot
    rather than round-tripping every weight through the server. A forward that raised
    still leaves (the hook is called always); were the count ever left high, operators on
    weights would only go back to running on the server."""
    return getattr(_FORWARD, "depth", 0) > 0


class _ForwardWatch:
    """One inference's module calls in one thread, from the first module-call boundary
    after its first operator until its outermost module call returns, or until the module
    it began in is called again (the program's next inference began inside a module that
    is still running: a loop wrapped in one). The session is told the region's wall time
    (:meth:`~robot_offload.transparent.robot_choice.RobotChoiceMixin._forward_region_ended`).
    With ``suspend``, the thread's :class:`Interceptor` is off its dispatch stack for the
    region: its operators run as in a plain program (the robot computes the inference)."""

    __slots__ = ("session", "restart_module", "suspend", "mode", "started_s")

    def __init__(self, session, restart_module, suspend: bool):
        self.session, self.restart_module, self.suspend = session, restart_module, suspend
        self.mode = None            # the interceptor taken off the stack while suspended
        self.started_s = None       # perf_counter at the region's start (None: not yet)

    def start(self) -> None:
        self.session._forward_region_started()
        if self.suspend:
            top = _get_current_dispatch_mode()
            if isinstance(top, Interceptor) and top.session is self.session:
                self.mode = _pop_mode()     # (another mode above it: stay intercepted)
        self.started_s = time.perf_counter()

    def end(self) -> None:
        if self.started_s is None:
            return
        elapsed_s = time.perf_counter() - self.started_s
        if self.mode is not None:
            _push_mode(self.mode)
            self.mode = None
        self.session._forward_region_ended(elapsed_s)


def watch_forward(session, suspend: bool) -> bool:
    """At an inference's first operator (inside the session's dispatch): time the rest of
    its module calls in this thread as one region (:class:`_ForwardWatch`), and with
    ``suspend`` run them without interception. A region still open in this thread ends
    first. False (nothing watched) outside any module call."""
    end_forward_watch()
    if getattr(_FORWARD, "depth", 0) == 0:
        return False
    _FORWARD.watch = _ForwardWatch(session, getattr(_FORWARD, "module", None), suspend)
    return True


def end_forward_watch() -> None:
    """End this thread's forward region now, if one is open or pending."""
    watch = getattr(_FORWARD, "watch", None)
    if watch is not None:
        _FORWARD.watch = None
        watch.end()


def interception_suspended() -> bool:
    """Whether this thread runs a region of module calls without its interceptor."""
    watch = getattr(_FORWARD, "watch", None)
    return watch is not None and watch.mode is not None


def _entering_forward(module, args):
    watch = getattr(_FORWARD, "watch", None)
    if watch is not None:
        if watch.started_s is None:
            watch.start()
        elif module is watch.restart_module:
            end_forward_watch()
    _FORWARD.depth = getattr(_FORWARD, "depth", 0) + 1
    _FORWARD.module = module


def _leaving_forward(module, args, result):
    _FORWARD.depth = depth = max(0, getattr(_FORWARD, "depth", 0) - 1)
    watch = getattr(_FORWARD, "watch", None)
    if watch is not None:
        if depth == 0:
            end_forward_watch()
        elif watch.started_s is None:
            watch.start()


def _install_hooks() -> None:
    """Keep ``nn.Parameter`` data on the robot and make ``.data =`` visible to the upload
    cache. A module conversion (``model.half()``) stores each new weight with
    ``param.data = new``; a fusion (``conv.weight = nn.Parameter(w * scale)``) wraps one.
    Outside a module's forward the operators computing them run on the robot
    (:func:`in_module_forward`); inside one, or on server tensors, on the server, and the
    new weight is then a proxy. A weight must hold robot memory (the program reads and
    writes it), so a proxy stored there is downloaded first. ``.data =`` keeps the version counter: the assignment also counts in
    ``_ro_data_epoch`` (see UploadsMixin._stamp). Global module hooks count the module
    calls each thread is in."""
    global _HOOKS_INSTALLED
    if _HOOKS_INSTALLED:
        return
    _HOOKS_INSTALLED = True
    from torch.nn.modules import module as nn_module
    nn_module.register_module_forward_pre_hook(_entering_forward)
    nn_module.register_module_forward_hook(_leaving_forward, always_call=True)
    # torch 2.1 (JetPack 5) names the C tensor base class _TensorBase
    base_data = getattr(torch._C, "TensorBase", None) or torch._C._TensorBase
    base_data = base_data.data

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
