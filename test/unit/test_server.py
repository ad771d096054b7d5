"""The server answers every bad request with an error status and keeps serving."""

import threading

import pytest
import torch

from robot_offload import codec
from robot_offload.codec import EncodedTensor
from robot_offload.protocol import (ComputeRequest, LoadModelRequest, PingRequest, StatusCode)
from robot_offload.server import OffloadServer, ServerConfig
from robot_offload.errors import ConfigError

from devices import SERVER_DEVICE, to_server


@pytest.fixture(scope="module")
def server():
    s = OffloadServer(ServerConfig(ops_sandbox=False, device=SERVER_DEVICE, max_request_bytes=2_000_000, max_input_elements=400_000))
    assert s.handle("load_model", LoadModelRequest("t", "resnet18")).status == StatusCode.OK
    return s


def _x(shape=(1, 3, 32, 32)):
    return codec.encode(torch.randn(shape), "input")


def _compute(server, **kw):
    args = dict(client_id="t", model="resnet18", entry="forward", tensors=[_x()])
    args.update(kw)
    return server.handle("compute", ComputeRequest(**args))


def test_valid_request_succeeds(server):
    r = _compute(server)
    assert r.status == StatusCode.OK and len(r.tensors) == 1 and r.server_compute_s > 0
    assert r.server_total_s >= r.server_compute_s


BAD = {
    "unknown model": (dict(model="nope"), StatusCode.MODEL_NOT_LOADED),
    "unknown entry": (dict(entry="rm -rf"), StatusCode.UNKNOWN_ENTRY),
    "no tensors": (dict(tensors=[]), StatusCode.BAD_REQUEST),
    "two tensors": (dict(tensors=[_x(), _x()]), StatusCode.BAD_REQUEST),
    "wrong rank": (dict(tensors=[_x((3, 32, 32))]), StatusCode.BAD_REQUEST),
    "wrong channels": (dict(tensors=[_x((1, 5, 32, 32))]), StatusCode.BAD_REQUEST),
    "integer input": (dict(tensors=[codec.encode(torch.zeros(1, 3, 8, 8, dtype=torch.int64))]), StatusCode.BAD_REQUEST),
    "truncated data": (dict(tensors=[EncodedTensor("x", "float32", [1, 3, 8, 8], raw_size=768, data=b"\0" * 700)]), StatusCode.BAD_REQUEST),
    "lying shape": (dict(tensors=[EncodedTensor("x", "float32", [1, 3, 800, 800], raw_size=7680000, data=b"\0" * 768)]), StatusCode.TOO_LARGE),
    "huge request": (dict(tensors=[codec.encode(torch.zeros(600_000))]), StatusCode.TOO_LARGE),
    "too many elements": (dict(tensors=[codec.encode(torch.zeros(1, 3, 400, 400, dtype=torch.float16))]), StatusCode.TOO_LARGE),
    "unknown dtype": (dict(tensors=[EncodedTensor("x", "complex", [1], raw_size=8, data=b"\0" * 8)]), StatusCode.BAD_REQUEST),
    "unknown output codec": (dict(output_codec="jpeg"), StatusCode.BAD_REQUEST),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_compute_requests_get_error_status(server, name):
    kw, code = BAD[name]
    r = _compute(server, **kw)
    assert r.status == code, r.status_text
    assert r.status_text
    assert _compute(server).status == StatusCode.OK  # still serving


def test_bad_load_requests(server):
    r = server.handle("load_model", LoadModelRequest("t", "nope"))
    assert r.status == StatusCode.UNKNOWN_MODEL and "resnet18" in r.status_text
    r = server.handle("load_model", LoadModelRequest("t", "resnet18", weights_hash="0" * 64))
    assert r.status == StatusCode.HASH_MISMATCH
    assert server.handle("nonsense", None).status == StatusCode.UNKNOWN_ENTRY
    assert server.handle("ping", PingRequest("t", b"x" * 3_000_000)).status == StatusCode.TOO_LARGE
    p = server.handle("ping", PingRequest("t", b"abc"))
    assert p.status == StatusCode.OK and p.payload == b"abc" and "resnet18" in p.loaded_models


def test_allow_list():
    s = OffloadServer(ServerConfig(ops_sandbox=False, device=SERVER_DEVICE, allowed_models=("mobilenet_v2",)))
    assert s.handle("load_model", LoadModelRequest("t", "resnet18")).status == StatusCode.UNAUTHORIZED


def test_config_refusals():
    with pytest.raises(ConfigError):
        ServerConfig(ops_sandbox=False, device="tpu").validate()
    with pytest.raises(ConfigError):
        ServerConfig(ops_sandbox=False, max_request_bytes=0).validate()


def test_concurrent_clients_get_their_own_results(server):
    inputs = [torch.randn(1, 3, 32, 32) for _ in range(6)]
    results = [None] * len(inputs)

    def run(i):
        results[i] = _compute(server, client_id=f"robot{i}", tensors=[codec.encode(inputs[i])])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    model = server.load("resnet18").module
    for x, r in zip(inputs, results):
        assert r.status == StatusCode.OK
        with torch.inference_mode():
            torch.testing.assert_close(codec.decode(r.tensors[0]), model(to_server(x)).cpu())


def test_tf32_is_off_unless_asked_for():
    """PyTorch lets cuDNN convolve in TF32 by default (~1e-3 from the robot's float32)."""
    if SERVER_DEVICE == "cpu":
        pytest.skip("needs the server on CUDA (ROBOT_OFFLOAD_TEST_DEVICE=cuda)")
    OffloadServer(ServerConfig(ops_sandbox=False, device=SERVER_DEVICE))
    assert not torch.backends.cudnn.allow_tf32 and not torch.backends.cuda.matmul.allow_tf32
    OffloadServer(ServerConfig(ops_sandbox=False, device=SERVER_DEVICE, allow_tf32=True))
    assert torch.backends.cudnn.allow_tf32 and torch.backends.cuda.matmul.allow_tf32
    OffloadServer(ServerConfig(ops_sandbox=False, device=SERVER_DEVICE))
