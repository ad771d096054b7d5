"""A recorded operator sequence (record_replay), compiled once into a slot program that
a replay runs with one Python call per operator."""

from typing import Dict, List

import torch

from robot_offload.server.base import bad_request as _bad
from robot_offload.server.executors.ops.calls import UNINITIALISED
from robot_offload.transparent import allowlist, wire


class Sequence:
    """A defined operator sequence, compiled for replay.

    Replay is the per-frame path of record_replay, and on a GPU server its cost is Python
    per operator (ConvNeXt-T's 184 operators take 4-7 ms a frame on an H100 at batch 1, of
    which its kernels take 1.4 ms). So the JSON is decoded once, here, into a flat
    program: every tensor an operator reads or writes gets an integer slot of one list
    (inputs, the session's tensors, outputs a later operator reads), each operator knows
    which argument positions to fill from which slots and which slots die after it (their
    last use, so memory is freed as in eager), and a replay only copies tensors between
    slots and calls the operators. Nothing is generated or evaluated: the program is data, its
    operators are the allowed OpOverloads :func:`wire.resolve_op` returned."""

    def __init__(self, ops: List[dict], n_inputs: int, device: torch.device):
        self.ops = ops
        self.n_inputs = n_inputs
        self.resolved = [wire.resolve_op(op["op"]) for op in ops]
        self.last_use: Dict[tuple, int] = {}
        self.input_uses: Dict[int, List[int]] = {}
        # the session tensors the sequence reads, in order of first use
        self.const_handles: List[object] = []
        const_index: Dict[tuple, int] = {}
        for j, op in enumerate(ops):
            for ref in wire.op_tensor_refs(op):
                if not isinstance(ref, dict) or len(ref) != 1:
                    raise _bad(f"sequence op {j}: malformed reference {str(ref)[:60]}")
                (kind, val), = ref.items()
                if kind == "o":
                    if (not isinstance(val, list) or len(val) != 2 or not all(isinstance(v, int) for v in val)
                            or not 0 <= val[0] < j):
                        raise _bad(f"sequence op {j}: output reference {val} is not of an earlier op")
                    self.last_use[tuple(val)] = j
                elif kind == "i":
                    if not isinstance(val, int) or not 0 <= val < n_inputs:
                        raise _bad(f"sequence op {j}: input reference {val} out of range")
                    self.input_uses.setdefault(val, []).append(j)
                elif kind == "c":
                    key = _handle_key(val)
                    if key not in const_index:
                        const_index[key] = len(self.const_handles)
                        self.const_handles.append(val)
                else:
                    raise _bad(f"sequence op {j}: reference kind {kind!r} not allowed in a sequence")
        self.steps: List[_Step] = []
        #: operators that write an argument, or hand out unwritten memory (checked and
        #: zeroed at every replay: see calls.check_writes, calls.zero_uninitialised)
        self.writing = {j for j, f in enumerate(self.resolved)
                        if any(a.alias_info is not None and a.alias_info.is_write for a in f._schema.arguments)}
        self.uninitialised = {j for j, f in enumerate(self.resolved)
                              if f._schema.name.split("::")[-1] in UNINITIALISED}
        #: replay costs per input signature (see executor._replay_cost)
        self.costs: Dict[tuple, tuple] = {}
        # Operators whose output sizes (or int values) later arguments name as size symbols
        # {"z": [op, i]}: a record of data-dependent sizes (see recorder.Recorder.unify).
        self.size_ops = set()
        for j, op in enumerate(ops):
            def size_of(val, j=j):
                if val[0] >= j:
                    raise _bad(f"sequence op {j}: size symbol {val} is not of an earlier op")
                self.size_ops.add(val[0])
                return _Size(val[0], val[1], val[2] if len(val) > 2 else 1)
            dec = wire.Decoder(_Slot, device, size_of)
            args = dec(op.get("a")) if op.get("a") is not None else []
            kwargs_tree = op.get("k") or {}
            if not isinstance(args, list) or not isinstance(kwargs_tree, dict) or len(kwargs_tree) > 64:
                raise _bad("sequence op: args must be {'l': [...]} and kwargs an object")
            kwargs = {str(k)[:64]: dec(v) for k, v in kwargs_tree.items()}
            # The tensors are slots here. Those filled at replay are the session's tensors
            # (codec uploads: dense, strided, real; views of them; registry weights) and
            # outputs of earlier allowed operators on such tensors with arguments checked
            # here, so they are dense too; the operators that trust a tensor's size or
            # values are checked at each replay (call_checks).
            allowlist.check_arguments(self.resolved[j], args, kwargs, placeholders=(_Slot, _Size))
            self.steps.append(_Step(self.resolved[j], args, kwargs))
        self.call_checks = {j: c for j, c in enumerate(map(allowlist.call_check, self.resolved)) if c}
        # Slots: the inputs, then the session tensors, then the outputs a later operator reads.
        first_out = n_inputs + len(self.const_handles)
        self.out_slot: Dict[tuple, int] = {key: first_out + i for i, key in enumerate(sorted(self.last_use))}
        self.n_slots = first_out + len(self.out_slot)

        def slot(ref) -> int:
            (kind, val), = ref.items()
            if kind == "i":
                return val
            if kind == "c":
                return n_inputs + const_index[_handle_key(val)]
            return self.out_slot[tuple(val)]

        for j, step in enumerate(self.steps):
            step.bind(slot)
            step.single = _returns_one_tensor(self.resolved[j])
        for key, s_ in self.out_slot.items():
            self.steps[key[0]].writes.append((key[1], s_))
        for key, j in self.last_use.items():
            self.steps[j].frees.append(self.out_slot[key])


def _handle_key(val) -> tuple:
    return (type(val).__name__, repr(val)[:64])


def _returns_one_tensor(func) -> bool:
    rets = func._schema.returns
    return len(rets) == 1 and isinstance(rets[0].type, torch._C.TensorType)


class _Step:
    """One operator of a compiled :class:`Sequence`: its arguments with the tensor
    positions left empty, where to fill them from, and the slots it writes and frees."""
    __slots__ = ("func", "args", "kwargs", "fills", "kw_fills", "nested", "single", "writes", "frees")

    def __init__(self, func, args: list, kwargs: dict):
        self.func, self.args, self.kwargs = func, args, kwargs
        self.fills: List[tuple] = []       # (argument index, slot)
        self.kw_fills: List[tuple] = []    # (keyword, slot)
        self.nested: List[tuple] = []      # (argument index or keyword, template with _Slots)
        self.single = True
        self.writes: List[tuple] = []      # (tensor leaf index k, slot) of outputs read later
        self.frees: List[int] = []         # slots whose last reader this is

    def bind(self, final_slot) -> None:
        def rebound(ref):               # a reference inside a nested template -> its slot
            return _Slot(final_slot(ref))

        for i, v in enumerate(self.args):
            if type(v) is _Slot:
                self.fills.append((i, final_slot(v.ref)))
                self.args[i] = None
            elif type(v) is _Size or (type(v) is list and _has_slot(v)):
                self.nested.append((i, _fill(v, rebound)))
        for k, v in list(self.kwargs.items()):
            if type(v) is _Slot:
                self.kw_fills.append((k, final_slot(v.ref)))
                self.kwargs[k] = None
            elif type(v) is _Size or (type(v) is list and _has_slot(v)):
                self.nested.append((k, _fill(v, rebound)))


def _has_slot(obj) -> bool:
    """Whether a template holds a tensor slot or a size symbol (filled at every replay)."""
    return type(obj) in (_Slot, _Size) or (type(obj) is list and any(_has_slot(o) for o in obj))


class _Slot:
    """A tensor position in a sequence's arguments: a reference while decoding, the
    slot number once compiled."""
    __slots__ = ("ref",)

    def __init__(self, ref):
        self.ref = ref


class _Size:
    """A size symbol in a sequence's arguments: integer ``i`` of what operator ``op``
    returned in this replay, times ``factor`` (:func:`wire.value_size_leaves`), e.g. the length of a boolean
    mask's selection that a later ``topk`` or ``view`` takes as a plain int."""
    __slots__ = ("op", "i", "factor")

    def __init__(self, op: int, i: int, factor: int = 1):
        self.op, self.i, self.factor = op, i, factor


def _fill(obj, tensor_of, size_of=None):
    if type(obj) is _Slot:
        return tensor_of(obj.ref)
    if type(obj) is _Size and size_of is not None:
        return size_of(obj)
    if type(obj) is list:
        return [_fill(o, tensor_of, size_of) for o in obj]
    return obj
