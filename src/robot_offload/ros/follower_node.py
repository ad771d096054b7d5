"""person_follower: the KAPAO person-following application's last stage.

Takes person_tracker's ``target`` (the tracked person, camera optical frame), looks up TF
at the frame's stamp and publishes the person in the robot's frame (``~person_robot``)
and in the fixed frame (``~person``); while following is enabled (``~enable``,
std_srvs/SetBool, or ``~enabled`` at start) it sends a ``move_base_simple/goal``
(PoseStamped, fixed frame) ``~standoff_m`` from the person, facing them, when the goal has
moved or turned enough (:class:`~robot_offload.apps.following.GoalGate`). Stopping cancels
move_base's goals (``move_base/cancel``) if a goal was sent. ``~annotated`` is the colour
image of each People frame (paired by stamp) with boxes, skeletons and the target's track id.
"""

import threading

import rospy
import tf2_ros
from actionlib_msgs.msg import GoalID
from geometry_msgs.msg import PointStamped, PoseStamped
from message_filters import Subscriber
from sensor_msgs.msg import Image
from std_srvs.srv import SetBool, SetBoolResponse
from tf2_geometry_msgs import do_transform_point

from robot_offload.apps.annotate import DrawnPerson, draw_people
from robot_offload.apps.following import FollowConfig, GoalGate, standoff_goal, yaw_quaternion
from robot_offload.errors import ConfigError
from robot_offload.msg import People
from robot_offload.ros.params import load_params
from robot_offload.ros.stamp_sync import StampPairing

PAIRING_HINT = ("No annotated image for them: check that `image` is the colour image the poses came "
                "from; People later than ~sync_queue_size images are dropped too.")


class FollowerNode:
    def __init__(self):
        try:
            self.config = c = load_params(FollowConfig)
        except ConfigError as e:
            raise rospy.ROSInitException(f"person_follower: {e}") from e
        self._lock = threading.Lock()
        self.enabled = c.enabled
        self.gate = GoalGate(c)
        self.tf = tf2_ros.Buffer()
        self._tf_listener = tf2_ros.TransformListener(self.tf)
        from cv_bridge import CvBridge
        self._bridge = CvBridge()
        self.goal_pub = rospy.Publisher("move_base_simple/goal", PoseStamped, queue_size=1)
        self.cancel_pub = rospy.Publisher("move_base/cancel", GoalID, queue_size=1)
        self.person_pub = rospy.Publisher("~person", PointStamped, queue_size=10)
        self.person_robot_pub = rospy.Publisher("~person_robot", PointStamped, queue_size=10)
        self.image_pub = rospy.Publisher("~annotated", Image, queue_size=2)
        rospy.Subscriber("target", PointStamped, self._on_target, queue_size=5)
        self.pairing = StampPairing([Subscriber("people", People, queue_size=2),
                                     Subscriber("image", Image, queue_size=c.sync_queue_size, buff_size=2 ** 24)],
                                    c.sync_queue_size, c.sync_slop_s, self._on_people_image, PAIRING_HINT)
        rospy.Service("~enable", SetBool, self._on_enable)
        rospy.loginfo(f"person_follower: goals in {c.fixed_frame} on {self.goal_pub.resolved_name}, "
                      f"{c.standoff_m} m from the person; following "
                      f"{'on' if c.enabled else 'off until ' + rospy.resolve_name('~enable') + ' true'}")

    # -- following --------------------------------------------------------------------
    def _on_enable(self, req):
        with self._lock:
            was, self.enabled = self.enabled, bool(req.data)
            sent = self.gate.last is not None
            if self.enabled and not was:
                self.gate.reset()
        if not req.data and sent:
            self.cancel_pub.publish(GoalID())  # empty id, zero stamp: every current goal
            with self._lock:
                self.gate.reset()
        state = "following" if req.data else "stopped"
        rospy.loginfo(f"person_follower: {state}")
        return SetBoolResponse(success=True, message=state)

    def _on_target(self, msg):
        c = self.config
        timeout = rospy.Duration.from_sec(c.tf_timeout_s)
        try:
            to_robot = self.tf.lookup_transform(c.robot_frame, msg.header.frame_id, msg.header.stamp, timeout)
            robot = self.tf.lookup_transform(c.fixed_frame, c.robot_frame, msg.header.stamp, timeout)
        except (tf2_ros.LookupException, tf2_ros.ConnectivityException, tf2_ros.ExtrapolationException,
                tf2_ros.InvalidArgumentException) as e:
            rospy.logwarn_throttle(5.0, f"person_follower: no transform for the target at "
                                        f"{msg.header.stamp.to_sec():.3f} ({msg.header.frame_id!r} -> "
                                        f"{c.robot_frame!r} -> {c.fixed_frame!r}): {e}")
            return
        person_robot = do_transform_point(msg, to_robot)
        person = do_transform_point(person_robot, robot)
        # tf2's Python binding passes times as float seconds: the transform's stamp is the
        # frame's give or take a few hundred ns. Keep the frame's exact stamp, so that these
        # pair with the frame's other messages (message_filters, exact time).
        person_robot.header.stamp = person.header.stamp = msg.header.stamp
        self.person_robot_pub.publish(person_robot)
        self.person_pub.publish(person)
        r = robot.transform.translation
        goal = standoff_goal((person.point.x, person.point.y), (r.x, r.y), c.standoff_m, z=r.z)
        if goal is None:
            rospy.logwarn_throttle(5.0, "person_follower: the person is where the robot is; no goal")
            return
        with self._lock:
            if not (self.enabled and self.gate.offer(goal, rospy.get_time())):
                return
        out = PoseStamped()
        out.header.stamp, out.header.frame_id = msg.header.stamp, c.fixed_frame
        out.pose.position.x, out.pose.position.y, out.pose.position.z = goal.x, goal.y, goal.z
        q = out.pose.orientation
        q.x, q.y, q.z, q.w = yaw_quaternion(goal.yaw)
        self.goal_pub.publish(out)

    # -- annotation -------------------------------------------------------------------
    def _on_people_image(self, people, image):
        if self.image_pub.get_num_connections() == 0:
            return
        drawn = []
        for p in people.people:
            n = min(len(p.keypoints_u), len(p.keypoints_v), len(p.keypoints_conf))
            kps = list(zip(p.keypoints_u[:n], p.keypoints_v[:n], p.keypoints_conf[:n]))
            drawn.append(DrawnPerson(box_xyxy=list(p.box_xyxy), keypoints=kps, score=p.score))
        rgb = self._bridge.imgmsg_to_cv2(image, desired_encoding="rgb8")
        out = self._bridge.cv2_to_imgmsg(draw_people(rgb, drawn, people.target_index, people.track_id,
                                                     people.track_status), encoding="rgb8")
        out.header = image.header
        self.image_pub.publish(out)
