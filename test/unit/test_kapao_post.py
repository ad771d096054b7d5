"""KAPAO post-processing on hand-built predictions, and on the real (random-weight) model."""

import numpy as np
import pytest
import torch

from robot_offload.apps.kapao_post import (
    COCO_KEYPOINT_NAMES,
    Pose,
    decode_poses,
    num_keypoints_from_channels,
    rescale_poses,
)
from robot_offload.models.kapao import build_kapao

pytestmark = pytest.mark.robot_side

K = 17
NO = 5 + (1 + K) + 2 * K  # 57


def row(cx, cy, w, h, cls, score, kps=None, obj=1.0):
    """One anchor: box centre/size (px), objectness, one class at ``score``, keypoints K x 2."""
    r = torch.zeros(NO)
    r[0:4] = torch.tensor([cx, cy, w, h], dtype=torch.float32)
    r[4] = obj
    r[5 + cls] = score
    if kps is not None:
        r[5 + 1 + K :] = torch.as_tensor(np.asarray(kps, dtype=np.float32).reshape(-1))
    return r


def regressed(x0, y0):
    """A distinct regressed keypoint layout per person: keypoint k at (x0 + 2k, y0 + 8k)."""
    return np.array([[x0 + 2 * k, y0 + 8 * k] for k in range(K)], dtype=np.float64)


KP_A = regressed(80.0, 40.0)
KP_B = regressed(280.0, 60.0)
WRIST = COCO_KEYPOINT_NAMES.index("left_wrist")  # 9
ELBOW_R = COCO_KEYPOINT_NAMES.index("right_elbow")  # 8


def scene():
    rows = [
        row(100, 110, 60, 160, 0, 0.9, KP_A),  # person A
        row(102, 112, 60, 160, 0, 0.6, KP_A + 1),  # duplicate of A: NMS must drop it
        row(300, 130, 60, 160, 0, 0.8, KP_B),  # person B
        row(500, 300, 60, 160, 0, 0.2, regressed(480, 240)),  # below conf_thres_pose: ignored
        row(500, 300, 60, 160, 0, 0.9, regressed(480, 240), obj=0.25),  # obj x cls = 0.225: ignored
        # left wrist objects
        row(KP_A[WRIST, 0] + 5, KP_A[WRIST, 1] - 3, 10, 10, 1 + WRIST, 0.8),  # -> A
        row(KP_A[WRIST, 0] + 6, KP_A[WRIST, 1] - 3, 10, 10, 1 + WRIST, 0.5),  # overlaps the above: NMS
        row(KP_A[WRIST, 0] - 12, KP_A[WRIST, 1], 10, 10, 1 + WRIST, 0.4),  # no overlap, also near A: loses
        row(KP_B[WRIST, 0] - 4, KP_B[WRIST, 1] + 6, 10, 10, 1 + WRIST, 0.7),  # -> B
        # a right elbow object at the same place as A's wrist object: other class, NMS keeps it,
        # but it is 16+ px from A's regressed right elbow -> fuses only with fuse_dist_px > that
        row(KP_A[WRIST, 0] + 5, KP_A[WRIST, 1] - 3, 10, 10, 1 + ELBOW_R, 0.6),
        # a nose object below conf_thres_kp, right on A's regressed nose: ignored
        row(KP_A[0, 0] + 1, KP_A[0, 1] + 1, 10, 10, 1 + 0, 0.1),
        # a left shoulder object 100 px from any regressed shoulder: not fused
        row(KP_A[5, 0] + 100, KP_A[5, 1], 10, 10, 1 + 5, 0.9),
    ]
    return torch.stack(rows)


def test_channel_layout():
    assert num_keypoints_from_channels(57) == 17
    assert num_keypoints_from_channels(21) == 5
    with pytest.raises(ValueError):
        num_keypoints_from_channels(58)


def test_two_people_nms_and_fusion():
    poses = decode_poses(scene()[None], conf_thres_pose=0.3, conf_thres_kp=0.3, iou_thres=0.45, fuse_dist_px=15.0)
    assert len(poses) == 2
    a, b = poses  # best first
    assert a.score == pytest.approx(0.9) and b.score == pytest.approx(0.8)
    np.testing.assert_allclose(a.box_xyxy, [70, 30, 130, 190])
    np.testing.assert_allclose(b.box_xyxy, [270, 50, 330, 210])
    assert a.keypoints.shape == (K, 3) and a.keypoint_fused.shape == (K,)

    # A's wrist: the 0.8 object (5, -3) px away replaces the regressed one, with its score.
    np.testing.assert_allclose(a.keypoints[WRIST], [KP_A[WRIST, 0] + 5, KP_A[WRIST, 1] - 3, 0.8], rtol=1e-6)
    # B's wrist from the object near B, not the nearer-to-A ones.
    np.testing.assert_allclose(b.keypoints[WRIST], [KP_B[WRIST, 0] - 4, KP_B[WRIST, 1] + 6, 0.7], rtol=1e-6)
    assert a.keypoint_fused[WRIST] and b.keypoint_fused[WRIST]

    # The right-elbow object 8.6 px from A's regressed right elbow (see the next test) fused too.
    assert a.keypoint_fused[ELBOW_R] and not b.keypoint_fused[ELBOW_R]

    # Everything else keeps its regressed position with the pose's score: the low-score nose,
    # the far shoulder and the losing wrist objects changed nothing.
    for pose, kp, fused in ((a, KP_A, {WRIST, ELBOW_R}), (b, KP_B, {WRIST})):
        others = np.array([k not in fused for k in range(K)])
        np.testing.assert_allclose(pose.keypoints[others, :2], kp[others], rtol=1e-6)
        np.testing.assert_allclose(pose.keypoints[others, 2], pose.score, rtol=1e-6)
        assert set(np.nonzero(pose.keypoint_fused)[0]) == fused


def test_fusion_distance_threshold_and_class_aware_nms():
    # A's regressed right elbow is at (96, 104); the elbow object sits at (103, 109):
    # sqrt(7^2 + 5^2) = 8.6 px from it, but 82 px from B's (296, 124) -> A, if fuse_dist_px > 8.6.
    elbow_obj = (KP_A[WRIST, 0] + 5, KP_A[WRIST, 1] - 3)
    assert np.hypot(elbow_obj[0] - KP_A[ELBOW_R, 0], elbow_obj[1] - KP_A[ELBOW_R, 1]) == pytest.approx(np.hypot(7, 5))
    near = decode_poses(scene(), fuse_dist_px=9.0)[0]
    far = decode_poses(scene(), fuse_dist_px=8.0)[0]
    # Same box as the wrist object but another class: class-aware NMS kept it.
    np.testing.assert_allclose(near.keypoints[ELBOW_R], [elbow_obj[0], elbow_obj[1], 0.6], rtol=1e-6)
    assert near.keypoint_fused[ELBOW_R]
    assert not far.keypoint_fused[ELBOW_R]
    np.testing.assert_allclose(far.keypoints[ELBOW_R, :2], KP_A[ELBOW_R])


def test_low_keypoint_threshold_lets_the_nose_in():
    a = decode_poses(scene(), conf_thres_kp=0.05, fuse_dist_px=15.0)[0]
    np.testing.assert_allclose(a.keypoints[0], [KP_A[0, 0] + 1, KP_A[0, 1] + 1, 0.1], rtol=1e-6)


def test_empty_and_degenerate_inputs():
    assert decode_poses(torch.zeros(0, NO)) == []
    assert decode_poses(torch.zeros(1, 0, NO)) == []
    assert decode_poses(torch.zeros(1, 20, NO)) == []  # nothing confident
    only_kp = torch.stack([row(50, 50, 10, 10, 3, 0.9)])
    assert decode_poses(only_kp) == []  # keypoint objects without a pose to join
    nan_row = row(100, 110, 60, 160, 0, 0.9, KP_A)
    nan_row[0] = float("nan")
    assert decode_poses(nan_row[None]) == []
    one = decode_poses(torch.stack([row(100, 110, 60, 160, 0, 0.9, KP_A)]).half())  # fp16 from a GPU
    assert len(one) == 1
    with pytest.raises(ValueError):
        decode_poses(torch.zeros(2, 5, NO))  # a batch: caller loops
    with pytest.raises(ValueError):
        decode_poses(torch.zeros(5, 40))


def test_rescale_to_camera_image():
    pose = Pose([10, 20, 30, 40], 0.9, np.tile([[10.0, 20.0, 0.5]], (K, 1)))
    (out,) = rescale_poses([pose], input_size_hw=(128, 128), image_size_hw=(480, 640))
    # x * 640/128 - 0.5, y * 480/128 - 0.5
    np.testing.assert_allclose(out.box_xyxy, [49.5, 74.5, 149.5, 149.5])
    np.testing.assert_allclose(out.keypoints[0], [49.5, 74.5, 0.5])
    assert out.score == pytest.approx(0.9)
    np.testing.assert_allclose(pose.keypoints[0], [10, 20, 0.5])  # input untouched


def test_random_weight_model_output_decodes():
    torch.manual_seed(0)
    model = build_kapao(width_multiple=0.25, depth_multiple=0.33)
    with torch.no_grad():
        pred, _ = model(torch.rand(1, 3, 128, 128))
    assert pred.shape[-1] == NO
    for thres in (0.3, 1e-4):  # default-ish, and low enough that random weights give poses
        poses = decode_poses(pred, conf_thres_pose=thres, conf_thres_kp=thres, fuse_dist_px=5.0)
        assert isinstance(poses, list)
        for p in poses:
            assert isinstance(p, Pose)
            assert p.box_xyxy.shape == (4,) and p.keypoints.shape == (K, 3)
            assert p.keypoint_fused.dtype == bool
            assert 0.0 < p.score <= 1.0 and np.all(np.isfinite(p.keypoints))
        assert [p.score for p in poses] == sorted((p.score for p in poses), reverse=True)
    assert len(poses) > 0  # the low threshold exercised the fusion path
