"""Adversarial ``ops`` requests: hypothesis draws each request's form, operators and
arguments from their schemas, plausible or hostile; the symbolic references are bound to
what the server has answered just before the request is sent."""

import hashlib
import json
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

from robot_offload import codec
from robot_offload.protocol import ComputeRequest
from robot_offload.server.fuzz.state import DTYPE_NAMES
from robot_offload.server.fuzz.state import EVIL_INTS
from robot_offload.server.fuzz.state import FIT_PERCENT
from robot_offload.server.fuzz.state import FORBIDDEN_OPS
from robot_offload.server.fuzz.state import FuzzState
from robot_offload.server.fuzz.state import SHAPES
from robot_offload.server.fuzz.state import SMALL_INTS
from robot_offload.server.fuzz.state import SPECIALS
from robot_offload.server.fuzz.state import SessionState
from robot_offload.server.fuzz.state import UPLOAD_DTYPES
from robot_offload.transparent import wire

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
    """A shape-aware request (:class:`.shapes.FitGen`) of ``client``, in one of its
    sessions (or a new one), now and then one aimed at a server limit."""
    import random
    from robot_offload.server.fuzz import shapes as fuzz_shapes
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


