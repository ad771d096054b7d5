"""Whether a robot and a server compute the same thing: the versions they exchange when
they first talk, and the one rule that compares them.

The client sends its :class:`Versions` with its first ``ping`` (``ServerLink.connect``
and its reconnect prober, the transparent launcher); the server answers with its own and,
for the operators the client listed, the ones it would read differently
(:func:`differing_ops`). The rule:

* **Protocol.** :data:`PROTOCOL_VERSION` names what both sides must read alike: the
  services' fields and their meaning, the tensor codec's formats, the compute entries'
  arguments. It must be equal for every mode; the server answers a client of another
  protocol with ``INCOMPATIBLE``, and a client that meets such a server stops offloading
  (:class:`~robot_offload.errors.Incompatible`, logged as an error, each frame's
  ``fallback_reason``), whatever the torch versions.
* **Operator schemas.** ``transparent`` and ``record_replay`` send single aten (and
  torchvision) operators by name with their arguments, which the server binds with its own
  torch's schema of that operator. So for every operator of the allow-list the client sends
  a digest of its schema, and the server names those whose schema reads the client's calls
  differently (or that its torch lacks or its allow-list refuses). Schemas are compared
  as torch binds calls, not as text: ``SymInt`` is an ``int`` and defaults are compared as
  values (torch 2.1 prints ``int[2] stride=1`` where later versions print ``SymInt[2]
  stride=[1, 1]``), and a server schema that only adds trailing arguments with defaults
  reads an older client's calls as before (torch's own rule for evolving operators). The
  client refuses to send those operators (:func:`op_refusals`): its operator backends
  compute the frame locally, naming the operator and both torch versions; the launcher
  runs that operator on the robot. The other operators are still offloaded.
* **Whole-model modes** (``full_offload``, ``layer_partition``, ``lop``) send tensors as
  bytes, dtype and shape; other torch versions on the two sides are fine once the
  protocol matches (and the weights hash, which ``load_model`` checks).
* **Compute entries.** A new entry is no protocol change (the existing entries read
  their requests as before), so it does not bump :data:`PROTOCOL_VERSION`: a server of an
  earlier release answers it ``UNKNOWN_ENTRY``, and the client goes on with the entries
  that server has. ``full_offload`` sends camera images to ``forward_image``; a server
  without it gets the preprocessed tensor (``forward``) from then on, remembered per
  server id (:mod:`robot_offload.backends.full_offload`).

Pure data and arithmetic, apart from the schema functions at the end, which read this
process's torch; no server code (the robot and the server both import it).
"""

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Dict, FrozenSet, Mapping, Optional

#: Bumped whenever the services' fields or meaning, the codec's formats or a compute
#: entry's arguments change (test_compat checks it moves with the .srv/.msg files).
PROTOCOL_VERSION = 4
#: Longest versions_json accepted (characters): the allow-list's digests take ~15 KB.
MAX_VERSIONS_JSON_CHARS = 256 * 1024
#: Most operators one client may list.
MAX_OPS = 4096
#: Longest reason a server gives for one differing operator (its schema is < 300).
MAX_WHY_CHARS = 1024
#: Characters of a schema digest (hex).
DIGEST_CHARS = 16
_OP_NAME = re.compile(r"^[a-z]+::[A-Za-z0-9_]+\.[A-Za-z0-9_]+$")
_VERSION_TEXT = re.compile(r"^[A-Za-z0-9.+_\-:]{0,64}$")
_HEX = re.compile(r"^[0-9a-f]{%d}$" % DIGEST_CHARS)


class VersionsError(ValueError):
    """A versions_json that is not the form :meth:`Versions.from_json` reads."""


@dataclass(frozen=True)
class Versions:
    """What one side runs. ``ops`` (a client's): operator name -> digest of its schema
    (:func:`schema_digest`); ``ops_differ`` (a server's answer): operator name -> why the
    server reads it differently."""

    package: str
    protocol: int
    torch: str
    torchvision: str = ""
    device: str = ""
    ops: Mapping[str, str] = field(default_factory=dict)
    ops_differ: Mapping[str, str] = field(default_factory=dict)

    def describe(self) -> str:
        """``protocol 1 (robot_offload 0.1.0, torch 2.1.2)``, for messages."""
        return f"protocol {self.protocol} (robot_offload {self.package}, torch {self.torch})"

    def to_json(self) -> str:
        out = {"package": self.package, "protocol": self.protocol, "torch": self.torch,
               "torchvision": self.torchvision, "device": self.device}
        if self.ops:
            out["ops"] = dict(sorted(self.ops.items()))
        if self.ops_differ:
            out["ops_differ"] = dict(sorted(self.ops_differ.items()))
        return json.dumps(out, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "Versions":
        """Parse what the other side sent; anything else than the documented form, or
        more than the limits, raises :class:`VersionsError`."""
        if not isinstance(text, str) or not text:
            raise VersionsError("no versions given")
        if len(text) > MAX_VERSIONS_JSON_CHARS:
            raise VersionsError(f"versions_json has {len(text)} characters; at most {MAX_VERSIONS_JSON_CHARS}")
        try:
            obj = json.loads(text)
        except (ValueError, RecursionError):
            raise VersionsError("versions_json is not JSON") from None
        if not isinstance(obj, dict):
            raise VersionsError("versions_json must be a JSON object")
        unknown = set(obj) - {"package", "protocol", "torch", "torchvision", "device", "ops", "ops_differ"}
        if unknown:
            raise VersionsError(f"versions_json has unknown keys {[k[:40] for k in sorted(unknown)[:5]]}")
        protocol = obj.get("protocol")
        if type(protocol) is not int or not 0 <= protocol < 1 << 31:
            raise VersionsError("versions_json: protocol must be a non-negative integer")
        texts = {}
        for key in ("package", "torch", "torchvision", "device"):
            value = obj.get(key, "")
            if not isinstance(value, str) or not _VERSION_TEXT.match(value):
                raise VersionsError(f"versions_json: {key} must be a short version string")
            texts[key] = value
        ops = _string_map(obj.get("ops", {}), "ops", lambda v: bool(_HEX.match(v)))
        differ = _string_map(obj.get("ops_differ", {}), "ops_differ", lambda v: len(v) <= MAX_WHY_CHARS)
        return cls(protocol=protocol, ops=ops, ops_differ=differ, **texts)


# -- the rule ------------------------------------------------------------------------------
def protocol_refusal(client: Versions, server: Versions) -> Optional[str]:
    """None when client and server speak the same protocol, else why no mode can work
    between them (naming both sides' versions)."""
    if client.protocol == server.protocol:
        return None
    return (f"the client speaks {client.describe()} and the server {server.describe()}: they "
            f"encode requests differently, so no mode can offload between them; install the "
            f"same robot_offload release on both")


def differing_ops(client: Versions, accepted: Mapping[str, FrozenSet[str]],
                  schemas: Mapping[str, str]) -> Dict[str, str]:
    """On the server, for the operators the client listed (``client.ops``): those whose
    calls this server would read differently, with why. ``accepted``
    (:func:`accepted_digests`): each allow-listed operator -> the schema digests of the
    calls it binds alike (empty where this torch lacks the operator); ``schemas``:
    operator -> its schema here (:func:`op_schemas`), for the message."""
    out = {}
    for name, digest in client.ops.items():
        ok = accepted.get(name)
        if ok is None:
            out[name] = "it is not on the server's allow-list"
        elif not ok:
            out[name] = "the server's torch has no such operator"
        elif digest not in ok:
            out[name] = f"the server's schema is {schemas[name]}"[:MAX_WHY_CHARS]
    return out


def checked_server_versions(client: Versions, versions_json: str) -> Versions:
    """On the client: the server's answer to its versions, read and checked. Raises
    :class:`~robot_offload.errors.Incompatible` for a server of another protocol, or one
    that sends no versions (it predates the exchange)."""
    from robot_offload.errors import Incompatible
    from robot_offload.protocol import StatusCode
    try:
        server = Versions.from_json(versions_json)
    except VersionsError as e:
        raise Incompatible(StatusCode.INCOMPATIBLE, f"the server sent no usable versions ({e}): it "
                           f"predates the client's {client.describe()}") from None
    refusal = protocol_refusal(client, server)
    if refusal is not None:
        raise Incompatible(StatusCode.INCOMPATIBLE, refusal)
    return server


def op_refusals(client: Versions, server: Versions) -> Dict[str, str]:
    """On the client, from the server's answer: operator -> why it must not be sent to
    that server (the operator modes refuse it; see the module docstring)."""
    return {name: (f"{name} cannot be offloaded: the server (torch {server.torch}) would read "
                   f"its arguments differently from the robot (torch {client.torch}): {why}")
            for name, why in server.ops_differ.items()}


def _string_map(value, key: str, valid) -> Dict[str, str]:
    if not isinstance(value, dict):
        raise VersionsError(f"versions_json: {key} must be an object")
    if len(value) > MAX_OPS:
        raise VersionsError(f"versions_json: {key} lists {len(value)} operators; at most {MAX_OPS}")
    for name, v in value.items():
        if not _OP_NAME.match(name) or len(name) > 256:
            raise VersionsError(f"versions_json: {key} has a malformed operator name {name[:80]!r}")
        if not isinstance(v, str) or not valid(v):
            raise VersionsError(f"versions_json: {key}[{name!r}] is malformed")
    return dict(value)


# -- schemas ---------------------------------------------------------------------------
def _arg_text(a) -> str:
    """One argument as torch binds it: type (SymInt is int there), fixed list size, alias
    annotation, name, keyword-only, default value."""
    info = a.alias_info
    alias = ""
    if info is not None:
        alias = "(" + "|".join(sorted(info.before_set)) + ("!" if info.is_write else "") + ")"
    size = f"[{a.N}]" if a.N is not None else ""
    text = f"{'*' if a.kwarg_only else ''}{a.type}{size}{alias} {a.name}"
    if a.has_default_value():
        text += "=" + repr(a.default_value)
    return text


def schema_text(op, n_args: Optional[int] = None) -> str:
    """The normalised schema of an OpOverload or a FunctionSchema (its first ``n_args``
    arguments)."""
    s = getattr(op, "_schema", op)
    args = list(s.arguments)[:n_args]
    rets = []
    for r in s.returns:
        info = r.alias_info
        alias = ("(" + "|".join(sorted(info.before_set)) + ("!" if info.is_write else "") + ")"
                 if info is not None else "")
        rets.append(f"{r.type}{alias}")
    name = f"{s.name}.{s.overload_name or 'default'}"
    return f"{name}({', '.join(_arg_text(a) for a in args)}) -> ({', '.join(rets)})"


def schema_digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:DIGEST_CHARS]


def accepted_schema_digests(op) -> FrozenSet[str]:
    """Digests of the schemas whose calls ``op`` binds alike: its own, and its own less
    trailing arguments that all have defaults (a client whose torch predates them never
    passes them, so they keep their defaults)."""
    args = list(getattr(op, "_schema", op).arguments)
    out = {schema_digest(schema_text(op))}
    k = len(args)
    while k > 0 and args[k - 1].has_default_value():
        k -= 1
        out.add(schema_digest(schema_text(op, k)))
    return frozenset(out)


_LOCAL: Dict[str, object] = {}


def _allowed_ops() -> Dict[str, object]:
    """Every allow-listed operator: name -> its OpOverload in this process's torch, or
    None where this torch has no such operator (one of a later release)."""
    if "ops" not in _LOCAL:
        from robot_offload.transparent import wire
        from robot_offload.transparent.allowed_ops import ALLOWED_OPS
        ops = {}
        for name in sorted(ALLOWED_OPS):
            try:
                ops[name] = wire.resolve_op(name)
            except wire.WireError:
                ops[name] = None
        _LOCAL["ops"] = ops
    return _LOCAL["ops"]


def op_schemas() -> Dict[str, str]:
    """Allow-listed operator -> its normalised schema, in this process's torch."""
    if "schemas" not in _LOCAL:
        _LOCAL["schemas"] = {name: schema_text(op) for name, op in _allowed_ops().items()
                             if op is not None}
    return _LOCAL["schemas"]


def accepted_digests() -> Dict[str, FrozenSet[str]]:
    """Allow-listed operator -> :func:`accepted_schema_digests` in this process's torch
    (empty where it has no such operator)."""
    if "accepted" not in _LOCAL:
        _LOCAL["accepted"] = {name: accepted_schema_digests(op) if op is not None else frozenset()
                              for name, op in _allowed_ops().items()}
    return _LOCAL["accepted"]


def local_versions(device: str = "", with_ops: bool = True) -> Versions:
    """This process's versions; ``with_ops``: with the digests of the allow-listed
    operators' schemas (what a client sends)."""
    import torch
    from robot_offload import __version__
    try:
        import torchvision
        tv = torchvision.__version__
    except ImportError:
        tv = ""
    ops = {name: schema_digest(text) for name, text in op_schemas().items()} if with_ops else {}
    return Versions(package=__version__, protocol=PROTOCOL_VERSION, torch=torch.__version__,
                    torchvision=tv, device=device, ops=ops)
