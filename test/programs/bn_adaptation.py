"""Test-time adaptation: BatchNorm layers in training mode update their running
statistics every frame, and a later eval pass reads them.

    python bn_adaptation.py --out out.npz [--frames 5]
"""
import argparse

import numpy as np
import torch
from torch import nn

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("--frames", type=int, default=5)
args = ap.parse_args()

torch.manual_seed(0)
model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                      nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                      nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 3))
model.eval()
gen = torch.Generator().manual_seed(2)
adapted, evaluated = [], []
with torch.no_grad():
    for i in range(args.frames):
        x = torch.rand(2, 3, 16, 16, generator=gen) * (1 + i)   # a drifting input
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.train()
        adapted.append(model(x).numpy().copy())
        model.eval()
        evaluated.append(model(x).numpy().copy())          # reads the adapted statistics
        print(f"frame {i}: running_mean[0] {float(model[1].running_mean[0]):.5f}")
np.savez(args.out, adapted=np.stack(adapted), evaluated=np.stack(evaluated),
         running_mean=model[1].running_mean.numpy(), running_var=model[4].running_var.numpy(),
         batches=np.array([model[1].num_batches_tracked.item()]))
