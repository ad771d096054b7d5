"""The order in which interleaved modes run their frame i.

What a frame leaves behind weighs on the frame after it: the robot's CPU quota half used
in the current period, a lop re-plan solving at low priority, transfers winding down. A
fixed order, or one rotated by a mode per frame, puts the same predecessor before a mode
most of the time: with ``local, full_offload, layer_partition, lop`` rotated,
``layer_partition`` came after ``full_offload`` (a robot left idle for its whole frame) in
three frames of four, and measured 8-15 % faster there than after ``local`` on the
testbed's MobileNetV2 and RegNetY. The orders here are a Williams design: over ``n``
frames (``2n`` for odd ``n``) every mode runs first equally often and follows every other
mode equally often, so what one mode leaves behind is spread over all the others.
"""

from typing import List


def balanced_orders(n: int) -> List[List[int]]:
    """Orders of ``range(n)``, one per frame, cycled: each index is first equally often,
    and each ordered pair of distinct indices is adjacent equally often. ``n`` even: ``n``
    orders, each pair once; odd: ``2n`` (the orders and their reverses), each pair twice."""
    if n < 1:
        raise ValueError(f"need at least one mode, got {n}")
    # 0, 1, n-1, 2, n-2, ...: the differences between neighbours take every non-zero
    # value mod n once (n even), so shifting the row by r = 0..n-1 meets every pair once.
    first, lo, hi = [0], 1, n - 1
    while len(first) < n:
        first.append(lo)
        lo += 1
        if len(first) < n:
            first.append(hi)
            hi -= 1
    orders = [[(k + r) % n for k in first] for r in range(n)]
    if n % 2 and n > 1:
        orders += [list(reversed(o)) for o in orders]
    return orders
