"""The offload server's logic, independent of ROS.

:class:`OffloadServer` answers the three protocol methods (``load_model``, ``compute``,
``ping``). It never raises out of :meth:`OffloadServer.handle`: every failure becomes a
status code and a text, so one bad request cannot take the server down for every robot.

``compute`` dispatches on ``entry`` to an executor. Executors are registered with
:func:`executor`; this module registers ``forward`` (the whole model, for full offload).
Later backends register their own (partition tails, per-operator execution on tensor
handles, replays, spatial parts) without touching this dispatch.
"""

import json
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional

import torch

from robot_offload import auth, codec, request_check, structure
from robot_offload.codec import PayloadTooLarge
from robot_offload.errors import CodecError, ConfigError, UnknownModelError
from robot_offload.models import get_spec, weights_hash
from robot_offload.protocol import (ComputeRequest, ComputeResponse, LoadModelRequest,
                                    LoadModelResponse, PingRequest, PingResponse, StatusCode)

log = logging.getLogger(__name__)


class RequestRejected(Exception):
    """Raised inside the server to answer with ``code`` and ``text``."""

    def __init__(self, code: StatusCode, text: str):
        super().__init__(text)
        self.code = code
        self.text = text


@dataclass
class ServerConfig:
    """Settings of the offload server (``~`` parameters of offload_server)."""

    device: str = "auto"                 # auto, cpu, cuda, cuda:N
    # TF32 convolutions and matrix products on CUDA: faster, but PyTorch's default (TF32
    # convolutions) put full_offload's ResNet-18 logits 1.8e-3 from the robot's float32 on an
    # H100; with TF32 off every registry model's outputs stayed within 4.2e-5 of their scale
    # (median 1.5e-6), as lossless plans promise. Off by default.
    allow_tf32: bool = False
    max_request_bytes: int = 256 * 1024 * 1024  # summed tensor payload of one request (bytes)
    max_input_elements: int = 64 * 1024 * 1024  # elements of one decoded input tensor
    allowed_models: tuple = ()           # empty: every registry model may be loaded
    # client_id -> models that client may load and use ({} = no per-client lists; key "*":
    # every client not listed). Refusals are UNAUTHORIZED. client_id is only as
    # trustworthy as the (shared-secret) authentication: see robot_offload.auth.
    client_models: dict = field(default_factory=dict)
    auth_max_skew_s: float = auth.DEFAULT_MAX_SKEW_S  # with a secret: token age / clock difference (s)
    weights_dir: str = ""                # optional: <weights_dir>/<model>.pt|.safetensors
    transparent: bool = True             # accept per-operator sessions (transparent, record_replay)
    max_session_mib: int = 2048          # tensors one transparent session may hold (MiB; XML-RPC ints are 32-bit)
    max_sessions: int = 16               # transparent sessions kept (least recently used dropped)

    def validate(self) -> "ServerConfig":
        if self.max_session_mib <= 0 or self.max_sessions <= 0:
            raise ConfigError("max_session_mib and max_sessions must be positive")
        if self.max_request_bytes <= 0 or self.max_input_elements <= 0:
            raise ConfigError("max_request_bytes and max_input_elements must be positive")
        if not self.auth_max_skew_s > 0:
            raise ConfigError(f"auth_max_skew_s must be positive, got {self.auth_max_skew_s}")
        if not isinstance(self.client_models, dict) or not all(
                isinstance(k, str) and isinstance(v, (list, tuple)) and all(isinstance(m, str) for m in v)
                for k, v in self.client_models.items()):
            raise ConfigError("client_models must map client ids to lists of model names, "
                              f"got {self.client_models!r}")
        resolve_device(self.device)
        return self


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError as e:
        raise ConfigError(f"unknown device {name!r}") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} asked for but CUDA is not available")
    return dev


@dataclass
class LoadedModel:
    name: str
    module: torch.nn.Module
    weights_hash: str
    device: torch.device
    load_time_s: float


Executor = Callable[["OffloadServer", LoadedModel, ComputeRequest], ComputeResponse]
EXECUTORS: Dict[str, Executor] = {}
#: Entries that run on tensors the client uploaded, not on a registry model: their
#: executor gets ``loaded=None`` and the request's ``model`` field is ignored.
MODEL_FREE_ENTRIES = set()


def executor(entry: str, needs_model: bool = True):
    """Register ``fn(server, loaded_model, request) -> ComputeResponse`` for ``entry``."""
    def deco(fn):
        EXECUTORS[entry] = fn
        if not needs_model:
            MODEL_FREE_ENTRIES.add(entry)
        return fn
    return deco


class OffloadServer:
    """Holds the loaded models and answers requests; thread-safe (one ROS thread per
    connection calls :meth:`handle` concurrently)."""

    def __init__(self, config: Optional[ServerConfig] = None, auth_secret: Optional[bytes] = None,
                 auth_keys: Optional[Dict[str, bytes]] = None):
        self.config = (config or ServerConfig()).validate()
        # With a shared secret or per-client keys (client_id -> key) every request must
        # carry a valid token (robot_offload.auth).
        self._verifier = (auth.Verifier(auth_secret, self.config.auth_max_skew_s, keys=auth_keys)
                          if auth_secret or auth_keys else None)
        self._refusals = auth.ThrottledLog(log, interval_s=5.0)
        self.device = resolve_device(self.config.device)
        if self.device.type == "cuda":
            # Process-wide switches; the server process owns them (PyTorch's default lets
            # cuDNN use TF32 for convolutions).
            torch.backends.cudnn.allow_tf32 = self.config.allow_tf32
            torch.backends.cuda.matmul.allow_tf32 = self.config.allow_tf32
        self.server_id = uuid.uuid4().hex[:12]
        self._models: Dict[str, LoadedModel] = {}
        self._lock = threading.Lock()
        self._load_locks: Dict[str, threading.Lock] = {}
        self.requests_total = 0
        self.requests_failed = 0

    # -- dispatch ---------------------------------------------------------------------
    def handle(self, method: str, request):
        """Answer one request. Never raises: errors become a status in the response."""
        handler, response_type = {
            "load_model": (self._load_model, LoadModelResponse),
            "compute": (self._compute, ComputeResponse),
            "ping": (self._ping, PingResponse),
        }.get(method, (None, None))
        with self._lock:
            self.requests_total += 1
        if handler is None:
            return ComputeResponse(status=StatusCode.UNKNOWN_ENTRY, status_text=f"unknown method {method!r}")
        denied = self._authenticate(method, request)
        if denied is not None:
            with self._lock:
                self.requests_failed += 1
            return response_type(status=StatusCode.UNAUTHORIZED, status_text=denied)
        try:
            self._admit(method, request)
            return handler(request)
        except RequestRejected as e:
            code, text = e.code, e.text
        except PayloadTooLarge as e:
            code, text = StatusCode.TOO_LARGE, str(e)
        except (CodecError, ConfigError) as e:
            code, text = StatusCode.BAD_REQUEST, str(e)
        except torch.cuda.OutOfMemoryError as e:
            torch.cuda.empty_cache()
            code, text = StatusCode.BUSY, f"server out of GPU memory: {e}"
        except Exception as e:  # noqa: BLE001 - the server must survive any request
            log.exception("request %s failed", method)
            code, text = StatusCode.INTERNAL, f"{type(e).__name__}: {e}"
        with self._lock:
            self.requests_failed += 1
        text = text[:2000]
        self._refusals.log(logging.WARNING, (method, int(code)),
                           f"{method} refused: {StatusCode(code).name} {text}")
        return response_type(status=code, status_text=text)

    def _authenticate(self, method: str, request) -> Optional[str]:
        """None when the request may proceed, else the UNAUTHORIZED text (logged, throttled
        per kind of failure). Runs before anything else looks at the request."""
        auth.bind_identity(request, None)
        if self._verifier is None:
            auth.bind_identity(request, auth.claimed_identity(request))
            return None
        try:
            auth.bind_identity(request, self._verifier.verify(method, request))
            return None
        except auth.AuthError as e:
            reason, text = e.reason, str(e)
        except Exception as e:  # noqa: BLE001 - whatever the request holds, refuse it
            reason, text = "malformed", f"malformed request ({type(e).__name__})"
        client = getattr(request, "client_id", "")
        client = client[:64] if isinstance(client, str) else type(client).__name__
        self._refusals.log(logging.WARNING, ("auth", reason),
                           f"{method} from {client!r} refused: UNAUTHORIZED {text}")
        return f"authentication failed: {text}"

    def identity_of(self, request) -> auth.Identity:
        """The client_id ``request`` may act as (an :class:`auth.Identity`, a ``str``), for
        executors to scope per-client state (sessions, handles) by. With per-client keys it
        is the id whose key signed the request (``proven``); with a shared secret the
        claimed id of a validly signed request; with authentication off the claimed id,
        ``authenticated`` False. Raises RequestRejected (UNAUTHORIZED) for a request that
        did not pass :meth:`handle`'s authentication."""
        identity = auth.bound_identity(request)
        if identity is None:
            raise RequestRejected(StatusCode.UNAUTHORIZED, "request has no verified identity")
        return identity

    def _admit(self, method: str, request) -> None:
        """Well-formedness (robot_offload.request_check) and the per-client allow list."""
        try:
            request_check.check_request(method, request, self.config.max_request_bytes)
        except request_check.BadRequest as e:
            raise RequestRejected(e.code, e.text) from None
        lists = self.config.client_models
        if lists and method in ("load_model", "compute"):
            allowed = lists.get(request.client_id, lists.get("*"))
            model_free = method == "compute" and request.entry in globals().get("MODEL_FREE_ENTRIES", ())
            if allowed is None:
                raise RequestRejected(StatusCode.UNAUTHORIZED,
                                      f"client {request.client_id[:64]!r} is not in client_models")
            if not model_free and request.model not in allowed:
                raise RequestRejected(StatusCode.UNAUTHORIZED, f"client {request.client_id[:64]!r} "
                                      f"may not use model {request.model[:64]!r}")

    # -- methods ----------------------------------------------------------------------
    def _ping(self, req: PingRequest) -> PingResponse:
        if len(req.payload) > self.config.max_request_bytes:
            raise RequestRejected(StatusCode.TOO_LARGE, "ping payload above max_request_bytes")
        with self._lock:
            loaded = sorted(self._models)
        return PingResponse(status=StatusCode.OK, server_id=self.server_id, loaded_models=loaded,
                            device=str(self.device), payload=bytes(req.payload))

    def _load_model(self, req: LoadModelRequest) -> LoadModelResponse:
        loaded = self.load(req.model)
        if req.weights_hash and req.weights_hash != loaded.weights_hash:
            raise RequestRejected(StatusCode.HASH_MISMATCH,
                                  f"{req.model}: client weights {req.weights_hash[:12]} differ from "
                                  f"server weights {loaded.weights_hash[:12]}")
        return LoadModelResponse(status=StatusCode.OK, weights_hash=loaded.weights_hash,
                                 device=str(loaded.device), load_time_s=loaded.load_time_s)

    def _compute(self, req: ComputeRequest) -> ComputeResponse:
        t0 = time.perf_counter()
        if req.payload_bytes > self.config.max_request_bytes:
            raise RequestRejected(StatusCode.TOO_LARGE, f"request of {req.payload_bytes} bytes; "
                                  f"max_request_bytes is {self.config.max_request_bytes}")
        run = EXECUTORS.get(req.entry)
        if run is None:
            raise RequestRejected(StatusCode.UNKNOWN_ENTRY,
                                  f"unknown entry {req.entry!r}; known: {sorted(EXECUTORS)}")
        if req.entry in MODEL_FREE_ENTRIES:
            loaded = None
        else:
            with self._lock:
                loaded = self._models.get(req.model)
            if loaded is None:
                raise RequestRejected(StatusCode.MODEL_NOT_LOADED, f"model {req.model!r} is not loaded")
        resp = run(self, loaded, req)
        resp.server_total_s = time.perf_counter() - t0
        return resp

    # -- helpers for executors ----------------------------------------------------------
    def load(self, name: str) -> LoadedModel:
        """Build (once) and return a registry model on the server's device."""
        if self.config.allowed_models and name not in self.config.allowed_models:
            raise RequestRejected(StatusCode.UNAUTHORIZED, f"model {name!r} is not allowed here")
        try:
            spec = get_spec(name)
        except UnknownModelError as e:
            raise RequestRejected(StatusCode.UNKNOWN_MODEL, str(e)) from e
        with self._lock:
            if name in self._models:
                return self._models[name]
            build_lock = self._load_locks.setdefault(name, threading.Lock())
        with build_lock:
            with self._lock:
                if name in self._models:
                    return self._models[name]
            t0 = time.perf_counter()
            module = spec.build(self._weights_path(name))
            digest = weights_hash(module)
            module = module.to(self.device)
            loaded = LoadedModel(name, module, digest, self.device, time.perf_counter() - t0)
            with self._lock:
                self._models[name] = loaded
            log.info("loaded %s on %s in %.2f s (weights %s)", name, self.device,
                     loaded.load_time_s, digest[:12])
            return loaded

    def _weights_path(self, name: str) -> Optional[str]:
        import os
        if not self.config.weights_dir:
            return None
        for ext in (".safetensors", ".pt", ".pth"):
            path = os.path.join(self.config.weights_dir, name + ext)
            if os.path.isfile(path):
                return path
        return None

    def decode_inputs(self, req: ComputeRequest):
        """Decode the request's tensors onto the server's device, enforcing the limits."""
        out = []
        for enc in req.tensors:
            t = codec.decode(enc, max_bytes=self.config.max_request_bytes)
            if t.numel() > self.config.max_input_elements:
                raise RequestRejected(StatusCode.TOO_LARGE, f"tensor {enc.name!r} has {t.numel()} "
                                      f"elements; max_input_elements is {self.config.max_input_elements}")
            out.append(t.to(self.device, non_blocking=True))
        return out

    def encode_outputs(self, outputs, req: ComputeRequest):
        """Flatten and encode outputs as the client asked (codec and compression)."""
        leaves, spec = structure.flatten(outputs)
        encoded = [codec.encode(t, name=f"out{i}", codec=req.output_codec,
                                compression=req.output_compression) for i, t in enumerate(leaves)]
        return encoded, spec

    def synchronize(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


@executor("forward")
def _forward(server: OffloadServer, loaded: LoadedModel, req: ComputeRequest) -> ComputeResponse:
    """Whole-model inference on the request's single input tensor (full offload)."""
    if len(req.tensors) != 1:
        raise RequestRejected(StatusCode.BAD_REQUEST, f"forward takes 1 input tensor, got {len(req.tensors)}")
    (x,) = server.decode_inputs(req)
    if not x.is_floating_point():
        raise RequestRejected(StatusCode.BAD_REQUEST, f"forward needs a floating input, got {x.dtype}")
    t0 = time.perf_counter()
    try:
        with torch.inference_mode():
            y = loaded.module(x)
        server.synchronize()
    except torch.cuda.OutOfMemoryError:
        raise
    except (RuntimeError, ValueError, IndexError, TypeError, AssertionError) as e:
        # Shape/dtype mismatches surface as these inside forward: the request is at fault.
        raise RequestRejected(StatusCode.BAD_REQUEST, f"{loaded.name} rejected the input "
                              f"{list(x.shape)}: {str(e).splitlines()[0][:300]}") from e
    compute_s = time.perf_counter() - t0
    tensors, spec = server.encode_outputs(y, req)
    return ComputeResponse(status=StatusCode.OK, tensors=tensors, structure_json=spec,
                           result_json=json.dumps({"input_shape": list(x.shape)}),
                           server_compute_s=compute_s)


# Executors of other modules register themselves on import (kept last: they import this module).
from robot_offload.partition import executor as _partition_executor  # noqa: E402,F401
from robot_offload.partition import lop_executor as _lop_executor  # noqa: E402,F401
from robot_offload.transparent import server as _transparent_executor  # noqa: E402,F401
