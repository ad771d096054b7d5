"""AGRNav application, pure part: voxel centres are the exact inverse of ``voxelize``
(hand-computed centres, axis order, round trips), occupied-voxel extraction, the indices
AGRNav's planner reads, and the moving synthetic LiDAR."""

import math

import numpy as np
import pytest
import torch

from robot_offload.apps.occupancy import (AGRNAV_PLANNER_TOPIC, LidarConfig, OccupancyConfig, SyntheticSweeps,
                                          occupied_mask, occupied_voxels, planner_indices, quaternion_matrix, voxel_centres,
                                          voxel_size)
from robot_offload.errors import ConfigError
from robot_offload.models.agrnav import DEFAULT_EXTENT, synthetic_scene, voxelize

pytestmark = pytest.mark.robot_side

DEFAULT = (256, 256, 32)  # X, Y, Z: AGRNav's 0.1 m voxels on every axis over the default extent
ODD = (32, 16, 8)         # 0.8 m forward, 1.6 m lateral, 0.4 m vertical


def all_indices(grid):
    nx, ny, nz = grid
    return np.argwhere(np.ones((nx, nz, ny), dtype=bool))  # (x, z, y) rows


@pytest.mark.parametrize("grid, xzy, xyz", [
    (DEFAULT, (0, 0, 0), (-9.95, -9.95, -0.05)),       # first voxel: lower corner + half a voxel
    (DEFAULT, (255, 31, 255), (15.55, 15.55, 3.05)),   # last voxel
    (DEFAULT, (121, 19, 64), (2.15, -3.55, 1.85)),
    (ODD, (3, 2, 5), (-7.2, -1.2, 0.9)),               # x=3 -> -10 + 3.5*0.8; y=5 -> -10 + 5.5*1.6; z=2 -> -0.1 + 2.5*0.4
    (ODD, (31, 7, 0), (15.2, -9.2, 2.9)),
])
def test_voxel_centres_hand_computed(grid, xzy, xyz):
    np.testing.assert_allclose(voxel_centres(np.array([xzy]), grid), [xyz], atol=1e-9)


def test_voxel_size():
    np.testing.assert_allclose(voxel_size(DEFAULT), [0.1, 0.1, 0.1])
    np.testing.assert_allclose(voxel_size(ODD), [0.8, 1.6, 0.4])
    np.testing.assert_allclose(voxel_size((4, 4, 4), ((0, 4), (0, 8), (-1, 1))), [1.0, 2.0, 0.5])


def test_axis_order_matches_voxelize():
    # One voxel set at tensor index [0, 0, x=3, z=2, y=5] of an X x Z x Y = 32 x 8 x 16 grid ...
    occ = torch.full((1, 1, 32, 8, 16), -5.0)
    occ[0, 0, 3, 2, 5] = 3.0
    labels = torch.zeros((1, 1, 32, 8, 16), dtype=torch.uint8)
    labels[0, 0, 3, 2, 5] = 7
    xyz, lab = occupied_voxels({"occupancy": occ, "labels": labels})
    # ... is the point x=-7.2 m forward, y=-1.2 m lateral, z=0.9 m up ...
    np.testing.assert_allclose(xyz, [[-7.2, -1.2, 0.9]], atol=1e-6)
    assert xyz.dtype == np.float32 and lab.dtype == np.float32 and lab.tolist() == [7.0]
    # ... and voxelize puts that point back at the same tensor index.
    grid = voxelize(xyz, grid=ODD)
    assert grid.shape == (1, 1, 32, 8, 16) and grid.sum() == 1 and grid[0, 0, 3, 2, 5] == 1


@pytest.mark.parametrize("grid", [DEFAULT, ODD, (32, 32, 32), (8, 24, 3)])
def test_round_trip_every_voxel(grid):
    centres = voxel_centres(all_indices(grid), grid)
    for dtype in (np.float64, np.float32):  # float32: what the published cloud carries
        occ = voxelize(centres.astype(dtype), grid=grid)
        assert torch.all(occ == 1), f"{dtype}: {int((occ == 0).sum())} voxels lost"


def test_round_trip_subset_and_custom_extent():
    rng = np.random.default_rng(0)
    grid, extent = (40, 24, 10), ((-5.0, 15.0), (-3.0, 9.0), (0.0, 2.5))
    want = torch.from_numpy(rng.random((1, 1, 40, 10, 24)) < 0.1).float()
    xyz, _ = occupied_voxels({"occupancy": want * 2 - 1, "labels": torch.zeros_like(want, dtype=torch.uint8)},
                             extent=extent)
    assert len(xyz) == int(want.sum())
    assert torch.equal(voxelize(xyz, grid=grid, extent=extent), want)


def test_points_land_within_half_a_voxel_of_their_centre():
    rng = np.random.default_rng(1)
    lo, hi = np.array(DEFAULT_EXTENT).T
    pts = (lo + rng.random((300, 3)) * (hi - lo)).astype(np.float32)
    occ = voxelize(pts, grid=ODD)
    centres, _ = occupied_voxels({"occupancy": occ * 2 - 1, "labels": torch.zeros_like(occ, dtype=torch.uint8)})
    half = voxel_size(ODD) / 2 + 1e-5
    inside = np.all(np.abs(pts[:, None, :] - centres[None, :, :]) <= half, axis=2)
    assert np.all(inside.sum(axis=1) == 1), "every point lies in exactly one occupied voxel"


def test_threshold_is_strict_and_labels_follow():
    occ = torch.tensor([0.0, 0.5, -1.0, 2.0, 1e-6, -1e-6, 0.0, 3.0]).repeat(4).reshape(1, 1, 8, 1, 4)  # X=8, Z=1, Y=4
    labels = torch.arange(32, dtype=torch.uint8).reshape(1, 1, 8, 1, 4)
    xyz, lab = occupied_voxels({"occupancy": occ, "labels": labels}, threshold_logit=0.0,
                               extent=((0, 8), (0, 4), (0, 1)))
    keep = (occ[0, 0, :, 0] > 0).numpy()
    assert len(xyz) == keep.sum()
    np.testing.assert_array_equal(lab, labels[0, 0, :, 0].numpy()[keep].astype(np.float32))
    ix, iy = np.nonzero(keep)
    np.testing.assert_allclose(xyz, np.c_[ix + 0.5, iy + 0.5, np.full(len(ix), 0.5)])
    assert len(occupied_voxels({"occupancy": occ, "labels": labels}, threshold_logit=0.5)[0]) == (occ > 0.5).sum()


def test_empty_result_gives_no_points():
    occ = torch.full((1, 1, 32, 32, 32), -1.0)
    xyz, lab = occupied_voxels({"occupancy": occ, "labels": torch.zeros_like(occ, dtype=torch.uint8)})
    assert xyz.shape == (0, 3) and lab.shape == (0,)


def test_agrnav_output_end_to_end():
    from robot_offload.models.registry import get_spec
    spec = get_spec("agrnav")
    out = spec.build()(spec.example_input(spec.test_input_size))
    xyz, lab = occupied_voxels(out)
    assert 0 < len(xyz) == int((out["occupancy"] > 0).sum()) and np.all((lab >= 1) & (lab < 20))
    assert torch.equal(voxelize(xyz, grid=spec.test_input_size), (out["occupancy"] > 0).float())


@pytest.mark.parametrize("outputs, match", [
    ({"occupancy": torch.zeros(1, 1, 8, 2, 8)}, "labels"),
    ([torch.zeros(1, 1, 8, 2, 8)], "occupancy"),
    ({"occupancy": torch.zeros(2, 1, 8, 2, 8), "labels": torch.zeros(2, 1, 8, 2, 8)}, "batch"),
    ({"occupancy": torch.zeros(1, 3, 8, 2, 8), "labels": torch.zeros(1, 3, 8, 2, 8)}, "channels"),
    ({"occupancy": torch.zeros(1, 1, 8, 2, 8), "labels": torch.zeros(1, 1, 8, 2, 4)}, "shape"),
    ({"occupancy": torch.zeros(8, 8), "labels": torch.zeros(8, 8)}, "X x Z x Y"),
    ({"occupancy": torch.zeros(1, 2, 8, 8), "labels": torch.zeros(1, 2, 8, 8)}, "X x Z x Y"),  # not N x Z x X x Y
])
def test_malformed_results_are_refused(outputs, match):
    with pytest.raises(ValueError, match=match):
        occupied_voxels(outputs)


def test_configured_grid_must_match_and_config_validates():
    out = {"occupancy": torch.zeros(1, 1, 32, 16, 32), "labels": torch.zeros(1, 1, 32, 16, 32, dtype=torch.uint8)}
    occupied_voxels(out, grid=(32, 32, 16))
    with pytest.raises(ValueError, match="grid"):
        occupied_voxels(out, grid=(32, 16, 32))
    cfg = OccupancyConfig(extent=([-10, 15.6], [-10, 15.6], [-0.1, 3.1]), grid=(32, 32, 16)).validate()
    assert cfg.extent == DEFAULT_EXTENT and cfg.grid == (32, 32, 16)
    assert OccupancyConfig().validate().extent == DEFAULT_EXTENT
    for bad in (dict(extent=((0, 1), (0, 1))), dict(extent=((1, 0), (0, 1), (0, 1))),
                dict(grid=(32, 32)), dict(grid=(0, 8, 8)), dict(threshold_logit=float("nan"))):
        with pytest.raises(ConfigError):
            OccupancyConfig(**bad).validate()
    with pytest.raises(ValueError, match="outside"):
        voxel_centres(np.array([[0, 16, 0]]), (32, 32, 16))


# ----------------------------------------------------------------------------- AGRNav's planner


PLANNER = dict(planner_voxel_m=0.1, planner_origin=(-10.0, -10.0, -0.1), planner_grid=(200, 200, 50))


def test_planner_defaults_are_agrnavs():
    c = OccupancyConfig().validate()
    assert c.planner_topic == AGRNAV_PLANNER_TOPIC == "/non_intersection_coordinates"
    assert (c.planner_frame, c.planner_voxel_size, c.planner_origin, c.planner_grid) == (
        "world", 0.1, (-10.0, -10.0, -0.1), (200, 200, 50))
    assert OccupancyConfig(planner_topic="").validate().planner_topic == ""
    for bad in (dict(planner_frame="/world"), dict(planner_frame=""), dict(planner_voxel_size=0),
                dict(planner_voxel_size=float("nan")), dict(planner_origin=(0, 0)), dict(planner_grid=(10, 10)),
                dict(planner_topic="a b"), dict(sync_queue_size=0), dict(sync_slop_s=2.0)):
        with pytest.raises(ConfigError):
            OccupancyConfig(**bad).validate()


def test_quaternion_matrix():
    np.testing.assert_allclose(quaternion_matrix(0, 0, 0, 1), np.eye(3))
    yaw = quaternion_matrix(0, 0, math.sin(math.pi / 4), math.cos(math.pi / 4))  # 90 deg about z
    np.testing.assert_allclose(yaw @ [1, 0, 0], [0, 1, 0], atol=1e-12)
    np.testing.assert_allclose(quaternion_matrix(0, 0, 2, 2), yaw, atol=1e-12)  # normalised
    for bad in ((0, 0, 0, 0), (float("nan"), 0, 0, 1)):
        with pytest.raises(ValueError):
            quaternion_matrix(*bad)


def one_voxel(grid, xzy):
    nx, ny, nz = grid
    occ = np.zeros((nx, nz, ny), dtype=bool)
    occ[xzy] = True
    return occ


def test_planner_indices_by_hand():
    # Model: 0.2 m voxels over x, y, z in [0, 0.4); the voxel at x, y, z = 0..0.2 holds the
    # planner cells 100..101, 100..101 and (0.05 + 0.1) / 0.1 -> 1..2 (origin z -0.1).
    extent = ((0.0, 0.4), (0.0, 0.4), (0.0, 0.4))
    occ = one_voxel((2, 2, 2), (0, 0, 0))
    idx = planner_indices(occ, extent, np.eye(3), (0, 0, 0), **PLANNER)
    assert idx.tolist() == [[x, y, z] for x in (100, 101) for y in (100, 101) for z in (1, 2)]
    # Sensor at (1, 2, 0.5) in the planner's frame, turned 90 deg about z: its x 0..0.2 is
    # the planner's y 2..2.2, its y 0..0.2 the planner's x 0.8..1.
    rot = quaternion_matrix(0, 0, math.sin(math.pi / 4), math.cos(math.pi / 4))
    idx = planner_indices(occ, extent, rot, (1.0, 2.0, 0.5), **PLANNER)
    assert idx.tolist() == [[x, y, z] for x in (108, 109) for y in (120, 121) for z in (6, 7)]
    # Outside the planner's map (it ends at x = 10 m): nothing.
    assert planner_indices(occ, extent, np.eye(3), (10.0, 0, 0), **PLANNER).shape == (0, 3)
    assert planner_indices(occ, extent, np.eye(3), (9.9, 0, 0), **PLANNER)[:, 0].tolist() == [199] * 4
    assert planner_indices(np.zeros((2, 2, 2)), extent, np.eye(3), (0, 0, 0), **PLANNER).shape == (0, 3)
    with pytest.raises(ValueError):
        planner_indices(np.zeros((2, 2)), extent, np.eye(3), (0, 0, 0), **PLANNER)


@pytest.mark.parametrize("yaw", [0.0, 0.5])
def test_planner_indices_are_the_cells_centred_in_occupied_voxels(yaw):
    grid = (32, 32, 16)  # 0.8 x 0.8 x 0.2 m voxels over the default extent
    rng = np.random.default_rng(2)
    occ = rng.random((32, 16, 32)) < 0.02
    rot = quaternion_matrix(0, 0, math.sin(yaw / 2), math.cos(yaw / 2))
    t = np.array([-5.0, 0.3, 1.0])
    idx = planner_indices(occ, DEFAULT_EXTENT, rot, t, **PLANNER)
    # brute force over the whole planner map, in voxelize's half-open voxels
    cells = np.argwhere(np.ones((200, 200, 50), dtype=bool))
    sensor = (np.array(PLANNER["planner_origin"]) + (cells + 0.5) * 0.1 - t) @ rot
    m = np.floor((sensor - np.array(DEFAULT_EXTENT)[:, 0]) / voxel_size(grid)).astype(int)
    ok = np.all((m >= 0) & (m < np.array(grid)), axis=1)
    want = cells[ok][occ[m[ok, 0], m[ok, 2], m[ok, 1]]]
    assert len(want) > 1000
    np.testing.assert_array_equal(idx, want)


def test_exclude_keeps_only_what_the_sweep_did_not_see():
    occ = torch.full((1, 1, 4, 2, 4), -1.0)  # X x Z x Y = 4 x 2 x 4
    occ[0, 0, 1, 0, 1] = occ[0, 0, 2, 1, 3] = occ[0, 0, 3, 0, 0] = 1.0
    seen = torch.zeros((1, 1, 4, 2, 4))
    seen[0, 0, 1, 0, 1] = 1.0  # observed and predicted: left out
    seen[0, 0, 0, 1, 0] = 1.0  # observed only: not predicted anyway
    out = {"occupancy": occ, "labels": torch.zeros_like(occ, dtype=torch.uint8)}
    mask, _ = occupied_mask(out)
    predicted, _ = occupied_mask(out, exclude=seen)
    assert mask.sum() == 3 and np.argwhere(predicted).tolist() == [[2, 1, 3], [3, 0, 0]]
    with pytest.raises(ValueError, match="exclude"):
        occupied_mask(out, exclude=torch.zeros((1, 1, 4, 2, 3)))


def test_synthetic_sweeps_move_obstacles_deterministically():
    cfg = LidarConfig(seed=3, n_points=5000, rate_hz=10.0, amplitude_m=2.0, period_s=8.0)
    a, b = SyntheticSweeps(cfg), SyntheticSweeps(cfg)
    first = a.read()
    assert first.dtype == np.float32 and first.shape == (5000, 4)
    np.testing.assert_array_equal(first, synthetic_scene(3, 5000))  # sweep 0 = the scene as generated
    for _ in range(19):
        a.read()
    quarter = a.read()  # sweep 20 at 10 Hz: t = 2 s, a quarter of the 8 s period
    np.testing.assert_array_equal(quarter, b.sweep(20))  # by index, not by wall clock
    moving = a.moving
    assert 0.3 < moving.mean() < 0.6  # boxes, poles and vegetation above a ~half-ground scene
    np.testing.assert_array_equal(quarter[~moving], first[~moving])  # the ground stays
    np.testing.assert_allclose(quarter[moving, 1] - first[moving, 1], 2.0, atol=1e-5)
    np.testing.assert_allclose(quarter[moving, 0] - first[moving, 0], 0.0, atol=1e-5)
    np.testing.assert_array_equal(quarter[:, 2:], first[:, 2:])
    assert not torch.equal(voxelize(quarter, grid=(32, 32, 16)), voxelize(first, grid=(32, 32, 16)))


def test_lidar_config_refusals():
    for bad in (dict(source="/dev/velodyne"), dict(rate_hz=0), dict(period_s=-1), dict(n_points=-5)):
        with pytest.raises(ConfigError):
            LidarConfig(**bad).validate()
