"""Inference backends (the client's modes) and their registry.

Importing this package registers the backends that exist; an unknown mode is refused
with the list of known ones."""

from robot_offload.backends.base import (  # noqa: F401
    Backend, BackendContext, make_backend, modes, register_backend)
from robot_offload.backends import local, full_offload, layer_partition, lop, transparent, auto  # noqa: F401,E402
