"""Server side of transparent offloading: the ``ops`` compute entry.

A robot-side :class:`~robot_offload.transparent.session.RemoteSession` keeps its tensors
here, in a *session* under integer handles the server hands out. A request with
``session=""`` opens one and is answered its id (``"session"`` in the result); the session
belongs to the identity that opened it (:mod:`.sessions`). One request (``args_json``) may
carry, applied in this order:

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

Operators are looked up by name on the allow-list only
(:func:`~robot_offload.transparent.wire.resolve_op`); each is costed on the ``meta``
device first (:mod:`.calls`: bytes against the session's and the client's budgets,
floating-point operations against the request's and the client's), so that what would
exceed a budget is refused before any memory or time is spent. A replay is costed once per
input signature (its data-dependent operators, and what follows from them, each time).
Every failure is a status, the session stays usable (an operator that fails leaves the
handles as they were).
"""

import json
import threading
import time
from typing import Dict, List, Optional

import torch

from robot_offload import codec
from robot_offload.errors import CodecError
from robot_offload.protocol import ComputeRequest, ComputeResponse, StatusCode
from robot_offload.server.base import Executor, RequestRejected, bad_request as _bad
from robot_offload.server.executors.ops import calls
from robot_offload.server.executors.ops.calls import OP_ERRORS, nbytes as _nbytes, op_failed as _op_failed
from robot_offload.server.executors.ops.sequence import Sequence, _fill, _Size, _Slot
from robot_offload.server.executors.ops.sessions import Session, SessionStore
from robot_offload.transparent import allowlist, wire

ENTRY = wire.ENTRY
KEYS = frozenset({"release", "uploads", "define", "replay", "ops", "fetch"})
MAX_OPS = 20000
MAX_SEQUENCES = 32



class _Run:
    """One request being executed against one session, with what it has cost so far."""

    def __init__(self, ops: "OpsExecutor", sess: Session, uploads: List[torch.Tensor], identity: str):
        self.ops = ops
        self.server = ops.server
        self.sess = sess
        self.uploads = uploads
        self.identity = identity
        self.device = ops.server.device
        self.compute_s = 0.0
        self.flops = 0

    def charge(self, new_bytes: int, flops: int) -> None:
        """Refuse before spending: ``new_bytes`` more in the session (and the client's
        sessions), ``flops`` more in this request (and the client's budget)."""
        cfg = self.server.config
        if new_bytes > 0:
            self.check_bytes(new_bytes)
        self.flops += flops
        if self.flops > cfg.max_request_gflop * 1e9:
            raise RequestRejected(StatusCode.TOO_LARGE, f"the request would take over "
                                  f"{cfg.max_request_gflop} GFLOP (max_request_gflop)")
        self.ops.spend(self.identity, flops)

    def check_bytes(self, extra: int) -> None:
        """Refuse ``extra`` more bytes past the session's or the client's budget."""
        self.sess.check_budget(extra, self.ops.store.client_bytes(self.identity),
                               self.server.config.max_client_mib * 2 ** 20)

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
    def call(self, func, args_tree, kwargs_tree, tensor_of):
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
        with torch.inference_mode():
            out = self.bounded(func, args, kwargs)
        return out, wire.tensor_leaves(args, kwargs)

    def bounded(self, func, args, kwargs, timed: bool = True, costed: bool = False):
        """Run one operator within the budgets (:mod:`.calls`): costed on the meta device
        first (unless ``costed``: a replay costed it ahead), refused if it writes the
        server's weights, its uninitialised memory zeroed and its in-place growth
        accounted after. ``timed=False``: the caller times it."""
        written = calls.written_tensors(func, args, kwargs)
        calls.check_writes(func, written, self.ops.store.shared_keys)
        new_bytes, flops, exact = (0, 0, True) if costed else calls.estimate(func, args, kwargs)
        self.charge(new_bytes, flops)
        old_sizes = {calls.storage_key(t): t.untyped_storage().nbytes() for t in written}
        out = self.invoke(func, args, kwargs) if timed else func(*args, **kwargs)
        calls.zero_uninitialised(func, out, written, old_sizes)
        for t in written:
            self.sess.regrow(t)
        if not exact:
            self.check_bytes(sum(_nbytes(t) for t in wire.leaves(out) if isinstance(t, torch.Tensor)))
        return out

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

    def encode_return(self, out, inputs):
        """The return value as a JSON tree; new tensors get handles, in-place results
        (an input returned as it is) are ``{"a": n}``, n indexing the input tensors in
        :func:`wire.tensor_leaves` order."""
        def ref(t):
            for n, i in enumerate(inputs):
                if t is i:
                    return {"a": n}
            return dict(wire.tensor_meta(t), h=self.sess.put(t, self.ops.store.shared_keys))
        try:
            return wire.encode(out, ref)
        except wire.Unsupported as e:
            raise _bad(f"cannot return {e}") from None


def _decode_uploads(ops: "OpsExecutor", sess: Session, req: ComputeRequest, specs) -> tuple:
    server = ops.server
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
            t = ops.store.lookup_digest(ops.models_for_index, sess, digest)
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
            or not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2 ** 63
                       for v in shape + stride + [offset])):
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
    except OP_ERRORS as e:
        raise _bad(f"upload {i}: view outside its base: {str(e).splitlines()[0][:200]}") from None


class OpsExecutor(Executor):
    """The ``ops`` entry of one server: its sessions, its weight index and each client's
    compute budget (a token bucket of ``client_gflop_per_s``, holding at most
    ``max_request_gflop``)."""

    ENTRY = ENTRY
    NEEDS_MODEL = False

    def __init__(self, server):
        super().__init__(server)
        self.store = SessionStore(server.config, server._refusals)
        #: the models whose weights uploads may name by digest (a sandbox worker builds
        #: the ones its server loaded)
        self.models_for_index = self._loaded_models
        self._budget_lock = threading.Lock()
        self._budgets: Dict[str, list] = {}      # identity -> [GFLOP left, monotonic time]

    def status(self) -> dict:
        """For the server's health report: open operator sessions and their bound."""
        with self.store.lock:
            return {"sessions": len(self.store.sessions), "max_sessions": self.server.config.max_sessions}

    def _loaded_models(self) -> list:
        with self.server._lock:
            return list(self.server._models.values())

    def spend(self, identity: str, flops: int) -> None:
        cfg = self.server.config
        rate, burst = cfg.client_gflop_per_s, cfg.max_request_gflop
        now = time.monotonic()
        with self._budget_lock:
            bucket = self._budgets.get(identity)
            if bucket is None:
                if len(self._budgets) > 4096:     # forget the fullest (least active) buckets
                    self._budgets = {k: b for k, b in self._budgets.items() if b[0] < burst}
                bucket = self._budgets[identity] = [burst, now]
            bucket[0] = min(burst, bucket[0] + (now - bucket[1]) * rate)
            bucket[1] = now
            if bucket[0] < flops / 1e9:
                raise RequestRejected(StatusCode.BUSY, f"this client used its compute budget "
                                      f"(client_gflop_per_s {rate}); try again in "
                                      f"{(flops / 1e9 - bucket[0]) / rate:.1f} s")
            bucket[0] -= flops / 1e9

    def __call__(self, loaded, req: ComputeRequest) -> ComputeResponse:
        server = self.server
        if not server.config.transparent:
            raise RequestRejected(StatusCode.UNAUTHORIZED, "this server does not accept transparent sessions")
        try:
            args = json.loads(req.args_json or "{}")
        except ValueError as e:
            raise _bad(f"args_json is not JSON: {e}") from None
        if not isinstance(args, dict) or not set(args) <= KEYS:
            raise _bad(f"args_json must be an object with keys from {sorted(KEYS)}")
        identity = server.identity_of(req)
        if not req.session:
            if not args:
                return ComputeResponse(status=StatusCode.OK, result_json="{}")    # a liveness probe
            sess = self.store.open(identity)
        else:
            sess = self.store.get(req.session, identity)
        with sess.lock:
            response = self._execute(sess, identity, req, args)
        if not req.session:
            result = json.loads(response.result_json or "{}")
            result["session"] = sess.id
            response.result_json = json.dumps(result)
        return response

    def _execute(self, sess: Session, identity: str, req: ComputeRequest, args: dict) -> ComputeResponse:
        server = self.server
        result = {}
        releases = args.get("release", [])
        if not isinstance(releases, list) or len(releases) > wire.MAX_ITEMS * 16:
            raise _bad("release must be a list of at most %d handles" % (wire.MAX_ITEMS * 16))
        for h in releases:
            sess.release(h)
        uploads, missing = _decode_uploads(self, sess, req, args.get("uploads", []))
        if missing:
            return ComputeResponse(status=StatusCode.OK, result_json=json.dumps({"missing": missing}))
        shared = self.store.shared_keys
        new_storages = {calls.storage_key(t): t.untyped_storage().nbytes() for t in uploads
                        if calls.storage_key(t) not in shared and calls.storage_key(t) not in sess.storages}
        run = _Run(self, sess, uploads, identity)
        run.check_bytes(sum(new_storages.values()))
        result["uploaded"] = []
        for spec, t in zip(args.get("uploads", []), uploads):
            h = sess.put(t, shared)
            if spec.get("sha"):
                sess.by_digest[spec["sha"]] = h
            result["uploaded"].append(h)
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
        fetch = args.get("fetch", [])
        if not isinstance(fetch, list) or len(fetch) > wire.MAX_ITEMS:
            raise _bad("fetch must be a list")
        for h in fetch:
            fetched.append(sess.get(h))
        tensors = [codec.encode(t, name=f"f{i}", codec=req.output_codec, compression=req.output_compression)
                   for i, t in enumerate(fetched)]
        return ComputeResponse(status=StatusCode.OK, tensors=tensors, result_json=json.dumps(result),
                               server_compute_s=run.compute_s)


def _define(sess: Session, spec, device: torch.device) -> None:
    if not isinstance(spec, dict) or not isinstance(spec.get("id"), str) or len(spec["id"]) > 64:
        raise _bad("define needs an id (string) and ops (list)")
    ops, n_inputs = spec.get("ops"), spec.get("n_inputs")
    if (not isinstance(ops, list) or not 0 < len(ops) <= MAX_OPS or type(n_inputs) is not int
            or not 0 <= n_inputs <= MAX_OPS):
        # a replay makes a slot per input: n_inputs is bounded like the operators
        raise _bad("define needs 1..%d ops and 0..%d n_inputs" % (MAX_OPS, MAX_OPS))
    if not all(isinstance(op, dict) and isinstance(op.get("op"), str) for op in ops):
        raise _bad("each op is an object naming its operator (op)")
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
    peak_bytes, flops, dynamic = _replay_cost(seq, start, n, slots)
    run.charge(peak_bytes, flops)
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
                if j in dynamic:
                    out = run.bounded(step.func, args, kwargs, timed=False)
                elif j in seq.writing or j in seq.uninitialised:
                    out = run.bounded(step.func, args, kwargs, timed=False, costed=True)
                else:
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


#: replay costs kept per sequence (input signatures)
MAX_COSTS = 16


def _replay_cost(seq: Sequence, start: int, n: int, slots: list) -> tuple:
    """(peak bytes, floating-point operations, steps to cost one by one) of replaying
    operators ``start`` .. ``n``-1 on ``slots``, from one run on the meta device per input
    signature. A step whose sizes depend on the data (no meta kernel, a size symbol, or an
    input that follows from such a step) cannot be costed ahead: it is costed when it runs
    (:meth:`_Run.bounded`)."""
    key = (start, n) + tuple(None if t is None else (tuple(t.shape), t.stride(), t.dtype, t.storage_offset())
                             for t in slots)
    cost = seq.costs.get(key)
    if cost is not None:
        return cost
    meta = [None if t is None else calls.to_meta(t) for t in slots]
    unknown = set()
    dynamic = set()
    live = peak = flops = 0
    counted: Dict[int, int] = {}        # slot -> bytes it added to live
    for j in range(start, n):
        step = seq.steps[j]
        used = [s_ for _, s_ in step.fills] + [s_ for _, s_ in step.kw_fills]
        nested_ok = all(not _has_size(tpl) for _, tpl in step.nested)
        out = None
        if nested_ok and not any(s_ in unknown or meta[s_] is None for s_ in used + _nested_slots(step)):
            args = list(step.args)
            for i, s_ in step.fills:
                args[i] = meta[s_]
            kwargs = dict(step.kwargs)
            for k, s_ in step.kw_fills:
                kwargs[k] = meta[s_]
            for where, tpl in step.nested:
                value = _fill(tpl, meta.__getitem__)
                if type(where) is int:
                    args[where] = value
                else:
                    kwargs[where] = value
            try:
                out, new, f = calls.meta_cost(step.func, args, kwargs)
            except Exception:  # noqa: BLE001 - data-dependent sizes: costed when it runs
                out = None
        if out is None:
            dynamic.add(j)
            unknown.update(s_ for _, s_ in step.writes)
            continue
        flops += f
        peak = max(peak, live + new)
        leaves = [t for t in wire.leaves(out) if isinstance(t, torch.Tensor)]
        for k, s_ in step.writes:
            meta[s_] = leaves[k] if k < len(leaves) else None
            counted[s_] = calls.nbytes(leaves[k]) if k < len(leaves) else 0
            live += counted[s_]
        for s_ in step.frees:
            live -= counted.pop(s_, 0)
    cost = (peak, flops, frozenset(dynamic))
    if len(seq.costs) >= MAX_COSTS:
        seq.costs.clear()
    seq.costs[key] = cost
    return cost


def _has_size(tpl) -> bool:
    return type(tpl) is _Size or (type(tpl) is list and any(_has_size(o) for o in tpl))


def _nested_slots(step) -> list:
    out = []

    def walk(o):
        if type(o) is _Slot:
            out.append(o.ref)
        elif type(o) is list:
            for v in o:
                walk(v)
    for _, tpl in step.nested:
        walk(tpl)
    return out
