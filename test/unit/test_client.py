"""Client fallback, deadlines, recovery and mode switching with an in-process server."""

import threading
import time

import numpy as np
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
    # The margins are seconds (a loaded machine's local inference takes a good part of
    # one): a 2 s deadline against a server that answers after 8 s.
    c = _client(SlowServer(shared_server, 8.0), timeout_s=2.0, retry_interval_s=1.0)
    try:
        assert c.connect()
        t0 = time.monotonic()
        y, stats = c.infer(x)
        elapsed = time.monotonic() - t0
        assert stats.executed_mode == "local" and "OffloadTimeout" in stats.fallback_reason
        assert "raise it if the server or link is only slow" in stats.fallback_reason
        assert elapsed < 2.0 + 3.0, elapsed  # deadline + one local inference, never 8 s
        with torch.inference_mode():
            assert_same_as_local(y, c.model(x))
        # While the link is down, frames go local at once without waiting for a deadline.
        t0 = time.monotonic()
        _, stats = c.infer(x)
        assert stats.executed_mode == "local" and stats.fallback_reason.startswith("server unavailable")
        assert time.monotonic() - t0 < 2.0
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


def _frame(shape, seed=0):
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


def test_a_server_without_the_frame_entry_gets_the_tensor_not_every_frame_local():
    """A server of an earlier release has no forward_image: it answers UNKNOWN_ENTRY, the
    frame goes up again as the preprocessed tensor within the same frame, and later frames
    send the tensor at once, to that server; a server reached anew is asked again."""
    old = OffloadServer(ServerConfig(ops_sandbox=False, device=SERVER_DEVICE))
    del old.executors["forward_image"]
    c = _client(old, timeout_s=30.0)
    transport = c.link.transport
    frame = _frame((32, 32, 3))
    tensor_bytes = 3 * 32 * 32 * 4
    try:
        assert c.connect(), c.link.last_error
        y, stats = c.process(frame)
        assert stats.executed_mode == "full_offload" and not stats.fallback_reason
        assert stats.plan == "input=tensor raw/none" and stats.round_trips == 2
        assert stats.bytes_up == frame.nbytes + tensor_bytes
        assert "UNKNOWN_ENTRY" in stats.extra["full_offload"]["tensor_because"]
        with torch.inference_mode():
            assert_same_as_local(y, c.model(c.preprocess(frame)), rtol=0, atol=0)
        _, stats = c.process(frame)
        assert stats.executed_mode == "full_offload" and stats.round_trips == 1
        assert stats.bytes_up == tensor_bytes and "no forward_image" in stats.extra["full_offload"]["tensor_because"]
        assert c.fallbacks == 0 and c.link.available
        # the server is replaced by one with the entry and the link connects anew
        transport.server = OffloadServer(ServerConfig(ops_sandbox=False, device=SERVER_DEVICE))
        c.link.mark_down("replaced")
        deadline = time.monotonic() + 30
        while not c.link.available and time.monotonic() < deadline:
            time.sleep(0.05)
        _, stats = c.process(frame)
        assert stats.plan == "input=frame uint8/none" and stats.bytes_up == frame.nbytes, stats
    finally:
        c.close()


def test_jpeg_frames_are_asked_for_lossy_and_say_so(shared_server):
    """input_jpeg_quality: full_offload sends the frame as JPEG, and the output is the
    model's on the decoded pixels, not on the frame; the stats say it was lossy. Off (the
    default), the same frame gives local's output exactly."""
    from robot_offload import codec, frame_codec
    from robot_offload.camera import natural_image
    frame = natural_image(48, 48, seed=5)
    jpeg = _client(shared_server, input_jpeg_quality=90, timeout_s=30.0)
    exact = _client(shared_server, timeout_s=30.0)
    try:
        assert jpeg.connect() and exact.connect()
        y, stats = jpeg.process(frame)
        assert stats.executed_mode == "full_offload" and not stats.fallback_reason
        assert stats.plan == "input=frame jpeg q90" and stats.round_trips == 1
        assert stats.extra["lossy_input"] == {"codec": "jpeg", "quality": 90, "frame_bytes": frame.nbytes}
        assert 0 < stats.bytes_up < frame.nbytes / 2
        pixels = codec.decode(frame_codec.encode(frame, "frame", 90), frames=True).numpy()
        with torch.inference_mode():
            assert_same_as_local(y, jpeg.model(jpeg.preprocess(pixels)), rtol=0, atol=0)
            on_frame = exact.model(exact.preprocess(frame))
        assert not torch.equal(y, on_frame)
        y_exact, stats = exact.process(frame)
        assert stats.plan == "input=frame uint8/none" and "lossy_input" not in stats.extra
        assert_same_as_local(y_exact, on_frame, rtol=0, atol=0)
    finally:
        jpeg.close()
        exact.close()


def test_a_camera_frame_larger_than_the_model_input_goes_as_jpeg_when_that_is_smaller(shared_server):
    """A 640 x 480 camera (921 KB) and a 224² model input (602 KB as float32): lossless,
    the preprocessed input goes; with JPEG asked for, the JPEG (a fraction of either). At a
    32² input (12 KB) the input is smaller than the JPEG too, and goes."""
    from robot_offload.camera import natural_image
    frame = natural_image(480, 640, seed=8)
    for input_size, jpeg_goes in (((224, 224), True), ((32, 32), False)):
        for quality in (0, 90):
            c = _client(shared_server, input_jpeg_quality=quality, timeout_s=60.0, input_size=input_size)
            try:
                assert c.connect()
                _, stats = c.process(frame)
                assert stats.executed_mode == "full_offload" and not stats.fallback_reason
                if quality and jpeg_goes:
                    assert stats.plan == "input=frame jpeg q90" and stats.bytes_up < 602_112 / 2, stats
                else:
                    assert stats.plan == "input=tensor raw/none", (input_size, quality, stats.plan)
                    why = stats.extra["full_offload"]["tensor_because"]
                    assert why.endswith("its JPEG" if quality else "than the frame"), why
            finally:
                c.close()


def test_a_server_that_refuses_jpeg_frames_gets_lossless_ones_within_the_frame():
    """A server that takes no JPEG frames (jpeg_frames: false, or an older release)
    answers BAD_REQUEST: the frame goes up again lossless within the same frame, and later
    frames to that server go lossless at once."""
    from robot_offload.camera import natural_image
    strict = OffloadServer(ServerConfig(ops_sandbox=False, device=SERVER_DEVICE, jpeg_frames=False))
    c = _client(strict, input_jpeg_quality=80, timeout_s=30.0)
    frame = natural_image(48, 48, seed=6)
    try:
        assert c.connect()
        y, stats = c.process(frame)
        assert stats.executed_mode == "full_offload" and not stats.fallback_reason
        assert stats.plan == "input=frame uint8/none" and stats.round_trips == 2
        with torch.inference_mode():
            assert_same_as_local(y, c.model(c.preprocess(frame)), rtol=0, atol=0)
        _, stats = c.process(frame)
        assert stats.plan == "input=frame uint8/none" and stats.round_trips == 1
        assert "jpeg_frames: false" in c._get_backend("full_offload")._no_jpeg[c.link.server_id]
    finally:
        c.close()


@pytest.mark.parametrize("quality", [-1, 96, 100])
def test_a_jpeg_quality_outside_the_range_is_refused(quality):
    with pytest.raises(ConfigError, match="input_jpeg_quality"):
        ClientConfig(model="resnet18", input_jpeg_quality=quality).validate()


@pytest.mark.parametrize("shape", [(32, 32, 3), (80, 80, 3)])
def test_a_fallback_preprocesses_the_frame_once(shared_server, monkeypatch, shape):
    """The server misses the deadline: the frame runs locally, preprocessed on the robot
    once, whether full_offload sent it as it is (32 x 32) or preprocessed it first (80 x 80
    is more than four times the input's pixels)."""
    from robot_offload.models import registry
    calls = []
    real = registry.preprocess_image

    def counting(*args, **kw):
        calls.append(1)
        return real(*args, **kw)

    monkeypatch.setattr(registry, "preprocess_image", counting)
    c = _client(SlowServer(shared_server, 3.0), timeout_s=0.3, retry_interval_s=1.0)
    frame = _frame(shape)
    try:
        assert c.connect()
        y, stats = c.process(frame)
        assert stats.executed_mode == "local" and "OffloadTimeout" in stats.fallback_reason
        assert len(calls) == 1
        with torch.inference_mode():
            assert_same_as_local(y, c.model(real(frame, (32, 32), c.spec.mean, c.spec.std)), rtol=0, atol=0)
    finally:
        c.close()


def test_a_frame_that_is_no_image_is_refused(shared_server):
    c = _client(shared_server)
    try:
        assert c.connect()
        for bad in (np.zeros((32, 32, 3), np.float32), np.zeros((32, 32, 2), np.uint8), np.zeros((0, 4, 3), np.uint8)):
            with pytest.raises(ConfigError, match="image"):
                c.process(bad)
    finally:
        c.close()


def test_a_refused_frame_goes_again_as_a_tensor_within_what_is_left_of_its_deadline(monkeypatch):
    """A server that refuses the camera image (TOO_LARGE: above its max_input_elements)
    gets the model input instead, within the frame's deadline less everything the refused
    attempt spent, its encoding included."""
    server = OffloadServer(ServerConfig(ops_sandbox=False, device=SERVER_DEVICE,
                                        max_input_elements=64 * 64 * 3))
    c = _client(server, timeout_s=5.0, input_size=(64, 64))
    backend = c._get_backend("full_offload")
    lossless = backend._lossless

    def slow_lossless(frame):
        time.sleep(0.3)
        return lossless(frame)

    given = []
    tensor_instead = backend._tensor_instead

    def spy(frame, stats, timeout_s, why):
        given.append((timeout_s, time.perf_counter() - started[0], why))
        return tensor_instead(frame, stats, timeout_s, why)

    monkeypatch.setattr(backend, "_lossless", slow_lossless)
    monkeypatch.setattr(backend, "_tensor_instead", spy)
    frame = np.random.default_rng(0).integers(0, 255, (100, 100, 3), dtype=np.uint8)
    started = [0.0]
    try:
        assert c.connect()
        started[0] = time.perf_counter()
        _, stats = c.process(frame)
        assert stats.executed_mode == "full_offload" and stats.round_trips == 2, stats
        (timeout_s, elapsed_s, why), = given
        assert "refused the frame" in why
        assert elapsed_s >= 0.3 and timeout_s <= 5.0 - elapsed_s + 0.01, (timeout_s, elapsed_s)
    finally:
        c.close()
