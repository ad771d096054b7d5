"""Shared-secret authentication: the right secret is accepted; a missing, malformed,
wrongly signed, tampered, stale or replayed token is refused with UNAUTHORIZED, and the
server keeps serving. Also secret loading, the replay cache's bound, throttled refusal
logs, per-client allow lists and the client's local fallback with a wrong secret."""

import dataclasses
import json
import logging
import os

import pytest
import torch

from robot_offload import auth, codec
from robot_offload.client import ClientConfig, OffloadClient
from robot_offload.errors import ConfigError, Unauthorized
from robot_offload.protocol import (ComputeRequest, LoadModelRequest, PingRequest, StatusCode,
                                    raise_for_status)
from robot_offload.server import OffloadServer, ServerConfig
from robot_offload.transport.inproc import InProcessTransport

from devices import SERVER_DEVICE, assert_same_as_local, to_server

SECRET = b"0123456789abcdef0123456789abcdef"
WRONG = b"fedcba9876543210fedcba9876543210"
X = torch.randn(1, 3, 32, 32)


@pytest.fixture(scope="module")
def server():
    s = OffloadServer(ServerConfig(ops_sandbox=False, device=SERVER_DEVICE), auth_secret=SECRET)
    r = s.handle("load_model", auth.sign_request(SECRET, "load_model", LoadModelRequest("t", "resnet18")))
    assert r.status == StatusCode.OK, r.status_text
    return s


@pytest.fixture(scope="module")
def expected(server):
    with torch.inference_mode():
        return server.load("resnet18").module(to_server(X)).cpu()


def _compute_req(**kw):
    args = dict(client_id="t", model="resnet18", entry="forward", tensors=[codec.encode(X, "input")])
    args.update(kw)
    return ComputeRequest(**args)


def _signed(method, req, secret=SECRET, **kw):
    return dataclasses.replace(req, auth=auth.make_token(secret, method, req, **kw))


def _assert_serving(server, expected):
    r = server.handle("compute", _signed("compute", _compute_req()))
    assert r.status == StatusCode.OK, r.status_text
    torch.testing.assert_close(codec.decode(r.tensors[0]), expected)
    assert server.handle("ping", _signed("ping", PingRequest("t", b"hi"))).status == StatusCode.OK


def test_right_secret_is_accepted_for_every_method(server, expected):
    transport = InProcessTransport(server, auth_secret=SECRET)
    try:
        assert transport.signs_requests
        r = transport.call("load_model", LoadModelRequest("t", "resnet18"), 30)
        assert r.status == StatusCode.OK, r.status_text
        r = transport.call("compute", _compute_req(), 30)
        assert r.status == StatusCode.OK, r.status_text
        torch.testing.assert_close(codec.decode(r.tensors[0]), expected)
        p = transport.call("ping", PingRequest("t", b"abc"), 30)
        assert p.status == StatusCode.OK and p.payload == b"abc"
        # the same request object twice: each call signs afresh (new nonce), no replay
        req = _compute_req()
        assert transport.call("compute", req, 30).status == StatusCode.OK
        assert transport.call("compute", req, 30).status == StatusCode.OK
        assert req.auth == ""          # the caller's object is not modified
    finally:
        transport.close()


def _tampered():
    """(what, method, signed-then-altered request) for every field the MAC covers. Built
    when the test runs (tokens made at collection would be stale by then)."""
    out = []
    base = _signed("compute", _compute_req(args_json='{"a": 1}'))
    t = base.tensors[0]
    data = bytearray(t.data)
    data[100] ^= 0x01
    out.append(("tensor bytes", "compute", dataclasses.replace(
        base, tensors=[dataclasses.replace(t, data=bytes(data))])))
    out.append(("tensor shape", "compute", dataclasses.replace(
        base, tensors=[dataclasses.replace(t, shape=[1, 3, 16, 64])])))
    out.append(("tensor dtype", "compute", dataclasses.replace(
        base, tensors=[dataclasses.replace(t, dtype="int32")])))
    out.append(("tensor scale", "compute", dataclasses.replace(
        base, tensors=[dataclasses.replace(t, scale=0.5)])))
    out.append(("tensor name", "compute", dataclasses.replace(
        base, tensors=[dataclasses.replace(t, name="other")])))
    out.append(("extra tensor", "compute", dataclasses.replace(base, tensors=[t, t])))
    out.append(("no tensors", "compute", dataclasses.replace(base, tensors=[])))
    for name, value in (("args_json", '{"a": 2}'), ("model", "resnet50"), ("entry", "partition_tail"),
                        ("client_id", "u"), ("session", "s"), ("output_codec", "float16"),
                        ("output_compression", "zstd")):
        out.append((name, "compute", dataclasses.replace(base, **{name: value})))
    load = _signed("load_model", LoadModelRequest("t", "resnet18"))
    out.append(("load model", "load_model", dataclasses.replace(load, model="mobilenet_v2")))
    out.append(("weights hash", "load_model", dataclasses.replace(load, weights_hash="0" * 64)))
    ping = _signed("ping", PingRequest("t", b"abc"))
    out.append(("ping payload", "ping", dataclasses.replace(ping, payload=b"abd")))
    # a token for one method used on another
    out.append(("method", "load_model", LoadModelRequest("t", "resnet18", auth=ping.auth)))
    return out


TAMPERED = [w for w, _, _ in _tampered()]


@pytest.mark.parametrize("what", TAMPERED)
def test_tampered_requests_are_refused(server, expected, what):
    method, req = {w: (m, r) for w, m, r in _tampered()}[what]
    r = server.handle(method, req)
    assert r.status == StatusCode.UNAUTHORIZED, (what, r.status, r.status_text)
    assert "bad signature" in r.status_text
    _assert_serving(server, expected)


REFUSED = {
    "no token": (lambda: _compute_req(), "no authentication token"),
    "wrong secret": (lambda: _signed("compute", _compute_req(), WRONG), "bad signature"),
    "old timestamp": (lambda: _signed("compute", _compute_req(), now_s=auth.time.time() - 31), "clock"),
    "future timestamp": (lambda: _signed("compute", _compute_req(), now_s=auth.time.time() + 31), "clock"),
    "garbage token": (lambda: _compute_req(auth="hello"), "malformed"),
    "v3 token": (lambda: _compute_req(auth="v3:" + _signed("compute", _compute_req()).auth[3:]), "malformed"),
    "v1 token": (lambda: _compute_req(auth=f"v1:{int(auth.time.time() * 1000)}:{'0' * 32}:{'0' * 64}"),
                 "v1 is no longer accepted"),
    "uppercase hex": (lambda: _compute_req(auth=_signed("compute", _compute_req()).auth.upper().replace("V2", "v2")),
                      "malformed"),
    "truncated mac": (lambda: _compute_req(auth=_signed("compute", _compute_req()).auth[:-2]), "malformed"),
    "huge token": (lambda: _compute_req(auth="v2:" + "1" * 100000), "malformed"),
    "token not a string": (lambda: _compute_req(auth=b"v1:1:2:3"), "malformed"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_bad_tokens_are_refused(server, expected, name):
    make, fragment = REFUSED[name]
    r = server.handle("compute", make())
    assert r.status == StatusCode.UNAUTHORIZED, (name, r.status_text)
    assert fragment in r.status_text and r.tensors == []
    _assert_serving(server, expected)


def test_unsigned_load_and_ping_are_refused(server, expected):
    assert server.handle("load_model", LoadModelRequest("t", "resnet18")).status == StatusCode.UNAUTHORIZED
    assert server.handle("ping", PingRequest("t", b"x")).status == StatusCode.UNAUTHORIZED
    assert server.handle("ping", None).status == StatusCode.UNAUTHORIZED       # not even a request
    _assert_serving(server, expected)


def test_replayed_token_is_refused(server, expected):
    req = _signed("compute", _compute_req())
    assert server.handle("compute", req).status == StatusCode.OK
    r = server.handle("compute", req)
    assert r.status == StatusCode.UNAUTHORIZED and "replayed" in r.status_text
    ping = _signed("ping", PingRequest("t", b""))
    assert server.handle("ping", ping).status == StatusCode.OK
    assert server.handle("ping", ping).status == StatusCode.UNAUTHORIZED
    _assert_serving(server, expected)


def test_token_within_the_window_is_accepted(server):
    for dt in (-25.0, 25.0):
        req = _signed("ping", PingRequest("t", b""), now_s=auth.time.time() + dt)
        assert server.handle("ping", req).status == StatusCode.OK


def test_server_without_secret_ignores_tokens(shared_server):
    assert shared_server.handle("ping", PingRequest("t", b"")).status == StatusCode.OK
    assert shared_server.handle("ping", _signed("ping", PingRequest("t", b""))).status == StatusCode.OK


class FakeClock:
    def __init__(self, t=1_000_000.0):
        self.t = t

    def __call__(self):
        return self.t


def test_replay_cache_is_bounded_and_forgets_expired_nonces():
    clock = FakeClock()
    v = auth.Verifier(SECRET, max_skew_s=30, max_nonces=3, clock=clock)
    reqs = [_signed("ping", PingRequest("t", bytes([i])), now_s=clock.t) for i in range(4)]
    for r in reqs[:3]:
        v.verify("ping", r)
    assert v.remembered == 3
    with pytest.raises(auth.AuthError) as e:
        v.verify("ping", reqs[3])
    assert e.value.reason == "cache_full"
    with pytest.raises(auth.AuthError) as e:
        v.verify("ping", reqs[0])
    assert e.value.reason == "replay"
    # Unauthenticated junk never reaches the cache.
    with pytest.raises(auth.AuthError) as e:
        v.verify("ping", _signed("ping", PingRequest("t", b"j"), WRONG, now_s=clock.t))
    assert e.value.reason == "signature" and v.remembered == 3
    clock.t += 31   # the first tokens left the window: forgotten, and too old to replay anyway
    fresh = _signed("ping", PingRequest("t", b"new"), now_s=clock.t)
    v.verify("ping", fresh)
    assert v.remembered == 1
    with pytest.raises(auth.AuthError) as e:
        v.verify("ping", reqs[0])
    assert e.value.reason == "skew"


def test_refusals_are_logged_throttled(caplog):
    s = OffloadServer(ServerConfig(ops_sandbox=False, device=SERVER_DEVICE), auth_secret=SECRET)
    with caplog.at_level(logging.WARNING, logger="robot_offload.server"):
        for _ in range(50):
            assert s.handle("ping", PingRequest("t", b"")).status == StatusCode.UNAUTHORIZED
        for _ in range(50):
            assert s.handle("ping", _signed("ping", PingRequest("t", b""), WRONG)).status == StatusCode.UNAUTHORIZED
    lines = [r.getMessage() for r in caplog.records if "UNAUTHORIZED" in r.getMessage()]
    assert len(lines) == 2, lines     # one per kind of failure within the interval
    assert "no authentication token" in lines[0] and "bad signature" in lines[1]
    assert s.requests_failed == 100


def test_per_client_allow_lists():
    cfg = ServerConfig(ops_sandbox=False, device=SERVER_DEVICE, client_models={"robot1": ["resnet18"], "*": ["mobilenet_v2"]})
    s = OffloadServer(cfg)
    ok = s.handle("load_model", LoadModelRequest("robot1", "resnet18"))
    assert ok.status == StatusCode.OK, ok.status_text
    r = s.handle("load_model", LoadModelRequest("robot2", "resnet18"))
    assert r.status == StatusCode.UNAUTHORIZED and "may not use model" in r.status_text
    # loaded for robot1, still not usable by robot2
    r = s.handle("compute", _compute_req(client_id="robot2"))
    assert r.status == StatusCode.UNAUTHORIZED
    assert s.handle("compute", _compute_req(client_id="robot1")).status == StatusCode.OK
    s2 = OffloadServer(ServerConfig(ops_sandbox=False, device=SERVER_DEVICE, client_models={"robot1": ["resnet18"]}))
    r = s2.handle("load_model", LoadModelRequest("robot3", "resnet18"))
    assert r.status == StatusCode.UNAUTHORIZED and "not in client_models" in r.status_text
    with pytest.raises(Unauthorized):
        raise_for_status(r.status, r.status_text)


@pytest.mark.parametrize("bad", [["resnet18"], {"robot1": "resnet18"}, {"robot1": [1]}, {1: ["resnet18"]}])
def test_client_models_config_refused(bad):
    with pytest.raises(ConfigError):
        ServerConfig(ops_sandbox=False, client_models=bad).validate()
    with pytest.raises(ConfigError):
        ServerConfig(ops_sandbox=False, auth_max_skew_s=0).validate()


def test_client_with_wrong_secret_computes_locally():
    s = OffloadServer(ServerConfig(ops_sandbox=False, device=SERVER_DEVICE), auth_secret=SECRET)
    cfg = ClientConfig(model="resnet18", mode="full_offload", input_size=(32, 32), retry_interval_s=0.05)
    for secret, offloads in ((WRONG, False), (None, False), (SECRET, True)):
        client = OffloadClient(cfg, InProcessTransport(s, auth_secret=secret))
        try:
            assert client.connect(30) is offloads
            out, stats = client.infer(X)
            assert stats.executed_mode == ("full_offload" if offloads else "local")
            if not offloads:
                assert "UNAUTHORIZED" in stats.fallback_reason or "authentication" in client.link.last_error
            with torch.inference_mode():
                assert_same_as_local(out, client.model(X), rtol=1e-4, atol=1e-4)
        finally:
            client.close()


# -- secrets -------------------------------------------------------------------------------
def _write(path, text, mode=0o600):
    path.write_text(text)
    os.chmod(path, mode)
    return str(path)


def test_load_secret_from_file_and_environment(tmp_path):
    f = _write(tmp_path / "secret", "  " + SECRET.decode() + "\n")
    assert auth.load_secret(f, environ={}) == SECRET
    assert auth.load_secret(f, environ={auth.ENV_VAR: WRONG.decode()}) == SECRET   # the file wins
    assert auth.load_secret("", environ={auth.ENV_VAR: WRONG.decode()}) == WRONG
    assert auth.load_secret("", environ={}) is None
    assert auth.load_secret("", environ={auth.ENV_VAR: ""}) is None


@pytest.mark.parametrize("case", ["group readable", "world readable", "missing", "short", "empty", "directory"])
def test_bad_secret_files_are_refused(tmp_path, case):
    path = tmp_path / "secret"
    if case == "group readable":
        _write(path, SECRET.decode(), 0o640)
    elif case == "world readable":
        _write(path, SECRET.decode(), 0o604)
    elif case == "short":
        _write(path, "tooshort")
    elif case == "empty":
        _write(path, "\n")
    elif case == "directory":
        path.mkdir()
        os.chmod(path, 0o700)
    with pytest.raises(ConfigError) as e:
        auth.load_secret(str(path), environ={})
    assert str(path) in str(e.value)


def test_short_environment_secret_refused():
    with pytest.raises(ConfigError):
        auth.load_secret("", environ={auth.ENV_VAR: "short"})


def test_token_format():
    token = auth.make_token(SECRET, "ping", PingRequest("t", b""), now_s=1700000000.123,
                            nonce=bytes(range(16)))
    version, ts, nonce, digest, mac = token.split(":")
    assert version == "v2" and ts == "1700000000123" and nonce == bytes(range(16)).hex()
    assert digest == auth.canonical_request("ping", PingRequest("t", b"")).hex()
    assert len(mac) == 64 and int(mac, 16) >= 0
    # the canonical form separates fields unambiguously
    a = auth.canonical_request("compute", _compute_req(client_id="ab", model="c"))
    b = auth.canonical_request("compute", _compute_req(client_id="a", model="bc"))
    assert a != b
    assert json.dumps(auth.SIGNED_FIELDS)  # plain data
