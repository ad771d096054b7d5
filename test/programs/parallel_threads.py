"""Two inferences at the same time: a pool of two worker threads, each with its own
frames, racing through one model (as two rospy subscribers would).

    python parallel_threads.py --out out.npz [--frames 8]
"""
import argparse
import concurrent.futures

import numpy as np
import torch
from torch import nn

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("--frames", type=int, default=8)
args = ap.parse_args()

torch.manual_seed(0)
model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
                      nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4)).eval()
frames = [torch.rand(1, 3, 16, 16, generator=torch.Generator().manual_seed(i)) for i in range(args.frames)]


def infer(i):
    with torch.no_grad():
        h = model(frames[i])
        return (h.softmax(1) + h.mean()).numpy().copy()


with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
    out = list(pool.map(infer, range(args.frames)))
print("classes", [int(o.argmax()) for o in out])
np.savez(args.out, out=np.stack(out))
