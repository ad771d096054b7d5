"""Weights changed after the model has already run: a ``half()``/``float()`` round trip
(``param.data`` swapped twice) and a conv-BN fusion as YOLO's ``fuse()`` does it, one
weight by ``.data =``, the other by a new ``nn.Parameter``.

    python half_fuse.py --out out.npz
"""
import argparse

import numpy as np
import torch
from torch import nn

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("--frames", type=int, default=1, help="frames per phase (load, half/float, fused)")
args = ap.parse_args()

torch.manual_seed(0)


class Block(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(cout)

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x)) if self.bn is not None else self.conv(x))


model = nn.Sequential(Block(3, 8), Block(8, 8), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))
for m in model.modules():      # statistics as after training
    if isinstance(m, nn.BatchNorm2d):
        m.running_mean.uniform_(-0.5, 0.5)
        m.running_var.uniform_(0.5, 2.0)
        m.weight.data.uniform_(0.5, 1.5)
model.eval()
x = torch.rand(1, 3, 16, 16, generator=torch.Generator().manual_seed(1))
outs = []


def run():
    for _ in range(args.frames):
        outs.append(model(x).numpy().copy())


with torch.no_grad():
    run()
    model.half()
    model.float()                          # weights now rounded to float16
    run()
    for k, blk in enumerate(m for m in model.modules() if isinstance(m, Block)):
        conv, bn = blk.conv, blk.bn
        scale = bn.weight / torch.sqrt(bn.running_var + bn.eps)
        w = conv.weight * scale.view(-1, 1, 1, 1)
        b = bn.bias - bn.running_mean * scale
        if k == 0:
            conv.weight.data = w           # same Parameter object, new data
        else:
            conv.weight = nn.Parameter(w)
        conv.bias = nn.Parameter(b)
        blk.bn = None
    run()
    model[-1].weight.data.mul_(0.5)        # an in-place write through .data
    run()
    print("outputs", [o.ravel()[:2] for o in outs])
np.savez(args.out, out=np.stack(outs))
