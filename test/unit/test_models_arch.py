"""Architecture tests for the KAPAO and AGRNav model modules (CPU, random weights)."""

import numpy as np
import pytest
import torch

from robot_offload.models.agrnav import build_agrnav, synthetic_scene, voxelize
from robot_offload.models.kapao import Detect, build_kapao, symbolic_trace_kapao

pytestmark = pytest.mark.robot_side

SMALL_W, SMALL_D = 0.25, 0.33  # KAPAO-S-like multiples: same structure, fast on CPU
NO = 57  # 4 box + 1 obj + 18 classes + 34 keypoint coords


def _n_params(model):
    return sum(p.numel() for p in model.parameters())


@pytest.fixture(scope="module")
def small_kapao():
    torch.manual_seed(0)
    return build_kapao(SMALL_W, SMALL_D)


# ------------------------------------------------------------------------------------- KAPAO


def test_kapao_full_size_parameter_count():
    torch.manual_seed(0)
    model = build_kapao()  # built, never run
    n = _n_params(model)
    print(f"KAPAO-L (width 1.0, depth 1.0) parameters: {n:,}")
    assert abs(n - 77e6) <= 0.15 * 77e6
    assert not model.training
    assert model.detect.strides == (8, 16, 32, 64)
    assert [c.out_channels for c in model.head] == [3 * NO] * 4


def test_kapao_output_shapes(small_kapao):
    x = torch.rand(2, 3, 128, 192)
    with torch.no_grad():
        pred, raw = small_kapao(x)
    cells = [(128 // s, 192 // s) for s in (8, 16, 32, 64)]
    assert pred.shape == (2, 3 * sum(h * w for h, w in cells), NO)
    assert isinstance(raw, list) and len(raw) == 4
    for r, (h, w) in zip(raw, cells):
        assert r.shape == (2, 3, h, w, NO)
    assert torch.isfinite(pred).all()
    assert (pred[..., 2:4] > 0).all()  # widths/heights
    assert ((pred[..., 4:23] > 0) & (pred[..., 4:23] < 1)).all()  # objectness + 18 class scores


def test_kapao_num_keypoints_changes_channels():
    model = build_kapao(0.125, 0.33, num_keypoints=5)
    with torch.no_grad():
        pred, raw = model(torch.rand(1, 3, 64, 64))
    no = 5 + 6 + 10
    assert pred.shape == (1, 3 * (64 + 16 + 4 + 1), no)
    assert raw[-1].shape == (1, 3, 1, 1, no)


@pytest.mark.parametrize("shape", [(1, 3, 100, 128), (1, 3, 128, 96), (1, 1, 128, 128), (3, 128, 128)])
def test_kapao_rejects_bad_input(small_kapao, shape):
    with pytest.raises(ValueError):
        small_kapao(torch.rand(*shape))


def test_kapao_decode_matches_yolov5_formulas(small_kapao):
    """pred must be raw decoded as YOLOv5 Detect (inference) + KAPAO's keypoint offsets."""
    with torch.no_grad():
        pred, raw = small_kapao(torch.rand(1, 3, 128, 128))
    det = small_kapao.detect
    start = 0
    for i, (r, s) in enumerate(zip(raw, (8, 16, 32, 64))):
        _, na, ny, nx, no = r.shape
        y = r.sigmoid()
        gy, gx = torch.meshgrid(torch.arange(ny), torch.arange(nx), indexing="ij")
        g = torch.stack([gx, gy], -1).float()  # ny x nx x 2, (x, y)
        anchors = det.anchors[i].view(na, 1, 1, 2)
        xy = (y[0, ..., :2] * 2 - 0.5 + g) * s
        wh = (y[0, ..., 2:4] * 2) ** 2 * anchors
        kp = (y[0, ..., 23:].reshape(na, ny, nx, 17, 2) * 4 - 2) * anchors.unsqueeze(-2) + (g * s).unsqueeze(-2)
        expect = torch.cat([xy, wh, y[0, ..., 4:23], kp.reshape(na, ny, nx, 34)], -1).reshape(-1, no)
        got = pred[0, start : start + na * ny * nx]
        torch.testing.assert_close(got, expect)
        start += na * ny * nx
    assert start == pred.shape[1]


def test_kapao_grid_cache_built_once_then_reused(monkeypatch):
    torch.manual_seed(1)
    model = build_kapao(SMALL_W, SMALL_D)
    det = model.detect
    assert isinstance(det, Detect)
    assert all(len(c) == 0 for c in det.grid_cache)  # lazily built: nothing before the first call

    built = []
    real_meshgrid = torch.meshgrid

    def counting_meshgrid(*args, **kwargs):
        built.append(1)
        return real_meshgrid(*args, **kwargs)

    monkeypatch.setattr(torch, "meshgrid", counting_meshgrid)
    x = torch.rand(1, 3, 128, 128)
    with torch.no_grad():
        out1, _ = model(x)
    assert len(built) == 4  # one grid per scale on the first call
    assert [list(c)[0][:2] for c in det.grid_cache] == [(16, 16), (8, 8), (4, 4), (2, 2)]
    first = [next(iter(c.values())) for c in det.grid_cache]

    with torch.no_grad():
        out2, _ = model(x)
    assert len(built) == 4  # no construction on the second call
    for cache, (grid, anchor_grid) in zip(det.grid_cache, first):
        assert len(cache) == 1
        g2, a2 = next(iter(cache.values()))
        assert g2 is grid and a2 is anchor_grid  # the very same tensors
    assert torch.equal(out1, out2)

    with torch.no_grad():
        model(torch.rand(1, 3, 64, 128))  # new input size: new grids, old ones kept
    assert len(built) == 8
    assert all(len(c) == 2 for c in det.grid_cache)
    det.clear_grid_cache()
    assert all(len(c) == 0 for c in det.grid_cache)
    assert not any(k.startswith("grid") for k in model.state_dict())  # cache is not weights


def test_kapao_deterministic():
    x = torch.rand(1, 3, 128, 128, generator=torch.Generator().manual_seed(3))
    outs = []
    for _ in range(2):
        torch.manual_seed(42)
        model = build_kapao(SMALL_W, SMALL_D)
        with torch.no_grad():
            outs.append((model(x), model(x)))
    (a1, a2), (b1, b2) = outs
    for p, q in ((a1, a2), (a1, b1), (a1, b2)):
        assert torch.equal(p[0], q[0])
        assert all(torch.equal(r, s) for r, s in zip(p[1], q[1]))


def test_kapao_fx_trace_matches_eager(small_kapao):
    gm = symbolic_trace_kapao(small_kapao)
    ops = {n.target for n in gm.graph.nodes if n.op == "call_module"}
    assert "detect" in ops and "stem.conv" in ops and "up" in ops
    x = torch.rand(1, 3, 128, 128)
    with torch.no_grad():
        pred, raw = small_kapao(x)
        gpred, graw = gm(x)
    assert torch.equal(pred, gpred)
    assert all(torch.equal(a, b) for a, b in zip(raw, graw))
    with pytest.raises(ValueError):
        gm(torch.rand(1, 3, 96, 128))  # the input check survives tracing


# ------------------------------------------------------------------------------------ AGRNav

#: SCONet (github.com/jmwang0117/AGRNav, its own classes, 20 classes, grid 256 x 32 x 256):
#: parameters, and FLOPs of one frame by torch.utils.flop_counter.FlopCounterMode
SCONET_PARAMS = 646_043
SCONET_FLOPS = 67.17e9


def test_agrnav_parameter_count_is_sconets():
    torch.manual_seed(0)
    model = build_agrnav()
    n = _n_params(model)
    print(f"AGRNav (height 32, 20 classes) parameters: {n:,}")
    assert abs(n / SCONET_PARAMS - 1) < 0.05
    assert not model.training


def test_agrnav_full_size_shapes_and_compute_are_sconets():
    """SCONet's input and output at AGRNav's grid, and its compute within 15 % (counted on
    the meta device: shapes only, nothing computed)."""
    from torch.utils.flop_counter import FlopCounterMode
    torch.manual_seed(0)
    model = build_agrnav().to("meta")
    with torch.no_grad(), FlopCounterMode(display=False) as flops:
        out = model(torch.zeros(1, 1, 256, 32, 256, device="meta"))
    assert out.shape == (1, 20, 256, 32, 256)
    assert abs(flops.get_total_flops() / SCONET_FLOPS - 1) < 0.15, flops.get_total_flops()


def test_agrnav_output_shapes():
    torch.manual_seed(0)
    model = build_agrnav(height=16, num_classes=5)
    x = (torch.rand(2, 1, 32, 16, 48) > 0.9).float()
    with torch.no_grad():
        out = model(x)
    assert out.shape == (2, 5, 32, 16, 48)
    assert torch.isfinite(out).all()


def test_agrnav_rejects_bad_sizes():
    with pytest.raises(ValueError, match="multiple of 8"):
        build_agrnav(height=12)
    model = build_agrnav(height=16)
    with pytest.raises(ValueError, match="multiples of 8"):
        model(torch.zeros(1, 1, 32, 16, 36))
    with pytest.raises(ValueError, match="Z=16"):
        model(torch.zeros(1, 1, 32, 8, 32))
    for bad in (torch.zeros(1, 16, 32, 32), torch.zeros(1, 2, 32, 16, 32)):
        with pytest.raises(ValueError, match="N x 1 x X x Z x Y"):
            model(bad)


def test_agrnav_deterministic_traceable_and_input_dependent():
    """Same seed, same outputs, traced or not; another sweep gives other scores (He
    initialisation: with torch's default the scores would be the last biases whatever the
    input)."""
    x = voxelize(synthetic_scene(5), grid=(32, 32, 16))
    outs = []
    for _ in range(2):
        torch.manual_seed(7)
        model = build_agrnav(height=16, num_classes=4)
        with torch.no_grad():
            outs.append(model(x))
    gm = torch.fx.symbolic_trace(model)
    with torch.no_grad():
        outs.append(gm(x))
        other = model(voxelize(synthetic_scene(6), grid=(32, 32, 16)))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    assert (other - outs[0]).abs().mean() > 0.03 * (outs[0] - outs[0].mean()).abs().mean()


def test_criss_cross_attention_attends_to_its_row_and_column():
    """Against the definition, position by position: softmax over the energies with the
    positions of its column (itself left out) and of its row (itself once)."""
    from robot_offload.models.agrnav import CrissCrossAttention
    torch.manual_seed(3)
    cca = CrissCrossAttention(16).eval()
    with torch.no_grad():
        cca.gamma.fill_(0.7)
        x = torch.randn(2, 16, 5, 7)
        got = cca(x)
        q, k, v = cca.query(x), cca.key(x), cca.value(x)
        want = torch.empty_like(x)
        for n in range(2):
            for i in range(5):
                for j in range(7):
                    where = [(t, j) for t in range(5) if t != i] + [(i, t) for t in range(7)]
                    energy = torch.stack([q[n, :, i, j] @ k[n, :, a, b] for a, b in where])
                    weights = torch.softmax(energy, 0)
                    attended = sum(w * v[n, :, a, b] for w, (a, b) in zip(weights, where))
                    want[n, :, i, j] = 0.7 * attended + x[n, :, i, j]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_registry_agrnav_occupancy_is_a_non_empty_label():
    """The registry entry's outputs: the occupancy logit is above 0 exactly where the label
    is not class 0 (empty), and most voxels come out empty (the empty class's prior)."""
    from robot_offload.models import get_spec
    spec = get_spec("agrnav")
    x = spec.example_input(spec.test_input_size, seed=1)
    with torch.no_grad():
        out = spec.build()(x)
    assert out["occupancy"].shape == out["labels"].shape == x.shape
    assert out["labels"].dtype == torch.uint8 and int(out["labels"].max()) < 20
    occupied = out["occupancy"] > 0
    assert torch.equal(occupied, out["labels"] != 0)
    assert 0.01 < occupied.float().mean() < 0.5


# ---------------------------------------------------------------------------------- voxelize

UNIT = dict(grid=(4, 4, 2), extent=((0.0, 4.0), (0.0, 4.0), (0.0, 2.0)))  # 1 m voxels


def _occupied(v):
    """Set of (x, z, y) indices that are 1."""
    return {tuple(int(i) for i in idx) for idx in torch.nonzero(v[0, 0])}


def test_voxelize_hand_checked_points():
    pts = np.array(
        [
            [0.0, 0.0, 0.0, 0.5],  # lower corner: kept, voxel (0, 0, 0)
            [3.999, 3.999, 1.999, 0.5],  # just inside the upper corner
            [1.5, 2.5, 0.5, 0.5],
            [1.2, 2.7, 0.9, 0.1],  # same voxel as the previous one
            [1.0, 1.0, 1.0, 0.5],  # on inner voxel boundaries: the upper voxel
            [4.0, 1.0, 1.0, 0.5],  # x on the upper bound: dropped
            [1.0, 4.0, 1.0, 0.5],  # y on the upper bound: dropped
            [1.0, 1.0, 2.0, 0.5],  # z on the upper bound: dropped
            [-0.001, 1.0, 1.0, 0.5],  # below the lower bound: dropped
            [1.0, -5.0, 1.0, 0.5],
            [np.nan, 1.0, 1.0, 0.5],  # NaN / inf coordinates: dropped
            [1.0, np.inf, 1.0, 0.5],
            [2.5, 0.5, -np.inf, 0.5],
            [2.5, 0.5, 0.5, np.nan],  # NaN intensity only: kept (xyz is valid)
        ],
        dtype=np.float32,
    )
    v = voxelize(pts, **UNIT)
    assert v.dtype == torch.float32 and v.shape == (1, 1, 4, 2, 4)
    assert _occupied(v) == {(0, 0, 0), (3, 1, 3), (1, 0, 2), (1, 1, 1), (2, 0, 0)}
    assert set(v.unique().tolist()) == {0.0, 1.0}
    # N x 3 and float64 input give the same grid
    assert torch.equal(voxelize(pts[:, :3].astype(np.float64), **UNIT), v)


def test_voxelize_default_extent_bounds():
    pts = np.array(
        [
            [-10.0, -10.0, -0.1],  # lower corner (float32 values): kept
            [15.55, 15.55, 3.05],  # centre of the last voxel
            [0.05, 0.05, 0.05],  # centre of x100, y100, z1 (0.1 m voxels from AGRNav's origin)
            [15.6, 0.0, 0.5],  # upper bounds: dropped
            [0.0, 15.6, 0.5],
            [0.0, 0.0, 3.1],
            [20.0, 0.0, 0.5],  # far away: dropped
        ],
        dtype=np.float32,
    )
    v = voxelize(pts)
    assert v.shape == (1, 1, 256, 32, 256)
    assert _occupied(v) == {(0, 0, 0), (255, 31, 255), (100, 1, 100)}


def test_voxelize_empty_and_all_outside():
    for pts in (np.zeros((0, 4), np.float32), np.zeros((0, 3)), np.array([[100.0, 0.0, 0.0]])):
        v = voxelize(pts, **UNIT)
        assert v.shape == (1, 1, 4, 2, 4) and v.sum() == 0
    with pytest.raises(ValueError):
        voxelize(np.zeros((5, 2)), **UNIT)


# --------------------------------------------------------------------------- synthetic scene


def test_synthetic_scene_deterministic_per_seed():
    a, b, c = synthetic_scene(3), synthetic_scene(3), synthetic_scene(4)
    assert a.shape == (20000, 4) and a.dtype == np.float32
    assert np.array_equal(a, b)
    assert not np.array_equal(a, c)
    assert np.isfinite(a).all()
    assert synthetic_scene(0, 777).shape == (777, 4)
    assert synthetic_scene(0, 0).shape == (0, 4)
    # a plausible scene: most points inside the default extent, ground the densest height slice
    v = voxelize(a)
    per_slice = v[0, 0].sum(dim=(0, 2))
    assert v.sum() > 2000
    assert int(per_slice.argmax()) in (0, 1, 2)
    assert ((a[:, 3] >= 0) & (a[:, 3] <= 1)).all()  # intensity in [0, 1]
