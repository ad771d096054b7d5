"""kapao_repo: the real KAPAO code (a local checkout) on camera images, its model offloaded
with the transparent or record_replay mode (or run locally), publishing the poses.

Parameters: ``~kapao_repo`` (path of the checkout), ``~weights`` (e.g. kapao_l_coco.pt),
``~data`` (data yaml, relative to the checkout; ``data/coco-kp.yaml``), ``~imgsz`` (1280),
``~mode`` (``auto`` | ``record_replay`` | ``transparent`` | ``local``; read every frame, so
``rosparam set`` switches it), ``~server_ns``, ``~timeout_s`` (deadline of one server call;
past it the frame finishes on the robot), ``~conf_thres``, ``~conf_thres_kp``,
``~auth_secret_file``. Subscribes ``image`` (sensor_msgs/Image); publishes ``~people``
(People: poses in image pixels, no tracking -- person_tracker with ``~input: people`` adds
depth, projection and the Kalman filter) and ``~stats`` (InferenceStats).
"""

import contextlib
import time

import rospy
from sensor_msgs.msg import Image

from robot_offload.apps.kapao_post import COCO_KEYPOINT_NAMES
from robot_offload.apps.kapao_repo import KAPAO_MODES, KapaoRepoConfig, KapaoRepoRunner
from robot_offload.errors import ConfigError, Incompatible
from robot_offload.frames import LatestFrame
from robot_offload.msg import InferenceStats, People, Person
from robot_offload.protocol import method_of
from robot_offload.ros import conversions as conv
from robot_offload.ros.params import load_auth_secret, load_params
from robot_offload.ros.transport import RosServiceTransport
from robot_offload.stats import FrameStats
from robot_offload.transparent.session import MODES, RemoteSession


class KapaoRepoNode:
    def __init__(self):
        try:
            c = self.config = load_params(KapaoRepoConfig)
            self.runner = KapaoRepoRunner(c.kapao_repo, c.weights, data=c.data, imgsz=c.imgsz,
                                          conf_thres=c.conf_thres, conf_thres_kp=c.conf_thres_kp,
                                          trust_checkpoint=c.trust_checkpoint)
        except ConfigError as e:
            raise rospy.ROSInitException(f"kapao_repo: {e}") from e
        self.transport = RosServiceTransport(c.server_ns)
        secret = load_auth_secret()
        if secret:
            self.transport.set_auth_secret(secret)
        timeout_s = c.timeout_s
        self.sessions = {m: RemoteSession(lambda r, t: self.transport.call(method_of(r), r, t), mode=m,
                                          timeout_s=timeout_s, local_fallback=True) for m in MODES}
        # The versions exchange (robot_offload.compat); a server that cannot be reached yet
        # is probed in the background. One of another protocol is refused for good.
        self.refusals = {}
        for m, session in self.sessions.items():
            try:
                session.connect(timeout_s)
            except Incompatible as e:
                rospy.logerr(f"kapao_repo: the offload server refuses this robot ({m} runs locally): {e.text}")
                self.refusals[m] = f"Incompatible: {e.text}"
        from cv_bridge import CvBridge
        self.bridge = CvBridge()
        self.slot = LatestFrame()
        self.processed = 0
        self.people_pub = rospy.Publisher("~people", People, queue_size=10)
        self.stats_pub = rospy.Publisher("~stats", InferenceStats, queue_size=50)
        rospy.Subscriber("image", Image, self.slot.put, queue_size=1, buff_size=2 ** 25)

    def spin(self):
        while not rospy.is_shutdown():
            item = self.slot.get(timeout_s=0.5)
            if item is not None:
                self.process(item[0])

    def process(self, msg):
        mode = rospy.get_param("~mode", self.config.mode)     # read every frame: rosparam set switches it
        if mode not in KAPAO_MODES:
            rospy.logwarn_throttle(5.0, f"kapao_repo: unknown mode {mode!r}; known: {list(KAPAO_MODES)}")
            mode = "local"
        image = self.bridge.imgmsg_to_cv2(msg, desired_encoding="rgb8")
        session = self.sessions.get(mode) if mode not in self.refusals else None
        stats = FrameStats(mode=mode, model="kapao_repo")
        t0 = time.perf_counter()
        losses = session.stats.server_losses if session else 0
        with session.frame(stats) if session is not None else contextlib.nullcontext():
            poses, stats = self.runner(image, session=session, stats=stats)
        stats.processing_s = time.perf_counter() - t0
        stats.executed_mode = mode
        if mode == "auto":      # record_replay, or the robot when it measured faster
            stats.executed_mode = "local" if stats.phase == "robot" else "record_replay"
        if mode in self.refusals:
            stats.executed_mode, stats.fallback_reason = "local", self.refusals[mode]
        if session is not None:
            if session.stats.server_losses > losses or session.down.is_set():
                stats.executed_mode, stats.fallback_reason = "local", session.last_error
        people = People(header=msg.header, target_index=-1, track_id=-1, track_status="none")
        for p in poses:
            kp = p.keypoints
            people.people.append(Person(score=float(p.score), box_xyxy=[float(v) for v in p.box_xyxy],
                                        keypoint_names=list(COCO_KEYPOINT_NAMES[:len(kp)]),
                                        keypoints_u=kp[:, 0].tolist(), keypoints_v=kp[:, 1].tolist(),
                                        keypoints_conf=kp[:, 2].tolist(), has_position=False))
        self.people_pub.publish(people)
        self.processed += 1
        latency_s = (rospy.Time.now() - msg.header.stamp).to_sec()
        self.stats_pub.publish(conv.stats_to_msg(stats, msg.header, latency_s,
                                                 (self.slot.received, self.processed, self.slot.dropped, 0)))
