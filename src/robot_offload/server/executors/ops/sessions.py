"""Transparent sessions: a client's tensors on the server, and who may use them.

A session is opened by a request that names none (``session=""``): the server makes an
unguessable id (128 random bits) and answers it; every later request must name it, and
the session answers only the identity that opened it (the authenticated client id when
requests are authenticated, else the claimed one). A request naming a session of another
identity is refused and logged, exactly as one naming no session at all: the id itself
is the capability, and it is never logged.

Limits, each a status the client can act on: a session's bytes (``max_session_mib``), an
identity's bytes over all its sessions (``max_client_mib``), sessions per identity
(``max_sessions_per_client``: the identity's least recently used is dropped) and sessions
in all (``max_sessions``: a new one is refused with BUSY, never made room for by dropping
another client's); sessions idle for ``session_idle_s`` are dropped.
"""

import logging
import secrets
import threading
import time
from collections import OrderedDict
from typing import Dict, Optional, Set

import torch

from robot_offload.protocol import StatusCode
from robot_offload.server.base import RequestRejected, bad_request
from robot_offload.server.executors.ops.calls import storage_key
from robot_offload.transparent import wire

log = logging.getLogger(__name__)
#: characters of a session id (hex of 128 random bits)
SESSION_ID_CHARS = 32


class Session:
    """One client session: handles to tensors, the digests they were uploaded under,
    its defined sequences and a replay stopped at a sync point. Bytes are counted per
    storage (views share theirs; an in-place resize grows it); storages of the server's
    shared weights are counted nowhere and may not be written."""

    def __init__(self, session_id: str, owner: str, max_bytes: int):
        self.id = session_id
        self.owner = owner
        self.lock = threading.Lock()
        self.handles: Dict[int, torch.Tensor] = {}
        self.by_digest: Dict[str, int] = {}
        self.next_handle = 1
        self.bytes = 0
        self.max_bytes = max_bytes
        self.storages: Dict[int, list] = {}      # storage key -> [handles using it, bytes]
        self.sequences: "OrderedDict[str, object]" = OrderedDict()
        self.partial = None   # a replay stopped at a sync point, to be continued
        self.used = time.monotonic()

    def put(self, t: torch.Tensor, shared_keys: Set[int] = frozenset()) -> int:
        """A handle for ``t``; its storage is counted unless it is in ``shared_keys``
        (the server's weights)."""
        h = self.next_handle
        self.next_handle += 1
        self.handles[h] = t
        key = storage_key(t)
        if key in shared_keys:
            return h
        entry = self.storages.get(key)
        if entry is None:
            size = t.untyped_storage().nbytes()
            self.storages[key] = [1, size]
            self.bytes += size
        else:
            entry[0] += 1
        return h

    def get(self, h) -> torch.Tensor:
        if not isinstance(h, int) or isinstance(h, bool):
            raise bad_request(f"handle must be an integer, got {str(h)[:40]}")
        try:
            return self.handles[h]
        except KeyError:
            raise RequestRejected(StatusCode.STALE_HANDLE, f"unknown tensor handle {h} "
                                  "(the server restarted or the handle was released)") from None

    def release(self, h) -> None:
        if not isinstance(h, int) or h not in self.handles:
            return
        key = storage_key(self.handles.pop(h))
        entry = self.storages.get(key)
        if entry is not None:
            entry[0] -= 1
            if entry[0] == 0:
                self.bytes -= entry[1]
                del self.storages[key]

    def regrow(self, t: torch.Tensor) -> None:
        """Account a storage the session holds that an in-place operator resized."""
        entry = self.storages.get(storage_key(t))
        if entry is not None:
            size = t.untyped_storage().nbytes()
            self.bytes += size - entry[1]
            entry[1] = size

    def check_budget(self, extra: int, client_bytes: int = 0, max_client_bytes: int = 0) -> None:
        if self.bytes + extra > self.max_bytes:
            raise RequestRejected(StatusCode.TOO_LARGE, f"session would hold {self.bytes + extra} bytes; "
                                  f"max_session_mib is {self.max_bytes // 2 ** 20}")
        if max_client_bytes and client_bytes + extra > max_client_bytes:
            raise RequestRejected(StatusCode.TOO_LARGE, f"this client's sessions would hold "
                                  f"{client_bytes + extra} bytes; max_client_mib is {max_client_bytes // 2 ** 20}")


class SessionStore:
    """The sessions of one server's ``ops`` entry, and the content index of its registry
    weights (digest -> tensor) that uploads by digest are answered from."""

    def __init__(self, config, refusals):
        self.config = config
        self.refusals = refusals              # auth.ThrottledLog
        self.lock = threading.Lock()
        self.sessions: "OrderedDict[str, Session]" = OrderedDict()
        self.index: Dict[str, torch.Tensor] = {}
        self.indexed_models: Set[str] = set()
        #: storage keys of the indexed weights: no client operator may write them
        self.shared_keys: Set[int] = set()

    def open(self, identity: str) -> Session:
        cfg = self.config
        with self.lock:
            self._expire(time.monotonic())
            mine = [s for s in self.sessions.values() if s.owner == identity]
            while mine and len(mine) >= cfg.max_sessions_per_client:
                oldest = mine.pop(0)
                del self.sessions[oldest.id]
            if len(self.sessions) >= cfg.max_sessions:
                raise RequestRejected(StatusCode.BUSY, f"the server holds {len(self.sessions)} transparent "
                                      "sessions (max_sessions); try again later")
            sess = Session(secrets.token_hex(SESSION_ID_CHARS // 2), identity, cfg.max_session_mib * 2 ** 20)
            self.sessions[sess.id] = sess
            return sess

    def get(self, session_id: str, identity: str) -> Session:
        if not isinstance(session_id, str) or len(session_id) != SESSION_ID_CHARS:
            raise RequestRejected(StatusCode.STALE_HANDLE, "unknown session (the server restarted, or "
                                  "the session expired): open a new one with session=\"\"")
        with self.lock:
            sess = self.sessions.get(session_id)
            if sess is None:
                raise RequestRejected(StatusCode.STALE_HANDLE, "unknown session (the server restarted, "
                                      "or the session expired): open a new one with session=\"\"")
            if sess.owner != identity:
                self.refusals.log(logging.WARNING, ("session-owner", identity[:64]),
                                  f"client {identity[:64]!r} named a transparent session of another "
                                  "client: refused")
                raise RequestRejected(StatusCode.UNAUTHORIZED, "this session belongs to another client")
            self.sessions.move_to_end(session_id)
            sess.used = time.monotonic()
            return sess

    def client_bytes(self, identity: str) -> int:
        with self.lock:
            return sum(s.bytes for s in self.sessions.values() if s.owner == identity)

    def _expire(self, now: float) -> None:
        idle = self.config.session_idle_s
        for sid in [k for k, s in self.sessions.items() if now - s.used > idle]:
            del self.sessions[sid]

    def lookup_digest(self, loaded_models, sess: Session, digest: str) -> Optional[torch.Tensor]:
        """A tensor of this content: one the session uploaded, or a weight of a registry
        model ``loaded_models()`` names (shared: see :meth:`Session.put`)."""
        if digest in sess.by_digest and sess.by_digest[digest] in sess.handles:
            return sess.handles[sess.by_digest[digest]]
        if digest in self.index:
            return self.index[digest]
        models = loaded_models()
        with self.lock:
            for m in models:
                if m.name in self.indexed_models:
                    continue
                for t in list(m.module.parameters()) + list(m.module.buffers()):
                    self.index[wire.content_digest(t)] = t.detach()
                    self.shared_keys.add(storage_key(t))
                self.indexed_models.add(m.name)
            return self.index.get(digest)
