"""Running the real KAPAO code (a checkout of github.com/wmcnally/kapao) unchanged, with its
model offloaded by operator interception.

:class:`KapaoRepoRunner` calls the repository's own functions, as its ``demos/video.py``
does: ``models.experimental.attempt_load(weights, map_location)``,
``utils.general.check_img_size``, ``utils.augmentations.letterbox``, the model with
``augment=True, kp_flip, scales, flips`` from the data yaml, then ``val.run_nms`` and
``val.post_process_batch``. Nothing in the checkout is modified or copied. With a
:class:`~robot_offload.transparent.session.RemoteSession`, only the model call runs under
interception (its operators go to the offload server, one replay per frame once its
sequence is identified); NMS and pose fusion run on the robot, as in the RRTO paper's
people-tracking robot.

KAPAO's released weights are pickled models (FP16), and ``attempt_load`` reads them with a
plain ``torch.load``: since torch 2.6 that refuses anything but tensors, because unpickling
a file runs code from it. Loading one is the user's explicit choice
(``trust_checkpoint=True``, the node's ``~trust_checkpoint``): only then, and only while
``attempt_load`` runs, does ``torch.load`` accept pickles. The file is the user's own, on
the robot; nothing received over the network is ever loaded this way.
"""

import contextlib
import dataclasses
import pickle

import os
import sys
import time
from typing import List, Optional, Tuple

import numpy as np
import torch

from robot_offload import checks
from robot_offload.apps.kapao_post import Pose
from robot_offload.errors import ConfigError
from robot_offload.stats import FrameStats
from robot_offload.transparent.session import MODES as SESSION_MODES

#: the kapao_repo node's modes: the model on the robot, or offloaded by a session's mode
KAPAO_MODES = ("local",) + SESSION_MODES


@dataclasses.dataclass
class KapaoRepoConfig:
    """Settings of the kapao_repo node (its ``~`` parameters)."""

    kapao_repo: str = ""            # path of a KAPAO checkout (required)
    weights: str = ""               # its weights file (required)
    data: str = "data/coco-kp.yaml"  # data yaml, relative to the checkout
    imgsz: int = 1280               # inference size (px)
    mode: str = "auto"              # start mode; the node reads ~mode again every frame
    server_ns: str = "/offload_server"
    timeout_s: float = 5.0          # deadline of one server call (s); past it the frame runs locally
    conf_thres: float = 0.5
    conf_thres_kp: float = 0.5
    trust_checkpoint: bool = False  # load a pickled checkpoint (runs code from the file)

    def validate(self) -> "KapaoRepoConfig":
        for name in ("kapao_repo", "weights"):
            checks.text(name, getattr(self, name), empty=False)
        if self.mode not in KAPAO_MODES:
            raise ConfigError(f"unknown mode {self.mode!r}; known: {list(KAPAO_MODES)}")
        return dataclasses.replace(
            self, data=checks.text("data", self.data, empty=False),
            imgsz=checks.integer("imgsz", self.imgsz, 32, 8192),
            server_ns=checks.ros_namespace("server_ns", self.server_ns),
            timeout_s=checks.number("timeout_s", self.timeout_s, 0.0, 3600.0, low_open=True),
            conf_thres=checks.number("conf_thres", self.conf_thres, 0.0, 1.0),
            conf_thres_kp=checks.number("conf_thres_kp", self.conf_thres_kp, 0.0, 1.0),
            trust_checkpoint=checks.flag("trust_checkpoint", self.trust_checkpoint))


class KapaoRepoRunner:
    def __init__(self, repo: str, weights: str, data: str = "data/coco-kp.yaml", imgsz: int = 1280,
                 device: str = "cpu", conf_thres: float = 0.5, iou_thres: float = 0.45,
                 conf_thres_kp: float = 0.5, conf_thres_kp_person: float = 0.2, iou_thres_kp: float = 0.45,
                 overwrite_tol: int = 50, use_kp_dets: bool = True, trust_checkpoint: bool = False):
        if not os.path.isdir(os.path.join(repo, "models")) or not os.path.isfile(os.path.join(repo, "val.py")):
            raise ConfigError(f"kapao_repo {repo!r} is not a KAPAO checkout (no models/ or val.py)")
        if not os.path.isfile(weights):
            raise ConfigError(f"KAPAO weights file {weights!r} not found")
        repo = os.path.abspath(repo)
        if repo not in sys.path:
            sys.path.insert(0, repo)
        import yaml
        from models.experimental import attempt_load          # the repository's own code
        from utils.augmentations import letterbox
        from utils.general import check_img_size
        from val import post_process_batch, run_nms
        self._letterbox, self._run_nms, self._post = letterbox, run_nms, post_process_batch
        with open(data if os.path.isabs(data) else os.path.join(repo, data)) as f:
            self.data = yaml.safe_load(f)
        self.data.update(imgsz=imgsz, conf_thres=conf_thres, iou_thres=iou_thres, use_kp_dets=use_kp_dets,
                         conf_thres_kp=conf_thres_kp, iou_thres_kp=iou_thres_kp,
                         conf_thres_kp_person=conf_thres_kp_person, overwrite_tol=overwrite_tol,
                         scales=[1], flips=[None], count_fused=False)
        self.device = torch.device(device)
        try:
            with _pickles_allowed() if trust_checkpoint else contextlib.nullcontext():
                self.model = attempt_load(weights, map_location=self.device).eval()
        except pickle.UnpicklingError as e:
            raise ConfigError(
                f"{weights!r} is a pickled checkpoint (KAPAO's release format); loading it runs code "
                "from the file, so torch refuses it by default. If the file is yours, allow it with "
                "trust_checkpoint (the kapao_repo node's ~trust_checkpoint, "
                "kapao_people_tracking.launch trust_checkpoint:=true)") from e
        self.stride = int(self.model.stride.max())
        self.imgsz = check_img_size(imgsz, s=self.stride)

    def __call__(self, image_rgb: np.ndarray, session=None,
                 stats: Optional[FrameStats] = None) -> Tuple[List[Pose], FrameStats]:
        """Poses (image pixels) for one RGB image; the model under ``session`` if given."""
        stats = stats or FrameStats()
        t0 = time.perf_counter()
        im0 = np.ascontiguousarray(image_rgb[:, :, ::-1])          # KAPAO reads BGR (cv2)
        img = self._letterbox(im0, self.imgsz, stride=self.stride, auto=True)[0]
        img = np.ascontiguousarray(img.transpose((2, 0, 1))[::-1])  # HWC BGR -> CHW RGB
        img = torch.from_numpy(img).to(self.device).float() / 255.0
        img = img[None]
        t1 = time.perf_counter()
        stats.add_compute(t0, t1)
        with torch.inference_mode():
            if session is None:
                out = self.model(img, augment=True, kp_flip=self.data["kp_flip"], scales=self.data["scales"],
                                 flips=self.data["flips"])[0]
            else:
                session.frame_stats = stats
                try:
                    with session:
                        out = self.model(img, augment=True, kp_flip=self.data["kp_flip"],
                                         scales=self.data["scales"], flips=self.data["flips"])[0]
                    out = session.materialize(out)
                finally:
                    session.frame_stats = None
        t2 = time.perf_counter()
        if session is None:
            stats.add_compute(t1, t2)
        t3 = time.perf_counter()
        person_dets, kp_dets = self._run_nms(self.data, out)
        bboxes, poses, scores, _, _ = self._post(self.data, img, [], [[im0.shape[:2]]], person_dets, kp_dets)
        stats.add_compute(t3, time.perf_counter())
        result = [Pose(box_xyxy=np.asarray(b, dtype=np.float64), score=float(s),
                       keypoints=np.asarray(p, dtype=np.float64)[:, :3])
                  for b, p, s in zip(bboxes, poses, scores)]
        return result, stats


@contextlib.contextmanager
def _pickles_allowed():
    """``torch.load`` without ``weights_only`` for this block: the user's own checkpoint."""
    original = torch.load

    def load(f, *args, **kwargs):
        kwargs.setdefault("weights_only", False)
        return original(f, *args, **kwargs)
    torch.load = load
    try:
        yield
    finally:
        torch.load = original
