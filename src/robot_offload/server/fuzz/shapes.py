"""Shape-aware requests for the ``ops`` fuzzer (:mod:`robot_offload.server.fuzz`).

Arguments drawn type by type from an operator's schema almost never fit the tensors they
are applied to, so most such requests stop at their first operator and the server's
deeper machinery (budgets, zeroing, in-place writes, views, replays with size symbols,
the sandbox limits) is rarely reached. :class:`FitGen` builds requests that are meant to
run: every tensor it uses has a known shape and dtype (an upload it makes, or a handle
the server answered with its ``"s"``/``"d"`` metadata), and each operator's arguments are
derived from those shapes (matching channels, valid dims, broadcastable operands, index
tensors within range, views of the same element count) and then tried locally on small
CPU tensors of the same shapes; only a call that runs locally is sent (a few attempts per
operator). Values of handles the server holds are unknown here, so a call may still fail
on the server: that is a fuzz finding like any other, never a crash.

It also builds the requests aimed at the server's limits (:meth:`FitGen.special`): a
session or a client holding more than ``max_session_mib`` / ``max_client_mib``, a request
over ``max_request_gflop``, the same heavy request sent back to back (``client_gflop_per_s``),
a request whose work hides in a window (a max-pool with a huge kernel: priced by its
window, so refused by ``max_request_gflop``, else it would run past ``max_request_s``), registry weights named by digest and then written (refused), and
new identities past ``max_sandboxes``.

Randomness comes from a ``random.Random`` the caller seeds (from a hypothesis draw in the
main fuzz loop, from the thread's seed in the concurrent clients), so a run is repeatable.
"""

import json
import os
import random
from typing import Dict, List, Optional

import torch

from robot_offload import codec
from robot_offload.transparent import allowlist, wire

#: shapes of the tensors a fit request uploads (small: they are also run locally)
FIT_SHAPES = ((4,), (8,), (6,), (2, 3), (3, 4), (4, 4), (1, 8), (2, 3, 4), (2, 2, 2), (1, 3, 8, 8),
              (2, 4, 6, 6), (1, 4, 8, 8), (2, 8, 5, 5), (1, 2, 4, 4, 4), (2, 3, 10))
#: a held tensor is used by fit requests only below this many elements (it is also made locally)
MAX_FIT_ELEMENTS = 1 << 15
#: a file each local trial call is appended to before it runs (JSON lines), to find the call
#: that took the fuzzer down if one ever does; empty: none
TRACE = os.environ.get("ROBOT_OFFLOAD_FUZZ_TRACE", "")
#: registry model whose weights digest uploads name
WEIGHTS_MODEL = "resnet18"
#: in-place operators tried on registry weights (each must be refused UNAUTHORIZED)
WRITES = (("aten::add_.Tensor", 2), ("aten::mul_.Scalar", "s"), ("aten::zero_.default", 0),
          ("aten::fill_.Scalar", "s"), ("aten::copy_.default", 2), ("aten::relu_.default", 0),
          ("aten::clamp_.default", "c"), ("aten::as_strided_.default", "v"))
#: identities that appear now and then, so more clients ask for sandboxes than max_sandboxes allows
EXTRA_CLIENTS = tuple(f"fuzz-x{i}" for i in range(8))


class _T:
    """A tensor a fit request may use: its wire reference and a local stand-in of the same
    shape and dtype (the upload itself, or random values for a server handle)."""
    __slots__ = ("ref", "value")

    def __init__(self, ref, value: torch.Tensor):
        self.ref, self.value = ref, value


def _rand(shape, dtype: torch.dtype, rng: random.Random, high: Optional[int] = None) -> torch.Tensor:
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    if high is not None:
        return torch.randint(0, max(1, high), tuple(shape), generator=g).to(dtype)
    if dtype.is_floating_point:
        return torch.randn(tuple(shape), generator=g).to(dtype)
    if dtype == torch.bool:
        return torch.rand(tuple(shape), generator=g) > 0.5
    return torch.randint(0, 5, tuple(shape), generator=g).to(dtype)


def local_value(shape, dtype_name: str, rng: random.Random) -> Optional[torch.Tensor]:
    """A stand-in for a server tensor of this shape and dtype name, or None (unknown,
    or too large to stand in for)."""
    dtype = wire._DTYPES.get(dtype_name)
    if dtype is None or dtype.is_complex or not isinstance(shape, list):
        return None
    n = 1
    for s in shape:
        n *= s
    if n > MAX_FIT_ELEMENTS:
        return None
    return _rand(shape, dtype, rng)


class _Rollback(Exception):
    pass


class FitGen:
    """Builds one shape-aware request (see the module docstring). ``held``: the session's
    tensors as ``(handle, shape, dtype name)``; ``seqs``: its sequences defined by fit
    requests (id -> {"n", "inputs": [(shape, dtype, high)]}); ``weights``: registry
    weights as ``(digest, shape, dtype)``."""

    def __init__(self, rng: random.Random, ops: Dict[str, object], held=(), seqs=None, weights=()):
        self.rng = rng
        self.ops = ops
        self.names = sorted(ops)
        self.tensors: List[codec.EncodedTensor] = []
        self.uploads: List[dict] = []
        self.upload_meta: List[Optional[tuple]] = []
        self.held = [_T({"h": h}, v) for h, s, d in held
                     for v in [local_value(s, d, rng)] if v is not None]
        self.seqs = seqs or {}
        self.weights = list(weights)
        self.seq_inputs: Optional[list] = None   # inside a define: the inputs made so far
        self.pool: List[_T] = []
        self.info: dict = {}                    # what the caller records (sequences, expectations)

    # -- tensors ----------------------------------------------------------------------------
    def upload(self, value: torch.Tensor, high: Optional[int] = None) -> _T:
        """A new tensor: an upload of this request, or (in a define) a new sequence input."""
        if self.seq_inputs is not None:
            k = len(self.seq_inputs)
            self.seq_inputs.append((list(value.shape), value.dtype, high, value))
            return _T({"i": k}, value)
        self.tensors.append(codec.encode(value.contiguous(), name=f"u{len(self.tensors)}"))
        self.uploads.append({"n": len(self.tensors) - 1})
        self.upload_meta.append((list(value.shape), str(value.dtype).replace("torch.", "")))
        return _T({"u": len(self.uploads) - 1}, value)

    def new(self, shape, dtype=torch.float32, high=None) -> _T:
        return self.upload(_rand(shape, dtype, self.rng, high), high)

    def first_tensor(self) -> _T:
        floats = [t for t in self.pool if t.value.dtype.is_floating_point]
        if floats and self.rng.random() < 0.6:
            return self.rng.choice(floats)
        if self.pool and self.rng.random() < 0.3:
            return self.rng.choice(self.pool)
        dtype = self.rng.choice([torch.float32] * 8 + [torch.float64, torch.int64, torch.bool])
        return self.new(self.rng.choice(FIT_SHAPES), dtype)

    def other_tensor(self, name: str, ctx: dict, base: str) -> _T:
        """A tensor argument after the first, shaped after the first (``ctx["self"]``)."""
        rng = self.rng
        x = ctx.get("self")
        if x is None:
            t = self.first_tensor()
            ctx["self"] = t
            return t
        shape, dtype = list(x.value.shape), x.value.dtype
        r = len(shape)
        if name in ("index", "indices", "idx") or (name == "input" and ctx.get("weight_first")):
            high = min(shape) if shape else 1
            if ctx.get("weight_first") and shape:
                high = shape[0]
            dims = rng.choice([shape, [3], [2, 2], [1]]) if r else [1]
            return self.new(dims, torch.int64, high=max(1, high))
        if name in ("mask", "condition"):
            return self.new(shape, torch.bool)
        if rng.random() < 0.15 and self.pool:
            same = [t for t in self.pool if list(t.value.shape) == shape and t.value.dtype == dtype]
            if same:
                return rng.choice(same)
        c1 = shape[1] if r > 1 else (shape[0] if r else 1)
        last = shape[-1] if r else 1
        choices = [shape, shape, [c1], [last], [], [1] * r]
        if r >= 1:
            choices.append(shape[:-2] + [last, rng.choice([2, 3, 4])] if r >= 2 else [last, 3])
            choices.append([rng.choice([2, 4]), last])
        if r >= 2:
            b = list(shape)
            b[rng.randrange(r)] = 1
            choices.append(b)
            choices.append(shape[:-2] + [shape[-1], shape[-2]])
        if r >= 3:
            k = rng.choice([1, 3])
            cout = rng.choice([2, 4, 8])
            choices += [[cout, c1] + [k] * (r - 2)] * 3
            choices.append([c1, cout] + [k] * (r - 2))
        choice = rng.choice(choices)
        dt = dtype if rng.random() < 0.9 or base != "Tensor" else torch.float32
        return self.new(choice, dt)

    # -- scalar arguments -----------------------------------------------------------------
    def ints(self, name: str, ctx: dict, opname: str):
        """A List[int] argument (wire value = local value)."""
        rng = self.rng
        x = ctx.get("self")
        shape = list(x.value.shape) if x is not None else list(rng.choice(FIT_SHAPES))
        r = len(shape)
        sp = max(1, r - 2)
        n = 1
        for s in shape:
            n *= s
        if name in ("dims", "dim") and "permute" in opname:
            p = list(range(r))
            rng.shuffle(p)
            return p
        if name in ("dim", "dims"):
            return sorted(rng.sample(range(r), rng.randint(1, r))) if r else []
        if name in ("size", "shape", "sizes"):
            if any(k in opname for k in ("view", "reshape", "unflatten")):
                divs = [d for d in range(1, n + 1) if n % d == 0]
                d = rng.choice(divs) if divs else 1
                return rng.choice([[n], [-1], [d, n // d], [d, -1], shape, shape[::-1], [1] + shape])
            if "expand" in opname:
                return rng.choice([[2] + shape, [s if s != 1 else 3 for s in shape], [-1] * r])
            return list(rng.choice(FIT_SHAPES))
        if name in ("kernel_size",):
            return [rng.choice([1, 2, 3])] * sp
        if name == "stride":
            return rng.choice([[], [1] * sp, [2] * sp])
        if name == "padding":
            return rng.choice([[0] * sp, [1] * sp])
        if name == "dilation":
            return [1] * sp
        if name == "output_padding":
            return [0] * sp
        if name == "output_size":
            return [rng.choice([1, 2, 3])] * sp
        if name in ("repeats", "dims"):
            return [rng.choice([1, 2])] * r
        if name == "pad":
            return [rng.choice([0, 1])] * (2 * sp)
        if name == "normalized_shape":
            return shape[-1:]
        if name in ("shifts",):
            return [1]
        if name in ("split_sizes", "split_size"):
            return [1, shape[0] - 1] if r and shape[0] > 1 else [1]
        return [rng.choice([0, 1, 2])] * rng.choice([1, sp])

    def int_(self, name: str, ctx: dict):
        rng = self.rng
        x = ctx.get("self")
        shape = list(x.value.shape) if x is not None else []
        r = len(shape)
        if name in ("dim", "dim0", "dim1", "start_dim", "end_dim", "source", "destination"):
            return rng.randrange(-r, r) if r else rng.choice([0, -1])
        if name in ("k",):
            return rng.randint(1, max(1, min(shape) if shape else 1))
        if name in ("groups",):
            return 1
        if name == "num_groups":
            c = shape[1] if r > 1 else 1
            return rng.choice([d for d in range(1, c + 1) if c % d == 0])
        if name in ("upscale_factor", "downscale_factor", "chunks", "num_samples"):
            return rng.choice([1, 2])
        if name in ("start",):
            return 0
        if name in ("end", "length", "split_size"):
            return rng.choice([1, 2])
        if name == "step":
            return 1
        if name == "index":
            return rng.choice([0, -1])
        return rng.choice([0, 1, 2, -1])

    def value(self, arg, ctx: dict, opname: str):
        """(wire value, local value) for one schema argument."""
        rng = self.rng
        t = str(arg.type)
        name = arg.name
        base = t[9:-1] if t.startswith("Optional[") else t
        if t.startswith("Optional[") and base != "Tensor" and rng.random() < 0.5:
            return None, None
        if name == "dtype" or (base in ("int", "ScalarType") and "dtype" in name):
            d = rng.choice(["float32", "float32", "float64", "int64"])
            return {"dtype": d}, wire._DTYPES[d]
        if name == "layout" or base == "Layout":
            return {"layout": "strided"}, torch.strided
        if name == "memory_format" or base == "MemoryFormat":
            return {"mf": "contiguous_format"}, torch.contiguous_format
        if base == "Device":
            return {"device": "cpu"}, torch.device("cpu")
        if base == "Generator":
            return None, None
        if base == "Tensor":
            if t.startswith("Optional[") and rng.random() < 0.3:
                return None, None
            if ctx.get("self") is None:
                tt = self.first_tensor()
                ctx["self"] = tt
            else:
                tt = self.other_tensor(name, ctx, base)
            return {"t": tt.ref}, tt.value
        if base in ("List[Tensor]", "List[Optional[Tensor]]"):
            if ctx.get("self") is None:
                ctx["self"] = self.first_tensor()
            x = ctx["self"]
            if name == "indices":
                items = [self.other_tensor("index", ctx, base)]
            else:
                items = [x] + [self.new(list(x.value.shape), x.value.dtype) for _ in range(rng.randint(0, 2))]
            return {"l": [{"t": i.ref} for i in items]}, [i.value for i in items]
        if base in ("int", "SymInt"):
            v = self.int_(name, ctx)
            return v, v
        if base in ("List[int]", "List[SymInt]") or base.startswith("List[int]") or base.startswith("List[SymInt]"):
            v = self.ints(name, ctx, opname)
            return {"l": v}, v
        if base == "float":
            v = {"p": 0.5, "eps": 1e-5, "momentum": 0.1, "alpha": 1.0, "beta": 1.0}.get(
                name, rng.choice([0.0, 0.5, 1.0, 2.0]))
            return v, v
        if base == "number" or base == "Scalar":
            v = rng.choice([0, 1, 2, 0.5, -1.0])
            return v, v
        if base == "bool":
            v = False if name in ("train", "pin_memory", "transposed", "ceil_mode") else rng.choice([True, False])
            return v, v
        if base == "List[float]":
            v = [rng.choice([1.0, 2.0])] * 2
            return {"l": v}, v
        if base == "List[bool]":
            v = [True, False]
            return {"l": v}, v
        if base == "str":
            x = ctx.get("self")
            r = x.value.dim() if x is not None else 1
            v = {"approximate": rng.choice(["none", "tanh"]), "rounding_mode": rng.choice(["floor", "trunc"]),
                 "indexing": "ij", "reduce": rng.choice(["sum", "mean", "amax", "prod"]),
                 "equation": "abcdefg"[:r] + "->" + "abcdefg"[:r][::-1], "mode": "constant",
                 "side": "left", "padding_mode": "zeros", "interpolation": "bilinear"}.get(name, "none")
            return v, v
        return None, None

    # -- one operator ---------------------------------------------------------------------
    def op(self, name: Optional[str] = None, tries: int = 10):
        """One operator call that runs locally on stand-ins of its tensors, as
        ``(wire op, local output)``; None if no attempt ran."""
        for _ in range(tries):
            opname = name or self.rng.choice(self.names)
            func = self.ops[opname]
            mark = (len(self.tensors), len(self.uploads), len(self.upload_meta),
                    len(self.seq_inputs) if self.seq_inputs is not None else 0)
            ctx = {"weight_first": "embedding" in opname}
            a, k, la, lk = [], {}, [], {}
            by_keyword = False
            try:
                for arg in func._schema.arguments:
                    if arg.has_default_value() and self.rng.random() < 0.5:
                        by_keyword = by_keyword or not arg.kwarg_only
                        continue
                    w, v = self.value(arg, ctx, opname)
                    if arg.kwarg_only or by_keyword:
                        k[arg.name], lk[arg.name] = w, v
                    else:
                        a.append(w)
                        la.append(v)
                allowlist.check_arguments(func, la, lk)
                if TRACE:
                    with open(TRACE, "a") as f:
                        f.write(json.dumps({"op": opname, "a": a, "k": k, "shapes": [
                            list(v.shape) if isinstance(v, torch.Tensor) else repr(v)[:200]
                            for v in la + list(lk.values())]}, default=str) + "\n")
                with torch.inference_mode():
                    out = func(*la, **lk)
                if any(isinstance(t, torch.Tensor) and t.numel() > MAX_FIT_ELEMENTS for t in wire.leaves(out)):
                    raise _Rollback()
                return {"op": opname, "a": {"l": a}, "k": k}, out
            except Exception:  # noqa: BLE001 - these arguments do not fit: try again
                del self.tensors[mark[0]:], self.uploads[mark[1]:], self.upload_meta[mark[2]:]
                if self.seq_inputs is not None:
                    del self.seq_inputs[mark[3]:]
        return None

    # -- requests -----------------------------------------------------------------------------
    def request(self):
        """(args, tensors, kind): plain operators, a define + replay, or a replay of a
        sequence defined before."""
        rng = self.rng
        args = {}
        self.pool = list(self.held)
        c = rng.random()
        if c < 0.55 or not self.names:
            ops = []
            for _ in range(rng.randint(1, 5)):
                got = self.op()
                if got is not None:
                    ops.append(got[0])
            args["ops"] = ops
            kind = "fit-ops"
        elif c < 0.85 or not self.seqs:
            args.update(self.define())
            kind = "fit-define"
        else:
            args["replay"] = self.replay_known()
            kind = "fit-replay"
        if self.uploads:
            args = dict(uploads=self.uploads, **args)
        if rng.random() < 0.3 and self.held:
            big = [t.ref["h"] for t in self.held if t.value.numel() > 4096]
            args["release"] = big[:2] or [rng.choice(self.held).ref["h"]]
        if rng.random() < 0.15 and self.held:
            args["fetch"] = [rng.choice(self.held).ref["h"]]
        return args, self.tensors, kind

    def define(self) -> dict:
        rng = self.rng
        self.seq_inputs = []
        consts = [_T({"c": t.ref["h"]}, t.value) for t in self.held]
        first = self.new(rng.choice(FIT_SHAPES))
        self.pool = [first] + consts[:4]
        ops = []
        for j in range(rng.randint(1, 6)):
            if j and rng.random() < 0.25:
                got = self.size_symbol_op(ops)
            else:
                got = self.op()
            if got is None:
                continue
            op, out = got
            ops.append((op, out))
            leaves = [t for t in wire.leaves(out) if isinstance(t, torch.Tensor)]
            self.pool += [_T({"o": [len(ops) - 1, i]}, v) for i, v in enumerate(leaves[:3])]
        if not ops:
            ops.append(({"op": "aten::relu.default", "a": {"l": [{"t": {"i": 0}}]}, "k": {}}, first.value.relu()))
        inputs = self.seq_inputs
        self.seq_inputs = None
        seq_id = f"f{rng.randrange(8)}"
        for k, (shape, dtype, high, value) in enumerate(inputs):
            self.upload(value, high)
        n = len(ops)
        self.info["define"] = (seq_id, {"n": n, "inputs": [(s, d, h) for s, d, h, _ in inputs]})
        upto = n if n == 1 or rng.random() < 0.7 else rng.randint(1, n - 1)
        if upto < n:
            self.info["partial"] = (seq_id, upto)
        outs = [j for j in range(upto) if any(isinstance(t, torch.Tensor) for t in wire.leaves(ops[j][1]))]
        replay = {"id": seq_id, "n": upto, "inputs": [[k, {"u": k}] for k in range(len(inputs))],
                  "keep": [[j, 0] for j in outs[-2:]], "fetch": [[outs[-1], 0]] if outs else [],
                  "sync": [upto - 1]}
        return {"define": {"id": seq_id, "n_inputs": len(inputs), "ops": [o for o, _ in ops]}, "replay": replay}

    def size_symbol_op(self, ops):
        """A reshape of an earlier output to sizes named by size symbols (``{"z": [j, i]}``:
        size i of operator j's output), so a replay fills them from what it computed."""
        rng = self.rng
        cands = [(j, t) for j, (_, out) in enumerate(ops) for t in [out]
                 if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.numel() > 0]
        if not cands:
            return None
        j, t = rng.choice(cands)
        sizes = wire.value_size_leaves(t)
        i = rng.randrange(len(sizes))
        if t.numel() % max(1, sizes[i]):
            return None
        op = {"op": "aten::reshape.default", "a": {"l": [{"t": {"o": [j, 0]}}, {"l": [{"z": [j, i]}, -1]}]}, "k": {}}
        return op, t.reshape(sizes[i], -1)

    def replay_known(self) -> dict:
        """A replay of a sequence a fit request defined, on fresh inputs of its shapes
        (continuing it where it stopped, sometimes)."""
        rng = self.rng
        seq_id = rng.choice(sorted(self.seqs))
        seq = self.seqs[seq_id]
        for shape, dtype, high in seq["inputs"]:
            self.upload(_rand(shape, dtype, rng, high), high)
        spec = {"id": seq_id, "n": seq["n"], "inputs": [[k, {"u": k}] for k in range(len(seq["inputs"]))],
                "fetch": [[seq["n"] - 1, 0]] if rng.random() < 0.5 else []}
        if seq.get("stopped") and rng.random() < 0.7:
            spec["from"] = seq["stopped"]
            self.info["continued"] = seq_id
        return spec

    # -- the server's limits ----------------------------------------------------------------
    def special(self, kind: str):
        """(args, tensors, repeat) of a request aimed at one limit (see the module docstring)."""
        rng = self.rng
        if kind == "hog":             # bytes: max_session_mib, max_client_mib
            mib = rng.choice([8, 24, 40, 56, 72])
            args = {"ops": [{"op": "aten::zeros.default", "a": {"l": [{"l": [mib * 2 ** 18]}]},
                             "k": {"dtype": {"dtype": "float32"}}}]}
            return args, [], 1
        if kind in ("gflop", "burst"):  # one request over max_request_gflop; heavy ones back to back
            n = 1100 if kind == "gflop" else 600
            mm = {"op": "aten::mm.default", "a": {"l": [{"t": {"o": [0, 0]}}, {"t": {"o": [0, 0]}}]}, "k": {}}
            ops = [{"op": "aten::ones.default", "a": {"l": [{"l": [n, n]}]}, "k": {}}, mm, dict(mm)]
            sid = f"heavy{n}"
            return {"define": {"id": sid, "n_inputs": 0, "ops": ops},
                    "replay": {"id": sid, "n": 3, "fetch": [[2, 0]] if rng.random() < 0.2 else []}}, [], \
                (1 if kind == "gflop" else 3)
        if kind == "slow":            # seconds of work in a few elements: priced by its window
            ops = [{"op": "aten::rand.default", "a": {"l": [{"l": [1, 1, 768, 768]}]}, "k": {}},
                   {"op": "aten::max_pool2d.default",
                    "a": {"l": [{"t": {"o": [0, 0]}}, {"l": [384, 384]}, {"l": [1, 1]}]}, "k": {}}]
            return {"define": {"id": "slow", "n_inputs": 0, "ops": ops}, "replay": {"id": "slow", "n": 2}}, [], 1
        if kind == "weights":         # registry weights by digest, then read and written
            picks = rng.sample(self.weights, min(len(self.weights), rng.randint(1, 3)))
            args = {"uploads": [{"sha": d} for d, _, _ in picks]}
            dtype = picks[0][2]
            opname, how = rng.choice(WRITES)
            a = [{"t": {"u": 0}}]
            if how == 2:
                a.append({"t": {"u": 0}})
            elif how == "s":
                a.append(0.0)
            elif how == "c":
                a += [0.0, 1.0]
            elif how == "v":
                a += [{"l": [1]}, {"l": [1]}]
            ops = []
            if rng.random() < 0.5 and dtype.is_floating_point:
                ops.append({"op": "aten::mul.Scalar", "a": {"l": [{"t": {"u": 0}}, 2.0]}, "k": {}})
            if rng.random() < 0.8 and dtype.is_floating_point:
                ops.append({"op": opname, "a": {"l": a}, "k": {}})
                self.info["writes_weight"] = True
            args["ops"] = ops
            return args, [], 1
        if kind == "extra":           # another identity: a sandbox of its own, or BUSY
            t = self.new([4, 4])
            return {"uploads": self.uploads, "ops": [{"op": "aten::relu.default", "a": {"l": [{"t": t.ref}]},
                                                      "k": {}}]}, self.tensors, 1
        raise ValueError(kind)


def registry_weights(model: str = WEIGHTS_MODEL) -> list:
    """``(digest, shape, dtype)`` of a registry model's parameters and buffers, built here
    exactly as the server builds it (seeded random weights)."""
    from robot_offload.models import get_spec
    module = get_spec(model).build()
    return [(wire.content_digest(t), list(t.shape), t.dtype)
            for t in list(module.parameters()) + list(module.buffers()) if t.dim() > 0]
