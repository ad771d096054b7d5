"""What every part of the server shares: the refusal every check raises, the loaded
model executors run on, and the executor interface."""

import threading
from dataclasses import dataclass, field
from typing import Optional

import torch

from robot_offload.protocol import ComputeRequest, ComputeResponse, StatusCode


class RequestRejected(Exception):
    """Raised inside the server to answer with ``code`` and ``text``."""

    def __init__(self, code: StatusCode, text: str):
        super().__init__(text)
        self.code = code
        self.text = text


def bad_request(text: str) -> RequestRejected:
    return RequestRejected(StatusCode.BAD_REQUEST, text)


@dataclass
class LoadedModel:
    """A registry model the server built, and what executors derive from it (its graph,
    parsed cuts, shape records): that state lives and dies with the model."""
    name: str
    module: torch.nn.Module
    weights_hash: str
    device: torch.device
    load_time_s: float
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    derived: Optional[object] = field(default=None, repr=False, compare=False)


class Executor:
    """One ``compute`` entry of one server. Subclasses set :attr:`ENTRY` and
    :attr:`NEEDS_MODEL` and implement :meth:`__call__`; their state (caches, sessions,
    frames in flight) lives on the instance, which the server builds for itself."""

    ENTRY = ""
    #: False: the entry runs on tensors the client uploaded, not on a registry model
    #: (``loaded`` is None and the request's ``model`` field is ignored).
    NEEDS_MODEL = True
    #: True: a request holds one of the server's compute slots while it runs, taken in the
    #: clients' fair turn and refused BUSY when it cannot start before its deadline
    #: (:mod:`robot_offload.server.scheduler`). Entries whose requests wait for one
    #: another (``lop_part``) or that bound their clients themselves (``ops``) say False.
    QUEUED = False
    #: True: the entry also has :meth:`prepare` (the model input of a request, checked and
    #: decoded) and :meth:`respond`, so requests of several clients for one model and
    #: input shape can run as one batch (``max_batch``).
    BATCHABLE = False

    def __init__(self, server):
        self.server = server

    def __call__(self, loaded: Optional[LoadedModel], req: ComputeRequest) -> ComputeResponse:
        raise NotImplementedError

    def prepare(self, loaded: LoadedModel, req: ComputeRequest) -> torch.Tensor:
        raise NotImplementedError

    def respond(self, loaded: LoadedModel, req: ComputeRequest, x: torch.Tensor, y,
                compute_s: float, **result) -> ComputeResponse:
        """The reply for outputs ``y`` of input ``x``; ``result`` goes into result_json."""
        raise NotImplementedError

    def status(self) -> dict:
        """This entry's own figures for the server's health report ({} = none)."""
        return {}
