"""Request authentication with a shared secret: HMAC-SHA256 tokens, no rospy.

When a secret is configured, the client signs every request (``load_model``, ``compute``,
``ping``) and puts the token in the request's ``auth`` field::

    v1:<unix time, ms>:<nonce, 32 hex>:<HMAC-SHA256, 64 hex>

The MAC covers a domain tag, the timestamp, the nonce and :func:`canonical_request`: the
method name and every field of the request that the server acts on (client_id, model,
weights hash, entry, args_json, session, output codec and compression, ping payload) and,
per tensor, a SHA-256 over its name, dtype, shape, codec, compression, quantisation
parameters, raw size and data. Changing any byte of any of these invalidates the token.

The server (:class:`Verifier`) refuses a token that is missing or malformed, whose MAC is
wrong (compared with :func:`hmac.compare_digest`), whose timestamp is more than
``max_skew_s`` from its own clock (robot and server clocks must agree to within that: run
chrony/NTP), or whose nonce it has already seen within the window (a replay). Nonces are
only remembered after the MAC checked out and only until their timestamp leaves the
window, and the cache is bounded (``max_nonces``; when full, new tokens are refused rather
than remembered badly), so an attacker without the secret cannot grow it.

What this gives: only holders of the secret can make the server load models, compute or
answer pings, and a recorded request cannot be replayed. What it does not give:
confidentiality (tensors cross in the clear: use a WireGuard tunnel on an untrusted
link), authenticated responses, or per-client identities (every client holding the shared
secret can claim any ``client_id``). The secret is read from a file (mode 0600) or from the
environment (:func:`load_secret`), never from the parameter server.
"""

import hashlib
import heapq
import hmac
import logging
import operator
import os
import re
import secrets as _secrets
import stat
import struct
import threading
import time
from dataclasses import replace
from typing import Callable, Dict, Optional

from robot_offload.errors import ConfigError, OffloadError

log = logging.getLogger(__name__)

VERSION = "v1"
#: Environment variable holding the secret when no secret file is given.
ENV_VAR = "ROBOT_OFFLOAD_SECRET"
#: Shortest secret accepted (bytes after stripping whitespace).
MIN_SECRET_BYTES = 16
#: Default accepted difference between a token's timestamp and the server's clock (s).
DEFAULT_MAX_SKEW_S = 30.0
#: Default bound of the replay cache (nonces remembered at once).
DEFAULT_MAX_NONCES = 100_000
#: Largest secret file read (bytes).
MAX_SECRET_FILE_BYTES = 4096
NONCE_BYTES = 16

_DOMAIN = b"robot_offload-auth-v1\x00"
_TOKEN_RE = re.compile(r"v1:(\d{1,15}):([0-9a-f]{32}):([0-9a-f]{64})")
_MAX_TOKEN_CHARS = 128

#: Request fields covered by the MAC, per method (tensors are digested separately).
SIGNED_FIELDS = {
    "load_model": ("client_id", "model", "weights_hash"),
    "compute": ("client_id", "model", "entry", "args_json", "session", "output_codec",
                "output_compression"),
    "ping": ("client_id", "payload"),
}


class AuthError(OffloadError):
    """A request's token does not authenticate it; ``reason`` is a short category
    (missing, malformed, skew, signature, replay, cache_full) for throttled logging."""

    def __init__(self, reason: str, text: str):
        super().__init__(text)
        self.reason = reason


# -- secrets ------------------------------------------------------------------------------
def secret_from_text(text, source: str = "secret") -> bytes:
    """The secret as bytes (surrounding whitespace stripped); refuses short ones."""
    raw = text.encode() if isinstance(text, str) else bytes(text)
    raw = raw.strip()
    if len(raw) < MIN_SECRET_BYTES:
        raise ConfigError(f"{source}: the secret must be at least {MIN_SECRET_BYTES} bytes "
                          f"(e.g. `openssl rand -hex 32`), got {len(raw)}")
    return raw


def read_secret_file(path: str) -> bytes:
    """Read a secret file; refuses a missing, empty, non-regular, oversized file or one that
    group or others may read or write (like ssh: chmod 600 it)."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise ConfigError(f"auth secret file {path!r}: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"auth secret file {path!r} is not a regular file")
    if st.st_mode & 0o077:
        raise ConfigError(f"auth secret file {path!r} has mode {stat.S_IMODE(st.st_mode):04o}; "
                          f"it must not be accessible to group or others (chmod 600 {path})")
    if st.st_size > MAX_SECRET_FILE_BYTES:
        raise ConfigError(f"auth secret file {path!r} is larger than {MAX_SECRET_FILE_BYTES} bytes")
    with open(path, "rb") as f:
        return secret_from_text(f.read(MAX_SECRET_FILE_BYTES + 1), f"auth secret file {path!r}")


def load_secret(path: str = "", environ=None) -> Optional[bytes]:
    """The configured secret, or None (authentication off).

    ``path`` (a node's ``~auth_secret_file``) wins; otherwise the environment variable
    ``ROBOT_OFFLOAD_SECRET`` if set and non-empty. A path that is set but unusable raises
    ConfigError: a node asked to authenticate must not silently run without."""
    if path:
        return read_secret_file(os.path.expanduser(str(path)))
    environ = os.environ if environ is None else environ
    value = environ.get(ENV_VAR, "")
    if value:
        return secret_from_text(value, f"${ENV_VAR}")
    return None


# -- canonical form -------------------------------------------------------------------------
def _as_bytes(value, what: str) -> bytes:
    if isinstance(value, str):
        return value.encode("utf-8", "surrogatepass")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    raise AuthError("malformed", f"{what} is a {type(value).__name__}, not a string")


def _put(h, value: bytes) -> None:
    h.update(struct.pack(">Q", len(value)))
    h.update(value)


def tensor_digest(t) -> bytes:
    """SHA-256 over everything of an EncodedTensor that decoding depends on."""
    h = hashlib.sha256()
    for name in ("name", "dtype", "codec", "compression"):
        _put(h, _as_bytes(getattr(t, name), f"tensor {name}"))
    try:
        shape = [operator.index(s) for s in t.shape]
        numbers = (float(t.scale).hex(), str(operator.index(t.zero_point)),
                   str(operator.index(t.raw_size)))
    except (TypeError, ValueError) as e:
        raise AuthError("malformed", f"tensor fields are not numbers: {e}") from None
    _put(h, ",".join(map(str, shape)).encode())
    for n in numbers:
        _put(h, n.encode())
    _put(h, _as_bytes(t.data, "tensor data"))
    return h.digest()


def canonical_request(method: str, request) -> bytes:
    """The byte string the MAC covers for ``request`` of ``method`` (unambiguous: every
    field is length-prefixed and in a fixed order)."""
    if method not in SIGNED_FIELDS:
        raise AuthError("malformed", f"unknown method {method!r}")
    h = hashlib.sha256()
    _put(h, method.encode())
    for name in SIGNED_FIELDS[method]:
        _put(h, name.encode())
        _put(h, _as_bytes(getattr(request, name), name))
    tensors = getattr(request, "tensors", None) if method == "compute" else []
    if tensors is None or not isinstance(tensors, (list, tuple)):
        raise AuthError("malformed", "tensors is not a list")
    _put(h, str(len(tensors)).encode())
    for t in tensors:
        h.update(tensor_digest(t))
    return h.digest()


def _mac(secret: bytes, timestamp_ms: str, nonce: bytes, canonical: bytes) -> bytes:
    return hmac.new(secret, _DOMAIN + timestamp_ms.encode() + b"\x00" + nonce + canonical,
                    hashlib.sha256).digest()


def make_token(secret: bytes, method: str, request, now_s: Optional[float] = None,
               nonce: Optional[bytes] = None) -> str:
    """A fresh token for ``request`` (the request's own ``auth`` field is not covered)."""
    ts = str(int(round((time.time() if now_s is None else now_s) * 1000)))
    nonce = _secrets.token_bytes(NONCE_BYTES) if nonce is None else nonce
    mac = _mac(secret, ts, nonce, canonical_request(method, request))
    return f"{VERSION}:{ts}:{nonce.hex()}:{mac.hex()}"


def sign_request(secret: bytes, method: str, request):
    """A copy of ``request`` (a protocol dataclass) carrying a fresh token; the caller's
    object is not modified, so a retried request gets a new nonce."""
    return replace(request, auth=make_token(secret, method, request))


# -- server side ----------------------------------------------------------------------------
class Verifier:
    """Checks tokens; thread-safe. ``clock`` is wall-clock seconds (both sides' clocks
    must agree to within ``max_skew_s``)."""

    def __init__(self, secret: bytes, max_skew_s: float = DEFAULT_MAX_SKEW_S,
                 max_nonces: int = DEFAULT_MAX_NONCES, clock: Callable[[], float] = time.time):
        if not secret:
            raise ConfigError("Verifier needs a secret")
        if not max_skew_s > 0 or max_nonces < 1:
            raise ConfigError("max_skew_s must be > 0 and max_nonces >= 1")
        self._secret = bytes(secret)
        self.max_skew_s = float(max_skew_s)
        self.max_nonces = int(max_nonces)
        self.clock = clock
        self._seen: Dict[bytes, float] = {}
        self._expiry = []          # heap of (forget_at, nonce)
        self._lock = threading.Lock()

    @property
    def remembered(self) -> int:
        return len(self._seen)

    def verify(self, method: str, request) -> None:
        """Return if ``request`` carries a valid, fresh, unseen token; raise AuthError."""
        token = getattr(request, "auth", None)
        if not token:
            raise AuthError("missing", "no authentication token (this server requires one)")
        if not isinstance(token, str) or len(token) > _MAX_TOKEN_CHARS:
            raise AuthError("malformed", "malformed authentication token")
        m = _TOKEN_RE.fullmatch(token)
        if m is None:
            raise AuthError("malformed", "malformed authentication token (expected "
                            "v1:<ms>:<32 hex>:<64 hex>)")
        ts_text, nonce_hex, mac_hex = m.groups()
        now = self.clock()
        skew = int(ts_text) / 1000.0 - now
        if abs(skew) > self.max_skew_s:
            raise AuthError("skew", f"token timestamp is {skew:+.1f} s from the server's clock; "
                            f"the window is +-{self.max_skew_s:g} s (synchronise the clocks)")
        nonce = bytes.fromhex(nonce_hex)
        expected = _mac(self._secret, ts_text, nonce, canonical_request(method, request))
        if not hmac.compare_digest(expected, bytes.fromhex(mac_hex)):
            raise AuthError("signature", "bad signature (wrong secret or altered request)")
        forget_at = int(ts_text) / 1000.0 + self.max_skew_s
        with self._lock:
            while self._expiry and self._expiry[0][0] < now:
                _, old = heapq.heappop(self._expiry)
                self._seen.pop(old, None)
            if nonce in self._seen:
                raise AuthError("replay", "replayed token (nonce already used)")
            if len(self._seen) >= self.max_nonces:
                raise AuthError("cache_full", f"more than {self.max_nonces} authenticated requests "
                                f"within {2 * self.max_skew_s:g} s; refusing until some expire")
            self._seen[nonce] = forget_at
            heapq.heappush(self._expiry, (forget_at, nonce))


class ThrottledLog:
    """At most one log line per ``key`` every ``interval_s``, with the number of lines
    suppressed since the last one. Keys must come from a small fixed set (never from
    request fields), so memory stays bounded."""

    def __init__(self, logger: logging.Logger, interval_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic):
        self.logger = logger
        self.interval_s = interval_s
        self.clock = clock
        self._last: Dict[object, float] = {}
        self._suppressed: Dict[object, int] = {}
        self._lock = threading.Lock()

    def log(self, level: int, key, msg: str) -> bool:
        now = self.clock()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < self.interval_s:
                self._suppressed[key] = self._suppressed.get(key, 0) + 1
                return False
            self._last[key] = now
            suppressed = self._suppressed.pop(key, 0)
        if suppressed:
            msg += f" (and {suppressed} more like this since the last report)"
        self.logger.log(level, msg)
        return True
