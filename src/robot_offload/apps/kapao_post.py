"""KAPAO post-processing: decoded head output -> people with 17 keypoints each.

KAPAO (Keypoints And Poses As Objects, McNally et al. 2022) detects two kinds of objects
with one YOLO head:

* *pose objects* (class 0, "person"): a box plus a regressed position for every keypoint.
  Regression from the box centre is coarse, but it says which keypoints belong together.
* *keypoint objects* (classes 1..K, one per keypoint type): a small box centred on one
  keypoint.  They localise a keypoint more precisely but carry no identity.

Post-processing therefore (1) filters both kinds by confidence, (2) suppresses duplicates
separately for poses and for keypoint objects (class-aware, so a left wrist never
suppresses a nearby left elbow), and (3) fuses: each keypoint object of type ``k`` replaces
keypoint ``k`` of the pose whose *regressed* keypoint ``k`` is nearest to it, provided that
distance is below ``fuse_dist_px``.  Matching uses the regressed positions (not already
fused ones) so the result does not depend on processing order; when several keypoint objects
of one type match the same pose, the most confident one wins.

Coordinates
-----------
:func:`decode_poses` returns coordinates in the *model input* pixels of ``pred``, in YOLO's
continuous convention (pixel ``i`` spans ``[i, i + 1)``).  :func:`rescale_poses` maps them to
the camera image that was resized into the model (as ``ModelSpec.preprocess`` does) and to
the camera-info convention (pixel centres at integer coordinates), which is what
:mod:`robot_offload.apps.tracking` expects.

Keypoint confidence
-------------------
A regressed keypoint gets the pose's score as its confidence (the network gives it no
separate one); a fused keypoint gets the keypoint object's score. ``Pose.keypoint_fused``
tells which is which.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Sequence, Tuple

import numpy as np
import torch
import torchvision

__all__ = [
    "COCO_KEYPOINT_NAMES",
    "TORSO_KEYPOINTS",
    "Pose",
    "decode_poses",
    "rescale_poses",
    "num_keypoints_from_channels",
]

# KAPAO is trained on COCO: keypoint object class k + 1 is keypoint k of this list.
COCO_KEYPOINT_NAMES: Tuple[str, ...] = (
    "nose", "left_eye", "right_eye", "left_ear", "right_ear",
    "left_shoulder", "right_shoulder", "left_elbow", "right_elbow",
    "left_wrist", "right_wrist", "left_hip", "right_hip",
    "left_knee", "right_knee", "left_ankle", "right_ankle",
)
# Shoulders and hips: the rigid part of the body, whose depth is the person's distance.
TORSO_KEYPOINTS: Tuple[int, ...] = (5, 6, 11, 12)


@dataclass
class Pose:
    """One person.

    ``box_xyxy`` (4,) and ``keypoints`` (K x 3: x, y, confidence) are in pixels of the frame
    they were decoded in (see the module docstring); ``score`` = objectness x person score.
    """

    box_xyxy: np.ndarray
    score: float
    keypoints: np.ndarray
    keypoint_fused: np.ndarray = field(default=None)  # (K,) bool: position from a keypoint object

    def __post_init__(self) -> None:
        self.box_xyxy = np.asarray(self.box_xyxy, dtype=np.float64).reshape(4)
        self.keypoints = np.asarray(self.keypoints, dtype=np.float64)
        if self.keypoints.ndim != 2 or self.keypoints.shape[1] != 3:
            raise ValueError(f"keypoints must be K x 3, got {self.keypoints.shape}")
        if self.keypoint_fused is None:
            self.keypoint_fused = np.zeros(len(self.keypoints), dtype=bool)
        self.keypoint_fused = np.asarray(self.keypoint_fused, dtype=bool).reshape(len(self.keypoints))
        self.score = float(self.score)

    @property
    def box_area_px2(self) -> float:
        w = max(0.0, float(self.box_xyxy[2] - self.box_xyxy[0]))
        h = max(0.0, float(self.box_xyxy[3] - self.box_xyxy[1]))
        return w * h


def num_keypoints_from_channels(no: int) -> int:
    """K from the channel count ``no = 5 + (1 + K) + 2K`` (57 -> 17)."""
    k, rem = divmod(int(no) - 6, 3)
    if rem or k < 1:
        raise ValueError(f"{no} channels is not a KAPAO layout (5 + (1 + K) + 2K)")
    return k


def _xywh_to_xyxy(b: torch.Tensor) -> torch.Tensor:
    half = b[:, 2:4] / 2.0
    return torch.cat([b[:, 0:2] - half, b[:, 0:2] + half], dim=1)


def _nms(boxes: torch.Tensor, scores: torch.Tensor, classes: torch.Tensor | None,
         iou_thres: float, max_candidates: int, max_det: int) -> torch.Tensor:
    """Indices (into ``boxes``) kept by (class-aware) NMS, best score first.

    The top-``max_candidates`` cap bounds the cost when an untrained or confused network
    scores many anchors above threshold (NMS is quadratic in the worst case).
    """
    if boxes.shape[0] == 0:
        return torch.zeros(0, dtype=torch.long, device=boxes.device)
    order = torch.argsort(scores, descending=True)[:max_candidates]
    b, s = boxes[order], scores[order]
    if classes is None:
        keep = torchvision.ops.nms(b, s, iou_thres)
    else:
        keep = torchvision.ops.batched_nms(b, s, classes[order], iou_thres)
    return order[keep[:max_det]]


def decode_poses(
    pred: torch.Tensor,
    conf_thres_pose: float = 0.3,
    conf_thres_kp: float = 0.3,
    iou_thres: float = 0.45,
    fuse_dist_px: float = 25.0,
    iou_thres_kp: float | None = None,
    max_det: int = 300,
    max_candidates: int = 30000,
) -> List[Pose]:
    """Turn one image's KAPAO ``pred`` (``1 x A x no`` or ``A x no``) into poses.

    Each anchor is assigned its best class (YOLOv5's single-label NMS), with score =
    objectness x class score; so an anchor is either a pose or one keypoint object, never
    both.  ``conf_thres_*`` apply to that score; ``iou_thres_kp`` defaults to ``iou_thres``.
    ``fuse_dist_px`` is in the pixels of ``pred`` (KAPAO uses 25 px at 1280 input; scale it
    with the input size).  Returns poses best-first; an empty list when nothing passes.
    """
    if pred.dim() == 3:
        if pred.shape[0] != 1:
            raise ValueError(f"decode_poses takes one image; got a batch of {pred.shape[0]} (loop over it)")
        pred = pred[0]
    if pred.dim() != 2:
        raise ValueError(f"pred must be 1 x A x no or A x no, got shape {tuple(pred.shape)}")
    k = num_keypoints_from_channels(pred.shape[1])
    nc = 1 + k
    if iou_thres_kp is None:
        iou_thres_kp = iou_thres
    p = pred.detach().float()

    cls_scores = p[:, 4:5] * p[:, 5 : 5 + nc]
    score, cls = cls_scores.max(dim=1)
    is_pose = cls == 0
    thres = torch.where(is_pose, torch.full_like(score, conf_thres_pose), torch.full_like(score, conf_thres_kp))
    candidate = (score > thres) & torch.isfinite(p).all(dim=1)
    boxes = _xywh_to_xyxy(p[:, 0:4])

    pose_idx = torch.nonzero(candidate & is_pose).flatten()
    pose_idx = pose_idx[_nms(boxes[pose_idx], score[pose_idx], None, iou_thres, max_candidates, max_det)]
    if pose_idx.numel() == 0:
        return []
    kp_idx = torch.nonzero(candidate & ~is_pose).flatten()
    kp_idx = kp_idx[_nms(boxes[kp_idx], score[kp_idx], cls[kp_idx], iou_thres_kp, max_candidates, max_det)]

    pose_boxes = boxes[pose_idx].cpu().numpy().astype(np.float64)
    pose_scores = score[pose_idx].cpu().numpy().astype(np.float64)
    regressed = p[pose_idx, 5 + nc :].reshape(-1, k, 2).cpu().numpy().astype(np.float64)  # P x K x 2
    n_pose = len(pose_idx)
    keypoints = np.concatenate([regressed, np.repeat(pose_scores[:, None, None], k, axis=1)], axis=2)
    fused = np.zeros((n_pose, k), dtype=bool)

    if kp_idx.numel():
        centres = p[kp_idx, 0:2].cpu().numpy().astype(np.float64)  # M x 2, best score first
        kp_scores = score[kp_idx].cpu().numpy().astype(np.float64)
        kp_type = cls[kp_idx].cpu().numpy().astype(np.int64) - 1
        # dist[m, j]: keypoint object m to pose j's regressed keypoint of m's type.
        dist = np.linalg.norm(regressed[:, kp_type, :].transpose(1, 0, 2) - centres[:, None, :], axis=2)
        nearest = dist.argmin(axis=1)
        ok = dist[np.arange(len(kp_idx)), nearest] < fuse_dist_px
        m = np.nonzero(ok)[0]
        if m.size:
            # First occurrence of each (pose, type) pair in best-first order = the winner.
            slot = nearest[m] * k + kp_type[m]
            _, first = np.unique(slot, return_index=True)
            win = m[first]
            j, t = nearest[win], kp_type[win]
            keypoints[j, t, 0:2] = centres[win]
            keypoints[j, t, 2] = kp_scores[win]
            fused[j, t] = True

    return [Pose(pose_boxes[i], pose_scores[i], keypoints[i], fused[i]) for i in range(n_pose)]


def rescale_poses(poses: Sequence[Pose], input_size_hw: Sequence[int], image_size_hw: Sequence[int]) -> List[Pose]:
    """Map poses from model-input pixels to the camera image that was resized to that input.

    For the plain (aspect-changing) resize of ``ModelSpec.preprocess``: a continuous
    coordinate scales by image/input size, then shifts by -0.5 px into the camera-info
    convention (pixel centres at integers) that the projection in
    :mod:`robot_offload.apps.tracking` uses.  Confidences are kept.  Returns new objects.
    """
    sy = float(image_size_hw[0]) / float(input_size_hw[0])
    sx = float(image_size_hw[1]) / float(input_size_hw[1])
    scale = np.array([sx, sy])
    out = []
    for pose in poses:
        box = pose.box_xyxy.reshape(2, 2) * scale - 0.5
        kps = pose.keypoints.copy()
        kps[:, 0:2] = kps[:, 0:2] * scale - 0.5
        out.append(Pose(box.reshape(4), pose.score, kps, pose.keypoint_fused.copy()))
    return out
