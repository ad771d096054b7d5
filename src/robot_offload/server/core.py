"""The offload server's composition root, independent of ROS.

:class:`OffloadServer` answers the three protocol methods (``load_model``, ``compute``,
``ping``). It never raises out of :meth:`OffloadServer.handle`: every failure becomes a
status code and a text, so one bad request cannot take the server down for every robot.

Order of a request: authentication (:mod:`robot_offload.auth`), well-formedness
(:mod:`.request_check`), the per-client model lists, then ``compute`` dispatches on
``entry`` to the server's own executor instance (:mod:`.executors`, one module each);
whole models and partition tails first wait for a compute slot in their client's fair
turn (:mod:`.scheduler`).
"""

import dataclasses
import logging
import threading
import time
import uuid
from collections import Counter, OrderedDict
from typing import Dict, Optional

import torch

from robot_offload import auth, codec, compat, structure
from robot_offload.codec import PayloadTooLarge
from robot_offload.errors import CodecError, ConfigError, UnknownModelError
from robot_offload.models import get_spec, weights_hash
from robot_offload.protocol import (ComputeRequest, ComputeResponse, LoadModelRequest,
                                    LoadModelResponse, PingRequest, PingResponse, StatusCode)
from robot_offload.server import executors, request_check
from robot_offload.server.base import LoadedModel, RequestRejected
from robot_offload.server.config import ServerConfig, resolve_device
from robot_offload.server.executors.forward import run_batch
from robot_offload.server.scheduler import FairScheduler

log = logging.getLogger(__name__)

#: clients counted as active: a request in the last this many seconds
CLIENT_WINDOW_S = 60.0
#: client ids remembered for that count (any client_id may be sent: bounded)
MAX_CLIENTS_TRACKED = 1024


def _status_name(code) -> str:
    try:
        return StatusCode(code).name
    except ValueError:
        return "UNKNOWN"


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
        #: what this server runs, told to every client that pings with its own versions
        self.versions = compat.local_versions(device=str(self.device), with_ops=False)
        compat.accepted_digests()     # computed once, before the first client's ping
        self._models: Dict[str, LoadedModel] = {}
        self._lock = threading.Lock()
        self._load_locks: Dict[str, threading.Lock] = {}
        self.requests_total = 0
        self.requests_failed = 0
        self.refused = Counter()                  # status name -> requests answered with it
        self.in_flight = 0                        # requests being answered now
        # client_id -> when its last request that passed authentication came (bounded,
        # least recent dropped)
        self._clients: "OrderedDict[str, float]" = OrderedDict()
        self.scheduler = FairScheduler(self.config.compute_slots, self.config.max_queued_per_client,
                                       max_wait_s=self.config.max_request_s,
                                       max_clients=MAX_CLIENTS_TRACKED)
        self.executors = executors.build(self)

    # -- dispatch ---------------------------------------------------------------------
    def handle(self, method: str, request):
        """Answer one request. Never raises: errors become a status in the response."""
        with self._lock:
            self.requests_total += 1
            self.in_flight += 1
        try:
            response = self._handle(method, request)
        finally:
            with self._lock:
                self.in_flight -= 1
        status = getattr(response, "status", StatusCode.OK)
        if status in (StatusCode.OK, StatusCode.BUSY) and hasattr(response, "server_backlog_s"):
            response.server_backlog_s = self.scheduler.backlog_s()
        if status != StatusCode.OK:
            with self._lock:
                self.requests_failed += 1
                self.refused[_status_name(status)] += 1
        return response

    def activity(self) -> dict:
        """What the server is doing, for its health report
        (:mod:`robot_offload.server.health`): request counts, requests in flight,
        clients seen in the last ``CLIENT_WINDOW_S``, loaded models, the device, and each
        executor's own figures (operator sandboxes or sessions)."""
        now = time.monotonic()
        with self._lock:
            figures = {"requests": self.requests_total, "refused": dict(self.refused),
                       "failed": self.requests_failed, "in_flight": self.in_flight,
                       "clients": sum(1 for t in self._clients.values() if now - t <= CLIENT_WINDOW_S),
                       "models": sorted(self._models), "device": str(self.device),
                       "server_id": self.server_id, "client_window_s": CLIENT_WINDOW_S}
        figures["compute"] = self.scheduler.status()
        figures["executors"] = {entry: f for entry, f in
                                ((entry, ex.status()) for entry, ex in self.executors.items()) if f}
        return figures

    def _seen(self, request) -> None:
        client = getattr(request, "client_id", "")
        if not isinstance(client, str) or not client:
            return
        with self._lock:
            self._clients[client[:64]] = time.monotonic()
            self._clients.move_to_end(client[:64])
            while len(self._clients) > MAX_CLIENTS_TRACKED:
                self._clients.popitem(last=False)

    def _handle(self, method: str, request):
        handler, response_type = {
            "load_model": (self._load_model, LoadModelResponse),
            "compute": (self._compute, ComputeResponse),
            "ping": (self._ping, PingResponse),
        }.get(method, (None, None))
        if handler is None:
            return ComputeResponse(status=StatusCode.UNKNOWN_ENTRY, status_text=f"unknown method {method!r}")
        denied = self._authenticate(method, request)
        if denied is not None:
            return response_type(status=StatusCode.UNAUTHORIZED, status_text=denied)
        self._seen(request)
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

    def close(self) -> None:
        """Stop what the executors started (sandbox processes)."""
        for ex in self.executors.values():
            close = getattr(ex, "close", None)
            if close is not None:
                close()

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
            entry = self.executors.get(request.entry) if method == "compute" else None
            model_free = entry is not None and not entry.NEEDS_MODEL
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
        versions = self.versions
        if req.versions_json:
            versions = self._compare_versions(req.versions_json)
        with self._lock:
            loaded = sorted(self._models)
        return PingResponse(status=StatusCode.OK, server_id=self.server_id, loaded_models=loaded,
                            device=str(self.device), payload=bytes(req.payload),
                            versions_json=versions.to_json())

    def _compare_versions(self, versions_json: str) -> compat.Versions:
        """The reply to a client's versions (robot_offload.compat): INCOMPATIBLE for
        another protocol, else this server's versions with the client's operators that it
        would read differently."""
        try:
            client = compat.Versions.from_json(versions_json)
        except compat.VersionsError as e:
            raise RequestRejected(StatusCode.BAD_REQUEST, str(e)) from None
        refusal = compat.protocol_refusal(client, self.versions)
        if refusal is not None:
            raise RequestRejected(StatusCode.INCOMPATIBLE, refusal)
        differ = compat.differing_ops(client, compat.accepted_digests(), compat.op_schemas())
        return dataclasses.replace(self.versions, ops_differ=differ)

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
        run = self.executors.get(req.entry)
        if run is None:
            raise RequestRejected(StatusCode.UNKNOWN_ENTRY,
                                  f"unknown entry {req.entry!r}; known: {sorted(self.executors)}")
        if not run.NEEDS_MODEL:
            loaded = None
        else:
            with self._lock:
                loaded = self._models.get(req.model)
            if loaded is None:
                raise RequestRejected(StatusCode.MODEL_NOT_LOADED, f"model {req.model!r} is not loaded")
        if run.BATCHABLE and self.config.max_batch > 1:
            resp = self._batched(run, loaded, req)
        elif run.QUEUED:
            with self.scheduler.slot(str(self.identity_of(req)), (req.entry, req.model),
                                     req.deadline_s, request_id=req.request_id) as ticket:
                resp = run(loaded, req)
            resp.server_queue_s = ticket.waited_s
        else:
            resp = run(loaded, req)
        resp.server_total_s = time.perf_counter() - t0
        return resp

    def _batched(self, run, loaded: LoadedModel, req: ComputeRequest) -> ComputeResponse:
        """A batchable request: its input prepared first, then run in a batch with other
        clients' requests for the same model and input shape (:mod:`.scheduler`)."""
        t0 = time.perf_counter()
        x = run.prepare(loaded, req)
        prepare_s = time.perf_counter() - t0
        batch_key = (req.entry, req.model, tuple(x.shape), str(x.dtype))
        with self.scheduler.slot(str(self.identity_of(req)), (req.entry, req.model), req.deadline_s,
                                 batch_key=batch_key, payload=x, request_id=req.request_id) as ticket:
            if ticket.leader is None:
                members = self.scheduler.gather(ticket, self.config.max_batch - 1, self.config.batch_wait_s)
                t1 = time.perf_counter()
                try:
                    outputs = run_batch(self, loaded, [x] + [m.payload for m in members])
                except BaseException as e:
                    self.scheduler.finish(members, error=e)
                    raise
                compute_s = time.perf_counter() - t1
                self.scheduler.finish(members, outputs[1:], compute_s=compute_s)
                y = outputs[0]
            else:
                y, compute_s = ticket.result, ticket.compute_s
        resp = run.respond(loaded, req, x, y, prepare_s + compute_s, batch=ticket.batch_size)
        resp.server_queue_s = ticket.waited_s
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

    def decode_inputs(self, req: ComputeRequest, frames: bool = False):
        """Decode the request's tensors onto the server's device, enforcing the limits;
        ``frames``: camera frames, which may come as JPEG (:mod:`robot_offload.frame_codec`)."""
        out = []
        for enc in req.tensors:
            t = codec.decode(enc, max_bytes=self.config.max_request_bytes, frames=frames)
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
