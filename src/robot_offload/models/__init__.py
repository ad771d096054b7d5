"""Model registry (see :mod:`robot_offload.models.registry`)."""

from robot_offload.models.registry import (  # noqa: F401
    MAX_FRAME_SIDE, ModelSpec, check_frame_shape, get_spec, names, register, weights_hash,
    preprocess_image, preprocess_image_tensor)
