"""Write an AGRNav SCONet checkpoint in the format its inference_ros.py reads
({'model': state_dict, 'config_dict': ...}), built with the checkout's own classes and its
own weight initialiser, for machines without the released weights.

    python make_agrnav_checkpoint.py AGRNAV_CHECKOUT OUT.pth [--seed 0]
"""
import argparse
import os
import sys

import torch

ap = argparse.ArgumentParser()
ap.add_argument("repo")
ap.add_argument("out")
ap.add_argument("--seed", type=int, default=0)
args = ap.parse_args()
sys.path.insert(0, os.path.join(os.path.abspath(args.repo), "src/perception/SCONet"))
from network.data.SemanticKITTI import SemanticKITTI_dataloader  # noqa: E402
from network.models.SCONet import SCONet  # noqa: E402

config = {"DATASET": {"TYPE": "SemanticKITTI", "ROOT_DIR": "", "MODALITIES": {"3D_OCCUPANCY": True},
                      "AUGMENTATION": {"FLIPS": False}},
          "MODEL": {"TYPE": "SCONet"}, "TRAIN": {"BATCH_SIZE": 1}, "VAL": {"BATCH_SIZE": 1},
          "DATALOADER": {"NUM_WORKERS": 0}, "OUTPUT": {}, "STATUS": {}}
torch.manual_seed(args.seed)
ds = SemanticKITTI_dataloader(config["DATASET"], "test")
model = SCONet(class_num=ds.nbr_classes, input_dimensions=ds.grid_dimensions,
               class_frequencies=ds.class_frequencies)
model.weights_init()
torch.save({"model": model.state_dict(), "config_dict": config, "startEpoch": 1}, args.out)
print(f"wrote {args.out}: {sum(p.numel() for p in model.parameters())} parameters")
