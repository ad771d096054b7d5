"""Client fallback, deadlines, recovery and mode switching with an in-process server."""

import threading
import time

import pytest
import torch

from robot_offload.client import ClientConfig, OffloadClient
from robot_offload.errors import ConfigError
from robot_offload.frames import LatestFrame
from robot_offload.server import OffloadServer, ServerConfig
from robot_offload.transport.inproc import InProcessTransport

from devices import SERVER_DEVICE, assert_same_as_local


class SlowServer:
    """Wraps a server and delays every compute by ``delay_s`` (a stalled GPU, a hung link)."""

    def __init__(self, server, delay_s):
        self.server, self.delay_s = server, delay_s

    def handle(self, method, request):
        if method == "compute":
            time.sleep(self.delay_s)
        return self.server.handle(method, request)


def _client(server, **kw):
    cfg = dict(model="resnet18", mode="full_offload", input_size=(32, 32), timeout_s=0.5,
               retry_interval_s=0.1)
    cfg.update(kw)
    return OffloadClient(ClientConfig(**cfg), InProcessTransport(server))


@pytest.fixture
def x():
    return torch.randn(1, 3, 32, 32)


def test_unknown_mode_is_refused_and_mode_kept(shared_server):
    c = _client(shared_server)
    try:
        with pytest.raises(ConfigError, match="known: .*full_offload"):
            c.set_mode("warp_drive")
        assert c.mode == "full_offload"
        with pytest.raises(ConfigError):
            ClientConfig(mode="warp_drive").validate()
        with pytest.raises(ConfigError):
            ClientConfig(codec="jpeg").validate()
    finally:
        c.close()


def test_slow_server_falls_back_within_deadline(shared_server, x):
    c = _client(SlowServer(shared_server, 3.0), timeout_s=0.3, retry_interval_s=1.0)
    try:
        assert c.connect()
        t0 = time.monotonic()
        y, stats = c.infer(x)
        elapsed = time.monotonic() - t0
        assert stats.executed_mode == "local" and "OffloadTimeout" in stats.fallback_reason
        assert "raise it if the server or link is only slow" in stats.fallback_reason
        assert elapsed < 0.3 + 1.0, elapsed  # deadline + one local inference, never 3 s
        with torch.inference_mode():
            assert_same_as_local(y, c.model(x))
        # While the link is down, frames go local at once without waiting for a deadline.
        t0 = time.monotonic()
        _, stats = c.infer(x)
        assert stats.executed_mode == "local" and stats.fallback_reason.startswith("server unavailable")
        assert time.monotonic() - t0 < 0.3
        assert c.fallbacks == 2
        # The server answers pings, so the link comes back after the back-off, and a
        # second miss doubles it: one missed deadline per back-off period, not per frame.
        deadline = time.monotonic() + 5
        while not c.link.available and time.monotonic() < deadline:
            time.sleep(0.05)
        _, stats = c.infer(x)
        assert "OffloadTimeout" in stats.fallback_reason
        assert c.link.consecutive_failures == 2 and not c.link.available
    finally:
        c.close()


def test_server_down_then_restarted(x):
    transport = InProcessTransport(None)
    # The frame deadline must cover a model load: after a restart it reloads in-frame.
    c = OffloadClient(ClientConfig(model="resnet18", mode="full_offload", input_size=(32, 32),
                                   timeout_s=10.0, retry_interval_s=0.1), transport)
    try:
        assert not c.connect(timeout_s=0.5)
        _, stats = c.infer(x)
        assert stats.executed_mode == "local"
        transport.server = OffloadServer(ServerConfig(ops_sandbox=False, device=SERVER_DEVICE))   # the server comes up
        deadline = time.monotonic() + 10
        while not c.link.available and time.monotonic() < deadline:
            time.sleep(0.05)
        assert c.link.available
        _, stats = c.infer(x)
        assert stats.executed_mode == "full_offload"
        # A restart loses the loaded model: the client reloads it and retries, no fallback.
        transport.server = OffloadServer(ServerConfig(ops_sandbox=False, device=SERVER_DEVICE))
        y, stats = c.infer(x)
        assert stats.executed_mode == "full_offload", stats.fallback_reason
        with torch.inference_mode():
            assert_same_as_local(y, c.model(x))
    finally:
        c.close()


def test_hash_mismatch_disables_offloading(tmp_path, x):
    spec_model = OffloadClient(ClientConfig(model="resnet18", mode="local"), None).model
    with torch.no_grad():
        next(spec_model.parameters()).add_(1.0)
    path = tmp_path / "other.pt"
    torch.save(spec_model.state_dict(), path)
    server = OffloadServer(ServerConfig(ops_sandbox=False, device=SERVER_DEVICE))
    c = _client(server, weights=str(path))
    try:
        assert not c.connect()
        assert "differ" in c.link.last_error
        _, stats = c.infer(x)
        assert stats.executed_mode == "local"
        time.sleep(0.3)
        assert not c.link.available   # never retried into wrong results
    finally:
        c.close()


def test_latest_frame_counts_drops():
    slot = LatestFrame()
    assert slot.get(0.01) is None
    assert not slot.put(1)
    assert slot.put(2) and slot.put(3)
    frame, _ = slot.get(0.01)
    assert frame == 3 and slot.received == 3 and slot.dropped == 2
    got = []
    threading.Timer(0.05, slot.put, args=(4,)).start()
    got.append(slot.get(1.0))
    assert got[0][0] == 4
