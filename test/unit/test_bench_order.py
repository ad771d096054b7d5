"""The orders of interleaved modes: every mode first equally often, and every mode right
after every other equally often (what one frame leaves behind is spread over all modes)."""

from collections import Counter

import pytest

from robot_offload.bench.order import balanced_orders


@pytest.mark.parametrize("n", range(1, 9))
def test_every_mode_follows_every_other_equally_often(n):
    orders = balanced_orders(n)
    assert all(sorted(o) == list(range(n)) for o in orders)
    assert len(orders) == (2 * n if n % 2 and n > 1 else n)
    first = Counter(o[0] for o in orders)
    assert set(first) == set(range(n)) and len(set(first.values())) == 1
    follows = Counter((a, b) for o in orders for a, b in zip(o, o[1:]))
    assert set(follows) == {(a, b) for a in range(n) for b in range(n) if a != b}
    assert len(set(follows.values())) <= 1


def test_four_modes_unlike_a_rotation():
    """Rotating local, full_offload, layer_partition, lop by one per frame put
    full_offload before layer_partition in three frames of four; here once in four."""
    def before(orders, a, b):
        return sum(o[j] == a and o[j + 1] == b for o in orders for j in range(3))

    rotation = [[(i + k) % 4 for k in range(4)] for i in range(4)]
    assert before(rotation, 1, 2) == 3 and before(balanced_orders(4), 1, 2) == 1


def test_no_modes_is_an_error():
    with pytest.raises(ValueError):
        balanced_orders(0)
