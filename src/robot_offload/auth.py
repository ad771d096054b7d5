"""Request authentication: HMAC-SHA256 tokens with a shared secret or per-client keys, no rospy.

When a key is configured, the client signs every request (``load_model``, ``compute``,
``ping``) and puts the token in the request's ``auth`` field::

    v2:<unix time, ms>:<nonce, 32 hex>:<request digest, 64 hex>:<HMAC-SHA256, 64 hex>

The request digest is :func:`canonical_request`: a SHA-256 over the method name and every
field of the request that the server acts on (client_id, model, weights hash, entry,
args_json, session, output codec and compression, ping payload) and, per tensor, a SHA-256
over its name, dtype, shape, codec, compression, quantisation parameters, raw size and
data. The MAC covers a domain tag, the timestamp, the nonce, the client_id, the method and
that digest (:func:`header_mac`), so it is a few hundred bytes whatever the request's size.
Changing any byte of the request changes the digest; changing the digest breaks the MAC.

The server (:class:`Verifier`) checks a token in two steps, cheapest first, so that a
forged token on a large request is refused before the payload is read: (1) format,
timestamp within ``max_skew_s`` of its own clock (robot and server clocks must agree to
within that: run chrony/NTP), the client's key, the MAC over the small header (compared
with :func:`hmac.compare_digest`) and the nonce not seen within the window (a replay);
only then (2) it hashes the request and compares the result with the digest the token
carries (constant time). A nonce is remembered only after both steps passed and only until
its timestamp leaves the window, and the cache is bounded (``max_nonces``; when full, new
tokens are refused rather than remembered badly), so neither an attacker without a key nor
one replaying a captured token on altered data can grow it or burn the legitimate
request's nonce. Tokens of the earlier format (``v1:``, a MAC over the whole request) are
refused with a message saying so.

Keys, one of:

* a shared secret (:func:`load_secret`): one key for every client. Any holder of the secret
  may claim any ``client_id``.
* per-client keys (:func:`load_keys`): a file mapping each ``client_id`` to its own key.
  The server picks the key by the request's claimed ``client_id``, so a token is valid
  only for the id whose key made it; an id without a key is refused (``unknown_client``).
  The client side is unchanged: it signs with its own key as with a shared secret.

After verification the request's :class:`Identity` (the ``client_id`` it may act as, and
how far that is proven) is what executors scope per-client state by; see
:meth:`Verifier.verify` and ``OffloadServer.identity_of``.

What this gives: only key holders can make the server load models, compute or answer
pings, a recorded request cannot be replayed, and with per-client keys a robot cannot act
as another. What it does not give: confidentiality (tensors cross in the clear: use a
WireGuard tunnel on an untrusted link) or authenticated responses. Secrets are read from
files (mode 0600) or from the environment, never from the parameter server, and never
logged.
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

VERSION = "v2"
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
#: Largest keys file read (bytes): some thousands of clients.
MAX_KEYS_FILE_BYTES = 1024 * 1024
NONCE_BYTES = 16
#: A client_id in a keys file: what ROS names and hostnames are made of.
CLIENT_ID_RE = re.compile(r"[A-Za-z0-9_.\-/]{1,128}")

_DOMAIN = b"robot_offload-auth-v2\x00"
_TOKEN_RE = re.compile(r"v2:(\d{1,15}):([0-9a-f]{32}):([0-9a-f]{64}):([0-9a-f]{64})")
_MAX_TOKEN_CHARS = 200

#: Request fields covered by the MAC, per method (tensors are digested separately).
SIGNED_FIELDS = {
    "load_model": ("client_id", "model", "weights_hash"),
    "compute": ("client_id", "model", "entry", "args_json", "session", "output_codec",
                "output_compression", "request_id"),
    "ping": ("client_id", "payload", "versions_json"),
}


class AuthError(OffloadError):
    """A request's token does not authenticate it; ``reason`` is a short category
    (missing, malformed, version, skew, unknown_client, signature, replay, cache_full)
    for throttled logging."""

    def __init__(self, reason: str, text: str):
        super().__init__(text)
        self.reason = reason


class Identity(str):
    """The ``client_id`` a request may act as, with how far that is established.

    A ``str`` (the client_id itself), so it can key per-client state directly.
    ``scheme`` is ``"per_client"`` (the token was made with this id's own key: the id is
    proven), ``"shared_secret"`` (a valid token, but any holder of the shared secret may
    claim any id) or ``"none"`` (authentication off: the id is only claimed)."""

    scheme: str

    def __new__(cls, client_id: str, scheme: str):
        if scheme not in ("per_client", "shared_secret", "none"):
            raise ValueError(f"unknown identity scheme {scheme!r}")
        self = super().__new__(cls, client_id)
        self.scheme = scheme
        return self

    @property
    def authenticated(self) -> bool:
        """The request carried a valid token (per-client key or shared secret)."""
        return self.scheme != "none"

    @property
    def proven(self) -> bool:
        """Only this client could have made the request (its own key signed it)."""
        return self.scheme == "per_client"

    def __repr__(self) -> str:
        return f"Identity({str(self)!r}, {self.scheme!r})"


#: Attribute of a request object under which the server records its :class:`Identity`
#: once verified (see :func:`bind_identity`).
IDENTITY_ATTR = "_robot_offload_identity"


def bind_identity(request, identity: Optional[Identity]) -> None:
    """Record on ``request`` the identity its verification established, or clear it
    (None). The server does this for every request before dispatch, overwriting whatever
    was there; a request object that cannot take the attribute is left without one (and
    ``OffloadServer.identity_of`` then refuses it when authentication is on)."""
    try:
        object.__setattr__(request, IDENTITY_ATTR, identity)
    except (AttributeError, TypeError):
        pass


def claimed_identity(request) -> Optional[Identity]:
    """The unauthenticated identity of ``request`` (its claimed client_id, scheme
    ``"none"``), for a server without keys; None when client_id is not a string."""
    client_id = getattr(request, "client_id", None)
    return Identity(client_id, "none") if isinstance(client_id, str) else None


def bound_identity(request) -> Optional[Identity]:
    """The identity :func:`bind_identity` recorded on ``request``, or None."""
    identity = getattr(request, IDENTITY_ATTR, None)
    return identity if isinstance(identity, Identity) else None


# -- secrets ------------------------------------------------------------------------------
def secret_from_text(text, source: str = "secret") -> bytes:
    """The secret as bytes (surrounding whitespace stripped); refuses short ones."""
    raw = text.encode() if isinstance(text, str) else bytes(text)
    raw = raw.strip()
    if len(raw) < MIN_SECRET_BYTES:
        raise ConfigError(f"{source}: the secret must be at least {MIN_SECRET_BYTES} bytes "
                          f"(e.g. `openssl rand -hex 32`), got {len(raw)}")
    return raw


def _read_private_file(path: str, what: str, max_bytes: int) -> bytes:
    """The bytes of a file that holds secrets; refuses a missing, non-regular, oversized
    file or one that group or others may read or write (like ssh: chmod 600 it)."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise ConfigError(f"{what} {path!r}: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"{what} {path!r} is not a regular file")
    if st.st_mode & 0o077:
        raise ConfigError(f"{what} {path!r} has mode {stat.S_IMODE(st.st_mode):04o}; "
                          f"it must not be accessible to group or others (chmod 600 {path})")
    if st.st_size > max_bytes:
        raise ConfigError(f"{what} {path!r} is larger than {max_bytes} bytes")
    with open(path, "rb") as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise ConfigError(f"{what} {path!r} is larger than {max_bytes} bytes")
    return data


def read_secret_file(path: str) -> bytes:
    """Read a secret file; refuses a missing, empty, non-regular, oversized file or one that
    group or others may read or write (like ssh: chmod 600 it)."""
    data = _read_private_file(path, "auth secret file", MAX_SECRET_FILE_BYTES)
    return secret_from_text(data, f"auth secret file {path!r}")


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


def parse_keys(text: str, source: str = "keys file") -> Dict[str, bytes]:
    """``client_id -> key`` from the text of a keys file.

    One ``client_id: secret`` per line (a subset of YAML: the secret may be quoted with
    ``'`` or ``"``); blank lines and lines starting with ``#`` are ignored. client_ids are
    letters, digits and ``_ . - /`` (at most 128); every secret is at least
    :data:`MIN_SECRET_BYTES` bytes. A client_id listed twice, or two clients with the same
    secret (each could then act as the other), is refused. Errors name the line, never
    the secret."""
    keys: Dict[str, bytes] = {}
    owner: Dict[bytes, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        where = f"{source}, line {number}"
        client_id, sep, value = stripped.partition(":")
        client_id, value = client_id.strip(), value.strip()
        if not sep or not CLIENT_ID_RE.fullmatch(client_id):
            raise ConfigError(f"{where}: expected `client_id: secret` with a client_id of "
                              f"letters, digits and _ . - / (at most 128)")
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        if client_id in keys:
            raise ConfigError(f"{where}: client_id {client_id!r} is listed twice")
        key = secret_from_text(value, f"{where} ({client_id!r})")
        if key in owner:
            raise ConfigError(f"{where}: {client_id!r} has the same secret as {owner[key]!r}; "
                              "every client needs its own")
        keys[client_id] = key
        owner[key] = client_id
    if not keys:
        raise ConfigError(f"{source}: no `client_id: secret` lines")
    return keys


def load_keys(path: str) -> Dict[str, bytes]:
    """Per-client keys from a keys file (mode 0600, see :func:`parse_keys`)."""
    path = os.path.expanduser(str(path))
    data = _read_private_file(path, "auth keys file", MAX_KEYS_FILE_BYTES)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"auth keys file {path!r} is not UTF-8 text") from None
    return parse_keys(text, f"auth keys file {path!r}")


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
    except (TypeError, ValueError, OverflowError) as e:
        raise AuthError("malformed", f"tensor fields are not numbers: {e}") from None
    _put(h, ",".join(map(str, shape)).encode())
    for n in numbers:
        _put(h, n.encode())
    _put(h, _as_bytes(t.data, "tensor data"))
    return h.digest()


def canonical_request(method: str, request) -> bytes:
    """The request digest a token carries: SHA-256 over ``method`` and the fields of
    ``request`` the server acts on (unambiguous: every field is length-prefixed and in a
    fixed order). Reads every byte of every tensor: the server computes it only after
    the token's header checked out."""
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


def header_mac(key: bytes, timestamp_ms: str, nonce: bytes, client_id: str, method: str,
               digest: bytes) -> bytes:
    """The token's MAC: HMAC-SHA256 under ``key`` over the domain tag, timestamp, nonce,
    client_id, method and request digest (each length-prefixed). Costs the same whatever
    the request's size."""
    h = hmac.new(key, _DOMAIN, hashlib.sha256)
    for part in (timestamp_ms.encode(), nonce, _as_bytes(client_id, "client_id"),
                 method.encode(), digest):
        _put(h, part)
    return h.digest()


def make_token(secret: bytes, method: str, request, now_s: Optional[float] = None,
               nonce: Optional[bytes] = None) -> str:
    """A fresh v2 token for ``request`` under ``secret`` (the shared secret, or this
    client's own key); the request's own ``auth`` field is not covered."""
    if method not in SIGNED_FIELDS:
        raise AuthError("malformed", f"unknown method {method!r}")
    ts = str(int(round((time.time() if now_s is None else now_s) * 1000)))
    nonce = _secrets.token_bytes(NONCE_BYTES) if nonce is None else nonce
    digest = canonical_request(method, request)
    mac = header_mac(secret, ts, nonce, request.client_id, method, digest)
    return f"{VERSION}:{ts}:{nonce.hex()}:{digest.hex()}:{mac.hex()}"


def sign_request(secret: bytes, method: str, request):
    """A copy of ``request`` (a protocol dataclass) carrying a fresh token; the caller's
    object is not modified, so a retried request gets a new nonce."""
    return replace(request, auth=make_token(secret, method, request))


# -- server side ----------------------------------------------------------------------------
class Verifier:
    """Checks tokens; thread-safe. Keyed either by one shared ``secret`` (any holder may
    claim any client_id) or by ``keys``, a ``client_id -> key`` map (a token is valid only
    for the client_id whose key made it). ``clock`` is wall-clock seconds (both sides'
    clocks must agree to within ``max_skew_s``)."""

    def __init__(self, secret: Optional[bytes] = None, max_skew_s: float = DEFAULT_MAX_SKEW_S,
                 max_nonces: int = DEFAULT_MAX_NONCES, clock: Callable[[], float] = time.time,
                 keys: Optional[Dict[str, bytes]] = None):
        if bool(secret) == bool(keys):
            raise ConfigError("Verifier needs either a shared secret or per-client keys (not both)")
        if not max_skew_s > 0 or max_nonces < 1:
            raise ConfigError("max_skew_s must be > 0 and max_nonces >= 1")
        if keys:
            if not all(isinstance(k, str) and v for k, v in keys.items()):
                raise ConfigError("per-client keys must map client_id strings to non-empty keys")
            self._keys: Optional[Dict[str, bytes]] = {k: bytes(v) for k, v in keys.items()}
            self._secret = None
        else:
            self._keys = None
            self._secret = bytes(secret)
        self.max_skew_s = float(max_skew_s)
        self.max_nonces = int(max_nonces)
        self.clock = clock
        self._seen: Dict[bytes, float] = {}
        self._expiry = []          # heap of (forget_at, nonce)
        self._lock = threading.Lock()

    @property
    def per_client(self) -> bool:
        """True with per-client keys, False with a shared secret."""
        return self._keys is not None

    @property
    def clients(self):
        """The client_ids that have a key (per-client mode), sorted; () with a shared secret."""
        return tuple(sorted(self._keys)) if self._keys is not None else ()

    @property
    def remembered(self) -> int:
        return len(self._seen)

    def _key_for(self, client_id: str) -> bytes:
        if self._keys is None:
            return self._secret
        key = self._keys.get(client_id)
        if key is None:
            raise AuthError("unknown_client", f"no key for client_id {client_id[:64]!r} on this server")
        return key

    def _forget_expired(self, now: float) -> None:
        while self._expiry and self._expiry[0][0] < now:
            _, old = heapq.heappop(self._expiry)
            self._seen.pop(old, None)

    def _check_fresh(self, nonce: bytes) -> None:
        if nonce in self._seen:
            raise AuthError("replay", "replayed token (nonce already used)")
        if len(self._seen) >= self.max_nonces:
            raise AuthError("cache_full", f"more than {self.max_nonces} authenticated requests "
                            f"within {2 * self.max_skew_s:g} s; refusing until some expire")

    def verify(self, method: str, request) -> Identity:
        """The request's :class:`Identity` if it carries a valid, fresh, unseen token made
        with the key of its ``client_id``; else raise AuthError.

        Everything that does not depend on the payload is checked first (format, clock,
        key, MAC over the header, replay); the payload is hashed only for a token that
        passed all of that, and the nonce is remembered only once the hash matched too."""
        token = getattr(request, "auth", None)
        if not token:
            raise AuthError("missing", "no authentication token (this server requires one)")
        if not isinstance(token, str) or len(token) > _MAX_TOKEN_CHARS:
            raise AuthError("malformed", "malformed authentication token")
        if token.startswith("v1:"):
            raise AuthError("version", "token version v1 is no longer accepted; this server "
                            f"needs {VERSION} tokens (update robot_offload on the client)")
        m = _TOKEN_RE.fullmatch(token)
        if m is None:
            raise AuthError("malformed", "malformed authentication token (expected "
                            f"{VERSION}:<ms>:<32 hex>:<64 hex>:<64 hex>)")
        if method not in SIGNED_FIELDS:
            raise AuthError("malformed", f"unknown method {method!r}")
        ts_text, nonce_hex, digest_hex, mac_hex = m.groups()
        now = self.clock()
        skew = int(ts_text) / 1000.0 - now
        if abs(skew) > self.max_skew_s:
            raise AuthError("skew", f"token timestamp is {skew:+.1f} s from the server's clock; "
                            f"the window is +-{self.max_skew_s:g} s (synchronise the clocks)")
        client_id = getattr(request, "client_id", None)
        if not isinstance(client_id, str):
            raise AuthError("malformed", "client_id is not a string")
        key = self._key_for(client_id)
        nonce, carried = bytes.fromhex(nonce_hex), bytes.fromhex(digest_hex)
        expected = header_mac(key, ts_text, nonce, client_id, method, carried)
        if not hmac.compare_digest(expected, bytes.fromhex(mac_hex)):
            raise AuthError("signature", "bad signature (wrong key for this client_id, or "
                            "altered token)")
        with self._lock:
            self._forget_expired(now)
            self._check_fresh(nonce)       # refuse a replay before reading its payload
        # Only a token made with the right key gets this far: now the payload is read.
        if not hmac.compare_digest(canonical_request(method, request), carried):
            raise AuthError("signature", "bad signature (the request does not match its "
                            "token: altered request)")
        forget_at = int(ts_text) / 1000.0 + self.max_skew_s
        with self._lock:
            self._check_fresh(nonce)       # a concurrent copy may have passed meanwhile
            self._seen[nonce] = forget_at
            heapq.heappush(self._expiry, (forget_at, nonce))
        return Identity(client_id, "per_client" if self._keys is not None else "shared_secret")


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
