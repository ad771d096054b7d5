"""Tensor codec: torch tensors to bytes and back, with optional lossy precision and zstd.

Wire format (one :class:`EncodedTensor`, mirrored by ``msg/Tensor.msg``):

* ``raw``     -- the tensor's own dtype, little endian. Lossless.
* ``float16`` -- floating tensors sent as IEEE half and decoded back to their dtype.
  Relative error <= 2**-11; values beyond +-65504 are refused rather than sent as inf.
* ``int8``    -- per-tensor affine uint8 with an input-specific scale (DynO's ISQuant): the
  range is taken from this tensor, widened to include 0 so that zeros (ReLU outputs) stay
  exact. Absolute error <= scale / 2 (see :func:`tolerance`).
* ``int7`` .. ``int2`` -- the same affine quantisation with ``2**b - 1`` steps, packed densely:
  element ``i`` occupies bits ``i*b .. i*b+b-1`` of the payload (least significant bit
  first), so ``ceil(numel * b / 8)`` bytes; unused bits of the last byte are zero.
* ``int8c`` -- uint8 with an offset and a step per channel (dimension 1; a tensor of fewer
  dimensions is one channel): ``real = offset[c] + q * step[c]``, the channel's range taken
  from this tensor. The payload starts with the ``C`` offsets, then the ``C`` steps (float32,
  little endian), then one byte per element; ``scale`` holds the largest step. Absolute
  error <= step / 2 plus float32 rounding of the offset. Channels differ in range (the
  normalised colours of an image; feature maps), and a range taken per channel is not
  widened to include 0: an image normalised from 8-bit values (``(k/255 - mean_c) / std_c``)
  comes back to float32 rounding, where the per-tensor ``int8`` errs up to half a step of
  the widest channel. Zeros stay exact where a channel's minimum is 0 (ReLU outputs).

Compression, after the codec (the encoder falls back to ``none`` when compressing would
not make the payload smaller, so a compressed tensor never costs more than an uncompressed
one; ``compression`` always says what is on the wire):

* ``none``.
* ``zstd``.
* ``bitshuffle_zstd`` -- DynO's bit shuffling before zstd: the payload is read as ``numel``
  elements of ``w`` bits (``w`` = 8 x itemsize for raw / float16, ``b`` for the integer
  codecs) and, per block of :data:`BIT_BLOCK` elements, rewritten bit plane by bit plane
  (bit 0 of every element of the block, then bit 1, ...). It is a length-preserving bit
  permutation that puts the near-constant high bits of activations next to each other,
  where zstd finds them. ``raw_size`` is the payload size before it. (Shuffling without
  compression would not change the size, so it is not offered on its own.)

Camera frames may also go as ``jpeg`` (lossy, opt-in; :mod:`robot_offload.frame_codec`):
:func:`check_header` accepts its header, and :func:`decode` decodes it only for a caller
that asks for frames (``frames=True``; the server's ``forward_image`` entry).

Decoding trusts nothing: codec, dtype, shape, sizes and quantisation parameters are checked
against each other and against a maximum payload size before a byte is interpreted, and the
bytes are only ever read with ``torch.frombuffer`` / ``numpy.frombuffer`` -- nothing is
unpickled or executed.
"""

import math
import operator
from dataclasses import dataclass, field
from typing import List, Sequence

import numpy as np
import torch

from robot_offload import frame_codec
from robot_offload.errors import CodecError

#: Integer codecs and their bit widths (affine quantisation with an input-specific scale).
INT_BITS = {"int8": 8, "int7": 7, "int6": 6, "int5": 5, "int4": 4, "int3": 3, "int2": 2}
#: Integer codecs with an offset and a step per channel, and their bit widths.
PER_CHANNEL_BITS = {"int8c": 8}
CODECS = ("raw", "float16") + tuple(INT_BITS) + tuple(PER_CHANNEL_BITS)
COMPRESSIONS = ("none", "zstd", "bitshuffle_zstd")
#: Largest decoded payload accepted by default (bytes). Servers and clients configure theirs.
DEFAULT_MAX_BYTES = 128 * 1024 * 1024
MAX_DIMS = 16
#: Largest size of one dimension. Any tensor within a request's byte limit has smaller
#: ones; the bound keeps every product of sizes torch computes (strides, storage) far
#: from int64 overflow.
MAX_DIM_SIZE = 2 ** 31 - 1

_DTYPES = {
    "float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
    "bfloat16": torch.bfloat16, "uint8": torch.uint8, "int8": torch.int8,
    "int16": torch.int16, "int32": torch.int32, "int64": torch.int64, "bool": torch.bool,
}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}
_FLOATING = {"float32", "float64", "float16", "bfloat16"}
_FLOAT16_MAX = 65504.0


@dataclass
class EncodedTensor:
    """A tensor as it crosses the wire. ``data`` is ``bytes``; see the module docstring."""

    name: str
    dtype: str
    shape: List[int]
    codec: str = "raw"
    compression: str = "none"
    scale: float = 0.0
    zero_point: int = 0
    raw_size: int = 0
    data: bytes = field(default=b"", repr=False)

    @property
    def nbytes(self) -> int:
        """Bytes of payload on the wire."""
        return len(self.data)


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise CodecError(f"dtype {dtype} is not supported; supported: {sorted(_DTYPES)}") from None


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def quant_bits(codec: str):
    """Bit width of an integer codec (per tensor or per channel); None for raw and float16."""
    return INT_BITS.get(codec, PER_CHANNEL_BITS.get(codec))


def _element_bits(dtype: str, codec: str) -> int:
    """Bits one element occupies in the (uncompressed) payload, after its header."""
    if codec == "float16":
        return 16
    bits = quant_bits(codec)
    if bits is not None:
        return bits
    return 8 * torch.empty((), dtype=_DTYPES[dtype]).element_size()


def channels(shape: Sequence[int]) -> int:
    """Channels of a per-channel codec: dimension 1, or one for fewer dimensions."""
    return int(shape[1]) if len(shape) >= 2 else 1


def _header_size(shape: Sequence[int], codec: str) -> int:
    """Bytes before the elements: a per-channel codec's offsets and steps (float32 each)."""
    return 8 * channels(shape) if codec in PER_CHANNEL_BITS else 0


def _payload_size(shape: Sequence[int], dtype: str, codec: str) -> int:
    return _header_size(shape, codec) + (_numel(shape) * _element_bits(dtype, codec) + 7) // 8


def payload_size(shape: Sequence[int], dtype: str = "float32", codec: str = "raw") -> int:
    """Bytes of the uncompressed payload of a ``dtype`` tensor of ``shape`` in ``codec``."""
    return _payload_size(shape, dtype, codec)


def _channel_view(t: torch.Tensor, per_channel: torch.Tensor) -> torch.Tensor:
    """``per_channel`` (C values) shaped to broadcast along dimension 1 of ``t``."""
    return per_channel.view([1, -1] + [1] * (t.dim() - 2)) if t.dim() >= 2 else per_channel


def _encode_per_channel(tf: torch.Tensor, bits: int):
    """(header + elements, largest step) of a per-channel integer codec; see the module
    docstring. Offsets and steps are rounded to float32 before quantising, so decoding uses
    exactly the values the elements were quantised with."""
    levels = (1 << bits) - 1
    c = channels(tf.shape)
    if c == 0:
        return b"", 1.0
    rows = tf.transpose(0, 1).reshape(c, -1) if tf.dim() >= 2 else tf.reshape(1, -1)
    if rows.shape[1] == 0:
        lo = hi = torch.zeros(c)
    else:
        lo, hi = rows.min(dim=1).values, rows.max(dim=1).values
    step = (hi - lo) / levels
    step = torch.where(step > 0, step, torch.ones_like(step))   # a constant channel: q = 0
    q = torch.clamp(torch.round((tf - _channel_view(tf, lo)) / _channel_view(tf, step)), 0, levels)
    header = lo.numpy().astype("<f4").tobytes() + step.numpy().astype("<f4").tobytes()
    return header + _to_bytes(q.to(torch.uint8)), float(step.max())


def _decode_per_channel(enc: "EncodedTensor", payload: bytes, shape: List[int]) -> torch.Tensor:
    c = channels(shape)
    lo = np.frombuffer(payload, dtype="<f4", count=c, offset=0).astype(np.float32)
    step = np.frombuffer(payload, dtype="<f4", count=c, offset=4 * c).astype(np.float32)
    # The steps must be the ones ``scale`` (and so :func:`tolerance`) promises.
    if not (np.isfinite(lo).all() and np.isfinite(step).all() and (step > 0).all()
            and (step <= enc.scale * (1 + 1e-6)).all()):
        raise CodecError(f"tensor {enc.name!r}: bad {enc.codec} offsets or steps "
                         f"(non-finite, not positive, or above scale={enc.scale})")
    body = payload[8 * c:]
    q = (torch.frombuffer(bytearray(body), dtype=torch.uint8) if body else torch.zeros(0)).reshape(shape).float()
    out = _channel_view(q, torch.from_numpy(lo)) + q * _channel_view(q, torch.from_numpy(step))
    return out.to(_DTYPES[enc.dtype])


#: Elements per block of the bit-level transforms (a multiple of 8, so that every block but
#: the last starts on a byte boundary); bounds their temporary memory to ~16 bytes / element
#: of one block, whatever the tensor's size.
BIT_BLOCK = 1 << 16

# The sub-byte codecs run on every frame, on both sides (KAPAO's 384x384 input at int3:
# 442,368 elements). Their packing works eight elements to a 64-bit word, and their bit
# shuffle one bit plane at a time straight from the values: an earlier version expanded
# every bit to a byte, transposed that array and packed it again, twice per tensor with
# bitshuffle_zstd (pack, then shuffle), and took 9.7 ms to decode that input on one x86
# core and 5.2 ms to encode it (0.7 and 1.6 ms now). Byte-wide elements (raw, float16,
# int8) keep the bit-array transpose, which measured faster for them than packing down the
# elements. The bytes are the same; test_codec pins them to the module docstring's format.

_EIGHT = np.arange(8, dtype="<u8")


def _blocks(numel: int, bits: int):
    """(first element, elements, first byte, bytes) of each block of a dense bit stream."""
    for start in range(0, numel, BIT_BLOCK):
        n = min(BIT_BLOCK, numel - start)
        yield start, n, start * bits // 8, (n * bits + 7) // 8


def _check_padding(block: np.ndarray, used_bits: int) -> None:
    if used_bits % 8 and int(block[-1]) >> (used_bits % 8):
        raise CodecError("nonzero padding bits after the last packed element")


def _pack_bits(q: np.ndarray, bits: int) -> bytes:
    """Dense little-endian bit packing of uint8 values below 2**bits: element i occupies
    bits i*bits .. i*bits+bits-1 of the stream. Eight elements fill ``bits`` bytes: they
    are OR-ed, shifted, into one little-endian 64-bit word whose low ``bits`` bytes are
    kept."""
    out = np.empty((q.size * bits + 7) // 8, dtype=np.uint8)
    shifts = _EIGHT * np.uint64(bits)
    for start, n, b0, nb in _blocks(q.size, bits):
        groups = -(-n // 8)
        words = np.zeros((groups, 8), dtype="<u8")
        words.reshape(-1)[:n] = q[start:start + n]
        words <<= shifts
        word = np.bitwise_or.reduce(words, axis=1)
        out[b0:b0 + nb] = word.view(np.uint8).reshape(groups, 8)[:, :bits].reshape(-1)[:nb]
    return out.tobytes()


def _unpack_bits(payload: bytes, numel: int, bits: int) -> np.ndarray:
    src = np.frombuffer(payload, dtype=np.uint8)
    out = np.empty(numel, dtype=np.uint8)
    shifts, mask = _EIGHT * np.uint64(bits), np.uint64((1 << bits) - 1)
    for start, n, b0, nb in _blocks(numel, bits):
        block = src[b0:b0 + nb]
        _check_padding(block, n * bits)
        groups = -(-n // 8)
        padded = np.zeros(groups * bits, dtype=np.uint8)
        padded[:nb] = block
        words = np.zeros((groups, 8), dtype=np.uint8)
        words[:, :bits] = padded.reshape(groups, bits)
        values = (words.reshape(-1).view("<u8")[:, None] >> shifts) & mask
        out[start:start + n] = values.astype(np.uint8).reshape(-1)[:n]
    return out


def _shuffle_values(q: np.ndarray, bits: int) -> bytes:
    """``_bitshuffle(_pack_bits(q, bits))`` in one pass: per block, bit plane ``j`` is
    bit ``j`` of every value, packed least significant first; the planes follow each
    other as one bit stream."""
    out = np.empty((q.size * bits + 7) // 8, dtype=np.uint8)
    planes_j = np.arange(bits, dtype=np.uint8)[:, None]
    for start, n, b0, nb in _blocks(q.size, bits):
        planes = (q[None, start:start + n] >> planes_j) & 1
        out[b0:b0 + nb] = np.packbits(planes.reshape(-1), bitorder="little")
    return out.tobytes()


def _unshuffle_values(payload: bytes, numel: int, bits: int) -> np.ndarray:
    """The values of a bit-shuffled sub-byte stream (``_unpack_bits(_bitunshuffle(...))``)."""
    src = np.frombuffer(payload, dtype=np.uint8)
    out = np.empty(numel, dtype=np.uint8)
    for start, n, b0, nb in _blocks(numel, bits):
        block = src[b0:b0 + nb]
        _check_padding(block, n * bits)
        planes = np.unpackbits(block, bitorder="little", count=n * bits).reshape(bits, n)
        values = out[start:start + n]
        np.copyto(values, planes[0])
        for j in range(1, bits):
            values |= planes[j] << j
    return out


def _bitshuffle(payload: bytes, numel: int, bits: int) -> bytes:
    """Per block of BIT_BLOCK elements: element-major bits -> bit-plane-major bits (bit 0
    of every element of the block, then bit 1, ...). Same length as ``payload``. The
    encoder uses it for byte-wide elements; sub-byte values go through
    :func:`_shuffle_values` (the same bytes, without packing them first)."""
    src = np.frombuffer(payload, dtype=np.uint8)
    out = np.empty_like(src)
    for _, n, b0, nb in _blocks(numel, bits):
        flat = np.unpackbits(src[b0:b0 + nb], bitorder="little", count=n * bits)
        out[b0:b0 + nb] = np.packbits(flat.reshape(n, bits).T.reshape(-1), bitorder="little")
    return out.tobytes()


def _bitunshuffle(payload: bytes, numel: int, bits: int) -> bytes:
    src = np.frombuffer(payload, dtype=np.uint8)
    out = np.empty_like(src)
    for _, n, b0, nb in _blocks(numel, bits):
        block = src[b0:b0 + nb]
        _check_padding(block, n * bits)
        flat = np.unpackbits(block, bitorder="little", count=n * bits)
        out[b0:b0 + nb] = np.packbits(flat.reshape(bits, n).T.reshape(-1), bitorder="little")
    return out.tobytes()


def byte_view(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's bytes in row-major order as a flat uint8 array: a view, no copy, when
    its elements are already laid out one after the other, else a copy. Any layout is
    accepted, including a single element or a size-1 dimension whose stride is not 1 (a
    slice of a column), which ``reshape(-1).view(torch.uint8)`` refuses."""
    flat = t.detach().reshape(-1)
    if flat.numel() and flat.stride(0) != 1:
        flat = flat.clone(memory_format=torch.contiguous_format)
    return flat.view(torch.uint8).numpy()


def _to_bytes(t: torch.Tensor) -> bytes:
    return byte_view(t).tobytes()


def encode(tensor: torch.Tensor, name: str = "", codec: str = "raw",
           compression: str = "none", zstd_level: int = 1) -> EncodedTensor:
    """Encode ``tensor`` for the wire. Raises :class:`CodecError` when the codec cannot
    represent it (non-floating tensor for a lossy codec, non-finite values, overflow)."""
    if codec not in CODECS:
        raise CodecError(f"unknown codec {codec!r}; known: {list(CODECS)}")
    if compression not in COMPRESSIONS:
        raise CodecError(f"unknown compression {compression!r}; known: {list(COMPRESSIONS)}")
    t = tensor.detach().to("cpu").contiguous()
    dtype = dtype_name(t.dtype)
    scale, zero_point = 0.0, 0
    if codec != "raw" and dtype not in _FLOATING:
        # Lossy codecs only make sense for floating tensors; integers go raw.
        codec = "raw"
    if codec == "float16":
        if t.numel() and float(t.abs().max()) > _FLOAT16_MAX:
            raise CodecError(f"tensor {name!r} exceeds the float16 range (+-65504); use raw")
        payload = _to_bytes(t.to(torch.float16))
    elif quant_bits(codec) is not None:
        bits = quant_bits(codec)
        tf = t.to(torch.float32)
        if t.numel() and not bool(torch.isfinite(tf).all()):
            raise CodecError(f"tensor {name!r} has non-finite values; {codec} cannot encode them")
        if codec in PER_CHANNEL_BITS:
            payload, scale = _encode_per_channel(tf, bits)
        else:
            levels = (1 << bits) - 1
            lo = min(float(tf.min()), 0.0) if t.numel() else 0.0
            hi = max(float(tf.max()), 0.0) if t.numel() else 0.0
            scale = (hi - lo) / levels if hi > lo else 1.0
            zero_point = int(min(levels, max(0, round(-lo / scale))))
            q = torch.clamp(torch.round(tf / scale) + zero_point, 0, levels).to(torch.uint8)
            if bits == 8:
                payload = _to_bytes(q)
            elif compression == "bitshuffle_zstd":
                # shuffled straight from the values, not packed first (see _shuffle_values)
                values = q.reshape(-1).numpy()
                payload, shuffled = None, _shuffle_values(values, bits)
            else:
                payload = _pack_bits(q.reshape(-1).numpy(), bits)
    else:
        payload = _to_bytes(t)
    if payload is None:
        raw_size = len(shuffled)
    else:
        raw_size = len(payload)
        shuffled = payload
        header = _header_size(t.shape, codec)
        if compression == "bitshuffle_zstd" and payload:
            shuffled = payload[:header] + _bitshuffle(payload[header:], t.numel(), _element_bits(dtype, codec))
    if compression in ("zstd", "bitshuffle_zstd"):
        packed = _zstd().ZstdCompressor(level=zstd_level).compress(shuffled)
        if len(packed) < raw_size:
            payload = packed
        else:   # incompressible (noise): send it uncompressed, never larger than raw
            compression = "none"
            if payload is None:
                payload = _pack_bits(values, bits)
    return EncodedTensor(name=name, dtype=dtype, shape=[int(s) for s in t.shape], codec=codec,
                         compression=compression, scale=float(scale), zero_point=zero_point,
                         raw_size=raw_size, data=payload)


def encode_or_raw(tensor: torch.Tensor, name: str, codec: str, compression: str) -> EncodedTensor:
    """:func:`encode`, or raw (lossless) for a tensor ``codec`` cannot represent (float16
    overflow, non-finite values for an integer codec): a lossy codec is a size choice,
    and such a tensor must still reach the other side."""
    try:
        return encode(tensor, name, codec, compression)
    except CodecError:
        if codec == "raw":
            raise
        return encode(tensor, name, "raw", compression)


def check_header(enc: EncodedTensor, max_bytes: int = DEFAULT_MAX_BYTES) -> int:
    """Check everything of ``enc`` that can be checked without decompressing or decoding
    it: field types, codec, compression, dtype, shape, sizes against each other and against
    ``max_bytes``, and, for uncompressed tensors, the length of ``data``. Returns the size of
    the decoded tensor (bytes). Raises what :func:`decode` raises for the same faults
    (:class:`CodecError`, :class:`PayloadTooLarge`); the server runs it on every request
    before any executor sees it."""
    for name in ("name", "dtype", "codec", "compression"):
        if not isinstance(getattr(enc, name, None), str):
            raise CodecError(f"tensor field {name!r} must be a string")
    if not isinstance(enc.data, (bytes, bytearray, memoryview)):
        raise CodecError(f"tensor {enc.name!r}: data must be bytes")
    if enc.codec not in CODECS + frame_codec.FRAME_CODECS:
        raise CodecError(f"unknown codec {enc.codec!r}; known: {list(CODECS + frame_codec.FRAME_CODECS)}")
    if enc.compression not in COMPRESSIONS:
        raise CodecError(f"unknown compression {enc.compression!r}; known: {list(COMPRESSIONS)}")
    if enc.dtype not in _DTYPES:
        raise CodecError(f"unknown dtype {enc.dtype!r}; known: {sorted(_DTYPES)}")
    if enc.codec in CODECS and enc.codec != "raw" and enc.dtype not in _FLOATING:
        raise CodecError(f"codec {enc.codec} needs a floating dtype, got {enc.dtype}")
    shape = _checked_shape(enc)
    try:
        if (isinstance(enc.raw_size, bool) or isinstance(enc.zero_point, bool)
                or isinstance(enc.scale, (bool, str, bytes, bytearray))):
            raise TypeError("not a number")
        raw_size = operator.index(enc.raw_size)
        operator.index(enc.zero_point)
        float(enc.scale)
    except (TypeError, ValueError, OverflowError):
        raise CodecError(f"tensor {enc.name!r}: raw_size and zero_point must be integers "
                         f"and scale a number") from None
    if enc.codec in frame_codec.FRAME_CODECS:
        if math.isnan(float(enc.scale)) or enc.zero_point != 0:
            raise CodecError(f"tensor {enc.name!r}: a {enc.codec} frame has zero_point 0 and a number as scale")
        if _numel(shape) > max_bytes:
            raise PayloadTooLarge(f"tensor {enc.name!r}: frame {shape} needs {_numel(shape)} bytes; "
                                  f"the limit is {max_bytes}")
        return frame_codec.check_header(enc, shape)
    itemsize = torch.empty((), dtype=_DTYPES[enc.dtype]).element_size()
    # Every dimension counts, zero-sized ones as 1: an empty tensor whose other
    # dimensions multiply beyond the limit is refused too (torch would compute its
    # strides from them), before anything is allocated.
    span = _numel(max(s, 1) for s in shape)
    if span * itemsize > max_bytes:
        raise PayloadTooLarge(f"tensor {enc.name!r}: shape {shape} spans {span} elements "
                              f"({span * itemsize} bytes of {enc.dtype}); the limit is {max_bytes} bytes")
    numel = _numel(shape)
    expected = _payload_size(shape, enc.dtype, enc.codec)
    decoded = numel * itemsize
    if max(expected, decoded, len(enc.data)) > max_bytes:
        raise PayloadTooLarge(f"tensor {enc.name!r} needs {max(expected, decoded, len(enc.data))} "
                              f"bytes; the limit is {max_bytes}")
    if raw_size != expected:
        raise CodecError(f"tensor {enc.name!r}: raw_size {_short_int(raw_size)} does not match shape "
                         f"{shape} and {enc.dtype}/{enc.codec} ({expected} bytes)")
    if enc.compression == "none" and len(enc.data) != expected:
        raise CodecError(f"tensor {enc.name!r}: {len(enc.data)} bytes of data, shape {shape} and "
                         f"{enc.dtype}/{enc.codec} need {expected}")
    bits = quant_bits(enc.codec)
    if bits is not None:
        # per tensor the quantised value of 0.0; per channel unused (the offsets say it): 0
        zero_point_max = 0 if enc.codec in PER_CHANNEL_BITS else (1 << bits) - 1
        if not (math.isfinite(enc.scale) and enc.scale > 0) or not 0 <= enc.zero_point <= zero_point_max:
            raise CodecError(f"tensor {enc.name!r}: bad {enc.codec} parameters scale={float(enc.scale)} "
                             f"zero_point={_short_int(enc.zero_point)}")
    return decoded


def _short_int(n) -> str:
    """An integer for a message; one too long to print usefully (or at all: Python refuses
    to format ints of more than 4300 digits) is described instead."""
    n = operator.index(n)
    return str(n) if n.bit_length() <= 64 else f"<a {n.bit_length()}-bit integer>"


def _checked_shape(enc: EncodedTensor) -> List[int]:
    """``enc.shape`` as a list of ints, each in [0, MAX_DIM_SIZE], at most MAX_DIMS of them;
    CodecError otherwise (bools, negative, huge or non-integer sizes, too many dimensions,
    a shape that is not a list). Checked before anything multiplies the sizes."""
    raw = enc.shape
    if not isinstance(raw, (list, tuple)):
        raise CodecError(f"tensor {enc.name!r}: invalid shape: a {type(raw).__name__}, not a list of integers")
    if len(raw) > MAX_DIMS:
        raise CodecError(f"tensor {enc.name!r}: invalid shape: {len(raw)} dimensions; at most {MAX_DIMS}")
    shape = []
    for i, s in enumerate(raw):
        if isinstance(s, (bool, np.bool_)):
            raise CodecError(f"tensor {enc.name!r}: invalid shape: dimension {i} is a bool")
        try:
            size = operator.index(s)
        except TypeError:
            raise CodecError(f"tensor {enc.name!r}: invalid shape: dimension {i} is a "
                             f"{type(s).__name__}, not an integer") from None
        if not 0 <= size <= MAX_DIM_SIZE:
            raise CodecError(f"tensor {enc.name!r}: invalid shape: dimension {i} is {_short_int(size)}; "
                             f"sizes must be in [0, {MAX_DIM_SIZE}]")
        shape.append(size)
    return shape


def decode(enc: EncodedTensor, max_bytes: int = DEFAULT_MAX_BYTES, frames: bool = False) -> torch.Tensor:
    """Decode an :class:`EncodedTensor` into a new, writable CPU tensor.

    Raises :class:`CodecError` (with the reason) for anything inconsistent, and
    :class:`PayloadTooLarge` for payloads above ``max_bytes``. A camera frame's lossy
    codec (``jpeg``) is refused unless ``frames``."""
    check_header(enc, max_bytes)
    shape = _checked_shape(enc)
    if enc.codec in frame_codec.FRAME_CODECS:
        if not frames:
            raise CodecError(f"tensor {enc.name!r}: {enc.codec} is accepted for camera frames only")
        return frame_codec.decode(enc, shape)
    numel = _numel(shape)
    expected = _payload_size(shape, enc.dtype, enc.codec)
    payload = bytes(enc.data)
    if enc.compression in ("zstd", "bitshuffle_zstd"):
        try:
            payload = _zstd().ZstdDecompressor().decompress(payload, max_output_size=expected)
        except _zstd().ZstdError as e:
            raise CodecError(f"tensor {enc.name!r}: zstd data is corrupt: {e}") from e
    if len(payload) != expected:
        raise CodecError(f"tensor {enc.name!r}: {len(payload)} bytes of data, shape {shape} and "
                         f"{enc.dtype}/{enc.codec} need {expected}")
    if expected == 0:
        return torch.empty(shape, dtype=_DTYPES[enc.dtype])
    bits = INT_BITS.get(enc.codec)
    shuffled = enc.compression == "bitshuffle_zstd"
    if shuffled and not (bits is not None and bits < 8):    # sub-byte: unshuffled to values below
        header = _header_size(shape, enc.codec)
        payload = payload[:header] + _bitunshuffle(payload[header:], numel, _element_bits(enc.dtype, enc.codec))
    if enc.codec in PER_CHANNEL_BITS:
        return _decode_per_channel(enc, payload, shape)
    if bits is not None:
        if bits == 8:
            q = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        elif shuffled:
            q = torch.from_numpy(_unshuffle_values(payload, numel, bits))
        else:
            q = torch.from_numpy(_unpack_bits(payload, numel, bits))
        q = q.reshape(shape)
        return ((q.to(torch.float32) - enc.zero_point) * enc.scale).to(_DTYPES[enc.dtype])
    wire_dtype = torch.float16 if enc.codec == "float16" else _DTYPES[enc.dtype]
    t = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(wire_dtype).reshape(shape)
    if enc.codec == "float16":
        return t.to(_DTYPES[enc.dtype])
    return t


def tolerance(enc: EncodedTensor) -> float:
    """Largest absolute error decode(enc) can have against the encoded tensor, for
    ``torch.testing.assert_close(atol=...)``; relative-only codecs return 0 (see rtol)."""
    if quant_bits(enc.codec) is not None:
        # half a step, plus float32 rounding of values up to 255 steps large (a per-channel
        # codec's values are its offset plus up to 255 steps: see RTOL)
        return enc.scale * (0.5 + 1e-3)
    return 0.0


#: Relative tolerance of each codec (for assert_close's rtol): a per-channel codec's offset
#: need not be near 0, so float32 rounding of the value itself (2**-23, with margin) counts.
RTOL = {"raw": 0.0, "float16": 2.0 ** -11, **{c: 0.0 for c in INT_BITS},
        **{c: 2.0 ** -21 for c in PER_CHANNEL_BITS}}


class PayloadTooLarge(CodecError):
    """A tensor larger than the configured maximum; refused before any allocation."""


def _zstd():
    try:
        import zstandard
    except ImportError as e:  # pragma: no cover - installed by scripts/setup.sh
        raise CodecError("zstd compression needs the zstandard module (python3-zstandard)") from e
    return zstandard
