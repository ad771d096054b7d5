"""The ops entry in a process per client (robot_offload.server.sandbox), with real worker
processes: a worker that dies or runs past max_request_s costs its own client's sessions
and nobody else's; requests of another client's session are refused before any worker
sees them; a record_replay session through the sandbox returns what local returns."""

import os
import signal
import socket
import threading
import time

import pytest
import torch
from torch import nn

from robot_offload.protocol import StatusCode
from robot_offload.server import OffloadServer, ServerConfig
from robot_offload.server.sandbox import SandboxedOps
from robot_offload.transparent.session import RemoteSession
from robot_offload.transport.inproc import InProcessTransport

from test_ops_limits import Client, h


@pytest.fixture
def server():
    s = OffloadServer(ServerConfig(device="cpu", max_request_s=20.0))
    yield s
    s.close()


def test_each_client_gets_its_own_worker_process(server):
    assert isinstance(server.executors["ops"], SandboxedOps)
    a, b = Client(server, "robot_a"), Client(server, "robot_b")
    a.op("aten::ones", {"l": [2]})
    b.op("aten::ones", {"l": [2]})
    pids = server.executors["ops"].pids()
    assert set(pids) == {"robot_a", "robot_b"}
    assert len(set(pids.values())) == 2 and os.getpid() not in pids.values()


def test_a_crashed_worker_costs_only_its_own_clients_sessions(server, caplog):
    a, b = Client(server, "robot_a"), Client(server, "robot_b")
    ha = a.op("aten::full", {"l": [3]}, 1.5)
    hb = b.op("aten::full", {"l": [3]}, 2.5)
    ops = server.executors["ops"]
    pid_a = ops.pids()["robot_a"]
    x = a.op("aten::ones", {"l": [512, 512]})
    # while a's worker runs a long request, it dies as memory corruption would make it
    threading.Timer(1.0, os.kill, (pid_a, signal.SIGSEGV)).start()
    resp = a.send({"ops": [{"op": "aten::mm", "a": {"l": [h(x), h(x)]}, "k": {}}] * 2000})
    assert resp.status == StatusCode.STALE_HANDLE, resp.status_text
    assert "SIGSEGV" in resp.status_text and "open a new one" in resp.status_text
    assert "robot_a" in caplog.text and "SIGSEGV" in caplog.text
    torch.testing.assert_close(b.fetch(hb), torch.full((3,), 2.5))   # b never noticed
    assert ops.crashes == 1
    a.session = ""                                 # the client opens a new session, as after a restart
    ha = a.op("aten::full", {"l": [3]}, 4.0)
    torch.testing.assert_close(a.fetch(ha), torch.full((3,), 4.0))
    assert ops.pids()["robot_a"] != pid_a


def test_a_request_past_max_request_s_is_stopped(server):
    server.config.max_request_s = 1.0
    a, b = Client(server, "robot_a"), Client(server, "robot_b")
    hb = b.op("aten::full", {"l": [3]}, 2.5)
    x = a.op("aten::ones", {"l": [1024, 1024]})
    pid_a = server.executors["ops"].pids()["robot_a"]
    t0 = time.monotonic()
    resp = a.send({"ops": [{"op": "aten::mm", "a": {"l": [h(x), h(x)]}, "k": {}}] * 200})  # ~430 GFLOP
    assert resp.status == StatusCode.BUSY and "max_request_s" in resp.status_text, resp.status_text
    assert time.monotonic() - t0 < 30
    assert server.executors["ops"].kills == 1
    with pytest.raises(ProcessLookupError):
        os.kill(pid_a, 0)
    torch.testing.assert_close(b.fetch(hb), torch.full((3,), 2.5))


def test_another_clients_session_is_refused_before_any_worker(server):
    a, b = Client(server, "robot_a"), Client(server, "robot_b")
    ha = a.op("aten::ones", {"l": [2]})
    b.session = a.session
    resp = b.send({"fetch": [ha]})
    assert resp.status == StatusCode.UNAUTHORIZED, resp.status_text
    assert "robot_b" not in server.executors["ops"].pids()


def test_new_clients_past_max_sandboxes_are_busy(server):
    server.config.max_sandboxes = 2
    for name in ("r1", "r2"):
        Client(server, name).op("aten::ones", {"l": [1]})
    assert Client(server, "r3").send({"ops": []}).status == StatusCode.BUSY


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 5)

    def forward(self, x):
        y = torch.relu(self.bn(self.conv(x)))
        return self.fc(y.mean(dim=(2, 3)))


@pytest.mark.parametrize("mode", ["transparent", "record_replay"])
def test_offloading_through_the_sandbox_equals_local(server, mode):
    torch.manual_seed(0)
    net = _Net().eval()
    transport = InProcessTransport(server)
    sess = RemoteSession(lambda r, t: transport.call("compute", r, t), mode=mode, timeout_s=30.0)
    with torch.no_grad():
        for i in range(5):
            x = torch.randn(1, 3, 16, 16)
            ref = net(x)
            with sess:
                y = net(x).cpu()
            torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    assert sess.stats.round_trips > 0 and sess.session_id
    if mode == "record_replay":
        assert sess.stats.inferences[-1].round_trips <= 2


def test_workers_work_under_a_process_wide_socket_timeout():
    """rospy sets socket.setdefaulttimeout(): the socket pair is then made non-blocking,
    and a worker that inherited its end as if blocking failed its first read."""
    old = socket.getdefaulttimeout()
    socket.setdefaulttimeout(5.0)
    try:
        s = OffloadServer(ServerConfig(device="cpu", max_request_s=20.0))
        try:
            c = Client(s, "robot_a")
            x = c.op("aten::full", {"l": [3]}, 1.5)
            time.sleep(0.5)                       # the worker waits for the next request
            torch.testing.assert_close(c.fetch(x), torch.full((3,), 1.5))
        finally:
            s.close()
    finally:
        socket.setdefaulttimeout(old)
