"""Projection, depth lookup, Kalman filter and person tracker against hand-computed values."""


import numpy as np
import pytest

from robot_offload.apps.kapao_post import Pose
from robot_offload.apps.tracking import (
    CHI2_3DOF_997,
    CameraIntrinsics,
    ConstantVelocityKalman,
    PersonTracker,
    TrackerConfig,
    TrackStatus,
    depth_at,
    person_position,
    project_pixel_to_3d,
)

pytestmark = pytest.mark.robot_side

K = 17
CAM = CameraIntrinsics(fx=500.0, fy=400.0, cx=320.0, cy=240.0)


# ----------------------------------------------------------------------------- projection


def test_intrinsics_from_camera_info_k():
    cam = CameraIntrinsics.from_camera_info_k([500.0, 0.0, 320.0, 0.0, 400.0, 240.0, 0.0, 0.0, 1.0])
    assert cam == CAM
    with pytest.raises(ValueError):
        CameraIntrinsics.from_camera_info_k([0.0] * 9)  # uncalibrated camera
    with pytest.raises(ValueError):
        CameraIntrinsics.from_camera_info_k([1.0] * 8)


def test_intrinsics_scaled_to_half_resolution():
    half = CAM.scaled(0.5, 0.5)
    # fx/2; the centre of pixel 320 spans [320, 321) -> [160, 160.5) whose centre is 159.75
    assert (half.fx, half.fy, half.cx, half.cy) == (250.0, 200.0, 159.75, 119.75)


def test_projection_of_known_pixels():
    # principal point -> straight ahead
    assert project_pixel_to_3d(320, 240, 2.0, CAM) == (0.0, 0.0, 2.0)
    # 100 px right, 100 px up at 2 m: x = 100 * 2 / 500 = 0.4, y = -100 * 2 / 400 = -0.5
    assert project_pixel_to_3d(420, 140, 2.0, CAM) == pytest.approx((0.4, -0.5, 2.0))
    # left and down at 3 m: x = -200 * 3 / 500 = -1.2, y = 40 * 3 / 400 = 0.3
    assert project_pixel_to_3d(120, 280, 3.0, CAM) == pytest.approx((-1.2, 0.3, 3.0))


# ----------------------------------------------------------------------------- depth lookup


def _holey_depth_m():
    d = np.full((6, 8), 9.0, dtype=np.float32)
    # the 3x3 window around (u=3, v=2): rows 1..3, cols 2..4
    d[1:4, 2:5] = [[1.0, np.nan, 2.0],
                   [0.0, 4.0, np.inf],
                   [3.0, 0.0, 5.0]]
    return d


def test_depth_window_median_skips_holes():
    d = _holey_depth_m()
    # valid: 1, 2, 4, 3, 5 -> median 3
    assert depth_at(d, 3, 2, window_px=3) == pytest.approx(3.0)
    # rounding to the nearest pixel centre
    assert depth_at(d, 3.4, 1.6, window_px=3) == pytest.approx(3.0)
    assert depth_at(d, 3, 2, window_px=1) == pytest.approx(4.0)
    # uint16 millimetres (0 = no data; NaN/inf cannot occur) give metres
    mm = np.nan_to_num(d * 1000.0, nan=0.0, posinf=0.0).astype(np.uint16)
    assert mm[1, 3] == 0 and mm[2, 4] == 0
    assert depth_at(mm, 3, 2, window_px=3) == pytest.approx(3.0)


def test_depth_window_clipped_at_the_border_and_none_cases():
    d = _holey_depth_m()
    d[0:2, 0:2] = [[1.0, 2.0], [6.0, 0.0]]
    # 5x5 window at (0, 0) clips to rows 0..2, cols 0..2:
    #   row 0: 1, 2, 9   row 1: 6, 0, 1 (d[1, 2])   row 2: 9, 9, 0 (d[2, 2])
    # valid: 1, 2, 9, 6, 1, 9, 9 -> sorted 1 1 2 6 9 9 9 -> median 6
    assert depth_at(d, 0, 0, window_px=5) == pytest.approx(6.0)
    # at the far corner (u=7, v=5) the window keeps rows 3..5, cols 5..7: all 9
    assert depth_at(d, 7, 5, window_px=5) == pytest.approx(9.0)
    assert depth_at(d, -1, 0) is None  # outside the image
    assert depth_at(d, 8, 0) is None
    assert depth_at(d, float("nan"), 0) is None
    assert depth_at(np.zeros((6, 8), np.uint16), 3, 3) is None  # all holes
    with pytest.raises(ValueError):
        depth_at(d, 3, 3, window_px=4)


# ----------------------------------------------------------------------------- person position


def _pose(points, conf=0.9):
    """Pose whose keypoints are all unconfident except ``points`` = {index: (u, v)}."""
    kps = np.zeros((K, 3))
    for i, (u, v) in points.items():
        kps[i] = (u, v, conf)
    return Pose([0, 0, 1, 1], 0.9, kps)


def _scene_depth():
    d = np.full((480, 640), 5.0, dtype=np.float32)  # background wall at 5 m
    d[180:300, 290:350] = 2.0  # the person's torso at 2 m
    return d


SHOULDERS_HIPS = {5: (300, 200), 6: (340, 200), 11: (310, 280), 12: (340, 280)}
WRISTS = {9: (250, 300), 10: (390, 300)}  # outside the torso: they hit the wall


def test_person_position_prefers_the_torso():
    pose = _pose({**SHOULDERS_HIPS, **WRISTS})
    # torso points at z = 2: x = (u - 320) * 2 / 500 -> -0.08, 0.08, -0.04, 0.08 -> median 0.02
    #                         y = (v - 240) * 2 / 400 -> -0.2, -0.2, 0.2, 0.2 -> median 0
    assert person_position(pose, _scene_depth(), CAM) == pytest.approx((0.02, 0.0, 2.0))


def test_person_position_without_enough_torso_uses_all_points():
    pose = _pose({5: (300, 200), **WRISTS})  # one shoulder + two wrists
    # z: 2, 5, 5 -> 5; x: -0.08, (250-320)*5/500 = -0.7, (390-320)*5/500 = 0.7 -> -0.08
    # y: -0.2, (300-240)*5/400 = 0.75, 0.75 -> 0.75 (per-axis medians)
    assert person_position(pose, _scene_depth(), CAM) == pytest.approx((-0.08, 0.75, 5.0))


def test_person_position_needs_enough_confident_keypoints_with_depth():
    depth = _scene_depth()
    assert person_position(_pose({5: (300, 200), 6: (340, 200)}), depth, CAM) is None  # 2 < 3
    assert person_position(_pose({5: (300, 200), 6: (340, 200)}), depth, CAM, min_keypoints=2) is not None
    low = _pose(SHOULDERS_HIPS, conf=0.1)
    assert person_position(low, depth, CAM) is None
    assert person_position(low, depth, CAM, min_keypoint_conf=0.05) == pytest.approx((0.02, 0.0, 2.0))
    holes = depth.copy()
    holes[150:320, 270:370] = np.nan  # depth camera saw nothing on the torso
    pose = _pose({**SHOULDERS_HIPS, 16: (600, 470)})  # only one keypoint (ankle) on valid depth
    assert person_position(pose, holes, CAM) is None


# ----------------------------------------------------------------------------- Kalman filter


def test_chi2_gate_constant():
    stats = pytest.importorskip("scipy.stats")
    assert CHI2_3DOF_997 == pytest.approx(stats.chi2.ppf(0.997, 3), abs=1e-3)


def test_one_predict_update_step_by_hand():
    # sigma_m = 0.1 -> r = 0.01; sigma_v = 1 -> v = 1; sigma_a = 2 -> q^2 = 4; dt = 0.1.
    kf = ConstantVelocityKalman(process_noise_std_mps2=2.0, measurement_noise_std_m=0.1,
                                initial_velocity_std_mps=1.0)
    assert kf.update((1.0, 2.0, 3.0))  # initialises
    np.testing.assert_allclose(kf.state, [1, 2, 3, 0, 0, 0])
    np.testing.assert_allclose(kf.covariance, np.diag([0.01] * 3 + [1.0] * 3))

    kf.predict(0.1)
    # Per axis, F P F^T = [[r + dt^2 v, dt v], [dt v, v]] = [[0.02, 0.1], [0.1, 1]]
    # Q = q^2 [[dt^4/4, dt^3/2], [dt^3/2, dt^2]] = 4 * [[2.5e-5, 5e-4], [5e-4, 1e-2]]
    #   = [[1e-4, 2e-3], [2e-3, 4e-2]]
    # P- = [[0.0201, 0.102], [0.102, 1.04]]
    p = kf.covariance
    for ax in range(3):
        assert p[ax, ax] == pytest.approx(0.0201)
        assert p[ax, ax + 3] == pytest.approx(0.102) and p[ax + 3, ax] == pytest.approx(0.102)
        assert p[ax + 3, ax + 3] == pytest.approx(1.04)
    assert p[0, 1] == 0.0 and p[0, 4] == 0.0  # axes stay independent
    np.testing.assert_allclose(kf.state, [1, 2, 3, 0, 0, 0])  # zero velocity: no motion

    # Measurement 0.1 m off on every axis. S = 0.0201 + 0.01 = 0.0301;
    # gain K = [0.0201, 0.102] / 0.0301; d^2 = 3 * 0.1^2 / 0.0301 = 0.9967 (inside the gate).
    assert kf.mahalanobis_sq((1.1, 2.1, 3.1)) == pytest.approx(3 * 0.01 / 0.0301)
    assert kf.update((1.1, 2.1, 3.1))
    k_pos, k_vel = 0.0201 / 0.0301, 0.102 / 0.0301
    x = kf.state
    np.testing.assert_allclose(x[:3], np.array([1, 2, 3]) + k_pos * 0.1)  # 1.0667774...
    np.testing.assert_allclose(x[3:], [k_vel * 0.1] * 3)  # 0.3388704... m/s
    # P+ = (I - K H) P-: [[0.0201 (1 - k_pos), 0.102 (1 - k_pos)], [., 1.04 - k_vel 0.102]]
    p = kf.covariance
    assert p[0, 0] == pytest.approx(0.0201 * 0.01 / 0.0301)  # 0.0066777
    assert p[0, 3] == pytest.approx(0.102 * 0.01 / 0.0301)  # 0.0338870
    assert p[3, 3] == pytest.approx(1.04 - 0.102**2 / 0.0301)  # 0.6943522
    np.testing.assert_allclose(p, p.T)


def test_converges_to_constant_velocity_ground_truth():
    rng = np.random.default_rng(42)
    x0, v = np.array([1.0, -0.5, 3.0]), np.array([0.5, -0.2, 0.1])
    sigma, dt = 0.05, 0.1
    kf = ConstantVelocityKalman(process_noise_std_mps2=0.5, measurement_noise_std_m=sigma)
    raw_err, filt_err = [], []
    for i in range(100):
        truth = x0 + v * i * dt
        z = truth + rng.normal(0.0, sigma, 3)
        if i:
            kf.predict(dt)
        assert kf.update(z)
        if i >= 50:  # after convergence
            raw_err.append(np.linalg.norm(z - truth))
            filt_err.append(np.linalg.norm(kf.position - truth))
    np.testing.assert_allclose(kf.velocity, v, atol=0.1)
    np.testing.assert_allclose(kf.position, x0 + v * 99 * dt, atol=0.06)
    assert np.sqrt(np.mean(np.square(filt_err))) < 0.7 * np.sqrt(np.mean(np.square(raw_err)))


def test_gating_rejects_an_outlier_then_reinitialises():
    kf = ConstantVelocityKalman(process_noise_std_mps2=0.5, measurement_noise_std_m=0.05,
                                max_consecutive_rejections=3)
    for _ in range(20):  # a person standing still at (1, 0, 3)
        kf.update((1.0, 0.0, 3.0))
        kf.predict(0.1)
    before_x, before_p = kf.state, kf.covariance
    assert not kf.update((3.0, 0.0, 3.0))  # a 2 m jump: a depth glitch or another person
    assert kf.last_mahalanobis_sq > CHI2_3DOF_997
    np.testing.assert_array_equal(kf.state, before_x)
    np.testing.assert_array_equal(kf.covariance, before_p)
    assert kf.update((1.02, 0.0, 3.0))  # a good one resets the count
    assert kf.consecutive_rejections == 0
    assert not kf.update((3.0, 0.0, 3.0))
    assert not kf.update((3.0, 0.0, 3.0))
    assert kf.update((3.0, 0.0, 3.0)) and kf.reinitialized  # third in a row
    np.testing.assert_allclose(kf.state, [3, 0, 3, 0, 0, 0])


def test_predict_time_rules():
    kf = ConstantVelocityKalman()
    kf.predict(0.5)  # before initialisation: nothing to do
    assert not kf.initialized
    kf.update((0.0, 0.0, 1.0))
    p = kf.covariance
    kf.predict(0.0)
    np.testing.assert_array_equal(kf.covariance, p)
    with pytest.raises(ValueError):
        kf.predict(-0.1)
    with pytest.raises(ValueError):
        kf.update((0.0, float("nan"), 1.0))


# ----------------------------------------------------------------------------- tracker


def _walk(tracker, t0, t1, start, v, dt=0.1, extra=()):
    """Feed a target walking at constant velocity from ``start`` (plus static ``extra`` people)."""
    res = None
    for t in np.arange(t0, t1 - 1e-9, dt):
        pos = np.asarray(start) + np.asarray(v) * (t - t0)
        res = tracker.update(t, [tuple(pos), *extra])
        assert res.status is TrackStatus.TRACKING and res.target_index == 0
    return res


def test_tracker_picks_closest_then_follows_its_target():
    tr = PersonTracker()
    res = tr.update(0.0, [(0.0, 0.0, 4.0), (1.0, 0.0, 2.0)])
    assert res.status is TrackStatus.TRACKING and res.target_index == 1
    # The other person walks up closer to the camera, but the target is the one near the estimate.
    res = tr.update(0.1, [(1.0, 0.0, 2.02), (0.2, 0.0, 1.5)])
    assert res.target_index == 0
    assert res.position_m == pytest.approx([1.0, 0.0, 2.0], abs=0.05)
    res = tr.update(0.2, [None, (1.0, 0.0, 2.04)])  # a person without depth keeps its index
    assert res.target_index == 1


def test_tracker_largest_selection():
    tr = PersonTracker(TrackerConfig(initial_selection="largest"))
    res = tr.update(0.0, [(0.0, 0.0, 4.0), (1.0, 0.0, 2.0), None], box_areas_px2=[900.0, 400.0, 5000.0])
    assert res.target_index == 0
    with pytest.raises(ValueError):
        PersonTracker(TrackerConfig(initial_selection="loudest"))


def test_tracker_coasts_then_drops():
    tr = PersonTracker(TrackerConfig(max_coast_s=1.0, measurement_noise_std_m=0.05, process_noise_std_mps2=0.5))
    v = np.array([0.5, 0.0, 0.0])
    last = _walk(tr, 0.0, 3.0, (0.0, 0.0, 3.0), v)
    t_last = last.stamp_s  # 2.9
    assert last.velocity_mps == pytest.approx(v, abs=0.05)
    # Occluded for 0.5 s: the target coasts along its velocity.
    res = tr.update(t_last + 0.5, [])
    assert res.status is TrackStatus.COASTING and res.target_index is None
    assert res.position_m == pytest.approx(last.position_m + v * 0.5, abs=0.03)
    assert np.trace(res.covariance[:3, :3]) > np.trace(last.covariance[:3, :3])
    # A detection far from the prediction is gated out: still coasting.
    res = tr.update(t_last + 0.6, [(-2.0, 0.0, 1.0)])
    assert res.status is TrackStatus.COASTING and res.target_index is None
    # Past max_coast_s since the last accepted detection: dropped.
    res = tr.update(t_last + 1.1, [])
    assert res.status is TrackStatus.NONE and not res.has_target and res.position_m is None
    # Then the next person seen becomes the target.
    res = tr.update(t_last + 1.2, [(-2.0, 0.0, 1.0)])
    assert res.status is TrackStatus.TRACKING and res.position_m == pytest.approx([-2.0, 0.0, 1.0])


def test_tracker_out_of_order_and_equal_stamps():
    tr = PersonTracker()
    _walk(tr, 0.0, 1.0, (0.0, 0.0, 2.0), (0.0, 0.0, 0.0))
    before = tr.kf.state
    res = tr.update(0.85, [(0.0, 0.0, 2.0)])  # older than 0.9: ignored
    assert res.stale and res.status is TrackStatus.TRACKING and res.stamp_s == pytest.approx(0.9)
    np.testing.assert_array_equal(tr.kf.state, before)
    res = tr.update(0.9, [(0.01, 0.0, 2.0)])  # same stamp: update, no predict
    assert not res.stale and res.target_index == 0
    # Time jumps back by more than max_coast_s (a rosbag looped): start over.
    res = tr.update(-20.0, [(5.0, 0.0, 5.0)])
    assert not res.stale and res.position_m == pytest.approx([5.0, 0.0, 5.0])


def test_tracker_from_poses_and_depth():
    tr = PersonTracker()
    near = _pose({**SHOULDERS_HIPS, **WRISTS})
    far_pts = {5: (100, 100), 6: (140, 100), 11: (105, 180), 12: (135, 180)}  # on the 5 m wall
    far = _pose(far_pts)
    no_depth = _pose({5: (10, 10)})
    res, positions = tr.update_from_poses(12.5, [far, no_depth, near], _scene_depth(), CAM)
    assert positions[1] is None
    assert positions[2] == pytest.approx((0.02, 0.0, 2.0))
    assert positions[0][2] == pytest.approx(5.0)
    assert res.target_index == 2 and res.position_m == pytest.approx([0.02, 0.0, 2.0])


def test_track_id_is_new_for_each_new_person():
    tr = PersonTracker(TrackerConfig(max_coast_s=0.5, max_consecutive_rejections=2))
    assert tr.update(0.0, []).track_id is None
    first = tr.update(0.1, [(0.0, 0.0, 3.0)])
    assert first.track_id == 1
    assert tr.update(0.2, [(0.0, 0.0, 3.01)]).track_id == 1  # the same person
    assert tr.update(0.3, [(3.0, 0.0, 3.0)]).track_id == 1  # gated out once: still coasting on 1
    jumped = tr.update(0.4, [(3.0, 0.0, 3.0)])  # second rejection in a row: the filter jumps
    assert jumped.reinitialized and jumped.track_id == 2
    lost = tr.update(1.0, [])  # past max_coast_s: no target
    assert lost.status is TrackStatus.NONE and lost.track_id is None
    assert tr.update(1.1, [(1.0, 0.0, 2.0)]).track_id == 3
    tr.update(-10.0, [(1.0, 0.0, 2.0)])  # time jumped back: a restart, still a new id
    assert tr.update(-9.9, [(1.0, 0.0, 2.0)]).track_id == 4
