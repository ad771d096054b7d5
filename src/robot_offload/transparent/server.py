"""Server side of transparent offloading: the ``ops`` compute entry.

A robot-side :class:`~robot_offload.transparent.session.RemoteSession` keeps its tensors
here, in a *session* (``ComputeRequest.session``, scoped by ``client_id``), under integer
handles the server hands out. One request (``args_json``) may carry, applied in this order:

``release``  handles the robot no longer references.
``uploads``  the request's tensors, in order: ``{"n": i}`` stores ``tensors[i]``;
             ``{"sha": hex}`` names a tensor by content (sha256 of dtype, shape and bytes)
             that the server may already hold -- a parameter of a registry model it built,
             or one uploaded earlier in the session -- so weights cross the link once or
             never. Unknown digests are answered with ``"missing"`` and nothing else is done;
             the robot sends them again with data.
``define``   a recorded operator sequence (record_replay), kept under an id.
``replay``   run the first ``n`` operators of a defined sequence on fresh inputs; keep the
             outputs the robot still references as handles, return the ones it will read.
``ops``      operators to run one by one (transparent mode, and recording).
``fetch``    handles whose values go back as the response's tensors.

References inside operator arguments: ``{"h": handle}``, ``{"u": i}`` (the i-th upload of
this request); inside a sequence: ``{"c": handle}`` (a constant), ``{"i": k}`` (the k-th
input of the replay), ``{"o": [j, k]}`` (tensor output k of operator j of the sequence).

Operators are looked up by name in the ``aten`` / ``torchvision`` namespaces, and only
those on the allow-list of dense operators run, with arguments it accepts
(:func:`~robot_offload.transparent.wire.resolve_op`,
:mod:`~robot_offload.transparent.allowlist`); their shapes are first computed on the
``meta`` device so that an operator whose output would exceed the session's byte
budget is refused before any memory is allocated. Every failure is a status, the session
stays usable (an operator that fails leaves the handles as they were).
"""

import hashlib
import json
import threading
import time
import weakref
from collections import OrderedDict
from typing import Dict, List, Optional

import torch

from robot_offload import codec
from robot_offload.errors import CodecError
from robot_offload.protocol import ComputeRequest, ComputeResponse, StatusCode
from robot_offload.server import OffloadServer, RequestRejected, executor
from robot_offload.transparent import allowlist, wire

ENTRY = "ops"
KEYS = frozenset({"release", "uploads", "define", "replay", "ops", "fetch"})
MAX_OPS = 20000
MAX_SEQUENCES = 32


def content_digest(t: torch.Tensor) -> str:
    """sha256 of a tensor's dtype, shape and bytes (the robot computes the same)."""
    h = hashlib.sha256(f"{t.dtype}|{tuple(t.shape)}|".encode())
    h.update(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy())  # no copy
    return h.hexdigest()


def _bad(text: str) -> RequestRejected:
    return RequestRejected(StatusCode.BAD_REQUEST, text)


#: what an operator raises for arguments it cannot take: the request's fault (BAD_REQUEST)
OP_ERRORS = (RuntimeError, ValueError, TypeError, IndexError, NotImplementedError)


def _op_failed(func, e: Exception) -> RequestRejected:
    return _bad(f"{wire.op_name(func)} failed: "
                f"{str(e).splitlines()[0][:300] if str(e) else type(e).__name__}")


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


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


class Session:
    def __init__(self, max_bytes: int):
        self.lock = threading.Lock()
        self.handles: Dict[int, torch.Tensor] = {}
        self.sizes: Dict[int, int] = {}
        self.by_digest: Dict[str, int] = {}
        self.next_handle = 1
        self.bytes = 0
        self.max_bytes = max_bytes
        self.sequences: "OrderedDict[str, Sequence]" = OrderedDict()
        self.partial = None   # a replay stopped at a sync point, to be continued

    def put(self, t: torch.Tensor) -> int:
        h = self.next_handle
        self.next_handle += 1
        size = _nbytes(t)
        self.handles[h] = t
        self.sizes[h] = size
        self.bytes += size
        return h

    def get(self, h) -> torch.Tensor:
        if not isinstance(h, int) or isinstance(h, bool):
            raise _bad(f"handle must be an integer, got {str(h)[:40]}")
        try:
            return self.handles[h]
        except KeyError:
            raise RequestRejected(StatusCode.STALE_HANDLE, f"unknown tensor handle {h} "
                                  "(the server restarted or the handle was released)") from None

    def release(self, h) -> None:
        if isinstance(h, int) and h in self.handles:
            del self.handles[h]
            self.bytes -= self.sizes.pop(h)

    def check_budget(self, extra: int) -> None:
        if self.bytes + extra > self.max_bytes:
            raise RequestRejected(StatusCode.TOO_LARGE, f"session would hold {self.bytes + extra} bytes; "
                                  f"max_session_mib is {self.max_bytes // 2 ** 20}")


class _State:
    """Per server: its sessions (LRU) and the content index of its registry weights."""

    def __init__(self):
        self.lock = threading.Lock()
        self.sessions: "OrderedDict[tuple, Session]" = OrderedDict()
        self.index: Dict[str, torch.Tensor] = {}
        self.indexed_models = set()


_STATES: "weakref.WeakKeyDictionary[OffloadServer, _State]" = weakref.WeakKeyDictionary()
_STATES_LOCK = threading.Lock()


def _state(server: OffloadServer) -> _State:
    with _STATES_LOCK:
        st = _STATES.get(server)
        if st is None:
            st = _STATES[server] = _State()
        return st


def _session(server: OffloadServer, req: ComputeRequest) -> Session:
    if not req.session or len(req.session) > 128:
        raise _bad("the ops entry needs a session id (1-128 characters)")
    st = _state(server)
    key = (req.client_id, req.session)
    with st.lock:
        sess = st.sessions.get(key)
        if sess is None:
            sess = st.sessions[key] = Session(server.config.max_session_mib * 2 ** 20)
            while len(st.sessions) > server.config.max_sessions:
                st.sessions.popitem(last=False)
        st.sessions.move_to_end(key)
        return sess


def _lookup_digest(server: OffloadServer, sess: Session, digest: str) -> Optional[torch.Tensor]:
    if digest in sess.by_digest and sess.by_digest[digest] in sess.handles:
        return sess.handles[sess.by_digest[digest]]
    st = _state(server)
    with server._lock:
        loaded = list(server._models.values())
    with st.lock:
        for m in loaded:
            if m.name in st.indexed_models:
                continue
            for t in list(m.module.parameters()) + list(m.module.buffers()):
                st.index[content_digest(t)] = t.detach()
            st.indexed_models.add(m.name)
        return st.index.get(digest)


class _Run:
    """One request being executed against one session."""

    def __init__(self, server: OffloadServer, sess: Session, uploads: List[torch.Tensor]):
        self.server = server
        self.sess = sess
        self.uploads = uploads
        self.device = server.device
        self.compute_s = 0.0

    # -- references ------------------------------------------------------------------
    def _direct(self, ref):
        if not isinstance(ref, dict) or len(ref) != 1:
            raise _bad(f"malformed tensor reference {str(ref)[:60]}")
        (kind, val), = ref.items()
        if kind == "h":
            return self.sess.get(val)
        if kind == "u":
            if not isinstance(val, int) or not 0 <= val < len(self.uploads):
                raise _bad(f"upload reference {val} out of range")
            return self.uploads[val]
        raise _bad(f"reference kind {kind!r} not allowed here")

    # -- one operator -----------------------------------------------------------------
    def call(self, func, args_tree, kwargs_tree, tensor_of, check_size: bool = True):
        dec = wire.Decoder(tensor_of, self.device)
        args = dec(args_tree) if args_tree is not None else []
        kwargs = {}
        if kwargs_tree is not None:
            if not isinstance(kwargs_tree, dict) or len(kwargs_tree) > 64:
                raise _bad("kwargs must be an object")
            kwargs = {str(k)[:64]: dec(v) for k, v in kwargs_tree.items()}
        if not isinstance(args, list):
            raise _bad("args must be {'l': [...]}")
        allowlist.check_arguments(func, args, kwargs)
        if check_size:
            self._check_size(func, args, kwargs)
        with torch.inference_mode():
            out = self.invoke(func, args, kwargs)
        return out, wire.tensor_leaves(args, kwargs)

    def invoke(self, func, args, kwargs):
        """Run one operator; its failures are the request's (BAD_REQUEST), not the server's."""
        t0 = time.perf_counter()
        try:
            out = func(*args, **kwargs)
        except torch.cuda.OutOfMemoryError:
            raise
        except OP_ERRORS as e:
            raise _op_failed(func, e) from e
        self.compute_s += time.perf_counter() - t0
        return out

    def _check_size(self, func, args, kwargs):
        """Refuse an operator whose outputs would not fit in the session's budget, using
        shapes computed on the meta device (no memory allocated)."""
        try:
            meta_args = _to_meta(args)
            meta_kwargs = {k: _to_meta(v) for k, v in kwargs.items()}
            if any(a.name == "device" for a in func._schema.arguments):
                meta_kwargs["device"] = torch.device("meta")     # factories: no allocation
            with torch.inference_mode():
                out = func(*meta_args, **meta_kwargs)
        except Exception:  # noqa: BLE001 - data-dependent shapes or no meta kernel: run it
            return
        extra = sum(_nbytes(t) for t in wire.leaves(out) if isinstance(t, torch.Tensor))
        self.sess.check_budget(extra)

    def encode_return(self, out, inputs):
        """The return value as a JSON tree; new tensors get handles, in-place results
        (an input returned as it is) are ``{"a": n}``, n indexing the input tensors in
        :func:`wire.tensor_leaves` order."""
        def ref(t):
            for n, i in enumerate(inputs):
                if t is i:
                    return {"a": n}
            return dict(wire.tensor_meta(t), h=self.sess.put(t))
        try:
            return wire.encode(out, ref)
        except wire.Unsupported as e:
            raise _bad(f"cannot return {e}") from None


def _to_meta(obj):
    if isinstance(obj, torch.Tensor):
        return torch.empty_strided(obj.shape, obj.stride(), dtype=obj.dtype, device="meta")
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_meta(o) for o in obj)
    return obj


def _decode_uploads(server: OffloadServer, sess: Session, req: ComputeRequest, specs) -> tuple:
    if not isinstance(specs, list) or len(specs) > wire.MAX_ITEMS:
        raise _bad("uploads must be a list")
    tensors, missing = [], []
    for i, spec in enumerate(specs):
        if not isinstance(spec, dict):
            raise _bad("each upload is an object")
        if "of" in spec:
            tensors.append(_view_upload(sess, tensors, i, spec))
            continue
        n, digest = spec.get("n", -1), spec.get("sha", "")
        if not isinstance(n, int) or not isinstance(digest, str) or len(digest) > 64:
            raise _bad("upload fields: n (int), sha (hex string)")
        if 0 <= n < len(req.tensors):
            t = codec.decode(req.tensors[n], max_bytes=server.config.max_request_bytes)
            if t.numel() > server.config.max_input_elements:
                raise RequestRejected(StatusCode.TOO_LARGE, f"upload {i} has {t.numel()} elements")
            t = t.to(server.device)
            tensors.append(t)
        elif digest:
            t = _lookup_digest(server, sess, digest)
            if t is None:
                missing.append(i)
            tensors.append(t)
        else:
            raise _bad(f"upload {i}: neither a tensor index nor a digest")
    return tensors, missing


def _view_upload(sess: Session, earlier: list, i: int, spec: dict) -> Optional[torch.Tensor]:
    """``{"of": ref, "view": [shape, stride, offset]}``: a view of a tensor the session holds
    or of an earlier upload of this request (as_strided checks it stays inside the storage)."""
    ref, view = spec.get("of"), spec.get("view")
    if not isinstance(ref, dict) or len(ref) != 1 or not isinstance(view, list) or len(view) != 3:
        raise _bad(f"upload {i}: a view needs 'of' (reference) and 'view' [shape, stride, offset]")
    shape, stride, offset = view
    if (not isinstance(shape, list) or not isinstance(stride, list) or len(shape) != len(stride)
            or len(shape) > codec.MAX_DIMS or not isinstance(offset, int) or offset < 0
            or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in shape + stride)):
        raise _bad(f"upload {i}: malformed view geometry")
    (kind, val), = ref.items()
    if kind == "h":
        base = sess.get(val)
    elif kind == "u" and isinstance(val, int) and 0 <= val < i:
        base = earlier[val]
        if base is None:
            return None       # its base is missing (digest unknown): resent with data
    else:
        raise _bad(f"upload {i}: a view refers to an earlier upload or a handle")
    try:
        return base.as_strided(shape, stride, offset)
    except RuntimeError as e:
        raise _bad(f"upload {i}: view outside its base: {str(e).splitlines()[0][:200]}") from None


@executor(ENTRY, needs_model=False)
def _ops(server: OffloadServer, loaded, req: ComputeRequest) -> ComputeResponse:
    if not server.config.transparent:
        raise RequestRejected(StatusCode.UNAUTHORIZED, "this server does not accept transparent sessions")
    try:
        args = json.loads(req.args_json or "{}")
    except ValueError as e:
        raise _bad(f"args_json is not JSON: {e}") from None
    if not isinstance(args, dict) or not set(args) <= KEYS:
        raise _bad(f"args_json must be an object with keys from {sorted(KEYS)}")
    sess = _session(server, req)
    with sess.lock:
        return _execute(server, sess, req, args)


def _execute(server: OffloadServer, sess: Session, req: ComputeRequest, args: dict) -> ComputeResponse:
    result = {}
    for h in args.get("release", [])[:wire.MAX_ITEMS * 16]:
        sess.release(h)
    uploads, missing = _decode_uploads(server, sess, req, args.get("uploads", []))
    if missing:
        return ComputeResponse(status=StatusCode.OK, result_json=json.dumps({"missing": missing}))
    sess.check_budget(sum(_nbytes(t) for t in uploads))
    result["uploaded"] = []
    for spec, t in zip(args.get("uploads", []), uploads):
        h = sess.put(t)
        if spec.get("sha"):
            sess.by_digest[spec["sha"]] = h
        result["uploaded"].append(h)
    run = _Run(server, sess, uploads)
    if "define" in args:
        _define(sess, args["define"], server.device)
    fetched: List[torch.Tensor] = []
    if "replay" in args:
        result["replay"] = _replay(run, args["replay"], fetched)
    ops = args.get("ops", [])
    if not isinstance(ops, list) or len(ops) > MAX_OPS:
        raise _bad("ops must be a list of at most %d operators" % MAX_OPS)
    result["ops"] = []
    for op in ops:
        if not isinstance(op, dict):
            raise _bad("each op is an object")
        func = wire.resolve_op(op.get("op"))
        out, inputs = run.call(func, op.get("a"), op.get("k"), run._direct)
        result["ops"].append(run.encode_return(out, inputs))
    for h in args.get("fetch", []):
        fetched.append(sess.get(h))
    if not isinstance(args.get("fetch", []), list):
        raise _bad("fetch must be a list")
    tensors = [codec.encode(t, name=f"f{i}", codec=req.output_codec, compression=req.output_compression)
               for i, t in enumerate(fetched)]
    return ComputeResponse(status=StatusCode.OK, tensors=tensors, result_json=json.dumps(result),
                           server_compute_s=run.compute_s)


def _define(sess: Session, spec, device: torch.device) -> None:
    if not isinstance(spec, dict) or not isinstance(spec.get("id"), str) or len(spec["id"]) > 64:
        raise _bad("define needs an id (string) and ops (list)")
    ops, n_inputs = spec.get("ops"), spec.get("n_inputs")
    if not isinstance(ops, list) or not 0 < len(ops) <= MAX_OPS or not isinstance(n_inputs, int):
        raise _bad("define needs 1..%d ops and n_inputs" % MAX_OPS)
    if not all(isinstance(op, dict) for op in ops):
        raise _bad("each op is an object")
    try:
        seq = Sequence(ops, n_inputs, device)
    except (wire.WireError, CodecError) as e:
        raise _bad(str(e)) from None
    sess.sequences[spec["id"]] = seq
    while len(sess.sequences) > MAX_SEQUENCES:
        sess.sequences.popitem(last=False)


def _replay(run: _Run, spec, fetched: list) -> dict:
    """Run operators ``from`` .. ``n``-1 of a defined sequence (``from`` > 0 continues the
    replay the previous request left off, whose slots the session kept).
    Returns the handles of the outputs the robot still references (``keep``) and the
    return values of the operators it marked ``sync`` (values, data-dependent shapes)."""
    sess = run.sess
    if not isinstance(spec, dict):
        raise _bad("replay must be an object")
    seq_id = spec.get("id")
    seq = sess.sequences.get(seq_id) if isinstance(seq_id, str) else None
    if seq is None:
        raise RequestRejected(StatusCode.STALE_HANDLE, f"unknown sequence {str(seq_id)[:64]!r}")
    start, n = spec.get("from", 0), spec.get("n")
    if not isinstance(start, int) or not isinstance(n, int) or not 0 <= start < n <= len(seq.ops):
        raise _bad(f"replay needs 0 <= from < n <= {len(seq.ops)}")
    if start == 0:
        sess.partial = {"id": seq_id, "at": 0, "slots": [None] * seq.n_slots, "captured": {},
                        "sizes": {}}
    part = getattr(sess, "partial", None)
    if part is None or part["id"] != seq_id or part["at"] != start:
        raise RequestRejected(StatusCode.STALE_HANDLE, f"no replay of {seq_id!r} stopped at {start}")
    slots, captured, sizes = part["slots"], part["captured"], part["sizes"]

    def size_of(sym):
        known = sizes.get(sym.op)
        if known is None or sym.i >= len(known):
            # the data gave this operator fewer outputs than the record: the robot's
            # program will not make this call either (it diverges), so refuse the replay
            raise _bad(f"size symbol [{sym.op}, {sym.i}]: operator {sym.op} returned no such size")
        return known[sym.i] * sym.factor
    for pair in spec.get("inputs", []):
        if not isinstance(pair, list) or len(pair) != 2 or not isinstance(pair[0], int) \
                or not 0 <= pair[0] < seq.n_inputs:
            raise _bad("replay inputs are [index, reference] pairs")
        slots[pair[0]] = run._direct(pair[1])
    for i, uses in seq.input_uses.items():
        if slots[i] is None and any(start <= j < n for j in uses):
            raise _bad(f"replay input {i} missing")
    for i, h in enumerate(seq.const_handles):      # released handles are refused here
        slots[seq.n_inputs + i] = sess.get(h)
    keep = {tuple(k) for k in spec.get("keep", []) if isinstance(k, list) and len(k) == 2}
    want = [tuple(k) for k in spec.get("fetch", []) if isinstance(k, list) and len(k) == 2]
    sync = {j for j in spec.get("sync", []) if isinstance(j, int)}
    capture: Dict[int, List[tuple]] = {}
    for key in keep | set(want):
        if all(isinstance(v, int) for v in key) and start <= key[0] < n:
            capture.setdefault(key[0], []).append(key)

    rets = {}
    sess.partial = None   # a failure below leaves no half-run replay to continue
    j = start
    steps = seq.steps
    t0 = time.perf_counter()
    try:
        with torch.inference_mode():
            for j in range(start, n):
                step = steps[j]
                args = step.args
                if step.fills or step.nested:
                    args = list(args)
                    for i, s_ in step.fills:
                        args[i] = slots[s_]
                kwargs = step.kwargs
                if step.kw_fills or step.nested:
                    kwargs = dict(kwargs)
                    for k, s_ in step.kw_fills:
                        kwargs[k] = slots[s_]
                for where, tpl in step.nested:
                    value = _fill(tpl, slots.__getitem__, size_of)
                    if type(where) is int:
                        args[where] = value
                    else:
                        kwargs[where] = value
                if j in seq.call_checks:
                    seq.call_checks[j](args, kwargs)
                out = step.func(*args, **kwargs)
                if step.writes or j in capture:
                    leaves = ([out] if step.single else
                              [t for t in wire.leaves(out) if isinstance(t, torch.Tensor)])
                    for k, s_ in step.writes:
                        slots[s_] = leaves[k]
                    for key in capture.get(j, ()):
                        if key[1] < len(leaves):
                            captured[key] = leaves[key[1]]
                if j in seq.size_ops:
                    sizes[j] = wire.value_size_leaves(out)
                if j in sync:
                    rets[str(j)] = wire.encode(out, lambda t: wire.tensor_meta(t))
                for s_ in step.frees:
                    slots[s_] = None
    except torch.cuda.OutOfMemoryError:
        raise
    except OP_ERRORS as e:
        raise _op_failed(steps[j].func, e) from e
    finally:
        run.compute_s += time.perf_counter() - t0
    for i in range(len(seq.const_handles)):        # the session owns these, not the replay
        slots[seq.n_inputs + i] = None

    def output(key):
        t = captured.get(key)
        if t is None and key in seq.out_slot:     # produced earlier, still read later
            t = slots[seq.out_slot[key]]
        return t

    kept = []
    for key in sorted(keep):
        t = output(key)
        if t is None:
            raise _bad(f"keep {list(key)}: no such output in the first {n} operators")
        kept.append([key[0], key[1], sess.put(t)])
    for key in want:
        t = output(key)
        if t is None:
            raise _bad(f"fetch {list(key)}: no such output in the first {n} operators")
        fetched.append(t)
    if n < len(seq.ops):
        sess.partial = {"id": seq_id, "at": n, "slots": slots, "captured": captured, "sizes": sizes}
    return {"kept": kept, "rets": rets}
