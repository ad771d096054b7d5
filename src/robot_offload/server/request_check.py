"""Well-formedness of a request, checked by the server before any executor sees it.

Executors check what only they can (shapes a model accepts, graph names, handles in a
session); this module checks what every request of a method must satisfy, whatever the
executor, so that a malformed request is refused even by an executor that ignores the
malformed part (``forward`` does not read ``args_json``; a session entry may not decode a
tensor it is not asked to use):

* the request is the method's protocol dataclass, its text fields are strings of at most
  :data:`MAX_TEXT_CHARS` characters;
* compute: ``deadline_s`` is a number in [0, :data:`~robot_offload.protocol.MAX_DEADLINE_S`];
  ``request_id`` is empty or 8-64 lowercase hex digits; ``output_codec`` / ``output_compression`` are known; ``args_json`` is empty or
  a JSON object of at most :data:`MAX_ARGS_JSON_CHARS` nesting at most
  :data:`MAX_ARGS_JSON_DEPTH` levels; at most :data:`MAX_TENSORS`
  tensors, each with a consistent header (:func:`robot_offload.codec.check_header`: types,
  codec, dtype, shape, sizes, data length when uncompressed);
* memory: the bytes on the wire *and* the decoded size of all tensors together are at most
  ``max_request_bytes`` (a few KB of zstd can claim gigabytes; this is refused before
  anything is decompressed). Ping payloads count against the same limit;
* ping: ``versions_json`` is a string of at most
  :data:`~robot_offload.compat.MAX_VERSIONS_JSON_CHARS` (its form is the server's
  ping handler's to check, :meth:`robot_offload.compat.Versions.from_json`).

Nothing is decoded, decompressed or evaluated here; everything is metadata arithmetic.
"""

import json

from robot_offload import codec
from robot_offload.compat import MAX_VERSIONS_JSON_CHARS
from robot_offload.codec import EncodedTensor
from robot_offload.errors import CodecError, OffloadError
from robot_offload.protocol import MAX_DEADLINE_S, METHODS, ID_RE, StatusCode

#: Longest client_id, model, entry, session, codec name, weights hash or token (characters).
MAX_TEXT_CHARS = 1024
#: Longest args_json (characters).
MAX_ARGS_JSON_CHARS = 4 * 1024 * 1024
#: Deepest nesting of arrays and objects in args_json. Python's json module refuses
#: depths near a thousand on 3.11 (RecursionError) but parses them on 3.12, so the limit is
#: explicit: the same request is refused whatever Python the server runs, and the
#: executors that walk argument trees recursively never meet one deeper than this (the
#: deepest real requests, record_replay's nested argument templates, nest about ten).
MAX_ARGS_JSON_DEPTH = 64
#: Most tensors in one compute request.
MAX_TENSORS = 16384

_TEXT_FIELDS = {
    "load_model": ("client_id", "model", "weights_hash", "auth"),
    "compute": ("client_id", "model", "entry", "session", "output_codec", "output_compression", "auth"),
    "ping": ("client_id", "auth"),
}


class BadRequest(OffloadError):
    """A request refused before dispatch; ``code`` is the StatusCode to answer with."""

    def __init__(self, code: StatusCode, text: str):
        super().__init__(text)
        self.code = code
        self.text = text


def _bad(text: str) -> BadRequest:
    return BadRequest(StatusCode.BAD_REQUEST, text)


def check_request(method: str, request, max_request_bytes: int) -> None:
    """Raise :class:`BadRequest` (BAD_REQUEST or TOO_LARGE) unless ``request`` is a
    well-formed request of ``method``; see the module docstring."""
    if method not in METHODS:
        raise BadRequest(StatusCode.UNKNOWN_ENTRY, f"unknown method {method!r}")
    request_type = METHODS[method][0]
    if not isinstance(request, request_type):
        raise _bad(f"{method} needs a {request_type.__name__}, got {type(request).__name__}")
    for name in _TEXT_FIELDS[method]:
        value = getattr(request, name, "")
        if not isinstance(value, str):
            raise _bad(f"{name} must be a string, got {type(value).__name__}")
        if len(value) > MAX_TEXT_CHARS:
            raise _bad(f"{name} has {len(value)} characters; at most {MAX_TEXT_CHARS}")
    if method == "ping":
        if not isinstance(request.payload, (bytes, bytearray, memoryview)):
            raise _bad("ping payload must be bytes")
        if len(request.payload) > max_request_bytes:
            raise BadRequest(StatusCode.TOO_LARGE, f"ping payload of {len(request.payload)} bytes; "
                             f"max_request_bytes is {max_request_bytes}")
        versions = request.versions_json
        if not isinstance(versions, str):
            raise _bad(f"versions_json must be a string, got {type(versions).__name__}")
        if len(versions) > MAX_VERSIONS_JSON_CHARS:
            raise BadRequest(StatusCode.TOO_LARGE, f"versions_json has {len(versions)} characters; "
                             f"at most {MAX_VERSIONS_JSON_CHARS}")
    elif method == "compute":
        _check_compute(request, max_request_bytes)


def _depth(value) -> int:
    """Nesting depth of parsed JSON (a scalar is 0, ``{}`` and ``[]`` are 1), without
    recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list)):
            deepest = max(deepest, d)
            stack.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v))
    return deepest


def _check_compute(req, max_request_bytes: int) -> None:
    deadline = req.deadline_s
    if (isinstance(deadline, bool) or not isinstance(deadline, (int, float))
            or not 0.0 <= deadline <= MAX_DEADLINE_S):
        raise _bad(f"deadline_s must be a number of seconds in [0, {MAX_DEADLINE_S:g}], got {deadline!r}")
    if req.request_id and not (isinstance(req.request_id, str) and ID_RE.fullmatch(req.request_id)):
        raise _bad("request_id must be empty or 8-64 lowercase hex digits")
    if req.output_codec not in codec.CODECS:
        raise _bad(f"unknown output_codec {req.output_codec!r}; known: {list(codec.CODECS)}")
    if req.output_compression not in codec.COMPRESSIONS:
        raise _bad(f"unknown output_compression {req.output_compression!r}; "
                   f"known: {list(codec.COMPRESSIONS)}")
    args = req.args_json
    if not isinstance(args, str):
        raise _bad(f"args_json must be a string, got {type(args).__name__}")
    if len(args) > MAX_ARGS_JSON_CHARS:
        raise BadRequest(StatusCode.TOO_LARGE, f"args_json has {len(args)} characters; "
                         f"at most {MAX_ARGS_JSON_CHARS}")
    if args.strip():
        try:
            parsed = json.loads(args)
        except (ValueError, RecursionError) as e:
            raise _bad(f"args_json is not JSON: {str(e)[:200]}") from None
        if not isinstance(parsed, dict):
            raise _bad(f"args_json must be a JSON object, got {type(parsed).__name__}")
        if _depth(parsed) > MAX_ARGS_JSON_DEPTH:
            raise _bad(f"args_json nests deeper than {MAX_ARGS_JSON_DEPTH} levels")
    tensors = req.tensors
    if not isinstance(tensors, (list, tuple)):
        raise _bad(f"tensors must be a list, got {type(tensors).__name__}")
    if len(tensors) > MAX_TENSORS:
        raise BadRequest(StatusCode.TOO_LARGE, f"{len(tensors)} tensors; at most {MAX_TENSORS}")
    wire = decoded = 0
    for i, t in enumerate(tensors):
        if not isinstance(t, EncodedTensor):
            raise _bad(f"tensor {i} is a {type(t).__name__}, not an EncodedTensor")
        try:
            decoded += codec.check_header(t, max_request_bytes)
        except codec.PayloadTooLarge as e:
            raise BadRequest(StatusCode.TOO_LARGE, str(e)) from None
        except CodecError as e:
            raise _bad(str(e)) from None
        wire += len(t.data)
        if max(wire, decoded) > max_request_bytes:
            raise BadRequest(StatusCode.TOO_LARGE, f"the tensors of this request need "
                             f"{max(wire, decoded)}+ bytes (on the wire or decoded); "
                             f"max_request_bytes is {max_request_bytes}")
