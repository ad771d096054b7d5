"""Model registry (see :mod:`robot_offload.models.registry`)."""

from robot_offload.models.registry import (  # noqa: F401
    ModelSpec, get_spec, names, register, weights_hash, preprocess_image)
