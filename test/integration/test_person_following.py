"""KAPAO person following with a real master and real nodes: person_tracker pairs each
People result with the depth of its own frame, however late the result comes;
person_follower turns the tracked person into move_base goals through a static TF tree
(map -> odom -> base_link -> camera), publishes the annotated image, and its service
starts and stops the following."""

import math
import subprocess
import threading
import time

import numpy as np
import pytest
import rospy
from actionlib_msgs.msg import GoalID
from geometry_msgs.msg import PointStamped, PoseStamped
from rosgraph_msgs.msg import Log
from sensor_msgs.msg import CameraInfo, Image
from std_srvs.srv import SetBool

from robot_offload.apps.annotate import TARGET_RGB
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


def colour_image(stamp):
    img = Image(height=H, width=W, encoding="rgb8", is_bigendian=0, step=W * 3,
                data=np.full((H, W, 3), 40, dtype=np.uint8).tobytes())
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


class Stream:
    """Camera images, depth, camera_info and People for one person at the image centre, at
    10 Hz, on a thread; ``metres`` is the person's depth."""

    def __init__(self, metres):
        self.metres = metres
        self.pubs = {name: rospy.Publisher(f"/follow_test/{name}", t, queue_size=20)
                     for name, t in [("image", Image), ("depth", Image), ("camera_info", CameraInfo),
                                     ("people", People)]}
        self.stamps = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self):
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            stamp = rospy.Time.now()
            self.pubs["image"].publish(colour_image(stamp))
            self.pubs["camera_info"].publish(camera_info(stamp))
            self.pubs["depth"].publish(depth_image(stamp, self.metres))
            self.stamps.append(stamp)
            time.sleep(0.02)
            self.pubs["people"].publish(people_at_centre(stamp))
            self._stop.wait(0.08)

    def stop(self):
        self._stop.set()
        self._thread.join(5)


def static_tf(launch, name, *args):
    launch.rosrun("tf2_ros", "static_transform_publisher", *map(str, args), f"__name:={name}")


def test_follower_goals_through_tf_annotation_and_service(launch, topics):
    half_pi = math.pi / 2
    # map -> odom: 1 m x, 2 m y, turned 90 deg; odom -> base_link: 0.5 m forward; the camera
    # 1 m up and 0.2 m forward, its optical frame looking along base_link's x.
    static_tf(launch, "tf_map_odom", 1, 2, 0, half_pi, 0, 0, "map", "odom")
    static_tf(launch, "tf_odom_base", 0.5, 0, 0, 0, 0, 0, "odom", "base_link")
    static_tf(launch, "tf_base_camera", 0.2, 0, 1.0, -half_pi, 0, -half_pi, "base_link", "camera")
    launch.rosrun("robot_offload", "person_tracker", "__name:=person_tracker", "_input:=people",
                  "people_in:=/follow_test/people", "depth:=/follow_test/depth",
                  "camera_info:=/follow_test/camera_info")
    launch.rosrun("robot_offload", "person_follower", "__name:=person_follower", "_min_interval_s:=0.5",
                  "target:=/person_tracker/target", "people:=/person_tracker/people", "image:=/follow_test/image")
    goals = topics("/move_base_simple/goal", PoseStamped)
    cancels = topics("/move_base/cancel", GoalID)
    person = topics("/person_follower/person", PointStamped)
    person_robot = topics("/person_follower/person_robot", PointStamped)
    annotated = topics("/person_follower/annotated", Image)
    stream = Stream(4.0)
    wait_connected([*stream.pubs.values(), goals.sub, cancels.sub, person.sub, annotated.sub])
    rospy.wait_for_service("/person_follower/enable", timeout=60)
    enable = rospy.ServiceProxy("/person_follower/enable", SetBool)
    stream.start()
    try:
        # 1. Following off (the default): the person in both frames and the annotated
        #    image, but no goal. Person at depth 4 m: base_link (4.2, 0, 1), odom (4.7, 0, 1),
        #    map (1 - 0, 2 + 4.7, 1); the robot at map (1, 2.5).
        p = person.wait_for(lambda m: True, 90)
        assert p.header.frame_id == "map" and p.header.stamp in stream.stamps  # the frame's exact stamp
        assert (p.point.x, p.point.y, p.point.z) == pytest.approx((1.0, 6.7, 1.0), abs=1e-6)
        r = person_robot.wait_for(lambda m: True, 10)
        assert r.header.frame_id == "base_link" and r.header.stamp in stream.stamps
        assert (r.point.x, r.point.y, r.point.z) == pytest.approx((4.2, 0.0, 1.0), abs=1e-6)
        img = annotated.wait_for(lambda m: True, 30)
        assert img.header.stamp in stream.stamps and (img.width, img.height, img.encoding) == (W, H, "rgb8")
        pixels = np.frombuffer(bytes(img.data), dtype=np.uint8).reshape(H, W, 3)
        assert np.all(pixels == TARGET_RGB, axis=-1).sum() > 50  # the target's box and skeleton
        time.sleep(1.5)
        assert goals.msgs == []

        # 2. On: one goal, in map, 2.5 m from the person towards the robot, facing them.
        assert enable(True).success
        g = goals.wait_for(lambda m: True, 20)
        assert g.header.frame_id == "map"
        pos, q = g.pose.position, g.pose.orientation
        assert (pos.x, pos.y, pos.z) == pytest.approx((1.0, 4.2, 0.0), abs=1e-6)
        assert math.hypot(1.0 - pos.x, 6.7 - pos.y) == pytest.approx(2.5)
        assert (q.x, q.y, q.z, q.w) == pytest.approx((0, 0, math.sin(half_pi / 2), math.cos(half_pi / 2)))
        time.sleep(2.0)  # the person stands still: no new goal
        assert len(goals.msgs) == 1

        # 3. The person steps 1 m back: new goals follow the tracker's estimate there, each
        #    2.5 m from the person as estimated in its frame, until within min_goal_move_m.
        stream.metres = 5.0
        g2 = goals.wait_for(lambda m: m.pose.position.y > 5.2 - 0.2, 30)
        assert g2.pose.position.x == pytest.approx(1.0, abs=1e-6)
        for goal in goals.msgs[1:]:
            # the person of the goal's frame (the two topics arrive independently)
            p = person.wait_for(lambda m, s=goal.header.stamp: m.header.stamp == s, 10)
            assert math.hypot(p.point.x - goal.pose.position.x, p.point.y - goal.pose.position.y) == pytest.approx(2.5)

        # 4. Off: move_base's goal is cancelled and no goal follows, even when the person moves.
        assert enable(False).success
        cancels.wait_for(lambda m: m.id == "" and m.stamp == rospy.Time(0), 10)
        n_goals = len(goals.msgs)
        stream.metres = 4.0
        person.wait_for(lambda m: abs(m.point.y - 6.7) < 0.05, 30, start=len(person.msgs))
        time.sleep(1.0)
        assert len(goals.msgs) == n_goals

        # 5. On again: a goal at once for where the person is now.
        assert enable(True).success
        g3 = goals.wait_for(lambda m: True, 20, start=n_goals)
        assert (g3.pose.position.x, g3.pose.position.y) == pytest.approx((1.0, 4.2), abs=0.05)
    finally:
        stream.stop()


def test_follow_launch_arguments():
    def roslaunch(*args):
        return subprocess.run(["roslaunch", *args], capture_output=True, text=True, timeout=60, check=True).stdout
    nodes = set(roslaunch("--nodes", "robot_offload", "kapao_people_tracking.launch").split())
    assert "/person_follower" not in nodes and "/camera_tf" not in nodes
    nodes = set(roslaunch("--nodes", "robot_offload", "kapao_people_tracking.launch", "follow:=true",
                          "camera_tf:=0.1 0 1 -1.5708 0 -1.5708").split())
    assert {"/person_tracker", "/person_follower", "/camera_tf"} <= nodes
    args = roslaunch("--args", "/camera_tf", "robot_offload", "kapao_people_tracking.launch", "follow:=true",
                     "camera_tf:=0.1 0 1 -1.5708 0 -1.5708")
    assert "static_transform_publisher 0.1 0 1 -1.5708 0 -1.5708 base_link camera" in args
    args = roslaunch("--args", "/person_follower", "robot_offload", "kapao_people_tracking.launch",
                     "follow:=true")
    assert "target:=person_tracker/target" in args and "image:=camera/image" in args     # relative: a robot namespace works
