"""Person tracking from KAPAO poses and a depth image (pure numpy, no rospy).

Pipeline per frame: for each pose, look up depth at its confident keypoints, back-project
them with the pinhole intrinsics, take a robust median (:func:`person_position`); then
:class:`PersonTracker` keeps one target and filters its position with a constant-velocity
Kalman filter (:class:`ConstantVelocityKalman`).

Conventions
-----------
* Pixel coordinates ``(u, v)`` follow ``sensor_msgs/CameraInfo`` / ``image_geometry``: pixel
  centres at integer coordinates, ``u`` to the right, ``v`` down.  A pixel lookup rounds.
* 3D points are in the camera *optical* frame (REP 103): x right, y down, z forward, metres.
* Depth images follow REP 118: ``float32`` metres, or ``uint16`` millimetres; 0 and
  non-finite values mean "no measurement".
* The keypoints must be in the depth image's pixels, i.e. the depth must be registered to
  the colour image the model saw and the poses rescaled to it
  (:func:`robot_offload.apps.kapao_post.rescale_poses`).
* The tracker itself is frame-agnostic: it filters whatever positions it is given.  A
  constant-velocity model is only right in a frame that does not move with the robot, so on
  a moving robot transform the positions to ``odom`` (or ``map``) before :meth:`PersonTracker.update`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from enum import Enum
from typing import List, Optional, Sequence, Tuple

import numpy as np

from robot_offload import checks
from robot_offload.apps.kapao_post import TORSO_KEYPOINTS, Pose
from robot_offload.errors import ConfigError
from robot_offload.frames import check_pairing

__all__ = [
    "CHI2_3DOF_997",
    "CameraIntrinsics",
    "project_pixel_to_3d",
    "depth_at",
    "person_position",
    "ConstantVelocityKalman",
    "TrackStatus",
    "TrackResult",
    "TrackerConfig",
    "PersonTracker",
]

# 99.7 % quantile of the chi-square distribution with 3 degrees of freedom
# (scipy.stats.chi2.ppf(0.997, 3) = 13.9314); hard-coded so the robot needs no scipy.
CHI2_3DOF_997 = 13.9314

Point3 = Tuple[float, float, float]


# ----------------------------------------------------------------------------- projection


@dataclass(frozen=True)
class CameraIntrinsics:
    """Pinhole intrinsics in pixels (distortion is assumed already removed: use the
    rectified image, or accept the error of the raw one)."""

    fx: float
    fy: float
    cx: float
    cy: float

    def __post_init__(self) -> None:
        if not (self.fx > 0 and self.fy > 0) or not all(map(math.isfinite, (self.fx, self.fy, self.cx, self.cy))):
            raise ValueError(f"invalid intrinsics {self}: fx and fy must be positive and all values finite")

    @classmethod
    def from_camera_info_k(cls, k: Sequence[float]) -> "CameraIntrinsics":
        """From ``CameraInfo.K`` (row-major 3x3: fx 0 cx / 0 fy cy / 0 0 1).

        An uncalibrated camera publishes K = 0, which is rejected here rather than giving
        points at infinity.
        """
        k = [float(v) for v in k]
        if len(k) != 9:
            raise ValueError(f"K must have 9 elements, got {len(k)}")
        return cls(fx=k[0], fy=k[4], cx=k[2], cy=k[5])

    def scaled(self, scale_x: float, scale_y: float) -> "CameraIntrinsics":
        """Intrinsics of the same camera at an image resized by (scale_x, scale_y), in the
        pixel-centre convention (a centre at u maps to (u + 0.5) * s - 0.5)."""
        return CameraIntrinsics(
            fx=self.fx * scale_x,
            fy=self.fy * scale_y,
            cx=(self.cx + 0.5) * scale_x - 0.5,
            cy=(self.cy + 0.5) * scale_y - 0.5,
        )


def project_pixel_to_3d(u: float, v: float, depth_m: float, intrinsics: CameraIntrinsics) -> Point3:
    """Back-project pixel (u, v) at depth ``depth_m`` (distance along the optical axis, as a
    depth camera reports it, not along the ray) to (x, y, z) in the optical frame."""
    z = float(depth_m)
    return ((u - intrinsics.cx) * z / intrinsics.fx, (v - intrinsics.cy) * z / intrinsics.fy, z)


def _depth_scale_to_m(depth_image: np.ndarray) -> float:
    if np.issubdtype(depth_image.dtype, np.floating):
        return 1.0  # 32FC1: metres
    if np.issubdtype(depth_image.dtype, np.integer):
        return 1e-3  # 16UC1: millimetres
    raise ValueError(f"unsupported depth dtype {depth_image.dtype} (float metres or integer millimetres)")


def depth_at(depth_image: np.ndarray, u: float, v: float, window_px: int = 5) -> Optional[float]:
    """Median of the valid depths (metres) in a ``window_px`` x ``window_px`` window centred on
    the pixel nearest to (u, v), clipped to the image; None if (u, v) is outside the image
    or the window holds no valid depth.

    A median over a window rather than one pixel because depth cameras leave holes (0 or
    NaN) around edges and on dark or shiny surfaces, exactly where keypoints tend to sit.
    """
    if depth_image.ndim != 2:
        raise ValueError(f"depth image must be H x W, got shape {depth_image.shape}")
    if window_px < 1 or window_px % 2 == 0:
        raise ValueError(f"window_px must be a positive odd number, got {window_px}")
    if not (math.isfinite(u) and math.isfinite(v)):
        return None
    h, w = depth_image.shape
    col, row = int(round(u)), int(round(v))
    if not (0 <= col < w and 0 <= row < h):
        return None
    r = window_px // 2
    patch = depth_image[max(0, row - r) : row + r + 1, max(0, col - r) : col + r + 1]
    vals = patch.astype(np.float64).ravel() * _depth_scale_to_m(depth_image)
    vals = vals[np.isfinite(vals) & (vals > 0)]
    if vals.size == 0:
        return None
    return float(np.median(vals))


def person_position(
    pose: Pose,
    depth_image: np.ndarray,
    intrinsics: CameraIntrinsics,
    min_keypoints: int = 3,
    min_keypoint_conf: float = 0.3,
    window_px: int = 5,
    min_torso_keypoints: int = 2,
) -> Optional[Point3]:
    """The person's 3D position (optical frame, metres), or None if it cannot be trusted.

    Rule: a keypoint is *usable* if its confidence >= ``min_keypoint_conf`` and
    :func:`depth_at` finds a valid depth there.  Fewer than ``min_keypoints`` usable
    keypoints -> None (a mostly occluded or spurious detection).  Otherwise, if at least
    ``min_torso_keypoints`` of the usable ones are torso keypoints (shoulders, hips), the
    position is the per-axis median of the torso points only; else of all usable points.
    Why the torso: it is rigid and wide, so its depth is the person's distance, while
    wrists, ankles and the head are thin and their depth windows often hit the background
    behind the person or an object held in front.
    """
    kps = np.asarray(pose.keypoints, dtype=np.float64)
    points: List[Point3] = []
    is_torso: List[bool] = []
    for idx, (u, v, conf) in enumerate(kps):
        if not conf >= min_keypoint_conf:
            continue
        d = depth_at(depth_image, u, v, window_px)
        if d is None:
            continue
        points.append(project_pixel_to_3d(u, v, d, intrinsics))
        is_torso.append(idx in TORSO_KEYPOINTS)
    if len(points) < max(1, min_keypoints):
        return None
    pts = np.asarray(points)
    torso = np.asarray(is_torso)
    if torso.sum() >= max(1, min_torso_keypoints):
        pts = pts[torso]
    x, y, z = np.median(pts, axis=0)
    return (float(x), float(y), float(z))


# ----------------------------------------------------------------------------- filtering


class ConstantVelocityKalman:
    """Kalman filter on state [x, y, z, vx, vy, vz] (m, m/s) with position measurements.

    Process model: constant velocity, with a random (piecewise constant, white) acceleration
    of standard deviation ``process_noise_std_mps2`` per axis, so for a step ``dt``
    ``Q = q^2 [[dt^4/4, dt^3/2], [dt^3/2, dt^2]]`` per axis.  Measurement noise is isotropic,
    ``measurement_noise_std_m`` per axis, overridable per update (depth noise grows with
    distance).  The first measurement initialises the position (covariance R) with zero
    velocity (std ``initial_velocity_std_mps``).

    Gating: :meth:`update` rejects a measurement whose squared Mahalanobis distance to the
    prediction exceeds ``gate_chi2`` (default: chi-square, 3 dof, 99.7 %), so a depth glitch
    or a different person does not drag the estimate.  After
    ``max_consecutive_rejections`` rejections in a row the filter re-initialises on the
    latest measurement, because by then the filter (not the measurements) is most likely
    wrong; ``None`` disables that.
    """

    def __init__(
        self,
        process_noise_std_mps2: float = 2.0,
        measurement_noise_std_m: float = 0.1,
        initial_velocity_std_mps: float = 1.0,
        gate_chi2: float = CHI2_3DOF_997,
        max_consecutive_rejections: Optional[int] = 5,
    ) -> None:
        if process_noise_std_mps2 < 0 or measurement_noise_std_m <= 0 or initial_velocity_std_mps <= 0:
            raise ValueError("noise standard deviations must be positive (process noise may be 0)")
        if gate_chi2 <= 0:
            raise ValueError("gate_chi2 must be positive")
        if max_consecutive_rejections is not None and max_consecutive_rejections < 1:
            raise ValueError("max_consecutive_rejections must be >= 1 or None")
        self.process_noise_std_mps2 = float(process_noise_std_mps2)
        self.measurement_noise_std_m = float(measurement_noise_std_m)
        self.initial_velocity_std_mps = float(initial_velocity_std_mps)
        self.gate_chi2 = float(gate_chi2)
        self.max_consecutive_rejections = max_consecutive_rejections
        self._x = np.zeros(6)
        self._p = np.eye(6)
        self._initialized = False
        self.consecutive_rejections = 0
        self.last_mahalanobis_sq: Optional[float] = None  # of the last update, for diagnostics
        self.reinitialized = False  # True if the last update re-initialised the filter

    # -- state ---------------------------------------------------------------------------
    @property
    def initialized(self) -> bool:
        return self._initialized

    @property
    def state(self) -> np.ndarray:
        """Copy of [x, y, z, vx, vy, vz]."""
        return self._x.copy()

    @property
    def covariance(self) -> np.ndarray:
        """Copy of the 6 x 6 state covariance."""
        return self._p.copy()

    @property
    def position(self) -> np.ndarray:
        return self._x[:3].copy()

    @property
    def velocity(self) -> np.ndarray:
        return self._x[3:].copy()

    def reset(self) -> None:
        self._x = np.zeros(6)
        self._p = np.eye(6)
        self._initialized = False
        self.consecutive_rejections = 0
        self.last_mahalanobis_sq = None
        self.reinitialized = False

    def initialize(self, z: Sequence[float], measurement_noise_std_m: Optional[float] = None) -> None:
        z = self._as_measurement(z)
        r = self._r(measurement_noise_std_m)[0, 0]
        self._x = np.concatenate([z, np.zeros(3)])
        self._p = np.diag([r] * 3 + [self.initial_velocity_std_mps**2] * 3)
        self._initialized = True
        self.consecutive_rejections = 0

    # -- filter steps --------------------------------------------------------------------
    @staticmethod
    def transition(dt_s: float) -> np.ndarray:
        f = np.eye(6)
        f[0:3, 3:6] = dt_s * np.eye(3)
        return f

    def process_noise(self, dt_s: float) -> np.ndarray:
        q2 = self.process_noise_std_mps2**2
        q = np.zeros((6, 6))
        i3 = np.eye(3)
        q[0:3, 0:3] = q2 * dt_s**4 / 4.0 * i3
        q[0:3, 3:6] = q[3:6, 0:3] = q2 * dt_s**3 / 2.0 * i3
        q[3:6, 3:6] = q2 * dt_s**2 * i3
        return q

    def predict(self, dt_s: float) -> None:
        """Advance the state by ``dt_s`` seconds.  0 is a no-op; negative is an error (the
        caller must drop out-of-order measurements, a Kalman filter cannot go back)."""
        if dt_s < 0 or not math.isfinite(dt_s):
            raise ValueError(f"predict needs a finite dt_s >= 0, got {dt_s}")
        if not self._initialized or dt_s == 0:
            return
        f = self.transition(dt_s)
        self._x = f @ self._x
        self._p = f @ self._p @ f.T + self.process_noise(dt_s)
        self._p = 0.5 * (self._p + self._p.T)

    def mahalanobis_sq(self, z: Sequence[float], measurement_noise_std_m: Optional[float] = None) -> float:
        """Squared Mahalanobis distance of measurement ``z`` from the predicted position."""
        if not self._initialized:
            raise RuntimeError("filter not initialised")
        y, s = self._innovation(self._as_measurement(z), measurement_noise_std_m)
        return float(y @ np.linalg.solve(s, y))

    def update(self, z: Sequence[float], measurement_noise_std_m: Optional[float] = None) -> bool:
        """Fuse position measurement ``z`` (metres).  Returns True if it was used (a normal
        update, the first measurement, or a re-initialisation) and False if gated out."""
        z = self._as_measurement(z)
        self.reinitialized = False
        if not self._initialized:
            self.initialize(z, measurement_noise_std_m)
            self.last_mahalanobis_sq = None
            return True
        y, s = self._innovation(z, measurement_noise_std_m)
        d2 = float(y @ np.linalg.solve(s, y))
        self.last_mahalanobis_sq = d2
        if d2 > self.gate_chi2:
            self.consecutive_rejections += 1
            if self.max_consecutive_rejections is not None and self.consecutive_rejections >= self.max_consecutive_rejections:
                self.initialize(z, measurement_noise_std_m)
                self.reinitialized = True
                return True
            return False
        self.consecutive_rejections = 0
        r = self._r(measurement_noise_std_m)
        ph_t = self._p[:, 0:3]  # P H^T with H = [I 0]
        gain = np.linalg.solve(s, ph_t.T).T  # K = P H^T S^-1 (S symmetric)
        self._x = self._x + gain @ y
        # Joseph form: stays symmetric positive definite despite rounding.
        i_kh = np.eye(6)
        i_kh[:, 0:3] -= gain
        self._p = i_kh @ self._p @ i_kh.T + gain @ r @ gain.T
        self._p = 0.5 * (self._p + self._p.T)
        return True

    # -- helpers -------------------------------------------------------------------------
    def _r(self, measurement_noise_std_m: Optional[float]) -> np.ndarray:
        std = self.measurement_noise_std_m if measurement_noise_std_m is None else float(measurement_noise_std_m)
        return std**2 * np.eye(3)

    def _innovation(self, z: np.ndarray, measurement_noise_std_m: Optional[float]) -> Tuple[np.ndarray, np.ndarray]:
        return z - self._x[0:3], self._p[0:3, 0:3] + self._r(measurement_noise_std_m)

    @staticmethod
    def _as_measurement(z: Sequence[float]) -> np.ndarray:
        z = np.asarray(z, dtype=np.float64).reshape(-1)
        if z.shape != (3,) or not np.all(np.isfinite(z)):
            raise ValueError(f"a measurement must be 3 finite numbers, got {z}")
        return z


# ----------------------------------------------------------------------------- tracker


class TrackStatus(str, Enum):
    NONE = "none"  # no target
    TRACKING = "tracking"  # updated with a detection this frame
    COASTING = "coasting"  # target kept on prediction alone


@dataclass
class TrackResult:
    """What the tracker knows at ``stamp_s``.

    ``target_index`` is the index (into the positions given to :meth:`PersonTracker.update`)
    of the detection used this frame, None if none was.  ``stale`` marks a frame that was
    older than one already processed and was ignored (the rest describes the current state).
    ``track_id`` names the target: a new one (counting from 1) whenever the tracker takes a
    new person (the first, one after a loss, or a jump to another detection); None when
    there is no target.
    """

    stamp_s: float
    status: TrackStatus
    position_m: Optional[np.ndarray] = None
    velocity_mps: Optional[np.ndarray] = None
    covariance: Optional[np.ndarray] = None
    target_index: Optional[int] = None
    stale: bool = False
    reinitialized: bool = False
    track_id: Optional[int] = None

    @property
    def has_target(self) -> bool:
        return self.status is not TrackStatus.NONE


@dataclass
class TrackerConfig:
    process_noise_std_mps2: float = 2.0
    measurement_noise_std_m: float = 0.1
    initial_velocity_std_mps: float = 1.0
    gate_chi2: float = CHI2_3DOF_997
    # Frames of rejected nearest detections before the filter jumps to them.  An occluder
    # nearer to the prediction than the target for this many frames takes the track over;
    # None leaves re-acquisition to max_coast_s alone.
    max_consecutive_rejections: Optional[int] = 10
    max_coast_s: float = 1.0
    initial_selection: str = "closest"  # "closest" (smallest range) or "largest" (box area)
    # person_position parameters, used by PersonTracker.update_from_poses
    min_keypoints: int = 3
    min_keypoint_conf: float = 0.3
    depth_window_px: int = 5

    def __post_init__(self) -> None:
        if self.initial_selection not in ("closest", "largest"):
            raise ValueError(f"initial_selection must be 'closest' or 'largest', got {self.initial_selection!r}")
        if self.max_coast_s < 0:
            raise ValueError("max_coast_s must be >= 0")


@dataclass
class PersonTrackerNodeConfig:
    """Settings of the person_tracker node (its ``~`` parameters); :meth:`tracker` is the
    filter's part."""

    input: str = "result"           # result (registry KAPAO output, decoded here) | people (decoded poses)
    model_input_size: Sequence[int] = (1280, 1280)   # [H, W] the model ran at
    conf_thres_pose: float = 0.3
    conf_thres_kp: float = 0.3
    iou_thres: float = 0.45
    max_coast_s: float = 1.0
    process_noise_std_mps2: float = 2.0
    measurement_noise_std_m: float = 0.1
    min_keypoints: int = 3
    depth_window_px: int = 5
    sync_queue_size: int = 60
    sync_slop_s: float = 0.01

    def validate(self) -> "PersonTrackerNodeConfig":
        if self.input not in ("result", "people"):
            raise ConfigError(f"input must be 'result' or 'people', got {self.input!r}")
        hw = self.model_input_size
        if isinstance(hw, str) or not isinstance(hw, (list, tuple)) or len(hw) != 2:
            raise ConfigError(f"model_input_size must be [H, W], got {hw!r}")
        queue, slop = check_pairing(self.sync_queue_size, self.sync_slop_s)
        return replace(
            self, model_input_size=tuple(checks.integer("model_input_size", v, 1, 16384) for v in hw),
            conf_thres_pose=checks.number("conf_thres_pose", self.conf_thres_pose, 0.0, 1.0),
            conf_thres_kp=checks.number("conf_thres_kp", self.conf_thres_kp, 0.0, 1.0),
            iou_thres=checks.number("iou_thres", self.iou_thres, 0.0, 1.0),
            max_coast_s=checks.number("max_coast_s", self.max_coast_s, 0.0, 3600.0),
            process_noise_std_mps2=checks.number("process_noise_std_mps2", self.process_noise_std_mps2,
                                                 0.0, 1000.0, low_open=True),
            measurement_noise_std_m=checks.number("measurement_noise_std_m", self.measurement_noise_std_m,
                                                  0.0, 1000.0, low_open=True),
            min_keypoints=checks.integer("min_keypoints", self.min_keypoints, 1, 1000),
            depth_window_px=checks.integer("depth_window_px", self.depth_window_px, 0, 1000),
            sync_queue_size=queue, sync_slop_s=slop)

    def tracker(self) -> TrackerConfig:
        return TrackerConfig(max_coast_s=self.max_coast_s, process_noise_std_mps2=self.process_noise_std_mps2,
                             measurement_noise_std_m=self.measurement_noise_std_m,
                             min_keypoints=self.min_keypoints, depth_window_px=self.depth_window_px)


class PersonTracker:
    """Keeps one target person and filters its 3D position.

    Per frame (:meth:`update`): predict the filter to the frame's stamp; take the detection
    nearest (Euclidean) to the prediction and offer it to the filter, whose gate may reject
    it; with no accepted detection the target *coasts* on the prediction, and once
    ``max_coast_s`` has passed since the last accepted detection it is dropped.  With no
    target, a new one is chosen among the detections: the closest to the camera (or the
    largest box).

    Time: stamps (seconds, e.g. ``header.stamp.to_sec()``) must not go backwards.  A frame
    older than the last one is ignored and reported ``stale`` (a Kalman filter cannot rewind),
    unless it is older by more than ``max_coast_s``: then time has jumped back (a rosbag
    looped, simulation reset) and the tracker restarts.  Equal stamps update without a
    prediction step.
    """

    def __init__(self, config: Optional[TrackerConfig] = None) -> None:
        self.config = config or TrackerConfig()
        c = self.config
        self.kf = ConstantVelocityKalman(
            c.process_noise_std_mps2,
            c.measurement_noise_std_m,
            c.initial_velocity_std_mps,
            c.gate_chi2,
            c.max_consecutive_rejections,
        )
        self._last_stamp_s: Optional[float] = None
        self._last_accept_s: Optional[float] = None
        self._last_track_id = 0
        self.track_id: Optional[int] = None

    @property
    def has_target(self) -> bool:
        return self.kf.initialized

    def reset(self) -> None:
        self.kf.reset()
        self._last_stamp_s = None
        self._last_accept_s = None
        self.track_id = None

    def _new_track(self) -> None:
        self._last_track_id += 1
        self.track_id = self._last_track_id

    def update(
        self,
        stamp_s: float,
        positions_m: Sequence[Optional[Sequence[float]]],
        box_areas_px2: Optional[Sequence[float]] = None,
    ) -> TrackResult:
        """Process one frame's detections (None entries = people without a position, kept
        so indices line up with the caller's pose list)."""
        stamp_s = float(stamp_s)
        if not math.isfinite(stamp_s):
            raise ValueError("stamp_s must be finite")
        if self._last_stamp_s is not None and stamp_s < self._last_stamp_s:
            if self._last_stamp_s - stamp_s > self.config.max_coast_s:
                self.reset()
            else:
                return self._result(self._last_stamp_s, None, stale=True)

        valid = [
            (i, np.asarray(p, dtype=np.float64))
            for i, p in enumerate(positions_m)
            if p is not None and np.all(np.isfinite(np.asarray(p, dtype=np.float64)))
        ]
        dt_s = 0.0 if self._last_stamp_s is None else stamp_s - self._last_stamp_s
        self._last_stamp_s = stamp_s

        used: Optional[int] = None
        reinit = False
        if self.kf.initialized:
            self.kf.predict(dt_s)
            if valid:
                pred = self.kf.position
                i, z = min(valid, key=lambda iz: float(np.linalg.norm(iz[1] - pred)))
                if self.kf.update(z):
                    used, reinit = i, self.kf.reinitialized
                    self._last_accept_s = stamp_s
                    if reinit:
                        self._new_track()
            if used is None and stamp_s - self._last_accept_s > self.config.max_coast_s:
                self.kf.reset()
                self.track_id = None
        if not self.kf.initialized and valid:
            i, z = self._select_new(valid, positions_m, box_areas_px2)
            self.kf.initialize(z)
            used, self._last_accept_s = i, stamp_s
            self._new_track()
        return self._result(stamp_s, used, reinitialized=reinit)

    def update_from_poses(
        self,
        stamp_s: float,
        poses: Sequence[Pose],
        depth_image: np.ndarray,
        intrinsics: CameraIntrinsics,
    ) -> Tuple[TrackResult, List[Optional[Point3]]]:
        """Convenience: :func:`person_position` for every pose, then :meth:`update`.
        Returns the result and the per-pose positions (optical frame, None where unknown).
        Only valid when the optical frame is the tracking frame (a static camera)."""
        c = self.config
        positions = [
            person_position(p, depth_image, intrinsics, c.min_keypoints, c.min_keypoint_conf, c.depth_window_px)
            for p in poses
        ]
        return self.update(stamp_s, positions, [p.box_area_px2 for p in poses]), positions

    def _select_new(self, valid, positions_m, box_areas_px2) -> Tuple[int, np.ndarray]:
        if self.config.initial_selection == "largest":
            if box_areas_px2 is None or len(box_areas_px2) != len(positions_m):
                raise ValueError("initial_selection='largest' needs one box area per position")
            return max(valid, key=lambda iz: float(box_areas_px2[iz[0]]))
        return min(valid, key=lambda iz: float(np.linalg.norm(iz[1])))

    def _result(self, stamp_s: float, used: Optional[int], stale: bool = False, reinitialized: bool = False) -> TrackResult:
        if not self.kf.initialized:
            return TrackResult(stamp_s, TrackStatus.NONE, stale=stale)
        status = TrackStatus.TRACKING if (used is not None or (stale and self._last_accept_s == stamp_s)) else TrackStatus.COASTING
        return TrackResult(
            stamp_s,
            status,
            position_m=self.kf.position,
            velocity_mps=self.kf.velocity,
            covariance=self.kf.covariance,
            target_index=used,
            stale=stale,
            reinitialized=reinitialized,
            track_id=self.track_id,
        )
