"""Running one client-defined operator on the server within its bounds.

Every operator a client names has passed the allow-list (:mod:`robot_offload.transparent.wire`).
Before it runs, its outputs are computed on the ``meta`` device (no memory, no compute),
which gives what the request will cost:

* **bytes**: its new outputs, and the growth of any storage it writes in place
  (``resize_``); an operator whose output size depends on the data (``nonzero``,
  ``masked_select``, ``unique``, ...) has no meta kernel and is charged an upper bound of
  :data:`DATA_DEPENDENT_FACTOR` times its inputs' bytes, then its actual outputs once run;
* **work**: floating-point operations from torch's FLOP formulas (matrix products,
  convolutions, attention), else one per element read or written.

After it runs, outputs of operators that hand out uninitialised memory (``empty*``,
``new_empty*``, a growing ``resize_``) are zeroed: a client never reads what the
allocator held before (another client's tensors, on a shared GPU).

And no operator may write into a tensor the session does not own: registry weights that
an upload named by digest are the server's, shared by every client (:func:`check_writes`).
"""

from typing import Iterable, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from robot_offload.protocol import StatusCode
from robot_offload.server.base import RequestRejected, bad_request
from robot_offload.transparent import wire

#: what an operator raises for arguments it cannot take: the request's fault (BAD_REQUEST)
#: (ArithmeticError: an integer argument past int64 raises OverflowError)
OP_ERRORS = (RuntimeError, ValueError, TypeError, IndexError, NotImplementedError, ArithmeticError)
#: bytes charged, per input byte, to an operator whose output size depends on the data
#: (``nonzero`` of a bool tensor returns up to 8 bytes per dimension per input byte)
DATA_DEPENDENT_FACTOR = 64
#: operators that return memory nobody wrote
UNINITIALISED = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
                           "empty_permuted", "resize_", "resize_as_"})


def op_failed(func, e: Exception) -> RequestRejected:
    return bad_request(f"{wire.op_name(func)} failed: "
                       f"{str(e).splitlines()[0][:300] if str(e) else type(e).__name__}")


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def storage_key(t: torch.Tensor) -> int:
    """Identity of a tensor's storage (stable when ``resize_`` reallocates it)."""
    return t.untyped_storage()._cdata


def to_meta(obj):
    if isinstance(obj, torch.Tensor):
        m = torch.empty_strided(obj.shape, obj.stride(), dtype=obj.dtype, device="meta")
        return m
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_meta(o) for o in obj)
    return obj


def written_tensors(func, args, kwargs) -> list:
    """The tensor arguments the operator's schema says it writes (``Tensor(a!)``)."""
    out = []
    schema = func._schema
    for i, a in enumerate(schema.arguments):
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        v = kwargs.get(a.name) if a.kwarg_only or i >= len(args) else args[i]
        out.extend(t for t in wire.leaves(v) if isinstance(t, torch.Tensor))
    return out


def check_writes(func, written: list, protected: Iterable[int]) -> None:
    """Refuse an operator whose ``written`` tensors (:func:`written_tensors`) share a
    storage in ``protected`` (the server's registry weights)."""
    for t in written:
        if storage_key(t) in protected:
            raise RequestRejected(StatusCode.UNAUTHORIZED, f"{wire.op_name(func)} would write into "
                                  "a weight the server shares with every client")


def _flops(func, meta_args, meta_kwargs, meta_out) -> int:
    """Estimated floating-point operations of one operator on meta tensors: torch's
    formula where it has one (matrix products, convolution, attention), a window's size
    per output for pooling, else one per element read or written. An operator torch
    implements by composing others (``conv2d``, ``linear``, ``einsum``, ``matmul``) is
    decomposed on meta and its parts counted, so none hides its work behind its size."""
    formula = flop_registry.get(func.overloadpacket)
    if formula is not None:
        try:
            return int(formula(*meta_args, **meta_kwargs, out_val=meta_out))
        except Exception:  # noqa: BLE001 - a formula that cannot read these arguments
            pass
    elements = sum(t.numel() for t in wire.leaves((meta_args, meta_kwargs, meta_out))
                   if isinstance(t, torch.Tensor))
    name = func._schema.name.split("::")[-1]
    if "pool" in name:
        return max(elements, _pool_window(name, meta_args, meta_out))
    if func.has_kernel_for_dispatch_key(torch._C.DispatchKey.CompositeImplicitAutograd):
        counter = _Counter()
        try:
            with torch.inference_mode(), counter:
                func.decompose(*meta_args, **meta_kwargs)
        except Exception:  # noqa: BLE001 - no decomposition on meta: count elements
            return elements
        return max(elements, counter.flops)
    return elements


def _pool_window(name, meta_args, meta_out) -> int:
    """Elements read by a pooling operator: each output's window (the kernel, or for
    adaptive pooling the whole input spread over the outputs)."""
    outs = [t for t in wire.leaves(meta_out) if isinstance(t, torch.Tensor)]
    if not outs or not meta_args or not isinstance(meta_args[0], torch.Tensor):
        return 0
    if name.startswith(("adaptive", "_adaptive")):
        return 2 * meta_args[0].numel() + outs[0].numel()
    kernel = meta_args[1] if len(meta_args) > 1 else None
    if isinstance(kernel, int):
        kernel = [kernel]
    area = 1
    for k in kernel or ():
        area *= max(int(k), 1)
    return outs[0].numel() * area


class _Counter(TorchDispatchMode):
    """Counts :func:`_flops` of the operators a decomposition runs on meta."""

    def __init__(self):
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.flops += _flops(func, args, kwargs, out)
        return out


def estimate(func, args, kwargs) -> Tuple[int, int, bool]:
    """(bytes of new memory, floating-point operations, exact) of running ``func`` on these
    arguments, from a run on the meta device. ``exact`` is False when the output size
    depends on the data: the bytes are then an upper bound."""
    meta_args = to_meta(args)
    meta_kwargs = {k: to_meta(v) for k, v in kwargs.items()}
    try:
        _, new, flops = meta_cost(func, meta_args, meta_kwargs)
    except Exception:  # noqa: BLE001 - no meta kernel, or sizes that depend on the data
        read = sum(nbytes(t) for t in wire.leaves((args, kwargs)) if isinstance(t, torch.Tensor))
        return DATA_DEPENDENT_FACTOR * read + 4096, read, False
    return new, flops, True


def meta_cost(func, meta_args, meta_kwargs):
    """(meta outputs, bytes of new memory, floating-point operations) of ``func`` on meta
    arguments; raises what the operator raises on meta (no kernel, data-dependent sizes)."""
    if any(a.name == "device" for a in func._schema.arguments):
        meta_kwargs = dict(meta_kwargs, device=torch.device("meta"))     # factories: no allocation
    before = {storage_key(m): m.untyped_storage().nbytes()
              for m in wire.leaves((meta_args, meta_kwargs)) if isinstance(m, torch.Tensor)}
    with torch.inference_mode():
        out = func(*meta_args, **meta_kwargs)
    new = 0
    seen = set()
    for t in wire.leaves((out, meta_args, meta_kwargs)):
        if not isinstance(t, torch.Tensor):
            continue
        key = storage_key(t)
        if key in seen:
            continue
        seen.add(key)
        new += max(0, t.untyped_storage().nbytes() - before.get(key, 0))   # in place: growth only
    return out, new, _flops(func, meta_args, meta_kwargs, out)


def zero_uninitialised(func, out, written: list, old_sizes: dict) -> None:
    """Zero what an operator returned without writing it (see :data:`UNINITIALISED`);
    ``written`` are the arguments it writes (:func:`written_tensors`), ``old_sizes`` maps
    their storage keys to their bytes before."""
    name = func._schema.name.split("::")[-1]
    if name not in UNINITIALISED:
        return
    if name.startswith("resize"):
        for t in written:
            storage = t.untyped_storage()
            old = old_sizes.get(storage_key(t), 0)
            if storage.nbytes() > old:
                raw = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
                raw[old:].zero_()
        return
    for t in wire.leaves(out):
        if isinstance(t, torch.Tensor):
            torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage()).zero_()
