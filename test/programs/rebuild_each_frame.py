"""A model built again in every loop iteration (a new object each time; same seed, so the
same weights, except for the last frames, which use another seed).

    python rebuild_each_frame.py --out out.npz [--frames 6]
"""
import argparse

import numpy as np
import torch
from torch import nn

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("--frames", type=int, default=6)
args = ap.parse_args()


def build(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(6, 3)).eval()


x = torch.rand(1, 3, 12, 12, generator=torch.Generator().manual_seed(9))
outs = []
with torch.no_grad():
    for i in range(args.frames):
        model = build(0 if i < args.frames - 2 else 1)
        outs.append(model(x).numpy().copy())
        print(f"frame {i}: {outs[-1].ravel().tolist()}")
        del model
np.savez(args.out, out=np.stack(outs))
