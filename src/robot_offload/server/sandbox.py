"""The ``ops`` entry in a process per client: a crash or a runaway request stays there.

The ``ops`` entry runs operator sequences a client defines. The allow-list, the argument
checks and the budgets (:mod:`.executors.ops`) are the first line; this is the second: if
something still slips through -- an operator that corrupts memory, a kernel that never
ends -- it takes down one process holding one client's sessions, never the server that
answers every robot's ``forward``, ``partition_tail`` and ``lop_part`` and the other
clients' sessions.

* Each client identity (:meth:`OffloadServer.identity_of`) gets a worker process of its own
  (``python -m robot_offload.server.sandbox_worker``), started from a warm spare so a new client
  does not wait for torch to import. The worker builds its own server with only what the
  entry needs and answers ``compute`` requests of that one identity.
* Requests and responses cross a Unix socket pair as frames of plain data -- a JSON header
  and the tensors' bytes (:func:`pack`) -- never pickles.
* A request that runs past ``max_request_s`` has its worker killed (its sessions with it)
  and is answered BUSY; a worker that dies is answered STALE_HANDLE (the client opens a new
  session, as after a server restart) and logged with its signal; either way the next
  request of that client gets a fresh worker.
* At most ``max_sandboxes`` workers at once (a new client past it: BUSY); a worker idle for
  ``session_idle_s`` exits with its sessions.

Registry weights that uploads name by digest: the worker builds the models the server has
loaded (same registry, same weights files) the first time a digest is looked up.
"""

import dataclasses
import fcntl
import json
import logging
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from typing import Dict, List, Optional, Tuple

from robot_offload.codec import EncodedTensor
from robot_offload.protocol import ComputeRequest, ComputeResponse, StatusCode
from robot_offload.server.base import Executor, RequestRejected

log = logging.getLogger(__name__)

_LEN = struct.Struct("!Q")
#: how long a new worker may take to start (import torch, build its server) (s)
STARTUP_TIMEOUT_S = 120.0
#: largest frame either side accepts (a request is bounded by max_request_bytes before)
MAX_FRAME_BYTES = 1 << 34
_TENSOR_FIELDS = [f.name for f in dataclasses.fields(EncodedTensor) if f.name != "data"]


# -- frames: a JSON header and raw blobs ------------------------------------------------------
def pack(header: dict, blobs: List[bytes]) -> bytes:
    head = json.dumps(dict(header, blobs=[len(b) for b in blobs])).encode()
    return b"".join([_LEN.pack(len(head)), head] + list(blobs))


def unpack(frame: bytes) -> Tuple[dict, List[bytes]]:
    (n,), at = _LEN.unpack_from(frame), _LEN.size
    header = json.loads(frame[at:at + n])
    at += n
    blobs = []
    for size in header.pop("blobs"):
        blobs.append(frame[at:at + size])
        at += size
    return header, blobs


def _tensors_out(tensors: List[EncodedTensor], blobs: List[bytes]) -> list:
    out = []
    for t in tensors:
        out.append({k: getattr(t, k) for k in _TENSOR_FIELDS})
        blobs.append(bytes(t.data))
    return out


def _tensors_in(specs: list, blobs: List[bytes]) -> List[EncodedTensor]:
    return [EncodedTensor(**{k: spec[k] for k in _TENSOR_FIELDS}, data=blob) for spec, blob in zip(specs, blobs)]


def request_frame(req: ComputeRequest, identity: str, models: List[str]) -> bytes:
    blobs: List[bytes] = []
    tensors = _tensors_out(req.tensors, blobs)
    fields = {k: getattr(req, k) for k in ("model", "entry", "args_json", "session", "output_codec",
                                            "output_compression")}
    return pack(dict(fields, identity=identity, models=models, tensors=tensors), blobs)


def response_frame(resp: ComputeResponse) -> bytes:
    blobs: List[bytes] = []
    tensors = _tensors_out(resp.tensors, blobs)
    fields = {k: getattr(resp, k) for k in ("status", "status_text", "structure_json", "result_json",
                                            "server_compute_s", "server_total_s")}
    return pack(dict(fields, status=int(resp.status), tensors=tensors), blobs)


def read_response(frame: bytes) -> ComputeResponse:
    header, blobs = unpack(frame)
    tensors = _tensors_in(header.pop("tensors"), blobs)
    return ComputeResponse(tensors=tensors, **header)


def _send(sock: socket.socket, frame: bytes) -> None:
    sock.sendall(_LEN.pack(len(frame)) + frame)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 22))
        if not chunk:
            raise EOFError("the other side closed")
        buf += chunk
    return bytes(buf)


def _recv(sock: socket.socket) -> bytes:
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if n > MAX_FRAME_BYTES:
        raise EOFError(f"frame of {n} bytes")
    return _recv_exact(sock, n)


# -- the server side ---------------------------------------------------------------------------
class _Worker:
    def __init__(self, config_json: str):
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        # Blocking, whatever socket.setdefaulttimeout() the process has (rospy sets one):
        # the child inherits the descriptor's mode and reads it as a blocking socket.
        child.setblocking(True)
        self.sock = parent
        # The child's end at a descriptor above stdin/stdout/stderr: a server started with
        # a closed stdin would otherwise get descriptor 0, which the child's stdin replaces.
        fd = fcntl.fcntl(child.fileno(), fcntl.F_DUPFD_CLOEXEC, 3)
        child.close()
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", "robot_offload.server.sandbox_worker", str(fd)],
                                         stdin=subprocess.DEVNULL, pass_fds=(fd,), start_new_session=True)
        finally:
            os.close(fd)
        _send(self.sock, config_json.encode())       # the worker's configuration, first
        self.lock = threading.Lock()
        self.used = time.monotonic()
        self.ready = False

    def call(self, frame: bytes, timeout_s: float) -> bytes:
        if not self.ready:             # its start (importing torch) is not the request's time
            self.sock.settimeout(STARTUP_TIMEOUT_S)
            try:
                if unpack(_recv(self.sock))[0].get("ready") is not True:
                    raise EOFError("the sandbox did not start")
            except socket.timeout:
                raise EOFError(f"the sandbox did not start within {STARTUP_TIMEOUT_S:.0f} s") from None
            self.ready = True
        self.sock.settimeout(timeout_s)
        _send(self.sock, frame)
        return _recv(self.sock)

    def stop(self) -> Optional[int]:
        """Kill the worker; its exit status (negative: the signal that ended it)."""
        try:
            self.sock.close()
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            try:
                return self.proc.wait(10)
            except subprocess.TimeoutExpired:
                return None


def _how(status: Optional[int]) -> str:
    if status is None:
        return "did not exit"
    if status < 0:
        try:
            return f"killed by {signal.Signals(-status).name}"
        except ValueError:
            return f"killed by signal {-status}"
    return f"exited with status {status}"


class SandboxedOps(Executor):
    """The ``ops`` entry of a server whose ``ops_sandbox`` is on: forwards each request to
    its client's worker process (see the module docstring)."""

    ENTRY = "ops"
    NEEDS_MODEL = False

    def __init__(self, server):
        super().__init__(server)
        cfg = dataclasses.replace(server.config, ops_sandbox=False, device=str(server.device))
        self._config_json = json.dumps(dataclasses.asdict(cfg))
        self._lock = threading.Lock()
        self._workers: Dict[str, _Worker] = {}
        self._spare: Optional[_Worker] = None     # a started worker for the next new client
        #: session id -> the identity that opened it, to refuse and log a request for
        #: another client's session before it reaches any worker
        self._owners: "OrderedDict[str, str]" = OrderedDict()
        self.crashes = 0                 # workers that died under a request
        self.kills = 0                   # workers killed for running past max_request_s

    def warm(self) -> None:
        """Start the spare worker now (the node does, so its first client does not wait
        for one to import torch)."""
        with self._lock:
            if self._spare is None:
                self._spare = _Worker(self._config_json)

    def _take_spare(self) -> _Worker:
        spare, self._spare = self._spare, None
        if spare is None or spare.proc.poll() is not None:
            spare = _Worker(self._config_json)
        self._spare = _Worker(self._config_json)
        return spare

    def _worker(self, identity: str) -> _Worker:
        cfg = self.server.config
        now = time.monotonic()
        with self._lock:
            for ident, w in list(self._workers.items()):
                if ident != identity and not w.lock.locked() and now - w.used > cfg.session_idle_s:
                    del self._workers[ident]
                    w.stop()
            w = self._workers.get(identity)
            if w is not None and w.proc.poll() is None:
                return w
            if w is not None:                 # it died between requests (the OOM killer, say)
                del self._workers[identity]
                self.crashes += 1
                log.error("the ops sandbox of %r had stopped (%s): its sessions are gone",
                          identity[:64], _how(w.stop()))
            if len(self._workers) >= cfg.max_sandboxes:
                raise RequestRejected(StatusCode.BUSY, f"{len(self._workers)} clients hold operator "
                                      "sessions (max_sandboxes); try again later")
            w = self._workers[identity] = self._take_spare()
            return w

    def _drop(self, identity: str, w: _Worker) -> Optional[int]:
        with self._lock:
            if self._workers.get(identity) is w:
                del self._workers[identity]
        return w.stop()

    def __call__(self, loaded, req: ComputeRequest) -> ComputeResponse:
        server = self.server
        identity = server.identity_of(req)
        if req.session:
            with self._lock:
                owner = self._owners.get(req.session)
            if owner is not None and owner != identity:
                server._refusals.log(logging.WARNING, ("session-owner", identity[:64]),
                                     f"client {identity[:64]!r} named a transparent session of another "
                                     "client: refused")
                raise RequestRejected(StatusCode.UNAUTHORIZED, "this session belongs to another client")
        with server._lock:
            models = sorted(server._models)
        w = self._worker(identity)
        frame = request_frame(req, identity, models)
        with w.lock:
            w.used = time.monotonic()
            try:
                response = read_response(w.call(frame, server.config.max_request_s))
                if not req.session and response.status == StatusCode.OK:
                    self._remember(json.loads(response.result_json or "{}").get("session"), identity)
                return response
            except socket.timeout:
                status = self._drop(identity, w)
                self.kills += 1
                log.warning("an ops request of %r ran past max_request_s (%.0f s): its sandbox was "
                            "stopped (%s), its sessions dropped", identity[:64], server.config.max_request_s,
                            _how(status))
                raise RequestRejected(StatusCode.BUSY, f"the request ran past max_request_s "
                                      f"({server.config.max_request_s:.0f} s) and was stopped; this "
                                      "client's operator sessions were dropped") from None
            except (EOFError, OSError, ValueError) as e:
                status = self._drop(identity, w)
                self.crashes += 1
                log.error("the ops sandbox of %r stopped under a request (%s: %s): its sessions are "
                          "gone; the other clients are unaffected", identity[:64], _how(status), e)
                raise RequestRejected(StatusCode.STALE_HANDLE, f"the operator sandbox of this client "
                                      f"stopped while running the request ({_how(status)}); its "
                                      "sessions are gone: open a new one") from None

    def _remember(self, session_id, identity: str) -> None:
        if not isinstance(session_id, str) or not session_id:
            return
        with self._lock:
            self._owners[session_id] = identity
            while len(self._owners) > 16 * self.server.config.max_sessions:
                self._owners.popitem(last=False)

    def close(self) -> None:
        with self._lock:
            workers = list(self._workers.values()) + ([self._spare] if self._spare else [])
            self._workers, self._spare = {}, None
        for w in workers:
            w.stop()

    def status(self) -> dict:
        """For the server's health report: sandboxes in use, their bound, and how many
        ended under a request (crashed) or past ``max_request_s`` (stopped)."""
        with self._lock:
            alive = sum(1 for w in self._workers.values() if w.proc.poll() is None)
            return {"sandboxes": alive, "max_sandboxes": self.server.config.max_sandboxes,
                    "crashed": self.crashes, "stopped": self.kills,
                    "spare ready": self._spare is not None and self._spare.proc.poll() is None}

    def pids(self) -> Dict[str, int]:
        with self._lock:
            return {ident: w.proc.pid for ident, w in self._workers.items()}


# -- the worker --------------------------------------------------------------------------------
def _serve(sock: socket.socket, config: dict) -> None:
    from robot_offload.server.config import ServerConfig
    from robot_offload.server.core import OffloadServer

    config["allowed_models"] = tuple(config.get("allowed_models") or ())
    server = OffloadServer(ServerConfig(**config))
    ops = server.executors["ops"]
    wanted: List[str] = []

    def models_for_index():
        out = []
        for name in wanted:
            try:
                out.append(server.load(name))
            except RequestRejected:
                continue
        return out
    ops.models_for_index = models_for_index
    _send(sock, pack({"ready": True}, []))
    while True:
        try:
            frame = _recv(sock)
        except (EOFError, OSError):
            return                     # the server closed the socket, or is gone
        header, blobs = unpack(frame)
        identity = header.pop("identity")
        wanted[:] = header.pop("models")
        tensors = _tensors_in(header.pop("tensors"), blobs)
        req = ComputeRequest(client_id=identity, tensors=tensors, **header)
        _send(sock, response_frame(server.handle("compute", req)))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    fd = int(argv[0])
    sock = socket.socket(fileno=fd)
    sock.setblocking(True)
    config = json.loads(_recv(sock))
    logging.basicConfig(level=logging.WARNING, format="[ops sandbox %(process)d] %(levelname)s %(message)s")
    _serve(sock, config)
    return 0

