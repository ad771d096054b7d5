"""The backend interface and the mode registry."""

import abc
from dataclasses import dataclass, field
from typing import Dict, Optional, Type

import torch

from robot_offload.errors import ConfigError
from robot_offload.link import ServerLink
from robot_offload.models import ModelSpec
from robot_offload.stats import FrameStats


@dataclass
class BackendContext:
    """What a backend may use: the model (already built on the robot), its registry spec,
    the link to the server (None when the client has no server) and the client config.

    ``shared`` is what the backends of one client learn about the model and keep for each
    other, by key (``layer_partition`` and ``lop``: the graph, the profiles, the drift
    factors and the measured choices, see
    :class:`~robot_offload.backends.layer_partition.PartitionKnowledge`), so that switching
    modes at run time neither measures the model again nor forgets what was measured."""

    spec: ModelSpec
    model: torch.nn.Module
    link: Optional[ServerLink]
    config: "object"
    shared: Dict[str, object] = field(default_factory=dict)


class Backend(abc.ABC):
    """Runs one inference. ``needs_server`` backends are skipped (local fallback) while the
    link is down; they raise TransportError / RemoteError on failure and never fall back
    themselves, so that fallback and its accounting live in one place (OffloadClient)."""

    name = ""
    needs_server = False

    def __init__(self, ctx: BackendContext):
        self.ctx = ctx

    @abc.abstractmethod
    def infer(self, x: torch.Tensor, stats: FrameStats, timeout_s: float):
        """Return the model's outputs for batched input ``x``, filling ``stats``."""

    def close(self) -> None:
        """Release server-side state; called when the client stops using this backend."""


_BACKENDS: Dict[str, Type[Backend]] = {}


def register_backend(cls: Type[Backend]) -> Type[Backend]:
    _BACKENDS[cls.name] = cls
    return cls


def modes() -> list:
    return sorted(_BACKENDS)


def make_backend(mode: str, ctx: BackendContext) -> Backend:
    try:
        cls = _BACKENDS[mode]
    except KeyError:
        raise ConfigError(f"unknown mode {mode!r}; known: {', '.join(modes())}") from None
    if cls.needs_server and ctx.link is None:
        raise ConfigError(f"mode {mode!r} needs an offload server and none is configured")
    return cls(ctx)
