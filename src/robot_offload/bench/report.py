"""Turn benchmark rows into the report: CSV, a Markdown table, PNG plots, the offline
predictor evaluation, the bandwidth estimates the frames used and the physical-limit check."""

import csv
import math
import os
from types import SimpleNamespace
from typing import Dict, List, Sequence

import numpy as np

from robot_offload.bandwidth import frame_transfer, score_predictors
from robot_offload.bench.predictors import HORIZONS_S, mean_rate, online_predictions, score_online
from robot_offload.partition.graph import OUTPUT_CUT_LABEL
from robot_offload.report import markdown_table, summarise
from robot_offload.testbed.netns import BURST_S

KEYS = ("model", "trace", "mode_asked")


def frame_rows(rows: Sequence[dict]) -> List[dict]:
    return [r for r in rows if not r.get("bandwidth")]


def write_csv(rows: Sequence[dict], path: str) -> None:
    fields = sorted({k for r in rows for k in r})
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for r in rows:
            w.writerow(r)


def transfer_floor_s(nbytes: float, rate_bps: float) -> float:
    """The least time ``nbytes`` take through the testbed's shaper at ``rate_bps``: what
    exceeds its bucket (:data:`robot_offload.testbed.netns.BURST_S` of the rate, which a
    link idle before the frame passes at line rate) at the rate."""
    return max(0.0, nbytes - rate_bps / 8 * BURST_S) * 8 / rate_bps


def physical_limit_s(row: dict, rate_bps: float) -> float:
    """The least latency a ``full_offload`` frame can have at ``rate_bps`` (both ways):
    its input up and its output down at that rate (less the shaper's bucket each way,
    :func:`transfer_floor_s`), the server's compute as the server reported it, and one
    request's round trip (``request_rtt_ms``, an empty Ping over the client's connection;
    0 where it was not measured)."""
    rtt_ms = float(row.get("request_rtt_ms", float("nan")))
    rtt_s = rtt_ms / 1e3 if np.isfinite(rtt_ms) else 0.0
    return (transfer_floor_s(row["bytes_up"], rate_bps) + transfer_floor_s(row.get("bytes_down", 0), rate_bps)
            + row.get("server_compute_s", 0.0) + rtt_s)


def constant_rate(trace) -> float:
    """The trace's rate (bit/s) where it is constant, else nan."""
    if trace is None or np.ptp(trace.rates_bps) > 0:
        return float("nan")
    return float(trace.rates_bps[0])


def add_physical_limits(rows: Sequence[dict], traces: Dict[str, object]) -> None:
    """``physical_limit_s`` and ``latency_over_limit`` on every ``full_offload`` frame of a
    constant-rate trace (the rate a frame met on a varying trace is not recorded)."""
    for r in rows:
        rate = constant_rate(traces.get(r.get("trace")))
        if r.get("executed_mode") == "full_offload" and np.isfinite(rate) and not r.get("lost"):
            r["physical_limit_s"] = physical_limit_s(r, rate)
            r["latency_over_limit"] = r["latency_s"] / r["physical_limit_s"]


def physical_limit_check(rows: Sequence[dict], traces: Dict[str, object]) -> List[str]:
    """Full offload cannot beat the input's transfer time at the set rate: for every
    full_offload frame on a constant-rate trace, latency >= bytes_up * 8 / rate. Returns
    one line per (model, trace), with the median physical limit (:func:`physical_limit_s`)
    and latency / limit, and a FAIL line per violating frame."""
    lines = []
    for (model, trace), rs in _group(rows, ("model", "trace")).items():
        rate = constant_rate(traces.get(trace))
        if not np.isfinite(rate):
            continue
        offl = [r for r in rs if r.get("executed_mode") == "full_offload"]
        bad = [r for r in offl if r["latency_s"] < transfer_floor_s(r["bytes_up"], rate)]
        floor_ms = 1e3 * min((transfer_floor_s(r["bytes_up"], rate) for r in offl), default=float("nan"))
        min_ms = 1e3 * min((r["latency_s"] for r in offl), default=float("nan"))
        line = (f"{'FAIL' if bad else 'ok'}: {model} @ {trace}: {len(offl)} full_offload frames, "
                f"min latency {min_ms:.1f} ms >= input transfer {floor_ms:.1f} ms at {rate / 1e6:g} Mbit/s"
                + (f" -- {len(bad)} frames below the physical limit" if bad else ""))
        if offl:
            def med(values):
                return 1e3 * float(np.median(values))
            limits = [physical_limit_s(r, rate) for r in offl]
            ratios = [r["latency_s"] / lim for r, lim in zip(offl, limits)]
            rtt = [float(r.get("request_rtt_ms", float("nan"))) for r in offl]
            line += (f"; limit {med(limits):.1f} ms (input {med([transfer_floor_s(r['bytes_up'], rate) for r in offl]):.1f}"
                     f" + server {med([r.get('server_compute_s', 0.0) for r in offl]):.1f}"
                     f" + output {med([transfer_floor_s(r.get('bytes_down', 0), rate) for r in offl]):.1f}"
                     f" + RTT {float(np.median(rtt)):.1f} ms"
                     + ("" if np.isfinite(np.median(rtt)) else ", not measured: 0")
                     + f"), latency / limit {float(np.median(ratios)):.2f} (min {min(ratios):.2f})")
        lines.append(line)
    return lines


def _group(rows, keys):
    out = {}
    for r in rows:
        out.setdefault(tuple(r[k] for k in keys), []).append(r)
    return out


def comparison_table(rows: Sequence[dict]) -> str:
    """Per model and trace: median latency of each mode side by side, and the ratios the
    issues' targets are stated in (layer_partition against the better of local and
    full_offload; lop against layer_partition and against the best other mode)."""
    frames = [r for r in rows if not r.get("lost")]
    modes = sorted({r["mode_asked"] for r in frames})
    lines = ["| model | trace | " + " | ".join(f"{m} ms" for m in modes)
             + " | LP / min(local, full) | lop / LP | lop / best other | its 95 % CI |",
             "|---|---|" + "---|" * (len(modes) + 4)]
    for (model, trace), rs in sorted(_group(frames, ("model", "trace")).items()):
        med = {m: float(np.median([r["latency_s"] for r in rs if r["mode_asked"] == m])) * 1e3
               for m in modes if any(r["mode_asked"] == m for r in rs)}

        def ratio(a, bs):
            bs = [med[b] for b in bs if b in med]
            return f"{med[a] / min(bs):.2f}" if a in med and bs else "n/a"

        others = [m for m in med if m != "lop"]
        ci = "n/a"
        if "lop" in med and others:
            best = min(others, key=lambda m: med[m])
            lo, hi = paired_ratio_ci([r for r in rs if r["mode_asked"] == "lop"],
                                     [r for r in rs if r["mode_asked"] == best])
            ci = f"{lo:.2f}-{hi:.2f}" if np.isfinite(lo) else "n/a"
        lines.append(f"| {model} | {trace} | " + " | ".join(f"{med[m]:.0f}" if m in med else "n/a"
                                                           for m in modes)
                     + f" | {ratio('layer_partition', ['local', 'full_offload'])}"
                     f" | {ratio('lop', ['layer_partition'])} | {ratio('lop', others)} | {ci} |")
    return "\n".join(lines)


def paired_ratio_ci(a_rows: Sequence[dict], b_rows: Sequence[dict], level: float = 0.95,
                    n_boot: int = 2000, seed: int = 0):
    """A bootstrap confidence interval of median(a) / median(b) latency, resampling the
    frame numbers both modes ran (with ``--interleave`` frame i of every mode ran back to
    back, so a drift of the shared machine moves both; resampling pairs keeps that).
    (nan, nan) with fewer than 5 common frames. Why: on 30 ms frames the testbed's
    frame-to-frame spread is 10-20 %, so a 1.04x ratio of medians over 40 frames is no
    measured difference unless its interval says so."""
    a = {r.get("frame"): r["latency_s"] for r in a_rows}
    b = {r.get("frame"): r["latency_s"] for r in b_rows}
    a.pop(None, None)
    b.pop(None, None)
    common = sorted(set(a) & set(b))
    if len(common) < 5:
        return float("nan"), float("nan")
    av = np.array([a[f] for f in common], dtype=float)
    bv = np.array([b[f] for f in common], dtype=float)
    idx = np.random.default_rng(seed).integers(0, len(common), size=(n_boot, len(common)))
    ratios = np.median(av[idx], axis=1) / np.median(bv[idx], axis=1)
    tail = (1.0 - level) / 2.0
    return float(np.quantile(ratios, tail)), float(np.quantile(ratios, 1.0 - tail))


#: the per-window oracle's window of trace time (s)
ORACLE_WINDOW_S = 1.0


def oracle_latencies(rows: Sequence[dict], chooser: str = "auto",
                     window_s: float = ORACLE_WINDOW_S, metric: str = "latency_s") -> Dict[str, Dict[int, float]]:
    """For one cell of an interleaved run (every mode ran frame i at the same point of the
    trace): per frame number, the ``metric`` (``latency_s``, or ``energy_j``: joules per
    inference) of ``chooser`` and of three references built from the fixed modes (every
    other mode) on the same frames, each chosen by that metric:

    - ``best_fixed``: the fixed mode with the lowest median over the cell;
    - ``oracle``: a hindsight oracle that knows the trace, per ``window_s`` of it the fixed
      mode with the lowest median latency in that window (per window, so that frame-to-frame
      noise does not flatter it);
    - ``frame_min``: the fastest fixed mode of each frame (for information: unattainable).

    Only frames that ``chooser`` and every fixed mode ran are kept."""
    by_mode: Dict[str, Dict[int, dict]] = {}
    for r in rows:
        if not r.get("lost") and r.get("frame") is not None:
            by_mode.setdefault(r["mode_asked"], {})[r["frame"]] = r
    fixed = sorted(m for m in by_mode if m != chooser)
    if chooser not in by_mode or not fixed:
        return {}
    frames = sorted(set(by_mode[chooser]).intersection(*(set(by_mode[m]) for m in fixed)))
    if not frames:
        return {}
    lat = {m: {f: float(by_mode[m][f][metric]) for f in frames} for m in fixed}
    best = min(fixed, key=lambda m: float(np.median(list(lat[m].values()))))
    windows: Dict[int, List[int]] = {}
    for f in frames:
        windows.setdefault(int(_trace_time(by_mode[chooser][f]) // window_s), []).append(f)
    oracle = {}
    for fs in windows.values():
        m = min(fixed, key=lambda m: float(np.median([lat[m][f] for f in fs])))
        oracle.update({f: lat[m][f] for f in fs})
    return {chooser: {f: float(by_mode[chooser][f][metric]) for f in frames},
            "best_fixed": {f: lat[best][f] for f in frames}, "oracle": oracle,
            "frame_min": {f: min(lat[m][f] for m in fixed) for f in frames},
            "best_fixed_mode": best}


def paired_mean_ratio_ci(a: Dict[int, float], b: Dict[int, float], level: float = 0.95,
                         n_boot: int = 2000, seed: int = 0):
    """A bootstrap interval of mean(a) / mean(b) over the frame numbers both have,
    resampled in pairs; (nan, nan) with fewer than 5."""
    common = sorted(set(a) & set(b))
    if len(common) < 5:
        return float("nan"), float("nan")
    av = np.array([a[f] for f in common])
    bv = np.array([b[f] for f in common])
    idx = np.random.default_rng(seed).integers(0, len(common), size=(n_boot, len(common)))
    ratios = av[idx].mean(axis=1) / bv[idx].mean(axis=1)
    tail = (1.0 - level) / 2.0
    return float(np.quantile(ratios, tail)), float(np.quantile(ratios, 1.0 - tail))


def oracle_table(rows: Sequence[dict], chooser: str = "auto", metric: str = "latency_s") -> str:
    """Per model and trace of an interleaved run: ``chooser``'s mean and median latency
    (or, with ``metric="energy_j"``, joules per inference, in mJ) against the best fixed
    mode and the per-window hindsight oracle (mean ratios with paired 95 % intervals),
    and the per-frame minimum for information."""
    unit = "mJ" if metric == "energy_j" else "ms"
    lines = [f"| model | trace | frames | {chooser} mean / median {unit} | best fixed (mean {unit}) | "
             f"oracle mean {unit} | frame-min mean {unit} | {chooser} / best fixed (95 % CI) | "
             f"{chooser} / oracle (95 % CI) |", "|---|---|---|---|---|---|---|---|---|"]
    for (model, trace), rs in sorted(_group([r for r in rows if not r.get("lost")],
                                            ("model", "trace")).items()):
        o = oracle_latencies(rs, chooser, metric=metric)
        if not o:
            continue
        a = o[chooser]
        mean = {k: 1e3 * float(np.mean(list(o[k].values()))) for k in (chooser, "best_fixed", "oracle", "frame_min")}

        def ratio(ref):
            lo, hi = paired_mean_ratio_ci(a, o[ref])
            r = mean[chooser] / mean[ref]
            return f"{r:.3f} ({lo:.3f}-{hi:.3f})" if np.isfinite(lo) else f"{r:.3f} (n/a)"

        lines.append(f"| {model} | {trace} | {len(a)} | {mean[chooser]:.1f} / "
                     f"{1e3 * float(np.median(list(a.values()))):.1f} | {o['best_fixed_mode']} "
                     f"({mean['best_fixed']:.1f}) | {mean['oracle']:.1f} | {mean['frame_min']:.1f} | "
                     f"{ratio('best_fixed')} | {ratio('oracle')} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def deadline_table(rows: Sequence[dict], deadline_s: float) -> str:
    """Per model and trace: for every mode, the share of frames that met ``deadline_s`` and
    the mean joules per inference (mJ): what ``~objective: deadline`` trades (the fewest
    joules of the ways that meet the deadline)."""
    frames = [r for r in rows if not r.get("lost")]
    modes = sorted({r["mode_asked"] for r in frames})
    lines = ["| model | trace | " + " | ".join(f"{m} met % / mJ" for m in modes) + " |",
             "|---|---|" + "---|" * len(modes)]
    for (model, trace), rs in sorted(_group(frames, ("model", "trace")).items()):
        cells = []
        for m in modes:
            ms = [r for r in rs if r["mode_asked"] == m]
            if not ms:
                cells.append("")
                continue
            met = 100.0 * np.mean([float(r["latency_s"]) <= deadline_s for r in ms])
            cells.append(f"{met:.0f} / {1e3 * float(np.nanmean([float(r.get('energy_j', 'nan')) for r in ms])):.0f}")
        lines.append(f"| {model} | {trace} | " + " | ".join(cells) + " |")
    return "\n".join(lines) if len(lines) > 2 else ""


def prediction_table(rows: Sequence[dict]) -> str:
    """The cost model's predicted latency against the measured one, per model and mode
    (frames with a prediction: layer_partition, lop, and auto per candidate), with the
    plans they ran."""
    frames = [r for r in rows if not r.get("lost") and r.get("executed_mode") == r.get("mode_asked")
              and np.isfinite(float(r.get("predicted_latency_s", float("nan"))))]
    lines = ["| model | mode | frames | median predicted ms | median measured ms | "
             "median abs. error % | plans (frames) |", "|---|---|---|---|---|---|---|"]
    # auto: one row per candidate it ran (its plan starts with auto:<candidate>)
    frames = [dict(r, mode_asked=str(r.get("plan", "")).split(" ")[0]) if r.get("mode_asked") == "auto"
              else r for r in frames]
    for (model, mode), rs in sorted(_group(frames, ("model", "mode_asked")).items()):
        pred = np.array([float(r["predicted_latency_s"]) for r in rs])
        act = np.array([float(r["latency_s"]) for r in rs])
        plans: Dict[str, int] = {}
        for r in rs:
            plans[str(r.get("plan", ""))] = plans.get(str(r.get("plan", "")), 0) + 1
        top = "; ".join(f"{p} ({n})" for p, n in sorted(plans.items(), key=lambda kv: -kv[1])[:3])
        lines.append(f"| {model} | {mode} | {len(rs)} | {1e3 * np.median(pred):.0f} | "
                     f"{1e3 * np.median(act):.0f} | {100 * np.median(np.abs(pred - act) / act):.0f} | {top} |")
    return "\n".join(lines)


def compute_ratio_table(rows: Sequence[dict]) -> str:
    """Robot / server compute ratio per model: the median robot compute of ``local`` frames
    over the median server compute of ``full_offload`` frames (same frames, one run)."""
    frames = [r for r in rows if not r.get("lost")]
    lines = ["| model | robot forward ms (local) | server forward ms (full_offload) | ratio |",
             "|---|---|---|---|"]
    for (model,), rs in sorted(_group(frames, ("model",)).items()):
        robot = [r["robot_compute_s"] for r in rs if r.get("executed_mode") == "local"
                 and r["mode_asked"] == "local"]
        server = [r["server_compute_s"] for r in rs if r.get("executed_mode") == "full_offload"]
        if robot and server:
            a, b = 1e3 * float(np.median(robot)), 1e3 * float(np.median(server))
            lines.append(f"| {model} | {a:.0f} | {b:.0f} | {a / b:.2f} |")
    return "\n".join(lines)


def ran_all_on_robot(row: dict) -> bool:
    """The frame computed the whole model on the robot: a ``local`` frame (asked or
    fallen back to), or a planner's all-local plan."""
    return row.get("executed_mode") == "local" or OUTPUT_CUT_LABEL in str(row.get("plan", ""))


def same_work_table(rows: Sequence[dict], min_frames: int = 5) -> str:
    """The noise floor of a run: per model and trace, the median latency of the frames that
    computed the whole model on the robot, in each mode that ran at least ``min_frames``
    of them, and the largest over the smallest of those medians. It is the same work
    (the model's own forward on the same frames), so the spread is the testbed's: a mode
    ratio smaller than it, in that cell, is not a measured difference."""
    frames = [r for r in rows if not r.get("lost") and ran_all_on_robot(r)]
    modes = sorted({r["mode_asked"] for r in frames})
    lines = ["| model | trace | " + " | ".join(f"{m} ms (frames)" for m in modes) + " | max / min |",
             "|---|---|" + "---|" * (len(modes) + 1)]
    for (model, trace), rs in sorted(_group(frames, ("model", "trace")).items()):
        cells, med = [], {}
        for m in modes:
            lat = [r["latency_s"] for r in rs if r["mode_asked"] == m]
            if len(lat) >= min_frames:
                med[m] = float(np.median(lat)) * 1e3
            cells.append(f"{med[m]:.1f} ({len(lat)})" if m in med else (f"({len(lat)})" if lat else ""))
        if len(med) < 2:
            continue
        lines.append(f"| {model} | {trace} | " + " | ".join(cells)
                     + f" | {max(med.values()) / min(med.values()):.2f} |")
    return "\n".join(lines)


def predictor_table(traces: Sequence[object]) -> str:
    scored, rows = score_predictors(traces)
    names = [p.name for _, p in scored]
    lines = ["| predictor | " + " | ".join(f"{t.name} MAE Mbit/s" for t in traces) + " | mean |",
             "|---|" + "---|" * (len(traces) + 1)]
    for score, p in scored:
        per = [next(r["mae_bps"] for r in rows if r["predictor"] == p.name and r["trace"] == t.name)
               for t in traces]
        lines.append(f"| {p.name} | " + " | ".join(f"{v / 1e6:.2f}" for v in per) + f" | {score / 1e6:.2f} |")
    lines.append(f"\nBest (lowest mean MAE at a 100 ms horizon): **{names[0]}**")
    return "\n".join(lines)


def _trace_time(row: dict) -> float:
    """Where in the trace the frame started: ``trace_s`` in a paired run (every mode's frame
    i at the same point), else its start since the trace did."""
    t = row.get("trace_s")
    return row["t_s"] if t in (None, "") else t


#: The columns of :func:`frames_online_table` besides the estimate the frames used:
#: (heading, predictor, burst).
REPLAYS = (("last", "last", None), ("harmonic(5)", "harmonic(5)", None),
           ("kalman", "kalman", None), ("last, burst learned", "last", "learn"))


def _frame_transfer(row):
    """(start, end, bytes, floor_only, acked) of the one call a bench frame row made, or None (see
    :func:`robot_offload.bandwidth.frame_transfer`)."""
    try:     # numbers, or the strings of a frames.csv
        stats = SimpleNamespace(round_trips=int(float(row["round_trips"])),
                                transfer_s=float(row["transfer_s"]), executed_mode=row["executed_mode"],
                                bytes_up=int(float(row["bytes_up"])), bytes_down=int(float(row["bytes_down"])),
                                detail_json=row.get("detail_json") or "")
        sample = frame_transfer(stats, float(row["t_s"]) + float(row["latency_s"]))
    except (KeyError, TypeError, ValueError, OverflowError):
        return None
    return None if sample is None else (sample.t_s - sample.duration_s, sample.t_s, sample.bytes,
                                        sample.floor_only, sample.acked)


def _finite(v):
    """``v`` as a finite float, or None."""
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def frames_online_table(frames, traces, horizons=HORIZONS_S, replays=REPLAYS) -> str:
    """Markdown: per trace (over its models), the bandwidth estimate each bench frame
    used (``predicted_bandwidth_bps``), and the frames' own transfers replayed through
    :class:`~robot_offload.bandwidth.PassiveEstimator` with other predictors
    (``replays``), against the mean rate the trace set over the next ``h`` from where the
    frame started (:func:`_trace_time`; a repeated trace wraps). MAE Mbit/s at each horizon;
    at the first, MAPE % and the share of estimates below half the rate. ``frames``: rows
    in memory or of a frames.csv (lost ones skipped)."""
    by_name = {t.name: t for t in traces}
    cols = ["used by the frames"] + [name for name, _, _ in replays]
    kept = [r for r in frames if r.get("lost") not in (True, "True")]
    acc = {}
    for (model, trace_name), rs in sorted(_group(kept, ("model", "trace")).items()):
        trace = by_name.get(trace_name)
        if trace is None:
            continue
        rs = sorted(rs, key=lambda r: float(r["t_s"]))
        pos = [float(_trace_time(r)) % trace.duration_s for r in rs]
        cell = acc.setdefault(trace_name, {c: {h: ([], []) for h in horizons} for c in cols})
        for r, p in zip(rs, pos):
            bw = _finite(r.get("predicted_bandwidth_bps"))
            if bw is not None and bw > 0:
                for h in horizons:
                    if p + h <= trace.duration_s:
                        cell[cols[0]][h][0].append(bw)
                        cell[cols[0]][h][1].append(mean_rate(trace, p, p + h))
        transfers = [x for x in map(_frame_transfer, rs) if x is not None]
        instants = [(float(r["t_s"]), p) for r, p in zip(rs, pos)]
        for name, spec, burst in replays:
            got = online_predictions(transfers, instants, trace, spec, horizons, burst=burst)
            for h in horizons:
                cell[name][h][0].extend(got[h][0])
                cell[name][h][1].extend(got[h][1])
    if not acc:
        return ""
    hs = " / ".join(f"{1e3 * h:g}" for h in horizons)
    lines = ["| trace | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]
    for name, cell in acc.items():
        out = []
        for c in cols:
            sc = [score_online(*cell[c][h]) for h in horizons]
            out.append("-" if not sc[0]["n"] else " / ".join(f"{x['mae_bps'] / 1e6:.1f}" for x in sc)
                       + f" ({sc[0]['mape_pct']:.0f} %, {sc[0]['below_half_pct']:.0f} %)")
        lines.append(f"| {name} | " + " | ".join(out) + " |")
    return (f"MAE Mbit/s {hs} ms ahead (MAPE, and the share of frames whose estimate was "
            f"below half the rate: a false drop, at {1e3 * horizons[0]:g} ms), at each frame's "
            "start, against the mean rate the trace set from there.\n\n" + "\n".join(lines))


def plots(rows: Sequence[dict], applied: Dict[str, list], out_dir: str) -> List[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    paths = []
    for (model, trace), rs in _group(frame_rows(rows), ("model", "trace")).items():
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
        for mode, ms in _group(rs, ("mode_asked",)).items():
            lat = np.sort([1e3 * r["latency_s"] for r in ms if not r.get("lost")])
            if lat.size:
                ax1.step(lat, np.arange(1, lat.size + 1) / lat.size, where="post", label=mode[0])
                ts = [_trace_time(r) for r in ms if not r.get("lost")]
                ax2.plot(ts, [1e3 * r["latency_s"] for r in ms if not r.get("lost")], "o-", ms=3,
                         label=f"{mode[0]} latency")
        ax1.set_xlabel("latency (ms)")
        ax1.set_ylabel("fraction of frames")
        ax1.set_title(f"{model} @ {trace}: latency CDF")
        ax1.grid(alpha=0.3)
        ax1.legend()
        ax2.set_xlabel("time since the trace started (s)")
        ax2.set_ylabel("latency (ms)")
        ax2.set_title("latency and link rate over time")
        ax2.grid(alpha=0.3)
        if applied.get(trace):
            # by trace position: a paired run seeks back for every mode's frame
            t, rate = zip(*sorted(applied[trace], key=lambda a: a[0]))
            axr = ax2.twinx()
            axr.step(t, np.array(rate) / 1e6, where="post", color="grey", alpha=0.5, label="link rate")
            axr.set_ylabel("link rate (Mbit/s)")
            end = max((_trace_time(r) + r.get("latency_s", 0) for r in rs), default=0) + 1
            ax2.set_xlim(0, end)
        ax2.legend(loc="upper left")
        fig.tight_layout()
        path = os.path.join(out_dir, f"latency-{model}-{trace}.png")
        fig.savefig(path, dpi=90)
        plt.close(fig)
        paths.append(path)
    return paths


def write_report(rows, runner, traces, out_dir, command: str) -> str:
    frames = [r for r in frame_rows(rows) if not r.get("lost")]
    lost = [r for r in frame_rows(rows) if r.get("lost")]
    add_physical_limits(frames, {t.name: t for t in traces})
    write_csv(frame_rows(rows), os.path.join(out_dir, "frames.csv"))
    summary = summarise(frames, KEYS)
    write_csv(summary, os.path.join(out_dir, "summary.csv"))
    check = physical_limit_check(frames, {t.name: t for t in traces})
    png = plots(rows, runner.applied, out_dir)
    synthetic = [t for t in traces if t.synthetic] or []
    from robot_offload.testbed import traces as tr
    pred_traces = synthetic or [tr.indoor(), tr.outdoor()]
    md = [f"# Benchmark\n\n`{command}`\n", "## Set-up\n"] + [f"- {n}" for n in runner.notes]
    md += ["- traces: " + ", ".join(f"{t.name} (mean {t.mean_bps / 1e6:.1f} Mbit/s"
                                     f"{', synthetic' if t.synthetic else ''})" for t in traces)]
    rtts = {}
    for r in frames:
        if r.get("request_rtt_ms") == r.get("request_rtt_ms") and "request_rtt_ms" in r:
            rtts.setdefault(r["trace"], []).append(r["request_rtt_ms"])
    if rtts:
        md += ["- request round-trip time (empty Ping over the client's persistent ROS service "
               "connection, robot to server, measured after each run; median over runs): "
               + ", ".join(f"{t} {float(np.median(v)):.2f} ms" for t, v in rtts.items())]
    md += [f"- lost frames (no stats within the driver's timeout): {len(lost)}", "",
           "## Results (medians unless p95; fps = frames / span, closed loop)\n",
           markdown_table(summary), "", "## Physical-limit check\n",
           "The limit of a full_offload frame: its input bytes and its output bytes at the "
           "trace's rate, the server's compute and one request round trip; latency / limit "
           "is how far the frame is from it (constant-rate traces only: a varying trace's "
           "rate during a frame is not recorded).\n"]
    md += [f"- {c}" for c in check or ["(no constant-rate full_offload runs)"]]
    md += ["", "## Modes side by side (median latency)\n", comparison_table(frames), "",
           "## Same work in every mode (the run's noise floor)\n",
           "Median latency of the frames that computed the whole model on the robot, per mode "
           "(at least 5 frames); a mode ratio within the cell's max / min is not a measured "
           "difference.\n", same_work_table(frames), "",
           "## Robot / server compute\n", compute_ratio_table(frames), ""]
    oracle = oracle_table(frames)
    if oracle:
        md += ["## auto against the fixed modes and a hindsight oracle\n",
               f"Per cell, on the same frames: the best fixed mode over the cell; the oracle "
               f"runs, per {ORACLE_WINDOW_S:g} s of the trace, the fixed mode with the lowest "
               f"median latency in that window; frame-min is each frame's fastest fixed mode "
               f"(unattainable, for information). Where frames last longer than a window, "
               f"each window holds one frame of each mode, and the oracle is frame-min.\n",
               oracle, ""]
    cfg = getattr(runner, "cfg", None)
    objective = getattr(cfg, "objective", "latency")
    energy = oracle_table(frames, metric="energy_j") if objective == "energy" else ""
    if energy:
        md += ["## auto against the fixed modes: energy per inference\n",
               "The client's objective was energy. The same references chosen by the robot's "
               "joules per inference (the power model's, see the Results' j_per_inference) "
               "instead of latency.\n", energy, ""]
    if frames and objective == "deadline":
        md += ["## Joules under a deadline\n",
               f"The client's objective was deadline ({1e3 * cfg.deadline_s:g} ms): the fewest "
               "joules of the ways that meet it. Per mode, the frames that met it and the "
               "robot's joules per inference.\n", deadline_table(frames, cfg.deadline_s), ""]
    md += ["## Planner prediction\n", prediction_table(frames)]
    online = frames_online_table(frames, traces)
    if online:
        md += ["", "## Bandwidth estimates at each frame (online)\n",
               "The estimate each frame used (the monitor's, from the transfers of all the "
               "cell's frames), and those transfers replayed through the estimator with other "
               "predictors, and with the link's burst learned and added back.\n", online]
    md += ["", "## Bandwidth predictors (offline, 100 ms ahead)\n", predictor_table(pred_traces), "",
           "## Plots\n"] + [f"![{os.path.basename(p)}]({os.path.basename(p)})" for p in png]
    text = "\n".join(md) + "\n"
    with open(os.path.join(out_dir, "report.md"), "w") as f:
        f.write(text)
    return text
