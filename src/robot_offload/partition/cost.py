"""The one cost model: predicted latency and robot energy of a frame for every way of
running it -- a layer partition at a cut (:func:`predict_cut`; the input cut is full
offload, the output cut all local), a spatial schedule of local-operator parallelism
(:func:`predict_schedule`) -- from the profile (node, head and tail times, bytes per
encoding), the predicted bandwidth and RTT, and the measured drift (the load factors of
:class:`~robot_offload.partition.planner.PlannerConfig`). ``layer_partition``'s planner,
``lop``'s LOSS and ``auto`` all predict through here. Pure arithmetic.

A cut ``c`` with encoding ``e`` at bandwidth ``B``::

    head   = robot_load * head_s(c)                      robot computes the head
    encode = robot_load * encode_s(c, e)                 robot quantises / shuffles / compresses
    up     = bytes(c, e) * 8 / B                         crossing tensors go up
    server = measured tail time of c on the server, else tail_s(c) / server_speedup * server_load
    down   = output bytes * 8 / B                        outputs come down
    latency = head + encode + up + rtt + server + down   (the output cut: robot_load * forward_s)

A spatial schedule: the two-machine recurrences in :mod:`robot_offload.partition.loss`.

Energy, for both (:func:`state_energy_j`, the state model of :mod:`robot_offload.power`):
compute power while the robot computes, transmit power while it waits for bytes it sends
or receives, idle power for the rest of the frame. For a cut, whose phases run in
sequence, that is ``compute_w * (head + encode) + transmit_w * (up + down) + idle_w *
(rtt + server)``.

What a plan minimises (:func:`objective_cost`): its latency, its energy, or, under a
deadline, its energy where its latency meets the deadline, and else its latency, ranked
after every plan that meets it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Tuple

import torch

from robot_offload import codec
from robot_offload.errors import ConfigError
from robot_offload.partition.graph import INPUT_CUT, OUTPUT_CUT
from robot_offload.partition.profile import CutProfile, Profile, encoding_key, split_encoding

if TYPE_CHECKING:   # annotations only: both modules import this one
    from robot_offload.partition.loss import Candidate
    from robot_offload.partition.planner import PlannerConfig


def state_energy_j(cfg: "PlannerConfig", busy_s, latency_s, transmit_s, maximum=max, minimum=min):
    """Robot energy (J) of a frame that computes ``busy_s`` of its ``latency_s`` and has
    ``transmit_s`` of bytes on the link: compute power while busy, transmit power while
    waiting on the link (at most the rest of the frame), idle power for what remains.
    Arrays too, with ``maximum=np.maximum, minimum=np.minimum`` (LOSS's vectorised solver)."""
    waiting = maximum(0.0, latency_s - busy_s)
    return (cfg.compute_w * busy_s + cfg.transmit_w * minimum(waiting, transmit_s)
            + cfg.idle_w * maximum(0.0, waiting - transmit_s))


#: the objective ``deadline`` counts a frame past the deadline as this many joules per
#: deadline of its latency: more than any frame's energy (a robot drawing 20 W for 50 s),
#: so every way that meets the deadline ranks before every way that misses it, and among
#: those that miss it the faster ranks first
MISSED_DEADLINE_J = 1000.0


def objective_cost(cfg, latency_s, energy_j, where=None):
    """What ``cfg.objective`` minimises, of a frame (predicted or measured) that takes
    ``latency_s`` and ``energy_j``: ``latency`` its latency (s), ``energy`` its energy (J),
    ``deadline`` its energy when ``latency_s <= cfg.deadline_s``, else
    :data:`MISSED_DEADLINE_J` times ``latency_s / cfg.deadline_s``. ``cfg``: a
    :class:`~robot_offload.partition.planner.PlannerConfig` or a client's config. Arrays
    too, with ``where=np.where``."""
    if cfg.objective == "latency":
        return latency_s
    if cfg.objective == "energy":
        return energy_j
    missed = MISSED_DEADLINE_J * latency_s / cfg.deadline_s
    if where is None:
        return energy_j if latency_s <= cfg.deadline_s else missed
    return where(latency_s <= cfg.deadline_s, energy_j, missed)


@dataclass(frozen=True)
class Prediction:
    latency_s: float
    energy_j: float
    head_s: float
    encode_s: float
    up_s: float
    server_s: float
    down_s: float
    bytes_up: float
    bytes_down: float


@dataclass(frozen=True)
class LopPrediction:
    latency_s: float
    energy_j: float
    robot_busy_s: float
    a_bytes: float
    b_bytes: float
    server_s: float
    robot_stripe_s: float = 0.0      # the robot's stripe alone, at the plan's load factors
    server_stripe_s: float = 0.0     # the server's stripe alone


def output_bytes(profile: Profile, output_codec: str) -> float:
    """Bytes of the outputs as the server encodes them (uncompressed; without a per-channel
    codec's 8 bytes per channel, which the profile's leaf sizes do not give)."""
    bits = 16 if output_codec == "float16" else codec.quant_bits(output_codec)
    total = 0
    for numel, dtype in profile.output_leaves:
        floating = dtype in ("float32", "float64", "float16", "bfloat16")
        if bits is None or not floating:
            total += numel * torch.empty((), dtype=getattr(torch, dtype)).element_size()
        else:
            total += (numel * bits + 7) // 8
    return float(total)


def server_time(profile: Profile, cut: CutProfile, cfg: PlannerConfig) -> float:
    """The server's time for ``cut``'s tail: measured in this run if it was, else the
    robot's tail time / ``server_speedup`` x ``server_load``. (Times saved by an earlier
    run are not used per cut: a cut measured under another load would keep that time until
    chosen again; they seed ``server_load`` instead, see Profile.server_factor.)"""
    measured = profile.fresh_tail_s.get(cut.id)
    if measured is not None:
        return measured
    return cut.tail_s / cfg.server_speedup * cfg.server_load


def join_encoding(encoding: str) -> str:
    """How the server's rows of ``c2`` come down when the robot joins them: lossless if
    the plan is, else float16, with the plan's compression. Not the plan's integer codec:
    its range guard (:func:`~robot_offload.backends.layer_partition.frame_codec`) needs
    the tensors before they are encoded, which here are on the server."""
    cd, z = split_encoding(encoding)
    return encoding_key("raw" if cd == "raw" else "float16", z)


def wire_ratio(cut: CutProfile, encoding: str) -> Optional[float]:
    """Wire bytes per raw byte of ``encoding`` at ``cut``; cuts the profile did not
    measure encodings at (not layer-partition candidates) travel raw. Nothing crosses the
    output cut (a region ending there keeps the robot's rows on the robot), so any
    encoding goes."""
    if cut.kind == OUTPUT_CUT:
        return 1.0
    if not cut.bytes:
        return 1.0 if encoding == encoding_key("raw", "none") else None
    wire = cut.wire_bytes(encoding)
    if wire is None or not cut.raw_bytes:
        return None
    return wire / cut.raw_bytes


def encode_s_per_byte(cut: CutProfile, encoding: str) -> float:
    if cut.kind == OUTPUT_CUT or not cut.raw_bytes:
        return 0.0
    return cut.encode_s.get(encoding, 0.0) / cut.raw_bytes


def predict_cut(profile: Profile, cut: CutProfile, encoding: str, bandwidth_bps: float,
            cfg: PlannerConfig, down_bytes: Optional[float] = None,
            up_bytes: Optional[float] = None, server_s: Optional[float] = None) -> Prediction:
    """Predicted latency and energy of ``cut`` with ``encoding`` at ``bandwidth_bps``.
    ``up_bytes`` / ``down_bytes`` / ``server_s``: what crosses the link and the server's
    time when the caller knows better than the profile (``auto``'s full offload of the
    camera image: the image's bytes, the server time its frames measured)."""
    if not bandwidth_bps > 0:
        raise ConfigError("bandwidth must be positive")
    if cut.kind == OUTPUT_CUT:
        t = profile.forward_s * cfg.robot_load
        return Prediction(t, state_energy_j(cfg, t, t, 0.0), t, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    up_bytes = cut.wire_bytes(encoding) if up_bytes is None else up_bytes
    if up_bytes is None:
        raise ConfigError(f"cut {cut.id[:60]!r} has no measurement for {encoding}")
    down = output_bytes(profile, cfg.output_codec) if down_bytes is None else down_bytes
    head = cut.head_s * cfg.robot_load
    enc = cut.encode_s.get(encoding, 0.0) * cfg.robot_load
    up = up_bytes * 8.0 / bandwidth_bps
    dn = down * 8.0 / bandwidth_bps
    srv = server_time(profile, cut, cfg) if server_s is None else server_s
    latency = head + enc + up + cfg.rtt_s + srv + dn
    energy = state_energy_j(cfg, head + enc, latency, up + dn)
    return Prediction(latency, energy, head, enc, up, srv, dn, float(up_bytes), float(down))


def predict_schedule(profile: Profile, cand: Candidate, encoding: str, bandwidth_bps: float,
            cfg: PlannerConfig, down_bytes: Optional[float] = None) -> LopPrediction:
    """Predicted latency and energy of a spatial schedule (see the module docstring of :mod:`robot_offload.partition.loss`)."""
    if not bandwidth_bps > 0:
        raise ConfigError("bandwidth must be positive")
    c = cand.cost
    r, v = cfg.robot_load, cfg.server_load
    a_bytes = c.a_raw_bytes * wire_ratio(cand.first, encoding)
    b_bytes = c.b_raw_bytes * wire_ratio(cand.last, encoding)
    enc_a = r * c.a_raw_bytes * encode_s_per_byte(cand.first, encoding)
    enc_b = r * c.b_raw_bytes * encode_s_per_byte(cand.last, encoding)
    head = r * (cand.first.head_s if cand.first.kind != INPUT_CUT else 0.0)
    a_sent = head + enc_a + a_bytes * 8.0 / bandwidth_bps
    stripe_r, stripe_v = cfg.stripe_loads(cand.first.id, cand.last.id)
    robot_stripe = r * stripe_r * c.robot_s
    server_stripe = v * stripe_v * c.server_robot_s / cfg.server_speedup
    robot = head + enc_a + robot_stripe + enc_b
    s_ready = a_sent + cfg.rtt_s / 2 + server_stripe
    b_in = max(robot, a_sent) + b_bytes * 8.0 / bandwidth_bps + cfg.rtt_s / 2
    if cand.until is not None:
        down = cand.until.raw_bytes * wire_ratio(cand.until, join_encoding(encoding))
    else:
        down = (output_bytes(profile, cfg.output_codec) if down_bytes is None else down_bytes)
        down = down * c.down_share
    if c.join_raw_bytes:
        down += c.join_raw_bytes * wire_ratio(cand.last, join_encoding(encoding))
    down_s = down * 8.0 / bandwidth_bps
    tail, robot_tail = tails_s(profile, cand, cfg)
    if cand.robot_joins:
        # no B: the server's rows come down in A's answer while the robot computes its own
        latency = max(robot, s_ready + down_s + cfg.rtt_s / 2) + robot_tail
    else:
        latency = max(b_in, s_ready) + tail + down_s + cfg.rtt_s / 2 + robot_tail
    latency += cfg.spatial_overhead_s
    busy = robot + robot_tail
    energy = state_energy_j(cfg, busy, latency, (a_bytes + b_bytes + down) * 8.0 / bandwidth_bps)
    return LopPrediction(latency, energy, busy, a_bytes, b_bytes, server_stripe + tail,
                         robot_stripe, server_stripe)


def tails_s(profile: Profile, cand: Candidate, cfg: PlannerConfig) -> Tuple[float, float]:
    """(server, robot) seconds of what runs after the join: the robot joins and runs the
    tail after c2 (none after the outputs), or the server runs it, up to c3 when the robot
    takes the rest (``until``)."""
    if cand.robot_joins:
        return 0.0, cfg.robot_load * cand.last.tail_s
    server = server_time(profile, cand.last, cfg)
    if cand.until is None:
        return server, 0.0
    return max(0.0, server - server_time(profile, cand.until, cfg)), cfg.robot_load * cand.until.tail_s
