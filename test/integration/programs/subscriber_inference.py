"""A ROS node that runs its model in a subscriber callback (rospy calls it in a thread of
its own): it publishes numbered frames to itself and saves each frame's output.

    python subscriber_inference.py --out out.npz [--frames 6]   (needs a ROS master)
"""
import argparse
import threading
import time

import numpy as np
import rospy
import torch
from std_msgs.msg import Float32MultiArray, MultiArrayLayout
from torch import nn

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("--frames", type=int, default=6)
args = ap.parse_args()

torch.manual_seed(0)
model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                      nn.Flatten(), nn.Linear(8, 4)).eval()
results, done = {}, threading.Event()


def callback(msg):
    x = torch.tensor(msg.data, dtype=torch.float32).view(1, 3, 16, 16)
    with torch.no_grad():
        results[msg.layout.data_offset] = model(x).softmax(1).numpy().copy()
    if len(results) == args.frames:
        done.set()


rospy.init_node("subscriber_inference", anonymous=True)
topic = rospy.get_name() + "/frames"
sub = rospy.Subscriber(topic, Float32MultiArray, callback, queue_size=args.frames)
pub = rospy.Publisher(topic, Float32MultiArray, queue_size=args.frames)
deadline = time.monotonic() + 30
while pub.get_num_connections() == 0 and time.monotonic() < deadline:
    time.sleep(0.05)
for i in range(args.frames):
    frame = torch.rand(3 * 16 * 16, generator=torch.Generator().manual_seed(i))
    pub.publish(Float32MultiArray(layout=MultiArrayLayout(data_offset=i), data=frame.tolist()))
    time.sleep(0.05)
if not done.wait(60):
    raise SystemExit(f"only {len(results)} of {args.frames} frames came back")
np.savez(args.out, out=np.stack([results[i] for i in range(args.frames)]))
rospy.signal_shutdown("done")
