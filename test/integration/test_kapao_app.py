"""kapao_people_tracking.launch as shipped (synthetic RGB + depth + camera_info, small
input): People messages and stats flow at the camera rate, and a mode switch through the
parameter server is seen in the stats."""

import subprocess
import time

import rospy

from robot_offload.msg import InferenceStats, People


def test_kapao_tracking_launch_flows_and_switches_mode(launch):
    launch.start("kapao_people_tracking.launch", "input_size:=[128,128]", "rate_hz:=4")
    people, stats = [], []
    subs = [rospy.Subscriber("/person_tracker/people", People, people.append, queue_size=20),
            rospy.Subscriber("/offload_client/stats", InferenceStats, stats.append, queue_size=20)]
    try:
        end = time.monotonic() + 120
        while len(people) < 3 and time.monotonic() < end:
            time.sleep(0.2)
        assert len(people) >= 3, "no People messages from person_tracker"
        n0, t0 = len(people), time.monotonic()
        time.sleep(3.0)
        rate = (len(people) - n0) / (time.monotonic() - t0)
        assert rate > 2.0, f"People at {rate:.1f} Hz, camera at 4 Hz"
        msg = people[-1]
        assert msg.header.frame_id == "camera" and msg.track_status in ("none", "tracking", "coasting")
        assert -1 <= msg.target_index < max(len(msg.people), 1)
        assert stats[-1].model == "kapao_l" and stats[-1].mode == "local"
        subprocess.run(["rosparam", "set", "/offload_client/mode", "full_offload"], check=True, timeout=20)
        end = time.monotonic() + 60
        while time.monotonic() < end and not any(s.executed_mode == "full_offload" for s in stats[-5:]):
            time.sleep(0.2)
        assert any(s.executed_mode == "full_offload" for s in stats[-5:])
        n1 = len(people)
        time.sleep(1.5)
        assert len(people) > n1, "People stopped after the mode switch"
    finally:
        for s in subs:
            s.unregister()
