"""kapao_people_tracking.launch as shipped (synthetic RGB + depth + camera_info, small
input, its default mode auto): People messages and stats flow at the camera rate, and a
mode switch through the parameter server is seen in the stats."""

import subprocess
import time

import pytest
import rospy

from robot_offload.msg import InferenceStats, People


@pytest.mark.timeout(1200)
def test_kapao_tracking_launch_flows_and_switches_mode(launch):
    launch.start("kapao_people_tracking.launch", "input_size:=[128,128]", "rate_hz:=4")
    people, stats = [], []
    subs = [rospy.Subscriber("/person_tracker/people", People, people.append, queue_size=20),
            rospy.Subscriber("/offload_client/stats", InferenceStats, stats.append, queue_size=20)]
    try:
        # auto's first frame measures the model's profile (seconds idle, minutes on a
        # machine whose CPU is oversubscribed)
        end = time.monotonic() + 600
        while len(people) < 3 and time.monotonic() < end:
            time.sleep(0.2)
        assert len(people) >= 3, "no People messages from person_tracker"
        # Every frame the client processes becomes People (the tracker drops none): compare
        # with the client's own count over the same window, not with the camera's rate,
        # which a loaded machine's inference cannot keep.
        n0, s0 = len(people), len(stats)
        end = time.monotonic() + 60
        while len(stats) - s0 < 4 and time.monotonic() < end:
            time.sleep(0.2)
        time.sleep(1.0)           # the last frames' People are on their way
        made, processed = len(people) - n0, len(stats) - s0
        assert processed >= 4, "the client processed too few frames to compare"
        assert made >= processed - 1, f"{made} People for {processed} processed frames"
        msg = people[-1]
        assert msg.header.frame_id == "camera" and msg.track_status in ("none", "tracking", "coasting")
        assert -1 <= msg.target_index < max(len(msg.people), 1)
        assert stats[-1].model == "kapao_l" and stats[-1].mode == "auto"     # the launch default
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


def test_kapao_tracking_launch_with_a_kapao_checkout(launch, tmp_path):
    """kapao_repo:=<checkout> runs the checkout's own code (here the stand-in fixture with
    KAPAO's layout) in the kapao_repo node, its model offloaded by auto (record_replay, or
    the robot where it measured faster), and the tracker consumes its poses; the mode
    switches through the parameter server."""
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "unit"))
    from test_kapao_repo import REPO, make_weights
    weights = make_weights(str(tmp_path / "kapao_w.pt"))
    launch.start("kapao_people_tracking.launch", f"kapao_repo:={os.path.abspath(REPO)}",
                 f"kapao_weights:={weights}", "trust_checkpoint:=true", "kapao_imgsz:=128", "rate_hz:=4",
                 "kapao_timeout_s:=30.0")
    stats, people = [], []
    subs = [rospy.Subscriber("/kapao_repo/stats", InferenceStats, stats.append, queue_size=50),
            rospy.Subscriber("/person_tracker/people", People, people.append, queue_size=50)]
    try:
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline and not any(m.phase == "replaying" for m in stats):
            time.sleep(0.2)
        replayed = [m for m in stats if m.phase == "replaying"]
        assert replayed, [(m.phase, m.round_trips, m.fallback_reason) for m in stats[-5:]]
        assert all(m.round_trips <= 2 and m.executed_mode == "record_replay" for m in replayed)
        assert people, "the tracker published nothing from the kapao_repo poses"
        # auto (the launch default) times the robot too once the server has replayed twice.
        while time.monotonic() < deadline + 60 and not any(m.phase == "robot" for m in stats):
            time.sleep(0.2)
        on_robot = [m for m in stats if m.phase == "robot"]
        assert on_robot and all(m.executed_mode == "local" and m.round_trips == 0 for m in on_robot), \
            [(m.phase, m.executed_mode, m.round_trips) for m in stats[-8:]]
        subprocess.run(["rosparam", "set", "/kapao_repo/mode", "transparent"], check=True, timeout=20)
        t_switch, n = time.monotonic(), len(stats)
        while time.monotonic() < t_switch + 60 and not any(m.phase == "transparent" for m in stats[n:]):
            time.sleep(0.2)
        assert any(m.phase == "transparent" and m.round_trips > 20 for m in stats[n:])
    finally:
        for s in subs:
            s.unregister()
