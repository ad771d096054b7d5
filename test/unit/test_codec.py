"""Codec round trips and every refusal."""

import pytest
import torch

from robot_offload import codec
from robot_offload.codec import EncodedTensor, PayloadTooLarge, decode, encode
from robot_offload.errors import CodecError

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int8,
          torch.int16, torch.int32, torch.int64, torch.bool]


def _sample(dtype, shape=(2, 3, 5)):
    g = torch.Generator().manual_seed(0)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 10).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    return torch.randint(-100 if dtype != torch.uint8 else 0, 100, shape, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_raw_round_trip_is_exact(dtype, compression):
    x = _sample(dtype)
    y = decode(encode(x, "x", "raw", compression))
    assert y.dtype == x.dtype and y.shape == x.shape
    assert torch.equal(y, x)


@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (1,), (7, 1, 1, 1)])
def test_odd_shapes(shape):
    x = torch.arange(int(torch.tensor(shape).prod()) if shape else 1, dtype=torch.float32).reshape(shape)
    assert torch.equal(decode(encode(x)), x)


def test_non_contiguous_and_decoded_tensor_is_writable():
    x = torch.randn(4, 6).t()
    y = decode(encode(x))
    assert torch.equal(y, x)
    y += 1  # frombuffer over a private copy: writable, does not alias the message bytes


def test_float16_within_stated_tolerance():
    x = torch.randn(1000) * 100
    enc = encode(x, codec="float16")
    assert enc.nbytes == 2000
    y = decode(enc)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, x, rtol=codec.RTOL["float16"], atol=1e-6)


def test_float16_refuses_overflow():
    with pytest.raises(CodecError, match="float16"):
        encode(torch.tensor([1e6]), codec="float16")


@pytest.mark.parametrize("lo,hi", [(-3.0, 5.0), (0.0, 6.0), (2.0, 9.0), (-7.0, -1.0)])
def test_int8_error_bounded_by_half_a_step(lo, hi):
    x = torch.linspace(lo, hi, 1001)
    enc = encode(x, codec="int8", compression="zstd")
    y = decode(enc)
    assert (y - x).abs().max() <= codec.tolerance(enc)
    assert enc.raw_size == 1001


def test_int8_keeps_zero_exact_and_constant_tensor():
    x = torch.relu(torch.randn(100))
    y = decode(encode(x, codec="int8"))
    assert torch.all(y[x == 0] == 0)
    c = torch.full((10,), 3.5)
    enc = encode(c, codec="int8")
    assert (decode(enc) - c).abs().max() <= codec.tolerance(enc)


def test_int8_refuses_non_finite():
    with pytest.raises(CodecError, match="non-finite"):
        encode(torch.tensor([1.0, float("nan")]), codec="int8")


def test_lossy_codec_on_integers_falls_back_to_raw():
    x = torch.arange(10)
    enc = encode(x, codec="int8")
    assert enc.codec == "raw"
    assert torch.equal(decode(enc), x)


def test_zstd_shrinks_redundant_data():
    x = torch.zeros(100000)
    enc = encode(x, compression="zstd")
    assert enc.nbytes < 1000 and enc.raw_size == 400000


# --- refusals ------------------------------------------------------------------------
def _valid():
    return encode(torch.randn(2, 3), "x")


@pytest.mark.parametrize("field,value,match", [
    ("codec", "jpeg", "unknown codec"),
    ("compression", "gzip", "unknown compression"),
    ("dtype", "complex64", "unknown dtype"),
    ("shape", [2, 4], "does not match"),
    ("shape", [-1, 6], "invalid shape"),
    ("shape", [1] * 17, "invalid shape"),
    ("raw_size", 23, "does not match"),
    ("data", b"\x00" * 23, "bytes of data"),
    ("data", b"\x00" * 25, "bytes of data"),
    ("data", b"", "bytes of data"),
])
def test_decode_refuses_inconsistent_tensors(field, value, match):
    enc = _valid()
    setattr(enc, field, value)
    with pytest.raises(CodecError, match=match):
        decode(enc)


def test_decode_refuses_oversized_before_allocating():
    enc = EncodedTensor(name="big", dtype="float32", shape=[1 << 20, 1 << 20], raw_size=4 << 40, data=b"")
    with pytest.raises(PayloadTooLarge):
        decode(enc, max_bytes=1 << 20)
    with pytest.raises(PayloadTooLarge):
        decode(encode(torch.zeros(1000)), max_bytes=100)


def test_decode_refuses_corrupt_or_lying_zstd():
    enc = encode(torch.zeros(1000), compression="zstd")
    bad = EncodedTensor(**{**enc.__dict__, "data": enc.data[:-3]})
    with pytest.raises(CodecError):
        decode(bad)
    # A compressed stream that expands beyond the declared size (a zip bomb) is refused.
    bomb = encode(torch.zeros(100000), compression="zstd")
    lie = EncodedTensor(**{**bomb.__dict__, "shape": [10], "raw_size": 40})
    with pytest.raises(CodecError):
        decode(lie)


def test_decode_refuses_bad_int8_parameters_and_lossy_integer_dtypes():
    enc = encode(torch.randn(5), codec="int8")
    for scale, zp in ((0.0, 0), (float("nan"), 0), (1.0, 300), (-1.0, 5)):
        bad = EncodedTensor(**{**enc.__dict__, "scale": scale, "zero_point": zp})
        with pytest.raises(CodecError, match="int8"):
            decode(bad)
    bad = EncodedTensor(**{**enc.__dict__, "dtype": "int64"})
    with pytest.raises(CodecError, match="floating"):
        decode(bad)


def test_encode_refuses_unknown_names():
    with pytest.raises(CodecError):
        encode(torch.zeros(1), codec="int3")
    with pytest.raises(CodecError):
        encode(torch.zeros(1), compression="lzma")
    with pytest.raises(CodecError):
        encode(torch.zeros(1, dtype=torch.complex64))
