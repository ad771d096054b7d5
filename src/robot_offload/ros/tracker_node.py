"""person_tracker: the KAPAO people-tracking application's last stage.

Takes offload_client's KAPAO result, decodes poses (NMS, keypoint-object fusion), looks
up the registered depth image at the keypoints, projects them with the camera info,
keeps one target with a constant-velocity Kalman filter and publishes ``~target``
(geometry_msgs/PointStamped, camera optical frame) and ``~people`` (People).

A result arrives up to a deadline after its frame, so each result is paired with the
depth image and camera_info of its own frame, by header stamp (``~sync_slop_s``), never
with whatever depth came last; ``~sync_queue_size`` depth frames are kept while a
result is awaited.
"""

import numpy as np
import rospy
from geometry_msgs.msg import Point, PointStamped
from message_filters import Subscriber
from sensor_msgs.msg import CameraInfo, Image

from robot_offload import codec, structure
from robot_offload.apps.kapao_post import COCO_KEYPOINT_NAMES, Pose, decode_poses, rescale_poses
from robot_offload.apps.tracking import CameraIntrinsics, PersonTracker, PersonTrackerNodeConfig
from robot_offload.errors import ConfigError
from robot_offload.msg import InferenceResult, People, Person
from robot_offload.ros.conversions import tensor_from_msg
from robot_offload.ros.params import load_params
from robot_offload.ros.stamp_sync import StampPairing

PAIRING_HINT = ("Check that depth_topic and camera_info_topic are the registered depth of the colour "
                "image, stamped with its stamp; a result later than ~sync_queue_size depth frames "
                "is dropped too (raise it, or ~sync_slop_s for a camera whose stamps differ slightly).")


class TrackerNode:
    def __init__(self):
        try:
            c = self.config = load_params(PersonTrackerNodeConfig)
        except ConfigError as e:
            raise rospy.ROSInitException(f"person_tracker: {e}") from e
        self.model_input_hw = c.model_input_size
        self.conf_pose, self.conf_kp, self.iou = c.conf_thres_pose, c.conf_thres_kp, c.iou_thres
        self.tracker = PersonTracker(c.tracker())
        queue, slop = c.sync_queue_size, c.sync_slop_s
        from cv_bridge import CvBridge
        self._bridge = CvBridge()
        self.target_pub = rospy.Publisher("~target", PointStamped, queue_size=10)
        self.people_pub = rospy.Publisher("~people", People, queue_size=10)
        # ~input: "result" (offload_client's raw KAPAO output: decoded here) or "people"
        # (poses already decoded by another node, e.g. kapao_repo running the real KAPAO code)
        self.input = c.input
        if self.input == "people":
            first = Subscriber("people_in", People, queue_size=2)
            handler = self._on_people
        else:
            first = Subscriber("result", InferenceResult, queue_size=2, buff_size=2 ** 26)
            handler = self._on_result
        depth = Subscriber("depth", Image, queue_size=queue, buff_size=2 ** 24)
        info = Subscriber("camera_info", CameraInfo, queue_size=queue)
        self.pairing = StampPairing([first, depth, info], queue, slop, handler, PAIRING_HINT)

    def _on_result(self, msg, depth_msg, info):
        outputs = structure.unflatten([codec.decode(tensor_from_msg(t)) for t in msg.outputs],
                                      msg.structure_json)
        pred = outputs[0] if isinstance(outputs, (tuple, list)) else outputs
        poses = rescale_poses(decode_poses(pred, self.conf_pose, self.conf_kp, self.iou),
                              self.model_input_hw, (info.height, info.width))
        self._track(msg.header, poses, depth_msg, info)

    def _on_people(self, msg, depth_msg, info):
        """Poses decoded elsewhere, in image pixels (pixel centres at integers)."""
        poses = [Pose(box_xyxy=np.asarray(p.box_xyxy, dtype=np.float64), score=float(p.score),
                      keypoints=np.stack([np.asarray(p.keypoints_u), np.asarray(p.keypoints_v),
                                          np.asarray(p.keypoints_conf)], axis=1).astype(np.float64))
                 for p in msg.people if len(p.keypoints_u)]
        self._track(msg.header, poses, depth_msg, info)

    def _track(self, header, poses, depth_msg, info):
        depth = self._bridge.imgmsg_to_cv2(depth_msg)
        people = People(header=header, target_index=-1, track_id=-1, track_status="none")
        people.header.frame_id = info.header.frame_id or header.frame_id
        intrinsics = CameraIntrinsics.from_camera_info_k(info.K)
        result, positions = self.tracker.update_from_poses(header.stamp.to_sec(), poses, depth, intrinsics)
        people.track_status = result.status.value
        if result.target_index is not None:
            people.target_index = int(result.target_index)
        if result.track_id is not None:
            people.track_id = int(result.track_id)
        if result.has_target and not result.stale:
            target = PointStamped(header=people.header)
            target.point = Point(*map(float, result.position_m))
            self.target_pub.publish(target)
        for pose, pos in zip(poses, positions):
            kp = pose.keypoints
            person = Person(score=float(pose.score), box_xyxy=[float(v) for v in pose.box_xyxy],
                            keypoint_names=list(COCO_KEYPOINT_NAMES[:len(kp)]),
                            keypoints_u=kp[:, 0].tolist(), keypoints_v=kp[:, 1].tolist(),
                            keypoints_conf=kp[:, 2].tolist(), has_position=pos is not None)
            if pos is not None:
                person.position = Point(*map(float, pos))
            people.people.append(person)
        self.people_pub.publish(people)
