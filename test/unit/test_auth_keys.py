"""Per-client keys and the v2 token's cheap refusal: a client's key signs for its own
client_id only, an id without a key is refused, a forged or replayed token is refused
before the payload is hashed, a nonce is remembered only after the whole check passed,
keys files are parsed strictly, and executors see the verified identity."""

import dataclasses
import json
import logging
import os

import pytest
import torch

from robot_offload import auth, codec
from robot_offload.errors import ConfigError
from robot_offload.protocol import ComputeRequest, ComputeResponse, PingRequest, StatusCode
from robot_offload.server import Executor, OffloadServer, RequestRejected, ServerConfig

KEY_A = b"a" * 16 + b"0123456789abcdef"
KEY_B = b"b" * 16 + b"0123456789abcdef"
SHARED = b"0123456789abcdef0123456789abcdef"
KEYS = {"robotA": KEY_A, "robotB": KEY_B}
ENTRY = "test_identity"


class IdentityExecutor(Executor):
    """A model-free entry answering with the identity the server gives it."""
    ENTRY = ENTRY
    NEEDS_MODEL = False

    def __call__(self, loaded, req):
        who = self.server.identity_of(req)
        return ComputeResponse(status=StatusCode.OK, result_json=json.dumps(
            {"identity": str(who), "scheme": who.scheme, "type": type(who).__name__}))


def _server(**kw):
    s = OffloadServer(ServerConfig(ops_sandbox=False, device="cpu"), **kw)
    s.executors[ENTRY] = IdentityExecutor(s)
    return s


def _req(client_id, n=1000):
    return ComputeRequest(client_id=client_id, model="", entry=ENTRY,
                          tensors=[codec.encode(torch.arange(n, dtype=torch.float32), "x")])


def _signed(key, method, req, **kw):
    return dataclasses.replace(req, auth=auth.make_token(key, method, req, **kw))


def _identity(resp):
    assert resp.status == StatusCode.OK, resp.status_text
    return json.loads(resp.result_json)


# -- per-client keys --------------------------------------------------------------------------
def test_each_client_is_accepted_with_its_own_key_and_identified():
    s = _server(auth_keys=KEYS)
    for client, key in KEYS.items():
        got = _identity(s.handle("compute", _signed(key, "compute", _req(client))))
        assert got == {"identity": client, "scheme": "per_client", "type": "Identity"}
        assert s.handle("ping", _signed(key, "ping", PingRequest(client, b"x"))).status == StatusCode.OK


def test_a_clients_key_cannot_sign_as_another_client():
    s = _server(auth_keys=KEYS)
    for method, req in (("compute", _req("robotB")), ("ping", PingRequest("robotB", b""))):
        r = s.handle(method, _signed(KEY_A, method, req))
        assert r.status == StatusCode.UNAUTHORIZED and "bad signature" in r.status_text, r.status_text
    # ... nor re-label a request it signed for itself
    mine = _signed(KEY_A, "compute", _req("robotA"))
    r = s.handle("compute", dataclasses.replace(mine, client_id="robotB"))
    assert r.status == StatusCode.UNAUTHORIZED and "bad signature" in r.status_text
    # with a shared secret, claiming another id is exactly what a holder can do
    shared = _server(auth_secret=SHARED)
    got = _identity(shared.handle("compute", _signed(SHARED, "compute", _req("robotB"))))
    assert got["identity"] == "robotB" and got["scheme"] == "shared_secret"


def test_unknown_client_is_refused_and_logged_throttled(caplog):
    s = _server(auth_keys=KEYS)
    with caplog.at_level(logging.WARNING, logger="robot_offload.server"):
        for i in range(20):
            r = s.handle("ping", _signed(KEY_A, "ping", PingRequest(f"intruder{i}", b"")))
            assert r.status == StatusCode.UNAUTHORIZED and "no key for client_id" in r.status_text
    lines = [r.getMessage() for r in caplog.records if "UNAUTHORIZED" in r.getMessage()]
    assert len(lines) == 1 and "no key for client_id" in lines[0], lines
    with pytest.raises(auth.AuthError) as e:
        auth.Verifier(keys=KEYS).verify("ping", _signed(KEY_A, "ping", PingRequest("robotC", b"")))
    assert e.value.reason == "unknown_client"
    for key in KEYS.values():     # no key's bytes in any message
        assert key.decode() not in caplog.text


def test_verifier_needs_exactly_one_kind_of_key():
    with pytest.raises(ConfigError):
        auth.Verifier()
    with pytest.raises(ConfigError):
        auth.Verifier(SHARED, keys=KEYS)


# -- refusing before hashing ----------------------------------------------------------------
@pytest.fixture
def hashing(monkeypatch):
    """Counts every call of the functions that read a request's payload."""
    calls = {"tensor_digest": 0, "canonical_request": 0}
    for name in calls:
        real = getattr(auth, name)

        def counting(*a, _real=real, _name=name, **kw):
            calls[_name] += 1
            return _real(*a, **kw)
        monkeypatch.setattr(auth, name, counting)
    return calls


def _forged(req, **fields):
    """A well-formed, fresh v2 token whose MAC (and, by default, digest) is random."""
    parts = dict(ts=str(int(auth.time.time() * 1000)), nonce=os.urandom(16).hex(),
                 digest=os.urandom(32).hex(), mac=os.urandom(32).hex())
    parts.update(fields)
    return dataclasses.replace(req, auth="v2:{ts}:{nonce}:{digest}:{mac}".format(**parts))


@pytest.mark.parametrize("keys", ["shared", "per_client"])
def test_forged_token_is_refused_without_hashing_the_payload(hashing, keys):
    s = _server(auth_secret=SHARED) if keys == "shared" else _server(auth_keys=KEYS)
    big = _req("robotA", n=1 << 16)
    true_digest = auth.canonical_request("compute", big).hex()
    hashing.update(tensor_digest=0, canonical_request=0)
    for forged in (_forged(big), _forged(big, digest=true_digest)):
        r = s.handle("compute", forged)
        assert r.status == StatusCode.UNAUTHORIZED and "bad signature" in r.status_text
    assert hashing == {"tensor_digest": 0, "canonical_request": 0}
    # the counters do see a genuine request's payload being hashed
    key = SHARED if keys == "shared" else KEY_A
    signed = _signed(key, "compute", big)
    hashing.update(tensor_digest=0, canonical_request=0)
    assert s.handle("compute", signed).status == StatusCode.OK
    assert hashing["tensor_digest"] == 1 and hashing["canonical_request"] == 1


def test_replayed_token_is_refused_without_hashing_the_payload(hashing):
    s = _server(auth_keys=KEYS)
    signed = _signed(KEY_A, "compute", _req("robotA"))
    assert s.handle("compute", signed).status == StatusCode.OK
    hashing.update(tensor_digest=0, canonical_request=0)
    r = s.handle("compute", signed)
    assert r.status == StatusCode.UNAUTHORIZED and "replayed" in r.status_text
    assert hashing == {"tensor_digest": 0, "canonical_request": 0}


def test_a_nonce_is_remembered_only_after_the_payload_matched():
    """A captured token replayed first on altered data must neither pass nor burn the
    genuine request's nonce."""
    v = auth.Verifier(keys=KEYS)
    genuine = _signed(KEY_A, "compute", _req("robotA"))
    t = genuine.tensors[0]
    altered = dataclasses.replace(genuine, tensors=[dataclasses.replace(t, data=b"\0" * len(t.data))])
    with pytest.raises(auth.AuthError) as e:
        v.verify("compute", altered)
    assert e.value.reason == "signature" and v.remembered == 0
    assert v.verify("compute", genuine) == "robotA" and v.remembered == 1
    with pytest.raises(auth.AuthError) as e:
        v.verify("compute", genuine)
    assert e.value.reason == "replay"


def test_v2_token_binds_method_and_client_id_in_its_header():
    req = PingRequest("robotA", b"")
    token = auth.make_token(KEY_A, "ping", req)
    version, ts, nonce, digest, mac = token.split(":")
    assert version == "v2" and digest == auth.canonical_request("ping", req).hex()
    assert mac == auth.header_mac(KEY_A, ts, bytes.fromhex(nonce), "robotA", "ping",
                                  bytes.fromhex(digest)).hex()
    assert mac != auth.header_mac(KEY_A, ts, bytes.fromhex(nonce), "robotB", "ping",
                                  bytes.fromhex(digest)).hex()


# -- identity ---------------------------------------------------------------------------------
def test_identity_without_authentication_is_the_claimed_id_marked_unauthenticated():
    s = _server()
    got = _identity(s.handle("compute", _req("anyone")))
    assert got == {"identity": "anyone", "scheme": "none", "type": "Identity"}
    ident = auth.Identity("anyone", "none")
    assert not ident.authenticated and not ident.proven and ident == "anyone"
    assert auth.Identity("x", "shared_secret").authenticated and not auth.Identity("x", "shared_secret").proven
    assert auth.Identity("x", "per_client").proven


def test_identity_set_by_the_caller_is_overwritten_and_unhandled_requests_have_none():
    s = _server(auth_keys=KEYS)
    req = _signed(KEY_A, "compute", _req("robotA"))
    auth.bind_identity(req, auth.Identity("robotB", "per_client"))
    assert _identity(s.handle("compute", req))["identity"] == "robotA"
    with pytest.raises(RequestRejected) as e:
        s.identity_of(_req("robotA"))
    assert e.value.code == StatusCode.UNAUTHORIZED


# -- keys files -------------------------------------------------------------------------------
def _keys_file(tmp_path, text, mode=0o600):
    path = tmp_path / "keys"
    path.write_text(text)
    os.chmod(path, mode)
    return str(path)


def test_keys_file_is_read():
    text = ("# robot keys\n\nrobotA: " + KEY_A.decode() + "\n"
            "  robot_b.2/x :  '" + KEY_B.decode() + "'  \n")
    assert auth.parse_keys(text) == {"robotA": KEY_A, "robot_b.2/x": KEY_B}


def test_keys_file_from_disk_and_its_mode(tmp_path):
    path = _keys_file(tmp_path, f"robotA: {KEY_A.decode()}\nrobotB: {KEY_B.decode()}\n")
    assert auth.load_keys(path) == KEYS
    os.chmod(path, 0o640)
    with pytest.raises(ConfigError) as e:
        auth.load_keys(path)
    assert "chmod 600" in str(e.value)
    with pytest.raises(ConfigError):
        auth.load_keys(str(tmp_path / "missing"))


@pytest.mark.parametrize("text,fragment", [
    ("", "no `client_id: secret`"),
    ("# only a comment\n", "no `client_id: secret`"),
    ("robotA " + KEY_A.decode(), "line 1"),
    ("robot A: " + KEY_A.decode(), "line 1"),
    ("robotA: short", "at least 16"),
    (f"robotA: {KEY_A.decode()}\nrobotA: {KEY_B.decode()}", "listed twice"),
    (f"robotA: {KEY_A.decode()}\nrobotB: {KEY_A.decode()}", "same secret"),
])
def test_bad_keys_files_are_refused_without_showing_secrets(text, fragment):
    with pytest.raises(ConfigError) as e:
        auth.parse_keys(text)
    assert fragment in str(e.value)
    assert KEY_A.decode() not in str(e.value) and "short" not in str(e.value)
