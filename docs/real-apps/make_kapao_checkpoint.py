"""Write a KAPAO checkpoint in the release format (a pickled FP16 model under 'model'),
built with the checkout's own classes, for machines without the released weights.

    python make_kapao_checkpoint.py KAPAO_CHECKOUT OUT.pt [--cfg models/yolov5s6.yaml] [--seed 0]

Weights are random (seeded); ``--obj-bias`` sets the objectness and person-class biases so
that the untrained model still reports people (1.0: every anchor passes KAPAO's default
thresholds, so NMS and pose fusion have the most work to do).
"""
import argparse
import os
import sys

import torch

ap = argparse.ArgumentParser()
ap.add_argument("repo")
ap.add_argument("out")
ap.add_argument("--cfg", default="models/yolov5s6.yaml")
ap.add_argument("--seed", type=int, default=0)
ap.add_argument("--obj-bias", type=float, default=1.0)
args = ap.parse_args()
sys.path.insert(0, os.path.abspath(args.repo))
import yaml  # noqa: E402
from models.yolo import Model  # noqa: E402  (the checkout's own class)
from utils.general import strip_optimizer  # noqa: E402  (its own release step)

torch.manual_seed(args.seed)
with open(os.path.join(args.repo, "data/coco-kp.yaml")) as f:
    data = yaml.safe_load(f)
model = Model(os.path.join(args.repo, args.cfg), ch=3, nc=data["nc"], num_coords=data["num_coords"])
detect = model.model[-1]
with torch.no_grad():
    for conv in detect.m:
        b = conv.bias.view(detect.na, -1)
        b[:, 4] = args.obj_bias            # objectness
        b[:, 5] = args.obj_bias            # person class
model.names = data["names"]
torch.save({"epoch": 0, "model": model, "optimizer": None}, args.out)
os.environ.setdefault("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")   # our own file, just written
strip_optimizer(args.out)               # FP16, requires_grad off: the release format
print(f"wrote {args.out}: {sum(p.numel() for p in model.parameters())} parameters, FP16")
