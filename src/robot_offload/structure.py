"""Flatten nested model outputs (tensors in lists, tuples and dicts) to a list of tensors
plus a JSON description, and rebuild them on the other side.

torchvision's detection models return ``[{"boxes": ..., "labels": ..., "scores": ...}]``,
segmentation models an ``OrderedDict``, classifiers a tensor. The description is plain
JSON built from a closed set of node kinds, so rebuilding it runs no code.
"""

import json
from typing import Any, List, Tuple

import torch

from robot_offload.errors import CodecError

_MAX_DEPTH = 32


def flatten(obj: Any) -> Tuple[List[torch.Tensor], str]:
    """Return ``(leaves, structure_json)`` for a nest of tensors, lists, tuples and dicts
    with string keys. Python scalars (int, float, bool, None, str) are kept in the JSON."""
    leaves: List[torch.Tensor] = []

    def walk(o, depth):
        if depth > _MAX_DEPTH:
            raise CodecError("output nesting too deep")
        if isinstance(o, torch.Tensor):
            leaves.append(o)
            return {"t": len(leaves) - 1}
        if isinstance(o, dict):
            if not all(isinstance(k, str) for k in o):
                raise CodecError("only dicts with string keys can be sent")
            return {"d": [[k, walk(v, depth + 1)] for k, v in o.items()]}
        if isinstance(o, tuple):
            return {"u": [walk(v, depth + 1) for v in o]}
        if isinstance(o, list):
            return {"l": [walk(v, depth + 1) for v in o]}
        if o is None or isinstance(o, (bool, int, float, str)):
            return {"v": o}
        raise CodecError(f"cannot send a {type(o).__name__} in a model output")

    spec = walk(obj, 0)
    return leaves, json.dumps(spec, separators=(",", ":"))


def unflatten(leaves: List[torch.Tensor], structure_json: str) -> Any:
    """Inverse of :func:`flatten`. Raises :class:`CodecError` for malformed descriptions."""
    try:
        spec = json.loads(structure_json)
    except (TypeError, ValueError) as e:
        raise CodecError(f"structure is not JSON: {e}") from e
    used = set()

    def build(node, depth):
        if depth > _MAX_DEPTH or not isinstance(node, dict) or len(node) != 1:
            raise CodecError("malformed output structure")
        (kind, val), = node.items()
        if kind == "t":
            if not isinstance(val, int) or not 0 <= val < len(leaves) or val in used:
                raise CodecError(f"structure refers to tensor {val!r} of {len(leaves)}")
            used.add(val)
            return leaves[val]
        if kind == "d" and isinstance(val, list):
            out = {}
            for item in val:
                if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str)):
                    raise CodecError("malformed dict entry in output structure")
                out[item[0]] = build(item[1], depth + 1)
            return out
        if kind in ("l", "u") and isinstance(val, list):
            items = [build(v, depth + 1) for v in val]
            return items if kind == "l" else tuple(items)
        if kind == "v" and (val is None or isinstance(val, (bool, int, float, str))):
            return val
        raise CodecError(f"unknown node {kind!r} in output structure")

    out = build(spec, 0)
    if len(used) != len(leaves):
        raise CodecError(f"structure uses {len(used)} of {len(leaves)} tensors")
    return out
