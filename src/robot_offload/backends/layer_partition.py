"""``layer_partition``: the robot runs the head of the model up to a cut, the server the tail
(Neurosurgeon / DSCCS), with the cut and the activation encoding chosen together per
predicted bandwidth (DynO): see :mod:`robot_offload.partition`.

Per input shape the backend loads (or measures, then caches) a profile, builds the plan
table for every bandwidth bucket, and per frame looks up the plan for the predicted
bandwidth (``stats.predicted_bandwidth_bps``, or ``bandwidth_bps_default`` without one).

* the ``input`` cut sends the (encoded) input to the server's ``forward`` entry (full
  offload, any model);
* the ``output`` cut runs the whole model here (local);
* an inner cut runs the head here, encodes the crossing tensors (named by their graph
  nodes) and sends them to the server's ``partition_tail`` entry, which runs the tail of
  its own copy of the model.

The profile's calibration inputs are the frame that triggers profiling and synthetic frames
of the registry (:meth:`LayerPartitionBackend._calibration`), so the codec errors the planner
admits are measured on data like the frames it serves. ``error_tolerance`` covers the
outputs as returned (activation codec and the server's ``output_codec``, see
:mod:`robot_offload.partition.planner`); a frame whose crossing tensors range wider than in
calibration, so that an integer codec's scaled error would no longer fit that budget, is
sent lossless (``raw``; ``stats.extra["partition"]["guarded"]``).

Measured robot head times and the server's reported tail times are compared with the
profile (DynO's scaling factor); when they drift by more than ``replan_threshold`` the
plans are rebuilt with the new factors, and the measured server tail times are kept in the
profile (saved when the backend closes). The plans are rebuilt on a background thread and
swapped in when ready (:mod:`robot_offload.background`): built in the frame, the table of
MobileNetV2 took 45-50 ms of a 30 ms frame on a 0.5-CPU robot, 14 times in 200 frames, and
the measured choice blamed that time on the plan the frame ran.

Close calls are settled by measurement (:class:`~robot_offload.partition.choice.MeasuredChoice`,
latency objective, ``probe_every`` > 0): the bucket's alternatives (the best plan at
another cut, all local, the best full offload) predicted within ``probe_margin`` of its
plan, and all local whatever its prediction (timed once for every bucket, kept while it
measures within the margin), are timed on real frames too and the fastest serves the
bucket, because a plan never times the side it does not run on.
"""

import json
import logging
import math
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Tuple

import torch

from robot_offload import background, codec, structure
from robot_offload.backends.base import Backend, register_backend
from robot_offload.local_hedge import computed_here
from robot_offload.partition.graph import INPUT_CUT, OUTPUT_CUT, Cut, CutError, ModelGraph, capture
from robot_offload.partition.cost import predict_cut
from robot_offload.partition.choice import MeasuredChoice
from robot_offload.partition.planner import (DriftTracker, Plan, PlannerConfig,
                                             PlanTable, admits)
from robot_offload.partition.profile import (DEFAULT_CODECS, DEFAULT_COMPRESSIONS, Profile,
                                             load_or_build)
from robot_offload.protocol import ComputeRequest

log = logging.getLogger(__name__)


@dataclass
class _ShapeState:
    profile: Profile
    cfg: PlannerConfig
    table: PlanTable
    tracker: DriftTracker
    measured: Optional[MeasuredChoice] = None   # None: probing off (or an objective not latency)
    #: keys of the plans and schedules this client has run at least once at this shape
    #: (their kernels are set up in this process, whichever backend ran them)
    ran: set = field(default_factory=set)
    #: a re-plan's table is being built in the background
    replanning: bool = False
    #: the table the measured choice's errors are relative to (see :meth:`LayerPartitionBackend.table_of`)
    judged: Optional[PlanTable] = None


class PartitionKnowledge:
    """What ``layer_partition`` and ``lop`` of one client know about its model, kept once
    in :attr:`BackendContext.shared`: the captured graph, its parsed cuts and, per input
    shape, the profile, the plan table, the drift tracker's load factors, the measured
    choice's latencies and ``lop``'s schedules (every ``lop`` of the client: ``auto`` has
    its own; apart, its schedules were solved and calibrated on its own frames only, and
    on the testbed it ran KAPAO-L on a spatial region 40-90 ms slower than the ``lop``
    mode's in the same client).

    Both backends run layer partitions (``lop`` wherever LOSS degrades to one, and when its
    measured choice prefers one of layer partitioning's plans to a spatial schedule), so
    both learn the same things. Kept apart, each backend settled its close calls on its own
    samples: on the testbed, lop ran MobileNetV2 at 50 Mbit/s on a cut after
    ``features_7_conv_3`` in 21 of 25 frames where layer_partition, in the same client and
    on the same frames, had measured all local faster, and lop came out 3-23 % behind
    layer_partition in all five of MobileNetV2's cells. Shared, a frame that lop runs as a
    layer partition is exactly the frame layer_partition would run, and a switch between
    the two modes at run time keeps the measurements (and the profile) instead of starting
    over."""

    def __init__(self, model, refresh: bool = False):
        self.graph: ModelGraph = capture(model)
        self.states: Dict[Tuple[int, ...], _ShapeState] = {}
        self.cuts: Dict[Tuple[str, ...], Cut] = {}
        self.lop: Dict[Tuple[int, ...], object] = {}     # shape -> lop's _LopState
        self.refresh = refresh      # measure profiles again instead of loading the cache
        self.fresh: set = set()     # shapes measured afresh since the last refresh request
        self.users = 0              # open backends; the last to close saves the profiles
        self.building = threading.Lock()   # held while a shape's state is made

    @classmethod
    def of(cls, ctx) -> "PartitionKnowledge":
        """The client's (made on first use)."""
        k = ctx.shared.get("partition")
        if k is None:
            refresh = bool(getattr(ctx.config, "profile_refresh", False))
            k = ctx.shared["partition"] = cls(ctx.model, refresh)
        return k


@register_backend
class LayerPartitionBackend(Backend):
    name = "layer_partition"
    needs_server = True

    #: calibration inputs per profile: the first frame of the shape, then deterministic
    #: synthetic frames of the registry
    calibration_inputs = 4
    #: timed runs per profile
    profile_repeats = 3
    #: while frames compute, a re-plan's table is built at most this share of the time
    replan_share = 0.25

    def __init__(self, ctx):
        super().__init__(ctx)
        self.known = PartitionKnowledge.of(ctx)
        self.known.users += 1
        self.graph: ModelGraph = self.known.graph
        if not self.graph.traced:
            log.info("%s: torch.fx cannot trace it (%s); %s uses the input and "
                     "output cuts only", ctx.spec.name, self.graph.trace_error, self.name)
        self._states = self.known.states
        self._cuts = self.known.cuts
        self.replans = 0

    # -- profiles and plans -------------------------------------------------------------
    def planner_config(self) -> PlannerConfig:
        c = self.ctx.config
        return PlannerConfig(objective=c.objective, deadline_s=c.deadline_s,
                             error_tolerance=c.error_tolerance, server_speedup=c.server_speedup, rtt_s=c.rtt_s,
                             compute_w=c.compute_w, transmit_w=c.transmit_w, idle_w=c.idle_w,
                             output_codec=c.output_codec).validate()

    def state(self, x: torch.Tensor) -> _ShapeState:
        """Profile and plan table for ``x``'s shape (measured on first use)."""
        shape = self.shape_key(x)
        st = self._states.get(shape)
        if st is None:
            with self.known.building:     # auto may be preparing it on another thread
                st = self._states.get(shape)
                if st is None:
                    st = self._build_state(x, shape)
        return st

    def _build_state(self, x: torch.Tensor, shape) -> _ShapeState:
        """Measure (or load) the profile of ``shape`` and make its plans."""
        c = self.ctx.config
        kw = dict(codecs=tuple(c.partition_codecs) or DEFAULT_CODECS,
                  compressions=tuple(c.partition_compressions) or DEFAULT_COMPRESSIONS,
                  repeats=self.profile_repeats)
        args = (c.profile_dir, self.graph, self.ctx.spec.name, self._weights_hash(),
                self._calibration(x))
        known = self.known
        profile = load_or_build(*args, refresh=known.refresh and shape not in known.fresh, **kw)
        known.fresh.add(shape)
        if not self._cuts_exist(profile):
            log.warning("the cached profile names cuts this graph does not have; measuring again")
            profile = load_or_build(*args, refresh=True, **kw)
        cfg = self.planner_config()
        # a drift sample weighs its profiled time against the whole forward's
        tracker = DriftTracker(threshold=c.replan_threshold, reference_s={
            "robot": profile.forward_s, "server": profile.forward_s / cfg.server_speedup})
        factor = profile.server_factor(cfg.server_speedup, device=self._device())
        if factor is not None:
            cfg = replace(cfg, server_load=factor)
            tracker.assume("server", factor)
        measured = MeasuredChoice.from_client_config(c)
        st = _ShapeState(profile, cfg, PlanTable(profile, cfg), tracker, measured)
        self._states[shape] = st
        return st

    def _device(self) -> str:
        link = self.ctx.link
        return link.device if link is not None else ""

    @staticmethod
    def shape_key(x: torch.Tensor) -> Tuple[int, ...]:
        """What per-shape state is kept under."""
        return tuple(int(s) for s in x.shape)

    def frame_bandwidth(self, stats) -> float:
        """The predicted bandwidth of this frame (bit/s), or ``bandwidth_bps_default``
        while there is no usable prediction."""
        bw = stats.predicted_bandwidth_bps
        if isinstance(bw, (int, float)) and math.isfinite(bw) and bw > 0:
            return bw
        return self.ctx.config.bandwidth_bps_default

    def _cuts_exist(self, profile: Profile) -> bool:
        try:
            for c in profile.candidates:
                if c.kind != OUTPUT_CUT:
                    self.graph.cut(c.crossing)
        except CutError:
            return False
        return True

    def refresh_profile(self) -> None:
        """Measure the profiles again (from the next frame on), ignoring the cache (for
        every backend of the client that shares them)."""
        self._states.clear()
        self.known.fresh.clear()
        self.known.refresh = True

    def _weights_hash(self) -> str:
        link = self.ctx.link
        if link is not None and link.weights_hash:
            return link.weights_hash
        from robot_offload.models import weights_hash
        return weights_hash(self.ctx.model)

    def _calibration(self, x: torch.Tensor) -> List[torch.Tensor]:
        """The frame ``x`` (first: it is the one timed), then ``calibration_inputs - 1``
        deterministic synthetic inputs of its shape (none if the registry cannot make that
        shape, e.g. batches).

        The frame is there because the codec errors depend on the data: the soak's N(0, 1)
        frames range 1.5x wider than the registry's synthetic images (normalised uniform
        pixels), and int8 at resnet18's input erred 0.0053 on them against 0.0025 on the
        synthetic frames alone -- more than ``error_safety`` covers."""
        xs = [x.detach().clone()]
        spec = self.ctx.spec
        try:
            size = spec.input_size_of(x)
            extra = [spec.example_input(size, seed=1000 + i) for i in range(self.calibration_inputs - 1)]
        except Exception:  # noqa: BLE001 - any shape the registry cannot synthesise
            extra = []
        if all(tuple(t.shape) == tuple(x.shape) and t.dtype == x.dtype for t in extra):
            xs += extra
        return xs

    def _replan(self, st: _ShapeState) -> None:
        """The load factors drifted: take them, and build the plan table for them on a
        background thread (swapped in when ready: see the module). While one is built,
        drift waits for it (the tracker keeps seeing it in the next frames)."""
        if st.replanning:
            return
        st.tracker.accept()
        st.cfg = cfg = st.tracker.apply(st.cfg)
        st.replanning = True

        def build():
            try:
                st.table = PlanTable(st.profile, cfg)
                self.replans += 1
                log.info("layer_partition re-planned (robot x%.2f, server x%.2f)", cfg.robot_load,
                         cfg.server_load)
            except Exception:  # noqa: BLE001 - a background re-plan must not kill the node
                log.exception("layer_partition: re-planning failed; keeping the previous plans")
            finally:
                st.replanning = False
        background.start(build, "partition-replan", self.replan_share)

    def table_of(self, st: _ShapeState) -> PlanTable:
        """The shape's plan table for a frame, with the measured choice's errors carried
        over from the table they were measured against when a re-plan swapped in a new
        one (here, on the frame's thread: the choice is not shared with the re-plan's)."""
        table = st.table
        if st.measured is not None and st.judged is not table:
            if st.judged is not None:
                st.measured.carry_errors(st.judged.predictions(), table.predictions())
            st.judged = table
        return table

    def cut_of(self, plan: Plan) -> Cut:
        return self.cut_named(plan.crossing, output=plan.kind == OUTPUT_CUT)

    def cut_named(self, crossing, output: bool = False) -> Cut:
        """The graph's cut with these crossing names (the output cut if ``output``),
        parsed once: cutting walks the whole graph."""
        crossing = tuple(crossing)
        c = self._cuts.get(crossing)
        if c is None:
            c = self._cuts[crossing] = self.graph.output_cut() if output else self.graph.cut(crossing)
        return c

    # -- inference ------------------------------------------------------------------------
    def infer(self, x, stats, timeout_s):
        profiled_now = self.shape_key(x) not in self._states
        st = self.state(x)
        y, _plan = self.partition_frame(x, st, stats, timeout_s, self.frame_bandwidth(stats),
                                        sample=not profiled_now)
        return y

    def partition_frame(self, x: torch.Tensor, st: _ShapeState, stats, timeout_s: float,
                        bandwidth_bps: float, sample: bool = True) -> Tuple[object, Plan]:
        """One frame as layer partitioning runs it at ``bandwidth_bps``: the bucket's plan,
        or the measured choice's pick among it and its alternatives, timed for that choice
        unless ``sample`` is false (the frame also measured the profile). ``lop`` runs its
        buckets without a spatial schedule through here, so that LOSS degrading to layer
        partitioning means exactly this backend's frames. Returns (outputs, plan run)."""
        table = self.table_of(st)
        i = table.index(bandwidth_bps)
        plan, probe = table.plans[i], False
        if st.measured is not None:
            plan, probe = st.measured.choose(i, plan, table.alternatives[i])
        t0 = time.perf_counter()
        y = self.run_plan(x, plan, stats, timeout_s, bandwidth_bps)
        if st.measured is not None and sample:
            st.measured.observe(i, plan, time.perf_counter() - t0, contended=background.contended())
        stats.extra["partition"]["probe"] = probe
        if st.measured is not None:
            stats.extra["partition"]["choice"] = st.measured.last
        return y, plan

    def run_plan(self, x: torch.Tensor, plan: Plan, stats, timeout_s: float,
                 bandwidth_bps: Optional[float] = None):
        """Run one frame with ``plan`` (from this backend's table or any other plan of the
        same profile): fills ``stats`` and returns the outputs."""
        st = self.state(x)
        bw = bandwidth_bps or plan.bandwidth_bps
        cut_prof = st.profile.cut(plan.cut_id)
        pred = predict_cut(st.profile, cut_prof, plan.encoding, bw, st.cfg)
        stats.plan = plan.describe()
        stats.predicted_latency_s = pred.latency_s
        t0 = time.perf_counter()
        codec_used = plan.codec
        if plan.kind == OUTPUT_CUT:
            with torch.inference_mode():
                y = self.ctx.model(x)
            t1 = time.perf_counter()
            stats.add_compute(t0, t1)
            server_s = None
            if st.tracker.observe("robot", st.profile.forward_s, t1 - t0,
                                  contended=background.contended()):
                self._replan(st)
        else:
            y, t1, server_s, codec_used = self._offload(x, plan, st, stats, timeout_s, t0)
        stats.extra["partition"] = {
            "cut": plan.label, "codec": codec_used, "guarded": codec_used != plan.codec,
            "compression": plan.compression, "bandwidth_bps": bw,
            "predicted_s": pred.latency_s, "predicted_energy_j": pred.energy_j,
            "predicted_bytes_up": pred.bytes_up, "actual_s": time.perf_counter() - t0,
            "server_compute_s": server_s, "replans": self.replans}
        st.ran.add(plan.key)
        return y

    def _offload(self, x, plan: Plan, st: _ShapeState, stats, timeout_s: float, t0: float):
        link = self.ctx.link
        cfg = self.ctx.config
        cut_prof = st.profile.cut(plan.cut_id)
        cut = None
        if plan.kind == INPUT_CUT:
            names, tensors = ["input"], [x]
            t_head = t0
            entry, args = "forward", "{}"
        else:
            cut = self.cut_of(plan)
            with torch.inference_mode():
                tensors = list(self.graph.head_module(cut)(x))
            t_head = time.perf_counter()
            names = list(cut.crossing)
            entry = "partition_tail"
            args = _json({"cut": names, "input_shape": [int(s) for s in x.shape]})
        codec_name = frame_codec(plan, cut_prof, tensors, st.cfg)
        encoded = [_encode(t, n, codec_name, plan.compression) for n, t in zip(names, tensors)]
        request = ComputeRequest(client_id=link.client_id, model=link.model, entry=entry,
                                 tensors=encoded, args_json=args, output_codec=cfg.output_codec,
                                 output_compression=cfg.compression)
        t1 = time.perf_counter()
        here = self._computed_here(cut, x, tensors, stats) if self.ctx.local_hedge is not None else None
        if here is None:
            response = link.compute(request, timeout_s - (t1 - t0))
        else:
            robot_s = (cut_prof.tail_s if cut is not None else st.profile.forward_s) * st.cfg.robot_load
            response, y = self.ctx.local_hedge.call(link, f"{entry}:{plan.cut_id}", request,
                                                    timeout_s - (t1 - t0), stats, here, local_s=robot_s)
            if response is None:        # the robot answered first: no server time to learn from
                stats.add_compute(t0, t1)
                return y, t1, None, codec_name
        t2 = time.perf_counter()
        y = structure.unflatten([codec.decode(t) for t in response.tensors], response.structure_json)
        t3 = time.perf_counter()
        server_s = response.server_compute_s
        stats.add_compute(t0, t1)
        stats.add_call(t1, t2, response.server_total_s or server_s, request.payload_bytes,
                       response.payload_bytes)
        stats.add_compute(t2, t3)
        # DynO's run-time profiler: robot head and server tail against the profile.
        st.profile.record_server_tail(plan.cut_id, server_s, device=link.device)
        drift = False
        if plan.kind != INPUT_CUT:
            drift |= st.tracker.observe("robot", cut_prof.head_s, t_head - t0,
                                        contended=background.contended())
        drift |= st.tracker.observe("server", cut_prof.tail_s / st.cfg.server_speedup, server_s)
        if drift:
            self._replan(st)
        return y, t1, server_s, codec_name

    def _computed_here(self, cut, x, tensors, stats):
        """The robot's hedge of a late call (:mod:`robot_offload.local_hedge`): the rest of
        the model on the robot's own head tensors (unencoded), stopped when the server
        answers; the whole model for the input cut (``cut`` None). None where the tail
        needs values recorded at this shape (``cut.statics``)."""
        if cut is None:
            return computed_here(self.ctx.model, lambda: [x], stats)
        if not cut.statics:
            return computed_here(self.graph.tail_module(cut), lambda: list(tensors), stats)
        return None

    def close(self) -> None:
        """Keep what was measured on the server: save the profiles (once, when the last
        backend sharing them closes)."""
        self.known.users -= 1
        if self.known.users > 0:
            return
        for st in self._states.values():
            try:
                st.profile.save(self.ctx.config.profile_dir)
            except OSError as e:
                log.warning("could not save the profile: %s", e)


def frame_codec(plan, cut_prof, tensors, cfg: PlannerConfig) -> str:
    """The codec of ``plan`` (a layer-partition or lop plan: ``codec`` and profiled
    ``error``) for this frame's ``tensors`` at ``cut_prof`` (as
    :meth:`~robot_offload.partition.profile.CutProfile.range_ratio` takes them), or ``raw``
    when the plan's integer codec was admitted on its profiled error but these tensors
    range wider than in calibration by a ratio that takes the scaled error past the
    budget. (Plans forced past the budget, :func:`~robot_offload.partition.planner.plan_for`,
    are left alone.)"""
    if codec.quant_bits(plan.codec) is None or not admits(cfg, plan.error):
        return plan.codec
    ratio = cut_prof.range_ratio(tensors)
    if ratio > 1.0 and not admits(cfg, plan.error * ratio):
        return "raw"
    return plan.codec


def _json(obj) -> str:
    return json.dumps(obj, separators=(",", ":"))


def _encode(t: torch.Tensor, name: str, codec_name: str, compression: str):
    """Encode with the plan's codec (raw where it cannot represent the tensor)."""
    return codec.encode_or_raw(t, name, codec_name, compression)
