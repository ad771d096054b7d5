"""The orders of interleaved modes: over the frames as they run (the step from a frame's
last mode to the next frame's first included), every mode right after every other exactly
equally often, so what one frame leaves behind is spread over all modes."""

from collections import Counter

import pytest

from robot_offload.bench.order import balanced_orders


def _steps(orders, cycles=1):
    """Who follows whom over ``cycles`` passes through the orders, read as a cycle."""
    seq = [m for _ in range(cycles) for o in orders for m in o]
    return Counter(zip(seq, seq[1:] + seq[:1]))


@pytest.mark.parametrize("n", range(2, 9))
def test_every_mode_follows_every_other_equally_often_across_frames(n):
    orders = balanced_orders(n)
    assert all(sorted(o) == list(range(n)) for o in orders)
    assert len(orders) == max(1, n - 1)
    steps = _steps(orders)
    assert set(steps) == {(a, b) for a in range(n) for b in range(n) if a != b}
    assert set(steps.values()) == {1}
    assert len({o[0] for o in orders}) == len(orders)      # different first modes


def test_four_modes_unlike_a_williams_design_or_a_rotation():
    """With local, full_offload, layer_partition, lop (0-3): a rotation put full_offload
    before layer_partition in three frames of four. A Williams design balanced the steps
    inside the frames only; across frames lop followed local every time, so local came
    before lop in half of lop's frames. Here in a third, as every other mode."""
    rotation = [[(i + k) % 4 for k in range(4)] for i in range(4)]
    williams = [[0, 1, 3, 2], [1, 2, 0, 3], [2, 3, 1, 0], [3, 0, 2, 1]]

    def local_before_lop(orders):
        steps = _steps(orders)
        return steps[(0, 3)] / sum(steps[(a, 3)] for a in range(3))

    assert _steps(rotation)[(1, 2)] == 3 and _steps(balanced_orders(4))[(1, 2)] == 1
    assert local_before_lop(williams) == pytest.approx(1 / 2)
    assert local_before_lop(balanced_orders(4)) == pytest.approx(1 / 3)


def test_one_mode_and_no_modes():
    assert balanced_orders(1) == [[0]]
    with pytest.raises(ValueError):
        balanced_orders(0)


class _SimulatedDriver:
    """The bench driver's frame loop over frames that take a fixed time (no ROS): what
    :meth:`Driver.run_frames` decides is how many frames a cell runs."""

    def __init__(self, frame_s, paired):
        from types import SimpleNamespace
        self.args = SimpleNamespace(paired_trace=paired, settle_s=0.05, frame_timeout_s=5.0)
        self.frame_s, self.positions = frame_s, []

    def switch(self, mode):
        pass

    def seek(self, position_s):
        self.positions.append(position_s)

    def one_frame(self, i, t_origin, timeout_s, mode):
        return {"frame": i, "mode_asked": mode, "roundtrip_wall_s": self.frame_s[mode]}


@pytest.mark.parametrize("max_frames, expected_rounds", [(250, 100), (60, 60)])
def test_a_paired_cell_is_extended_until_its_frames_span_the_trace(max_frames, expected_rounds):
    """Five interleaved modes whose slowest frame takes 0.2 s (plus 0.05 s of settle):
    a 25 s span of the trace is 100 rounds, whatever the wall time the rounds took."""
    import time
    from robot_offload.ros.bench_driver import Driver
    d = _SimulatedDriver({"local": 0.2, "full_offload": 0.05, "layer_partition": 0.06,
                          "lop": 0.07, "auto": 0.05}, paired=True)
    rows = Driver.run_frames(d, 30, True, time.monotonic(), modes=list(d.frame_s),
                             min_span_s=25.0, max_frames=max_frames)
    assert len(rows) == 5 * expected_rounds
    assert max(r["frame"] for r in rows) == expected_rounds - 1
    assert rows[-1]["trace_s"] < 25.0 <= rows[-1]["trace_s"] + 0.25 or expected_rounds == max_frames
