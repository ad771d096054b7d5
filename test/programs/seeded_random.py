"""Randomness in the forward pass: dropout kept on (Monte Carlo dropout) and noise from
``torch.randn``, under the program's own seed.

    python seeded_random.py --out out.npz [--frames 5]
"""
import argparse

import numpy as np
import torch
from torch import nn
import torch.nn.functional as F

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("--frames", type=int, default=5)
args = ap.parse_args()

torch.manual_seed(0)


class Noisy(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.fc = nn.Linear(8 * 16 * 16, 6)
        self.gen = torch.Generator().manual_seed(11)

    def forward(self, x):
        h = torch.relu(self.conv(x))
        h = F.dropout(h, p=0.3, training=True)             # MC dropout
        h = h + 0.1 * torch.randn(h.shape)                 # noise from the default generator
        h = h + 0.05 * torch.randn_like(h)
        h = h + torch.empty_like(h).normal_(0, 0.01, generator=self.gen)   # its own generator
        return self.fc(h.flatten(1))


model = Noisy().eval()
torch.manual_seed(42)
outs = []
with torch.no_grad():
    for i in range(args.frames):
        x = torch.rand(1, 3, 16, 16)
        outs.append(model(x).numpy().copy())
        print(f"frame {i}: {outs[-1].ravel()[:3]}")
after = torch.rand(3).numpy()          # the generator's state after the loop
np.savez(args.out, out=np.stack(outs), after=after)
