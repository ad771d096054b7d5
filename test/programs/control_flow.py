"""Data-dependent control flow: a branch and a loop count decided by tensor values, so the
operator sequence changes between frames once the sequence has been identified.

    python control_flow.py --out out.npz [--frames 10]
"""
import argparse

import numpy as np
import torch
from torch import nn

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("--frames", type=int, default=10)
args = ap.parse_args()

torch.manual_seed(0)


class Gated(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1))
        self.bright = nn.Conv2d(8, 4, 1)
        self.dark = nn.Sequential(nn.Conv2d(8, 4, 3, padding=1), nn.Tanh())
        self.refine = nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x):
        h = self.stem(x)
        y = self.bright(h) if h.mean() > 0 else self.dark(h)     # a branch on a value
        steps = int(x.mean().item() * 4) + 1                        # a loop count from a value
        for _ in range(steps):
            y = torch.relu(self.refine(y)) + y
        return y


model = Gated().eval()
outs, steps = [], []
with torch.no_grad():
    for i in range(args.frames):
        # Frames 0-5 are alike (the sequence is identified on them); later ones change the
        # branch and the number of refinement steps.
        level = 0.2 if i < 6 else (0.9 if i % 2 else -0.6)
        x = torch.full((1, 3, 16, 16), level) + 0.05 * torch.sin(torch.arange(768.0).view(1, 3, 16, 16) + i)
        y = model(x)
        outs.append(y.numpy().copy())
        print(f"frame {i}: level {level}, out mean {y.mean().item():.5f}")
np.savez(args.out, y=np.stack(outs))
