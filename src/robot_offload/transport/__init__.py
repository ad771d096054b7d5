"""Transports carry :mod:`robot_offload.protocol` requests to a server and back."""

from robot_offload.transport.base import Transport  # noqa: F401
