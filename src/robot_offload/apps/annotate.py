"""Drawing people on a camera image (OpenCV, no rospy): each person's box, skeleton and
confident keypoints; the tracked target's box in its own colour with its track id."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

__all__ = ["COCO_SKELETON", "DrawnPerson", "draw_people", "TARGET_RGB", "OTHER_RGB", "KEYPOINT_RGB"]

#: limbs as pairs of COCO keypoint indices (nose 0 ... right ankle 16)
COCO_SKELETON = ((15, 13), (13, 11), (16, 14), (14, 12), (11, 12), (5, 11), (6, 12), (5, 6), (5, 7),
                 (6, 8), (7, 9), (8, 10), (1, 2), (0, 1), (0, 2), (1, 3), (2, 4), (3, 5), (4, 6))
TARGET_RGB = (0, 255, 0)
OTHER_RGB = (255, 0, 255)
KEYPOINT_RGB = (0, 255, 255)
_LIMIT_PX = 1 << 15  # coordinates are clipped to this: OpenCV draws in int32 fixed point


@dataclass
class DrawnPerson:
    box_xyxy: Sequence[float]  # x0, y0, x1, y1 (px)
    keypoints: np.ndarray  # K x 3: u, v, confidence
    score: float = 0.0


def _pt(u: float, v: float):
    return int(round(min(max(u, -_LIMIT_PX), _LIMIT_PX))), int(round(min(max(v, -_LIMIT_PX), _LIMIT_PX)))


def _finite(*values: float) -> bool:
    return all(math.isfinite(float(v)) for v in values)


def draw_people(image_rgb: np.ndarray, people: Sequence[DrawnPerson], target_index: int = -1,
                track_id: int = -1, track_status: str = "", min_keypoint_conf: float = 0.3) -> np.ndarray:
    """A copy of ``image_rgb`` (H x W x 3 uint8) with ``people`` drawn on it. The person at
    ``target_index`` is the tracked target: its box is drawn in :data:`TARGET_RGB` and
    labelled ``id <track_id> <track_status>``; the others in :data:`OTHER_RGB` with their
    score. Keypoints below ``min_keypoint_conf`` and non-finite coordinates are not drawn."""
    import cv2

    img = np.ascontiguousarray(image_rgb, dtype=np.uint8).copy()
    if img.ndim != 3 or img.shape[2] != 3:
        raise ValueError(f"image must be H x W x 3, got shape {img.shape}")
    thick = max(1, int(round(min(img.shape[:2]) / 240)))
    for i, person in enumerate(people):
        colour = TARGET_RGB if i == target_index else OTHER_RGB
        kps = np.asarray(person.keypoints, dtype=np.float64).reshape(-1, 3)
        ok = np.array([_finite(u, v, c) and c >= min_keypoint_conf for u, v, c in kps], dtype=bool)
        for a, b in COCO_SKELETON:
            if a < len(kps) and b < len(kps) and ok[a] and ok[b]:
                cv2.line(img, _pt(*kps[a, :2]), _pt(*kps[b, :2]), colour, thick, cv2.LINE_AA)
        for (u, v, _), good in zip(kps, ok):
            if good:
                cv2.circle(img, _pt(u, v), thick + 1, KEYPOINT_RGB, -1, cv2.LINE_AA)
        box = [float(v) for v in person.box_xyxy][:4]
        if len(box) == 4 and _finite(*box):
            p0, p1 = _pt(box[0], box[1]), _pt(box[2], box[3])
            cv2.rectangle(img, p0, p1, colour, thick + (1 if i == target_index else 0))
            label = (f"id {track_id} {track_status}".strip() if i == target_index
                     else f"{float(person.score):.2f}")
            cv2.putText(img, label, (p0[0], max(p0[1] - 4, 12)), cv2.FONT_HERSHEY_SIMPLEX,
                        0.4 * thick, colour, thick, cv2.LINE_AA)
    return img
