"""Every registered model: full_offload through the in-process transport returns the same
outputs as local, at a small input size (DESIGN.md: correctness first); for image models
also from the camera frame, which the server preprocesses."""

import numpy as np
import pytest
import torch

from robot_offload import codec, structure
from robot_offload.client import ClientConfig, OffloadClient
from robot_offload.models import get_spec, names
from robot_offload.transport.inproc import InProcessTransport

from devices import ON_CPU, assert_same_as_local

IMAGE_MODELS = [m for m in names() if get_spec(m).input_kind == "image"]


def _client(server, model, **kw):
    spec = get_spec(model)
    cfg = ClientConfig(model=model, mode="full_offload", input_size=spec.test_input_size,
                       load_timeout_s=120, timeout_s=120, **kw)
    client = OffloadClient(cfg, InProcessTransport(server))
    assert client.connect(), client.link.last_error
    return client


@pytest.mark.parametrize("model", names())
def test_full_offload_equals_local(shared_server, model):
    client = _client(shared_server, model)
    try:
        x = client.spec.example_input(client.input_size, seed=1)
        remote, stats = client.infer(x)
        assert stats.executed_mode == "full_offload", stats.fallback_reason
        client.set_mode("local")
        local, lstats = client.infer(x)
        assert lstats.executed_mode == "local" and lstats.round_trips == 0
        leaves, _ = structure.flatten(local)
        assert stats.round_trips == 1 and stats.bytes_up == x.numel() * 4
        assert stats.bytes_down == sum(t.numel() * t.element_size() for t in leaves)
        assert_same_as_local(remote, local, rtol=0, atol=0)
    finally:
        client.close()


def _assert_identical(remote, local):
    """Bit-equal on the CPU (both sides run one preprocessing function, then one model);
    with the server elsewhere, the cross-device comparison."""
    if not ON_CPU:
        assert_same_as_local(remote, local, rtol=0, atol=0)
        return
    got, got_structure = structure.flatten(remote)
    want, want_structure = structure.flatten(local)
    assert got_structure == want_structure
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype and torch.equal(a, b), f"output {i} differs from local"


@pytest.mark.parametrize("model", IMAGE_MODELS)
def test_full_offload_of_the_camera_frame_equals_local(shared_server, model):
    """The camera's uint8 frame goes up (a quarter of the float input's bytes) and the
    server preprocesses it: the outputs are local's on the same frame, for a frame of the
    input size, a larger one (resized on the server) and a grey one."""
    client = _client(shared_server, model)
    h, w = client.input_size
    rng = np.random.default_rng(7)
    frames = {"input size": rng.integers(0, 256, (h, w, 3), dtype=np.uint8),
              "larger": rng.integers(0, 256, (h * 3 // 2 + 1, w * 3 // 2 + 3, 3), dtype=np.uint8),
              "grey": rng.integers(0, 256, (h + 5, w - 3), dtype=np.uint8)}
    try:
        for name, frame in frames.items():
            client.set_mode("full_offload")
            remote, stats = client.process(frame)
            assert stats.executed_mode == "full_offload", (name, stats.fallback_reason)
            assert stats.plan == "input=frame uint8/none" and stats.bytes_up == frame.nbytes, (name, stats.plan)
            assert stats.round_trips == 1 and frame.nbytes <= 3 * h * w * 4
            client.set_mode("local")
            local, lstats = client.process(frame)
            assert lstats.executed_mode == "local"
            _assert_identical(remote, local)
    finally:
        client.close()


def test_a_frame_larger_than_the_float_input_goes_preprocessed(shared_server):
    """A camera of more than four times the input's pixels: the float32 input is the
    smaller upload, so the robot preprocesses and sends it."""
    client = _client(shared_server, "resnet18", compression="zstd")
    h, w = client.input_size
    frame = np.random.default_rng(8).integers(0, 256, (2 * h + 1, 2 * w, 3), dtype=np.uint8)
    try:
        remote, stats = client.process(frame)
        assert stats.executed_mode == "full_offload" and stats.plan.startswith("input=tensor raw/")
        x = client.preprocess(frame)
        assert stats.bytes_up == codec.encode(x, compression="zstd").nbytes
        assert "smaller than the frame" in stats.extra["full_offload"]["tensor_because"]
        client.set_mode("local")
        local, _ = client.process(frame)
        _assert_identical(remote, local)
    finally:
        client.close()


def test_a_compressible_frame_goes_up_compressed(shared_server):
    """``compression: zstd`` compresses the frame losslessly (a flat camera image: to a
    fraction of its bytes); the server decompresses it and computes what local does."""
    client = _client(shared_server, "resnet18", compression="zstd")
    h, w = client.input_size
    frame = np.zeros((h, w, 3), dtype=np.uint8)
    frame[h // 4:, : w // 2] = (200, 30, 90)
    try:
        remote, stats = client.process(frame)
        assert stats.plan == "input=frame uint8/zstd" and stats.bytes_up < frame.nbytes / 10, stats
        client.set_mode("local")
        local, _ = client.process(frame)
        _assert_identical(remote, local)
    finally:
        client.close()


@pytest.mark.parametrize("input_codec", ["float16", "int8", "int8c"])
@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_lossy_input_codec_is_what_the_server_computes_on(shared_server, input_codec, compression):
    """With a lossy codec the server must compute on exactly decode(encode(x)): the only
    error is the codec's, and it is the stated one."""
    client = _client(shared_server, "resnet18", codec=input_codec, compression=compression)
    try:
        x = client.spec.example_input(client.input_size, seed=2)
        remote, stats = client.infer(x)
        assert stats.executed_mode == "full_offload"
        enc = codec.encode(x, codec=input_codec, compression=compression)
        assert stats.bytes_up == enc.nbytes < x.numel() * 4
        x_wire = codec.decode(enc)
        torch.testing.assert_close(x_wire, x, rtol=codec.RTOL[input_codec], atol=codec.tolerance(enc) + 1e-6)
        with torch.inference_mode():
            expected = client.model(x_wire)
        assert_same_as_local(remote, expected)
    finally:
        client.close()


def test_float16_outputs_within_tolerance(shared_server):
    client = _client(shared_server, "resnet18", output_codec="float16")
    try:
        x = client.spec.example_input(client.input_size, seed=3)
        remote, stats = client.infer(x)
        assert stats.bytes_down == 2 * 1000
        with torch.inference_mode():
            local = client.model(x)
        assert_same_as_local(remote, local, rtol=codec.RTOL["float16"], atol=1e-5)
    finally:
        client.close()
