"""The client/server protocol as plain dataclasses, independent of how it is carried.

Each dataclass mirrors one ROS service (``srv/*.srv``); :mod:`robot_offload.ros.conversions`
maps between the two, and :class:`~robot_offload.transport.inproc.InProcessTransport`
hands them to the server directly. A backend only ever sees these types, which is what
lets one backend run over ROS, in process, or over a future transport unchanged.

``Compute`` is deliberately generic: ``entry`` names a server-side executor (``forward``
for whole-model inference; later backends add their own for partition tails, single
operators on tensor handles, replayed sequences and spatial parts), ``args_json`` carries
its arguments as data, and ``session`` scopes server-side tensor handles.
"""

import enum
import re
from dataclasses import dataclass, field
from typing import List

from robot_offload.codec import EncodedTensor
from robot_offload import errors


class StatusCode(enum.IntEnum):
    """Mirrors the constants of ``msg/Status.msg`` (a test checks they agree)."""

    OK = 0
    BAD_REQUEST = 1
    UNKNOWN_MODEL = 2
    MODEL_NOT_LOADED = 3
    HASH_MISMATCH = 4
    TOO_LARGE = 5
    UNAUTHORIZED = 6
    UNKNOWN_ENTRY = 7
    STALE_HANDLE = 8
    INTERNAL = 9
    BUSY = 10
    INCOMPATIBLE = 11


_CODE_ERRORS = {
    StatusCode.MODEL_NOT_LOADED: errors.ModelNotLoaded,
    StatusCode.HASH_MISMATCH: errors.HashMismatch,
    StatusCode.STALE_HANDLE: errors.StaleHandle,
    StatusCode.UNAUTHORIZED: errors.Unauthorized,
    StatusCode.INCOMPATIBLE: errors.Incompatible,
}


def raise_for_status(code: int, text: str) -> None:
    """Turn a reply's status into the matching exception; return when it is OK."""
    if code == StatusCode.OK:
        return
    try:
        code = StatusCode(code)
    except ValueError:
        pass
    raise _CODE_ERRORS.get(code, errors.RemoteError)(code, text)


@dataclass
class LoadModelRequest:
    client_id: str
    model: str
    weights_hash: str = ""
    auth: str = ""


@dataclass
class LoadModelResponse:
    status: int
    status_text: str = ""
    weights_hash: str = ""
    device: str = ""
    load_time_s: float = 0.0


#: Longest deadline a compute request may state (s); 0 states none.
MAX_DEADLINE_S = 3600.0
#: an id a client makes up (a request's ``request_id``, a ``lop`` frame's): matched whole
ID_RE = re.compile(r"[0-9a-f]{8,64}")


@dataclass
class ComputeRequest:
    client_id: str
    model: str
    entry: str
    tensors: List[EncodedTensor] = field(default_factory=list)
    args_json: str = "{}"
    session: str = ""
    output_codec: str = "raw"
    output_compression: str = "none"
    auth: str = ""
    #: how long the client waits for the answer, from sending it (s); 0 = no bound. The
    #: server refuses work it cannot start in time (BUSY) instead of queueing it past this.
    #: Not signed: changing it can only get the request refused or dropped, as dropping
    #: it on the way would.
    deadline_s: float = 0.0
    #: the client's name for this request (8-64 lowercase hex digits, or "" for none): the
    #: ``cancel`` entry takes it, to drop the request while it still waits for a slot
    request_id: str = ""

    @property
    def payload_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


@dataclass
class ComputeResponse:
    status: int
    status_text: str = ""
    tensors: List[EncodedTensor] = field(default_factory=list)
    structure_json: str = ""
    result_json: str = "{}"
    server_compute_s: float = 0.0
    server_total_s: float = 0.0
    server_queue_s: float = 0.0      # waited for a compute slot (s), part of server_total_s
    #: how long a new request would wait for a compute slot as this reply left (s): the
    #: server's load, which clients of several servers balance on
    server_backlog_s: float = 0.0

    @property
    def payload_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


@dataclass
class PingRequest:
    client_id: str
    payload: bytes = b""
    auth: str = ""
    versions_json: str = ""     # robot_offload.compat.Versions; "" for a plain probe


@dataclass
class PingResponse:
    status: int
    status_text: str = ""
    server_id: str = ""
    loaded_models: List[str] = field(default_factory=list)
    device: str = ""
    payload: bytes = b""
    versions_json: str = ""     # the server's robot_offload.compat.Versions
    server_backlog_s: float = 0.0   # as in ComputeResponse


#: The methods every transport carries: name -> (request type, response type).
METHODS = {
    "load_model": (LoadModelRequest, LoadModelResponse),
    "compute": (ComputeRequest, ComputeResponse),
    "ping": (PingRequest, PingResponse),
}


def method_of(request) -> str:
    """The method whose request ``request`` is (``ping`` for a PingRequest)."""
    for method, (request_type, _) in METHODS.items():
        if isinstance(request, request_type):
            return method
    raise TypeError(f"{type(request).__name__} is not a request of the protocol")
