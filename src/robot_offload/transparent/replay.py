"""record_replay on the robot: recording operators, identifying a sequence, and answering
the calls of a known sequence from the record (a speculation), each call checked against
it -- by a check compiled per recorded call where it can be, argument by argument
otherwise. A call that differs ends the speculation (a divergence): what matched is
replayed, the rest goes one by one and recording starts again. Sending the replay is in
:mod:`~robot_offload.transparent.replay_requests`.
"""

import concurrent.futures
import logging
import threading
import weakref
from typing import Dict, List, Optional

import torch
from torch.utils._pytree import tree_flatten, tree_map

from robot_offload.transparent import wire
from robot_offload.transparent.fallback import HIDDEN_WRITES, _short_name
from robot_offload.transparent.proxy import RemoteTensor
from robot_offload.transparent.recorder import RecordedOp, Sequence, frame_return, resolve_sizes
from robot_offload.transparent.robot_choice import ROBOT

log = logging.getLogger(__name__)

#: Argument types the record holds as they are (wire.encode returns them unchanged; a float
#: only when finite, and an equal float is finite since the record holds others as dicts).
_PLAIN_SCALARS = (int, bool, str, float)


class Mismatch(Exception):
    """An operator call that differs from the recorded sequence."""


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


class ReplayMixin:
    """Recording and speculation of a :class:`~robot_offload.transparent.session.RemoteSession`."""

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
                    if self._choosers is not None and self._choose_where(seq, func, args, kwargs) == ROBOT:
                        return self._run_on_robot(func, args, kwargs)
                    self._spec = _Speculation(seq)
                    self.stats.begin("replaying")
                    try:
                        return self._speculate(func, name, args, kwargs)
                    except Mismatch as e:
                        self._diverge(str(e))
                        return self._transparent(func, args, kwargs, record=True)
                if probe[1]:
                    self._end_timed()
                    self.stats.begin("recording")
        elif not self.stats.inferences_total:
            self.stats.begin("recording")
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
            h = None if reused_as_input and not isinstance(t, torch.nn.Parameter) else self._known_handle(t)
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
            rec = None  # break the closure's reference cycle (see RemoteCallsMixin._decode_return)
        out_tensors = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        metas = [wire.tensor_meta(t) for t in out_tensors]
        _, _, value_return, _, _ = self._schema(func)
        sync = value_return or not self._shapes_static(func, args, kwargs, metas)
        op = RecordedOp(name, a_rec, k_rec, metas, ret, sync)
        # In-place results ({"a": 1}) produce no new tensor: their producer stays the same.
        self.recorder.add(op, [m.get("h") for m in wire.metas_in(ret)])

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
        meta = wire.single_new_tensor(ret)
        if meta is not None:
            # The usual return, one new tensor: its proxy without the generic decoding.
            out = RemoteTensor(self, meta, None)
            out_tensors = [out]
        else:
            out = self._decode_return(func, args, kwargs, ret, from_record=True)
            out_tensors = [t for t in wire.leaves(out) if isinstance(t, RemoteTensor)]
        if self.local_fallback:
            self._attach_recipe(func, args, kwargs, out)
        for k, (t, m) in enumerate(zip(out_tensors, wire.metas_in(ret) if meta is None else [meta])):
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
            if not wire.same_shapes(actual, ret):
                # The data made the shapes differ from the record: hand out proxies with the
                # real shapes (same server tensors) and record again from here.
                self._spec = None
                self._note_divergence(spec, f"operator {j} returned other shapes than recorded")
                if len(wire.metas_in(actual)) != len(wire.metas_in(ret)):
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
        metas = wire.metas_in(resolved)
        if not any("a" not in m for m in metas):
            return self._decode_return(func, args, kwargs, resolved)   # values, or its input
        # the stand-ins of the new tensors, in order (an in-place result is its input)
        olds = [t for t, m in zip(stand_ins, wire.metas_in(seq.recorded_rets[j])) if "a" not in m]
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
            return isinstance(a, torch.Tensor) and self._known_handle(a) == want
        if kind is _LIST:
            return type(a) in (list, tuple) and len(a) == len(want) and all(
                self._compiled_arg(spec, k, w, v) for (k, w), v in zip(want, a))
        if kind is _SIZE:
            return _size_matches(spec, want, a)
        if kind is _VALUES:   # element types first: a tensor equal to 2 must not pass as 2
            values, types = want
            return type(a) is list and tuple(map(type, a)) == types and a == values
        return type(a) is type(want) and a == want    # _VALUE

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
                if self._known_handle(actual) != val:
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
            walk = None  # break the closure's reference cycle (see RemoteCallsMixin._decode_return)

    def _diverge(self, why: str) -> None:
        spec = self._spec
        if spec is None:
            return
        self._flush(why)
        self._spec = None
        self._note_divergence(spec, why)

    def _note_divergence(self, spec, why: str) -> None:
        self.stats.divergences += 1
        self._spoil_timed()
        if self.stats.inferences:
            self.stats.inferences[-1].phase = "fallback"
        log.info("record/replay: %s (sequence %s, operator %d); finishing op by op and "
                 "recording again", why, spec.seq.seq_id, spec.pos)
        self.recorder.sequences.pop(spec.seq.key, None)
        self.recorder.reset()

    @property
    def not_static(self) -> bool:
        """True once inferences keep differing (3 times without an identified sequence):
        the program's operator sequence is not static and it runs op by op."""
        return not self.recorder.sequences and max(self.recorder.differing.values(), default=0) >= 3


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
