"""Camera frames as JPEG: the lossy way to send a frame, for ``full_offload`` of the camera
image on a slow link (``~input_jpeg_quality``; off by default).

A frame sent so reaches the model changed: its outputs differ from ``local``'s by what
JPEG loses, and the frame's stats say so (``plan`` ``input=frame jpeg q90``,
``detail_json`` ``lossy_input``). Nothing else in the package sends or accepts it: the
server decodes JPEG only in its ``forward_image`` entry, and clients never decode it.

On the wire, an :class:`~robot_offload.codec.EncodedTensor` with ``codec`` ``jpeg``,
``dtype`` ``uint8``, ``shape`` ``[H, W, 3]`` (colour) or ``[H, W]`` (grey),
``compression`` ``none``, ``raw_size`` the decoded size (H x W x C bytes), ``scale`` the
quality it was encoded at (for the record only) and ``data`` a baseline JPEG stream.
The encoder sends one only when it is smaller than the frame.

Decoding trusts nothing: the stream must be smaller than the decoded frame and begin with
a JPEG start-of-image marker; Pillow then reads its header alone, with its JPEG reader
alone (no other format is tried), and the declared size, colour mode and coding (baseline,
one image: progressive streams, whose decoding time a crafted file can multiply, and
multi-picture files are refused) must match the tensor's header before a pixel is decoded;
a truncated or corrupt stream is refused rather than padded.
"""

import io
import math
from typing import List

import numpy as np
import torch

from robot_offload.errors import CodecError

JPEG = "jpeg"
#: Codecs of camera frames (lossy; decoded only where a caller asks for frames).
FRAME_CODECS = (JPEG,)
#: Qualities the client may ask for (Pillow's useful range; above 95 the stream grows with
#: little gain).
MIN_QUALITY, MAX_QUALITY = 1, 95
_SOI = b"\xff\xd8\xff"
_MODES = {2: "L", 3: "RGB"}


def _pil():
    try:
        from PIL import Image
    except ImportError as e:  # pragma: no cover - Pillow comes with torchvision and Debian's python3-pil
        raise CodecError("JPEG frames need Pillow (python3-pil)") from e
    return Image


def check_quality(quality) -> int:
    q = int(quality)
    if isinstance(quality, bool) or q != quality or not MIN_QUALITY <= q <= MAX_QUALITY:
        raise CodecError(f"a JPEG quality must be an integer in {MIN_QUALITY}..{MAX_QUALITY}, got {quality!r}")
    return q


def encodable(frame) -> bool:
    """Whether ``frame`` can go as JPEG: a uint8 H x W, H x W x 3 or H x W x 4 image (the
    fourth channel is dropped, as preprocessing drops it)."""
    return (isinstance(frame, np.ndarray) and frame.dtype == np.uint8
            and (frame.ndim == 2 or (frame.ndim == 3 and frame.shape[2] in (3, 4)))
            and min(frame.shape[:2]) > 0)


def encode(frame: np.ndarray, name: str, quality: int):
    """``frame`` as a JPEG :class:`~robot_offload.codec.EncodedTensor`, or None when the
    stream would not be smaller than the frame's bytes (noise, tiny frames)."""
    from robot_offload.codec import EncodedTensor
    quality = check_quality(quality)
    if not encodable(frame):
        raise CodecError(f"only a uint8 H x W (x 3 or 4) image can go as JPEG, got "
                         f"{getattr(frame, 'dtype', type(frame).__name__)} {getattr(frame, 'shape', '')}")
    if frame.ndim == 3:
        frame = frame[:, :, :3]
    frame = np.ascontiguousarray(frame)
    buf = io.BytesIO()
    _pil().fromarray(frame, _MODES[frame.ndim]).save(buf, format="JPEG", quality=quality,
                                                      progressive=False, optimize=False)
    data = buf.getvalue()
    if len(data) >= frame.nbytes:
        return None
    return EncodedTensor(name=name, dtype="uint8", shape=[int(s) for s in frame.shape], codec=JPEG,
                         compression="none", scale=float(quality), zero_point=0,
                         raw_size=int(frame.nbytes), data=data)


def check_header(enc, shape: List[int]) -> int:
    """What can be checked without reading the stream; returns the decoded size (bytes).
    ``shape`` is the header's, already checked to be a list of sane sizes."""
    if enc.dtype != "uint8":
        raise CodecError(f"tensor {enc.name!r}: a {JPEG} frame is uint8, got {enc.dtype[:20]}")
    if not (len(shape) == 2 or (len(shape) == 3 and shape[2] == 3)) or 0 in shape:
        raise CodecError(f"tensor {enc.name!r}: a {JPEG} frame is [H, W, 3] or [H, W], got {shape}")
    if enc.compression != "none":
        raise CodecError(f"tensor {enc.name!r}: a {JPEG} frame is not compressed again, got {enc.compression[:20]}")
    decoded = math.prod(shape)     # Python ints: no overflow whatever the header says
    if enc.raw_size != decoded:
        raise CodecError(f"tensor {enc.name!r}: raw_size must be the frame's {decoded} bytes")
    if not 0 < len(enc.data) < decoded:
        raise CodecError(f"tensor {enc.name!r}: a {JPEG} stream of {len(enc.data)} bytes for a frame of "
                         f"{decoded}; it must be smaller")
    return decoded


def decode(enc, shape: List[int]) -> torch.Tensor:
    """The frame, a new uint8 tensor of ``shape``; :func:`check_header` passed."""
    data = bytes(enc.data)
    if not data.startswith(_SOI):
        raise CodecError(f"tensor {enc.name!r}: not a JPEG stream")
    image = _pil()
    try:
        try:
            img = image.open(io.BytesIO(data), formats=["JPEG"])
        except TypeError:       # Pillow before 8.0 (Ubuntu 20.04's 7.0): only JPEG's reader
            img = image.open(io.BytesIO(data))    # accepts a stream starting with the marker
    except Exception as e:      # Pillow raises UnidentifiedImageError, SyntaxError, OSError...
        raise CodecError(f"tensor {enc.name!r}: unreadable JPEG header: {str(e)[:200]}") from None
    try:
        mode = _MODES[len(shape)]
        want = (shape[1], shape[0])
        if img.format != "JPEG" or img.mode != mode or img.size != want:
            raise CodecError(f"tensor {enc.name!r}: the stream is a {img.format} {img.mode} image of "
                             f"{img.size[0]} x {img.size[1]}; the header says {mode} {want[0]} x {want[1]}")
        if img.info.get("progressive") or img.info.get("progression") or getattr(img, "n_frames", 1) != 1:
            raise CodecError(f"tensor {enc.name!r}: only baseline single-image JPEG is accepted")
        try:
            img.load()
        except Exception as e:  # truncated, corrupt
            raise CodecError(f"tensor {enc.name!r}: corrupt JPEG stream: {str(e)[:200]}") from None
        array = np.asarray(img)
    finally:
        img.close()
    if array.dtype != np.uint8 or list(array.shape) != list(shape):
        raise CodecError(f"tensor {enc.name!r}: the JPEG decoded to {array.dtype} {list(array.shape)}, not {shape}")
    return torch.from_numpy(array.copy())

