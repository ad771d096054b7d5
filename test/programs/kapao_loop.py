"""A KAPAO-architecture inference loop: its decoder builds its grids on the first call,
so the first inference runs other operators than the rest (RRTO §VI-B).

    python kapao_loop.py --out out.npz [--frames 6] [--size 128]
"""
import argparse

import numpy as np
import torch

from robot_offload.models.kapao import KAPAO

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("--frames", type=int, default=6)
ap.add_argument("--size", type=int, default=128)
args = ap.parse_args()

torch.manual_seed(0)
model = KAPAO().eval()
gen = torch.Generator().manual_seed(2)
preds = []
with torch.inference_mode():
    for i in range(args.frames):
        x = torch.rand(1, 3, args.size, args.size, generator=gen)
        pred, maps = model(x)
        best = pred[0, :, 4].argmax().item()
        preds.append(pred.cpu().numpy().copy())
        print(f"frame {i}: {pred.shape[1]} candidates, best {best}, maps {[tuple(m.shape) for m in maps]}")
np.savez(args.out, pred=np.stack(preds))
