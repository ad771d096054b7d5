"""Camera sources, message conversions and the status-code mirror (no master needed)."""

import numpy as np
import pytest
import torch

from robot_offload import codec
from robot_offload.camera import (FolderSource, NaturalSource, SyntheticSource, VideoSource,
                                  natural_image, open_source)
from robot_offload.errors import ConfigError
from robot_offload.protocol import StatusCode

pytestmark = pytest.mark.robot_side


def test_synthetic_source_is_deterministic_and_moves():
    a, b = SyntheticSource(64, 48, seed=3), SyntheticSource(64, 48, seed=3)
    f0, g0 = a.read(), b.read()
    assert f0.shape == (48, 64, 3) and f0.dtype == np.uint8
    assert np.array_equal(f0, g0)
    assert not np.array_equal(a.read(), f0)
    with pytest.raises(ConfigError):
        SyntheticSource(0, 10)


def test_natural_images_have_a_photographs_statistics():
    """natural_image: deterministic per seed; power falling with spatial frequency (1/f
    amplitude: the low band holds far more than the high band); colour channels sharing
    most of their structure; and, under the codec, int8 + zstd shrinking it a little
    (noise-free flat patterns shrink 10x or more, uniform noise not at all)."""
    a = natural_image(128, 160, seed=5)
    assert a.shape == (128, 160, 3) and a.dtype == np.uint8
    assert np.array_equal(a, natural_image(128, 160, seed=5))
    assert not np.array_equal(a, natural_image(128, 160, seed=6))
    lum = a.astype(np.float64).mean(axis=2)
    power = np.abs(np.fft.rfft2(lum - lum.mean())) ** 2
    f = np.hypot(np.fft.rfftfreq(160)[None, :], np.fft.fftfreq(128)[:, None])
    low, high = power[(f > 0) & (f < 0.05)].mean(), power[f > 0.4].mean()
    assert low > 100 * high, (low, high)
    r, g, b = (a[:, :, c].astype(np.float64).ravel() for c in range(3))
    assert np.corrcoef(r, g)[0, 1] > 0.7 and np.corrcoef(g, b)[0, 1] > 0.7
    x = torch.from_numpy(a).permute(2, 0, 1).float()
    ratio = x.numel() * 4 / len(codec.encode(x, "x", "int8", "zstd").data)
    assert 4.05 < ratio < 6.0, ratio
    src = open_source("natural", 32, 24, seed=2)
    assert isinstance(src, NaturalSource)
    f0, f1 = src.read(), src.read()
    assert f0.shape == (24, 32, 3) and not np.array_equal(f0, f1)
    assert np.array_equal(f0, natural_image(24, 32, seed=2))
    with pytest.raises(ConfigError):
        natural_image(0, 4)


def test_folder_and_video_sources(tmp_path):
    cv2 = pytest.importorskip("cv2")
    frames = [np.full((24, 32, 3), 40 * i, np.uint8) for i in range(3)]
    for i, f in enumerate(frames):
        cv2.imwrite(str(tmp_path / f"{i:03d}.png"), f[:, :, ::-1])
    src = open_source(str(tmp_path))
    assert isinstance(src, FolderSource)
    got = [src.read() for _ in range(4)]
    assert np.array_equal(got[1], frames[1]) and np.array_equal(got[3], frames[0])  # loops
    once = FolderSource(str(tmp_path), loop=False)
    assert [once.read() is None for _ in range(4)] == [False, False, False, True]

    video = str(tmp_path / "v.avi")
    w = cv2.VideoWriter(video, cv2.VideoWriter_fourcc(*"MJPG"), 10, (32, 24))
    for f in frames:
        w.write(f[:, :, ::-1])
    w.release()
    vs = open_source(video)
    assert isinstance(vs, VideoSource)
    first = vs.read()
    assert first.shape == (24, 32, 3) and abs(int(first.mean()) - 0) < 8
    with pytest.raises(ConfigError):
        open_source(str(tmp_path / "nothing-here"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError):
        FolderSource(str(tmp_path / "empty"))


def test_status_codes_mirror_the_message():
    from robot_offload.msg import Status
    for code in StatusCode:
        assert getattr(Status, code.name) == int(code)


def test_tensor_message_round_trip_through_serialisation():
    from io import BytesIO
    from robot_offload.msg import Tensor
    from robot_offload.ros.conversions import tensor_from_msg, tensor_to_msg
    x = torch.randn(2, 3)
    msg = tensor_to_msg(codec.encode(x, "x", "float16", "zstd"))
    buf = BytesIO()
    msg.serialize(buf)
    back = Tensor()
    back.deserialize(buf.getvalue())
    torch.testing.assert_close(codec.decode(tensor_from_msg(back)), x, rtol=codec.RTOL["float16"], atol=1e-6)


def test_every_compute_request_field_survives_the_service_message():
    import dataclasses
    from io import BytesIO
    from robot_offload.protocol import ComputeRequest
    from robot_offload.ros.conversions import compute_req_from_srv, compute_req_to_srv
    from robot_offload.srv import ComputeRequest as ComputeSrvReq
    req = ComputeRequest(client_id="r1", model="resnet18", entry="forward",
                         tensors=[codec.encode(torch.ones(2), "x")], args_json='{"a": 1}', session="s",
                         output_codec="float16", output_compression="zstd", auth="v2:token",
                         deadline_s=1.5, request_id="00112233aabbccdd")
    assert all(getattr(req, f.name) != f.default for f in dataclasses.fields(req)
               if f.default is not dataclasses.MISSING), "give every field a value of its own"
    buf = BytesIO()
    compute_req_to_srv(req).serialize(buf)
    msg = ComputeSrvReq()
    msg.deserialize(buf.getvalue())
    assert compute_req_from_srv(msg) == req


def test_stats_message_carries_the_backends_detail_as_json():
    """``InferenceStats.detail_json``: a backend's own figures (``FrameStats.extra``)
    survive serialisation; values JSON does not know become strings; too much is cut to
    an object that says so, never to broken JSON."""
    import json
    from io import BytesIO
    from std_msgs.msg import Header
    from robot_offload.msg import InferenceStats
    from robot_offload.ros.conversions import DETAIL_JSON_MAX, stats_to_msg
    from robot_offload.stats import FrameStats
    stats = FrameStats()
    stats.extra["lop"] = {"robot_stripe_s": 0.0123, "spatial": True, "device": torch.device("cpu")}
    msg = stats_to_msg(stats, Header(), 0.5, (1, 1, 0, 0))
    buf = BytesIO()
    msg.serialize(buf)
    back = InferenceStats()
    back.deserialize(buf.getvalue())
    detail = json.loads(back.detail_json)
    assert detail["lop"]["robot_stripe_s"] == 0.0123 and detail["lop"]["spatial"] is True
    assert detail["lop"]["device"] == "cpu"
    assert json.loads(stats_to_msg(FrameStats(), Header(), 0.5, (1, 1, 0, 0)).detail_json) == {}
    stats.extra["transparent"] = {"ops": ["x" * 100] * 200}
    big = stats_to_msg(stats, Header(), 0.5, (1, 1, 0, 0)).detail_json
    assert len(big) <= DETAIL_JSON_MAX
    assert json.loads(big) == {"truncated": True, "bytes": json.loads(big)["bytes"], "keys": ["lop", "transparent"]}
    assert json.loads(big)["bytes"] > DETAIL_JSON_MAX


def test_pointcloud2_round_trip():
    from std_msgs.msg import Header
    from robot_offload.ros.conversions import pointcloud2_to_xyzi, xyzi_to_pointcloud2
    pts = np.array([[1, 2, 3, 0.5], [-1, 0, 0.25, 1.0]], dtype=np.float32)
    msg = xyzi_to_pointcloud2(pts, Header(frame_id="lidar"), [("label", np.array([3, 7], np.float32))])
    assert [f.name for f in msg.fields] == ["x", "y", "z", "intensity", "label"]
    assert np.array_equal(pointcloud2_to_xyzi(msg), pts)
    msg.data = msg.data[:-4]
    with pytest.raises(ValueError):
        pointcloud2_to_xyzi(msg)


def test_pinhole_and_synthetic_depth():
    import math
    from robot_offload.camera import pinhole_k
    k = pinhole_k(640, 480, 90.0)
    assert k[0] == k[4] == pytest.approx(320.0)         # f = w / (2 tan 45 deg)
    assert (k[2], k[5], k[8]) == (319.5, 239.5, 1.0)
    src = SyntheticSource(64, 48, seed=1)
    img = src.read()
    depth = src.depth_m(3.0, 2.0)
    assert depth.dtype == np.float32 and depth.shape == (48, 64)
    assert set(np.unique(depth)) <= {2.0, 3.0} and (depth == 2.0).any()
    # the near pixels are exactly the painted squares (their colour differs from the ramp)
    cx, cy, s = src._rects[-1]
    assert np.all(depth[cy:cy + s, cx:cx + s] == 2.0)
    assert math.isclose(float(depth[depth == 3.0].mean()), 3.0)
    del img
