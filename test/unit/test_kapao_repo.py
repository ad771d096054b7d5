"""kapao_repo: a KAPAO checkout's own inference path (here the stand-in fixture with the
repository's layout and entry points), its model offloaded by record_replay, gives the same
poses as running it locally."""

import os

import numpy as np
import pytest
import torch

from robot_offload.apps.kapao_repo import KapaoRepoRunner
from robot_offload.camera import SyntheticSource
from robot_offload.errors import ConfigError
from robot_offload.protocol import method_of
from robot_offload.server import OffloadServer, ServerConfig
from robot_offload.transparent.session import RemoteSession
from robot_offload.transport.inproc import InProcessTransport

from devices import SERVER_DEVICE, skip_off_cpu

REPO = os.path.join(os.path.dirname(__file__), "..", "fixtures", "kapao_repo")


def make_weights(path):
    import sys
    sys.path.insert(0, os.path.abspath(REPO))
    try:
        from models.experimental import StandInKapao
    finally:
        sys.path.remove(os.path.abspath(REPO))
    torch.manual_seed(0)
    model = StandInKapao().eval()
    torch.save({"model": model.half(), "epoch": -1}, path)      # KAPAO's release format: a pickled FP16 model
    return path


def test_record_replay_poses_equal_local(tmp_path):
    skip_off_cpu("random-weight keypoint objects are matched among near-ties, which float "
                 "rounding reorders (5 of 51 coordinates moved a grid cell on an H100)")
    runner = KapaoRepoRunner(REPO, make_weights(tmp_path / "w.pt"), imgsz=128,
                             conf_thres_kp=0.0, conf_thres=0.0, trust_checkpoint=True)
    runner.data["conf_thres_kp_person"] = 0.0
    transport = InProcessTransport(OffloadServer(ServerConfig(ops_sandbox=False, device=SERVER_DEVICE)))
    session = RemoteSession(lambda r, t: transport.call(method_of(r), r, t), mode="record_replay",
                            local_fallback=True)
    cam = SyntheticSource(160, 120, seed=1)
    phases = []
    for i in range(6):
        image = cam.read()
        local, _ = runner(image)
        n = len(session.stats.inferences)
        remote, stats = runner(image, session=session)
        phases.append((session.stats.inferences[n].phase if len(session.stats.inferences) > n else "?",
                       stats.round_trips))
        assert len(local) == len(remote) and len(local) > 0
        for a, b in zip(local, remote):
            np.testing.assert_allclose(b.keypoints, a.keypoints, rtol=1e-4, atol=1e-3)
            np.testing.assert_allclose(b.box_xyxy, a.box_xyxy, rtol=1e-4, atol=1e-3)
    assert phases[-1][0] == "replaying" and phases[-1][1] <= 2, phases
    assert phases[0][1] > 20


def test_not_a_checkout_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="not a KAPAO checkout"):
        KapaoRepoRunner(str(tmp_path), str(tmp_path / "w.pt"))


def test_a_pickled_checkpoint_loads_only_when_the_user_trusts_it(tmp_path):
    """KAPAO's release format (a pickled FP16 model, then .float().fuse()): refused with a
    message naming the switch by default, loaded with it; torch.load is itself again after."""
    weights = make_weights(tmp_path / "w.pt")
    with pytest.raises(ConfigError, match="trust_checkpoint"):
        KapaoRepoRunner(REPO, weights, imgsz=128)
    load = torch.load
    runner = KapaoRepoRunner(REPO, weights, imgsz=128, trust_checkpoint=True)
    assert torch.load is load
    assert all(p.dtype == torch.float32 for p in runner.model.parameters())
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in runner.model.modules())   # fused
