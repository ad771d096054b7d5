"""LOSS, the local operator scheduling strategy of Intra-DP (§4.2), over our profiles.

A lop schedule (:class:`LopPlan`) is

* a *first cut* ``c1``: the robot computes everything before it (a layer-partition head;
  the input cut when it starts at once);
* a *last cut* ``c2``: every node between the two cuts is a local operator
  (:class:`~robot_offload.partition.spatial.Region`); everything after it runs on the
  server, as the tail of a layer partition at ``c2``;
* a *robot share* ``f``: the robot computes the top ``f`` of the rows of every tensor
  crossing ``c2``, the server the rest, each with the halo rows its block-wise operators
  need (recomputed on both sides instead of exchanged). ``f`` may be 0: joined on the
  robot, that is a full offload whose end the robot runs (one request, ``c2``'s tensors
  down instead of the outputs; KAPAO's head maps instead of its decoded predictions);
* a transfer encoding (codec x compression) for both transfers;
* which side joins the rows of ``c2`` and runs the tail: the server (transfer B goes up,
  the outputs come down) or the robot (the server's rows come down, nothing else).

At run time (``lop`` backend) the robot runs the head, sends the server the rows of the
``c1`` tensors its stripe needs (transfer A), computes its own stripe *while A is on the
wire*, then sends its rows of the ``c2`` tensors (transfer B); the server computes its
stripe as soon as A has arrived, joins the rows and runs the tail. This is Intra-DP's
overlap of transmission and computation of local operators; global operators
synchronise (they are after ``c2``).

Latency model, the two-machine recurrences of §4.2 for this schedule (``B`` bandwidth,
``r`` the robot's and ``v`` the server's load factors, node times from the profile)::

    head     = r * head_s(c1)
    a_sent   = head + r * enc(A) + bytes(A) * 8 / B         A's last byte leaves the robot
    robot    = head + r * (enc(A) + stripe_robot + enc(B))  the robot's stripe is ready
    s_ready  = a_sent + rtt/2 + v * stripe_server / speedup the server's stripe is ready
    b_in     = max(robot, a_sent) + bytes(B) * 8 / B + rtt/2
    latency  = max(b_in, s_ready) + server_tail(c2) + down + rtt/2

The rows may instead be joined on the robot (``robot_joins``): the server answers A with
its rows of the ``c2`` tensors, the robot puts them under its own and runs the tail
itself. No transfer B and no output download; what crosses down is the server's share of
``c2`` (``join`` bytes, encoded with :func:`join_encoding`)::

    latency  = max(robot, s_ready + join + rtt/2) + r * tail_robot(c2)

This pays when the tail is cheap and the outputs are large, as after a detection head's
last convolutions: KAPAO's decoder takes 5 ms of the robot's 1.2 s and its decoded
predictions are 2 MB, against the head maps' 24 KB as float16/zstd. A region that ends at
the model's outputs always joins on the robot (there is no tail): only the server's share
``s`` of the output bytes crosses::

    latency  = max(robot, s_ready + s * down + rtt/2)

When the server joins, it may also hand the end of the model back (``until``, a cut
``c3`` whose robot tail is cheap, :data:`ROBOT_TAIL_MAX_SHARE` of the forward or less):
it runs only up to ``c3`` and ``c3``'s tensors come down instead of the outputs::

    latency  = max(b_in, s_ready) + server(c2 -> c3) + c3 bytes + rtt/2 + r * tail_robot(c3)

Every spatial schedule's latency also carries ``spatial_overhead_s`` (PlannerConfig,
5 ms): what a spatial frame costs that these terms leave out -- the transport worker that
sends A, the slicing and joining of rows around every region node on both sides, the
second request when the server joins. Measured on the testbed (0.5-CPU
robot, medians): spatial frames ran over their predictions by 3.8 ms on DenseNet-121,
4.1 ms on MobileNetV2, 6.4 ms on RegNetY, 5.1 ms on VGG-19 and 0.4 ms on ConvNeXt-T, the
same models' layer-partition frames by -4.2 to +0.1 ms (VGG-19 +7.4); without it,
MobileNetV2's spatial schedule at 100 Mbit/s, predicted 23 ms against the layer
partition's 27 ms, won its bucket and measured 27-36 ms.

``stripe_*`` is the sum over region nodes of the node's robot time times the share of its
rows that side computes (halo included); ``server_tail`` the measured tail time of ``c2``
when there is one (as in layer partitioning). The formulas are
:func:`robot_offload.partition.cost.predict_schedule`'s (energy: the state model of
:func:`~robot_offload.partition.cost.state_energy_j`). As the paper's constraint (2)-(3) keeps transfers below the raw input size, here a
schedule qualifies only with an encoding whose profiled error at both cuts, times the
planner's safety factor, is within the tolerance.

Solving. The decision space is (region, joining side, share, encoding): regions between the profile's
candidate cuts (already the cuts worth crossing), shares on a grid of ``1/share_steps``,
all qualifying encodings. :func:`solve_grid` evaluates all of it (the stripe geometry is
computed once per region and share, the rest is arithmetic per bandwidth), so it returns
the optimum of the discretised problem. :func:`solve_de` runs scipy's differential
evolution on the same objective, as the paper does; :func:`compare_solvers` reports both
objectives and solving times (the grid search is exact on this space and faster).
Layer-partition plans are candidates too, so LOSS degrades to layer partitioning when no
local region pays off by :data:`MIN_SPATIAL_GAIN` (or when a model has no local operators).
"""

import bisect
import hashlib
import json
import logging
import math
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Dict, List, NamedTuple, Optional, Tuple

from robot_offload import background
from robot_offload.errors import ConfigError
from robot_offload.partition.graph import INPUT_CUT, OUTPUT_CUT, CutError, ModelGraph
from robot_offload.partition.cost import (LopPrediction, encode_s_per_byte, join_encoding, objective_cost,
                                          output_bytes, predict_schedule, state_energy_j, tails_s, wire_ratio)
from robot_offload.partition.planner import (Plan, PlannerConfig, admits, best_plan, error_budget,
                                             options)
from robot_offload.partition.profile import (CutProfile, Profile, split_encoding)
from robot_offload.partition.spatial import Region, SpatialGraph

log = logging.getLogger(__name__)

LOSS_VERSION = 6

#: A spatial schedule replaces the bucket's layer partition only when predicted at least
#: this much better (relative). It costs two round trips instead of one, a second recorded
#: graph on the server and new kernel set-ups the first time each slab shape runs, and its
#: stripe times are sums of whole-node profile times scaled by rows, which miss per-node
#: overheads that do not shrink with the rows. On the testbed (KAPAO at 50 Mbit/s and on
#: the traces, natural frames) schedules predicted 1-3 % better measured 1-7 % slower than
#: the layer partition; VGG-19 and DenseNet-121, predicted 18 % and 8 % better (medians),
#: measured 6-16 % and 9-38 % faster.
MIN_SPATIAL_GAIN = 0.05

#: A cut qualifies as a robot tail's start (``until``) when the robot runs the rest of the
#: model in at most this share of its whole forward: a decoder, not a network.
ROBOT_TAIL_MAX_SHARE = 0.05


class RegionChoice(NamedTuple):
    """One region of LOSS's decision space with its joining side: ``first``/``last`` are
    the profiles of its cuts; ``until`` the profile of the cut the server stops at when it
    joins and the robot runs the rest (None: the server runs to the outputs)."""

    region: Region
    first: CutProfile
    last: CutProfile
    robot_joins: bool
    until: Optional[CutProfile] = None


@dataclass(frozen=True)
class StripeCost:
    """Bandwidth-independent figures of one (region, share, joining side): robot and
    server stripe times at load 1 (robot seconds), raw bytes of transfers A and B, the
    share of the output bytes that comes down (1 when the server joins; the server's share
    of the rows when the region ends at the outputs; 0 when the robot joins before them),
    and the raw bytes of the server's rows of the ``c2`` tensors that come down when the
    robot joins before the outputs."""

    robot_s: float
    server_robot_s: float
    a_raw_bytes: float
    b_raw_bytes: float
    down_share: float = 1.0
    join_raw_bytes: float = 0.0


@dataclass(frozen=True)
class LopPlan:
    """One bucket's schedule: a spatial split (``partition`` is None) or a layer partition."""

    bandwidth_bps: float
    latency_s: float
    energy_j: float
    partition: Optional[Plan] = None
    first: Tuple[str, ...] = ()        # crossing names of c1
    last: Tuple[str, ...] = ()         # crossing names of c2
    first_label: str = ""
    last_label: str = ""
    share: float = 0.0                 # robot's share of the c2 rows
    codec: str = "raw"
    compression: str = "none"
    error: float = 0.0                 # profiled output error of the codec (worse cut)
    a_bytes: float = 0.0
    b_bytes: float = 0.0
    robot_stripe_s: float = 0.0        # predicted stripe times (what frames calibrate)
    server_stripe_s: float = 0.0
    robot_joins: bool = False          # the robot joins c2's rows and runs the tail
    until: Tuple[str, ...] = ()        # crossing names of c3: the server stops there
    until_label: str = ""

    @property
    def spatial(self) -> bool:
        return self.partition is None

    @property
    def link_free(self) -> bool:
        """All on the robot (see :attr:`Plan.link_free`)."""
        return self.partition is not None and self.partition.link_free

    @property
    def error_group(self) -> Optional[str]:
        """Spatial schedules err on their predictions alike (stripes on new slab shapes,
        per-node costs that do not shrink with the rows), whatever their split: one not
        yet measured is corrected by the others' errors
        (:meth:`~robot_offload.partition.choice.MeasuredChoice.corrected_s`)."""
        return "spatial" if self.spatial else None

    @property
    def key(self) -> Tuple:
        if self.partition is not None:
            return ("partition", self.partition.cut_id, self.partition.encoding)
        return ("lop", self.first, self.last, round(self.share, 6), self.codec, self.compression,
                self.robot_joins, self.until)

    def describe(self) -> str:
        if self.partition is not None:
            return "layer_partition " + self.partition.describe()
        joins = " (robot joins)" if self.robot_joins and self.last_label != "outputs" else ""
        if self.until:
            joins = f" (robot from {self.until_label})"
        return (f"lop {self.first_label} -> {self.last_label}{joins} robot {self.share:.0%} "
                f"enc={self.codec}/{self.compression}")

    def to_dict(self) -> Dict:
        d = asdict(self)
        if self.partition is not None:
            d["partition"] = asdict(self.partition)
        return d


@dataclass
class Candidate:
    region: Region
    share: float
    cost: StripeCost
    first: CutProfile
    last: CutProfile
    robot_joins: bool = False
    until: Optional[CutProfile] = None


def _join_bytes(cut: CutProfile) -> float:
    """The fewest bytes ``cut``'s tensors take in an encoding that can come down
    (:func:`join_encoding`: raw or float16, any compression); a cut whose encodings were
    not profiled travels raw."""
    if not cut.bytes:
        return float(cut.raw_bytes)
    sizes = [b for e, b in cut.bytes.items() if join_encoding(e) == e]
    return min(sizes) if sizes else 0.0


class Loss:
    """Stripe costs of every (region, share) of a graph and profile, and the solvers."""

    def __init__(self, graph: ModelGraph, spatial: SpatialGraph, profile: Profile,
                 share_steps: int = 16, max_regions: int = 400):
        if share_steps < 2:
            raise ConfigError("share_steps must be >= 2")
        self.graph, self.spatial, self.profile = graph, spatial, profile
        self.share_steps = share_steps
        t0 = time.perf_counter()
        cuts = []
        for c in _boundary_cuts(graph, spatial, profile):
            try:
                cuts.append((c, graph.input_cut() if c.kind == INPUT_CUT else graph.cut(c.crossing)))
            except CutError:
                continue
        cuts.sort(key=lambda pc: len(pc[1].head))
        spatial_regions = []
        for i, (p1, c1) in enumerate(cuts):
            for p2, c2 in cuts[i + 1:]:
                if len(spatial_regions) >= max_regions:
                    break
                background.checkpoint()
                try:
                    spatial_regions.append((spatial.region(c1, c2), p1, p2))
                except CutError:
                    continue
        # Where the server may stop and hand the rest to the robot: cheap robot tails
        tails = [(p, c) for p, c in cuts if p.kind == "inner"
                 and p.tail_s <= ROBOT_TAIL_MAX_SHARE * profile.forward_s and _join_bytes(p)]
        #: a region ending at the outputs is joined on the robot; any other is listed
        #: joined on the server, then (when a robot tail follows it) joined on the server
        #: up to the robot tail with the fewest bytes, then joined on the robot
        self.regions: List[RegionChoice] = []
        for region, p1, p2 in spatial_regions:
            if p2.kind != OUTPUT_CUT:
                self.regions.append(RegionChoice(region, p1, p2, False))
                after = [p for p, c in tails if region.last.head < c.head]
                if after:
                    self.regions.append(RegionChoice(region, p1, p2, False,
                                                     min(after, key=_join_bytes)))
            self.regions.append(RegionChoice(region, p1, p2, True))
        self._costs: Dict[Tuple[int, int], StripeCost] = {}
        self._solver_arrays: Optional[Tuple[Tuple, Optional[Dict[str, object]]]] = None
        self.geometry_s = time.perf_counter() - t0

    def shares(self) -> List[float]:
        return [i / self.share_steps for i in range(0, self.share_steps)]

    def cost(self, region_index: int, step: int) -> StripeCost:
        """Stripe cost of region ``region_index`` with robot share ``step / share_steps``."""
        key = (region_index, step)
        c = self._costs.get(key)
        if c is None:
            background.checkpoint()     # thousands of these make a first solve
            rc = self.regions[region_index]
            c = self._costs[key] = stripe_cost(self.spatial, rc.region, step / self.share_steps,
                                               self.profile.node_s, rc.robot_joins)
        return c

    def candidate(self, region_index: int, step: int) -> Candidate:
        rc = self.regions[region_index]
        return Candidate(rc.region, step / self.share_steps, self.cost(region_index, step), rc.first,
                         rc.last, rc.robot_joins, rc.until)

    def candidates(self) -> List[Candidate]:
        """Region-major, ``share_steps`` shares per region, from 0 (:func:`solve_buckets`
        relies on the order)."""
        return [self.candidate(i, step) for i in range(len(self.regions))
                for step in range(0, self.share_steps)]

    def solver_arrays(self, cfg: PlannerConfig, encodings: List[str]) -> Optional[Dict[str, object]]:
        """What :func:`solve_buckets` needs that the load factors do not change, made once
        per admission rule (encodings, error budget and safety) and kept: per candidate its
        stripe costs, per admissible (region, encoding) pair the encoding's byte ratios,
        encoding seconds per byte and profiled error, and the rows the solver evaluates
        (candidate-major as :meth:`candidates`, each candidate with its region's admissible
        encodings). None when no candidate has an admissible encoding.

        A re-plan (new load or stripe factors, every few seconds on a small model under a
        CPU quota) used to recompute all of it on the robot, and over every encoding
        whether admissible or not: MobileNetV2's 900 regions x 24 encodings, 0.6 s of a
        core per re-plan, of which 28 % of the pairs were admissible."""
        import numpy as np

        key = (tuple(encodings), error_budget(cfg), cfg.error_safety)
        cached = self._solver_arrays
        if cached is not None and cached[0] == key:
            return cached[1]
        cands = self.candidates()
        per, n_r = self.share_steps, len(self.regions)
        pair_region, pair_enc, fig = [], [], []
        for ri in range(n_r):
            background.checkpoint()
            cand = cands[ri * per]
            ok = dict(encodings_for(self.profile, cand, cfg))
            first, last, rc = cand.first, cand.last, self.regions[ri]
            for j, e in enumerate(encodings):
                if e not in ok:
                    continue
                ratio_b, ratio_j = wire_ratio(last, e), 0.0
                if rc.robot_joins:
                    ratio_b = 0.0          # no B; the join's bytes come down instead
                    ratio_j = wire_ratio(last, join_encoding(e))
                until = (rc.until.raw_bytes * wire_ratio(rc.until, join_encoding(e))
                         if rc.until is not None else 0.0)
                pair_region.append(ri)
                pair_enc.append(j)
                fig.append((wire_ratio(first, e), ratio_b, ratio_j, until, encode_s_per_byte(first, e),
                            encode_s_per_byte(last, e), ok[e]))
        arr = None
        if fig:
            fig_a = np.array(fig, dtype=float)
            pair_region = np.array(pair_region)
            # rows: candidate-major (region, share), then the region's pairs
            starts = np.searchsorted(pair_region, np.arange(n_r + 1))
            row_pair, row_cand = [], []
            for ri in range(n_r):
                pairs = np.arange(starts[ri], starts[ri + 1])
                if len(pairs):
                    row_pair.append(np.tile(pairs, per))
                    row_cand.append(np.repeat(ri * per + np.arange(per), len(pairs)))
            row_pair, row_cand = np.concatenate(row_pair), np.concatenate(row_cand)
            costs = [c.cost for c in cands]
            arr = {"cands": cands, "row_pair": row_pair, "row_cand": row_cand,
                   "row_region": pair_region[row_pair], "pair_enc": np.array(pair_enc),
                   "ratio_a": fig_a[:, 0], "ratio_b": fig_a[:, 1], "ratio_j": fig_a[:, 2],
                   "until_bytes": fig_a[:, 3], "eps_a": fig_a[:, 4], "eps_b": fig_a[:, 5],
                   "err": fig_a[:, 6],
                   "a_raw": np.array([c.a_raw_bytes for c in costs], dtype=float),
                   "b_raw": np.array([c.b_raw_bytes for c in costs], dtype=float),
                   "robot_s": np.array([c.robot_s for c in costs], dtype=float),
                   "server_robot_s": np.array([c.server_robot_s for c in costs], dtype=float),
                   "down_share": np.array([c.down_share for c in costs], dtype=float),
                   "join_raw": np.array([c.join_raw_bytes for c in costs], dtype=float),
                   "head_s": np.array([c.first.head_s if c.first.kind != INPUT_CUT else 0.0
                                       for c in cands], dtype=float),
                   "joins": np.array([c.robot_joins for c in cands]),
                   "has_until": np.array([c.until is not None for c in cands])}
        self._solver_arrays = (key, arr)
        return arr


def _boundary_cuts(graph: ModelGraph, spatial: SpatialGraph, profile: Profile) -> List[CutProfile]:
    """Where a region may start or end: the profile's candidate cuts (the cuts worth
    crossing in layer partitioning) and the entry and exit of every run of local operators
    (right after and right before a global one), which are not always candidates."""
    kinds = spatial.info
    order = graph.order
    edges = set()
    for i, name in enumerate(order):
        if kinds[name].kind == "global":
            if i > 0:
                edges.add(order[i - 1])      # exit of the run before
            edges.add(name)                  # entry of the run after
    out = {c.id: c for c in profile.candidates}
    for c in profile.cuts:
        if c.kind == "inner" and c.id not in out:
            try:
                last = graph.cut(c.crossing).last
            except CutError:
                continue
            if last in edges:
                out[c.id] = c
    return list(out.values())


def stripe_seconds(spatial: SpatialGraph, region: Region, need: Dict[str, Tuple[int, int]],
                   node_s: Dict[str, float]) -> float:
    """Profiled time of a stripe: each region node's robot time times the share of its rows
    the stripe computes (halo included), summed."""
    return sum(node_s.get(n, 0.0) * f for n, f in spatial.computed_fraction(region, need).items())


def stripe_cost(spatial: SpatialGraph, region: Region, share: float,
                node_s: Dict[str, float], robot_joins: bool = False) -> StripeCost:
    robot_rows, server_rows = spatial.split_rows(region, share)
    need_r = spatial.needs(region, robot_rows)
    need_s = spatial.needs(region, server_rows)
    robot_s = stripe_seconds(spatial, region, need_r, node_s)
    server_s = stripe_seconds(spatial, region, need_s, node_s)
    metas = spatial.metas
    a = sum(metas[n].nbytes * (need_s[n][1] - need_s[n][0]) / spatial.rows(n)
            for n in region.inputs if n in need_s)
    if robot_joins or region.last.kind == OUTPUT_CUT:
        # the server's rows of each c2 tensor come down (not those passing over the region:
        # the robot holds them whole); at the outputs, as a share of the output bytes
        down = sum(metas[n].nbytes * (server_rows[n][1] - server_rows[n][0]) / spatial.rows(n)
                   for n in region.outputs if n not in region.inputs)
        if region.last.kind == OUTPUT_CUT:
            total = sum(metas[n].nbytes for n in region.outputs) or 1
            return StripeCost(robot_s, server_s, float(a), 0.0, down / total)
        return StripeCost(robot_s, server_s, float(a), 0.0, 0.0, float(down))
    b = sum(metas[n].nbytes * held_from(need_s, n, spatial.rows(n)) / spatial.rows(n)
            for n in region.outputs)
    return StripeCost(robot_s, server_s, float(a), float(b))


def held_from(need_server: Dict[str, Tuple[int, int]], name: str, rows: int) -> int:
    """First row of ``name`` the server holds after its stripe (it holds the rest to the
    bottom): the robot sends rows ``[0, held_from)`` in transfer B."""
    return need_server[name][0] if name in need_server else rows


def encodings_for(profile: Profile, cand: Candidate, cfg: PlannerConfig) -> List[Tuple[str, float]]:
    """Encodings usable for both transfers of ``cand`` and their profiled error (the worse
    of the two cuts), admitted as by the layer-partition planner (safety factor, output
    codec's error counted)."""
    encs = list(cfg.encodings) if cfg.encodings is not None else profile.encodings
    out = []
    for e in encs:
        last_e = join_encoding(e) if cand.robot_joins else e
        if wire_ratio(cand.first, e) is None or wire_ratio(cand.last, last_e) is None:
            continue
        err = max(cand.first.codec_error(split_encoding(e)[0]),
                  cand.last.codec_error(split_encoding(last_e)[0]))
        if cand.until is not None:
            until_e = join_encoding(e)
            if wire_ratio(cand.until, until_e) is None:
                continue
            err = max(err, cand.until.codec_error(split_encoding(until_e)[0]))
        if admits(cfg, err):
            out.append((e, err))
    return out


def _objective(p, cfg: PlannerConfig) -> float:
    return objective_cost(cfg, p.latency_s, p.energy_j)


def _lop_plan(cand: Candidate, encoding: str, p: LopPrediction, bw: float,
              error: float = 0.0) -> LopPlan:
    cd, z = split_encoding(encoding)
    return LopPlan(bandwidth_bps=bw, latency_s=p.latency_s, energy_j=p.energy_j,
                   first=tuple(cand.region.inputs), last=tuple(cand.region.outputs),
                   first_label=cand.first.label,
                   last_label="outputs" if cand.last.kind == OUTPUT_CUT else cand.last.label,
                   share=cand.share,
                   codec=cd, compression=z, error=error, a_bytes=p.a_bytes, b_bytes=p.b_bytes,
                   robot_stripe_s=p.robot_stripe_s, server_stripe_s=p.server_stripe_s,
                   robot_joins=cand.robot_joins,
                   until=tuple(cand.until.crossing) if cand.until is not None else (),
                   until_label=cand.until.label if cand.until is not None else "")


def _partition_plan(plan: Plan) -> LopPlan:
    return LopPlan(bandwidth_bps=plan.bandwidth_bps, latency_s=plan.prediction.latency_s,
                   energy_j=plan.prediction.energy_j, partition=plan)


def _spatial_wins(spatial_obj: float, lp_obj: float, min_gain: float) -> bool:
    """Whether a spatial schedule's objective beats the layer partition's by ``min_gain``."""
    return math.isfinite(spatial_obj) and spatial_obj < lp_obj * (1.0 - min_gain)


def solve_grid(loss: Loss, bandwidth_bps: float, cfg: PlannerConfig,
               candidates: Optional[List[Candidate]] = None, spatial_only: bool = False,
               min_gain: float = MIN_SPATIAL_GAIN) -> LopPlan:
    """The best schedule at ``bandwidth_bps``: every (region, share, encoding), and the best
    layer partition unless ``spatial_only`` (kept unless the best spatial schedule is
    ``min_gain`` better, see :data:`MIN_SPATIAL_GAIN`)."""
    cands = loss.candidates() if candidates is None else candidates
    down = output_bytes(loss.profile, cfg.output_codec)
    best, best_key = None, None
    for cand in cands:
        for e, err in encodings_for(loss.profile, cand, cfg):
            p = predict_schedule(loss.profile, cand, e, bandwidth_bps, cfg, down)
            key = (_objective(p, cfg), p.a_bytes + p.b_bytes, err)
            if best_key is None or key < best_key:
                best, best_key = _lop_plan(cand, e, p, bandwidth_bps, err), key
    if not spatial_only:
        lp = best_plan(loss.profile, bandwidth_bps, cfg, options(loss.profile, cfg))
        lp_obj = _objective(lp.prediction, cfg)
        if best_key is None or not _spatial_wins(best_key[0], lp_obj, min_gain):
            best = _partition_plan(lp)
    if best is None:
        raise ConfigError(f"{loss.profile.model}: no schedule satisfies the constraints")
    return best


def solve_buckets(loss: Loss, cfg: PlannerConfig, min_gain: float = MIN_SPATIAL_GAIN) -> List[LopPlan]:
    """:func:`solve_grid` for every bucket of ``cfg``, vectorised: the same model and the
    same decision space evaluated as arrays (one row per candidate and admissible encoding,
    one column per bucket), so a whole table costs about what one bucket costs in the
    scalar loop (a test checks they agree). What does not depend on the load factors (the
    admissible encodings of every region and their figures, the candidates' stripe costs)
    is kept on ``loss`` (:meth:`Loss.solver_arrays`), so a re-plan is the arithmetic alone."""
    import numpy as np

    buckets = np.asarray(cfg.buckets, dtype=float)
    lp = []
    for b in cfg.buckets:
        background.checkpoint()
        lp.append(_partition_plan(best_plan(loss.profile, b, cfg, options(loss.profile, cfg))))
    encs = list(cfg.encodings) if cfg.encodings is not None else loss.profile.encodings
    arr = loss.solver_arrays(cfg, encs)
    if arr is None:
        return lp
    cands, per = arr["cands"], loss.share_steps
    rows_c, rows_r, rows_p = arr["row_cand"], arr["row_region"], arr["row_pair"]   # per row
    r, v = cfg.robot_load, cfg.server_load
    # per region: its stripe factors and what runs after the join (cfg-dependent)
    stripe = np.array([cfg.stripe_loads(rc.first.id, rc.last.id) for rc in loss.regions])   # (r, 2)
    tails = np.array([tails_s(loss.profile, cands[ri * per], cfg)
                      for ri in range(len(loss.regions))])
    a_raw, b_raw = arr["a_raw"][rows_c], arr["b_raw"][rows_c]
    a_bytes, b_bytes = a_raw * arr["ratio_a"][rows_p], b_raw * arr["ratio_b"][rows_p]
    enc_a, enc_b = r * a_raw * arr["eps_a"][rows_p], r * b_raw * arr["eps_b"][rows_p]
    robot_s = stripe[rows_r, 0] * arr["robot_s"][rows_c]
    srv_s = stripe[rows_r, 1] * arr["server_robot_s"][rows_c]
    head = r * arr["head_s"][rows_c]
    joins, has_until = arr["joins"][rows_c][:, None], arr["has_until"][rows_c]
    server_tail, robot_tail = tails[rows_r, 0][:, None], tails[rows_r, 1][:, None]
    down = output_bytes(loss.profile, cfg.output_codec)
    bw = buckets[None, :]
    a_sent = (head + enc_a)[:, None] + a_bytes[:, None] * 8.0 / bw
    robot = (head + enc_a + r * robot_s + enc_b)[:, None]
    s_ready = a_sent + cfg.rtt_s / 2 + (v * srv_s / cfg.server_speedup)[:, None]
    b_in = np.maximum(robot, a_sent) + b_bytes[:, None] * 8.0 / bw + cfg.rtt_s / 2
    down_bytes = np.where(has_until, arr["until_bytes"][rows_p],
                          down * arr["down_share"][rows_c]
                          + arr["join_raw"][rows_c] * arr["ratio_j"][rows_p])[:, None]
    down_s = down_bytes * 8.0 / bw
    latency = np.where(joins, np.maximum(robot, s_ready + down_s + cfg.rtt_s / 2),
                       np.maximum(b_in, s_ready) + server_tail + down_s + cfg.rtt_s / 2) + robot_tail
    latency = latency + cfg.spatial_overhead_s
    energy = None
    if cfg.objective != "latency":
        tx = (a_bytes[:, None] + b_bytes[:, None] + down_bytes) * 8.0 / bw
        energy = state_energy_j(cfg, robot + robot_tail, latency, tx, np.maximum, np.minimum)
    obj = objective_cost(cfg, latency, energy, np.where)
    obj = np.where(np.isnan(obj), np.inf, obj)
    plans = []
    best = obj.argmin(axis=0)
    for k, b in enumerate(cfg.buckets):
        lp_plan = lp[k]
        lp_obj = _objective(lp_plan, cfg)
        row = int(best[k])
        if not _spatial_wins(float(obj[row, k]), lp_obj, min_gain):
            plans.append(lp_plan)
            continue
        cand, e = cands[int(rows_c[row])], encs[int(arr["pair_enc"][rows_p[row]])]
        p = predict_schedule(loss.profile, cand, e, b, cfg, down)
        plans.append(_lop_plan(cand, e, p, b, float(arr["err"][rows_p[row]])))
    return plans


def solve_de(loss: Loss, bandwidth_bps: float, cfg: PlannerConfig, seed: int = 0,
             maxiter: int = 60, popsize: int = 15) -> Tuple[Optional[LopPlan], int]:
    """The paper's solver: scipy's differential evolution over (region, share, encoding),
    integer-constrained, on the same objective (spatial schedules only). Returns the plan
    and the number of objective evaluations."""
    from scipy.optimize import differential_evolution
    import numpy as np

    regions = len(loss.regions)
    if not regions:
        return None, 0
    encs = list(cfg.encodings) if cfg.encodings is not None else loss.profile.encodings
    down = output_bytes(loss.profile, cfg.output_codec)
    evals = [0]

    def decode(x):
        ri = int(min(regions - 1, max(0, round(x[0]))))
        step = int(min(loss.share_steps - 1, max(0, round(x[1]))))
        ei = int(min(len(encs) - 1, max(0, round(x[2]))))
        return ri, step, ei

    def objective(x):
        evals[0] += 1
        ri, step, ei = decode(x)
        cand = loss.candidate(ri, step)
        ok = dict(encodings_for(loss.profile, cand, cfg))
        if encs[ei] not in ok:
            return 1e9
        return _objective(predict_schedule(loss.profile, cand, encs[ei], bandwidth_bps, cfg, down), cfg)

    bounds = [(0, regions - 1), (0, loss.share_steps - 1), (0, len(encs) - 1)]
    res = differential_evolution(objective, bounds, integrality=np.array([True, True, True]),
                                 seed=seed, maxiter=maxiter, popsize=popsize, tol=1e-9,
                                 polish=False)
    ri, step, ei = decode(res.x)
    if res.fun >= 1e9:
        return None, evals[0]
    cand = loss.candidate(ri, step)
    return _lop_plan(cand, encs[ei], predict_schedule(loss.profile, cand, encs[ei], bandwidth_bps, cfg, down),
                     bandwidth_bps), evals[0]


def compare_solvers(loss: Loss, cfg: PlannerConfig, bandwidths: List[float]) -> List[Dict]:
    """Per bandwidth: the grid optimum and differential evolution's result, objective
    (ms or mJ) and solving time (s), spatial schedules only."""
    rows = []
    cands = loss.candidates()
    for bw in bandwidths:
        t0 = time.perf_counter()
        g = solve_grid(loss, bw, cfg, cands, spatial_only=True)
        t1 = time.perf_counter()
        d, evals = solve_de(loss, bw, cfg)
        t2 = time.perf_counter()
        scale = 1e3
        rows.append({"bandwidth_mbps": bw / 1e6,
                     "grid_objective": scale * _objective(g, cfg),
                     "grid_s": t1 - t0,
                     "de_objective": scale * _objective(d, cfg) if d is not None else math.inf,
                     "de_s": t2 - t1, "de_evaluations": evals})
    return rows


class LopTable:
    """Schedules per bandwidth bucket; :meth:`lookup` picks one per frame."""

    def __init__(self, buckets: Tuple[float, ...], plans: List[LopPlan], solve_s: float):
        self.buckets = tuple(buckets)
        self.plans = plans
        self.solve_s = solve_s

    def predictions(self) -> Dict[Tuple, Dict[int, float]]:
        """Spatial schedule key -> {bucket index: predicted latency (s)} (see
        :meth:`~robot_offload.partition.choice.MeasuredChoice.carry_errors`)."""
        out: Dict[Tuple, Dict[int, float]] = {}
        for i, p in enumerate(self.plans):
            if p.spatial:
                out.setdefault(p.key, {})[i] = p.latency_s
        return out

    @classmethod
    def build(cls, loss: Loss, cfg: PlannerConfig) -> "LopTable":
        """Every bucket at once (:func:`solve_buckets`); the geometry of ``loss`` is reused,
        so re-planning with new load factors is arithmetic only."""
        t0 = time.perf_counter()
        plans = solve_buckets(loss, cfg)
        return cls(cfg.buckets, plans, time.perf_counter() - t0 + loss.geometry_s)

    def index(self, bandwidth_bps: float) -> int:
        """The highest bucket not above ``bandwidth_bps`` (the lowest below the range)."""
        if not bandwidth_bps > 0 or math.isnan(bandwidth_bps):
            return 0
        i = bisect.bisect_right(self.buckets, bandwidth_bps * (1 + 1e-9)) - 1
        return max(0, min(i, len(self.plans) - 1))

    def lookup(self, bandwidth_bps: float) -> LopPlan:
        """The plan of the highest bucket not above ``bandwidth_bps``."""
        return self.plans[self.index(bandwidth_bps)]

    def rows(self) -> List[Dict]:
        return [{"bandwidth_mbps": b / 1e6, "plan": p.describe(), "latency_ms": 1e3 * p.latency_s,
                 "energy_mj": 1e3 * p.energy_j} for b, p in zip(self.buckets, self.plans)]

    # -- cache (JSON; plans are data, never code) --------------------------------------------
    def to_json(self) -> str:
        return json.dumps({"version": LOSS_VERSION, "buckets": list(self.buckets),
                           "solve_s": self.solve_s, "plans": [p.to_dict() for p in self.plans]})

    @classmethod
    def from_json(cls, text: str) -> "LopTable":
        d = json.loads(text)
        if d.get("version") != LOSS_VERSION:
            raise ValueError("other LOSS version")
        plans = []
        for p in d["plans"]:
            part = p.pop("partition")
            if part is not None:
                from robot_offload.partition.planner import Prediction
                part["prediction"] = Prediction(**part["prediction"])
                part["crossing"] = tuple(part["crossing"])
                part = Plan(**part)
            p["first"], p["last"], p["until"] = tuple(p["first"]), tuple(p["last"]), tuple(p["until"])
            plans.append(LopPlan(partition=part, **p))
        return cls(tuple(d["buckets"]), plans, float(d["solve_s"]))


def table_key(profile: Profile, cfg: PlannerConfig, share_steps: int) -> str:
    """Cache key: the profile (model hash, machine, shape, options, measured server times)
    and every planner setting."""
    blob = json.dumps({"profile": profile.key, "server": profile.server, "cfg": asdict(cfg),
                       "steps": share_steps, "v": LOSS_VERSION}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def load_or_solve(directory: str, loss_factory, profile: Profile, cfg: PlannerConfig,
                  share_steps: int = 16, cached: bool = True) -> LopTable:
    """The plan table from the cache under ``directory/lop`` or solved, then saved there.
    ``cached=False`` solves without the cache: a re-plan's key would hold the server
    times measured so far, which change with every frame, so no start would ever look
    it up again."""
    if not cached:
        return LopTable.build(loss_factory(), cfg)
    key = table_key(profile, cfg, share_steps)
    path = os.path.join(os.path.expanduser(directory), "lop", f"{profile.model}-{key}.json")
    try:
        with open(path, encoding="utf-8") as f:
            return LopTable.from_json(f.read())
    except (OSError, ValueError, KeyError, TypeError):
        pass
    table = LopTable.build(loss_factory(), cfg)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(table.to_json())
        os.replace(tmp, path)
    except OSError as e:
        log.warning("could not cache the lop plans: %s", e)
    return table
