"""bag_report: CSV tables and PNG plots from a bag of robot_offload's topics.

    rosrun robot_offload bag_report BAG [--out DIR]

Topics are picked by message type, whatever their names: ``InferenceStats`` ->
``stats.csv``, ``BandwidthEstimate`` -> ``bandwidth.csv``, ``PowerSample`` ->
``power.csv``, one row per message with every scalar field (numbers, booleans as 0/1,
strings such as ``mode`` and ``executed_mode``), ``time_s`` (header stamp, s since the
epoch), ``t_s`` (the same, from the earliest stamp in the bag), ``bag_time_s`` (when it
was recorded) and ``topic``; power rails become ``rail_<name>_w`` columns. Plots
(matplotlib, Agg): ``latency.png`` (per frame, coloured by the mode that ran it),
``bandwidth.png`` (measured and predicted), ``power.png`` and ``mode.png`` (asked and
executed mode over time). The bag is read with rosbag, hence its place under ``ros/``;
tables and plots are plain functions of the rows.
"""

import argparse
import csv
import math
import os
import sys
from typing import Dict, List, Sequence

from robot_offload.errors import OffloadError

KINDS = (  # table name, message type in the bag
    ("stats", "robot_offload/InferenceStats"),
    ("bandwidth", "robot_offload/BandwidthEstimate"),
    ("power", "robot_offload/PowerSample"),
)
_NUMERIC = {"bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
            "float32", "float64", "byte", "char"}
_LEAD = ["time_s", "t_s", "bag_time_s", "topic"]


class BagReportError(OffloadError):
    """The bag cannot be read or holds nothing to report."""


def scalar_fields(msg_class) -> List[str]:
    """The message's numeric and string fields, in definition order (no arrays, no header)."""
    return [name for name, kind in zip(msg_class.__slots__, msg_class._slot_types)
            if kind in _NUMERIC or kind == "string"]


def _row(msg, topic: str, bag_time_s: float, fields: Sequence[str]) -> dict:
    row = {"time_s": msg.header.stamp.to_sec(), "bag_time_s": bag_time_s, "topic": topic}
    for name in fields:
        value = getattr(msg, name)
        row[name] = int(value) if isinstance(value, bool) else value
    for name, watts in zip(getattr(msg, "rail_names", ()), getattr(msg, "rail_watts", ())):
        row[f"rail_{name}_w"] = watts
    return row


def read_tables(path: str) -> Dict[str, List[dict]]:
    """``{"stats": rows, "bandwidth": rows, "power": rows}`` from the bag at ``path``.
    :class:`BagReportError` for a missing, unreadable or unindexed bag, or one without any
    of the three message types."""
    import rosbag
    if not os.path.isfile(path):
        raise BagReportError(f"no such bag file: {path}")
    try:
        bag = rosbag.Bag(path)
    except rosbag.ROSBagUnindexedException as e:
        raise BagReportError(f"{path} is not indexed (still being recorded, or the recorder was "
                             f"killed): run 'rosbag reindex {path}' first") from e
    except (rosbag.ROSBagException, OSError, ValueError) as e:
        raise BagReportError(f"cannot read {path} as a bag: {e}") from e
    with bag:
        info = bag.get_type_and_topic_info().topics
        topics = {kind: sorted(t for t, i in info.items() if i.msg_type == msg_type and i.message_count)
                  for kind, msg_type in KINDS}
        kind_of = {t: kind for kind, ts in topics.items() for t in ts}
        if not kind_of:
            found = ", ".join(f"{t} ({i.msg_type}, {i.message_count})" for t, i in sorted(info.items()))
            raise BagReportError(f"{path} holds no InferenceStats, BandwidthEstimate or PowerSample "
                                 f"messages (topics: {found or 'none, the bag is empty'})")
        tables = {kind: [] for kind, _ in KINDS}
        fields = {}
        for topic, msg, t in bag.read_messages(topics=sorted(kind_of)):
            if topic not in fields:
                fields[topic] = scalar_fields(type(msg))
            tables[kind_of[topic]].append(_row(msg, topic, t.to_sec(), fields[topic]))
    t0 = min(r["time_s"] for rows in tables.values() for r in rows)
    for rows in tables.values():
        rows.sort(key=lambda r: r["time_s"])
        for r in rows:
            r["t_s"] = r["time_s"] - t0
    return tables


def _header_for(kind: str, rows: Sequence[dict]) -> List[str]:
    if rows:
        names = list(_LEAD)
        for r in rows:
            names += [k for k in r if k not in names]
        return names
    from robot_offload import msg as msgs
    msg_class = getattr(msgs, dict(KINDS)[kind].split("/")[1])
    return _LEAD + scalar_fields(msg_class)


def write_csvs(tables: Dict[str, List[dict]], out_dir: str) -> List[str]:
    """One CSV per table (a header-only file for a table without messages)."""
    paths = []
    for kind, _ in KINDS:
        rows = tables.get(kind, [])
        path = os.path.join(out_dir, f"{kind}.csv")
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=_header_for(kind, rows), restval="")
            w.writeheader()
            w.writerows(rows)
        paths.append(path)
    return paths


def _by(rows, key):
    out = {}
    for r in rows:
        out.setdefault(r[key], []).append(r)
    return out


def plot(tables: Dict[str, List[dict]], out_dir: str) -> List[str]:
    """The PNGs for the tables that have rows; returns their paths."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []

    def save(fig, name):
        fig.tight_layout()
        path = os.path.join(out_dir, name)
        fig.savefig(path, dpi=90)
        plt.close(fig)
        paths.append(path)

    stats = tables.get("stats", [])
    multi = len({r["topic"] for r in stats}) > 1
    if stats:
        fig, ax = plt.subplots(figsize=(10, 4))
        groups = {}
        for r in stats:
            groups.setdefault((r["topic"], r["executed_mode"]), []).append(r)
        for (topic, mode), rs in sorted(groups.items()):
            label = f"{topic} {mode}" if multi else mode
            asked = [r for r in rs if r["mode"] == mode]
            fell = [r for r in rs if r["mode"] != mode]  # fallbacks: asked for another mode
            line, = ax.plot([r["t_s"] for r in asked], [1e3 * r["latency_s"] for r in asked], "o", ms=3,
                            label=label)
            if fell:
                ax.plot([r["t_s"] for r in fell], [1e3 * r["latency_s"] for r in fell], "x", ms=5,
                        color=line.get_color(), label=f"{label} (fallback)")
        ax.set_xlabel("time (s)")
        ax.set_ylabel("latency (ms)")
        ax.set_title("end-to-end latency per frame, by executed mode")
        ax.grid(alpha=0.3)
        ax.legend()
        save(fig, "latency.png")

        fig, ax = plt.subplots(figsize=(10, 3))
        modes = sorted({r["mode"] for r in stats} | {r["executed_mode"] for r in stats})
        level = {m: i for i, m in enumerate(modes)}
        for topic, rs in sorted(_by(stats, "topic").items()):
            prefix = f"{topic} " if multi else ""
            ax.step([r["t_s"] for r in rs], [level[r["mode"]] for r in rs], where="post",
                    label=f"{prefix}mode (asked)")
            ax.plot([r["t_s"] for r in rs], [level[r["executed_mode"]] for r in rs], ".", ms=4,
                    label=f"{prefix}executed mode")
        ax.set_yticks(range(len(modes)))
        ax.set_yticklabels(modes)
        ax.set_ylim(-0.5, len(modes) - 0.5)
        ax.set_xlabel("time (s)")
        ax.set_title("mode over time")
        ax.grid(alpha=0.3)
        ax.legend()
        save(fig, "mode.png")

    bandwidth = tables.get("bandwidth", [])
    if bandwidth:
        fig, ax = plt.subplots(figsize=(10, 4))
        groups = _by(bandwidth, "topic")
        for topic, rs in sorted(groups.items()):
            t = [r["t_s"] for r in rs]
            prefix = f"{topic} " if len(groups) > 1 else ""
            ax.plot(t, [r["measured_bps"] / 1e6 for r in rs], ".-", ms=3, label=f"{prefix}measured")
            ax.plot(t, [r["predicted_bps"] / 1e6 for r in rs], "--", label=f"{prefix}predicted ({rs[-1]['predictor']})")
        ax.set_xlabel("time (s)")
        ax.set_ylabel("bandwidth (Mbit/s)")
        ax.set_title("link bandwidth, measured and predicted")
        ax.grid(alpha=0.3)
        ax.legend()
        save(fig, "bandwidth.png")

    power = tables.get("power", [])
    if power:
        fig, ax = plt.subplots(figsize=(10, 4))
        groups = _by(power, "topic")
        for topic, rs in sorted(groups.items()):
            sources = ", ".join(sorted({r["source"] for r in rs}))
            modelled = " (modelled, not measured)" if any(r["modelled"] for r in rs) else ""
            prefix = f"{topic}: " if len(groups) > 1 else ""
            ax.plot([r["t_s"] for r in rs], [r["watts"] for r in rs], "-", label=f"{prefix}{sources}{modelled}")
        ax.set_xlabel("time (s)")
        ax.set_ylabel("power (W)")
        ax.set_title("robot power")
        ax.grid(alpha=0.3)
        ax.legend()
        save(fig, "power.png")
    return paths


def _summary(kind: str, rows: Sequence[dict]) -> str:
    if not rows:
        return f"{kind}.csv: no messages"
    span = rows[-1]["t_s"] - rows[0]["t_s"]
    text = f"{kind}.csv: {len(rows)} rows over {span:.1f} s"
    if kind == "stats":
        lat = sorted(r["latency_s"] for r in rows if math.isfinite(r["latency_s"]))
        if lat:
            text += f", median latency {1e3 * lat[len(lat) // 2]:.1f} ms"
        text += ", modes " + ", ".join(f"{m} {len(rs)}" for m, rs in sorted(_by(rows, "executed_mode").items()))
    return text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="bag_report", description=__doc__.split("\n\n")[0])
    parser.add_argument("bag", help="bag file (from record.launch or rosbag record)")
    parser.add_argument("--out", help="output folder (default: the bag's path without .bag, plus _report)")
    args = parser.parse_args(argv)
    out = args.out or (args.bag[:-4] if args.bag.endswith(".bag") else args.bag) + "_report"
    try:
        tables = read_tables(args.bag)
    except BagReportError as e:
        print(f"bag_report: {e}", file=sys.stderr)
        return 1
    os.makedirs(out, exist_ok=True)
    write_csvs(tables, out)
    pngs = plot(tables, out)
    for kind, _ in KINDS:
        print(_summary(kind, tables[kind]))
    print(f"wrote {len(KINDS)} CSV and {len(pngs)} PNG files to {out}")
    return 0
