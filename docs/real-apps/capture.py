"""Save the first N std_msgs/Float64MultiArray of a topic (rows of x, y, z), in order:

    python capture.py TOPIC OUT.npz N
"""
import sys, numpy as np, rospy
from std_msgs.msg import Float64MultiArray
topic, out, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
got = []
def cb(m):
    got.append(np.asarray(m.data, dtype=np.float64).reshape(-1, 3))
    print(f"capture: message {len(got)}: {got[-1].shape[0]} voxels", flush=True)
    np.savez(out, *got)
    if len(got) >= n:
        rospy.signal_shutdown("done")
rospy.init_node("capture", anonymous=True)
rospy.Subscriber(topic, Float64MultiArray, cb, queue_size=100)
rospy.spin()
