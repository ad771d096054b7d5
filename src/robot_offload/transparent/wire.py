"""How intercepted operator calls travel as data (JSON), and how the server reads them back.

An operator call is its name (``"aten::convolution.default"``) plus its arguments as a
JSON tree. Tensor arguments become references (``{"t": ref}``) whose meaning the caller
chooses (a server handle, an uploaded tensor, an output of an earlier operator of a
replayed sequence); everything else is a plain value: numbers (non-finite floats as
``{"f": "inf"}``), booleans, strings, ``None``, lists, and the few torch enums operators
take (dtype, device, layout, memory format).

Nothing here is executable: an operator name is resolved with attribute lookups in the
``aten`` and ``torchvision`` operator namespaces only, after checking it against a pattern
and the allow-list of dense operators (:mod:`~robot_offload.transparent.allowlist`), and
values are rebuilt from a fixed set of forms. A tree that is too deep, too long or of an
unknown form is refused with :class:`WireError`.
"""

import hashlib
import json
import math
import re
from typing import Callable

import torch

from robot_offload.codec import byte_view
from robot_offload.errors import CodecError

#: The ``compute`` entry that runs intercepted operators (transparent, record_replay).
ENTRY = "ops"
NAMESPACES = ("aten", "torchvision")
MAX_DEPTH = 8
MAX_ITEMS = 4096
MAX_STRING = 256
_OP_NAME = re.compile(r"^([a-z]+)::([A-Za-z0-9_]+)(?:\.([A-Za-z0-9_]+))?$")

_DTYPES = {str(d).replace("torch.", ""): d for d in (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int8,
    torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128)}
_LAYOUTS = {"strided": torch.strided}
_MEMORY_FORMATS = {"contiguous_format": torch.contiguous_format, "channels_last": torch.channels_last,
                   "preserve_format": torch.preserve_format, "channels_last_3d": torch.channels_last_3d}


class WireError(CodecError):
    """A request names an operator or holds a value that the wire format does not allow."""


class Unsupported(Exception):
    """An argument the wire format cannot carry (the robot runs that operator itself)."""


def content_digest(t: torch.Tensor) -> str:
    """sha256 of a tensor's dtype, shape and bytes: how an upload names a tensor the
    server may already hold (robot and server compute it alike)."""
    h = hashlib.sha256(f"{t.dtype}|{tuple(t.shape)}|".encode())
    h.update(byte_view(t.cpu()))
    return h.hexdigest()


def op_name(func) -> str:
    """``aten::add.Tensor`` for an OpOverload."""
    return f"{func._schema.name}.{func._overloadname}"


_OP_CACHE = {}


def resolve_op(name: str):
    """The OpOverload called ``name``; refuses anything outside the allowed namespaces and
    anything not on the allow-list (:func:`allowlist.check_op`)."""
    op = _OP_CACHE.get(name)
    if op is not None:
        return op
    if not isinstance(name, str) or len(name) > MAX_STRING:
        raise WireError("operator name must be a short string")
    m = _OP_NAME.match(name)
    if m is None:
        raise WireError(f"malformed operator name {name[:80]!r}")
    ns, base, overload = m.group(1), m.group(2), m.group(3) or "default"
    if ns not in NAMESPACES:
        raise WireError(f"operator namespace {ns!r} not allowed; allowed: {list(NAMESPACES)}")
    from robot_offload.transparent import allowlist     # it imports this module
    allowlist.check_op(f"{ns}::{base}.{overload}")
    if ns == "torchvision":
        import torchvision  # noqa: F401  (registers torchvision::nms, roi_align, ...)
    try:
        packet = getattr(getattr(torch.ops, ns), base)
        op = getattr(packet, overload)
    except (AttributeError, RuntimeError):
        raise WireError(f"unknown operator {name!r}") from None
    if not isinstance(op, torch._ops.OpOverload):
        raise WireError(f"{name!r} is not an operator overload")
    _OP_CACHE[name] = op
    return op


def encode(value, tensor_ref: Callable, depth: int = 0):
    """JSON tree for an argument or return value; ``tensor_ref(t)`` gives a tensor's ref.
    Raises :class:`Unsupported` for values the format cannot carry."""
    if isinstance(value, torch.Tensor):
        return {"t": tensor_ref(value)}
    if value is None or isinstance(value, (bool, str)):
        if isinstance(value, str) and len(value) > MAX_STRING:
            raise Unsupported("long string argument")
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"f": repr(value)}
    if isinstance(value, (list, tuple)):
        if depth >= MAX_DEPTH:
            raise Unsupported("argument nested too deeply")
        return {"l": [encode(v, tensor_ref, depth + 1) for v in value]}
    if isinstance(value, torch.dtype):
        if value.is_complex:      # the server computes on real tensors only (allowlist)
            raise Unsupported(f"dtype {value}")
        return {"dtype": str(value).replace("torch.", "")}
    if isinstance(value, torch.device):
        return {"device": value.type}
    if isinstance(value, torch.layout):
        return {"layout": str(value).replace("torch.", "")}
    if isinstance(value, torch.memory_format):
        return {"mf": str(value).replace("torch.", "")}
    raise Unsupported(f"argument of type {type(value).__name__}")


class Decoder:
    """Rebuilds values from JSON trees, counting items so one request cannot explode."""

    def __init__(self, tensor_of: Callable, device: torch.device, size_of: Callable = None):
        self.tensor_of = tensor_of
        self.device = device
        self.size_of = size_of      # {"z": [p, i]} (a recorded sequence's size symbol), or None
        self.items = 0

    def __call__(self, obj, depth: int = 0):
        self.items += 1
        if self.items > MAX_ITEMS or depth > MAX_DEPTH:
            raise WireError("argument tree too large or too deep")
        if obj is None or isinstance(obj, (bool, int, float)):
            return obj
        if isinstance(obj, str):
            if len(obj) > MAX_STRING:
                raise WireError("string argument too long")
            return obj
        if isinstance(obj, list):
            raise WireError("bare JSON list; lists are {'l': [...]}")
        if not isinstance(obj, dict) or len(obj) != 1:
            raise WireError(f"malformed argument {str(obj)[:80]}")
        (key, val), = obj.items()
        if key == "t":
            return self.tensor_of(val)
        if key == "z" and self.size_of is not None:
            # [op, i] or [op, i, factor]: integer i of what op returned (times factor)
            if not (isinstance(val, list) and len(val) in (2, 3)
                    and all(type(v) is int and v >= 0 for v in val) and val[2:] != [0]):
                raise WireError(f"malformed size symbol {str(val)[:40]}")
            return self.size_of(val)
        if key == "l":
            if not isinstance(val, list):
                raise WireError("'l' must hold a list")
            return [self(v, depth + 1) for v in val]
        if key == "f":
            if val not in ("inf", "-inf", "nan"):
                raise WireError(f"bad float {str(val)[:20]!r}")
            return float(val)
        table = {"dtype": _DTYPES, "layout": _LAYOUTS, "mf": _MEMORY_FORMATS}.get(key)
        if table is not None:
            if not isinstance(val, str) or val not in table:
                raise WireError(f"unknown {key} {str(val)[:40]!r}")
            return table[val]
        if key == "device":
            if val not in ("cpu", "cuda", "meta", "mps", "xpu"):
                raise WireError(f"unknown device type {str(val)[:20]!r}")
            # Every device the program names means "where the server computes".
            return self.device
        raise WireError(f"unknown argument form {key[:20]!r}")


def tensor_meta(t: torch.Tensor) -> dict:
    """What the robot needs to stand in for a server tensor."""
    return {"s": list(t.shape), "st": list(t.stride()), "o": int(t.storage_offset()),
            "d": str(t.dtype).replace("torch.", "")}


def size_leaves(tree) -> list:
    """The integers a return tree (JSON, as :func:`encode` with :func:`tensor_meta` writes
    it) makes known: each tensor's shape, then plain int values, depth first. Element ``i``
    of an operator's list is what the size symbol ``{"z": [op, i]}`` of a recorded sequence
    stands for. :func:`value_size_leaves` gives the same list from the operator's output
    itself (the server), so both sides number the symbols alike."""
    out = []
    stack = [tree]
    while stack:
        node = stack.pop()
        if type(node) is int:
            out.append(node)
        elif isinstance(node, dict) and len(node) == 1:
            (key, val), = node.items()
            if key == "t" and isinstance(val, dict):
                out.extend(val.get("s") or ())
            elif key == "l" and isinstance(val, list):
                stack.extend(reversed(val))
    return out


def value_size_leaves(value) -> list:
    """:func:`size_leaves` of ``encode(value, tensor_meta)``, without encoding it."""
    out = []
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, torch.Tensor):
            out.extend(v.shape)
        elif type(v) is int:
            out.append(v)
        elif isinstance(v, (list, tuple)):
            stack.extend(reversed(v))
    return out


def meta_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise WireError(f"unknown dtype {name!r}") from None


def tensor_ref_refs(obj, out: list) -> list:
    """Every tensor reference in a JSON tree (depth-first order)."""
    if isinstance(obj, dict):
        if "t" in obj and len(obj) == 1:
            out.append(obj["t"])
        elif "l" in obj and len(obj) == 1 and isinstance(obj["l"], list):
            for v in obj["l"]:
                tensor_ref_refs(v, out)
    return out


def op_tensor_refs(op: dict) -> list:
    """Every tensor reference of a define-form operator ``{"op", "a", "k"}``: its
    positional arguments', then each keyword value's."""
    refs = tensor_ref_refs(op.get("a"), [])
    if isinstance(op.get("k"), dict):           # keyword values, each a JSON tree
        for v in op["k"].values():
            tensor_ref_refs(v, refs)
    return refs


def leaves(obj) -> list:
    """The leaves of an operator's arguments or result, depth first (lists, tuples and
    dicts nest: the only containers aten uses). Cheaper than torch's pytree on the
    per-operator paths of robot and server."""
    out = []
    stack = [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, (list, tuple)):
            stack.extend(reversed(o))
        elif isinstance(o, dict):
            stack.extend(reversed(list(o.values())))
        else:
            out.append(o)
    return out


def tensor_leaves(args, kwargs) -> list:
    """The tensors of an operator call, depth first, positional then keyword arguments in
    their order: how an in-place or pass-through result names the input it returns."""
    return [v for v in leaves((list(args), list(kwargs.values()))) if isinstance(v, torch.Tensor)]


def request_json(body: dict) -> str:
    """The ``args_json`` of an ``ops`` request."""
    return json.dumps(body)


def reply_json(text: str) -> dict:
    """The ``result_json`` of an ``ops`` reply (``{}`` when empty)."""
    return json.loads(text or "{}")


def same_shapes(actual, recorded) -> bool:
    """Whether two return trees hold tensors of the same shapes and dtypes, in order."""
    def shapes(tree):
        return [(m.get("s"), m.get("d")) for m in metas_in(tree)]
    return shapes(actual) == shapes(recorded)


def single_new_tensor(ret):
    """The meta of a return tree that is one new tensor (not one of the call's inputs), or
    None (any other return: the generic decoding)."""
    if type(ret) is dict and len(ret) == 1:
        meta = ret.get("t")
        if meta is not None and "a" not in meta:
            return meta
    return None


def metas_in(tree) -> list:
    """The tensor metas of a return tree, depth first (a loop: a recursive closure
    would keep the tree alive until the garbage collector runs)."""
    out = []
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, dict) and len(node) == 1 and "t" in node:
            out.append(node["t"])
        elif isinstance(node, dict) and len(node) == 1 and "l" in node:
            stack.extend(reversed(node["l"]))
    return out
