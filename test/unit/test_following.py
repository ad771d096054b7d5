"""Person following, the pure part: the standoff goal, the goal gate, the configuration,
and drawing people on an image."""

import dataclasses
import math

import numpy as np
import pytest

from robot_offload.apps.annotate import KEYPOINT_RGB, OTHER_RGB, TARGET_RGB, DrawnPerson, draw_people
from robot_offload.apps.following import (FollowConfig, Goal, GoalGate, check_frame_id, standoff_goal,
                                          yaw_quaternion)
from robot_offload.errors import ConfigError


# ----------------------------------------------------------------------------- goal geometry


@pytest.mark.parametrize("person, robot", [((5.0, 0.0), (0.0, 0.0)), ((1.0, 6.7), (1.0, 2.5)),
                                           ((-3.0, 4.0), (2.0, -1.0)), ((0.3, 0.4), (0.0, 0.0))])
def test_goal_is_standoff_from_the_person_on_the_line_to_the_robot_facing_them(person, robot):
    g = standoff_goal(person, robot, 2.5, z=0.1)
    p, r, q = np.array(person), np.array(robot), np.array([g.x, g.y])
    assert np.linalg.norm(q - p) == pytest.approx(2.5)
    # on the person-robot line, on the robot's side of the person
    d = (r - p) / np.linalg.norm(r - p)
    assert np.dot(q - p, d) == pytest.approx(2.5)
    # facing the person
    assert math.atan2(p[1] - q[1], p[0] - q[0]) == pytest.approx(g.yaw)
    assert g.z == 0.1


def test_goal_by_hand():
    assert standoff_goal((5.0, 0.0), (0.0, 0.0), 2.0) == pytest.approx(Goal(3.0, 0.0, 0.0, 0.0))
    g = standoff_goal((1.0, 6.7), (1.0, 2.5), 2.5)  # person straight "north" of the robot
    assert (g.x, g.y, g.yaw) == pytest.approx((1.0, 4.2, math.pi / 2))
    g = standoff_goal((0.0, 0.0), (1.0, 0.0), 2.0)  # too close: back off to 2 m, still facing them
    assert (g.x, g.y, abs(g.yaw)) == pytest.approx((2.0, 0.0, math.pi))
    assert standoff_goal((1.0, 1.0), (1.0, 1.0), 2.0) is None  # no direction
    assert standoff_goal((1.0, 1.0), (1.0 + 1e-4, 1.0), 2.0) is None


def test_goal_refuses_non_finite_input():
    for bad in [(float("nan"), 0.0), (0.0, float("inf")), (1.0,)]:
        with pytest.raises(ValueError):
            standoff_goal(bad, (0.0, 0.0), 1.0)
        with pytest.raises(ValueError):
            standoff_goal((3.0, 0.0), bad, 1.0)
    for bad in [-1.0, float("nan")]:
        with pytest.raises(ValueError):
            standoff_goal((3.0, 0.0), (0.0, 0.0), bad)


def test_yaw_quaternion():
    for yaw in (0.0, 0.7, -2.0, math.pi):
        x, y, z, w = yaw_quaternion(yaw)
        assert x == y == 0.0 and z * z + w * w == pytest.approx(1.0)
        assert 2 * math.atan2(z, w) == pytest.approx(yaw)


# ----------------------------------------------------------------------------- goal gate


def test_gate_sends_first_then_only_real_changes_at_most_every_interval():
    gate = GoalGate(FollowConfig(min_goal_move_m=0.2, min_goal_turn_rad=0.3, min_interval_s=1.0).validate())
    assert gate.offer(Goal(1.0, 0.0, 0.0, 0.0), 10.0)
    assert not gate.offer(Goal(3.0, 0.0, 0.0, 0.0), 10.5)  # a big move, but too soon
    assert not gate.offer(Goal(1.1, 0.0, 0.0, 0.1), 12.0)  # late enough, but too small
    assert gate.last == Goal(1.0, 0.0, 0.0, 0.0)  # refusals are not remembered
    assert gate.offer(Goal(1.0, 0.25, 0.0, 0.0), 12.0)  # moved 0.25 m
    assert gate.offer(Goal(1.0, 0.25, 0.0, 0.35), 13.0)  # turned 0.35 rad
    assert not gate.offer(Goal(1.0, 0.25, 0.0, 0.35 - 2 * math.pi), 14.0)  # the same heading
    gate.reset()
    assert gate.offer(Goal(1.0, 0.25, 0.0, 0.35), 14.0)
    assert gate.offer(Goal(1.0, 0.25, 0.0, 0.35), 3.0)  # time jumped back: starts over


# ----------------------------------------------------------------------------- configuration


def test_config_defaults_and_refusals():
    c = FollowConfig().validate()
    assert (c.fixed_frame, c.robot_frame, c.standoff_m, c.enabled) == ("map", "base_link", 2.5, False)
    assert isinstance(FollowConfig(standoff_m=2).validate().standoff_m, float)
    bad = [dict(fixed_frame=""), dict(fixed_frame="/map"), dict(robot_frame="base link"),
           dict(fixed_frame="base_link"), dict(standoff_m=-1.0), dict(standoff_m=float("nan")),
           dict(min_interval_s="1"), dict(min_goal_move_m=True), dict(enabled="yes"),
           dict(sync_queue_size=0), dict(sync_queue_size=2.5), dict(sync_slop_s=1.5),
           dict(tf_timeout_s=float("inf"))]
    for kwargs in bad:
        with pytest.raises(ConfigError):
            dataclasses.replace(FollowConfig(), **kwargs).validate()
    assert check_frame_id("x", "odom") == "odom"


# ----------------------------------------------------------------------------- drawing


def _person(x0, y0, x1, y1, conf=0.9):
    u = np.linspace(x0 + 5, x1 - 5, 17)
    v = np.linspace(y0 + 5, y1 - 5, 17)
    return DrawnPerson(box_xyxy=(x0, y0, x1, y1), keypoints=np.stack([u, v, np.full(17, conf)], axis=1), score=0.8)


def test_draw_people_marks_target_others_and_keypoints():
    img = np.zeros((240, 320, 3), dtype=np.uint8)
    people = [_person(20, 30, 100, 200), _person(180, 40, 300, 220)]
    out = draw_people(img, people, target_index=1, track_id=7, track_status="tracking")
    assert out.shape == img.shape and out.dtype == np.uint8 and not img.any()  # input untouched

    def has(colour, region):
        y0, y1, x0, x1 = region
        return bool(np.all(out[y0:y1, x0:x1] == colour, axis=-1).any())
    assert has(TARGET_RGB, (40, 220, 175, 185))  # the target's left box edge
    assert has(OTHER_RGB, (30, 200, 15, 25))  # the other's left box edge
    assert not has(TARGET_RGB, (0, 240, 0, 160))
    u, v = people[0].keypoints[8, :2].astype(int)
    assert has(KEYPOINT_RGB, (v - 2, v + 3, u - 2, u + 3))


def test_draw_people_skips_low_confidence_and_hostile_values():
    img = np.zeros((120, 160, 3), dtype=np.uint8)
    faint = _person(10, 10, 100, 100, conf=0.1)
    assert not np.array_equal(draw_people(img, [faint]), img)  # the box is drawn
    faint_box_only = draw_people(img, [faint])
    assert not np.all(faint_box_only == KEYPOINT_RGB, axis=-1).any()  # no keypoints
    hostile = DrawnPerson(box_xyxy=(float("nan"), 0, 1e30, -1e30),
                          keypoints=np.array([[np.inf, 1, 1.0], [1e30, -1e30, 1.0], [5, 5, np.nan]]))
    out = draw_people(img, [hostile], target_index=0)
    assert out.shape == img.shape
    with pytest.raises(ValueError):
        draw_people(np.zeros((10, 10), dtype=np.uint8), [])


def test_pairing_parameters_are_bounded():
    from robot_offload.frames import check_pairing
    assert check_pairing(30, 0.01) == (30, 0.01) and check_pairing(1, 0) == (1, 0.0)
    for queue, slop in [(0, 0.01), (1001, 0.01), (2.0, 0.01), (True, 0.01), ("30", 0.01),
                        (30, -0.1), (30, 1.0), (30, float("nan")), (30, "0.01"), (30, True)]:
        with pytest.raises(ConfigError):
            check_pairing(queue, slop)
