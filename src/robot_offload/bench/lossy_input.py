"""What JPEG camera frames cost in accuracy and save in bytes:
``python -m robot_offload.bench.lossy_input --models mobilenet_v2 resnet101 --qualities 75 90 95``.

Per model and quality, over ``--frames`` natural camera frames
(:func:`~robot_offload.camera.natural_image`: 1/f spectrum, shared colour structure,
sensor noise) of ``--camera-size``, all in this process on the CPU: the model on the frame
(what ``local`` computes) against the model on the JPEG's decoded pixels (what
``full_offload`` with ``input_jpeg_quality`` computes on the server), preprocessed by the
registry's function both times. Reported: the JPEG's bytes against the frame's, the
relative output error (max|dy| / max|y|, the measure of ``~error_tolerance``; median and
largest), and for classification models the top-1 agreement. The registry's seeded random
weights have small margins between classes, so their top-1 flips more easily than a
trained model's: ``--weights MODEL=FILE`` measures your own.
"""

import argparse
import os
import statistics
import sys

import numpy as np
import torch

from robot_offload import codec, frame_codec
from robot_offload.camera import natural_image
from robot_offload.models import get_spec
from robot_offload.partition.profile import output_error

#: seeds of the frames, apart from the profiles' and the benchmark's
SEED0 = 70_000


def measure(name: str, qualities, frames: int, width: int, height: int, input_size=None,
            weights_path: str = "") -> list:
    """One row per quality: dict(model, quality, frames, kb_frame, kb_jpeg, ratio,
    error_median, error_max, top1)."""
    spec = get_spec(name)
    size = tuple(input_size or spec.input_size)
    model = spec.build(weights_path or None)
    refs, pictures = [], []
    with torch.inference_mode():
        for i in range(frames):
            frame = natural_image(height, width, seed=SEED0 + i)
            pictures.append(frame)
            refs.append(model(spec.preprocess(frame, size)))
    rows = []
    for q in qualities:
        sizes, errors, agree = [], [], 0
        with torch.inference_mode():
            for frame, ref in zip(pictures, refs):
                enc = frame_codec.encode(frame, "frame", q)
                if enc is None:      # the JPEG would not be smaller: the frame goes lossless
                    sizes.append(frame.nbytes)
                    errors.append(0.0)
                    agree += 1
                    continue
                pixels = codec.decode(enc, frames=True).numpy()
                y = model(spec.preprocess(pixels, size))
                sizes.append(enc.nbytes)
                errors.append(output_error(y, ref))
                if spec.task == "classification":
                    agree += int(torch.equal(y.argmax(-1), ref.argmax(-1)))
        rows.append(dict(model=name, quality=q, frames=frames, kb_frame=pictures[0].nbytes / 1e3,
                         kb_jpeg=statistics.mean(sizes) / 1e3,
                         ratio=pictures[0].nbytes / statistics.mean(sizes),
                         error_median=statistics.median(errors), error_max=max(errors),
                         top1=(agree if spec.task == "classification" else None)))
    return rows


def table(rows) -> str:
    md = ["| model | quality | frame KB | JPEG KB (mean) | smaller by | output error median / max | top-1 agreement |",
          "|---|---|---|---|---|---|---|"]
    for r in rows:
        top1 = "n/a" if r["top1"] is None else f"{r['top1']}/{r['frames']}"
        md.append(f"| {r['model']} | {r['quality']} | {r['kb_frame']:.0f} | {r['kb_jpeg']:.1f} | "
                  f"{r['ratio']:.1f}x | {r['error_median']:.3f} / {r['error_max']:.3f} | {top1} |")
    return "\n".join(md) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(prog="lossy_input", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", required=True)
    ap.add_argument("--qualities", nargs="+", type=int, default=[75, 90, 95])
    ap.add_argument("--frames", type=int, default=100)
    ap.add_argument("--camera-size", default="224,224", metavar="W,H")
    ap.add_argument("--weights", action="append", default=[], metavar="MODEL=FILE",
                    help="a model's weights (state dict, .pt or .safetensors) instead of the registry's")
    ap.add_argument("--out", default="", help="write the table here (markdown)")
    args = ap.parse_args(argv)
    weights = dict(item.split("=", 1) for item in args.weights)
    for q in args.qualities:
        frame_codec.check_quality(q)
    width, height = (int(v) for v in args.camera_size.split(","))
    torch.manual_seed(0)
    np.random.seed(0)
    rows = []
    for name in args.models:
        rows += measure(name, args.qualities, args.frames, width, height, weights_path=weights.get(name, ""))
    text = ("# JPEG camera frames: bytes and accuracy\n\n`python -m robot_offload.bench.lossy_input "
            + " ".join(argv if argv is not None else sys.argv[1:]) + "`\n\n" + table(rows))
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
