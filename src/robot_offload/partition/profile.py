"""Profiles for layer partitioning: what each cut costs, measured on this machine.

A :class:`Profile` holds, for one model, weights, input shape and machine:

* every node's compute time on the robot (this machine), from timed runs of the fx graph
  (``repeats`` runs after one warm-up, the median per node), scaled so that the nodes sum
  to the directly measured forward time (the per-node interpreter overhead is spread
  proportionally rather than counted);
* per cut: the robot head time, the robot time of the tail, the raw bytes of the crossing
  tensors and, for the candidate cuts, the bytes on the wire and the encode time of each
  encoding (codec x compression, measured: compression depends on the data), and the
  output error of each lossy codec (DynO's accuracy profile), measured on calibration
  inputs, and the widest range of each crossing tensor over them;
* server tail times measured at run time (``server_compute_s`` of the replies, per cut).

What is estimated, not measured: the server's compute time of a cut that has not run on
the server yet is the robot's tail time divided by ``server_speedup`` (the planner's
parameter), corrected by the ratio observed on cuts that have run; transfer time is bytes
/ predicted bandwidth + RTT. Errors are maxima over a few calibration inputs, not bounds:
the integer codecs' error grows with the range of the tensor they quantise (the step is
range / (2**b - 1)), so a frame whose crossing tensors range wider than any calibration
input's can err more; :meth:`CutProfile.range_ratio` says by how much, for the backend to
check each frame against the planner's budget.

Candidate cuts (the only cuts the planner chooses) are found in two steps, so that the
encoding and error measurements stay affordable for graphs of hundreds of nodes: first the
cuts that no other cut beats by both less head time and ``1/slack`` of the raw bytes;
then, among those, the cuts on the Pareto front of (head + encode time, bytes) for at
least one encoding. Under the planner's model (server time falling as robot time grows)
a cut off every front can never be chosen; measured server times may change that, which
this simplification ignores. The input and output cuts are always candidates.

Profiles are cached as JSON (never pickle) under ``~/.cache/robot_offload/profiles`` (or
``profile_dir``), keyed by the weights hash, the machine (host, CPU model, torch version,
device, threads, the CPUs it may use), the input shape and the profiling options;
:func:`load_or_build` with ``refresh=True`` measures again.
"""

import hashlib
import json
import logging
import math
import os
import platform
import socket
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from robot_offload import codec, structure
from robot_offload.errors import CodecError, ConfigError
from robot_offload.partition.graph import INPUT_CUT, OUTPUT_CUT, Cut, ModelGraph

log = logging.getLogger(__name__)

PROFILE_VERSION = 3     # 2: CutProfile.ranges; 3: sub-byte encode times of the faster bit packing
DEFAULT_PROFILE_DIR = os.path.join("~", ".cache", "robot_offload", "profiles")
#: Codecs and compressions a profile measures by default (DynO: 3..8 bits cover most layers).
DEFAULT_CODECS = ("raw", "float16", "int8c", "int8", "int6", "int5", "int4", "int3")
DEFAULT_COMPRESSIONS = ("none", "zstd", "bitshuffle_zstd")
LOSSLESS_CODECS = ("raw",)


def encoding_key(codec_name: str, compression: str) -> str:
    return f"{codec_name}/{compression}"


def split_encoding(key: str) -> Tuple[str, str]:
    c, _, z = key.partition("/")
    return c, z


def quant_range(t: torch.Tensor) -> float:
    """The range an integer codec quantises ``t`` over: max(hi, 0) - min(lo, 0) (0 for
    non-floating or empty tensors, which are sent raw)."""
    if not (isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()):
        return 0.0
    lo, hi = torch.aminmax(t.detach().float())
    return max(float(hi), 0.0) - min(float(lo), 0.0)


def output_error(y, ref) -> float:
    """Relative L-infinity error of outputs ``y`` against ``ref``: the largest, over the
    floating output tensors, of max|y - ref| / max|ref|. Non-floating tensors must be equal
    (else inf), as must the output structure."""
    try:
        ly, sy = structure.flatten(y)
        lr, sr = structure.flatten(ref)
    except CodecError:
        return math.inf
    if sy != sr or len(ly) != len(lr):
        return math.inf
    worst = 0.0
    for a, b in zip(ly, lr):
        if a.shape != b.shape:
            return math.inf
        if not b.is_floating_point():
            if not torch.equal(a, b):
                return math.inf
            continue
        if b.numel() == 0:
            continue
        a, b = a.detach().float().cpu(), b.detach().float().cpu()
        if not bool(torch.isfinite(a).all()):
            return math.inf
        scale = float(b.abs().max())
        diff = float((a - b).abs().max())
        worst = max(worst, diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf))
    return worst


def cpu_budget() -> str:
    """The CPUs this process may use: its affinity, capped by its cgroup's CPU quota
    ("0.5" under the testbed's robot quota, "2" without). Without it a profile measured at
    full speed and one measured under a quota shared a key, and the robot planned with
    timings 2-4x too fast."""
    from robot_offload.testbed.cgroup import quota_cpus
    n = float(len(os.sched_getaffinity(0)))
    try:
        quota = quota_cpus()
    except (OSError, ValueError):   # an unreadable cgroup tree must not stop profiling
        quota = None
    return f"{n if quota is None else min(n, quota):g}"


def cpu_quota_shape() -> str:
    """How a CPU quota is handed out: its period and the kernel's bandwidth slice (""
    without a quota). 0.5 CPU over 20 ms ran a 15 ms forward in 16-36 ms, over 4 ms
    with a 1 ms slice in 28-32 ms (testbed.cgroup), so they are other machines too."""
    from robot_offload.testbed.cgroup import bandwidth_slice_us, quota_limit
    try:
        limit = quota_limit()
    except (OSError, ValueError):
        limit = None
    if limit is None:
        return ""
    return f"period {limit[1]} us, slice {bandwidth_slice_us()} us"


def machine_id(device: str = "cpu") -> Dict[str, str]:
    """What makes timings of this machine comparable: host, CPU model, torch, device,
    threads, the CPUs it may use (:func:`cpu_budget`) and how a quota is handed out
    (:func:`cpu_quota_shape`)."""
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.lower().startswith(("model name", "hardware", "cpu model")):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    dev = str(device)
    if dev.startswith("cuda") and torch.cuda.is_available():
        dev += ":" + torch.cuda.get_device_name(torch.device(dev))
    return {"host": socket.gethostname(), "cpu": cpu, "torch": torch.__version__,
            "device": dev, "threads": str(torch.get_num_threads()), "cpus": cpu_budget(),
            "cpu_quota": cpu_quota_shape()}


def profile_key(weights_hash: str, machine: Dict[str, str], input_shape: Sequence[int],
                options: Dict) -> str:
    blob = json.dumps({"v": PROFILE_VERSION, "w": weights_hash, "m": machine,
                       "shape": [int(s) for s in input_shape], "o": options}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


@dataclass
class CutProfile:
    id: str
    kind: str
    crossing: List[str]
    label: str
    head_s: float                    # robot time of the head (s)
    tail_s: float                    # robot time of the tail (s); the server's is estimated
    raw_bytes: int                   # crossing tensors at their own dtype
    candidate: bool = False
    bytes: Dict[str, float] = field(default_factory=dict)      # encoding -> bytes on the wire
    encode_s: Dict[str, float] = field(default_factory=dict)   # encoding -> robot encode time
    error: Dict[str, float] = field(default_factory=dict)      # codec -> relative output error
    #: per crossing tensor (in ``crossing`` order), the widest quantisation range
    #: max(hi, 0) - min(lo, 0) over the calibration inputs (candidate cuts; 0: not floating)
    ranges: List[float] = field(default_factory=list)

    def wire_bytes(self, key: str) -> Optional[float]:
        if self.kind == OUTPUT_CUT:
            return 0.0
        return self.bytes.get(key)

    def codec_error(self, codec_name: str) -> float:
        if codec_name in LOSSLESS_CODECS or self.kind == OUTPUT_CUT:
            return 0.0
        return self.error.get(codec_name, math.inf)

    def range_ratio(self, tensors) -> float:
        """How much wider than in calibration the widest of these crossing tensors ranges:
        >= 1, 1 when none is wider. ``tensors`` is this frame's crossing tensors in
        ``crossing`` order, or a mapping from crossing names to tensors (or row slabs of
        them; any subset: what one transfer of lop sends). An integer codec's step, and
        with it (to first order) its output error, scales by this. inf when the calibration
        ranges are unknown or a range was 0 and is not now."""
        if len(self.ranges) != len(self.crossing):
            return math.inf
        if isinstance(tensors, Mapping):
            calibrated = dict(zip(self.crossing, self.ranges))
            if not set(tensors) <= set(calibrated):
                return math.inf
            pairs = [(t, calibrated[n]) for n, t in tensors.items()]
        elif len(tensors) != len(self.ranges):
            return math.inf
        else:
            pairs = list(zip(tensors, self.ranges))
        ratio = 1.0
        for t, calibrated in pairs:
            r = quant_range(t)
            if r > calibrated:
                ratio = max(ratio, r / calibrated if calibrated > 0 else math.inf)
        return ratio


@dataclass
class Profile:
    model: str
    key: str
    weights_hash: str
    machine: Dict[str, str]
    input_shape: List[int]
    traced: bool
    trace_error: str
    codecs: List[str]
    compressions: List[str]
    forward_s: float                 # robot time of the whole model (s)
    output_leaves: List[Tuple[int, str]]   # (numel, dtype) of each output tensor
    cuts: List[CutProfile]
    node_s: Dict[str, float] = field(default_factory=dict)
    calibration: int = 1
    created: float = 0.0
    version: int = PROFILE_VERSION
    #: measured server tail times: {"device": ..., "tail_s": {cut id: seconds}}
    server: Dict = field(default_factory=lambda: {"device": "", "tail_s": {}})

    def __post_init__(self):
        self._by_id = {c.id: c for c in self.cuts}
        #: server tail times measured since this object was made (not saved apart from
        #: ``server``): the planner uses these per cut; the saved ones only seed the
        #: server's load factor (:meth:`server_factor`), since the server's load when they
        #: were measured is not its load now
        self.fresh_tail_s: Dict[str, float] = {}

    def cut(self, cut_id: str) -> CutProfile:
        try:
            return self._by_id[cut_id]
        except KeyError:
            raise ConfigError(f"{self.model}: no cut {cut_id[:80]!r} in the profile") from None

    @property
    def candidates(self) -> List[CutProfile]:
        return [c for c in self.cuts if c.candidate]

    @property
    def encodings(self) -> List[str]:
        return [encoding_key(c, z) for c in self.codecs for z in self.compressions]

    @property
    def output_raw_bytes(self) -> int:
        return sum(n * torch.empty((), dtype=getattr(torch, d)).element_size()
                   for n, d in self.output_leaves)

    def record_server_tail(self, cut_id: str, seconds: float, device: str = "", alpha: float = 0.3):
        """Fold one measured server tail time into the profile (exponential average)."""
        if device and device != self.server.get("device"):
            self.server = {"device": device, "tail_s": {}}
            self.fresh_tail_s = {}
        for table in (self.server["tail_s"], self.fresh_tail_s):
            old = table.get(cut_id)
            table[cut_id] = seconds if old is None else (1 - alpha) * old + alpha * seconds

    def server_factor(self, server_speedup: float, device: str = "", min_s: float = 1e-3) -> Optional[float]:
        """The server's load factor implied by the saved server tail times (median over
        cuts of saved time / (robot tail time / ``server_speedup``)), or None without any
        (or when they were measured on another ``device``). It starts the planner where
        the last run left it, instead of at ``server_speedup``'s guess."""
        if device and device != self.server.get("device"):
            return None
        ratios = []
        for cut_id, t in self.server.get("tail_s", {}).items():
            c = self._by_id.get(cut_id)
            if c is not None and c.tail_s > min_s and t > 0:
                ratios.append(t / (c.tail_s / server_speedup))
        return float(statistics.median(ratios)) if ratios else None

    # -- JSON -----------------------------------------------------------------------------
    def to_json(self) -> str:
        d = {k: v for k, v in asdict(self).items()}
        return json.dumps(d, sort_keys=True, allow_nan=True)

    @classmethod
    def from_json(cls, text: str) -> "Profile":
        d = json.loads(text)
        if not isinstance(d, dict) or d.get("version") != PROFILE_VERSION:
            raise ConfigError("profile has another version")
        try:
            d["cuts"] = [CutProfile(**c) for c in d["cuts"]]
            d["output_leaves"] = [(int(n), str(t)) for n, t in d["output_leaves"]]
            p = cls(**d)
        except (TypeError, KeyError, ValueError) as e:
            raise ConfigError(f"malformed profile: {e}") from e
        for c in p.cuts:
            if not isinstance(c.crossing, list) or not all(isinstance(s, str) for s in c.crossing):
                raise ConfigError("malformed profile: crossing names")
            if not all(isinstance(v, dict) for v in (c.bytes, c.encode_s, c.error)):
                raise ConfigError("malformed profile: per-encoding measurements")
            if not (isinstance(c.ranges, list) and all(isinstance(v, (int, float)) for v in c.ranges)):
                raise ConfigError("malformed profile: ranges")
        server = p.server
        if not (isinstance(server, dict) and isinstance(server.get("tail_s"), dict)
                and all(isinstance(v, (int, float)) for v in server["tail_s"].values())):
            p.server = {"device": "", "tail_s": {}}
        return p

    def save(self, directory: str) -> str:
        """Write atomically to ``<directory>/<model>-<key>.json``; returns the path."""
        directory = os.path.expanduser(directory or DEFAULT_PROFILE_DIR)
        os.makedirs(directory, exist_ok=True)
        path = profile_path(directory, self.model, self.key)
        fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(self.to_json())
        os.replace(tmp, path)
        return path


def profile_path(directory: str, model: str, key: str) -> str:
    safe = "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in model)
    return os.path.join(os.path.expanduser(directory or DEFAULT_PROFILE_DIR), f"{safe}-{key[:24]}.json")


# ---------------------------------------------------------------------------------------
# Measuring
# ---------------------------------------------------------------------------------------
def time_nodes(graph: ModelGraph, x: torch.Tensor, repeats: int = 3) -> Tuple[Dict[str, float], float]:
    """Per-node robot times (median of ``repeats`` timed runs after a warm-up), scaled to sum
    to the whole model's forward time, and that forward time (median)."""
    times: Dict[str, List[float]] = {}

    class _Timed(torch.fx.Interpreter):
        def run_node(self, n):
            t0 = time.perf_counter()
            v = super().run_node(n)
            times.setdefault(n.name, []).append(time.perf_counter() - t0)
            return v

    forward = []
    with torch.inference_mode():
        graph.gm(x)
        _Timed(graph.gm).run(x)
        times.clear()
        for _ in range(max(1, repeats)):
            _Timed(graph.gm).run(x)
            t0 = time.perf_counter()
            graph.gm(x)
            forward.append(time.perf_counter() - t0)
    node_s = {k: statistics.median(v) for k, v in times.items()}
    forward_s = statistics.median(forward)
    total = sum(node_s.values())
    if total > 0:
        node_s = {k: v * forward_s / total for k, v in node_s.items()}
    return node_s, forward_s


def _pareto(points: List[Tuple[float, float, int]], slack: float = 1.0) -> set:
    """Indices of the ``(time, bytes, index)`` points that no other point beats with no more
    time and ``slack`` times fewer bytes (``slack`` = 1: the Pareto front)."""
    keep, best = set(), math.inf
    for t, b, i in sorted(points):
        if best * slack > b:
            keep.add(i)
        best = min(best, b)
    return keep


def build_profile(graph: ModelGraph, model_name: str, weights_hash: str,
                  calibration: Sequence[torch.Tensor], codecs: Sequence[str] = DEFAULT_CODECS,
                  compressions: Sequence[str] = DEFAULT_COMPRESSIONS, repeats: int = 3,
                  device: str = "cpu", slack: float = 2.0, max_error: float = 1.0) -> Profile:
    """Measure a :class:`Profile` of ``graph`` on this machine (see the module docstring).

    ``calibration``: inputs of one shape; the first is timed, all are used for sizes and
    errors. ``slack``: how much better a cut may compress than a cut with fewer raw bytes
    and no more head time and still be kept in the first step. Codecs are measured from
    most to fewest bits per cut, and stop after one exceeds ``max_error``."""
    if not calibration:
        raise ConfigError("profiling needs at least one calibration input")
    for c in codecs:
        if c not in codec.CODECS:
            raise ConfigError(f"unknown codec {c!r}")
    for z in compressions:
        if z not in codec.COMPRESSIONS:
            raise ConfigError(f"unknown compression {z!r}")
    x0 = calibration[0]
    shape = [int(s) for s in x0.shape]
    metas, ref0 = graph.record(x0)
    refs = [ref0]
    for x in calibration[1:]:
        if list(x.shape) != shape:
            raise ConfigError("calibration inputs must share one shape")
        with torch.inference_mode():
            refs.append(graph.gm(x))
    node_s, forward_s = time_nodes(graph, x0, repeats)
    leaves, _ = structure.flatten(refs[0])
    output_leaves = [(int(t.numel()), codec.dtype_name(t.dtype)) for t in leaves]

    cuts = graph.enumerate_cuts(metas)
    data_time = {n: node_s.get(n, 0.0) for n in graph.order}
    profiles: List[CutProfile] = []
    for c in cuts:
        head_s = sum(data_time[n] for n in c.head)
        tail_s = sum(data_time[n] for n in c.tail)
        raw = 0 if c.kind == OUTPUT_CUT else sum(metas[n].nbytes for n in c.crossing)
        profiles.append(CutProfile(id=c.id, kind=c.kind, crossing=list(c.crossing), label=c.label,
                                   head_s=head_s, tail_s=tail_s, raw_bytes=int(raw)))
    if cuts[0].kind == INPUT_CUT:
        profiles[0].tail_s = forward_s
    if cuts[-1].kind == OUTPUT_CUT:
        profiles[-1].head_s = forward_s

    # Step 1: cuts not beaten by a faster one with 1/slack of the raw bytes.
    inner = [(p.head_s, float(p.raw_bytes), i) for i, p in enumerate(profiles) if p.kind == "inner"]
    step1 = _pareto(inner, slack) | {i for i, p in enumerate(profiles) if p.kind != "inner"}

    # Bytes and encode time of each crossing tensor, once per tensor (not per cut), taken
    # as the tensor is produced in one run per calibration input.
    encodings = [(cd, z) for cd in codecs for z in compressions]
    need = {n for i in step1 if profiles[i].kind != OUTPUT_CUT for n in profiles[i].crossing}
    per_tensor: Dict[Tuple[str, str], List[Tuple[float, float]]] = {}

    class _Measure(torch.fx.Interpreter):
        def run_node(self, n):
            v = super().run_node(n)
            if n.name in need and isinstance(v, torch.Tensor):
                for cd, z in encodings:
                    t0 = time.perf_counter()
                    enc = codec.encode(v, n.name, cd if _encodable(v, cd) else "raw", z)
                    per_tensor.setdefault((n.name, encoding_key(cd, z)), []).append(
                        (enc.nbytes, time.perf_counter() - t0))
            return v

    with torch.inference_mode():
        for x in calibration:
            _Measure(graph.gm).run(x)
    for i in step1:
        p = profiles[i]
        if p.kind == OUTPUT_CUT:
            p.bytes = {encoding_key(cd, z): 0.0 for cd, z in encodings}
            p.encode_s = dict.fromkeys(p.bytes, 0.0)
            continue
        for cd, z in encodings:
            k = encoding_key(cd, z)
            samples = [per_tensor[(n, k)] for n in p.crossing]
            p.bytes[k] = sum(statistics.fmean(b for b, _ in s) for s in samples)
            p.encode_s[k] = sum(statistics.fmean(t for _, t in s) for s in samples)

    # Step 2: Pareto fronts of (head + encode time, bytes) per encoding.
    candidates = {i for i, p in enumerate(profiles) if p.kind != "inner"}
    for cd, z in encodings:
        k = encoding_key(cd, z)
        pts = [(profiles[i].head_s + profiles[i].encode_s[k], profiles[i].bytes[k], i)
               for i in step1 if profiles[i].kind == "inner"]
        candidates |= _pareto(pts, 1.0)
    for i in candidates:
        profiles[i].candidate = True

    # Step 3: output error of each lossy codec at each candidate cut (DynO's accuracy
    # profile), most bits first; stop once a codec is far beyond any useful tolerance.
    # And the widest range of each crossing tensor, against which frames are checked.
    lossy = sorted((c for c in codecs if c not in LOSSLESS_CODECS),
                   key=lambda c: (_bits(c), c in codec.PER_CHANNEL_BITS), reverse=True)
    for i in sorted(candidates):
        p, cut = profiles[i], cuts[i]
        if p.kind == OUTPUT_CUT or not lossy:
            continue
        heads = []
        with torch.inference_mode():
            for x in calibration:
                heads.append(list(graph.head_module(cut)(x)))
        p.ranges = [max(quant_range(h[k]) for h in heads) for k in range(len(p.crossing))]
        for cd in lossy:
            err = 0.0
            for tensors, ref in zip(heads, refs):
                y = _run_tail(graph, cut, metas, [_round_trip(t, cd) for t in tensors])
                err = max(err, output_error(y, ref))
            p.error[cd] = err
            if err > max_error:
                break

    options = {"codecs": list(codecs), "compressions": list(compressions), "repeats": repeats,
               "calibration": len(calibration), "slack": slack}
    machine = machine_id(device)
    return Profile(model=model_name, key=profile_key(weights_hash, machine, shape, options),
                   weights_hash=weights_hash, machine=machine, input_shape=shape,
                   traced=graph.traced, trace_error=graph.trace_error, codecs=list(codecs),
                   compressions=list(compressions), forward_s=forward_s,
                   output_leaves=output_leaves, cuts=profiles, node_s=node_s,
                   calibration=len(calibration), created=time.time())


def _bits(codec_name: str) -> int:
    return {"raw": 32, "float16": 16}.get(codec_name, codec.quant_bits(codec_name) or 0)


def _encodable(t: torch.Tensor, codec_name: str) -> bool:
    """Whether ``codec.encode`` takes ``t`` with ``codec_name``; where not, the frames send
    it raw (``codec.encode_or_raw``), and so do the measurements here: float16 within its
    range, the integer codecs finite values only (an attention's -inf mask)."""
    if codec_name == "raw" or not t.is_floating_point() or not t.numel():
        return True
    if codec_name == "float16":
        return float(t.abs().max()) <= 65504.0
    return bool(torch.isfinite(t).all())


def _round_trip(t: torch.Tensor, codec_name: str) -> torch.Tensor:
    if not _encodable(t, codec_name):
        codec_name = "raw"
    return codec.decode(codec.encode(t, codec=codec_name), max_bytes=1 << 62)


def _run_tail(graph: ModelGraph, cut: Cut, metas, tensors):
    with torch.inference_mode():
        return graph.tail_module(cut)(*tensors, *graph.static_values(cut, metas))


def options_key(codecs, compressions, repeats, calibration, slack) -> Dict:
    return {"codecs": list(codecs), "compressions": list(compressions), "repeats": repeats,
            "calibration": calibration, "slack": slack}


def load_or_build(directory: str, graph: ModelGraph, model_name: str, weights_hash: str,
                  calibration: Sequence[torch.Tensor], codecs: Sequence[str] = DEFAULT_CODECS,
                  compressions: Sequence[str] = DEFAULT_COMPRESSIONS, repeats: int = 3,
                  device: str = "cpu", slack: float = 2.0, refresh: bool = False,
                  save: bool = True) -> Profile:
    """The cached profile for this model, weights, machine, input shape and options, or a
    freshly measured one (saved) when there is none, it is unreadable, or ``refresh``."""
    shape = [int(s) for s in calibration[0].shape]
    key = profile_key(weights_hash, machine_id(device), shape,
                      options_key(codecs, compressions, repeats, len(calibration), slack))
    path = profile_path(directory, model_name, key)
    if not refresh and os.path.isfile(path):
        try:
            with open(path, encoding="utf-8") as f:
                p = Profile.from_json(f.read())
            if p.key == key:
                log.info("profile of %s loaded from %s", model_name, path)
                return p
            log.warning("profile %s has another key; measuring again", path)
        except (OSError, ValueError, ConfigError) as e:
            log.warning("profile %s unreadable (%s); measuring again", path, e)
    t0 = time.perf_counter()
    p = build_profile(graph, model_name, weights_hash, calibration, codecs, compressions,
                      repeats, device, slack)
    log.info("profiled %s at %s in %.1f s: %d cuts, %d candidates", model_name, shape,
             time.perf_counter() - t0, len(p.cuts), len(p.candidates))
    if save:
        try:
            p.save(directory)
        except OSError as e:
            log.warning("could not save the profile of %s: %s", model_name, e)
    return p
