"""Person following, the pure part: where to send the robot for a tracked person, and
when a new goal is worth sending (no rospy; :mod:`robot_offload.ros.follower_node` wraps it).

Geometry is planar, in a fixed frame (``map`` or ``odom``), x and y in metres, yaw in
radians about z (REP 103). The goal lies on the line from the person to the robot, at
``standoff_m`` from the person, facing the person: a robot farther away drives up to
that distance, a nearer one backs off to it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence, Tuple

from robot_offload.errors import ConfigError
from robot_offload.frames import check_pairing

__all__ = ["FollowConfig", "Goal", "standoff_goal", "yaw_quaternion", "GoalGate", "check_frame_id"]

#: below this horizontal distance (m) the robot is "on" the person: no direction to face
MIN_SEPARATION_M = 1e-3


def check_frame_id(name: str, value) -> str:
    """A TF frame id: a non-empty string without a leading slash (tf2 refuses those) or blanks."""
    if not isinstance(value, str) or not value or value.startswith("/") or any(c.isspace() for c in value):
        raise ConfigError(f"{name} must be a TF frame id (non-empty, no leading '/', no blanks), got {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class FollowConfig:
    """person_follower's parameters (``~name``)."""

    fixed_frame: str = "map"  # goals and the person's position are in this frame (map or odom)
    robot_frame: str = "base_link"
    standoff_m: float = 2.5  # distance kept from the person (m)
    min_goal_move_m: float = 0.2  # a new goal only when it moved this far ...
    min_goal_turn_rad: float = 0.3  # ... or turned this much
    min_interval_s: float = 1.0  # and at most one goal per this many seconds
    enabled: bool = False  # follow from the start; else after ~enable true
    tf_timeout_s: float = 0.5  # wait this long for the frame's transforms
    sync_queue_size: int = 60  # images kept while their People are awaited (annotation)
    sync_slop_s: float = 0.01  # stamps this close are the same frame (s)

    def validate(self) -> "FollowConfig":
        check_frame_id("fixed_frame", self.fixed_frame)
        check_frame_id("robot_frame", self.robot_frame)
        if self.fixed_frame == self.robot_frame:
            raise ConfigError(f"fixed_frame and robot_frame must differ, both are {self.fixed_frame!r}")
        numbers = {f: getattr(self, f) for f in ("standoff_m", "min_goal_move_m", "min_goal_turn_rad",
                                                  "min_interval_s", "tf_timeout_s", "sync_slop_s")}
        for name, value in numbers.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ConfigError(f"{name} must be a finite number >= 0, got {value!r}")
        if not isinstance(self.enabled, bool):
            raise ConfigError(f"enabled must be true or false, got {self.enabled!r}")
        check_pairing(self.sync_queue_size, self.sync_slop_s)
        return dataclasses.replace(self, **{k: float(v) for k, v in numbers.items()})


@dataclasses.dataclass(frozen=True)
class Goal:
    """A planar goal pose in the fixed frame."""

    x: float
    y: float
    z: float
    yaw: float


def _finite_xy(name: str, p: Sequence[float]) -> Tuple[float, float]:
    if len(p) < 2:
        raise ValueError(f"{name} needs x and y, got {p!r}")
    x, y = float(p[0]), float(p[1])
    if not (math.isfinite(x) and math.isfinite(y)):
        raise ValueError(f"{name} must be finite, got {p!r}")
    return x, y


def standoff_goal(person_xy: Sequence[float], robot_xy: Sequence[float], standoff_m: float,
                  z: float = 0.0) -> Optional[Goal]:
    """The goal at ``standoff_m`` from the person, on the person-to-robot line, facing the
    person; ``z`` is the goal's height (the robot's own, so the goal is on its floor).
    None when the robot is within :data:`MIN_SEPARATION_M` of the person horizontally
    (no line to stand on, no direction to face)."""
    if not (math.isfinite(standoff_m) and standoff_m >= 0):
        raise ValueError(f"standoff_m must be finite and >= 0, got {standoff_m}")
    px, py = _finite_xy("person_xy", person_xy)
    rx, ry = _finite_xy("robot_xy", robot_xy)
    dx, dy = rx - px, ry - py
    dist = math.hypot(dx, dy)
    if dist < MIN_SEPARATION_M:
        return None
    gx, gy = px + standoff_m * dx / dist, py + standoff_m * dy / dist
    return Goal(gx, gy, float(z), math.atan2(-dy, -dx))


def yaw_quaternion(yaw: float) -> Tuple[float, float, float, float]:
    """(x, y, z, w) of a rotation by ``yaw`` about z."""
    return 0.0, 0.0, math.sin(yaw / 2.0), math.cos(yaw / 2.0)


def _angle_diff(a: float, b: float) -> float:
    return abs(math.atan2(math.sin(a - b), math.cos(a - b)))


class GoalGate:
    """Which goals to send: the first one; after that one whose position moved at least
    ``min_goal_move_m`` or whose heading turned at least ``min_goal_turn_rad`` from the
    last one sent, and never two within ``min_interval_s``. A planner re-plans on every
    goal, so a person shifting on the spot should not restart it each frame."""

    def __init__(self, config: FollowConfig):
        self.config = config
        self.last: Optional[Goal] = None
        self.last_s: Optional[float] = None

    def reset(self) -> None:
        self.last, self.last_s = None, None

    def offer(self, goal: Goal, now_s: float) -> bool:
        """True if ``goal`` should be sent now (it is then the last one sent)."""
        if self.last is not None and now_s < self.last_s:
            self.reset()  # time jumped back (a bag looped, a simulation restarted)
        if self.last is not None:
            if now_s - self.last_s < self.config.min_interval_s:
                return False
            moved = math.hypot(goal.x - self.last.x, goal.y - self.last.y) >= self.config.min_goal_move_m
            turned = _angle_diff(goal.yaw, self.last.yaw) >= self.config.min_goal_turn_rad
            if not (moved or turned):
                return False
        self.last, self.last_s = goal, now_s
        return True
