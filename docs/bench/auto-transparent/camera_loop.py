"""An ordinary camera loop, for the launcher: one torchvision model, a frame buffer refilled
in place every frame, the top class read back. Writes one CSV row per frame (wall time at
the frame's start, latency in ms) and stops when STOP_FILE exists.

    python camera_loop.py --model resnet50 --out frames.csv --ready READY_FILE --stop STOP_FILE
"""
import argparse
import os
import time

import torch
import torchvision

ap = argparse.ArgumentParser()
ap.add_argument("--model", default="resnet50")
ap.add_argument("--out", required=True)
ap.add_argument("--ready", required=True, help="created after --warm frames")
ap.add_argument("--stop", required=True, help="the loop ends once this file exists")
ap.add_argument("--warm", type=int, default=8)
args = ap.parse_args()

torch.manual_seed(0)
model = getattr(torchvision.models, args.model)(weights=None).eval()
frame = torch.empty(1, 3, 224, 224)
g = torch.Generator().manual_seed(1)
with open(args.out, "w") as out, torch.no_grad():
    out.write("wall_s,latency_ms,top1\n")
    k = 0
    while not os.path.exists(args.stop):
        frame.copy_(torch.rand(1, 3, 224, 224, generator=g))      # the camera refills its buffer
        t0 = time.time()
        top1 = int(model(frame).argmax())
        out.write(f"{t0:.3f},{(time.time() - t0) * 1e3:.1f},{top1}\n")
        out.flush()
        k += 1
        if k == args.warm:
            open(args.ready, "w").close()
