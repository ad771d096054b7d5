"""The offload client's logic, independent of ROS: pick the backend for the current mode,
run the frame within its deadline, and fall back to the local model when the server is
down, slow or refuses. The ROS node (:mod:`robot_offload.ros.client_node`) only feeds it
frames and publishes what it returns."""

import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Optional, Sequence, Tuple, Union

import torch

from robot_offload import backends, background, checks, frame_codec
from robot_offload.codec import CODECS, COMPRESSIONS
from robot_offload.errors import CodecError, ConfigError, Incompatible, OffloadTimeout, RemoteError, TransportError
from robot_offload.link import ServerLink
from robot_offload.local_hedge import LocalHedge
from robot_offload.mode_control import MODE_CONTROLS
from robot_offload.models import get_spec, weights_hash
from robot_offload.partition.planner import OBJECTIVES
from robot_offload.pool import POLICIES, ServerDirectory, ServerPool
from robot_offload.power import EnergyMeter
from robot_offload.protocol import StatusCode
from robot_offload.stats import FrameStats
from robot_offload.transport.base import Transport

log = logging.getLogger(__name__)


@dataclass
class ClientConfig:
    """Settings of the offload client (``~`` parameters of offload_client)."""

    model: str = "resnet18"
    mode: str = "local"
    timeout_s: float = 1.0          # deadline of the server calls of one frame (s)
    retry_interval_s: float = 0.5   # how often a down server is probed (s)
    load_timeout_s: float = 60.0    # deadline of a load_model call (s)
    codec: str = "raw"              # input/activation codec: raw, float16, int8
    compression: str = "none"       # none or zstd
    output_codec: str = "raw"       # codec the server uses for outputs
    input_jpeg_quality: int = 0     # full_offload sends camera frames as JPEG of this quality (lossy); 0 = off
    input_size: Sequence[int] = ()  # override the registry's input size; () = default
    weights: str = ""               # local weights file; "" = registry's seeded weights
    client_id: str = field(default_factory=lambda: "client-" + uuid.uuid4().hex[:8])
    num_threads: int = 0            # torch intra-op threads on the robot; 0 = torch default
    compute_w: float = 13.35        # state model: robot power while computing (W)
    transmit_w: float = 4.25        # state model: robot power while transmitting (W)
    idle_w: float = 4.04            # state model: robot power while waiting (W)
    # layer_partition (split point + activation encoding per predicted bandwidth)
    objective: str = "latency"      # what its plans minimise: latency | energy | deadline (the
                                    # fewest joules of the ways that meet deadline_s, else the fastest)
    deadline_s: float = 0.1         # the latency a frame must meet under the objective deadline (s)
    error_tolerance: float = 0.005  # max relative error of layer_partition outputs (activation + output codec)
    bandwidth_bps_default: float = 50e6  # bandwidth assumed while there is no prediction (bit/s)
    server_speedup: float = 10.0    # server compute = robot compute / this, until measured
    rtt_s: float = 0.002            # round trip of one request in the latency model (s)
    replan_threshold: float = 0.3   # re-plan when measured / profiled compute drifts this much
    probe_margin: float = 0.25      # time an alternative plan predicted within this of the plan (all local: always)
    probe_every: int = 20           # ... again every this many frames of a bucket; 0 = never
    probe_known_margin: float = 0.10   # ... unless, both having run, its prediction corrected by
                                    # its measured error is this much slower than the plan's
    lop_spatial_margin: float = 0.03   # lop serves a spatial schedule only where its measured
                                    # median is this much below the best layer partition's
    profile_dir: str = ""           # profile cache; "" = ~/.cache/robot_offload/profiles
    profile_refresh: bool = False   # measure the profile again instead of loading it
    partition_codecs: Sequence[str] = ()        # activation codecs to consider; () = default set
    partition_compressions: Sequence[str] = ()  # compressions to consider; () = default set
    # record_replay: send the replay once the inputs are known and check the calls while it
    # runs (the paper's order); false: send it after the last call is checked
    early_replay: bool = True
    # who may switch the mode after start (robot_offload.mode_control): open (the ~mode
    # parameter and the set_mode service), service (set_mode only), locked (neither)
    mode_control: str = "open"
    # the node around the client (offload_client)
    server_ns: str = "/offload_server"  # where the server's services are
    # several servers (robot_offload.pool): "" = the one server at server_ns; else every
    # offload server under this namespace, found through the ROS master
    fleet_ns: str = ""
    balance: str = "least_predicted_latency"  # round_robin | least_outstanding | least_predicted_latency
    hedge: bool = True              # a late call also goes to a second server (one: the robot); first wins
    hedge_percentile: float = 95.0  # ... once it is later than this percentile of recent calls
    hedge_budget: float = 0.1       # ... in at most this fraction of calls
    use_server: bool = True         # false: local only, no server connection attempted
    publish_outputs: bool = True    # publish InferenceResult on ~result
    result_codec: str = "raw"       # codec of the published outputs

    def validate(self) -> "ClientConfig":
        get_spec(self.model)
        if self.mode_control not in MODE_CONTROLS:
            raise ConfigError(f"unknown mode_control {self.mode_control!r}; known: {list(MODE_CONTROLS)}")
        if self.mode not in backends.modes():
            raise ConfigError(f"unknown mode {self.mode!r}; known: {', '.join(backends.modes())}")
        if not self.timeout_s > 0 or not self.retry_interval_s > 0 or not self.load_timeout_s > 0:
            raise ConfigError("timeout_s, retry_interval_s and load_timeout_s must be positive")
        for name, value, known in (("codec", self.codec, CODECS), ("output_codec", self.output_codec, CODECS),
                                   ("result_codec", self.result_codec, CODECS),
                                   ("compression", self.compression, COMPRESSIONS)):
            if value not in known:
                raise ConfigError(f"unknown {name} {value!r}; known: {list(known)}")
        if self.input_jpeg_quality != 0:
            try:
                frame_codec.check_quality(self.input_jpeg_quality)
            except CodecError as e:
                raise ConfigError(f"input_jpeg_quality: {e} (0 = off)") from None
        if self.input_size and any(int(s) <= 0 for s in self.input_size):
            raise ConfigError(f"input_size must be positive, got {list(self.input_size)}")
        if not (self.compute_w >= self.idle_w >= 0 and self.transmit_w >= self.idle_w):
            raise ConfigError("need compute_w >= idle_w >= 0 and transmit_w >= idle_w")
        if self.objective not in OBJECTIVES:
            raise ConfigError(f"unknown objective {self.objective!r}; known: {list(OBJECTIVES)}")
        if not self.deadline_s > 0:
            raise ConfigError("deadline_s must be > 0")
        if not (self.error_tolerance >= 0 and self.bandwidth_bps_default > 0 and self.server_speedup > 0
                and self.rtt_s >= 0 and self.replan_threshold > 0 and self.probe_margin >= 0
                and self.probe_known_margin >= 0 and int(self.probe_every) >= 0
                and self.lop_spatial_margin >= 0):
            raise ConfigError("need error_tolerance >= 0, bandwidth_bps_default > 0, server_speedup > 0, "
                              "rtt_s >= 0, replan_threshold > 0, probe_margin >= 0, "
                              "probe_known_margin >= 0, probe_every >= 0 and lop_spatial_margin >= 0")
        for name, values, known in (("partition_codecs", self.partition_codecs, CODECS),
                                    ("partition_compressions", self.partition_compressions, COMPRESSIONS)):
            bad = [v for v in values if v not in known]
            if bad:
                raise ConfigError(f"unknown {name} {bad}; known: {list(known)}")
        checks.ros_namespace("server_ns", self.server_ns)
        if self.fleet_ns:
            checks.ros_namespace("fleet_ns", self.fleet_ns)
        if self.balance not in POLICIES:
            raise ConfigError(f"unknown balance {self.balance!r}; known: {list(POLICIES)}")
        checks.flag("hedge", self.hedge)
        if not (0 < self.hedge_percentile <= 100 and 0 <= self.hedge_budget <= 1):
            raise ConfigError("need 0 < hedge_percentile <= 100 and 0 <= hedge_budget <= 1")
        checks.flag("use_server", self.use_server)
        checks.flag("publish_outputs", self.publish_outputs)
        return self


class OffloadClient:
    """Runs frames through the backend of the current mode, with local fallback."""

    def __init__(self, config: ClientConfig, transport: Union[Transport, ServerDirectory, None],
                 model: Optional[torch.nn.Module] = None):
        """``transport``: the one server's, or a :class:`~robot_offload.pool.ServerDirectory`
        of several (balanced and hedged, :mod:`robot_offload.pool`), or None (local only).
        ``model``: an already built instance of the registry model ``config.model`` (the
        application's own, e.g. for :mod:`robot_offload.lop`'s hook); by default the
        client builds it. Its weights hash must match the server's either way."""
        self.config = config.validate()
        if config.num_threads > 0:
            torch.set_num_threads(config.num_threads)
        self.spec = get_spec(config.model)
        self.model = model if model is not None else self.spec.build(config.weights or None)
        self.weights_hash = weights_hash(self.model)
        self.link = None
        link_kw = dict(load_timeout_s=config.load_timeout_s, retry_interval_s=config.retry_interval_s)
        if isinstance(transport, ServerDirectory):
            self.link = ServerPool(transport, config.client_id, config.model, self.weights_hash,
                                   balance=config.balance, hedge=config.hedge,
                                   hedge_percentile=config.hedge_percentile,
                                   hedge_budget=config.hedge_budget, **link_kw)
        elif transport is not None:
            self.link = ServerLink(transport, config.client_id, config.model, self.weights_hash, **link_kw)
        # one server: a late full offload or partition tail is hedged by the robot itself
        # (several servers: by the pool, but for calls bound to the home server)
        hedge = LocalHedge(config.hedge_percentile, config.hedge_budget) if config.hedge and self.link is not None else None
        one_server = isinstance(self.link, ServerLink) and not isinstance(self.link, ServerPool)
        self._ctx = backends.BackendContext(self.spec, self.model, self.link, config,
                                            local_hedge=hedge if one_server else None, home_hedge=hedge,
                                            energy_j=lambda stats, t0, t1: self._energy(stats, t0, t1)[0])
        self._backends = {}
        self._lock = threading.Lock()
        self.fallbacks = 0
        self._incompatible_logged = set()
        self.measured_power = EnergyMeter(None)   # fed by the node with sensor samples
        self.predicted_bandwidth_bps = float("nan")  # fed by the node (bandwidth_monitor)
        # perf_counter -> wall clock, for matching intervals with stamped power samples
        self.wall_offset_s = time.time() - time.perf_counter()
        self.mode = config.mode
        self._get_backend(self.mode)
        self._local = self._get_backend("local")

    @property
    def input_size(self) -> Tuple[int, ...]:
        return self._ctx.input_size

    def connect(self, timeout_s: Optional[float] = None) -> bool:
        """Reach the server and load the model there (probing in the background if not)."""
        return self.link.connect(timeout_s) if self.link is not None else False

    def needs_server(self, mode: Optional[str] = None) -> bool:
        """Whether ``mode`` (default: the current one) offloads to the server."""
        return self._get_backend(mode or self.mode).needs_server

    def set_mode(self, mode: str) -> str:
        """Switch backend from the next frame on; returns the previous mode. An unknown
        mode raises ConfigError and the current mode is kept."""
        self._get_backend(mode)
        previous, self.mode = self.mode, mode
        if previous != mode:
            log.info("mode %s -> %s", previous, mode)
        return previous

    def warm_up(self) -> float:
        """Run the local model once on a blank frame, so that the first fallback of a
        client that starts offloading does not also pay the local model's first-run costs
        (allocations, kernel selection: 0.5 s more for that frame on the testbed), and,
        where the robot hedges late calls (:mod:`robot_offload.local_hedge`), once more
        to time a forward. Returns the seconds the first took."""
        import numpy as np
        t0 = time.perf_counter()
        if self.spec.input_kind == "image":
            frame = np.zeros((*self.input_size[:2], 3), dtype=np.uint8)
        else:
            frame = np.zeros((1, 4), dtype=np.float32)
        x = self.preprocess(frame)
        with torch.inference_mode():
            self.model(x)
        first_s = time.perf_counter() - t0
        if self._ctx.local_hedge is not None:     # what a later forward takes
            t1 = time.perf_counter()
            with torch.inference_mode():
                self.model(x)
            self._ctx.local_hedge.observe_local(time.perf_counter() - t1)
        return first_s

    def preprocess(self, frame) -> torch.Tensor:
        return self.spec.preprocess(frame, self.input_size)

    def process(self, frame):
        """Run one raw frame (a uint8 H x W x 3 image, or a point cloud for point-cloud
        models); returns ``(outputs, stats)``. The backend decides where the frame is
        preprocessed (``full_offload`` sends an image as it is); a local fallback
        preprocesses it on the robot, once. Never raises for server trouble (see
        :meth:`infer`)."""
        stats = FrameStats()
        t0 = time.perf_counter()
        ctx, timeout_s = self._ctx, self.config.timeout_s
        try:
            return self._run(stats, t0, lambda b: b.infer_frame(frame, stats, timeout_s),
                             lambda: ctx.preprocess(frame, stats))
        finally:
            ctx.forget(frame)

    def infer(self, x: torch.Tensor, stats: Optional[FrameStats] = None,
              t0: Optional[float] = None):
        """Run one batched input; returns ``(outputs, stats)``. Never raises for server
        trouble: the frame is computed locally and ``stats.fallback_reason`` says why."""
        stats = stats or FrameStats()
        t0 = time.perf_counter() if t0 is None else t0
        timeout_s = self.config.timeout_s
        return self._run(stats, t0, lambda b: b.infer(x, stats, timeout_s), lambda: x)

    def _run(self, stats: FrameStats, t0: float, run, local_input):
        """The one path of every frame: ``run(backend)`` on the current mode's backend,
        or, when the server is unavailable or fails, the local model on
        ``local_input()``; then the frame's totals and energy. The frame is the
        process's foreground: background planning pauses while it computes
        (:mod:`robot_offload.background`); ``detail_json``'s ``background`` is true when
        some ran beside it all the same (its latency samples do not last)."""
        with background.GATE.frame():
            result = self._run_frame(stats, t0, run, local_input)
            if background.GATE.contended():
                stats.extra["background"] = True
            return result

    def _run_frame(self, stats: FrameStats, t0: float, run, local_input):
        mode = self.mode
        stats.mode, stats.model = mode, self.config.model
        stats.predicted_bandwidth_bps = self.predicted_bandwidth_bps
        backend = self._get_backend(mode)
        outputs = None
        if backend.needs_server and not self.link.available:
            stats.fallback_reason = f"server unavailable: {self.link.last_error}"
        else:
            try:
                outputs = run(backend)
                stats.executed_mode = stats.executed_mode or mode     # "local": a hedge the robot won
            except Incompatible as e:
                # the server is fine; this mode cannot use it (robot_offload.compat)
                stats.fallback_reason = f"{type(e).__name__}: {e}"
                if e.text not in self._incompatible_logged:
                    self._incompatible_logged.add(e.text)
                    log.error("%s: computing locally: %s", mode, e.text)
            except (TransportError, RemoteError) as e:
                stats.fallback_reason = f"{type(e).__name__}: {e}"
                if isinstance(e, OffloadTimeout):
                    stats.fallback_reason += (f" (the frame's deadline, ~timeout_s = {self.config.timeout_s:g} s: "
                                              "raise it if the server or link is only slow)")
                if not (isinstance(e, RemoteError) and e.code == StatusCode.BUSY):
                    # BUSY: the server is up and refused this frame at once, cheaply (it
                    # cannot start it in time, or a bound is reached): no back-off
                    self.link.mark_down(stats.fallback_reason)
        pool_report = self.link.take_frame_report() if self.link is not None else None
        if pool_report:
            stats.extra["pool"] = pool_report
        if outputs is None:
            if backend.needs_server:
                self.fallbacks += 1
            outputs = self._local.infer(local_input(), stats, self.config.timeout_s)
            stats.executed_mode = "local"
        t1 = time.perf_counter()
        stats.processing_s = t1 - t0
        self._account_energy(stats, t0, t1)
        return outputs, stats

    def _account_energy(self, stats: FrameStats, t0: float, t1: float) -> None:
        stats.energy_j, stats.energy_modelled = self._energy(stats, t0, t1)

    def _energy(self, stats: FrameStats, t0: float, t1: float) -> Tuple[float, bool]:
        """The robot's joules from ``t0`` to ``t1`` of the frame of ``stats``, and whether
        they are modelled: measured when a power sensor's samples cover the span, else
        modelled from the frame's intervals."""
        w0, w1 = t0 + self.wall_offset_s, t1 + self.wall_offset_s
        first, _ = self.measured_power.span_s
        if first is not None and first <= w0:
            return self.measured_power.energy_between(w0, w1, hold_last=True), False
        return self._ctx.modelled_energy_j(stats, t0, t1), True

    def close(self) -> None:
        for b in self._backends.values():
            b.close()
        if self.link is not None:
            self.link.close()             # a pool closes its servers' transports itself
            if isinstance(self.link, ServerLink):
                self.link.transport.close()

    def _get_backend(self, mode: str) -> backends.Backend:
        with self._lock:
            if mode not in self._backends:
                self._backends[mode] = backends.make_backend(mode, self._ctx)
            return self._backends[mode]
