"""Summaries of InferenceStats rows as tables (Markdown), shared by the demo and the
benchmarks. Rows are dicts with the InferenceStats fields they use, at least
``latency_s`` and ``t_s`` (when the frame was sent or its stats arrived, s)."""

from collections import OrderedDict
from typing import Dict, Iterable, List, Sequence

import numpy as np


def summarise(rows: Iterable[dict], keys: Sequence[str] = ("mode",)) -> List[Dict]:
    """Per value of ``keys`` (in first-seen order): frames, fps, median/p95 latency, the
    medians of the cost split, bytes, round trips and energy, and how many frames fell
    back to local. fps is frames over the span of their ``t_s``."""
    groups: "OrderedDict[tuple, list]" = OrderedDict()
    for r in rows:
        groups.setdefault(tuple(r[k] for k in keys), []).append(r)
    out = []
    for name, rs in groups.items():
        lat = np.array([r["latency_s"] for r in rs], dtype=float)
        t = np.array([r["t_s"] for r in rs], dtype=float)
        span = float(t.max() - t.min()) if len(t) > 1 else float("nan")
        med = lambda f: float(np.median([r.get(f, np.nan) for r in rs]))  # noqa: E731
        out.append(OrderedDict(list(zip(keys, name)) + [
            ("frames", len(rs)),
            ("fps", (len(rs) - 1) / span if len(rs) > 1 and span > 0 else float("nan")),
            ("median_latency_ms", 1e3 * float(np.median(lat))),
            ("p95_latency_ms", 1e3 * float(np.percentile(lat, 95))),
            ("robot_ms", 1e3 * med("robot_compute_s")), ("transfer_ms", 1e3 * med("transfer_s")),
            ("server_ms", 1e3 * med("server_compute_s")),
            ("kb_up", med("bytes_up") / 1e3), ("kb_down", med("bytes_down") / 1e3),
            ("round_trips", med("round_trips")), ("j_per_inference", med("energy_j")),
            ("fallbacks", sum(1 for r in rs if r.get("fallback_reason"))),
        ]))
    return out


def markdown_table(summary: List[Dict], digits: int = 1) -> str:
    if not summary:
        return "(no frames)"
    cols = list(summary[0].keys())

    def fmt(v):
        if isinstance(v, float):
            return "n/a" if np.isnan(v) else f"{v:.{digits}f}"
        return str(v)

    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    lines += ["| " + " | ".join(fmt(r[c]) for c in cols) + " |" for r in summary]
    return "\n".join(lines)
