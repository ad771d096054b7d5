"""Benchmark command line: ``rosrun robot_offload bench [--quick]`` (as root for the
shaped testbed; otherwise loopback, unshaped, and the report says so).

    --fleet R:S  R robots and S servers sharing them (robot_offload.bench.fleet; --help there)
    --quick   resnet18 + agrnav (64x64x32), local vs full_offload, const:50 and outdoor, 6 frames
              (under 3 minutes on the 2-core CI machine)
    (full)    resnet101, vgg19, kapao_l (640 px), agrnav; local vs full_offload;
              const:10, const:50, const:100, indoor, outdoor; 20 frames each
"""

import argparse
import shlex
import sys
import time

from robot_offload.bench.report import write_report
from robot_offload.bench.runner import BenchConfig, BenchRunner
from robot_offload.camera import open_source
from robot_offload.errors import ConfigError
from robot_offload.partition.planner import OBJECTIVES

FULL = dict(models=["resnet101", "vgg19", "kapao_l", "agrnav"], modes=["local", "full_offload"],
            traces=["const:10", "const:50", "const:100", "indoor", "outdoor"], frames=20,
            input_sizes={"kapao_l": [640, 640]})
QUICK = dict(models=["resnet18", "agrnav"], modes=["local", "full_offload"],
             traces=["const:50", "outdoor"], frames=6, input_sizes={"agrnav": [64, 64, 32]})


def main(argv=None):
    if any(a == "--fleet" or a.startswith("--fleet=") for a in (sys.argv[1:] if argv is None else argv)):
        from robot_offload.bench import fleet
        return fleet.main(argv)
    ap = argparse.ArgumentParser(prog="bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--models", nargs="+")
    ap.add_argument("--modes", nargs="+")
    ap.add_argument("--traces", nargs="+",
                    help="const:MBPS, indoor, outdoor, steps, walk (NAME:SEED), iperf:PATH, csv:PATH")
    ap.add_argument("--frames", type=int)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--warmup-for", action="append", default=[], metavar="MODE=N",
                    help="another number of warm-up frames for one mode, e.g. transparent=1: "
                         "it learns nothing, and at a long RTT each of its frames takes tens "
                         "of seconds")
    ap.add_argument("--robot-cpus", type=float, default=0.5, help="CPU quota of the robot side (0 = none)")
    ap.add_argument("--timeout-s", type=float, default=5.0, help="client deadline per frame")
    ap.add_argument("--objective", choices=OBJECTIVES, default="latency",
                    help="what the client's plans and auto minimise (its objective parameter)")
    ap.add_argument("--deadline-s", type=float, default=0.1,
                    help="with --objective deadline: the latency a frame must meet (its deadline_s)")
    ap.add_argument("--no-hedge", action="store_true",
                    help="the client hedges no late call (its hedge parameter false)")
    ap.add_argument("--input-jpeg-quality", type=int, default=0, metavar="Q",
                    help="the client sends camera frames as JPEG of quality Q (lossy; its "
                         "input_jpeg_quality parameter); 0 = off")
    ap.add_argument("--input-size", action="append", default=[], metavar="MODEL=H,W",
                    help="override a model's input size, e.g. kapao_l=640,640")
    ap.add_argument("--loopback", action="store_true", help="skip namespaces: unshaped loopback")
    ap.add_argument("--delay-ms", type=float, default=0.0,
                    help="one-way delay added to each direction (ms; RTT grows by twice this); "
                         "uses TUN devices and a user-space relay, as this kernel has no netem")
    ap.add_argument("--interleave", action="store_true",
                    help="run the modes in turn frame by frame (one segment per trace) rather "
                         "than one after the other: on a shared machine whose speed drifts, "
                         "every mode's frame i then meets the same load and trace point")
    ap.add_argument("--no-paired-trace", action="store_true",
                    help="with --interleave, let the trace play on in wall time instead of "
                         "starting every mode's frame i at the same point of it")
    ap.add_argument("--pin-cpus", action="store_true",
                    help="robot side on the lowest CPU, server side on the others (taskset), so "
                         "neither slows the other's threads as separate machines would not")
    ap.add_argument("--min-span-s", type=float, default=0.0,
                    help="extend a cell past --frames until its frames span this many seconds "
                         "of the trace (with --interleave and several modes; else of wall time): fast models get "
                         "more frames, slow ones keep --frames")
    ap.add_argument("--max-frames", type=int, default=64, help="the most frames --min-span-s may run")
    ap.add_argument("--settle-s", type=float, default=BenchConfig.settle_s,
                    help="robot idle before every frame (s; default %(default)g, two and a half "
                         "periods of the robot's CPU quota): a frame then does not start on quota "
                         "the frame before it used up")
    ap.add_argument("--frames-source", default="natural",
                    help="image frames: natural (1/f statistics with sensor noise; zstd takes "
                         "it about as far as a photograph), synthetic (flat squares: 100x or "
                         "more, so sending the input looks nearly free), a folder or a video file")
    ap.add_argument("--camera-size", default="640,480", metavar="W,H",
                    help="image frames' size (px); at a model's input size full_offload and auto "
                         "send the camera's uint8 image, at 640,480 a 224 x 224 model's float input")
    ap.add_argument("--out", default="results/bench")
    args = ap.parse_args(argv)
    if not args.deadline_s > 0:
        ap.error(f"--deadline-s must be > 0, got {args.deadline_s:g}")
    try:
        open_source(args.frames_source, 8, 8).close()   # fail here, not in every segment's driver
        camera_size = tuple(int(v) for v in args.camera_size.split(","))
        if len(camera_size) != 2 or min(camera_size) < 1:
            raise ValueError
    except ConfigError as e:
        ap.error(str(e))
    except ValueError:
        ap.error(f"--camera-size takes W,H in pixels, got {args.camera_size!r}")
    profile = dict(QUICK if args.quick else FULL)
    for key in ("models", "modes", "traces", "frames"):
        if getattr(args, key):
            profile[key] = getattr(args, key)
    sizes = dict(profile.pop("input_sizes"))
    for item in args.input_size:
        model, _, dims = item.partition("=")
        sizes[model] = [int(d) for d in dims.split(",")]
    warmup_for = {}
    for item in args.warmup_for:
        mode, _, count = item.partition("=")
        if not count.isdigit():
            ap.error(f"--warmup-for wants MODE=N, got {item!r}")
        warmup_for[mode] = int(count)

    try:
        from tqdm import tqdm
        bar = tqdm(total=len(profile["models"]) * len(profile["traces"]) * len(profile["modes"]),
                   unit="run", file=sys.stderr)
    except ImportError:  # pragma: no cover
        bar = None

    def progress(text):
        if bar is not None:
            bar.set_postfix_str(text)
            bar.update(1)
        else:
            print(text, file=sys.stderr)

    cfg = BenchConfig(out_dir=args.out, warmup=args.warmup, warmup_for=warmup_for, robot_cpus=args.robot_cpus,
                      timeout_s=args.timeout_s, input_sizes=sizes, loopback=args.loopback,
                      delay_ms=args.delay_ms, interleave=args.interleave,
                      paired_trace=not args.no_paired_trace, pin_cpus=args.pin_cpus,
                      frames_source=args.frames_source, camera_size=camera_size, min_span_s=args.min_span_s,
                      max_frames=args.max_frames, settle_s=args.settle_s, progress=progress,
                      objective=args.objective, deadline_s=args.deadline_s, hedge=not args.no_hedge,
                      input_jpeg_quality=args.input_jpeg_quality,
                      **profile)
    runner = BenchRunner(cfg)
    t0 = time.monotonic()
    rows = runner.run()
    if bar is not None:
        bar.close()
    command = "rosrun robot_offload bench " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    text = write_report(rows, runner, runner.traces, args.out, command)
    print(text)
    print(f"bench: {time.monotonic() - t0:.0f} s; report in {args.out}/report.md", file=sys.stderr)
    physical_fail = "FAIL" in text.split("## Physical-limit check")[1].split("##")[0]
    return 1 if physical_fail or runner.failed else 0


if __name__ == "__main__":
    sys.exit(main())
