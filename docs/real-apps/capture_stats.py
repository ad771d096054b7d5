"""Save the first N InferenceStats of a topic as JSON lines:

    python cap_stats.py TOPIC OUT.jsonl N
"""
import sys, json, rospy
from robot_offload.msg import InferenceStats
topic, out, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
f = open(out, "w"); k = [0]
def cb(m):
    d = dict(mode=m.mode, executed=m.executed_mode, phase=m.phase, rt=m.round_trips, up=m.bytes_up, down=m.bytes_down,
             latency_s=round(m.latency_s, 3), server_s=round(m.server_compute_s, 3), fallback=m.fallback_reason)
    f.write(json.dumps(d) + "\n"); f.flush(); k[0] += 1; print(d, flush=True)
    if k[0] >= n: rospy.signal_shutdown("done")
rospy.init_node("cap_stats", anonymous=True)
rospy.Subscriber(topic, InferenceStats, cb, queue_size=100)
rospy.spin()
