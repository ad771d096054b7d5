"""Value checks for the config dataclasses' ``validate()``: each returns the value in its
field's type or raises :class:`ConfigError` naming the parameter, so a bad launch file
fails at start with the parameter's name, not somewhere later with a type error."""

import math
from typing import Optional

from robot_offload.errors import ConfigError


def number(name: str, value, low: Optional[float] = None, high: Optional[float] = None,
           low_open: bool = False) -> float:
    """A finite float in ``[low, high]`` (``(low, high]`` with ``low_open``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{name} must be a finite number, got {value!r}")
    if low is not None and (value <= low if low_open else value < low):
        raise ConfigError(f"{name} must be {'>' if low_open else '>='} {low}, got {value!r}")
    if high is not None and value > high:
        raise ConfigError(f"{name} must be <= {high}, got {value!r}")
    return float(value)


def integer(name: str, value, low: Optional[int] = None, high: Optional[int] = None) -> int:
    """An int in ``[low, high]`` (a float with an integer value is accepted)."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    if (low is not None and value < low) or (high is not None and value > high):
        raise ConfigError(f"{name} must be in {low if low is not None else '-inf'}.."
                          f"{high if high is not None else 'inf'}, got {value!r}")
    return value


def flag(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be true or false, got {value!r}")
    return value


def text(name: str, value, empty: bool = True) -> str:
    """A string without control characters (``""`` only with ``empty``)."""
    if not isinstance(value, str) or any(ord(c) < 32 for c in value) or (not empty and not value):
        raise ConfigError(f"{name} must be a{'' if empty else ' non-empty'} string, got {value!r}")
    return value


def ros_namespace(name: str, value) -> str:
    """A ROS graph name such as ``/offload_server``: no whitespace, not empty."""
    text(name, value, empty=False)
    if any(c.isspace() for c in value) or not all(c.isalnum() or c in "/_~" for c in value):
        raise ConfigError(f"{name} must be a ROS name such as /offload_server, got {value!r}")
    return value
