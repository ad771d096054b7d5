"""Results written into tensors the program allocated once: ``out=`` arguments, in-place
normalisation of the input, an in-place activation, and a running average kept across
frames (an exponential filter over the model's output, as a tracker smooths detections).

    python preallocated_outputs.py --out out.npz [--frames 6]
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
backbone = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)).eval()
head = nn.Linear(8, 4).eval()
gen = torch.Generator().manual_seed(11)
x = torch.empty(1, 3, 20, 20)
features = torch.empty(1, 8)
logits = torch.empty(1, 4)
smoothed = torch.zeros(1, 4)
mean = torch.tensor([0.5, 0.4, 0.3]).view(1, 3, 1, 1)
outs = []
with torch.no_grad():
    for i in range(args.frames):
        x.copy_(torch.rand(1, 3, 20, 20, generator=gen))
        x.sub_(mean).mul_(2.0)                                  # normalised in place
        f = backbone(x)
        f.relu_()                                              # in-place activation
        torch.mean(f, dim=(2, 3), out=features)                # into a preallocated tensor
        torch.matmul(features, head.weight.t(), out=logits)
        logits.add_(head.bias)
        smoothed.mul_(0.7).add_(logits, alpha=0.3)             # state kept across frames
        outs.append(np.concatenate([logits.numpy().copy(), smoothed.numpy().copy()], axis=1))
        print(f"frame {i}: {smoothed.flatten().tolist()}")
np.savez(args.out, out=np.stack(outs))
