"""Recording intercepted operators and finding the sequence that repeats (RRTO §IV-C).

The recorder sees every operator the robot sends one by one, as :class:`RecordedOp`:
its name, its arguments as a JSON tree whose tensor references are either *outputs of an
earlier recorded operator* (``("op", index, k)``) or *uploaded robot tensors*
(``("up", handle)``), the metadata of its outputs, and whether its result had to be known
on the robot (a value, or a shape that depends on data).

Data dependency search. Operators that consume each other's outputs belong to the same
*component* (union-find over the dataflow); an inference of a model is one component: it
starts at operators that depend on no other operator (they read the input and weights
only) and ends at the ones whose results go back to the robot. A component's *signature*
rewrites its references relative to itself: an earlier operator of the component becomes
its position, a tensor uploaded during the component becomes a numbered *input* (the frame),
one uploaded before it a *constant* (weights, buffers, a cached grid). When a component
closes -- a new one starts with the same first operator -- and its signature equals the
previous component that started the same way, its operator sequence is *identified*.
That skips a first inference that differs (KAPAO builds its grids then), and keeps models
or call sites apart: their first operators read different weights or shapes.

Nothing in the signature is trusted for correctness: the replayer compares every later
operator call with the sequence before answering it (see ``session``); the signature only
decides what is worth predicting.
"""

import json
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from robot_offload.transparent import wire


@dataclass
class RecordedOp:
    name: str
    args: object                      # JSON tree; tensor refs are ("op", i, k) / ("up", h) tuples
    kwargs: object
    out_metas: List[dict]             # tensor outputs, in leaf order
    ret: object                       # return tree as sent by the server (metas / values)
    sync: bool                        # its result must be known on the robot (value, dynamic shape)
    fetched: set = field(default_factory=set)   # output indices read back by the robot


#: Early replies of one sequence dropped in a row before it is replayed at its end only.
EARLY_MAX_MISSES = 3


@dataclass
class Sequence:
    """An identified inference operator sequence, in the server's ``define`` form."""

    seq_id: str
    key: str                          # signature of its first operator
    ops: List[dict]                   # {"op", "a", "k"} with {"c"}/{"i"}/{"o"} refs
    rets: List[object]                # recorded return trees (metas / values)
    sync: List[bool]
    input_metas: List[dict]
    prefetch: List[Tuple[int, int]]   # outputs the robot read back during recording
    n_ops: int = 0
    # Outputs the program still held when its last replay ended (robot side only): what an
    # early replay asks the server to keep. None until one replay has ended.
    early_keep: Optional[List[Tuple[int, int]]] = None
    # Early replies dropped in a row; at EARLY_MAX_MISSES early replay stops for this
    # sequence (each miss costs a second round trip).
    early_misses: int = 0
    # Content digest of each fresh robot input in the last replay (None: too large, or a
    # proxy): an input whose digest repeats is predicted by the next early replay.
    input_digests: Dict[int, Optional[str]] = field(default_factory=dict)
    # Replays in a row in which each fresh input's content changed (replay_requests._input_ref).
    input_changes: Dict[int, int] = field(default_factory=dict)
    # The robot's compiled check of each call (replay._compile_check; None: the generic
    # match), built at the first replay.
    robot_checks: Optional[list] = field(default=None, repr=False)
    # The newest recording's own returns, where ``rets`` holds size symbols (Recorder.unify).
    recorded_rets: Optional[List[object]] = field(default=None, repr=False)

    def __post_init__(self):
        self.n_ops = len(self.ops)
        # size_ops: the operators whose returns define the size symbols of arguments and
        # inputs. has_sizes: the sequence was unified from inferences of other sizes
        # (Recorder.unify). sized[j]: then op j's shapes may change with the data, so each
        # replay takes them from the server's run (or a meta kernel), never from the record:
        # it is a sync point (its sizes are the frame's, even those both recordings shared),
        # its return differed, an argument names a symbol, or it reads a tensor of such an
        # operator or an input whose shape names one. (An operator whose return was the
        # same in both recordings may still change: x[:10] of an x that had 12 and 15
        # elements there and has 5 now.)
        self.size_ops = set()
        for tree in [op["a"] for op in self.ops] + [op["k"] for op in self.ops] + list(self.input_metas):
            _size_refs(tree, self.size_ops)
        self.has_sizes = bool(self.size_ops) or any(_has_size(r) for r in self.rets)
        self.sized = [False] * self.n_ops
        if self.has_sizes:
            sized_inputs = {i for i, m in enumerate(self.input_metas) if _has_size(m)}
            for j, op in enumerate(self.ops):
                self.sized[j] = ((self.sync[j] and not _returns_an_input(self.rets[j]))
                                 or _has_size(self.rets[j]) or _has_size(op["a"]) or _has_size(op["k"])
                                 or any(isinstance(r, dict) and (("o" in r and self.sized[r["o"][0]])
                                                                 or r.get("i") in sized_inputs)
                                        for r in wire.op_tensor_refs(op)))
        if self.recorded_rets is None:
            self.recorded_rets = self.rets

    @property
    def early_ok(self) -> bool:
        """Whether the whole replay may be sent before its last call is checked: not once
        its early replies keep being dropped. (Sync points do not prevent it: the early
        request asks for every sync result, and the robot checks each one against the
        record when its program gets there.)"""
        return self.early_misses < EARLY_MAX_MISSES

    @property
    def sync_ops(self) -> List[int]:
        return [j for j, s in enumerate(self.sync) if s]

    @property
    def answered_ops(self) -> List[int]:
        """The operators whose returns a replay's reply must carry: the sync operators and
        every operator whose shapes depend on a size symbol."""
        return [j for j in range(self.n_ops) if self.sync[j] or self.sized[j]]


def _returns_an_input(tree) -> bool:
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if len(node) == 1 and isinstance(node.get("t"), dict) and "a" in node["t"]:
                return True
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return False


def _has_size(tree) -> bool:
    """Whether a JSON tree holds a size symbol or a ``{"z": []}`` (an integer of a return that this frame's reply gives, see frame_return)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if len(node) == 1 and isinstance(node.get("z"), list):
                return True
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return False


def _size_refs(tree, out: set) -> set:
    """The operators the size symbols of a JSON tree refer to (added to ``out``)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            z = node.get("z") if len(node) == 1 else None
            if isinstance(z, list) and len(z) in (2, 3):
                out.add(z[0])
            else:
                stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return out


def frame_return(recorded, actual):
    """The return of an operator whose shapes change with the data, for this frame: the
    record's structure, dtypes and aliasing (an in-place result names its input), with the
    shapes, strides and values of ``actual``, the server's run of it (or its meta kernel's
    on this call's arguments). ValueError where the two differ in structure or dtype."""
    if isinstance(recorded, dict) and len(recorded) == 1 and isinstance(recorded.get("t"), dict):
        meta = recorded["t"]
        if "a" in meta:
            return recorded
        got = actual.get("t") if isinstance(actual, dict) and len(actual) == 1 else None
        if not isinstance(got, dict) or got.get("d") != meta.get("d") or "s" not in got:
            raise ValueError(f"a tensor of {got and got.get('d')} where the record has {meta.get('d')}")
        out = dict(meta)
        out.update(s=got["s"], st=got["st"], o=got.get("o", 0))
        return {"t": out}
    if isinstance(recorded, dict) and len(recorded) == 1 and isinstance(recorded.get("l"), list):
        items = actual.get("l") if isinstance(actual, dict) and len(actual) == 1 else None
        if not isinstance(items, list) or len(items) != len(recorded["l"]):
            raise ValueError("another number of results than recorded")
        return {"l": [frame_return(r, a) for r, a in zip(recorded["l"], items)]}
    return actual        # a value: this frame's


def resolve_sizes(tree, sizes: Dict[int, list]):
    """A recorded input's meta with this frame's integers: a size symbol ``{"z": [op,
    i]}`` becomes what ``op`` returned (``sizes``), ``{"z": [op, i, f]}`` f times that.
    KeyError or IndexError when an operator named has not returned it (yet). (Returns
    take this frame's shapes whole: :func:`frame_return`.)"""
    if isinstance(tree, dict):
        if len(tree) == 1 and "z" in tree:
            z = tree["z"]
            return sizes[z[0]][z[1]] * (z[2] if len(z) > 2 else 1)
        return {k: resolve_sizes(v, sizes) for k, v in tree.items()}
    if isinstance(tree, list):
        return [resolve_sizes(v, sizes) for v in tree]
    return tree


def _refs(tree, out):
    if isinstance(tree, tuple):
        out.append(tree)
    elif isinstance(tree, dict):
        for v in tree.values():
            _refs(v, out)
    elif isinstance(tree, list):
        for v in tree:
            _refs(v, out)
    return out


class Recorder:
    """Op log + union-find + identification. ``max_ops`` bounds the log (oldest dropped)."""

    def __init__(self, max_ops: int = 50000):
        self.max_ops = max_ops
        self.reset()
        self.sequences: Dict[str, Sequence] = {}
        # start key -> how often two consecutive inferences starting that way differed: a
        # model whose count keeps growing has no static operator sequence (detectors whose
        # number of boxes changes what runs) and stays op by op.
        self.differing: Dict[str, int] = {}
        self.not_unified = ""      # why the last two differing inferences were not unified
        self._seq_counter = 0

    def reset(self) -> None:
        """Forget the log (after a divergence); identified sequences are kept."""
        self.ops: List[RecordedOp] = []
        self.parent: List[int] = []
        self.producer: Dict[int, Tuple[int, int]] = {}    # handle -> (op index, k)
        self.uploaded_at: Dict[int, int] = {}             # handle -> op count when uploaded
        self.comp_first: Dict[int, int] = {}              # root -> first op index

    # -- union-find -------------------------------------------------------------------
    def _find(self, i: int) -> int:
        while self.parent[i] != i:
            self.parent[i] = self.parent[self.parent[i]]
            i = self.parent[i]
        return i

    def _union(self, a: int, b: int) -> None:
        ra, rb = self._find(a), self._find(b)
        if ra != rb:
            if self.comp_first[ra] > self.comp_first[rb]:
                ra, rb = rb, ra
            self.parent[rb] = ra
            del self.comp_first[rb]

    # -- logging ----------------------------------------------------------------------
    def note_upload(self, handle: int) -> None:
        self.uploaded_at[handle] = len(self.ops)

    def ref_of_handle(self, handle: int):
        """The recorder's reference for a server handle the robot used as an argument."""
        if handle in self.producer:
            i, k = self.producer[handle]
            return ("op", i, k)
        return ("up", handle)

    def is_root(self, args, kwargs) -> bool:
        return not any(r[0] == "op" for r in _refs(args, []) + _refs(kwargs, []))

    def add(self, op: RecordedOp, out_handles: List[int]) -> int:
        if len(self.ops) >= self.max_ops:
            self.reset()
        i = len(self.ops)
        self.ops.append(op)
        self.parent.append(i)
        self.comp_first[i] = i
        for r in _refs(op.args, []) + _refs(op.kwargs, []):
            if r[0] == "op" and r[1] < i:
                self._union(i, r[1])
        for k, h in enumerate(out_handles):
            if h is not None:
                self.producer[h] = (i, k)
        return i

    def note_fetch(self, handle: int) -> None:
        if handle in self.producer:
            i, k = self.producer[handle]
            if i < len(self.ops):
                self.ops[i].fetched.add(k)

    def forget_handle(self, handle: int) -> None:
        self.producer.pop(handle, None)
        self.uploaded_at.pop(handle, None)

    # -- signatures -------------------------------------------------------------------
    def start_key(self, name: str, args, kwargs, fresh) -> str:
        """Signature of a would-be first operator. ``fresh(handle)`` says whether an
        uploaded tensor is new in this inference (else it is a constant)."""
        inputs: Dict[int, int] = {}

        def canon(tree):
            if isinstance(tree, tuple):
                if tree[0] == "up":
                    if fresh(tree[1]):
                        return {"i": inputs.setdefault(tree[1], len(inputs)), "m": tree[2] if len(tree) > 2 else None}
                    return {"c": tree[1]}
                return {"x": list(tree)}
            if isinstance(tree, dict):
                return {k: canon(v) for k, v in tree.items()}
            if isinstance(tree, list):
                return [canon(v) for v in tree]
            return tree
        return json.dumps([name, canon(args), canon(kwargs)], sort_keys=True)

    def _component_ops(self, root: int) -> List[int]:
        return [i for i in range(self.comp_first[root], len(self.ops)) if self._find(i) == root]

    def _signature(self, idx: List[int]):
        """(key, define-ops, input metas, JSON signature) of the component ``idx``."""
        first = idx[0]
        pos = {i: p for p, i in enumerate(idx)}
        inputs: Dict[int, int] = {}
        input_metas: List[dict] = []

        def canon(tree):
            if isinstance(tree, tuple):
                if tree[0] == "op":
                    return {"o": [pos[tree[1]], tree[2]]}
                h = tree[1]
                if self.uploaded_at.get(h, -1) >= first:
                    if h not in inputs:
                        inputs[h] = len(inputs)
                        input_metas.append(tree[2] if len(tree) > 2 else {})
                    return {"i": inputs[h]}
                return {"c": h}
            if isinstance(tree, dict):
                return {k: canon(v) for k, v in tree.items()}
            if isinstance(tree, list):
                return [canon(v) for v in tree]
            return tree
        ops = []
        for i in idx:
            op = self.ops[i]
            if any(r[0] == "op" and r[1] not in pos for r in _refs(op.args, []) + _refs(op.kwargs, [])):
                return None
            ops.append({"op": op.name, "a": canon(op.args), "k": canon(op.kwargs)})
        metas = [[op_meta_key(self.ops[i])] for i in idx]
        sig = json.dumps([ops, input_metas, metas], sort_keys=True)
        return ops, input_metas, sig

    def identify(self) -> Optional[Sequence]:
        """Called when a new root operator arrives: compare the newest closed component
        with the previous one that started with the same operator; on a match, the
        sequence is identified (and returned)."""
        roots = sorted(self.comp_first.items(), key=lambda kv: kv[1])
        if len(roots) < 2:
            return None
        newest_root = roots[-1][0]
        newest = self._component_ops(newest_root)
        sig_new = self._signature(newest)
        if sig_new is None:
            return None
        key_new = self._key_of(newest[0])
        for root, _ in reversed(roots[:-1]):
            comp = self._component_ops(root)
            if self._key_of(comp[0]) != key_new:
                continue
            sig_old = self._signature(comp)
            if sig_old is None:
                self.differing[key_new] = self.differing.get(key_new, 0) + 1
                return None
            ops, input_metas, _ = sig_new
            rets = recorded = [self.ops[i].ret for i in newest]
            if sig_old[2] != sig_new[2]:
                unified = self.unify(comp, newest, sig_old, sig_new)
                if unified is None:
                    self.differing[key_new] = self.differing.get(key_new, 0) + 1
                    return None
                ops, rets, input_metas = unified
            self._seq_counter += 1
            seq = Sequence(
                seq_id=f"s{self._seq_counter}", key=key_new, ops=ops,
                rets=rets, recorded_rets=recorded, sync=[self.ops[i].sync for i in newest],
                input_metas=input_metas,
                prefetch=sorted({(p, k) for p, i in enumerate(newest) for k in self.ops[i].fetched}
                                | {(p, k) for p, i in enumerate(comp) for k in self.ops[i].fetched}))
            self.sequences[key_new] = seq
            # The log before this point is explained; start afresh (bounded memory).
            self.reset()
            return seq
        return None

    def unify(self, old: List[int], new: List[int], sig_old, sig_new):
        """(define-ops, rets) of two inferences that ran the same operators on the same
        tensors but with other sizes, or None. Detectors select boxes by score: a boolean
        mask, ``nonzero`` or NMS returns as many as the data keep, and the program passes
        that count on as a plain int (``topk(min(k, n))``, ``view(n, 4)``, ``split``).
        Every integer of an argument or of an input's shape that differs between the two
        must equal (or be a multiple of), in both, one integer of what an earlier sync
        operator returned (:func:`wire.size_leaves`); it becomes the size symbol
        ``{"z": [op, i]}`` (``[op, i, factor]``), which the server fills from its own run of
        that operator and the robot checks the program's argument against. An integer of a
        return that differs becomes ``{"z": []}``: the operator is sized, and each frame's
        reply gives its shapes (:func:`frame_return`). Anything else that differs (an
        operator, a tensor read, a float, a dtype, an argument no size explains) leaves the
        sequence unidentified, as before.

        The latest such operator wins a tie; a wrong guess cannot give a wrong result: the
        robot compares every argument and every sync result with the symbol's value in
        that frame and diverges when they differ."""
        ops_old, inputs_old, _ = sig_old
        ops_new, inputs_new, _ = sig_new
        if len(old) != len(new) or len(inputs_old) != len(inputs_new):
            self.not_unified = f"{len(old)} and {len(new)} operators, {len(inputs_old)} and {len(inputs_new)} inputs"
            return None
        syncs = [self.ops[i].sync for i in new]
        if syncs != [self.ops[i].sync for i in old]:
            self.not_unified = "other sync points"
            return None
        # (value in old, value in new) -> [(op, i)], latest operator first
        where: Dict[tuple, List[tuple]] = {}
        for p in reversed(range(len(new))):
            # (a return that hands back one of the call's inputs names it, {"a": index},
            # without its shape: the server's list of integers would be longer)
            if syncs[p] and not _returns_an_input(self.ops[new[p]].ret):
                a = wire.size_leaves(self.ops[old[p]].ret)
                b = wire.size_leaves(self.ops[new[p]].ret)
                if len(a) == len(b):
                    for i, pair in enumerate(zip(a, b)):
                        where.setdefault(pair, []).append((p, i))

        class Differs(Exception):
            pass

        def symbol(a, b, before, in_return):
            if in_return:       # a shape the server's reply (or a meta kernel) will give
                return {"z": []}
            for p, i in where.get((a, b), ()):
                if p < before:
                    return {"z": [p, i]}
            # a multiple of one (a flattened [n, 90] is n * 90 long): {"z": [op, i, factor]}
            best = None
            if a > 0 and b > 0:
                for (va, vb), places in where.items():
                    if 0 < va < a and a % va == 0 and vb > 0 and b % vb == 0 and a // va == b // vb:
                        for p, i in places:
                            if p < before and (best is None or p > best[0]):
                                best = (p, i, a // va)
                            break
            if best is not None:
                return {"z": list(best)}
            raise Differs(f"{a} and {b}, no size of an earlier sync point")

        def merge(x, y, before, data=False, in_return=False):
            """``data``: the return of a sync operator, whose values are the frame's data;
            ``in_return``: an operator's return, whose integers need not be symbols."""
            if type(x) is int and type(y) is int:
                return x if x == y else symbol(x, y, before, in_return)
            if isinstance(x, dict) and isinstance(y, dict):
                if set(x) != set(y):
                    raise Differs(f"{str(x)[:40]} and {str(y)[:40]}")
                if len(x) == 1 and isinstance(x.get("t"), dict) and "s" not in x["t"]:
                    if x != y:        # a tensor reference of a define op: the same tensor
                        raise Differs(f"reads {x['t']} and {y['t']}")
                    return y
                return {k: (y[k] if k == "h" else merge(x[k], y[k], before, data, in_return))
                        for k in y}
            if isinstance(x, list) and isinstance(y, list):
                if len(x) != len(y):
                    raise Differs(f"lists of {len(x)} and {len(y)}")
                return [merge(a, b, before, data, in_return) for a, b in zip(x, y)]
            if x == y or (data and type(x) is type(y)):
                return y
            raise Differs(f"{str(x)[:40]} and {str(y)[:40]}")

        q = 0
        try:
            ops = []
            for q, (a, b) in enumerate(zip(ops_old, ops_new)):
                if a["op"] != b["op"]:
                    raise Differs(f"{a['op']} and {b['op']}")
                ops.append({"op": b["op"], "a": merge(a["a"], b["a"], q), "k": merge(a["k"], b["k"], q)})
            rets = []
            for q, (i, k) in enumerate(zip(old, new)):
                rets.append(merge(self.ops[i].ret, self.ops[k].ret, q, syncs[q], True))
            # an input the program builds after a sync point, of the size it returned
            # (torch.full((n,), level)): its shape may name a symbol of an earlier sync point
            first_read = {}
            for q, op in enumerate(ops_new):
                for r in wire.op_tensor_refs(op):
                    if isinstance(r, dict) and "i" in r:
                        first_read.setdefault(r["i"], q)
            q = 0
            input_metas = [merge(a, b, first_read.get(i, 0)) for i, (a, b) in enumerate(zip(inputs_old, inputs_new))]
        except Differs as e:
            # kept for diagnosis (logged by the session at debug level)
            self.not_unified = f"operator {q} ({ops_new[q]['op']}): {e}"
            return None
        return ops, rets, input_metas

    def _key_of(self, i: int) -> str:
        op = self.ops[i]
        return self.start_key(op.name, op.args, op.kwargs,
                              lambda h: self.uploaded_at.get(h, -1) >= i)


def op_meta_key(op: RecordedOp):
    return [op.out_metas, op.sync]
