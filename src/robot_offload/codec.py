"""Tensor codec: torch tensors to bytes and back, with optional lossy precision and zstd.

Wire format (one :class:`EncodedTensor`, mirrored by ``msg/Tensor.msg``):

* ``raw``     -- the tensor's own dtype, little endian. Lossless.
* ``float16`` -- floating tensors sent as IEEE half and decoded back to their dtype.
  Relative error <= 2**-11; values beyond +-65504 are refused rather than sent as inf.
* ``int8``    -- per-tensor affine uint8 with an input-specific scale (DynO): the range is
  taken from this tensor, widened to include 0 so that zeros (ReLU outputs) stay exact.
  Absolute error <= scale / 2 (see :func:`tolerance`).

Any codec may be followed by ``zstd`` compression. Decoding trusts nothing: codec, dtype,
shape, sizes and quantisation parameters are checked against each other and against a
maximum payload size before a byte is interpreted, and the bytes are only ever read with
``torch.frombuffer`` -- nothing is unpickled or executed.
"""

import math
from dataclasses import dataclass, field
from typing import List, Sequence

import torch

from robot_offload.errors import CodecError

CODECS = ("raw", "float16", "int8")
COMPRESSIONS = ("none", "zstd")
#: Largest decoded payload accepted by default (bytes). Servers and clients configure theirs.
DEFAULT_MAX_BYTES = 128 * 1024 * 1024
MAX_DIMS = 16

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


def _itemsize(dtype: str, codec: str) -> int:
    if codec == "float16":
        return 2
    if codec == "int8":
        return 1
    return torch.empty((), dtype=_DTYPES[dtype]).element_size()


def _to_bytes(t: torch.Tensor) -> bytes:
    if t.numel() == 0:
        return b""
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


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
    elif codec == "int8":
        tf = t.to(torch.float32)
        if t.numel() and not bool(torch.isfinite(tf).all()):
            raise CodecError(f"tensor {name!r} has non-finite values; int8 cannot encode them")
        lo = min(float(tf.min()), 0.0) if t.numel() else 0.0
        hi = max(float(tf.max()), 0.0) if t.numel() else 0.0
        scale = (hi - lo) / 255.0 if hi > lo else 1.0
        zero_point = int(min(255, max(0, round(-lo / scale))))
        q = torch.clamp(torch.round(tf / scale) + zero_point, 0, 255).to(torch.uint8)
        payload = _to_bytes(q)
    else:
        payload = _to_bytes(t)
    raw_size = len(payload)
    if compression == "zstd":
        payload = _zstd().ZstdCompressor(level=zstd_level).compress(payload)
    return EncodedTensor(name=name, dtype=dtype, shape=[int(s) for s in t.shape], codec=codec,
                         compression=compression, scale=float(scale), zero_point=zero_point,
                         raw_size=raw_size, data=payload)


def decode(enc: EncodedTensor, max_bytes: int = DEFAULT_MAX_BYTES) -> torch.Tensor:
    """Decode an :class:`EncodedTensor` into a new, writable CPU tensor.

    Raises :class:`CodecError` (with the reason) for anything inconsistent, and
    :class:`PayloadTooLarge` for payloads above ``max_bytes``."""
    if enc.codec not in CODECS:
        raise CodecError(f"unknown codec {enc.codec!r}; known: {list(CODECS)}")
    if enc.compression not in COMPRESSIONS:
        raise CodecError(f"unknown compression {enc.compression!r}; known: {list(COMPRESSIONS)}")
    if enc.dtype not in _DTYPES:
        raise CodecError(f"unknown dtype {enc.dtype!r}; known: {sorted(_DTYPES)}")
    if enc.codec != "raw" and enc.dtype not in _FLOATING:
        raise CodecError(f"codec {enc.codec} needs a floating dtype, got {enc.dtype}")
    shape = list(enc.shape)
    if len(shape) > MAX_DIMS or any(int(s) < 0 for s in shape):
        raise CodecError(f"invalid shape {shape}")
    expected = _numel(shape) * _itemsize(enc.dtype, enc.codec)
    if expected > max_bytes or len(enc.data) > max_bytes:
        raise PayloadTooLarge(
            f"tensor {enc.name!r} needs {max(expected, len(enc.data))} bytes; the limit is {max_bytes}")
    if enc.raw_size != expected:
        raise CodecError(f"tensor {enc.name!r}: raw_size {enc.raw_size} does not match shape "
                         f"{shape} and {enc.dtype}/{enc.codec} ({expected} bytes)")
    payload = bytes(enc.data)
    if enc.compression == "zstd":
        try:
            payload = _zstd().ZstdDecompressor().decompress(payload, max_output_size=expected)
        except _zstd().ZstdError as e:
            raise CodecError(f"tensor {enc.name!r}: zstd data is corrupt: {e}") from e
    if len(payload) != expected:
        raise CodecError(f"tensor {enc.name!r}: {len(payload)} bytes of data, shape {shape} and "
                         f"{enc.dtype}/{enc.codec} need {expected}")
    if enc.codec == "int8":
        if not (math.isfinite(enc.scale) and enc.scale > 0) or not 0 <= enc.zero_point <= 255:
            raise CodecError(f"tensor {enc.name!r}: bad int8 parameters scale={enc.scale} "
                             f"zero_point={enc.zero_point}")
    wire_dtype = {"float16": torch.float16, "int8": torch.uint8}.get(enc.codec, _DTYPES[enc.dtype])
    if expected == 0:
        return torch.empty(shape, dtype=_DTYPES[enc.dtype])
    t = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(wire_dtype).reshape(shape)
    if enc.codec == "int8":
        return ((t.to(torch.float32) - enc.zero_point) * enc.scale).to(_DTYPES[enc.dtype])
    if enc.codec == "float16":
        return t.to(_DTYPES[enc.dtype])
    return t


def tolerance(enc: EncodedTensor) -> float:
    """Largest absolute error decode(enc) can have against the encoded tensor, for
    ``torch.testing.assert_close(atol=...)``; relative-only codecs return 0 (see rtol)."""
    if enc.codec == "int8":
        # half a step, plus float32 rounding of values up to 255 steps large
        return enc.scale * (0.5 + 1e-3)
    return 0.0


#: Relative tolerance of each codec (for assert_close's rtol).
RTOL = {"raw": 0.0, "float16": 2.0 ** -11, "int8": 0.0}


class PayloadTooLarge(CodecError):
    """A tensor larger than the configured maximum; refused before any allocation."""


def _zstd():
    try:
        import zstandard
    except ImportError as e:  # pragma: no cover - installed by scripts/setup.sh
        raise CodecError("zstd compression needs the zstandard module (python3-zstandard)") from e
    return zstandard
