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
