"""Codec round trips and every refusal."""

import pytest
import torch

from robot_offload import codec
from robot_offload.codec import EncodedTensor, PayloadTooLarge, decode, encode
from robot_offload.errors import CodecError

pytestmark = pytest.mark.robot_side

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
    ("codec", "webp", "unknown codec"),
    ("codec", "jpeg", "a jpeg frame is uint8"),
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
        encode(torch.zeros(1), codec="int9")
    with pytest.raises(CodecError):
        encode(torch.zeros(1), codec="int1")
    with pytest.raises(CodecError):
        encode(torch.zeros(1), compression="lzma")
    with pytest.raises(CodecError):
        encode(torch.zeros(1, dtype=torch.complex64))


# --- lower bit widths and bit shuffling -----------------------------------------------
LOW_BITS = [c for c in codec.INT_BITS if c != "int8"]


@pytest.mark.parametrize("name", list(codec.INT_BITS))
@pytest.mark.parametrize("n", [1, 7, 8, 9, 1000, codec.BIT_BLOCK + 5])
def test_int_codecs_pack_densely_and_bound_the_error(name, n):
    bits = codec.INT_BITS[name]
    x = torch.randn(n) * 3 + 1
    enc = encode(x, codec=name)
    assert enc.raw_size == enc.nbytes == (n * bits + 7) // 8
    y = decode(enc)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert (y - x).abs().max() <= codec.tolerance(enc)
    assert 0 <= enc.zero_point <= (1 << bits) - 1
    assert codec.RTOL[name] == 0.0


@pytest.mark.parametrize("name", LOW_BITS)
def test_low_bit_codecs_keep_zero_exact(name):
    x = torch.relu(torch.randn(4, 8, 5))
    y = decode(encode(x, codec=name, compression="zstd"))
    assert torch.all(y[x == 0] == 0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_bitshuffle_round_trip_is_exact_for_raw(dtype):
    x = _sample(dtype, shape=(3, codec.BIT_BLOCK // 3 + 11))
    enc = encode(x, codec="raw", compression="bitshuffle_zstd")
    assert enc.raw_size == x.numel() * x.element_size()
    assert torch.equal(decode(enc), x)


@pytest.mark.parametrize("name", ["float16"] + list(codec.INT_BITS) + list(codec.PER_CHANNEL_BITS))
@pytest.mark.parametrize("shape", [(1,), (13,), (2, 3, 5), (codec.BIT_BLOCK + 3,)])
def test_bitshuffle_changes_nothing_but_the_size(name, shape):
    x = torch.relu(torch.randn(shape))
    plain = decode(encode(x, codec=name))
    enc = encode(x, codec=name, compression="bitshuffle_zstd")
    assert enc.raw_size == encode(x, codec=name).raw_size
    assert torch.equal(decode(enc), plain)


def _reference_stream(values, bits: int) -> bytes:
    """The module docstring's packing, bit by bit: value i at bits i*bits.. of one
    little-endian stream, unused bits of the last byte zero."""
    acc = 0
    for i, v in enumerate(values):
        acc |= int(v) << (i * bits)
    return acc.to_bytes((len(values) * bits + 7) // 8, "little")


def _reference_shuffle(values, bits: int) -> bytes:
    """bitshuffle as the docstring defines it: per block of BIT_BLOCK values, bit j of value
    i at position j * n + i of the block's stream."""
    out = b""
    for start in range(0, len(values), codec.BIT_BLOCK):
        block = values[start:start + codec.BIT_BLOCK]
        n, acc = len(block), 0
        for i, v in enumerate(block):
            for j in range(bits):
                acc |= ((int(v) >> j) & 1) << (j * n + i)
        out += acc.to_bytes((n * bits + 7) // 8, "little")
    return out


@pytest.mark.parametrize("name", LOW_BITS)
@pytest.mark.parametrize("n", [1, 9, 8 * 5, codec.BIT_BLOCK + 13])
def test_low_bit_payloads_are_the_documented_bit_layout(name, n):
    """The wire bytes against a bit-by-bit reference of the format, so that a faster
    packing can never change what the other side decodes (a robot and a server of
    different versions must agree)."""
    import numpy as np
    import zstandard

    bits = codec.INT_BITS[name]
    levels = (1 << bits) - 1
    q = np.random.default_rng(n + bits).integers(0, levels + 1, n).astype(np.uint8)
    q[0] = levels                    # range [0, levels]: scale 1, zero point 0, q exact
    x = torch.from_numpy(q.astype(np.float32))
    plain = encode(x, codec=name)
    assert (plain.scale, plain.zero_point) == (1.0, 0)
    assert plain.data == _reference_stream(q, bits)
    shuffled = encode(x, codec=name, compression="bitshuffle_zstd")
    if shuffled.compression == "bitshuffle_zstd":
        assert zstandard.ZstdDecompressor().decompress(shuffled.data) == _reference_shuffle(q, bits)
    else:                            # incompressible: sent packed, unshuffled
        assert shuffled.data == plain.data
    for enc in (plain, shuffled):
        assert torch.equal(decode(enc), x)
    # the encoder's fused path and the payload-level transforms agree with each other
    stream = _reference_stream(q, bits)
    assert codec._bitshuffle(stream, n, bits) == _reference_shuffle(q, bits)
    assert codec._bitunshuffle(_reference_shuffle(q, bits), n, bits) == stream


def test_bitshuffle_groups_bit_planes():
    # Small integers in float32: the high bit planes are constant, so shuffled zstd wins.
    x = torch.randint(0, 4, (50000,)).float()
    plain = encode(x, compression="zstd").nbytes
    shuffled = encode(x, compression="bitshuffle_zstd").nbytes
    assert shuffled < plain


def test_empty_tensor_with_every_codec_and_compression():
    for name in codec.CODECS:
        for comp in codec.COMPRESSIONS:
            x = torch.zeros(0, 3)
            assert decode(encode(x, codec=name, compression=comp)).shape == (0, 3)


def _set(enc, **kw):
    return EncodedTensor(**{**enc.__dict__, **kw})


@pytest.mark.parametrize("name", LOW_BITS)
def test_decode_refuses_bad_low_bit_parameters(name):
    levels = (1 << codec.INT_BITS[name]) - 1
    enc = encode(torch.randn(10), codec=name)
    for scale, zp in ((0.0, 0), (float("inf"), 0), (1.0, levels + 1), (1.0, -1)):
        with pytest.raises(CodecError, match=name):
            decode(_set(enc, scale=scale, zero_point=zp))
    with pytest.raises(CodecError, match="does not match"):
        decode(_set(enc, raw_size=enc.raw_size + 1))
    with pytest.raises(CodecError, match="does not match"):
        decode(_set(enc, shape=[20]))


def test_decode_refuses_nonzero_padding_bits():
    enc = encode(torch.randn(3), codec="int3")       # 9 bits in 2 bytes: 7 padding bits
    data = bytearray(enc.data)
    data[-1] |= 0x80
    with pytest.raises(CodecError, match="padding"):
        decode(_set(enc, data=bytes(data)))
    import zstandard
    enc = encode(torch.zeros(1001), codec="int3", compression="bitshuffle_zstd")  # 3003 bits
    assert enc.compression == "bitshuffle_zstd" and enc.raw_size == 376
    raw = bytearray(zstandard.ZstdDecompressor().decompress(enc.data, max_output_size=376))
    raw[-1] |= 0x80
    bad = _set(enc, data=zstandard.ZstdCompressor().compress(bytes(raw)))
    with pytest.raises(CodecError, match="padding"):
        decode(bad)


def test_decode_bounds_the_decoded_size_not_only_the_payload():
    # 2 bits per element on the wire, 32 decoded: refused by the decoded size.
    enc = EncodedTensor(name="x", dtype="float32", shape=[1 << 20], codec="int2", scale=1.0,
                        raw_size=1 << 18, data=b"\x00" * (1 << 18))
    with pytest.raises(PayloadTooLarge):
        decode(enc, max_bytes=1 << 20)
    assert decode(enc, max_bytes=4 << 20).shape == (1 << 20,)


@pytest.mark.parametrize("compression", ["zstd", "bitshuffle_zstd"])
def test_incompressible_payloads_go_uncompressed(compression):
    x = torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(1)).to(torch.uint8)
    enc = encode(x, compression=compression)
    assert enc.compression == "none" and enc.nbytes == enc.raw_size == 4096
    assert torch.equal(decode(enc), x)
    small = encode(torch.randn(3), compression=compression)
    assert small.compression == "none" and small.nbytes == 12


# --- per-channel integer codec ------------------------------------------------------------

def test_int8c_gives_an_image_normalised_from_8_bits_back():
    """A camera image normalised per colour (the models' input) has 256 levels per channel
    at each channel's own spacing: int8c returns it to float32 rounding, in a quarter of the
    bytes plus 8 per channel, where per-tensor int8 errs up to half a step of the widest."""
    from robot_offload.models import get_spec
    x = get_spec("vgg19").example_input((64, 48), seed=5)
    enc = encode(x, codec="int8c")
    assert enc.nbytes == x.numel() + 8 * 3
    y = decode(enc)
    torch.testing.assert_close(y, x, rtol=codec.RTOL["int8c"], atol=1e-6)
    assert (decode(encode(x, codec="int8")) - x).abs().max() > 100 * (y - x).abs().max()


def test_int8c_bounds_each_channel_by_its_own_step():
    g = torch.Generator().manual_seed(1)
    ranges = torch.tensor([0.01, 1.0, 100.0])
    x = torch.randn(2, 3, 7, 5, generator=g) * ranges.view(1, 3, 1, 1) + torch.tensor([50.0, 0, -3]).view(1, 3, 1, 1)
    for comp in codec.COMPRESSIONS:
        enc = encode(x, codec="int8c", compression=comp)
        y = decode(enc)
        for c in range(3):
            xc = x[:, c]
            step = float(xc.max() - xc.min()) / 255
            err = float((y[:, c] - xc).abs().max())
            assert err <= step * (0.5 + 1e-3) + codec.RTOL["int8c"] * float(xc.abs().max()), (c, err, step)
        assert enc.scale == pytest.approx(float((x[:, 2].max() - x[:, 2].min()) / 255), rel=1e-6)
    relu = torch.relu(torch.randn(1, 4, 9, 9, generator=g))
    assert torch.all(decode(encode(relu, codec="int8c"))[relu == 0] == 0)   # min 0: zeros exact


def test_decode_refuses_bad_int8c_headers():
    import numpy as np
    x = torch.randn(1, 2, 4, 4)
    enc = encode(x, codec="int8c")

    def with_header(lo, step):
        head = np.asarray(lo, "<f4").tobytes() + np.asarray(step, "<f4").tobytes()
        return _set(enc, data=head + enc.data[16:])
    with pytest.raises(CodecError, match="int8c"):
        decode(with_header([0, 0], [enc.scale * 2, enc.scale]))       # a step above scale
    with pytest.raises(CodecError, match="int8c"):
        decode(with_header([float("nan"), 0], [enc.scale, enc.scale]))
    with pytest.raises(CodecError, match="int8c"):
        decode(with_header([0, 0], [0.0, enc.scale]))
    for scale, zp in ((0.0, 0), (float("inf"), 0), (enc.scale, 3)):
        with pytest.raises(CodecError, match="int8c"):
            decode(_set(enc, scale=scale, zero_point=zp))
    with pytest.raises(CodecError, match="does not match"):
        decode(_set(enc, shape=[1, 4, 2, 4]))      # same elements, other channels: header size
    decode(with_header([0, 0], [enc.scale, enc.scale]))
