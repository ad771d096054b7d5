"""Inference in worker threads (as in a rospy subscriber callback): a thread per frame
and a thread pool, never the main thread.

    python worker_thread.py --out out.npz [--frames 6]
"""
import argparse
import concurrent.futures
import threading

import numpy as np
import torch
from torch import nn

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("--frames", type=int, default=6)
args = ap.parse_args()

torch.manual_seed(0)
model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
                      nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4)).eval()
frames = [torch.rand(1, 3, 20, 20, generator=torch.Generator().manual_seed(i)) for i in range(args.frames)]
results = {}


class Worker(threading.Thread):
    def __init__(self, i):
        super().__init__(name=f"worker-{i}")
        self.i = i

    def run(self):
        with torch.no_grad():
            results[self.i] = model(frames[self.i]).softmax(1).numpy().copy()


def infer(i):
    with torch.no_grad():
        return model(frames[i] * 2.0).numpy().copy()


for i in range(args.frames):          # one thread per frame (callback style)
    t = Worker(i)
    t.start()
    t.join()
with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
    pooled = list(pool.map(infer, range(args.frames)))
a = np.stack([results[i] for i in range(args.frames)])
print("thread results", a.argmax(-1).ravel().tolist())
np.savez(args.out, a=a, b=np.stack(pooled))
