"""The server's ``forward_image`` entry: a camera frame in, preprocessed on the server with
the registry's function and run through the model; everything else refused with a clear
status before it is decoded."""

import json

import numpy as np
import pytest
import torch

from robot_offload import codec, frame_codec
from robot_offload.camera import natural_image
from robot_offload.codec import EncodedTensor
from robot_offload.models import MAX_FRAME_SIDE, get_spec, preprocess_image, preprocess_image_tensor
from robot_offload.protocol import ComputeRequest, LoadModelRequest, StatusCode
from robot_offload.server import OffloadServer, ServerConfig

from devices import SERVER_DEVICE, assert_same_as_local

MAX_ELEMENTS = 400_000


@pytest.fixture(scope="module")
def server():
    s = OffloadServer(ServerConfig(ops_sandbox=False, device=SERVER_DEVICE, max_request_bytes=2_000_000,
                                   max_input_elements=MAX_ELEMENTS))
    for model in ("resnet18", "agrnav"):
        assert s.handle("load_model", LoadModelRequest("t", model)).status == StatusCode.OK
    return s


def _frame(shape, seed=0):
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


def _enc(frame, compression="none"):
    return codec.encode(torch.from_numpy(frame), "frame", "raw", compression)


def _compute(server, tensors, input_size=(32, 32), model="resnet18", args=None):
    args_json = json.dumps({"input_size": list(input_size)}) if args is None else args
    return server.handle("compute", ComputeRequest("t", model, "forward_image", list(tensors),
                                                   args_json=args_json))


@pytest.mark.parametrize("shape", [(32, 32, 3), (45, 61, 3), (20, 24), (32, 32, 4)])
@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_a_frame_gives_what_the_robot_computes_from_it(server, shape, compression):
    frame = _frame(shape)
    spec = get_spec("resnet18")
    r = _compute(server, [_enc(frame, compression)])
    assert r.status == StatusCode.OK, r.status_text
    result = json.loads(r.result_json)
    assert result["frame_shape"] == list(shape) and result["input_shape"] == [1, 3, 32, 32]
    assert r.server_compute_s >= result["preprocess_s"] > 0
    model = server.load("resnet18").module
    x = preprocess_image(frame, (32, 32), spec.mean, spec.std)
    with torch.inference_mode():
        expected = model(x.to(SERVER_DEVICE)).cpu()
    assert_same_as_local(codec.decode(r.tensors[0]), expected, rtol=0, atol=0)


def test_the_robot_and_the_server_preprocess_with_one_function():
    """preprocess_image is preprocess_image_tensor of the same bytes, bit for bit."""
    spec = get_spec("resnet18")
    for shape in [(32, 32, 3), (70, 50, 3), (20, 24), (33, 31, 4)]:
        frame = _frame(shape, seed=3)
        robot = preprocess_image(frame, (40, 36), spec.mean, spec.std)
        server = preprocess_image_tensor(codec.decode(_enc(frame)), (40, 36), spec.mean, spec.std)
        assert torch.equal(robot, server), shape


BAD = {
    "two frames": (dict(tensors=2), StatusCode.BAD_REQUEST, "1 uint8 frame"),
    "no frame": (dict(tensors=0), StatusCode.BAD_REQUEST, "1 uint8 frame"),
    "float frame": (dict(frame=codec.encode(torch.zeros(8, 8, 3))), StatusCode.BAD_REQUEST, "a uint8 frame, raw or jpeg"),
    "lossy frame": (dict(frame=codec.encode(torch.zeros(8, 8, 3), codec="int8")), StatusCode.BAD_REQUEST, "a uint8 frame, raw or jpeg"),
    "batched": (dict(frame=_enc(_frame((1, 8, 8, 3)))), StatusCode.BAD_REQUEST, "[H, W, 3]"),
    "channels first": (dict(frame=_enc(_frame((3, 8, 8)))), StatusCode.BAD_REQUEST, "[H, W, 3]"),
    "two channels": (dict(frame=_enc(_frame((8, 8, 2)))), StatusCode.BAD_REQUEST, "[H, W, 3]"),
    "one dimension": (dict(frame=_enc(_frame((64,)))), StatusCode.BAD_REQUEST, "[H, W, 3]"),
    "empty": (dict(frame=_enc(_frame((0, 8, 3)))), StatusCode.BAD_REQUEST, "empty frame"),
    "side too long": (dict(frame=_enc(_frame((1, MAX_FRAME_SIDE + 1)))), StatusCode.TOO_LARGE, "side above"),
    "too many elements": (dict(frame=_enc(_frame((400, 400, 3)))), StatusCode.TOO_LARGE, "max_input_elements"),
    "lying header": (dict(frame=EncodedTensor("f", "uint8", [4000, 4000, 3], raw_size=48_000_000, data=b"\0" * 10)),
                     StatusCode.TOO_LARGE, "limit"),
    "no arguments": (dict(args=""), StatusCode.BAD_REQUEST, "input_size only"),
    "other arguments": (dict(args='{"input_size": [8, 8], "mean": [0, 0, 0]}'), StatusCode.BAD_REQUEST, "input_size only"),
    "one size": (dict(args='{"input_size": [8]}'), StatusCode.BAD_REQUEST, "must be [h, w]"),
    "three sizes": (dict(args='{"input_size": [8, 8, 3]}'), StatusCode.BAD_REQUEST, "must be [h, w]"),
    "zero size": (dict(args='{"input_size": [0, 8]}'), StatusCode.BAD_REQUEST, "must be [h, w]"),
    "negative size": (dict(args='{"input_size": [-8, 8]}'), StatusCode.BAD_REQUEST, "must be [h, w]"),
    "float size": (dict(args='{"input_size": [8.0, 8]}'), StatusCode.BAD_REQUEST, "must be [h, w]"),
    "bool size": (dict(args='{"input_size": [true, 8]}'), StatusCode.BAD_REQUEST, "must be [h, w]"),
    "string size": (dict(args='{"input_size": "8,8"}'), StatusCode.BAD_REQUEST, "must be [h, w]"),
    "huge size": (dict(args='{"input_size": [100000000000000000000, 8]}'), StatusCode.BAD_REQUEST, "must be [h, w]"),
    "size above the side": (dict(args=json.dumps({"input_size": [MAX_FRAME_SIDE + 1, 1]})), StatusCode.BAD_REQUEST,
                            "must be [h, w]"),
    "size above the elements": (dict(args='{"input_size": [400, 400]}'), StatusCode.TOO_LARGE, "max_input_elements"),
    "point-cloud model": (dict(model="agrnav"), StatusCode.BAD_REQUEST, "takes camera images"),
    "model not loaded": (dict(model="vgg19"), StatusCode.MODEL_NOT_LOADED, "not loaded"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_frame_requests_are_refused_with_a_clear_status(server, name):
    kw, code, fragment = BAD[name]
    frame = kw.get("frame", _enc(_frame((16, 16, 3))))
    tensors = [frame] * kw.get("tensors", 1)
    r = _compute(server, tensors, model=kw.get("model", "resnet18"), args=kw.get("args"))
    assert r.status == code and fragment in r.status_text, (r.status, r.status_text)
    assert r.tensors == []
    assert _compute(server, [_enc(_frame((16, 16, 3)))]).status == StatusCode.OK   # still serving


def test_a_jpeg_frame_gives_what_the_model_computes_from_the_decoded_stream(server):
    """A JPEG frame (the robot asked for lossy frames) is decoded on the server and run as
    the decoded pixels would be on the robot: the output is the model's on exactly those
    pixels, and differs from the output on the original frame (what JPEG loses)."""
    frame = natural_image(48, 64, seed=11)
    enc = frame_codec.encode(frame, "frame", 85)
    r = _compute(server, [enc])
    assert r.status == StatusCode.OK, r.status_text
    assert json.loads(r.result_json)["frame_shape"] == [48, 64, 3]
    spec = get_spec("resnet18")
    model = server.load("resnet18").module
    pixels = codec.decode(enc, frames=True).numpy()
    with torch.inference_mode():
        on_pixels = model(preprocess_image(pixels, (32, 32), spec.mean, spec.std).to(SERVER_DEVICE)).cpu()
        on_frame = model(preprocess_image(frame, (32, 32), spec.mean, spec.std).to(SERVER_DEVICE)).cpu()
    got = codec.decode(r.tensors[0])
    assert_same_as_local(got, on_pixels, rtol=0, atol=0)
    assert not torch.equal(got, on_frame)


def test_jpeg_is_refused_by_every_entry_but_the_frames(server):
    enc = frame_codec.encode(natural_image(32, 32, seed=2), "x", 90)
    r = server.handle("compute", ComputeRequest("t", "resnet18", "forward", [enc]))
    assert r.status == StatusCode.BAD_REQUEST and "camera frames only" in r.status_text, r.status_text


@pytest.mark.parametrize("data", [b"\xff\xd8\xff" + bytes(range(256)) * 8, b"\0" * 3000])
def test_a_crafted_jpeg_frame_is_refused_and_the_server_goes_on(server, data):
    enc = EncodedTensor("frame", "uint8", [32, 32, 3], codec="jpeg", scale=90.0, raw_size=3072, data=data)
    r = _compute(server, [enc])
    assert r.status == StatusCode.BAD_REQUEST and r.tensors == [], (r.status, r.status_text)
    assert _compute(server, [_enc(_frame((16, 16, 3)))]).status == StatusCode.OK
