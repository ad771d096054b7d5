"""Offline tables of layer partitioning and lop from the robot's cached profiles:
``python -m robot_offload.bench.partition_report --models resnet101 vgg19 ... --out DIR``.

Per model (the profile of its input shape on this machine, measured if not cached):

* **packing** -- bytes on the wire of every candidate cut for every encoding, against the
  cut's raw float32 bytes, with the profiled output error of each codec; the cuts the
  layer-partition planner chooses between 5 and 100 Mbit/s are marked;
* **top-1 agreement** (classification models) of the chosen lossy plans against float32,
  over ``--agreement-inputs`` random inputs (head, encode/decode, tail in this process),
  with their bytes on the wire: ``--inputs noise`` (uniform-noise images, which no
  compressor shrinks: the worst case) or ``natural`` (:func:`~robot_offload.camera.natural_image`:
  1/f spectrum, shared colour structure, sensor noise, as a camera frame);
* **LOSS** -- the lop schedule per bandwidth, and the grid solver against scipy's
  differential evolution (objective and solving time).

Planner settings are the client's defaults unless given (``--server-speedup``).
"""

import argparse
import os
import sys
import time
from typing import List

import torch

from robot_offload import codec
from robot_offload.camera import natural_image
from robot_offload.backends.base import BackendContext
from robot_offload.backends.layer_partition import LayerPartitionBackend
from robot_offload.client import ClientConfig
from robot_offload.models import get_spec
from robot_offload.partition.loss import Loss, LopTable, compare_solvers
from robot_offload.partition.profile import split_encoding
from robot_offload.partition.spatial import SpatialGraph

BANDWIDTHS = (5e6, 20e6, 50e6, 100e6)


def packing_table(profile, chosen: set) -> str:
    encs = profile.encodings
    lines = ["| cut | raw KB | " + " | ".join(encs) + " |", "|---|---|" + "---|" * len(encs)]
    for c in profile.candidates:
        if c.kind == "output":
            continue
        cells = []
        for e in encs:
            b = c.wire_bytes(e)
            err = c.codec_error(split_encoding(e)[0])
            cells.append("n/a" if b is None else f"{c.raw_bytes / max(b, 1):.1f}x ({err:.1e})")
        mark = " **(chosen)**" if c.id in chosen else ""
        lines.append(f"| {c.label}{mark} | {c.raw_bytes / 1e3:.0f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


#: What ``--inputs`` may name: how the i-th agreement input is made.
INPUT_KINDS = ("noise", "natural")


def report_input(spec, size, seed: int, kind: str = "noise") -> torch.Tensor:
    """An input of ``kind`` (see :data:`INPUT_KINDS`) at ``size``; a point-cloud model
    keeps its own synthetic scene."""
    if kind == "noise" or spec.input_kind != "image":
        return spec.example_input(size, seed=seed)
    if kind == "natural":
        return spec.preprocess(natural_image(size[0], size[1], seed=seed), size)
    raise ValueError(f"unknown input kind {kind!r}; known: {', '.join(INPUT_KINDS)}")


def agreement_input(spec, size, i: int, kind: str = "noise") -> torch.Tensor:
    """The i-th agreement input of ``kind`` at ``size`` (seeds apart from the profile's)."""
    return report_input(spec, size, 50_000 + i, kind)


def agreement(backend: LayerPartitionBackend, st, metas, plans, n: int, kind: str = "noise") -> List[str]:
    """Top-1 agreement of each distinct lossy inner/input plan with float32 over ``n``
    random inputs of ``kind``."""
    out = []
    spec = backend.ctx.spec
    seen = set()
    for p in plans:
        if p.kind == "output" or p.codec == "raw" or (p.cut_id, p.codec) in seen:
            continue
        seen.add((p.cut_id, p.codec))
        cut = backend.graph.input_cut() if p.kind == "input" else backend.graph.cut(p.crossing)
        agree, raw_bytes, wire_bytes = 0, 0, 0
        for i in range(n):
            x = agreement_input(spec, tuple(st.profile.input_shape[2:]), i, kind)
            with torch.inference_mode():
                ref = backend.ctx.model(x)
                tensors = [x] if p.kind == "input" else list(backend.graph.head_module(cut)(x))
                encoded = [codec.encode(t, "t", p.codec, p.compression) for t in tensors]
                raw_bytes += sum(t.numel() * 4 for t in tensors)
                wire_bytes += sum(len(e.data) for e in encoded)
                dec = [codec.decode(e) for e in encoded]
                y = backend.ctx.model(dec[0]) if p.kind == "input" else \
                    backend.graph.tail_module(cut)(*dec, *backend.graph.static_values(cut, metas))
            agree += int(y.argmax(-1).item() == ref.argmax(-1).item())
        out.append(f"- {p.describe()}: top-1 agreement {agree}/{n} {kind} inputs ({100 * agree / n:.1f} %), "
                   f"bytes on the wire {raw_bytes / max(wire_bytes, 1):.3f}x smaller than raw float32")
    return out


def model_report(name: str, size, agreement_inputs: int, server_speedup: float,
                 error_tolerance: float = ClientConfig.error_tolerance, inputs: str = "noise",
                 profile_dir: str = "") -> str:
    spec = get_spec(name)
    cfg = ClientConfig(model=name, mode="layer_partition", input_size=size, server_speedup=server_speedup,
                       error_tolerance=error_tolerance, profile_dir=profile_dir)
    model = spec.build()
    backend = LayerPartitionBackend(BackendContext(spec, model, None, cfg))
    # The profile's first frame is of the same kind, as the robot's first camera frame is
    # in the field: it decides what compression gains and codec errors the planner sees.
    x = report_input(spec, size, 0, inputs)
    st = backend.state(x)
    metas, _ = backend.graph.record(x)
    lp_plans = [st.table.lookup(b) for b in BANDWIDTHS]
    md = [f"## {name} {list(st.profile.input_shape)}\n",
          f"robot forward {1e3 * st.profile.forward_s:.0f} ms (profile), {len(st.profile.cuts)} cuts, "
          f"{len(st.profile.candidates)} candidates; planner server_speedup {server_speedup}, "
          f"error_tolerance {error_tolerance:g}; first frame and agreement inputs: {inputs}\n",
          "### Packing: raw bytes / wire bytes per candidate cut and encoding (profiled output error)\n",
          packing_table(st.profile, {p.cut_id for p in lp_plans}), "",
          "layer_partition plans: " + "; ".join(f"{b / 1e6:g} Mbit/s: {p.describe()}"
                                                for b, p in zip(BANDWIDTHS, lp_plans)), ""]
    if spec.task == "classification" and agreement_inputs > 0:
        md += ["### Top-1 agreement of the chosen lossy plans\n"]
        md += agreement(backend, st, metas, lp_plans, agreement_inputs, inputs) or ["- (no lossy plan chosen)"]
        md += [""]
    sg = SpatialGraph(backend.graph, metas)
    t0 = time.perf_counter()
    loss = Loss(backend.graph, sg, st.profile)
    table = LopTable.build(loss, st.cfg)
    kinds = sg.kinds()
    md += ["### lop (LOSS)\n",
           f"operators: {sum(k == 'elementwise' for k in kinds.values())} element-wise, "
           f"{sum(k == 'rowwise' for k in kinds.values())} row-wise, "
           f"{sum(k == 'block' for k in kinds.values())} block-wise, "
           f"{sum(k == 'global' for k in kinds.values())} global; {len(loss.regions)} regions between "
           f"candidate and boundary cuts; table of {len(table.plans)} buckets solved in "
           f"{time.perf_counter() - t0:.2f} s (geometry {loss.geometry_s:.2f} s)\n",
           "| Mbit/s | schedule (of the bucket at or below) | predicted ms |", "|---|---|---|"]
    md += [f"| {b / 1e6:g} | {table.lookup(b).describe()} | {1e3 * table.lookup(b).latency_s:.0f} |"
           for b in BANDWIDTHS]
    md += ["", "Solvers (spatial schedules only, same objective):\n",
           "| Mbit/s | grid ms | grid solve s | DE ms | DE solve s | DE evaluations |",
           "|---|---|---|---|---|---|"]
    for r in compare_solvers(loss, st.cfg, list(BANDWIDTHS)):
        md.append(f"| {r['bandwidth_mbps']:g} | {r['grid_objective']:.1f} | {r['grid_s']:.3f} | "
                  f"{r['de_objective']:.1f} | {r['de_s']:.3f} | {r['de_evaluations']} |")
    return "\n".join(md) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(prog="partition_report", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", required=True)
    ap.add_argument("--input-size", action="append", default=[], metavar="MODEL=H,W")
    ap.add_argument("--agreement-inputs", type=int, default=200)
    ap.add_argument("--server-speedup", type=float, default=ClientConfig.server_speedup)
    ap.add_argument("--error-tolerance", type=float, default=ClientConfig.error_tolerance,
                    help="the planner's output-error budget (offload_client ~error_tolerance)")
    ap.add_argument("--inputs", choices=INPUT_KINDS, default="noise",
                    help="agreement inputs: uniform-noise images (incompressible) or natural-statistics images")
    ap.add_argument("--profile-dir", default="",
                    help="profile cache (default the client's); a profile is not keyed by its first "
                         "frame, so give --inputs natural its own")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    sizes = {}
    for item in args.input_size:
        model, _, dims = item.partition("=")
        sizes[model] = tuple(int(d) for d in dims.split(","))
    text = "# layer_partition and lop: packing, agreement, LOSS\n\n`python -m " \
           "robot_offload.bench.partition_report " + " ".join(argv or sys.argv[1:]) + "`\n\n"
    for name in args.models:
        section = model_report(name, sizes.get(name) or get_spec(name).input_size,
                               args.agreement_inputs, args.server_speedup, args.error_tolerance,
                               args.inputs, args.profile_dir)
        text += section
        print(section, flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "partition_report.md"), "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
