"""Fuzzing the ``ops`` entry of a running offload server with adversarial operator requests.

The ``ops`` entry runs aten operators a client names in JSON (see
:mod:`robot_offload.server.executors.ops.executor` for the request format), so every
request is an untrusted program. This module generates such programs with hypothesis and
drives them against a server, checking what the server promises whatever a client sends:
every request is answered with a status (never an exception, never INTERNAL), the server
process stays up, and a well-behaved client sharing the server keeps getting correct
answers.

How requests are generated (:func:`request_strategy`): operators come from the allow-list
(:func:`allowed_ops`: ``robot_offload.transparent.allowlist`` when it exists, else
:data:`FALLBACK_OPS`); each operator's arguments are drawn from its schema, type by type
(tensors, ints and int lists, floats, scalars, dtypes, devices, strings), each either
plausible (small shapes, tensors the session holds) or adversarial (0, -1, 2**31-1,
2**63-1, lists longer than the wire allows, non-finite floats, wrong types, unknown or
released handles, references of the wrong kind). A request mixes plain ``ops``, ``define``
+ ``replay`` of 1..12 operators with input, constant, output and size-symbol references,
replay continuations, uploads (encoded small tensors, digests, as_strided views of
handles), releases, fetches, unknown keys, other clients' and made-up sessions. What the
server answers (handles, their shapes, sessions, sequences) feeds a :class:`FuzzState`
that later draws refer to, so the fuzz reaches deep into sessions instead of stopping at
the first unknown handle.

:class:`ValidClient` is the well-behaved client: a small two-layer conv net whose output
is known locally, run every few requests both as plain operators and as a replayed
sequence, and compared with ``torch.testing.assert_close``.

Hypothesis is a test and development dependency: it is imported inside the functions that
use it, so importing this module costs nothing on a server. The command line
(``python -m robot_offload.server.fuzz_ops --requests 10000``) starts a roscore and a real
``offload_server`` node (:class:`robot_offload.ros.server_process.RosServer`, imported
only there), runs the fuzz over the ROS ``compute`` service and prints a summary table.
"""

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import torch

from robot_offload import codec
from robot_offload.protocol import ComputeRequest, ComputeResponse, LoadModelRequest, PingRequest, StatusCode
from robot_offload.transparent import wire

#: Common dense-inference operators, fuzzed while the allow-list module is not there.
FALLBACK_OPS = (
    "aten::convolution.default", "aten::conv2d.default", "aten::linear.default", "aten::addmm.default",
    "aten::mm.default", "aten::bmm.default", "aten::relu.default", "aten::relu_.default",
    "aten::gelu.default", "aten::silu.default", "aten::silu_.default", "aten::sigmoid.default",
    "aten::tanh.default", "aten::add.Tensor", "aten::add.Scalar", "aten::add_.Tensor", "aten::add_.Scalar",
    "aten::mul.Tensor", "aten::mul.Scalar", "aten::mul_.Tensor", "aten::mul_.Scalar", "aten::sub.Tensor",
    "aten::sub.Scalar", "aten::sub_.Tensor", "aten::sub_.Scalar", "aten::div.Tensor", "aten::div.Scalar",
    "aten::div_.Tensor", "aten::div_.Scalar", "aten::view.default", "aten::reshape.default",
    "aten::permute.default", "aten::transpose.int", "aten::expand.default", "aten::contiguous.default",
    "aten::clone.default", "aten::copy_.default", "aten::slice.Tensor", "aten::select.int",
    "aten::cat.default", "aten::stack.default", "aten::split.Tensor", "aten::as_strided.default",
    "aten::max_pool2d.default", "aten::max_pool2d_with_indices.default", "aten::avg_pool2d.default",
    "aten::adaptive_avg_pool2d.default", "aten::_adaptive_avg_pool2d.default", "aten::batch_norm.default",
    "aten::native_batch_norm.default", "aten::_native_batch_norm_legit_no_training.default",
    "aten::softmax.int", "aten::_softmax.default", "aten::log_softmax.int", "aten::topk.default",
    "aten::sort.default", "aten::argmax.default", "aten::max.dim", "aten::nonzero.default",
    "aten::masked_select.default", "aten::index.Tensor", "aten::index_put_.default", "aten::gather.default",
    "aten::scatter.src", "aten::scatter.value", "aten::empty.memory_format", "aten::zeros.default",
    "aten::ones.default", "aten::full.default", "aten::arange.default", "aten::arange.start",
    "aten::arange.start_step", "aten::empty_like.default", "aten::new_empty.default", "aten::resize_.default",
    "aten::upsample_nearest2d.default", "aten::upsample_nearest2d.vec", "aten::upsample_bilinear2d.default",
    "aten::upsample_bilinear2d.vec", "aten::where.self", "aten::clamp.default", "aten::pow.Tensor_Scalar",
    "aten::pow.Tensor_Tensor", "aten::exp.default", "aten::log.default", "aten::sqrt.default",
    "aten::mean.dim", "aten::sum.dim_IntList", "aten::amax.default", "aten::flatten.using_ints",
)
#: Names no server may run (files, raw memory, other namespaces) or that are malformed:
#: sent now and then, they must be refused like any other bad request.
FORBIDDEN_OPS = ("aten::from_file", "aten::_pin_memory.default", "aten::set_.source_Storage",
                 "os::system", "builtins::eval", "aten::", "aten::relu.nope", "aten::no_such_op",
                 "prim::data", "aten::record_stream.default", "torchvision::nms.default", 12, None)

#: Server limits of a fuzz run, small so that the bounds are exercised and memory figures
#: mean something on a small machine (``~`` parameters of offload_server).
FUZZ_CONFIG = {
    "device": "cpu",
    "max_session_mib": 64,
    "max_client_mib": 96,
    "max_request_bytes": 4 * 2 ** 20,
    "max_input_elements": 2 ** 20,
    "max_request_gflop": 1.0,
    "client_gflop_per_s": 2.0,
    "max_request_s": 5.0,
    "max_sandboxes": 10,       # the clients below, the valid one and a warm-up fit; EXTRA_CLIENTS do not
    "session_idle_s": 60.0,
}
#: percent of requests built shape-aware (:mod:`.fuzz_shapes`); the rest are adversarial
FIT_PERCENT = 70
#: per mille of fit requests aimed at one limit (:meth:`.fuzz_shapes.FitGen.special`)
SPECIALS = (("slow", 4), ("hog", 30), ("gflop", 15), ("burst", 15), ("weights", 35), ("extra", 15))
#: Identities of the fuzzing clients (each gets a sandbox process of its own).
FUZZ_CLIENTS = ("fuzz-a", "fuzz-b", "fuzz-c")
VALID_CLIENT = "valid-client"

SMALL_INTS = (0, 1, 2, 3, 4, -1)
EVIL_INTS = (0, 1, -1, -2, 2 ** 31 - 1, -2 ** 31, 2 ** 63 - 1, -2 ** 63, 2 ** 32, 2 ** 64, 10 ** 30, 65536)
DTYPE_NAMES = tuple(sorted(wire._DTYPES))
SHAPES = ((), (1,), (3,), (4, 4), (2, 3), (1, 3, 8, 8), (2, 3, 4, 4), (2, 2, 2), (1, 1), (0,), (3, 0, 2),
          (8,), (1, 4, 6, 6), (2, 4), (4, 3))
UPLOAD_DTYPES = (torch.float32, torch.float32, torch.float32, torch.float64, torch.float16, torch.int64,
                 torch.int32, torch.uint8, torch.bool, torch.bfloat16, torch.int8)


def allowed_ops() -> List[str]:
    """The operator names to fuzz: the allow-list module's, when it exists (an attribute
    ``ALLOWED_OPS``, else ``ALLOWED``: a collection of ``ns::name.overload`` names), else
    :data:`FALLBACK_OPS`."""
    try:
        from robot_offload.transparent import allowlist
    except ImportError:
        return sorted(FALLBACK_OPS)
    names = getattr(allowlist, "ALLOWED_OPS", None) or getattr(allowlist, "ALLOWED", None)
    if not names:
        return sorted(FALLBACK_OPS)
    out = set()
    for n in names:
        n = str(n)
        if "::" not in n:
            n = "aten::" + n
        out.add(n if "." in n.split("::", 1)[1] else n + ".default")
    return sorted(out)


def catalog(names=None) -> Dict[str, object]:
    """name -> OpOverload of the operators to fuzz that resolve in this torch."""
    out = {}
    for n in names or allowed_ops():
        try:
            out[n] = wire.resolve_op(n)
        except wire.WireError:
            continue
    return out


# -- what the fuzzer knows of the server's state ------------------------------------------------
@dataclass
class Handle:
    h: int
    shape: Optional[list]      # None: unknown
    dtype: str


@dataclass
class SessionState:
    id: str
    client: str
    handles: Dict[int, Handle] = field(default_factory=dict)
    next_guess: int = 1
    sequences: Dict[str, dict] = field(default_factory=dict)     # id -> {"n", "n_inputs"}
    partial: Optional[tuple] = None                                # (sequence id, stopped at)
    digests: List[str] = field(default_factory=list)
    fit_seqs: Dict[str, dict] = field(default_factory=dict)         # sequences fit requests defined


class FuzzState:
    """The sessions, handles and sequences the server has answered so far, per client:
    what later requests refer to (validly or not)."""

    MAX_HANDLES = 96

    def __init__(self, clients=FUZZ_CLIENTS, weights=()):
        self.clients = tuple(clients)
        self.weights = list(weights)        # registry weights (digest, shape, dtype) of fuzz_shapes
        self.built = 0                      # fit requests built: mixed into their seeds
        self.sessions: Dict[str, SessionState] = {}
        self.by_client: Dict[str, List[str]] = {c: [] for c in self.clients}

    def observe(self, req: ComputeRequest, args, resp: ComputeResponse, fr: "Optional[FuzzRequest]" = None) -> None:
        """Learn from one request and its response (handles made, released, sessions opened,
        shapes of uploads and outputs, sequences defined by fit requests)."""
        if resp.status != StatusCode.OK:
            if resp.status == StatusCode.STALE_HANDLE and "sandbox" in (resp.status_text or ""):
                for sid in self.by_client.get(req.client_id, []):   # its sandbox, and sessions, are gone
                    self.sessions.pop(sid, None)
                self.by_client[req.client_id] = []
            elif resp.status == StatusCode.STALE_HANDLE and "unknown session" in (resp.status_text or ""):
                self._forget(req.session)
            return
        try:
            result = json.loads(resp.result_json or "{}")
        except ValueError:
            return
        sid = result.get("session") or req.session
        sess = self.sessions.get(sid)
        if sess is None and result.get("session"):
            sess = self.sessions[sid] = SessionState(sid, req.client_id)
            lst = self.by_client.setdefault(req.client_id, [])
            lst.append(sid)
            while len(lst) > 4:             # the server keeps max_sessions_per_client (4)
                self.sessions.pop(lst.pop(0), None)
        if sess is None:
            return
        if isinstance(args, dict):
            for h in args.get("release", []) if isinstance(args.get("release"), list) else []:
                sess.handles.pop(h, None) if isinstance(h, int) else None
            d = args.get("define")
            if isinstance(d, dict) and isinstance(d.get("id"), str) and isinstance(d.get("ops"), list):
                sess.sequences[d["id"]] = {"n": len(d["ops"]), "n_inputs": d.get("n_inputs", 0)}
            r = args.get("replay")
            if isinstance(r, dict) and isinstance(r.get("n"), int):
                seq = sess.sequences.get(r.get("id"))
                sess.partial = (r.get("id"), r["n"]) if seq and r["n"] < seq["n"] else None
            for spec in args.get("uploads", []) if isinstance(args.get("uploads"), list) else []:
                if isinstance(spec, dict) and isinstance(spec.get("sha"), str) and len(spec["sha"]) == 64:
                    sess.digests.append(spec["sha"])
        metas = fr.upload_meta if fr is not None else []
        for n, h in enumerate(result.get("uploaded", [])):
            if isinstance(h, int):
                meta = metas[n] if n < len(metas) and metas[n] else (None, "")
                self._add(sess, Handle(h, meta[0], meta[1]))
        info = fr.info if fr is not None else {}
        if "continued" not in info:           # the server keeps one stopped replay per session
            for seq in sess.fit_seqs.values():
                seq.pop("stopped", None)
        if "define" in info:
            seq_id, seq = info["define"]
            sess.fit_seqs[seq_id] = dict(seq)
        if "partial" in info and info["partial"][0] in sess.fit_seqs:
            sess.fit_seqs[info["partial"][0]]["stopped"] = info["partial"][1]
        if "continued" in info and info["continued"] in sess.fit_seqs:
            sess.fit_seqs[info["continued"]].pop("stopped", None)
        for tree in result.get("ops", []):
            for t in _tensor_metas(tree):
                self._add(sess, Handle(t["h"], list(t.get("s", [])), t.get("d", "")))
        for kept in (result.get("replay") or {}).get("kept", []):
            if isinstance(kept, list) and len(kept) == 3:
                self._add(sess, Handle(kept[2], None, ""))
        del sess.digests[:-16]

    def _add(self, sess: SessionState, h: Handle) -> None:
        if not isinstance(h.h, int):
            return
        sess.handles[h.h] = h
        sess.next_guess = max(sess.next_guess, h.h + 1)
        while len(sess.handles) > self.MAX_HANDLES:
            sess.handles.pop(next(iter(sess.handles)))

    def _forget(self, sid: str) -> None:
        sess = self.sessions.pop(sid, None)
        if sess is not None and sid in self.by_client.get(sess.client, []):
            self.by_client[sess.client].remove(sid)


def _tensor_metas(tree) -> list:
    out, stack = [], [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, dict) and len(node) == 1:
            (k, v), = node.items()
            if k == "t" and isinstance(v, dict) and isinstance(v.get("h"), int):
                out.append(v)
            elif k == "l" and isinstance(v, list):
                stack.extend(v)
    return out


# -- generation ---------------------------------------------------------------------------------
@dataclass
class FuzzRequest:
    """One generated request: what is sent (``request``) and its arguments (``args``:
    the parsed args_json, or None when the JSON is deliberately broken); ``upload_meta``:
    (shape, dtype name) of each upload where known; ``info``: what a fit request expects
    (sequences it defines, a write into registry weights); ``repeat``: times it is sent
    back to back."""
    request: ComputeRequest
    args: object
    kind: str
    upload_meta: list = field(default_factory=list)
    info: dict = field(default_factory=dict)
    repeat: int = 1


def request_strategy(state: FuzzState, ops: Dict[str, object]):
    """A hypothesis strategy of one adversarial ``ops`` request, given what the server
    answered so far (``state``) and the operators to fuzz (``ops``: name -> OpOverload).

    Hypothesis requires a strategy to draw the same way whatever happened outside it, so
    the draws never look at ``state``: what refers to the server's state (a session, a
    handle it holds, one of its sequences, a shape it answered) is drawn as a
    :class:`_Ref` (a kind and an index), and bound to the state when the request is built
    (:func:`_bind`: index modulo what there is, or a made-up value when there is nothing)."""
    from hypothesis import strategies as st

    names = sorted(ops)

    @st.composite
    def template(draw):
        return _template(_Gen(draw, ops, names))

    return template().map(lambda t: _build(state, ops, t))


def make_request(state: FuzzState, ops: Dict[str, object], rng) -> FuzzRequest:
    """One request like :func:`request_strategy`'s, drawn from ``rng`` (a random.Random)
    instead of hypothesis: what the concurrent fuzzing clients send."""
    return _build(state, ops, _template(_Gen(None, ops, sorted(ops), rng=rng)))


def _template(g: "_Gen"):
    """The state-independent draws of one request (see :func:`request_strategy`)."""
    client = g.int_in(1 << 16)                # bound to a client of the state
    c = g.int_in(100)
    session = "" if c < 6 else _Ref("foreign", g.int_in(1 << 16), g.int_in(4)) if c < 9 \
        else _Ref("session", g.int_in(1 << 16))
    args, tensors, kind = g.request()
    if g.chance(2):                                     # an unknown top-level key
        args[g.pick(["evil", "exec", "Ops", ""])] = g.int_in(4)
    broken = g.pick(["[]", "null", "{", "\"ops\"", "{\"ops\": {\"l\": []}}", "1e999",
                     "{\"ops\": [{\"op\": \"aten::relu\", \"a\": {\"l\": [NaN]}}]}"]) if g.chance(1) else None
    out_codec = g.pick(["raw"] * 8 + ["float16", "int8", "bogus"])
    model = g.pick(["", "", "resnet18", "nope"])
    fit = g.int_in(100) < FIT_PERCENT
    fit_seed = g.int_in(1 << 30)
    return client, session, args, tensors, kind, broken, out_codec, model, fit, fit_seed



def _build(state: FuzzState, ops, t) -> FuzzRequest:
    """Bind one template to the server state as the fuzzer knows it."""
    client, session, args, tensors, kind, broken, out_codec, model, fit, fit_seed = t
    client = state.clients[client % len(state.clients)]
    if fit:
        return _fit_request(state, ops, client, fit_seed)
    known = [state.sessions[s] for s in state.by_client.get(client, []) if s in state.sessions]
    sess = None
    if isinstance(session, _Ref) and session.kind == "session":
        sess = known[session.i % len(known)] if known else None
        session = sess.id if sess else ""
    elif isinstance(session, _Ref):
        others = [s for c, ss in state.by_client.items() if c != client for s in ss]
        made_up = ["%032x" % session.i, "x", "0" * 32, "#" * 2000]
        session = others[session.i % len(others)] if others and session.extra == 0 \
            else made_up[session.extra % len(made_up)]
    args = _bind(args, sess, [])
    text = broken if broken is not None else json.dumps(args)
    req = ComputeRequest(client_id=client, model=model, entry="ops", session=session, tensors=tensors,
                         args_json=text, output_codec=out_codec)
    return FuzzRequest(req, None if broken is not None else args, kind)


def _fit_request(state: FuzzState, ops, client: str, seed: int) -> FuzzRequest:
    """A shape-aware request (:class:`.fuzz_shapes.FitGen`) of ``client``, in one of its
    sessions (or a new one), now and then one aimed at a server limit."""
    import random
    from robot_offload.server import fuzz_shapes
    state.built += 1
    # hypothesis favours small draws: the count keeps equal draws from making equal requests
    rng = random.Random(f"{seed}/{state.built}/{','.join(state.clients)}")
    known = [state.sessions[s] for s in state.by_client.get(client, []) if s in state.sessions]
    sess = rng.choice(known) if known and rng.random() < 0.92 else None
    held = [(h.h, h.shape, h.dtype) for h in sess.handles.values() if h.shape is not None and h.dtype] if sess else []
    gen = fuzz_shapes.FitGen(rng, ops, held=held, seqs=sess.fit_seqs if sess else {}, weights=state.weights)
    pm = rng.randrange(1000)
    special = None
    for name, per_mille in SPECIALS:
        if pm < per_mille:
            special = name
            break
        pm -= per_mille
    if special == "weights" and not state.weights:
        special = None
    repeat = 1
    if special is None:
        args, tensors, kind = gen.request()
    else:
        args, tensors, repeat = gen.special(special)
        kind = "limit-" + special
        if special == "extra":
            client, sess = rng.choice(fuzz_shapes.EXTRA_CLIENTS), None
        if special == "weights":
            by_digest = {d: (shape, str(dtype).replace("torch.", "")) for d, shape, dtype in state.weights}
            gen.upload_meta = [by_digest[u["sha"]] for u in args["uploads"]]
    req = ComputeRequest(client_id=client, model="", entry="ops", session=sess.id if sess else "",
                         tensors=list(tensors), args_json=json.dumps(args))
    return FuzzRequest(req, args, kind, upload_meta=gen.upload_meta, info=gen.info, repeat=repeat)


class _Ref:
    """Something of the server's state a request refers to, bound when it is built:
    ``session``, ``foreign`` (another client's or a made-up session), ``held`` (a handle
    the session holds), ``future`` (a handle it may hand out next), ``digest`` (of a tensor
    uploaded before), ``shape`` (of a tensor the session holds, or of an upload), ``seq``
    (a sequence it defined), ``seq_n``, ``seq_from``, ``seq_inputs`` (its length, where a
    replay stopped, the replay inputs it takes)."""
    __slots__ = ("kind", "i", "extra")

    def __init__(self, kind: str, i: int = 0, extra=None):
        self.kind, self.i, self.extra = kind, i, extra


def _bind(tree, sess: Optional[SessionState], upload_shapes: list):
    """``tree`` with its :class:`_Ref` bound to ``sess`` (None: no session known)."""
    if isinstance(tree, dict):
        if "uploads" in tree and isinstance(tree["uploads"], list):
            uploads = tree["uploads"]
            upload_shapes = _Shapes(s for s in (u.pop("_shape", None) if isinstance(u, dict) else None
                                                for u in uploads) if s)
            upload_shapes.n_uploads = len(uploads)
        ref = tree.get("h") if len(tree) == 1 else None
        if isinstance(ref, _Ref) and ref.kind == "held" and not (sess and sess.handles) \
                and getattr(upload_shapes, "n_uploads", 0):
            return {"u": ref.i % upload_shapes.n_uploads}    # nothing held yet: an upload instead
        return {k: _bind(v, sess, upload_shapes) for k, v in tree.items()}
    if isinstance(tree, list):
        out = []
        for v in tree:
            if isinstance(v, _Ref) and v.kind == "seq_inputs":        # the inputs the sequence takes
                seq = _seq_of(sess, v.i)
                out.extend(_bind(v.extra[:seq["n_inputs"] if seq else 1], sess, upload_shapes))
            else:
                out.append(_bind(v, sess, upload_shapes))
        return out
    if not isinstance(tree, _Ref):
        return tree
    r = tree
    held = sorted(sess.handles) if sess else []
    if r.kind == "held":
        return held[r.i % len(held)] if held else [0, 10 ** 6, 7][r.i % 3]
    if r.kind == "future":
        return (sess.next_guess if sess else 1) + r.i % 12
    if r.kind == "digest":
        return sess.digests[r.i % len(sess.digests)] if sess and sess.digests else "0" * 64
    if r.kind == "shape":
        shapes = [h.shape for h in sess.handles.values() if h.shape] if sess else []
        shapes += upload_shapes
        shape = list(shapes[r.i % len(shapes)]) if shapes else list(SHAPES[r.i % len(SHAPES)])
        where, value, reverse = r.extra
        if shape and value is not None:
            shape[where % len(shape)] = value
        return {"l": shape[::-1] if reverse else shape}
    if r.kind == "seq":
        seq_ids = sorted(sess.sequences) if sess else []
        return seq_ids[r.i % len(seq_ids)] if seq_ids else "zz"
    seq = _seq_of(sess, r.i)
    n = seq["n"] if seq else 1
    part = sess.partial if sess else None
    if r.kind == "seq_n":                # its length, or off by extra; after a continuation start
        if r.extra == "continue" and part and seq and part[0] == _bind(_Ref("seq", r.i), sess, []):
            return n
        return n + r.extra if isinstance(r.extra, int) else n
    if r.kind == "seq_from":
        if part and seq and part[0] == _bind(_Ref("seq", r.i), sess, []):
            return part[1]
        return 0
    raise AssertionError(r.kind)


class _Shapes(list):
    """The shapes of a request's uploads, and how many uploads it has."""
    n_uploads = 0


def _seq_of(sess: Optional[SessionState], i: int) -> Optional[dict]:
    seq_ids = sorted(sess.sequences) if sess else []
    return sess.sequences[seq_ids[i % len(seq_ids)]] if seq_ids else None


class _Gen:
    """Draws the parts of one request (``draw`` is hypothesis's draw); what refers to the
    server's state is drawn as :class:`_Ref`."""

    def __init__(self, draw, ops, names, rng=None):
        self.st = None
        if draw is not None:
            from hypothesis import strategies as st
            self.st = st
        self.rng = rng          # a random.Random drawing instead of hypothesis (draw None)
        self.draw = draw
        self.ops = ops
        self.names = names
        self.tensors: List[codec.EncodedTensor] = []
        self.uploads: List[dict] = []
        self.seq_refs: Optional[list] = None      # inside a define: the references ops may use
        self.seq_at = 0
        self._by_keyword = False
        #: percent of values drawn plausibly whatever else: requests range from mostly
        #: valid programs (reaching deep into operators) to nothing but nonsense
        self.tame = 0

    def plausible(self) -> bool:
        return self.int_in(100) < self.tame

    def int_in(self, n: int) -> int:
        if self.draw is None:
            return self.rng.randrange(n)
        return self.draw(self.st.integers(0, n - 1))

    def pick(self, options):
        return options[self.int_in(len(options))]

    def chance(self, percent: int) -> bool:
        return self.int_in(100) < percent

    def request(self):
        self.tame = self.pick([95, 95, 80, 50, 0])
        args = {}
        if self.chance(15):
            args["release"] = [self.handle_value() for _ in range(self.int_in(5))]
        if self.chance(55):
            self.make_uploads()
            args["uploads"] = self.uploads
        kind = self.pick(["ops", "ops", "ops", "define", "define", "replay"])
        if kind == "ops":
            args["ops"] = [self.op() for _ in range(1 + self.int_in(12))]
        elif kind == "define":
            seq_id = self.pick(["s0", "s1", "s2", "s3", "s" * 65, 7])
            n_inputs = self.pick([0, 1, 1, 2, 3, -1, 2 ** 40])
            n_ops = 1 + self.int_in(12)
            ops = []
            for j in range(n_ops):
                self.seq_refs = [("i", k) for k in range(max(0, min(n_inputs, 3)))] + \
                                [("o", j2) for j2 in range(j)]
                self.seq_at = j
                ops.append(self.op())
            self.seq_refs = None
            args["define"] = {"id": seq_id, "n_inputs": n_inputs, "ops": ops}
            if self.chance(80):
                args["replay"] = self.replay(seq_id, n_ops, n_inputs)
        else:
            if self.chance(85):
                args["replay"] = self.replay(None, None, None)
            else:
                args["replay"] = self.replay(self.pick(["s0", "zz", 3]), self.int_in(15) - 1, 1)
            if self.chance(30):
                args["ops"] = [self.op()]
        if self.chance(20):
            args["fetch"] = [self.handle_value() for _ in range(self.int_in(4))]
        return args, self.tensors, kind

    # -- replay -------------------------------------------------------------------------------
    def replay(self, seq_id, n_ops, n_inputs):
        """A replay of the sequence just defined (``seq_id``, ``n_ops``, ``n_inputs``), or
        (``seq_id`` None) of one the session defined before, maybe continuing where it stopped."""
        known = seq_id is None
        i = self.int_in(1 << 16)
        spec = {"id": _Ref("seq", i) if known else seq_id}
        if known and self.chance(40):
            spec["from"] = _Ref("seq_from", i)
            spec["n"] = _Ref("seq_n", i, "continue")
        elif known:
            spec["n"] = _Ref("seq_n", i, 0 if self.chance(60) else self.pick([-1, -2, 1, -100]))
        else:
            spec["n"] = n_ops if self.chance(70) else self.int_in(n_ops + 3) - 1
            if self.chance(10):
                spec["from"] = self.pick([0, -1, 1, spec["n"]])
        inputs = [[k, self.direct_ref()] for k in range(3) if self.chance(90)]
        if known:
            inputs = [_Ref("seq_inputs", i, inputs)]
        else:
            inputs = inputs[:max(0, n_inputs if isinstance(n_inputs, int) and n_inputs < 4 else 3)]
        if self.chance(10):
            inputs.append(self.pick([[99, {"u": 0}], [0], "x", [-1, {"h": 1}], [True, {"h": 1}]]))
        spec["inputs"] = inputs

        def pairs(k):
            return [[self.int_in(14) - 1, self.pick([0, 0, 0, 1, 2])] if self.chance(85)
                    else self.pick([[0], "x", [0, 0, 0], [2 ** 63 - 1, 0], None]) for _ in range(self.int_in(k))]
        spec["keep"] = pairs(4)
        spec["fetch"] = pairs(3)
        spec["sync"] = [self.int_in(14) - 1 if self.chance(95) else "x" for _ in range(self.int_in(4))]
        return spec

    # -- uploads ------------------------------------------------------------------------------
    def make_uploads(self):
        for _ in range(self.int_in(5)):
            c = self.int_in(100)
            if c < 60:
                shape = list(self.pick(SHAPES))
                dtype = self.pick(UPLOAD_DTYPES)
                t = _small_tensor(shape, dtype, self.int_in(1 << 16))
                if dtype.is_floating_point and self.chance(15) and t.numel():
                    t.view(-1)[0] = self.pick([float("inf"), float("nan"), float("-inf"), 1e30])
                self.tensors.append(codec.encode(t, name=f"u{len(self.tensors)}",
                                                 compression=self.pick(["none", "none", "zstd"])))
                spec = {"n": len(self.tensors) - 1, "_shape": shape}
                if self.chance(20):
                    spec["sha"] = wire.content_digest(t)
            elif c < 70:
                spec = {"sha": _Ref("digest", self.int_in(1 << 16))}        # sent before (if any)
            elif c < 75:
                spec = {"sha": hashlib.sha256(self.pick([b"a", b"b"])).hexdigest()}   # unknown: "missing"
            elif c < 92:
                spec = self.view_upload()
            else:
                spec = self.pick([{"n": 99}, {"n": "0"}, {}, {"n": -1, "sha": 5}, {"sha": "x" * 65},
                                  {"of": {"h": 1}}, {"of": {"u": 0}, "view": [[1], [1]]}, 3])
                spec = dict(spec) if isinstance(spec, dict) else spec
            self.uploads.append(spec)

    def view_upload(self):
        """``{"of": ref, "view": [shape, stride, offset]}``: an as_strided view of a held
        tensor or an earlier upload, its geometry plausible or far outside the storage."""
        earlier = len(self.uploads)
        c = self.int_in(100)
        if c < 50:
            ref = {"h": _Ref("held", self.int_in(1 << 16))}
        elif c < 90 and earlier:
            ref = {"u": self.int_in(earlier)}
        else:
            ref = self.pick([{"u": earlier}, {"h": -5}, {"x": 0}, {"u": -1}])
        nd = self.int_in(5)

        def dim():
            return self.int_in(6) if self.chance(85) else self.pick(EVIL_INTS)
        shape = [dim() for _ in range(nd)]
        stride = [dim() for _ in range(nd)]
        if self.chance(10):
            stride = stride[:-1]
        offset = self.int_in(9) if self.chance(85) else self.pick(EVIL_INTS)
        return {"of": ref, "view": [shape, stride, offset], "_shape": shape}

    # -- references ---------------------------------------------------------------------------
    def handle_value(self):
        """A handle number: one the session holds, one it may soon hold, or nonsense."""
        c = self.int_in(100)
        if c < 60:
            return _Ref("held", self.int_in(1 << 16))
        if c < 75:
            return _Ref("future", self.int_in(12))
        return self.pick([0, -1, 2 ** 63 - 1, 10 ** 6, 2 ** 64, True, "1", None, 1.5])

    def direct_ref(self):
        """A tensor reference of plain ops: ``{"h": ...}`` or ``{"u": ...}``, or a bad one."""
        c = self.int_in(100)
        if c < 55 or (self.plausible() and not self.uploads):
            return {"h": _Ref("held", self.int_in(1 << 16))}
        if (c < 80 or self.plausible()) and self.uploads:
            return {"u": self.int_in(len(self.uploads))}
        if c < 88:
            return {"h": self.handle_value()}
        return self.pick([{"u": 99}, {"u": -1}, {"u": "0"}, {"o": [0, 0]}, {"i": 0}, {"h": 1, "u": 0}, {}, 5,
                          {"c": 1}, {"z": [0, 0]}])

    def seq_ref(self):
        """A tensor reference inside a sequence: input, constant, earlier output, or bad."""
        c = self.int_in(100)
        outs = [r for r in self.seq_refs if r[0] == "o"]
        ins = [r for r in self.seq_refs if r[0] == "i"]
        if (c < 40 or self.plausible()) and outs:
            return {"o": [self.pick(outs)[1], self.pick([0, 0, 0, 0, 0, 1, 2])]}
        if (c < 70 or self.plausible()) and ins:
            return {"i": self.pick(ins)[1]}
        if c < 88 or self.plausible():
            return {"c": _Ref("held", self.int_in(1 << 16))}
        return self.pick([{"o": [self.seq_at, 0]}, {"o": [99, 0]}, {"o": [0]}, {"i": 99}, {"i": -1},
                          {"c": 10 ** 6}, {"c": "x"}, {"h": 1}, {"u": 0}, {"o": [-1, 0]}])

    def tensor(self):
        ref = self.seq_ref() if self.seq_refs is not None else self.direct_ref()
        if self.chance(3) and not self.plausible():
            return self.pick([1, 2.5, None, {"l": []}, "t"])         # not a tensor at all
        return {"t": ref}

    # -- scalar arguments ---------------------------------------------------------------------
    def size_symbol(self):
        if self.seq_refs is not None and self.seq_at > 0 and self.chance(60):
            sym = [self.int_in(self.seq_at), self.pick([0, 0, 1, 2, 5])]
            if self.chance(20):
                sym.append(self.pick([2, -1, 0, 2 ** 62]))
            return {"z": sym}
        return {"z": self.pick([[0, 0], [99, 0], [-1, 0], [0, 0, 0], "x", [0]])}

    def int_(self):
        c = self.int_in(100)
        if c < 60 or self.plausible():
            return self.pick(SMALL_INTS)
        if c < 80:
            return self.pick(EVIL_INTS)
        if c < 88 and self.seq_refs is not None:
            return self.size_symbol()
        return self.pick([True, 1.5, None, "1", {"l": [1]}, {"f": "nan"}])

    def int_list(self, name: str):
        c = self.int_in(100)
        if c < 35 or self.plausible():      # a shape the session or this request holds
            mutate = self.chance(30) and not self.plausible()
            return _Ref("shape", self.int_in(1 << 16), (self.int_in(8), self.pick([-1, 0, 1, 2 ** 31 - 1])
                                                        if mutate else None, self.chance(20)))
        if c < 55:
            vals = [self.pick(SMALL_INTS) for _ in range(self.int_in(5))]
        elif c < 70:
            vals = [self.pick(EVIL_INTS) for _ in range(1 + self.int_in(4))]
        elif c < 74:
            vals = [self.pick([1, 0, 2 ** 31 - 1])] * self.pick([64, 5000, 10000])     # huge lists
        elif c < 78:                        # valid but big sizes: the byte and FLOP budgets
            vals = self.pick([[4096, 4096], [1 << 20, 1 << 20], [64, 3, 512, 512], [1 << 24], [2048, 2048]])
        elif c < 88 and self.seq_refs is not None:
            vals = [self.size_symbol() if self.chance(50) else self.pick(SMALL_INTS)
                    for _ in range(1 + self.int_in(4))]
        elif c < 94:
            return self.int_()                                                  # a bare int
        else:
            return self.pick([None, "x", {"l": [1.5]}, {"l": [{"l": [1]}]}, [1, 2], {"l": [None]}])
        return {"l": vals}

    def float_(self):
        c = self.int_in(100)
        if c < 50 or self.plausible():
            return self.pick([0.0, 1.0, -1.0, 0.5, 1e-12, 1e308, -0.0, 3.0])
        if c < 75:
            return self.pick([{"f": "inf"}, {"f": "-inf"}, {"f": "nan"}, {"f": "bogus"}, 2 ** 63 - 1])
        if self.draw is None:
            return self.rng.uniform(-3.4e38, 3.4e38)
        return self.draw(self.st.floats(allow_nan=False, allow_infinity=False, width=32))

    def value(self, arg):
        """A value for one schema argument."""
        t = str(arg.type)
        name = arg.name
        if t.startswith("Optional[") and self.chance(40):
            return None
        base = t[9:-1] if t.startswith("Optional[") else t
        if name == "dtype" or (base == "int" and "dtype" in name):
            if self.plausible():
                return {"dtype": self.pick(["float32", "float32", "int64", "float64", "bool"])}
            return self.pick([{"dtype": d} for d in DTYPE_NAMES] + [{"dtype": "float128"}, {"dtype": 3}, 6])
        if name == "layout":
            return self.pick([{"layout": "strided"}, {"layout": "sparse_coo"}, 0])
        if name == "memory_format":
            return self.pick([{"mf": m} for m in wire._MEMORY_FORMATS] + [{"mf": "nope"}])
        if base == "Device":
            return self.pick([{"device": "cpu"}, {"device": "cuda"}, {"device": "meta"}, {"device": "disk"}, "cpu"])
        if base == "Tensor":
            return self.tensor()
        if base in ("List[Tensor]", "List[Optional[Tensor]]"):
            n = self.int_in(5) if self.chance(95) else 5000
            return {"l": [None if "Optional" in base and self.chance(20) else self.tensor() for _ in range(n)]}
        if base in ("int", "SymInt"):
            return self.int_()
        if base in ("List[int]", "List[SymInt]"):
            return self.int_list(name)
        if base == "float":
            return self.float_()
        if base == "number":
            return self.float_() if self.chance(40) else self.int_()
        if base == "bool":
            return self.pick([True, False, False]) if self.plausible() else self.pick([True, False, 1, None])
        if base in ("List[float]",):
            return {"l": [self.float_() for _ in range(self.int_in(5))]}
        if base == "List[bool]":
            return {"l": [self.pick([True, False]) for _ in range(self.int_in(5))]}
        if base == "str":
            return self.pick(["none", "tanh", "mean", "floor", "trunc", "x" * 300, "", "sum"])
        return self.pick([None, 0, {"l": []}])

    # -- one operator -------------------------------------------------------------------------
    def op(self):
        if self.chance(2) and not self.plausible():
            return {"op": self.pick(list(FORBIDDEN_OPS)), "a": {"l": []}, "k": {}}
        if self.chance(1) and not self.plausible():
            return self.pick([{"a": {"l": []}}, {"op": "aten::relu.default"}, {"op": "aten::relu.default", "a": [1]},
                              {"op": "aten::relu.default", "a": {"l": []}, "k": []}, "relu", None])
        name = self.pick(self.names)
        func = self.ops[name]
        a, k = [], {}
        for arg in func._schema.arguments:
            positional = not arg.kwarg_only
            if arg.has_default_value() and self.chance(45):
                if positional:
                    positional = False      # later positionals would shift: pass the rest by keyword
                    self._by_keyword = True
                continue
            v = self.value(arg)
            if positional and not getattr(self, "_by_keyword", False) and self.chance(90):
                a.append(v)
            else:
                k[arg.name] = v
        self._by_keyword = False
        if self.chance(5) and not self.plausible():
            k[self.pick(["bogus", "self", "out", "x" * 80])] = self.int_()
        if self.chance(3) and not self.plausible():
            a.append(self.int_())                     # one positional too many
        op = {"op": name, "a": {"l": a}, "k": k}
        if self.chance(5):
            op.pop("k")
        return op


def _small_tensor(shape, dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    return torch.randint(-3 if dtype != torch.uint8 else 0, 6, shape, generator=g).to(dtype)


# -- the well-behaved client ---------------------------------------------------------------------
class ValidClient:
    """A client that only sends correct requests: a two-layer conv net (conv 3->8, relu,
    conv 8->4, adaptive average pool, flatten, linear 4->3) on fresh inputs, as plain
    operators and as a defined and replayed sequence, whose answers are compared with the
    same net run locally. ``send(request) -> ComputeResponse``."""

    def __init__(self, send: Callable, client_id: str = VALID_CLIENT, seed: int = 0):
        self.send = send
        self.client_id = client_id
        g = torch.Generator().manual_seed(seed)
        self.w1 = torch.randn(8, 3, 3, 3, generator=g) * 0.3
        self.b1 = torch.randn(8, generator=g) * 0.1
        self.w2 = torch.randn(4, 8, 3, 3, generator=g) * 0.3
        self.b2 = torch.randn(4, generator=g) * 0.1
        self.wl = torch.randn(3, 4, generator=g)
        self.bl = torch.randn(3, generator=g)
        self.session = ""
        self.weights: List[int] = []
        self.checks = 0
        self.passed = 0
        self.failures: List[str] = []
        self._seed = seed

    def expected(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(torch.nn.functional.conv2d(x, self.w1, self.b1, 1, 1))
        y = torch.nn.functional.conv2d(y, self.w2, self.b2, 2, 1)
        y = torch.nn.functional.adaptive_avg_pool2d(y, 1).flatten(1)
        return torch.nn.functional.linear(y, self.wl, self.bl)

    def _call(self, args, tensors=()) -> ComputeResponse:
        req = ComputeRequest(client_id=self.client_id, model="", entry="ops", session=self.session,
                             tensors=list(tensors), args_json=json.dumps(args))
        resp = self.send(req)
        if resp.status != StatusCode.OK:
            raise AssertionError(f"valid request refused: {StatusCode(resp.status).name} {resp.status_text}")
        return resp

    def setup(self) -> None:
        """Open a session, upload the weights once and define the net as a sequence."""
        self.session = ""
        ws = [self.w1, self.b1, self.w2, self.b2, self.wl, self.bl]
        resp = self._call({"uploads": [{"n": i} for i in range(len(ws))]},
                          [codec.encode(w, name=f"w{i}") for i, w in enumerate(ws)])
        result = json.loads(resp.result_json)
        self.session = result["session"]
        self.weights = result["uploaded"]
        ops = _net_ops({"i": 0}, lambda i: {"c": self.weights[i]}, lambda j: {"o": [j, 0]})
        self._call({"define": {"id": "net", "n_inputs": 1, "ops": ops}})

    def check(self) -> bool:
        """One checked inference (alternating replay and plain operators); True if correct."""
        self.checks += 1
        x = _small_tensor([1, 3, 8, 8], torch.float32, self._seed * 100003 + self.checks)
        try:
            if not self.session:
                self.setup()
            got = self._replay(x) if self.checks % 2 else self._plain(x)
            torch.testing.assert_close(got, self.expected(x), rtol=1e-4, atol=1e-5)
        except (AssertionError, KeyError, IndexError, ValueError) as e:
            self.failures.append(f"check {self.checks}: {type(e).__name__}: {str(e)[:300]}")
            self.session = ""          # start over with a fresh session next time
            return False
        self.passed += 1
        return True

    def _replay(self, x):
        resp = self._call({"uploads": [{"n": 0}],
                           "replay": {"id": "net", "n": len(NET_OPS), "inputs": [[0, {"u": 0}]],
                                      "fetch": [[len(NET_OPS) - 1, 0]]}},
                          [codec.encode(x, name="x")])
        self._call({"release": json.loads(resp.result_json)["uploaded"]})
        return codec.decode(resp.tensors[0])

    def _plain(self, x):
        """Operator by operator, each naming the previous one's output by its handle."""
        resp = self._call({"uploads": [{"n": 0}]}, [codec.encode(x, name="x")])
        x_h = json.loads(resp.result_json)["uploaded"][0]
        outs: List[int] = []
        for j in range(len(NET_OPS)):
            op = _net_ops({"h": x_h}, lambda i: {"h": self.weights[i]},
                          lambda k: {"h": outs[k] if k < len(outs) else -1})[j]
            resp = self._call({"ops": [op]})
            outs.append(json.loads(resp.result_json)["ops"][0]["t"]["h"])
        resp = self._call({"fetch": [outs[-1]]})
        self._call({"release": [x_h] + outs})      # a request releases before it fetches
        return codec.decode(resp.tensors[0])


NET_OPS = ("aten::convolution.default", "aten::relu.default", "aten::convolution.default",
           "aten::_adaptive_avg_pool2d.default", "aten::flatten.using_ints", "aten::linear.default")


def _net_ops(x, w, prev) -> list:
    """:class:`ValidClient`'s net as ``ops`` operators: ``x`` the input's reference,
    ``w(i)`` weight i's, ``prev(j)`` operator j's output's."""
    def L(*v):
        return {"l": list(v)}

    def T(r):
        return {"t": r}
    args = [
        L(T(x), T(w(0)), T(w(1)), L(1, 1), L(1, 1), L(1, 1), False, L(0, 0), 1),
        L(T(prev(0))),
        L(T(prev(1)), T(w(2)), T(w(3)), L(2, 2), L(1, 1), L(1, 1), False, L(0, 0), 1),
        L(T(prev(2)), L(1, 1)),
        L(T(prev(3)), 1, -1),
        L(T(prev(4)), T(w(4)), T(w(5))),
    ]
    return [{"op": name, "a": a, "k": {}} for name, a in zip(NET_OPS, args)]


# -- watching the server's processes -------------------------------------------------------------
class ProcessWatch:
    """The server node's process and its sandbox workers (its children): whether it is
    alive and still the same process, and the RSS of it and of its children together."""

    def __init__(self, pid: int):
        import psutil
        self.psutil = psutil
        self.pid = pid
        self.proc = psutil.Process(pid)
        self.created = self.proc.create_time()

    def alive(self) -> bool:
        try:
            return self.proc.is_running() and self.proc.create_time() == self.created
        except self.psutil.Error:
            return False

    def sample(self) -> dict:
        """{"alive", "server_rss_mb", "sandbox_rss_mb" (sum over children), "sandbox_max_mb"
        (the largest child), "sandboxes" (their count)}."""
        if not self.alive():
            return {"alive": False}
        try:
            rss = self.proc.memory_info().rss
            kids = []
            for c in self.proc.children(recursive=True):
                try:
                    kids.append(c.memory_info().rss)
                except self.psutil.Error:
                    continue
        except self.psutil.Error:
            return {"alive": False}
        mb = 2 ** 20
        return {"alive": True, "server_rss_mb": rss / mb, "sandbox_rss_mb": sum(kids) / mb,
                "sandbox_max_mb": max(kids, default=0) / mb, "sandboxes": len(kids)}


# -- the run --------------------------------------------------------------------------------------
@dataclass
class FuzzReport:
    """What a fuzz run saw; :meth:`problems` lists what breaks the server's promises."""
    requests: int = 0
    by_status: Counter = field(default_factory=Counter)
    by_kind: Counter = field(default_factory=Counter)
    by_reason: Counter = field(default_factory=Counter)      # refusals by :func:`refusal_reason`
    reason_examples: Dict[str, str] = field(default_factory=dict)   # reason -> its first status_text
    ok_by_kind: Counter = field(default_factory=Counter)
    weight_writes_refused: int = 0
    weight_writes_allowed: List[str] = field(default_factory=list)   # writes into registry weights answered OK
    internal: List[str] = field(default_factory=list)        # INTERNAL answers: request and text
    errors: List[str] = field(default_factory=list)          # exceptions instead of answers
    sandbox_crashes: List[str] = field(default_factory=list)  # workers that died under a request
    sandbox_kills: int = 0                                    # requests past max_request_s
    valid_checks: int = 0
    valid_passed: int = 0
    valid_failures: List[str] = field(default_factory=list)
    pings_failed: int = 0
    restarts: int = 0                                         # the server process changed or died
    server_rss_mb: List[float] = field(default_factory=list)  # [first, max]
    sandbox_rss_mb: List[float] = field(default_factory=list)  # sum over sandboxes: [first, max]
    sandbox_max_mb: float = 0.0                               # the largest single sandbox
    max_sandboxes: int = 0
    wall_s: float = 0.0

    def note(self, sample: dict) -> None:
        if not sample.get("alive"):
            self.restarts += 1
            return
        for key in ("server_rss_mb", "sandbox_rss_mb"):
            figs = getattr(self, key)
            if not figs:
                figs[:] = [sample[key], sample[key]]
            figs[1] = max(figs[1], sample[key])
        self.sandbox_max_mb = max(self.sandbox_max_mb, sample["sandbox_max_mb"])
        self.max_sandboxes = max(self.max_sandboxes, sample["sandboxes"])

    def problems(self) -> List[str]:
        out = []
        if self.internal:
            out.append(f"{len(self.internal)} INTERNAL answers, e.g. {self.internal[0]}")
        if self.errors:
            out.append(f"{len(self.errors)} requests raised instead of answering, e.g. {self.errors[0]}")
        if self.restarts:
            out.append(f"the server process died or changed {self.restarts} times")
        if self.pings_failed:
            out.append(f"{self.pings_failed} pings failed")
        if self.weight_writes_allowed:
            out.append(f"{len(self.weight_writes_allowed)} writes into registry weights were answered OK, "
                       f"e.g. {self.weight_writes_allowed[0]}")
        if self.valid_failures or self.valid_passed < self.valid_checks:
            out.append(f"the valid client failed {self.valid_checks - self.valid_passed} of "
                       f"{self.valid_checks} checks, e.g. {self.valid_failures[:1]}")
        return out

    def table(self) -> str:
        rows = [("requests sent", self.requests)]
        rows += [(f"  {StatusCode(code).name}", n) for code, n in sorted(self.by_status.items())]
        ok = self.by_status.get(int(StatusCode.OK), 0)
        rows.append(("OK rate", "%.1f %%" % (100.0 * ok / max(1, self.requests))))
        rows += [(f"  kind {k} (OK)", f"{n} ({self.ok_by_kind.get(k, 0)})") for k, n in sorted(self.by_kind.items())]
        rows += [(f"  refused: {k}", n) for k, n in sorted(self.by_reason.items(), key=lambda kv: -kv[1])]
        rows += [("registry-weight writes refused", self.weight_writes_refused),
                 ("registry-weight writes answered OK", len(self.weight_writes_allowed))]
        rows += [("exceptions (no answer)", len(self.errors)),
                 ("sandbox crashes (contained)", len(self.sandbox_crashes)),
                 ("sandbox kills (max_request_s)", self.sandbox_kills),
                 ("server RSS MiB (first / max)", "%.0f / %.0f" % tuple(self.server_rss_mb or (0, 0))),
                 ("sandboxes RSS MiB, sum (first / max)", "%.0f / %.0f" % tuple(self.sandbox_rss_mb or (0, 0))),
                 ("largest sandbox RSS MiB", "%.0f" % self.sandbox_max_mb),
                 ("sandboxes at once (max)", self.max_sandboxes),
                 ("valid-client checks passed", f"{self.valid_passed} / {self.valid_checks}"),
                 ("pings failed", self.pings_failed),
                 ("server restarts", self.restarts),
                 ("wall time s", "%.0f" % self.wall_s)]
        width = max(len(r[0]) for r in rows)
        return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


#: (text in a refusal's status_text, short reason), first match wins
REASONS = (
    ("max_session_mib", "max_session_mib"), ("max_client_mib", "max_client_mib"),
    ("max_request_gflop", "max_request_gflop"), ("client_gflop_per_s", "client_gflop_per_s"),
    ("max_sandboxes", "max_sandboxes"), ("max_request_s", "max_request_s"),
    ("max_request_bytes", "max_request_bytes"), ("max_sessions", "max_sessions"),
    ("another client", "another client"), ("shares with every client", "registry weight write"),
    ("allow-list", "allow-list"), ("sandbox of this client stopped", "sandbox crash"),
    ("unknown tensor handle", "unknown handle"), ("unknown session", "unknown session"),
    ("unknown sequence", "unknown sequence"), ("no replay of", "no stopped replay"),
    ("size symbol", "size symbol"), (" failed: ", "operator failed"), ("upload", "upload"),
    ("not JSON", "bad JSON"), ("args_json must be", "bad JSON"), ("reference", "bad reference"),
    ("replay", "bad replay"), ("define", "bad define"), ("elements", "max_input_elements"),
    ("not allowed", "argument not allowed"), ("unknown entry", "unknown entry"),
)


def refusal_reason(code: int, text: str) -> str:
    """A short reason for a refusal (a status other than OK) from its status text."""
    for needle, reason in REASONS:
        if needle in text:
            return reason
    return f"other {StatusCode(code).name}"


class _Tally:
    """Sends a generated request (``repeat`` times) and counts what came back."""

    def __init__(self, send: Callable, report: FuzzReport, lock):
        self.send, self.report, self.lock = send, report, lock

    def __call__(self, fr: FuzzRequest, state: FuzzState) -> Optional[int]:
        """Send it; the last status (None: no answer)."""
        status = None
        for _ in range(max(1, fr.repeat)):
            resp = self._one(fr)
            status = None if resp is None else resp.status
            if resp is not None:
                state.observe(fr.request, fr.args, resp, fr)
                if resp.status == StatusCode.OK and not fr.request.session:
                    sid = json.loads(resp.result_json or "{}").get("session")
                    if sid and fr.repeat > 1:
                        fr.request.session = sid        # the repeats go to the session it opened
        return status

    def _one(self, fr: FuzzRequest) -> Optional[ComputeResponse]:
        report = self.report
        try:
            resp = self.send(fr.request)
        except Exception as e:  # noqa: BLE001 - a transport failure is a finding, not a crash of the fuzzer
            with self.lock:
                report.requests += 1
                report.by_kind[fr.kind] += 1
                report.errors.append(f"{type(e).__name__}: {str(e)[:200]} for {fr.request.args_json[:300]}")
            return None
        with self.lock:
            report.requests += 1
            report.by_kind[fr.kind] += 1
            if not isinstance(resp, ComputeResponse) or not isinstance(resp.status, int):
                report.errors.append(f"answer {type(resp).__name__} for {fr.request.args_json[:300]}")
                return None
            try:
                code = StatusCode(resp.status)
            except ValueError:
                report.errors.append(f"unknown status {resp.status} for {fr.request.args_json[:300]}")
                return None
            report.by_status[int(code)] += 1
            text = resp.status_text or ""
            if code == StatusCode.OK:
                report.ok_by_kind[fr.kind] += 1
            else:
                reason = refusal_reason(code, text)
                report.by_reason[reason] += 1
                report.reason_examples.setdefault(reason, text[:300])
            if code == StatusCode.INTERNAL:
                report.internal.append(f"{text[:300]} <- {fr.request.args_json[:1500]}")
            elif code == StatusCode.STALE_HANDLE and "sandbox of this client stopped" in text:
                report.sandbox_crashes.append(f"{text[:200]} <- {fr.request.args_json[:1500]}")
            elif code == StatusCode.BUSY and "max_request_s" in text:
                report.sandbox_kills += 1
            if fr.info.get("writes_weight"):
                if code == StatusCode.OK:
                    report.weight_writes_allowed.append(fr.request.args_json[:300])
                elif code == StatusCode.UNAUTHORIZED:
                    report.weight_writes_refused += 1
        return resp


def load_weights(load: Optional[Callable]) -> list:
    """Have the server load the registry model whose weights fit requests name by digest
    (``load(model) -> True`` when loaded) and return those weights as
    ``(digest, shape, dtype)``; [] without ``load`` or when it fails."""
    from robot_offload.server import fuzz_shapes
    if load is None or not load(fuzz_shapes.WEIGHTS_MODEL):
        return []
    return fuzz_shapes.registry_weights(fuzz_shapes.WEIGHTS_MODEL)


def run_fuzz(send: Callable, n_requests: int, seed: int = 0, valid_every: int = 50,
             ping: Optional[Callable] = None, watch: Optional[ProcessWatch] = None,
             watch_every: int = 20, ops: Optional[Dict[str, object]] = None,
             progress: Optional[Callable] = None, report: Optional[FuzzReport] = None,
             load: Optional[Callable] = None, threads: int = 0) -> FuzzReport:
    """Send ``n_requests`` generated requests through ``send(ComputeRequest) ->
    ComputeResponse``, a :class:`ValidClient` check every ``valid_every`` of them, a
    ``ping()`` (True when answered OK) and a ``watch`` sample every ``watch_every``.
    ``load(model) -> bool`` loads a registry model on the server, whose weights fit
    requests then name by digest; ``threads`` more clients fuzz concurrently (identities
    of their own, :func:`make_request`), their requests counted in the same report.
    Never stops at a problem: everything is counted in the returned report."""
    import random
    import threading
    from hypothesis import HealthCheck, Phase, given, seed as hyp_seed, settings, strategies as st

    ops = ops or catalog()
    weights = load_weights(load)
    state = FuzzState(weights=weights)
    report = report or FuzzReport()
    valid = ValidClient(send, seed=seed)
    t0 = time.monotonic()
    lock = threading.Lock()
    tally = _Tally(send, report, lock)
    stop = threading.Event()

    def one(fr: FuzzRequest) -> None:
        tally(fr, state)

    def concurrent(i: int) -> None:
        rng = random.Random(seed * 7919 + i)
        own = FuzzState(clients=(f"fuzz-t{i}",), weights=weights)
        while not stop.is_set() and report.requests < n_requests:
            try:
                fr = make_request(own, ops, rng)
            except Exception as e:  # noqa: BLE001 - a generator bug is reported, not a hang
                with lock:
                    report.errors.append(f"generator: {type(e).__name__}: {e}")
                return
            if tally(fr, own) == StatusCode.BUSY:
                time.sleep(0.5)     # a refused client backs off rather than flood the count

    workers = [threading.Thread(target=concurrent, args=(i,), daemon=True) for i in range(threads)]
    for w in workers:
        w.start()

    last = {"valid": 0, "watch": 0, "progress": 0}

    def due(what: str, every: int) -> bool:
        """Whether ``every`` more requests were sent since ``what`` last ran (the
        concurrent clients add to the count too)."""
        if every and report.requests - last[what] >= every:
            last[what] = report.requests
            return True
        return False

    def between() -> None:
        if due("valid", valid_every):
            report.valid_checks += 1
            if valid.check():
                report.valid_passed += 1
            else:
                report.valid_failures.append(valid.failures[-1])
        if due("watch", watch_every):
            if ping is not None and not ping():
                report.pings_failed += 1
            if watch is not None:
                report.note(watch.sample())
        if progress is not None and due("progress", 500):
            progress(report)

    if watch is not None:
        report.note(watch.sample())
    strategy = st.data()
    while report.requests < n_requests:
        left = n_requests - report.requests

        @hyp_seed(seed + report.requests)
        @settings(max_examples=left, phases=[Phase.generate], deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(strategy)
        def step(data):
            fr = data.draw(request_strategy(state, ops))     # always drawn: hypothesis wants the
            if report.requests >= n_requests:                # same draws for the same choices
                return
            one(fr)
            between()
        step()
    stop.set()
    for w in workers:
        w.join(FUZZ_CONFIG["max_request_s"] + 60)
    report.wall_s = time.monotonic() - t0
    return report


# -- command line ---------------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m robot_offload.server.fuzz_ops", description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=10000, help="generated requests to send")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--valid-every", type=int, default=50, help="a valid-client check every N requests")
    p.add_argument("--workdir", default="", help="logs of roscore and the server (default: a temporary folder)")
    p.add_argument("--out", default="", help="write the report as JSON here")
    p.add_argument("--threads", type=int, default=2, help="clients fuzzing concurrently besides the main one")
    args = p.parse_args(argv)
    if args.requests <= 0 or args.valid_every < 0:
        p.error("--requests must be positive and --valid-every not negative")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    # The server runs in a ROS node of its own: its tools live under robot_offload.ros.
    from robot_offload.ros.server_process import RosServer

    workdir = args.workdir or tempfile.mkdtemp(prefix="fuzz_ops_")
    os.makedirs(workdir, exist_ok=True)
    server = RosServer(None, workdir, threads=2, params=FUZZ_CONFIG)
    try:
        transport = server.transport

        def send(req):
            return transport.call("compute", req, FUZZ_CONFIG["max_request_s"] + 40)

        def ping():
            try:
                return transport.call("ping", PingRequest(client_id="fuzz-ping"), 30).status == StatusCode.OK
            except Exception:  # noqa: BLE001 - counted as a failed ping
                return False

        def load(model):
            try:
                return transport.call("load_model", LoadModelRequest(client_id="fuzz-load", model=model),
                                      300).status == StatusCode.OK
            except Exception:  # noqa: BLE001 - no registry weights to fuzz with then
                return False

        def progress(r):
            print(f"[fuzz_ops] {r.requests} requests, {dict(r.by_status)}, valid {r.valid_passed}/"
                  f"{r.valid_checks}, {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        report = run_fuzz(send, args.requests, seed=args.seed, valid_every=args.valid_every, ping=ping,
                          watch=ProcessWatch(server.node.pid), progress=progress, load=load,
                          threads=max(0, args.threads))
    finally:
        server.close()
    print(report.table())
    problems = report.problems()
    for line in problems:
        print("PROBLEM:", line)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(vars(report), by_status={StatusCode(k).name: v for k, v in report.by_status.items()},
                           problems=problems, seed=args.seed, config=FUZZ_CONFIG, workdir=workdir), f, indent=1)
    print(f"logs in {workdir}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
