"""Bandwidth predictors scored on traces (offline) and on real transfers through the
shaped testbed (online).

    python -m robot_offload.bench.predictors                  # offline only, any user
    python -m robot_offload.bench.predictors --online --out DIR   # as root, ~2.5 minutes
    python -m robot_offload.bench.predictors --logs DIR/transfers.json   # score a run again
    python -m robot_offload.bench.predictors --frames BENCH_OUT/frames.csv  # a bench run's estimates

Offline: each predictor is fed a trace's samples (0.1 s, exact) and at every sample
predicts the mean rate over the next ``h`` (100 ms, and 300 ms: the decision horizon, a
frame's transfers at a few frames per second).

Online: a client in the robot namespace makes requests of realistic sizes (150 KB camera
frames and 600 KB tensors, mixed, 20 frames/s, closed loop; see
:mod:`robot_offload.testbed.transfers`) while the trace replays on the tc-shaped link. Each
predictor sits behind a :class:`~robot_offload.bandwidth.PassiveEstimator`, as in
bandwidth_monitor, fed every real transfer in the order it finished; at each frame's start
(where a per-frame choice is made) its prediction is compared with the mean rate the trace
set over the next ``h``. The client does not depend on the predictor, so one log scores
every predictor on the same transfers. The "measured / set" line shows what the samples
themselves read against the trace.

A bench run (``rosrun robot_offload bench``): the estimate each frame used, and the
frames' own transfers replayed through the estimator with other predictors, against the
rate the trace set where the frame started (its report has the same table).

MAE in Mbit/s; MAPE in % over instants whose actual rate is at least 1 Mbit/s.
"""

import argparse
import csv
import json
import os
import platform
import re
import shlex
import sys
import time

import numpy as np

from robot_offload.bandwidth import (MAPE_FLOOR_BPS, PassiveEstimator, TransferSample,
                                     evaluate_predictors, make_predictor)
from robot_offload.errors import ConfigError
from robot_offload.testbed import traces as tr

PREDICTORS = ("last", "harmonic(5)", "kalman")
#: The brief's traces plus one the predictor was not chosen on (a random walk with jumps,
#: a seed not used while choosing).
TRACES = ("indoor", "outdoor", "steps", "walk:101")
HORIZONS_S = (0.1, 0.3)
WORKLOAD = {"rate_hz": 20.0, "sizes": (150_000, 600_000), "reply_bytes": 2_000}


def mean_rate(trace, t0_s, t1_s):
    """Mean rate the trace sets over [t0, t1] (s of trace position; bit/s)."""
    step = trace.step_s
    r = trace.rates_bps
    cum = np.concatenate([[0.0], np.cumsum(r)])
    idx = np.arange(len(r) + 1)
    a, b = float(t0_s) / step, float(t1_s) / step
    if not b > a:
        return trace.rate_at(t0_s)
    return float((np.interp(b, idx, cum) - np.interp(a, idx, cum)) / (b - a))


def score_online(pred, actual):
    """n, MAE, MAPE (over actual rates of at least MAPE_FLOOR_BPS), bias, and the share of
    predictions below half the actual rate (%; a false drop: what sends a choice to the
    robot for nothing)."""
    pred, actual = np.asarray(pred, float), np.asarray(actual, float)
    err = pred - actual
    ok = actual >= MAPE_FLOOR_BPS
    return {"n": int(err.size), "mae_bps": float(np.mean(np.abs(err))) if err.size else float("nan"),
            "mape_pct": float(100 * np.mean(np.abs(err[ok]) / actual[ok])) if ok.any() else float("nan"),
            "bias_bps": float(np.mean(err)) if err.size else float("nan"),
            "below_half_pct": float(100 * np.mean(pred < 0.5 * actual)) if err.size else float("nan")}


def offline_rows(trace, specs=PREDICTORS, horizons=HORIZONS_S):
    """{(predictor, horizon): scores} on a trace's own samples."""
    out = {}
    for h in horizons:
        for spec, row in zip(specs, evaluate_predictors(trace, [make_predictor(s) for s in specs],
                                                        h, target="mean")):
            out[(spec, h)] = row
    return out


def _estimator(spec, burst, rtt_s=(), **kwargs):
    """A :class:`PassiveEstimator` with predictor ``spec`` and ``burst`` (and ``kwargs``),
    that has seen the RTTs ``rtt_s`` (s)."""
    est = PassiveEstimator(make_predictor(spec), burst=burst, **kwargs)
    for rtt in rtt_s:
        est.observe_rtt(rtt)
    return est


def online_predictions(transfers, instants, trace, spec, horizons=HORIZONS_S, rtt_s=(),
                       burst="learn"):
    """{horizon: (predicted, actual)}: a :class:`PassiveEstimator` with predictor ``spec``
    (and ``burst``, see there) fed ``transfers`` ([(start, end, bytes[, floor_only[, acked]])], real
    time, see :class:`TransferSample`) in the order they ended; at each of ``instants``
    ([(real time, trace position)]) its prediction against the mean rate the trace set over
    the next ``h`` from that position (instants before the first prediction, or whose
    horizon runs past the trace, skipped)."""
    transfers = sorted(transfers, key=lambda x: x[1])
    est = _estimator(spec, burst, rtt_s)
    out = {h: ([], []) for h in horizons}
    j = 0
    for t, pos in sorted(instants):
        while j < len(transfers) and transfers[j][1] <= t:
            t0, t1, nbytes, *flags = transfers[j]
            flags = [bool(f) for f in flags] + [False, False]
            est.add(TransferSample(t1, int(nbytes), t1 - t0, floor_only=flags[0], acked=flags[1]))
            j += 1
        p = est.predict_bps()
        if p is None:
            continue
        for h in horizons:
            if pos + h <= trace.duration_s:
                out[h][0].append(p)
                out[h][1].append(mean_rate(trace, pos, pos + h))
    return out


def online_rows(log, trace, specs=PREDICTORS, horizons=HORIZONS_S, burst="learn"):
    """{(predictor, horizon): scores} on a transfer log (see
    :func:`robot_offload.testbed.transfers.record`; times in trace position), scored at
    each transfer's start; ``burst`` as :class:`PassiveEstimator` takes it."""
    transfers = [(t0, t1, up + down) for t0, t1, up, down in (tuple(x) for x in log["transfers"])]
    instants = [(t0, t0) for t0, _, _ in transfers]
    out = {}
    for spec in specs:
        got = online_predictions(transfers, instants, trace, spec, horizons, log.get("rtt_s", []),
                                 burst)
        for h in horizons:
            out[(spec, h)] = score_online(*got[h])
    return out


def measurement_bias(log, trace):
    """What the samples PassiveEstimator uses read against the trace's mean rate over the
    transfer: {"used", "ignored", "median", "p10", "p90"} of measured / set, the same
    without the learned burst added back ("raw": median, p10, p90), and the burst learned
    ("burst_ms": median, p10, p90 over the transfers)."""
    transfers = sorted((tuple(x) for x in log["transfers"]), key=lambda x: x[1])
    out = {}
    for key, burst in (("learned", "learn"), ("raw", None)):
        # every sample as it reads: none waits for a second to confirm a drop
        est = _estimator("last", burst, log.get("rtt_s", []), drops_to_lower=1)
        ratios, bursts = [], []
        for t0, t1, up, down in transfers:
            bps = est.add(TransferSample(t1, int(up + down), t1 - t0))
            truth = mean_rate(trace, t0, t1)
            if bps is not None and truth >= MAPE_FLOOR_BPS:
                ratios.append(bps / truth)
            bursts.append(est.burst_s)
        q = np.percentile(ratios, [50, 10, 90]) if ratios else [float("nan")] * 3
        out[key] = {"used": est.used, "ignored": est.ignored, "ratio": [float(x) for x in q],
                    "burst_ms": [round(1e3 * float(x), 1) for x in np.percentile(bursts, [50, 10, 90])]
                    if bursts else [float("nan")] * 3}
    got = out["learned"]
    return {"used": got["used"], "ignored": got["ignored"], "median": got["ratio"][0],
            "p10": got["ratio"][1], "p90": got["ratio"][2], "raw": out["raw"]["ratio"],
            "burst_ms": got["burst_ms"]}


def cost_us(spec, n=20000):
    """Mean time of one update + predict (microseconds) on this machine."""
    p = make_predictor(spec)
    rng = np.random.default_rng(0)
    xs = (50e6 * np.exp(rng.normal(0, 0.5, n))).tolist()
    ds = rng.uniform(0.005, 0.5, n).tolist()
    t0 = time.perf_counter()
    for i in range(n):
        p.update(0.05 * i, xs[i], ds[i])
        p.predict()
    return 1e6 * (time.perf_counter() - t0) / n


def estimator_cost_us(spec, n=5000):
    """Mean time (microseconds) of :meth:`PassiveEstimator.add` with ``spec`` behind it, on
    transfers of two sizes 50 ms apart: every one is paired and refits the link's burst."""
    est = PassiveEstimator(make_predictor(spec), burst="learn")
    rng = np.random.default_rng(0)
    sizes = rng.choice(WORKLOAD["sizes"], n).tolist()
    on_link = rng.uniform(0.01, 0.1, n).tolist()
    t0 = time.perf_counter()
    for i in range(n):
        est.add(TransferSample(0.05 * i, int(sizes[i]), on_link[i]))
    return 1e6 * (time.perf_counter() - t0) / n


def table(traces, offline, online, specs, horizons):
    """Markdown: one row per trace and predictor; MAE Mbit/s / MAPE % per horizon."""
    hs = [f"{1e3 * h:g} ms" for h in horizons]
    cols = [f"offline {h}" for h in hs] + ([f"online {h}" for h in hs] if online else [])
    lines = ["| trace | predictor | " + " | ".join(cols) + " |",
             "|---|---|" + "---:|" * len(cols)]
    for t in traces:
        best = {}
        for kind, res in (("offline", offline), ("online", online)):
            for h in horizons:
                if res:
                    best[(kind, h)] = min(res[t.name][(s, h)]["mae_bps"] for s in specs)
        for s in specs:
            cells = []
            for kind, res in (("offline", offline), ("online", online)):
                if not res:
                    continue
                for h in horizons:
                    r = res[t.name][(s, h)]
                    mark = "**" if r["mae_bps"] <= best[(kind, h)] * (1 + 1e-3) else ""
                    cells.append(f"{mark}{r['mae_bps'] / 1e6:.2f}{mark} / {r['mape_pct']:.0f} %")
            lines.append(f"| {t.name} | {s} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run_online(traces, duration_s, out=sys.stderr):
    """Record a transfer log per trace on the shaped testbed; {trace name: log}, and the
    testbed's description. Raises ConfigError where no shaped testbed can be built."""
    from robot_offload.testbed import Testbed
    from robot_offload.testbed.transfers import record

    logs = {}
    with Testbed() as tb:
        if not tb.shaped:
            raise ConfigError(f"online scoring needs the shaped testbed (root): {tb.reason}")
        for t in traces:
            print(f"online: {t.name}, {duration_s:g} s ...", file=out, flush=True)
            logs[t.name] = record(tb, t, duration_s=duration_s, seed=1, **WORKLOAD)
        return logs, tb.reason


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m robot_offload.bench.predictors",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--predictors", nargs="+", default=list(PREDICTORS))
    ap.add_argument("--traces", nargs="+", default=list(TRACES),
                    help="synthetic traces (NAME or NAME:SEED), const:MBPS, csv:PATH")
    ap.add_argument("--duration-s", type=float, default=30.0,
                    help="seconds of each trace (online: of transfers; default 30)")
    ap.add_argument("--online", action="store_true",
                    help="also score on real transfers through the tc-shaped testbed (root)")
    ap.add_argument("--logs", help="score the transfer logs of an earlier --online run "
                                   "(its transfers.json) instead of making new ones")
    ap.add_argument("--burst", choices=("learn", "none"), default="learn",
                    help="online: the estimator learns the link's burst and adds it back "
                         "(bandwidth_monitor's ~learn_burst), or not (its default)")
    ap.add_argument("--frames", help="instead: score the bandwidth estimates a bench run's "
                                     "frames used, and replay their transfers (its frames.csv)")
    ap.add_argument("--out", help="folder for report.md and transfers.json (with --frames: "
                                  "estimates.md)")
    args = ap.parse_args(argv)
    if args.frames:
        return _main_frames(ap, args, argv)
    try:
        for s in args.predictors:
            make_predictor(s)
        saved = None
        if args.logs:
            with open(args.logs, encoding="utf-8") as f:
                saved = json.load(f)
            args.duration_s = float(saved["duration_s"])
            args.traces = list(saved["logs"])
        traces = [tr.from_spec(s, args.duration_s + 2.0) for s in args.traces]
    except (ValueError, OSError, KeyError, ConfigError) as e:
        ap.error(str(e))
    specs, horizons = args.predictors, HORIZONS_S
    offline = {t.name: offline_rows(t, specs, horizons) for t in traces}
    online, testbed = {}, ""
    if saved is not None:
        logs, testbed = saved["logs"], saved.get("testbed", "")
    elif args.online:
        try:
            logs, testbed = run_online(traces, args.duration_s)
        except ConfigError as e:
            print(f"predictors: {e}", file=sys.stderr)
            return 2
    else:
        logs = {}
    for t in traces:
        if t.name in logs:
            online[t.name] = online_rows(logs[t.name], t, specs, horizons,
                                         None if args.burst == "none" else "learn")
    bias = {t.name: measurement_bias(logs[t.name], t) for t in traces if t.name in logs}

    command = "python -m robot_offload.bench.predictors " + " ".join(
        shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    recorded_by = saved.get("command") if saved is not None else None
    md = ["# Bandwidth predictors", "",
          f"`{command}`" + (f" (transfers recorded by `{recorded_by}`)" if recorded_by else ""),
          "",
          f"{time.strftime('%Y-%m-%d')}, {platform.machine()}, {os.cpu_count()} CPUs"
          + (f"; testbed: {testbed}" if testbed else ""), "",
          "Traces:", ""] + [f"- {t.name}: {t.source}" for t in traces] + ["",
          "MAE Mbit/s / MAPE % of the prediction made at each instant against the mean rate "
          "over the next 100 ms and 300 ms; bold: lowest MAE in the column for that trace. "
          "Offline: the trace's own 0.1 s samples. Online: real transfers (150 KB and "
          "600 KB, 20 frames/s, closed loop) through tc htb while the trace replays; "
          "scored at each frame's start; the estimator "
          + ("learning the link's burst and adding it back (`~learn_burst: true`)."
             if args.burst == "learn" else "without the link's burst (the monitor's default)."),
          "",
          table(traces, offline, online, specs, horizons), ""]
    if bias:
        md += ["Online samples, measured / set rate (median, p10-p90), samples used / "
               "ignored (shorter than 5 ms on the link, or too small), and the link's burst "
               "the estimator learned (median, p10-p90 over the run). A transfer that starts "
               "after an idle moment goes through the shaper's bucket at line rate; read as "
               "bytes over its time on the link it shows about 1 + burst / (that time) times "
               "the rate (\"raw\" below), so the burst, learned from the transfers "
               "themselves, is added back:", ""]
        md += [f"- {n}: {b['median']:.2f} ({b['p10']:.2f}-{b['p90']:.2f}), raw {b['raw'][0]:.2f} "
               f"({b['raw'][1]:.2f}-{b['raw'][2]:.2f}); {b['used']} / {b['ignored']}; burst "
               f"{b['burst_ms'][0]:g} ms ({b['burst_ms'][1]:g}-{b['burst_ms'][2]:g})"
               for n, b in bias.items()]
        md.append("")
    md += ["Cost of one update + predict on this CPU (a Jetson's is about 3-5x slower): "
           + ", ".join(f"{s} {cost_us(s):.1f} us" for s in specs) + "; of one transfer "
           "through the estimator, the burst refitted: "
           + ", ".join(f"{s} {estimator_cost_us(s):.0f} us" for s in specs) + "."]
    text = "\n".join(md) + "\n"
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "report.md"), "w", encoding="utf-8") as f:
            f.write(text)
        if logs and saved is None:
            with open(os.path.join(args.out, "transfers.json"), "w", encoding="utf-8") as f:
                json.dump({"duration_s": args.duration_s, "testbed": testbed, "command": command,
                           "workload": WORKLOAD, "logs": {
                               n: {"rtt_s": [round(x, 7) for x in lg["rtt_s"]],
                                   "late_steps": lg.get("late_steps", 0),
                                   "transfers": [[round(a, 6), round(b, 6), u, d]
                                                 for a, b, u, d in lg["transfers"]]}
                               for n, lg in logs.items()}}, f)
    return 0


def bench_trace(name, duration_s):
    """The trace a bench report names (``const5M``, ``indoor``, ``walk:7``, ...)."""
    m = re.fullmatch(r"const([0-9.]+)M", name)
    return tr.from_spec(f"const:{m.group(1)}" if m else name, duration_s)


def _main_frames(ap, args, argv):
    from robot_offload.bench.report import frames_online_table
    from robot_offload.bench.runner import BenchConfig
    try:
        with open(args.frames, newline="", encoding="utf-8") as f:
            frames = list(csv.DictReader(f))
        traces = [bench_trace(n, BenchConfig.trace_duration_s) for n in sorted({r["trace"] for r in frames})]
    except (OSError, KeyError, ConfigError) as e:
        ap.error(str(e))
    command = "python -m robot_offload.bench.predictors " + " ".join(
        shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    text = (f"# Bandwidth estimates of a bench run\n\n`{command}`\n\n"
            + (frames_online_table(frames, traces) or "(no frames of a known trace)") + "\n")
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "estimates.md"), "w", encoding="utf-8") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
