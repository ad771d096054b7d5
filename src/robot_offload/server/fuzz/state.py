"""What the fuzzer knows: the operators it draws from, the server configuration it runs
against, and the state the server's answers built (sessions, handles, shapes, sequences)."""

import json
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

from robot_offload.protocol import ComputeRequest, ComputeResponse, StatusCode
from robot_offload.transparent import wire

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
#: percent of requests built shape-aware (:mod:`.shapes`); the rest are adversarial
FIT_PERCENT = 70
#: per mille of fit requests aimed at one limit (:meth:`.shapes.FitGen.special`)
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
        self.weights = list(weights)        # registry weights (digest, shape, dtype): shapes.registry_weights
        self.built = 0                      # fit requests built: mixed into their seeds
        self.sessions: Dict[str, SessionState] = {}
        self.by_client: Dict[str, List[str]] = {c: [] for c in self.clients}

    def observe(self, req: ComputeRequest, args, resp: ComputeResponse, fr=None) -> None:
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


