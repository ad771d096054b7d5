"""Frames copied into one input tensor with ``copy_`` inside ``torch.inference_mode()``
(inference tensors have no version counter).

    python copy_inference_mode.py --out out.npz [--frames 6]
"""
import argparse

import numpy as np
import torch
from torch import nn

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("--frames", type=int, default=6)
args = ap.parse_args()

torch.manual_seed(0)
model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 3, padding=1),
                      nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(16, 3)).eval()
gen = torch.Generator().manual_seed(5)
outs = []
with torch.inference_mode():
    x = torch.empty(1, 3, 24, 24)          # an inference tensor, reused every frame
    for i in range(args.frames):
        frame = torch.rand(1, 3, 24, 24, generator=gen)
        x.copy_(frame)
        y = model(x)
        outs.append(y.numpy().copy())
        print(f"frame {i}: {y.flatten().tolist()}")
np.savez(args.out, out=np.stack(outs))
