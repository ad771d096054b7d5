"""Every registered model: full_offload through the in-process transport returns the same
outputs as local, at a small input size (DESIGN.md: correctness first)."""

import pytest
import torch

from robot_offload import codec, structure
from robot_offload.client import ClientConfig, OffloadClient
from robot_offload.models import get_spec, names
from robot_offload.transport.inproc import InProcessTransport

from devices import assert_same_as_local


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
