"""Two models alternating in one process, called from two places.

    python two_models.py --out out.npz [--frames 6]
"""
import argparse

import numpy as np
import torch
import torchvision

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("--frames", type=int, default=6)
args = ap.parse_args()

torch.manual_seed(0)
classifier = torchvision.models.resnet18(num_classes=10).eval()
segmenter = torchvision.models.mobilenet_v2(num_classes=5).eval()
gen = torch.Generator().manual_seed(3)


def classify(x):
    return classifier(x).softmax(1)


def features(x):
    return segmenter.features(x).mean(dim=(2, 3))


a, b = [], []
with torch.no_grad():
    for i in range(args.frames):
        x = torch.rand(1, 3, 64, 64, generator=gen)
        a.append(classify(x).numpy().copy())
        b.append(features(x * 0.5).numpy().copy())
        print(f"frame {i}: class {int(a[-1].argmax())}, feature norm {float(np.linalg.norm(b[-1])):.3f}")
np.savez(args.out, a=np.stack(a), b=np.stack(b))
