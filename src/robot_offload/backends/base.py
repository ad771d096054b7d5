"""The backend interface and the mode registry."""

import abc
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional, Tuple, Type

import torch

from robot_offload.energy import modelled_energy_j
from robot_offload.errors import ConfigError
from robot_offload.link import ServerLink
from robot_offload.local_hedge import LocalHedge
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
    #: with one server: when a late full offload is hedged by the robot (None: never)
    local_hedge: Optional[LocalHedge] = None
    #: the robot's hedge of calls bound to the home server (``lop``'s pairs): with one
    #: server ``local_hedge`` itself; with several, where the pool hedges every other call
    home_hedge: Optional[LocalHedge] = None
    #: the client's joules over ``(stats, t0, t1)`` of a frame (see :meth:`frame_energy_j`)
    energy_j: Optional[Callable[[FrameStats, float, float], float]] = None
    # the last frame preprocessed: (frame, its FrameStats, the model input)
    _last: Optional[tuple] = field(default=None, repr=False, compare=False)
    _last_lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    @property
    def input_size(self) -> Tuple[int, ...]:
        """The model input size: the client's ``input_size``, else the registry's."""
        return tuple(self.config.input_size) or self.spec.input_size

    def frame_energy_j(self, stats: FrameStats, t0: float, t1: float) -> float:
        """The robot's joules from ``t0`` to ``t1`` (:func:`time.perf_counter`) of the frame
        of ``stats``: the client's (a power sensor's where its samples cover the span),
        else the state model's over the frame's intervals."""
        if self.energy_j is not None:
            return self.energy_j(stats, t0, t1)
        return self.modelled_energy_j(stats, t0, t1)

    def modelled_energy_j(self, stats: FrameStats, t0: float, t1: float) -> float:
        """The state model's joules from ``t0`` to ``t1`` over the intervals of ``stats``,
        at the client's ``compute_w``, ``transmit_w`` and ``idle_w``."""
        c = self.config
        return modelled_energy_j(stats.intervals, t0, t1, c.compute_w, c.transmit_w, c.idle_w)

    def preprocess(self, frame, stats: FrameStats) -> torch.Tensor:
        """The model input for one raw frame, computed on the robot and accounted in
        ``stats``. Within one frame it is computed once: a backend that preprocessed the
        frame and then failed leaves it for the local fallback (:meth:`forget` ends the
        frame)."""
        with self._last_lock:
            last = self._last
        if last is not None and last[0] is frame and last[1] is stats:
            return last[2]
        t0 = time.perf_counter()
        x = self.spec.preprocess(frame, self.input_size)
        stats.add_compute(t0, time.perf_counter())
        with self._last_lock:
            self._last = (frame, stats, x)
        return x

    def forget(self, frame) -> None:
        """Drop what :meth:`preprocess` kept of ``frame`` (the frame is done; its buffer
        may be filled with the next one)."""
        with self._last_lock:
            if self._last is not None and self._last[0] is frame:
                self._last = None


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

    def infer_frame(self, frame, stats: FrameStats, timeout_s: float):
        """Return the model's outputs for one raw frame (a uint8 H x W x 3 image, or a
        point cloud for point-cloud models), filling ``stats``. By default the frame is
        preprocessed here on the robot (accounted as compute) and run by :meth:`infer`;
        a backend that can send the frame itself overrides it."""
        x = self.ctx.preprocess(frame, stats)
        return self.infer(x, stats, timeout_s)

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
