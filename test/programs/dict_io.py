"""A model that takes a dict of tensors and returns a dict (multi-sensor style).

    python dict_io.py --out out.npz [--frames 5]
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


class Fusion(nn.Module):
    def __init__(self):
        super().__init__()
        self.image = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.imu = nn.Linear(6, 8)
        self.heads = nn.ModuleDict({"pose": nn.Linear(16, 7), "label": nn.Linear(16, 4)})

    def forward(self, batch):
        f = torch.cat([self.image(batch["image"]), torch.tanh(self.imu(batch["imu"]))], 1)
        return {name: head(f) for name, head in self.heads.items()} | {"feature": f}


model = Fusion().eval()
gen = torch.Generator().manual_seed(6)
out = {"pose": [], "label": [], "feature": []}
with torch.no_grad():
    for i in range(args.frames):
        batch = {"image": torch.rand(1, 3, 16, 16, generator=gen), "imu": torch.randn(1, 6, generator=gen)}
        res = model(batch)
        for k in out:
            out[k].append(res[k].numpy().copy())
        print(f"frame {i}: label {int(res['label'].argmax())}")
np.savez(args.out, **{k: np.stack(v) for k, v in out.items()})
