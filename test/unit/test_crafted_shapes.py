"""Crafted tensor headers at the server: the request check and OffloadServer.handle refuse
what the codec refuses, as the request's fault (BAD_REQUEST or TOO_LARGE), never INTERNAL."""

import pytest
from hypothesis import example, given, settings, strategies as st

from robot_offload import codec
from robot_offload.codec import EncodedTensor, decode
from robot_offload.errors import CodecError
from robot_offload.protocol import ComputeRequest, LoadModelRequest, StatusCode
from robot_offload.server import request_check

_EDGE_DIMS = [0, 1, 2, 3, 2 ** 31 - 1, 2 ** 31, 2 ** 32 - 1, 2 ** 32,
              2 ** 63 - 1, 2 ** 63, 2 ** 64, 10 ** 30, -1, -(2 ** 63)]
_DIM = st.one_of(st.sampled_from(_EDGE_DIMS), st.integers(-5, 40), st.integers(-(2 ** 70), 2 ** 70),
                 st.booleans(), st.floats(allow_nan=True), st.none(), st.text(max_size=2))
_SHAPE = st.one_of(st.lists(_DIM, max_size=codec.MAX_DIMS + 3),
                   st.lists(st.sampled_from([0, 2 ** 32 - 1, 2 ** 31 - 1, 2 ** 31, 7]), max_size=codec.MAX_DIMS),
                   st.sampled_from([None, 5, "1,2", b"\x01", (2 ** 32 - 1,), {"a": 1}]))


def _consistent_raw_size(shape, dtype, name):
    """The raw_size a header with this shape would need, where it can be computed, so that
    crafted shapes reach the decoder's allocation instead of stopping at raw_size."""
    try:
        return codec._payload_size([int(s) for s in shape], dtype, name)
    except Exception:  # noqa: BLE001 - not a computable shape: any raw_size will do
        return 0


@given(shape=_SHAPE, dtype=st.sampled_from(["float32", "uint8", "bool", "float64"]),
       name=st.sampled_from(["raw", "float16", "int8", "int3", "int8c"]),
       compression=st.sampled_from(["none", "zstd"]), raw_size=st.one_of(st.none(), st.integers(-1, 1 << 70)))
@example(shape=[0, 2 ** 32 - 1, 2 ** 32 - 1, 2 ** 32 - 1], dtype="float32", name="raw", compression="none", raw_size=None)
@example(shape=[True, 3], dtype="float32", name="raw", compression="none", raw_size=None)
@example(shape=[0, 2 ** 31 - 1, 2 ** 31 - 1, 2 ** 31 - 1], dtype="float32", name="raw", compression="none", raw_size=None)
@settings(max_examples=400, deadline=None, database=None)
def test_any_shape_is_decoded_or_refused_with_a_codec_error(shape, dtype, name, compression, raw_size):
    """Whatever the shape (overflowing products, negative, bool, huge, not integers), a
    header is decoded or refused with CodecError / PayloadTooLarge before any allocation,
    and the server's request check passes it or refuses it as BAD_REQUEST or TOO_LARGE."""
    size = _consistent_raw_size(shape, dtype, name) if raw_size is None else raw_size
    data = b"\x00" * size if 0 < size <= 4096 and compression == "none" and name == "raw" else b""
    enc = EncodedTensor(name="x", dtype=dtype, shape=shape, codec=name, compression=compression,
                        scale=1.0, raw_size=size, data=data)
    max_bytes = 1 << 20
    try:
        t = decode(enc, max_bytes=max_bytes)
    except CodecError as e:   # PayloadTooLarge included
        assert str(e)
    else:
        assert list(t.shape) == [int(s) for s in shape] and t.numel() * t.element_size() <= max_bytes
        return
    # The request check reads headers only (a corrupt zstd stream is the decoder's to
    # find); whatever it refuses, it refuses as the request's fault.
    req = ComputeRequest("t", "resnet18", "forward", [enc])
    try:
        request_check.check_request("compute", req, max_bytes)
    except request_check.BadRequest as refused:
        assert refused.code in (StatusCode.BAD_REQUEST, StatusCode.TOO_LARGE) and refused.text


@pytest.mark.parametrize("shape,status,fragment", [
    ([0, 2 ** 32 - 1, 2 ** 32 - 1, 2 ** 32 - 1], StatusCode.BAD_REQUEST, "dimension 1 is 4294967295"),
    ([0, 2 ** 31 - 1, 2 ** 31 - 1, 2 ** 31 - 1], StatusCode.TOO_LARGE, "spans"),
    ([2 ** 63, 0], StatusCode.BAD_REQUEST, "dimension 0"),
    ([True, 3], StatusCode.BAD_REQUEST, "is a bool"),
    ([0, -1], StatusCode.BAD_REQUEST, "dimension 1 is -1"),
    ([0, 10 ** 5000], StatusCode.BAD_REQUEST, "-bit integer"),
    ([1.0, 3], StatusCode.BAD_REQUEST, "not an integer"),
    ([0] * 17, StatusCode.BAD_REQUEST, "17 dimensions"),
])
def test_crafted_shapes_are_refused_by_the_server_not_internal(shared_server, shape, status, fragment):
    """The same shapes through OffloadServer.handle with the model loaded: the answer is
    the request's fault, with a clear text, never INTERNAL."""
    assert shared_server.handle("load_model", LoadModelRequest("t", "resnet18")).status == StatusCode.OK
    enc = EncodedTensor(name="x", dtype="float32", shape=shape, raw_size=0, data=b"")
    r = shared_server.handle("compute", ComputeRequest("t", "resnet18", "forward", [enc]))
    assert r.status == status and fragment in r.status_text, (r.status, r.status_text)


_FRAME_SHAPE = st.one_of(_SHAPE, st.lists(st.integers(0, 24), min_size=1, max_size=4),
                         st.tuples(st.integers(0, 24), st.integers(0, 24), st.sampled_from([1, 2, 3, 4, 5])).map(list))
_INPUT_SIZE = st.one_of(st.lists(st.one_of(st.integers(-2, 20), st.sampled_from([4096, 4097, 2 ** 31, 2 ** 64]),
                                           st.booleans(), st.floats(0, 20), st.none()), max_size=3),
                        st.sampled_from([None, "8,8", {"h": 8}, 8]))


@given(shape=_FRAME_SHAPE, dtype=st.sampled_from(["uint8", "uint8", "float32", "int64"]),
       compression=st.sampled_from(["none", "zstd"]), input_size=_INPUT_SIZE,
       extra_args=st.booleans())
@example(shape=[2 ** 31 - 1, 2 ** 31 - 1, 3], dtype="uint8", compression="none", input_size=[8, 8], extra_args=False)
@example(shape=[4096, 4096, 4], dtype="uint8", compression="zstd", input_size=[8, 8], extra_args=False)
@example(shape=[5, 7], dtype="uint8", compression="none", input_size=[8, 8], extra_args=False)
@settings(max_examples=300, deadline=None, database=None)
def test_crafted_frames_are_run_or_refused_as_the_requests_fault(shared_server, shape, dtype, compression,
                                                                  input_size, extra_args):
    """forward_image (the camera frame of full_offload) under crafted headers and
    arguments: a frame is run, or refused BAD_REQUEST / TOO_LARGE with a text, never
    INTERNAL, and never decoded before its shape and the input size are within bounds."""
    import json
    assert shared_server.handle("load_model", LoadModelRequest("t", "resnet18")).status == StatusCode.OK
    size = _consistent_raw_size(shape, dtype, "raw")
    data = b"\x07" * size if 0 < size <= 4096 else b""
    if compression == "zstd":
        data = codec._zstd().ZstdCompressor().compress(b"\x07" * size) if 0 < size <= 1 << 16 else data
    enc = EncodedTensor(name="frame", dtype=dtype, shape=shape, codec="raw", compression=compression,
                        raw_size=size, data=data)
    args = {"input_size": input_size}
    if extra_args:
        args["mean"] = [0, 0, 0]
    r = shared_server.handle("compute", ComputeRequest("t", "resnet18", "forward_image", [enc],
                                                       args_json=json.dumps(args)))
    assert r.status in (StatusCode.OK, StatusCode.BAD_REQUEST, StatusCode.TOO_LARGE), (r.status, r.status_text)
    if r.status == StatusCode.OK:
        assert not extra_args and len(shape) in (2, 3) and dtype == "uint8"
        assert codec.decode(r.tensors[0]).shape == (1, 1000)
    else:
        assert r.status_text and r.tensors == []
