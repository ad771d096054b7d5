"""An ordinary torchvision classification loop (knows nothing about offloading).

    python classifier_loop.py --out logits.npz [--frames 8] [--size 64]
"""
import argparse

import numpy as np
import torch
import torchvision

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("--frames", type=int, default=8)
ap.add_argument("--size", type=int, default=64)
ap.add_argument("--model", default="resnet18")
args = ap.parse_args()

torch.manual_seed(0)
model = getattr(torchvision.models, args.model)(num_classes=1000).eval()
gen = torch.Generator().manual_seed(1)
logits, top5 = [], []
with torch.no_grad():
    for i in range(args.frames):
        image = torch.rand(1, 3, args.size, args.size, generator=gen)
        x = (image - 0.45) / 0.225
        out = model(x)
        probs = torch.softmax(out, dim=1)
        top5.append(probs.topk(5).indices[0].tolist())
        logits.append(out.numpy().copy())
        print(f"frame {i}: top-1 class {top5[-1][0]}, p={probs.max().item():.4f}")
np.savez(args.out, logits=np.stack(logits), top5=np.array(top5))
