"""The order in which interleaved modes run their frame i.

What a frame leaves behind weighs on the frame after it: the robot's CPU quota half used
in the current period, a lop re-plan solving at low priority, transfers winding down, a
server left idle (its next forward slower). A fixed order, or one rotated by a mode per
frame, puts the same predecessor before a mode most of the time: with ``local,
full_offload, layer_partition, lop`` rotated, ``layer_partition`` came after
``full_offload`` (a robot left idle for its whole frame) in three frames of four, and
measured 8-15 % faster there than after ``local`` on the testbed's MobileNetV2 and RegNetY.

The orders here make every mode follow every other exactly equally often over the frames
as they run, the step from one frame's last mode to the next frame's first included.
They replace a Williams design (each order a row of a Latin square whose neighbours take
every ordered pair once), which balanced the steps inside the orders only: the step
between frames always joined the same pairs (with four modes ``local`` -> ``lop`` ->
``layer_partition`` -> ``full_offload`` -> ``local``), so ``lop`` followed ``local`` in
half its frames, not a third. On the testbed the server's full-offload
forwards of DenseNet-121 took 68.7 ms after ``local`` (the server idle for a whole frame)
against 65.3 ms after another offloading mode, which put ``lop`` 1-3 % behind
``layer_partition`` on the same plan in most cells.

The orders start with different modes, but with ``n - 1`` orders one mode is never first:
the first mode follows the previous frame's last like any other step, and every mode's
frame is preceded by the same ``--settle-s`` of idle, so being first means nothing else.
"""

from functools import lru_cache
from typing import List, Tuple


def balanced_orders(n: int) -> List[List[int]]:
    """Orders of ``range(n)``, one per frame, cycled: ``n - 1`` orders (one for ``n``
    <= 2) whose concatenation, read as a cycle (each order's last index followed by the
    next order's first, the last order's by the first's), has every ordered pair of
    distinct indices adjacent exactly once and no index after itself; no two orders start
    with the same index."""
    if n < 1:
        raise ValueError(f"need at least one mode, got {n}")
    return [list(o) for o in _cycle(n)]


@lru_cache(maxsize=None)
def _cycle(n: int) -> Tuple[Tuple[int, ...], ...]:
    """Depth-first search for the orders (an Eulerian circuit of the complete directed
    graph on ``n`` modes cut into permutations with different first indices), the first
    index fixed at 0."""
    if n == 1:
        return ((0,),)
    total = n * (n - 1)
    unused = {(a, b) for a in range(n) for b in range(n) if a != b}
    seq: List[int] = [0]
    in_block = [{0}]
    firsts = {0}        # the orders start with different modes

    def place(pos: int) -> bool:
        if pos == total:
            return unused == {(seq[-1], seq[0])}
        if pos % n == 0:
            in_block.append(set())
        for x in range(n):
            step = (seq[-1], x)
            if x in in_block[-1] or step not in unused or (pos % n == 0 and x in firsts):
                continue
            unused.discard(step)
            seq.append(x)
            in_block[-1].add(x)
            if pos % n == 0:
                firsts.add(x)
            if place(pos + 1):
                return True
            if pos % n == 0:
                firsts.discard(x)
            in_block[-1].discard(x)
            seq.pop()
            unused.add(step)
        if pos % n == 0:
            in_block.pop()
        return False

    if not place(1):
        raise RuntimeError(f"no balanced cycle of orders for {n} modes")
    return tuple(tuple(seq[i:i + n]) for i in range(0, total, n))
