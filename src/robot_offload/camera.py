"""Frame sources for camera_node: a synthetic moving pattern (the default, so the demo
needs no hardware), natural-statistics noise (``natural``: what compression sees in a
photograph, not in a flat pattern), a folder of images, a video file or a V4L2 device.
All return RGB uint8 H x W x 3 arrays; ``read()`` returns None at the end of a non-looping source."""

import dataclasses
import glob
import math
import os
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from robot_offload import checks
from robot_offload.errors import ConfigError

_IMAGE_EXTS = (".png", ".jpg", ".jpeg", ".bmp", ".ppm", ".pgm")


class SyntheticSource:
    """Moving coloured squares over a shifting gradient: deterministic per frame index,
    so two runs (or two modes in a benchmark) see the same frames."""

    def __init__(self, width: int = 640, height: int = 480, seed: int = 0):
        if width <= 0 or height <= 0:
            raise ConfigError(f"synthetic size must be positive, got {width}x{height}")
        self.width, self.height = width, height
        rng = np.random.default_rng(seed)
        self._squares = [(rng.integers(0, 256, 3).astype(np.uint8), rng.uniform(0.05, 0.2),
                          rng.uniform(0, 2 * np.pi, 2), rng.uniform(0.02, 0.08, 2)) for _ in range(5)]
        yy, xx = np.mgrid[0:height, 0:width]
        self._base = ((xx * 255 // max(width - 1, 1)).astype(np.uint8),
                      (yy * 255 // max(height - 1, 1)).astype(np.uint8))
        self.index = 0
        self._rects = []

    def read(self) -> np.ndarray:
        i = self.index
        self.index += 1
        gx, gy = self._base
        img = np.stack([gx + np.uint8(i % 256), gy, np.full_like(gx, (i * 3) % 256)], axis=2)
        self._rects = []
        for color, size, phase, speed in self._squares:
            s = int(size * min(self.width, self.height))
            cx = int((0.5 + 0.4 * np.sin(phase[0] + speed[0] * i)) * (self.width - s))
            cy = int((0.5 + 0.4 * np.sin(phase[1] + speed[1] * i)) * (self.height - s))
            img[cy:cy + s, cx:cx + s] = color
            self._rects.append((cx, cy, s))
        return img

    def depth_m(self, background_m: float = 3.0, objects_m: float = 2.0) -> np.ndarray:
        """A float32 depth image (m, REP 118) registered to the last frame: a wall at
        ``background_m`` with the squares at ``objects_m``."""
        depth = np.full((self.height, self.width), background_m, dtype=np.float32)
        for cx, cy, s in self._rects:
            depth[cy:cy + s, cx:cx + s] = objects_m
        return depth

    def close(self):
        pass


def natural_image(height: int, width: int, seed: int = 0, sensor_noise_dn: float = 2.0) -> np.ndarray:
    """A uint8 H x W x 3 image with the statistics that matter to a codec, where neither
    uniform noise (incompressible) nor :class:`SyntheticSource` (flat squares: zstd takes
    it 100x or more) is a fair stand-in for a camera frame: an amplitude spectrum falling
    as 1/f (natural images' power law), colour channels sharing most of their structure
    (a luminance field plus two weaker chroma fields), and Gaussian sensor noise of
    ``sensor_noise_dn`` digital numbers before quantisation. Deterministic per seed."""
    if height <= 0 or width <= 0:
        raise ConfigError(f"image size must be positive, got {width}x{height}")
    rng = np.random.default_rng(seed)
    fy = np.fft.fftfreq(height)[:, None]
    fx = np.fft.rfftfreq(width)[None, :]
    f = np.hypot(fx, fy)
    f[0, 0] = np.inf                      # no DC term: each field has mean 0

    def field():
        phase = rng.uniform(0.0, 2 * np.pi, f.shape)
        x = np.fft.irfft2(np.exp(1j * phase) / f, s=(height, width))
        return x / max(float(x.std()), 1e-12)

    lum, c1, c2 = field(), field(), field()
    rgb = np.stack([lum + 0.35 * c1, lum - 0.2 * c1 + 0.2 * c2, lum - 0.35 * c2], axis=2)
    img = 118.0 + 48.0 * rgb + rng.normal(0.0, sensor_noise_dn, rgb.shape)
    return np.clip(np.rint(img), 0, 255).astype(np.uint8)


class NaturalSource:
    """:func:`natural_image` frames, a new one per index (seed + index): deterministic, so
    two runs or two modes see the same frames."""

    def __init__(self, width: int = 640, height: int = 480, seed: int = 0):
        if width <= 0 or height <= 0:
            raise ConfigError(f"natural size must be positive, got {width}x{height}")
        self.width, self.height, self.seed = width, height, seed
        self.index = 0

    def read(self) -> np.ndarray:
        self.index += 1
        return natural_image(self.height, self.width, self.seed + self.index - 1)

    def close(self):
        pass


class FolderSource:
    """Images of a folder in name order, looping by default."""

    def __init__(self, path: str, loop: bool = True):
        self.files = sorted(f for f in glob.glob(os.path.join(path, "*"))
                            if f.lower().endswith(_IMAGE_EXTS))
        if not self.files:
            raise ConfigError(f"no images ({', '.join(_IMAGE_EXTS)}) in {path!r}")
        self.loop, self.index = loop, 0

    def read(self) -> Optional[np.ndarray]:
        import cv2
        if self.index >= len(self.files):
            if not self.loop:
                return None
            self.index = 0
        path = self.files[self.index]
        self.index += 1
        bgr = cv2.imread(path, cv2.IMREAD_COLOR)
        if bgr is None:
            raise ConfigError(f"cannot read image {path!r}")
        return bgr[:, :, ::-1].copy()

    def close(self):
        pass


class VideoSource:
    """A video file or a V4L2 device (``/dev/videoN`` or an index) through OpenCV."""

    def __init__(self, uri: str, loop: bool = True, width: int = 0, height: int = 0):
        import cv2
        self.uri, self.loop = uri, loop
        target = int(uri) if uri.isdigit() else uri
        self.cap = cv2.VideoCapture(target)
        if width and height:
            self.cap.set(cv2.CAP_PROP_FRAME_WIDTH, width)
            self.cap.set(cv2.CAP_PROP_FRAME_HEIGHT, height)
        if not self.cap.isOpened():
            raise ConfigError(f"cannot open video source {uri!r}")
        self.is_file = os.path.isfile(uri)

    def read(self) -> Optional[np.ndarray]:
        ok, bgr = self.cap.read()
        if not ok and self.is_file and self.loop:
            import cv2
            self.cap.set(cv2.CAP_PROP_POS_FRAMES, 0)
            ok, bgr = self.cap.read()
        if not ok:
            return None
        return bgr[:, :, ::-1].copy()

    def close(self):
        self.cap.release()


def pinhole_k(width: int, height: int, hfov_deg: float) -> list:
    """Row-major 3x3 camera matrix of an ideal pinhole with a horizontal field of view."""
    f = width / (2.0 * math.tan(math.radians(hfov_deg) / 2.0))
    return [f, 0.0, (width - 1) / 2.0, 0.0, f, (height - 1) / 2.0, 0.0, 0.0, 1.0]


def open_source(source: str, width: int = 640, height: int = 480, loop: bool = True, seed: int = 0):
    """``synthetic``, ``natural``, a folder of images, a video file, ``/dev/videoN`` or a
    device index."""
    if source in ("", "synthetic"):
        return SyntheticSource(width, height, seed)
    if source == "natural":
        return NaturalSource(width, height, seed)
    if os.path.isdir(source):
        return FolderSource(source, loop)
    if source.startswith("/dev/video") or source.isdigit() or os.path.isfile(source):
        return VideoSource(source, loop, width, height)
    raise ConfigError(f"unknown camera source {source!r}: use synthetic, natural, a folder, a video file "
                      f"or /dev/videoN")


@dataclass
class CameraConfig:
    """Settings of camera_node (its ``~`` parameters)."""

    source: str = "synthetic"       # see open_source
    rate_hz: float = 10.0           # publishing rate (Hz)
    frame_id: str = "camera"        # header.frame_id of the images
    width: int = 640                # synthetic / requested capture size (px)
    height: int = 480
    loop: bool = True               # restart a folder or video at its end
    seed: int = 0                   # synthetic pattern
    camera_matrix: Sequence[float] = ()   # row-major K of camera_info; () = pinhole_k(hfov_deg)
    hfov_deg: float = 69.4          # horizontal field of view of the ideal pinhole (deg)
    publish_depth: bool = False     # synthetic source only: a registered depth image

    def validate(self) -> "CameraConfig":
        source = self.source
        if isinstance(source, int) and not isinstance(source, bool) and source >= 0:
            source = str(source)    # a device index given as a number (source:=0)
        k = self.camera_matrix
        if isinstance(k, str) or not isinstance(k, (list, tuple)) or len(k) not in (0, 9):
            raise ConfigError(f"camera_matrix must be [] or 9 numbers (row-major K), got {k!r}")
        k = tuple(checks.number(f"camera_matrix[{i}]", v) for i, v in enumerate(k))
        frame_id = checks.text("frame_id", self.frame_id, empty=False)
        if frame_id.startswith("/") or any(c.isspace() for c in frame_id):
            raise ConfigError(f"frame_id must be a TF frame id (no leading '/'), got {frame_id!r}")
        return dataclasses.replace(
            self, source=checks.text("source", source),
            rate_hz=checks.number("rate_hz", self.rate_hz, 0.0, 1000.0, low_open=True),
            width=checks.integer("width", self.width, 1, 16384),
            height=checks.integer("height", self.height, 1, 16384),
            loop=checks.flag("loop", self.loop), seed=checks.integer("seed", self.seed, 0, 2 ** 32 - 1),
            camera_matrix=k, hfov_deg=checks.number("hfov_deg", self.hfov_deg, 0.0, 179.0, low_open=True),
            publish_depth=checks.flag("publish_depth", self.publish_depth))
