"""Bandwidth traces: one rate (bit/s of TCP goodput, as iperf reports) every ``step_s``.

Synthetic traces are generated with a fixed default seed, to the statistics the Intra-DP
paper reports for its robot (Sec. 2.1, Fig. 2: iperf saturating the WiFi link, sampled every
0.1 s for 5 minutes): mean 93 Mbit/s indoors; mean 73 Mbit/s outdoors, with frequent drops
to about 0 Mbit/s. The paper gives means and a qualitative description only, so the shape
parameters below are ours and are stated in each trace's ``source``:

- indoor: slow AR(1) (phi 0.98, sd 10 Mbit/s) + fast AR(1) (phi 0.6, sd 8 Mbit/s) around
  the mean, clipped to [5, 200] Mbit/s, then scaled so the mean is exactly 93 Mbit/s.
- outdoor: a Gilbert-Elliott fade process (good->fade 3 % and fade->good 20 % per 0.1 s
  step: fades last 0.5 s on average, ~13 % of the time) on top of an AR(1) good-state rate
  (phi 0.9, sd 25 Mbit/s); in a fade the rate is uniform in [0, 2] Mbit/s. Scaled so the
  mean is exactly 73 Mbit/s.
- steps: a square wave between two rates (default 100 and 5 Mbit/s, 5 s each, starting
  high): the worst case for a predictor that smooths, and for one that trusts one sample.
- walk: a random walk in log(rate) (sd 0.05 per 0.1 s step, reflected at [2, 200] Mbit/s)
  with Markov jumps (2 % per step) to a level drawn log-uniformly in that range. Neither
  model above made it; predictors can be checked on it after being chosen on the others.

Loaders read an iperf3 ``-J`` log or a CSV and resample to 0.1 s by time-weighted
averaging (each source value holds until the next one).
"""

import csv
import json
import math
import os
from dataclasses import dataclass, field

import numpy as np

from robot_offload.errors import ConfigError

STEP_S = 0.1
INDOOR_MEAN_BPS = 93e6
OUTDOOR_MEAN_BPS = 73e6
INDOOR_SEED = 20240093
OUTDOOR_SEED = 20240073
WALK_SEED = 20240002
MBIT = 1e6


@dataclass(frozen=True, eq=False)
class Trace:
    """Rates in bit/s, one per ``step_s`` starting at t = 0; rate i holds on
    [i*step_s, (i+1)*step_s)."""

    rates_bps: np.ndarray
    step_s: float = STEP_S
    name: str = "trace"
    synthetic: bool = False
    source: str = ""
    meta: dict = field(default_factory=dict)

    def __post_init__(self):
        rates = np.asarray(self.rates_bps, dtype=float).reshape(-1)
        if rates.size == 0:
            raise ConfigError(f"trace {self.name!r} has no samples")
        if not np.all(np.isfinite(rates)) or np.any(rates < 0):
            raise ConfigError(f"trace {self.name!r}: rates must be finite and >= 0")
        if not self.step_s > 0:
            raise ConfigError(f"trace {self.name!r}: step_s must be > 0")
        rates.setflags(write=False)
        object.__setattr__(self, "rates_bps", rates)

    def __len__(self):
        return int(self.rates_bps.size)

    @property
    def duration_s(self):
        return len(self) * self.step_s

    @property
    def times_s(self):
        return np.arange(len(self)) * self.step_s

    @property
    def mean_bps(self):
        return float(self.rates_bps.mean())

    def rate_at(self, t_s):
        """Rate at time t_s (the last rate after the end, the first before 0)."""
        i = int(math.floor(t_s / self.step_s + 1e-9))
        return float(self.rates_bps[min(max(i, 0), len(self) - 1)])

    def fraction_below(self, rate_bps):
        return float(np.mean(self.rates_bps < rate_bps))

    def stats(self):
        r = self.rates_bps
        return {"name": self.name, "samples": len(self), "duration_s": self.duration_s,
                "mean_mbps": r.mean() / MBIT, "std_mbps": r.std() / MBIT,
                "p5_mbps": np.percentile(r, 5) / MBIT,
                "p50_mbps": np.percentile(r, 50) / MBIT,
                "p95_mbps": np.percentile(r, 95) / MBIT,
                "min_mbps": r.min() / MBIT, "max_mbps": r.max() / MBIT,
                "frac_below_5mbps": self.fraction_below(5 * MBIT)}

    def resample(self, step_s):
        """The same rate function averaged over bins of ``step_s``."""
        edges = np.arange(len(self) + 1) * self.step_s
        rates = resample_piecewise(edges, self.rates_bps, step_s)
        return Trace(rates, step_s, self.name, self.synthetic, self.source, dict(self.meta))


def constant(rate_bps, duration_s=60.0, step_s=STEP_S):
    """A constant-rate trace."""
    n = max(1, int(round(duration_s / step_s)))
    return Trace(np.full(n, float(rate_bps)), step_s, f"const{rate_bps / MBIT:g}M", True,
                 f"constant {rate_bps / MBIT:g} Mbit/s")


def _ar1(rng, n, phi, sd):
    """Zero-mean stationary AR(1) with lag-1 correlation phi and marginal sd."""
    x = np.empty(n)
    x[0] = rng.normal(0.0, sd)
    innov = rng.normal(0.0, sd * math.sqrt(1.0 - phi * phi), n)
    for i in range(1, n):
        x[i] = phi * x[i - 1] + innov[i]
    return x


def _scale_to_mean(rates, mean_bps):
    return rates * (mean_bps / rates.mean())


def indoor(duration_s=60.0, seed=INDOOR_SEED, mean_bps=INDOOR_MEAN_BPS, step_s=STEP_S):
    """Synthetic indoor WiFi trace (see the module docstring for the model)."""
    n = max(2, int(round(duration_s / step_s)))
    rng = np.random.default_rng(seed)
    rates = (mean_bps + _ar1(rng, n, 0.98, 10 * MBIT) + _ar1(rng, n, 0.6, 8 * MBIT))
    rates = _scale_to_mean(np.clip(rates, 5 * MBIT, 200 * MBIT), mean_bps)
    return Trace(rates, step_s, "indoor", True,
                 f"synthetic indoor: AR(1) phi .98 sd 10 + AR(1) phi .6 sd 8 Mbit/s, "
                 f"clip [5,200], scaled to mean {mean_bps / MBIT:g} Mbit/s "
                 f"(Intra-DP Sec. 2.1); seed {seed}", {"seed": seed})


def outdoor(duration_s=60.0, seed=OUTDOOR_SEED, mean_bps=OUTDOOR_MEAN_BPS, step_s=STEP_S,
            p_fade=0.03, p_recover=0.2):
    """Synthetic outdoor WiFi trace with fades to ~0 (see the module docstring)."""
    n = max(2, int(round(duration_s / step_s)))
    rng = np.random.default_rng(seed)
    good_fraction = p_recover / (p_fade + p_recover)
    good_mean = mean_bps / good_fraction
    good = np.clip(good_mean + _ar1(rng, n, 0.9, 25 * MBIT), 10 * MBIT, 250 * MBIT)
    fade_rate = rng.uniform(0.0, 2 * MBIT, n)
    u = rng.random(n)
    in_fade = np.zeros(n, dtype=bool)
    in_fade[0] = u[0] < 1.0 - good_fraction
    for i in range(1, n):
        in_fade[i] = (u[i] >= p_recover) if in_fade[i - 1] else (u[i] < p_fade)
    rates = np.where(in_fade, fade_rate, good)
    # Scale only the good state, so fades stay near zero.
    fade_sum = rates[in_fade].sum()
    rates[~in_fade] *= (mean_bps * n - fade_sum) / rates[~in_fade].sum()
    return Trace(rates, step_s, "outdoor", True,
                 f"synthetic outdoor: Gilbert-Elliott fades (p_fade {p_fade}, p_recover "
                 f"{p_recover} per step; fade rate U[0,2] Mbit/s) + AR(1) phi .9 sd 25 "
                 f"Mbit/s, scaled to mean {mean_bps / MBIT:g} Mbit/s (Intra-DP Sec. 2.1); "
                 f"seed {seed}", {"seed": seed, "fade_fraction": float(in_fade.mean())})


def steps(duration_s=60.0, high_bps=100 * MBIT, low_bps=5 * MBIT, period_s=5.0,
          step_s=STEP_S):
    """``high_bps`` for ``period_s``, then ``low_bps`` for ``period_s``, and so on."""
    if not (high_bps >= 0 and low_bps >= 0 and period_s >= step_s):
        raise ConfigError("steps: rates must be >= 0 and the period at least one step")
    n = max(2, int(round(duration_s / step_s)))
    per = int(round(period_s / step_s))
    rates = np.where((np.arange(n) // per) % 2 == 0, float(high_bps), float(low_bps))
    return Trace(rates, step_s, "steps", True,
                 f"synthetic steps: {high_bps / MBIT:g} / {low_bps / MBIT:g} Mbit/s, "
                 f"switching every {period_s:g} s", {"period_s": float(period_s)})


def walk(duration_s=60.0, seed=WALK_SEED, step_s=STEP_S, low_bps=2 * MBIT,
         high_bps=200 * MBIT, sd_log=0.05, p_jump=0.02):
    """Log-rate random walk with Markov jumps (see the module docstring)."""
    if not 0 < low_bps < high_bps or not sd_log >= 0 or not 0 <= p_jump <= 1:
        raise ConfigError("walk: need 0 < low < high, sd_log >= 0, p_jump in [0, 1]")
    n = max(2, int(round(duration_s / step_s)))
    rng = np.random.default_rng(seed)
    lo, hi = math.log(low_bps), math.log(high_bps)
    noise = rng.normal(0.0, sd_log, n)
    jump = rng.random(n) < p_jump
    levels = rng.uniform(lo, hi, n)
    x = np.empty(n)
    x[0] = levels[0]
    for i in range(1, n):
        v = levels[i] if jump[i] else x[i - 1] + noise[i]
        if v < lo:           # reflect at the bounds
            v = 2 * lo - v
        elif v > hi:
            v = 2 * hi - v
        x[i] = min(max(v, lo), hi)
    return Trace(np.exp(x), step_s, "walk", True,
                 f"synthetic walk: log-rate random walk sd {sd_log:g} per step in "
                 f"[{low_bps / MBIT:g}, {high_bps / MBIT:g}] Mbit/s, jumps {p_jump:g} per "
                 f"step to a log-uniform level; seed {seed}",
                 {"seed": seed, "jumps": int(jump[1:].sum())})


SYNTHETIC = {"indoor": indoor, "outdoor": outdoor, "steps": steps, "walk": walk}
#: The synthetic traces that take a seed (``walk:7``).
SEEDED = ("indoor", "outdoor", "walk")


def from_spec(spec, duration_s=60.0):
    """A trace from its name: ``const:MBPS``, a synthetic trace (``indoor``, ``outdoor``,
    ``steps``, ``walk``; ``NAME:SEED`` for another seed of a seeded one), ``iperf:PATH``
    or ``csv:PATH``. Raises ConfigError for anything else."""
    kind, _, arg = str(spec).partition(":")
    known = f"use const:MBPS, {', '.join(SYNTHETIC)} (NAME:SEED), iperf:PATH, csv:PATH"
    try:
        if kind == "const":
            return constant(float(arg) * MBIT, duration_s)
        if kind in SYNTHETIC and not arg:
            return SYNTHETIC[kind](duration_s=duration_s)
        if kind in SEEDED:
            t = SYNTHETIC[kind](duration_s=duration_s, seed=int(arg))
            return Trace(t.rates_bps, t.step_s, f"{kind}:{int(arg)}", True, t.source, t.meta)
    except ValueError as e:
        raise ConfigError(f"bad trace {spec!r}: {e}; {known}") from e
    if kind == "iperf" and arg:
        return load_iperf3_json(arg)
    if kind == "csv" and arg:
        return load_csv(arg)
    raise ConfigError(f"unknown trace {spec!r}: {known}")


def resample_piecewise(edges_s, values, step_s=STEP_S):
    """Average a piecewise-constant function (value i on [edges[i], edges[i+1])) over
    consecutive bins of ``step_s`` starting at edges[0]. A final partial bin is kept if it
    covers at least half a step (averaged over the part covered)."""
    edges = np.asarray(edges_s, dtype=float) - float(edges_s[0])
    values = np.asarray(values, dtype=float)
    if edges.size != values.size + 1 or np.any(np.diff(edges) <= 0):
        raise ConfigError("resample: need increasing edges, one more than values")
    cum = np.concatenate([[0.0], np.cumsum(values * np.diff(edges))])
    total = edges[-1]
    n_full = int(math.floor(total / step_s + 1e-9))
    bin_edges = list(np.arange(n_full + 1) * step_s)
    if total - bin_edges[-1] >= step_s / 2 - 1e-9 or n_full == 0:
        bin_edges.append(total)
    bin_edges = np.asarray(bin_edges)
    integral = np.interp(bin_edges, edges, cum)
    return np.diff(integral) / np.diff(bin_edges)


def _hold_edges(times_s, default_step_s):
    """Edges for sample-and-hold values at times_s (the last holds a typical step)."""
    t = np.asarray(times_s, dtype=float)
    if np.any(np.diff(t) <= 0):
        raise ConfigError("time_s must be strictly increasing")
    last = float(np.median(np.diff(t))) if t.size > 1 else default_step_s
    return np.concatenate([t, [t[-1] + last]])


def load_iperf3_json(path, step_s=STEP_S, name=None):
    """A trace from ``iperf3 -J`` output: intervals[].sum.bits_per_second over
    [start, end) (``seconds`` if end is absent), omitted intervals skipped."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    edges, values = [], []
    for iv in data.get("intervals", []):
        s = iv.get("sum")
        if s is None:
            streams = iv.get("streams", [])
            if not streams:
                continue
            s = {"start": streams[0]["start"], "end": streams[0]["end"],
                 "bits_per_second": sum(x["bits_per_second"] for x in streams)}
        if s.get("omitted"):
            continue
        start = float(s["start"])
        end = float(s["end"]) if "end" in s else start + float(s["seconds"])
        if edges and abs(edges[-1] - start) > 1e-3:
            raise ConfigError(f"{path}: intervals are not contiguous at {start} s")
        if not edges:
            edges.append(start)
        edges.append(end)
        values.append(float(s["bits_per_second"]))
    if not values:
        raise ConfigError(f"{path}: no intervals[].sum.bits_per_second in iperf3 JSON")
    stem = os.path.splitext(os.path.basename(path))[0]
    return Trace(resample_piecewise(edges, values, step_s), step_s, name or stem, False,
                 f"iperf3 -J log {os.path.basename(path)} ({len(values)} intervals)")


def load_csv(path, step_s=STEP_S, name=None):
    """A trace from a CSV with columns time_s and rate_bps or rate_mbps (lines starting
    with '#' are comments). Each rate holds until the next row's time."""
    times, rates = [], []
    with open(path, encoding="utf-8", newline="") as f:
        rows = csv.DictReader(line for line in f if line.strip() and not line.startswith("#"))
        fields = [c.strip() for c in (rows.fieldnames or [])]
        if "time_s" not in fields:
            raise ConfigError(f"{path}: need a time_s column, got {fields}")
        if "rate_bps" in fields:
            col, scale = "rate_bps", 1.0
        elif "rate_mbps" in fields:
            col, scale = "rate_mbps", MBIT
        else:
            raise ConfigError(f"{path}: need a rate_bps or rate_mbps column, got {fields}")
        for row in rows:
            row = {k.strip(): v for k, v in row.items() if k is not None}
            times.append(float(row["time_s"]))
            rates.append(float(row[col]) * scale)
    if not rates:
        raise ConfigError(f"{path}: no rows")
    edges = _hold_edges(times, step_s)
    stem = os.path.splitext(os.path.basename(path))[0]
    return Trace(resample_piecewise(edges, rates, step_s), step_s, name or stem, False,
                 f"csv {os.path.basename(path)} ({len(rates)} rows, {col})")


def to_csv(trace, path):
    """Write time_s,rate_bps rows, with a '#' line giving name, step and source."""
    with open(path, "w", encoding="utf-8", newline="") as f:
        f.write(f"# name={trace.name} step_s={trace.step_s:g} synthetic={trace.synthetic} "
                f"source={trace.source}\n")
        w = csv.writer(f)
        w.writerow(["time_s", "rate_bps"])
        for t, r in zip(trace.times_s, trace.rates_bps):
            w.writerow([f"{t:.3f}", f"{r:.1f}"])
    return path
