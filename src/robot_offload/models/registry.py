"""Model registry: a name to a constructor, its preprocessing and a weights hash.

Both the robot and the server build models from this registry, so only a name and a hash
cross the network, never code or weights. Weights are random (seeded per name, identical
on every machine) unless a weights file is given; timings are real, labels meaningless.

    spec = get_spec("resnet101")
    model = spec.build()                      # eval mode, CPU
    x = spec.preprocess(image_hwc_uint8)      # 1 x 3 x H x W float32
"""

import hashlib
import threading
import zlib
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import nn

from robot_offload.codec import byte_view
from robot_offload.errors import ConfigError, UnknownModelError

#: held while a model's seeded weights are drawn (ModelSpec.build)
_BUILD_LOCK = threading.Lock()

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@dataclass(frozen=True)
class ModelSpec:
    """What a registry entry knows about a model.

    ``input_kind`` is ``image`` (uint8 H x W x 3 RGB in, resized to ``input_size`` = (H, W)
    and normalised with ``mean``/``std``) or ``pointcloud`` (N x 3+ float32 points in,
    voxelised to ``input_size`` = (X, Y, Z) voxels). ``test_input_size`` is a small size at
    which the model still runs, for unit tests.
    """

    name: str
    task: str
    input_kind: str
    input_size: Tuple[int, ...]
    test_input_size: Tuple[int, ...]
    constructor: Callable[[], nn.Module] = field(repr=False)
    mean: Tuple[float, ...] = IMAGENET_MEAN
    std: Tuple[float, ...] = IMAGENET_STD
    description: str = ""

    @property
    def seed(self) -> int:
        """Seed of the random weights: fixed per name, the same on every machine."""
        return zlib.crc32(self.name.encode())

    def build(self, weights_path: Optional[str] = None) -> nn.Module:
        """Construct the model in eval mode on the CPU, with seeded random weights or the
        weights from ``weights_path`` (a state dict file on this machine).

        The constructors draw from torch's one global generator, so builds take turns
        (:data:`_BUILD_LOCK`): two built at once in two threads (a server loading models
        for two clients, a client reaching two servers) would interleave their draws and
        get other weights than the same build alone, and a weights hash mismatch."""
        with _BUILD_LOCK, torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            model = self.constructor()
        if weights_path:
            from robot_offload.models.weights import load_state_dict_file
            model.load_state_dict(load_state_dict_file(weights_path))
        return model.eval()

    def preprocess(self, data: np.ndarray, input_size: Optional[Sequence[int]] = None) -> torch.Tensor:
        """Turn one raw frame into the batched model input (robot side)."""
        size = tuple(input_size or self.input_size)
        if self.input_kind == "image":
            return preprocess_image(data, size, self.mean, self.std)
        from robot_offload.models.agrnav import voxelize
        return voxelize(data, grid=size)

    def input_size_of(self, x: torch.Tensor) -> Tuple[int, ...]:
        """The ``input_size`` that :meth:`preprocess` makes ``x`` at: (H, W) of an
        ``N x 3 x H x W`` image, (X, Y, Z) of an ``N x 1 x X x Z x Y`` voxel grid."""
        if self.input_kind == "image":
            return tuple(int(s) for s in x.shape[2:])
        return int(x.shape[2]), int(x.shape[4]), int(x.shape[3])

    def example_input(self, input_size: Optional[Sequence[int]] = None, seed: int = 0) -> torch.Tensor:
        """A deterministic synthetic input at ``input_size`` (default: the model's)."""
        size = tuple(input_size or self.input_size)
        rng = np.random.default_rng(seed)
        if self.input_kind == "image":
            return self.preprocess(rng.integers(0, 256, (size[0], size[1], 3), dtype=np.uint8), size)
        from robot_offload.models.agrnav import synthetic_scene
        return self.preprocess(synthetic_scene(seed), size)


#: Largest height or width of a camera frame the server preprocesses, and of a model input
#: size it resizes to (px); a full_offload client sends larger frames preprocessed.
MAX_FRAME_SIDE = 4096


def preprocess_image(image: np.ndarray, size: Sequence[int], mean: Sequence[float],
                     std: Sequence[float]) -> torch.Tensor:
    """uint8 H x W x 3 (RGB) -> float32 1 x 3 x size[0] x size[1], scaled to 0..1,
    bilinearly resized and normalised. Grey images are repeated to three channels, a
    fourth channel is dropped (:func:`preprocess_image_tensor`, which the server runs on
    frames it receives: one function on both sides)."""
    if not isinstance(image, np.ndarray) or image.dtype != np.uint8:
        raise ConfigError("an image must be a uint8 numpy array")
    check_frame_shape(image.shape)
    return preprocess_image_tensor(torch.from_numpy(np.ascontiguousarray(image)), size, mean, std)


def check_frame_shape(shape: Sequence[int]) -> None:
    """Raise ConfigError unless ``shape`` is an image's: H x W (grey), H x W x 3 or
    H x W x 4, none of them 0."""
    shape = tuple(shape)
    if len(shape) not in (2, 3) or (len(shape) == 3 and shape[2] not in (3, 4)) or 0 in shape:
        raise ConfigError(f"an image must be H x W x 3 (or H x W grey, H x W x 4), got {shape}")


def preprocess_image_tensor(image: torch.Tensor, size: Sequence[int], mean: Sequence[float],
                            std: Sequence[float]) -> torch.Tensor:
    """:func:`preprocess_image` of a uint8 tensor (H x W, H x W x 3 or H x W x 4), on the
    tensor's device; torch only. The robot's preprocessing and the server's
    ``forward_image`` entry both end here, so a frame preprocessed on either side gives
    the same model input (bit for bit on the same device)."""
    if not isinstance(image, torch.Tensor) or image.dtype != torch.uint8:
        raise ConfigError("an image must be a uint8 tensor")
    check_frame_shape(image.shape)
    if image.dim() == 2:
        image = image.unsqueeze(2).expand(-1, -1, 3)
    image = image[:, :, :3].contiguous()
    x = image.permute(2, 0, 1)[None].float() / 255.0
    if tuple(x.shape[2:]) != tuple(size):
        x = nn.functional.interpolate(x, size=tuple(size), mode="bilinear", align_corners=False)
    m = torch.tensor(mean, dtype=torch.float32, device=x.device).view(1, 3, 1, 1)
    s = torch.tensor(std, dtype=torch.float32, device=x.device).view(1, 3, 1, 1)
    return ((x - m) / s).contiguous()


_REGISTRY: Dict[str, ModelSpec] = {}


def register(spec: ModelSpec) -> ModelSpec:
    if spec.name in _REGISTRY:
        raise ConfigError(f"model {spec.name!r} is registered twice")
    _REGISTRY[spec.name] = spec
    return spec


def names() -> list:
    """Registered model names, sorted."""
    _ensure_loaded()
    return sorted(_REGISTRY)


def get_spec(name: str) -> ModelSpec:
    """The :class:`ModelSpec` for ``name``; :class:`UnknownModelError` lists the known ones."""
    _ensure_loaded()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UnknownModelError(f"unknown model {name!r}; known: {', '.join(sorted(_REGISTRY))}") from None


def weights_hash(model: nn.Module) -> str:
    """sha256 over the state dict (names, dtypes, shapes and bytes, in order): equal hashes
    mean the two sides compute the same function."""
    h = hashlib.sha256()
    for key, value in model.state_dict().items():
        t = value.detach().to("cpu")
        h.update(f"{key}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(byte_view(t))
    return h.hexdigest()


def _ensure_loaded():
    if not _REGISTRY:
        from robot_offload.models import zoo  # noqa: F401  (registers the entries)
