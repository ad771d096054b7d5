"""The version exchange between a real client and an in-process server: a client or a
server of another protocol is refused at connect with both versions named; an operator
whose schema differs refuses the operator modes (or, in the launcher, runs on the robot)
while the whole-model modes go on."""

import dataclasses
import json
import logging

import pytest
import torch
from torch import nn

from robot_offload import compat
from robot_offload.client import ClientConfig, OffloadClient
from robot_offload.protocol import PingRequest, StatusCode, method_of
from robot_offload.server import OffloadServer, ServerConfig
from robot_offload.transparent import launcher
from robot_offload.transparent.session import RemoteSession
from robot_offload.transport.inproc import InProcessTransport

from devices import SERVER_DEVICE, assert_same_as_local

CONV = "aten::conv2d.default"    # what a convolution layer calls under inference_mode


def _claim(monkeypatch, **changes):
    """This process's clients claim other versions (``protocol``) or other schemas for
    the operators in ``ops`` (name -> digest); a server built before keeps its own."""
    real = compat.local_versions

    def claimed(device="", with_ops=True):
        v = real(device, with_ops)
        ops = dict(v.ops, **changes.pop("ops", {})) if with_ops else v.ops
        return dataclasses.replace(v, ops=ops, **changes)
    monkeypatch.setattr(compat, "local_versions", claimed)


def _client(server, mode, **kw):
    cfg = ClientConfig(model="resnet18", mode=mode, input_size=(32, 32), timeout_s=30.0,
                       load_timeout_s=120, retry_interval_s=0.1, **kw)
    return OffloadClient(cfg, InProcessTransport(server))


class CountingServer:
    """Passes requests on and counts them per method."""

    def __init__(self, server):
        self.server, self.calls = server, {}

    def handle(self, method, request):
        self.calls[method] = self.calls.get(method, 0) + 1
        return self.server.handle(method, request)


def test_a_plain_ping_gets_the_servers_versions(shared_server):
    r = shared_server.handle("ping", PingRequest("t"))
    v = compat.Versions.from_json(r.versions_json)
    assert r.status == StatusCode.OK and v.protocol == compat.PROTOCOL_VERSION
    assert v.torch == torch.__version__ and v.device == str(shared_server.device) and not v.ops_differ


@pytest.mark.parametrize("text,status", [
    ("{", StatusCode.BAD_REQUEST),
    (json.dumps({"protocol": 1, "ops": {"aten::relu.default": "zz"}}), StatusCode.BAD_REQUEST),
    ("{}" + " " * compat.MAX_VERSIONS_JSON_CHARS, StatusCode.TOO_LARGE),
])
def test_malformed_versions_are_the_requests_fault(shared_server, text, status):
    r = shared_server.handle("ping", PingRequest("t", versions_json=text))
    assert r.status == status and r.status_text


def test_the_server_refuses_a_client_of_another_protocol(shared_server):
    claim = dataclasses.replace(compat.local_versions(), protocol=compat.PROTOCOL_VERSION + 1)
    r = shared_server.handle("ping", PingRequest("t", versions_json=claim.to_json()))
    assert r.status == StatusCode.INCOMPATIBLE
    assert f"client speaks protocol {compat.PROTOCOL_VERSION + 1}" in r.status_text
    assert f"server protocol {compat.PROTOCOL_VERSION} (robot_offload" in r.status_text
    assert f"torch {torch.__version__}" in r.status_text


def test_a_client_of_another_protocol_never_offloads(shared_server, monkeypatch, caplog):
    _claim(monkeypatch, protocol=compat.PROTOCOL_VERSION + 1)
    counting = CountingServer(shared_server)
    c = _client(counting, "full_offload")
    try:
        with caplog.at_level(logging.ERROR, logger="robot_offload.link"):
            assert not c.connect()
        assert any("offloading disabled" in r.getMessage() and "protocol" in r.getMessage()
                   for r in caplog.records)
        x = torch.rand(1, 3, 32, 32)
        y, stats = c.infer(x)
        assert stats.executed_mode == "local"
        assert f"protocol {compat.PROTOCOL_VERSION + 1}" in stats.fallback_reason
        assert f"protocol {compat.PROTOCOL_VERSION} (" in stats.fallback_reason
        with torch.inference_mode():
            assert_same_as_local(y, c.model(x))
        assert counting.calls == {"ping": 1}           # no load, no compute, no more probes
    finally:
        c.close()


class OtherProtocolServer:
    """A server that answers pings with another protocol and checks nothing (as one of an
    older release would): the client's own check refuses it."""

    def __init__(self, server):
        self.server = server

    def handle(self, method, request):
        if method == "ping":
            r = self.server.handle("ping", PingRequest(request.client_id))
            v = dataclasses.replace(compat.Versions.from_json(r.versions_json), protocol=0)
            return dataclasses.replace(r, versions_json=v.to_json())
        return self.server.handle(method, request)


def test_the_client_refuses_a_server_of_another_protocol(shared_server):
    c = _client(OtherProtocolServer(shared_server), "full_offload")
    try:
        assert not c.connect()
        assert "server protocol 0" in c.link.last_error and "INCOMPATIBLE" in c.link.last_error
        _, stats = c.infer(torch.rand(1, 3, 32, 32))
        assert stats.executed_mode == "local" and "protocol 0" in stats.fallback_reason
    finally:
        c.close()


@pytest.mark.parametrize("mode", ["record_replay", "transparent"])
def test_a_differing_schema_refuses_the_operator_modes_only(shared_server, monkeypatch, caplog, mode):
    _claim(monkeypatch, ops={CONV: "0" * compat.DIGEST_CHARS})
    counting = CountingServer(shared_server)
    c = _client(counting, mode)
    try:
        assert c.connect()
        assert set(c.link.refused_ops) == {CONV}
        x = torch.rand(1, 3, 32, 32)
        with caplog.at_level(logging.ERROR, logger="robot_offload.client"):
            y, stats = c.infer(x)
        assert stats.executed_mode == "local"
        reason = stats.fallback_reason
        assert reason.startswith("Incompatible") and f"{CONV} cannot be offloaded" in reason
        assert f"torch {torch.__version__}" in reason and "the server's schema is aten::conv2d" in reason
        assert any(CONV in r.getMessage() for r in caplog.records)
        with torch.inference_mode():
            assert_same_as_local(y, c.model(x))
        # the next frame is refused before anything is sent; the link stays up
        before = dict(counting.calls)
        _, stats = c.infer(x)
        assert stats.executed_mode == "local" and f"{CONV} cannot be offloaded" in stats.fallback_reason
        assert counting.calls == before and c.link.available
        # the whole-model modes are unaffected
        c.set_mode("full_offload")
        y, stats = c.infer(x)
        assert stats.executed_mode == "full_offload" and not stats.fallback_reason
        with torch.inference_mode():
            assert_same_as_local(y, c.model(x))
    finally:
        c.close()


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(3, 4, 3)
        self.b = nn.Linear(4, 2)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)).mean(dim=(2, 3)))


def test_the_launcher_runs_a_differing_operator_on_the_robot(shared_server, monkeypatch):
    _claim(monkeypatch, ops={CONV: "0" * compat.DIGEST_CHARS})
    transport = InProcessTransport(shared_server)
    sess = RemoteSession(lambda r, t: transport.call(method_of(r), r, t), mode="record_replay",
                         local_fallback=True)
    try:
        sess.connect(30.0)
        assert set(sess.refused_ops) == {CONV}
        net, x = _Net().eval(), torch.rand(1, 3, 8, 8)
        for _ in range(3):
            with torch.inference_mode(), sess:
                y = sess.materialize_tree(net(x))
            with torch.inference_mode():
                assert_same_as_local(y, net(x))
        assert sess.stats.ops_refused == 3 and sess.stats.ops_remote > 0
        assert not sess.down.is_set() and sess.stats.server_losses == 0
    finally:
        transport.close()


def test_the_launcher_refuses_a_server_of_another_protocol(shared_server, monkeypatch, tmp_path, capsys):
    _claim(monkeypatch, protocol=compat.PROTOCOL_VERSION + 1)
    program = tmp_path / "prog.py"
    program.write_text("open(__file__ + '.ran', 'w').close()\n")
    transport = InProcessTransport(shared_server)

    def make_call(args):
        return (lambda r, t: transport.call(method_of(r), r, t)), transport.close
    assert launcher.main(["--", "python", str(program)], make_call=make_call) == 2
    err = capsys.readouterr().err
    assert "refuses this robot" in err and f"protocol {compat.PROTOCOL_VERSION + 1}" in err
    assert not (tmp_path / "prog.py.ran").exists()


def test_a_new_server_is_asked_again(monkeypatch):
    """The versions are exchanged on every connection: after a restart, the prober's
    ping carries them again and the refused operators follow the new server."""
    transport = InProcessTransport(OffloadServer(ServerConfig(ops_sandbox=False, device=SERVER_DEVICE)))
    c = OffloadClient(ClientConfig(model="resnet18", mode="full_offload", input_size=(32, 32),
                                   timeout_s=30.0, retry_interval_s=0.1), transport)
    try:
        assert c.connect() and c.link.refused_ops == {}
        first = c.link.server_versions
        c.link.versions = dataclasses.replace(c.link.versions, ops=dict(c.link.versions.ops, **{CONV: "1" * 16}))
        transport.server = OffloadServer(ServerConfig(ops_sandbox=False, device=SERVER_DEVICE))
        c.link.mark_down("restarted")
        import time
        deadline = time.monotonic() + 60
        while not c.link.available and time.monotonic() < deadline:
            time.sleep(0.05)
        assert c.link.available and c.link.server_versions is not first
        assert set(c.link.refused_ops) == {CONV}
    finally:
        c.close()
