"""KAPAO person tracking with a real master and real nodes: person_tracker pairs each
People result with the depth of its own frame, however late the result comes."""

import time

import numpy as np
import pytest
import rospy
from rosgraph_msgs.msg import Log
from sensor_msgs.msg import CameraInfo, Image

from robot_offload.msg import People, Person

W, H = 160, 120
FX = FY = 100.0
CX, CY = (W - 1) / 2, (H - 1) / 2
TORSO = (5, 6, 11, 12)


class Topic:
    def __init__(self, name, msg_type):
        self.msgs = []
        self.sub = rospy.Subscriber(name, msg_type, self.msgs.append, queue_size=100, buff_size=2 ** 24)

    def wait_for(self, predicate, timeout_s, start=0):
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            for m in list(self.msgs[start:]):
                if predicate(m):
                    return m
            time.sleep(0.05)
        pytest.fail(f"{self.sub.name}: nothing matching within {timeout_s} s ({len(self.msgs)} messages; "
                    f"last {self.msgs[-1] if self.msgs else None})")


@pytest.fixture
def topics():
    made = []

    def make(name, msg_type):
        made.append(Topic(name, msg_type))
        return made[-1]
    yield make
    for t in made:
        t.sub.unregister()


def wait_connected(endpoints, timeout_s=90):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if all(e.get_num_connections() > 0 for e in endpoints):
            return
        time.sleep(0.1)
    pytest.fail("not connected: " + ", ".join(e.name for e in endpoints if e.get_num_connections() == 0))


def camera_info(stamp):
    info = CameraInfo(width=W, height=H, K=[FX, 0, CX, 0, FY, CY, 0, 0, 1], distortion_model="plumb_bob",
                      D=[0.0] * 5, R=[1, 0, 0, 0, 1, 0, 0, 0, 1], P=[FX, 0, CX, 0, 0, FY, CY, 0, 0, 0, 1, 0])
    info.header.stamp, info.header.frame_id = stamp, "camera"
    return info


def depth_image(stamp, metres):
    img = Image(height=H, width=W, encoding="32FC1", is_bigendian=0, step=W * 4,
                data=np.full((H, W), metres, dtype=np.float32).tobytes())
    img.header.stamp, img.header.frame_id = stamp, "camera"
    return img


def people_at_centre(stamp):
    """One person whose torso keypoints sit symmetrically around the principal point: its
    position is (0, 0, depth) in the optical frame."""
    u, v, c = [CX] * 17, [CY] * 17, [0.0] * 17
    for k, (du, dv) in zip(TORSO, [(-8, -10), (8, -10), (-8, 10), (8, 10)]):
        u[k], v[k], c[k] = CX + du, CY + dv, 0.9
    msg = People(target_index=-1, track_id=-1, track_status="none",
                 people=[Person(score=0.9, box_xyxy=[CX - 20, CY - 40, CX + 20, CY + 45],
                                keypoints_u=u, keypoints_v=v, keypoints_conf=c)])
    msg.header.stamp, msg.header.frame_id = stamp, "camera"
    return msg


def test_tracker_pairs_each_result_with_the_depth_of_its_frame(launch, topics):
    """People arrive DELAY frames late; every frame's depth differs. The position of each
    must come from its own frame's depth, and a result of no frame is not processed."""
    launch.rosrun("robot_offload", "person_tracker", "__name:=person_tracker", "_input:=people",
                         "people_in:=/sync_test/people", "depth:=/sync_test/depth",
                         "camera_info:=/sync_test/camera_info")
    rosout = topics("/rosout_agg", Log)
    people_pub = rospy.Publisher("/sync_test/people", People, queue_size=10)
    depth_pub = rospy.Publisher("/sync_test/depth", Image, queue_size=50)
    info_pub = rospy.Publisher("/sync_test/camera_info", CameraInfo, queue_size=50)
    out = topics("/person_tracker/people", People)
    wait_connected([people_pub, depth_pub, info_pub, out.sub])

    n, delay = 10, 4
    t0 = rospy.Time.now()
    stamps = [t0 + rospy.Duration.from_sec(0.1 * i) for i in range(n)]
    metres = [1.0 + 0.25 * i for i in range(n)]
    orphan = t0 + rospy.Duration.from_sec(0.45)  # between frames 4 and 5, further than the slop
    for i in range(n + delay):
        if i < n:
            info_pub.publish(camera_info(stamps[i]))
            depth_pub.publish(depth_image(stamps[i], metres[i]))
        j = i - delay
        if j == 5:
            people_pub.publish(people_at_centre(orphan))
        if j >= 0:
            time.sleep(0.05)  # the newer frames' depth is in before the late result
            people_pub.publish(people_at_centre(stamps[j]))
            out.wait_for(lambda m, s=stamps[j]: m.header.stamp == s, 30)
        else:
            time.sleep(0.1)
    by_stamp = {m.header.stamp: m for m in out.msgs}
    for s, d in zip(stamps, metres):
        person = by_stamp[s].people[0]
        assert person.has_position, s
        assert (person.position.x, person.position.y, person.position.z) == pytest.approx((0.0, 0.0, d), abs=1e-4)
    assert orphan not in by_stamp
    assert by_stamp[stamps[-1]].track_id >= 1 and by_stamp[stamps[-1]].header.frame_id == "camera"
    # ... and the dropped one is reported.
    warning = rosout.wait_for(lambda m: m.name == "/person_tracker" and "found no" in m.msg, 30)
    assert warning.level == Log.WARN
    assert "1 message(s) of /sync_test/people found no /sync_test/depth and /sync_test/camera_info" in warning.msg
