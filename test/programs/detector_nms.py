"""A small dense detector with per-class non-maximum suppression
(``torchvision.ops.batched_nms``) on the model's outputs: how many boxes survive changes
from frame to frame.

    python detector_nms.py --out out.npz [--frames 6]
"""
import argparse

import numpy as np
import torch
import torchvision
from torch import nn

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("--frames", type=int, default=6)
args = ap.parse_args()

torch.manual_seed(0)
NC = 3


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.ReLU(),
                                  nn.Conv2d(16, 16, 3, stride=2, padding=1), nn.ReLU())
        self.box = nn.Conv2d(16, 4, 1)
        self.cls = nn.Conv2d(16, NC, 1)

    def forward(self, x):
        h = self.body(x)
        n, _, gh, gw = h.shape
        ys, xs = torch.meshgrid(torch.arange(gh), torch.arange(gw), indexing="ij")
        centres = torch.stack([xs, ys], -1).reshape(-1, 2).float() * 4 + 2
        d = self.box(h).permute(0, 2, 3, 1).reshape(n, -1, 4)
        wh = torch.exp(d[..., 2:].clamp(max=3)) * 4
        xy = centres + d[..., :2] * 4
        boxes = torch.cat([xy - wh / 2, xy + wh / 2], -1)
        scores = self.cls(h).permute(0, 2, 3, 1).reshape(n, -1, NC).sigmoid()
        return boxes, scores


model = Head().eval()
gen = torch.Generator().manual_seed(4)
kept_boxes, kept_scores, kept_cls, counts = [], [], [], []
with torch.no_grad():
    for i in range(args.frames):
        x = torch.rand(1, 3, 32, 32, generator=gen)
        boxes, scores = model(x)
        s, c = scores[0].max(1)
        m = s > 0.5
        b, s, c = boxes[0][m], s[m], c[m]
        keep = torchvision.ops.batched_nms(b, s, c, 0.3)
        kept_boxes.append(b[keep].numpy())
        kept_scores.append(s[keep].numpy())
        kept_cls.append(c[keep].numpy())
        counts.append(len(keep))
        print(f"frame {i}: {len(keep)} detections")
np.savez(args.out, boxes=np.concatenate(kept_boxes), scores=np.concatenate(kept_scores),
         classes=np.concatenate(kept_cls), counts=np.array(counts))
