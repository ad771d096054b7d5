"""Energy of one inference on the robot.

Two ways, chosen per frame by what is available:

* measured: power samples from a sensor (Jetson INA3221, RAPL) published by power_logger,
  integrated over the frame (trapezoid; the last sample's power is held to the frame end,
  since the sample after it has not arrived when the frame's stats are published);
* modelled: the frame's own compute / transmit intervals through the state model of
  :class:`robot_offload.power.StateModelSource` (Intra-DP Table 3 watts by default).
"""

import bisect
import threading
from typing import Iterable, Tuple

from robot_offload.power import COMPUTE_W, IDLE_W, TRANSMIT_W, StateModelSource


def modelled_energy_j(intervals: Iterable[Tuple[str, float, float]], t0_s: float, t1_s: float,
                      compute_w: float = COMPUTE_W, transmit_w: float = TRANSMIT_W,
                      idle_w: float = IDLE_W) -> float:
    """Energy (J) over [t0_s, t1_s] of a robot doing ``intervals`` (activity, start, end)
    and idling otherwise, by the state model's overlap rule."""
    model = StateModelSource(compute_w, transmit_w, idle_w)
    model.set_state("idle", t0_s)
    events = []
    for activity, a, b in intervals:
        a, b = max(a, t0_s), min(b, t1_s)
        if b > a:
            events += [(a, 0, activity), (b, 1, activity)]
    for t, kind, activity in sorted(events):
        (model.begin if kind == 0 else model.end)(activity, t)
    return model.energy_between(t0_s, t1_s)


class MeasuredPower:
    """A window of measured (t_s, watts) samples; energy over an interval."""

    def __init__(self, max_samples: int = 10_000):
        self._t, self._w = [], []
        self._max = max_samples
        self._lock = threading.Lock()
        self.source = ""

    def add(self, t_s: float, watts: float, source: str = "") -> None:
        with self._lock:
            if self._t and t_s <= self._t[-1]:
                return  # out of order or duplicate: keep the window monotonic
            self._t.append(t_s)
            self._w.append(watts)
            self.source = source
            if len(self._t) > self._max:
                del self._t[:-self._max], self._w[:-self._max]

    def covers(self, t0_s: float) -> bool:
        with self._lock:
            return bool(self._t) and self._t[0] <= t0_s

    def energy_j(self, t0_s: float, t1_s: float) -> float:
        """Trapezoid over the samples, linear between them, the last one held after."""
        with self._lock:
            t, w = list(self._t), list(self._w)
        if not t or t1_s <= t0_s:
            return 0.0

        def power(x):
            j = bisect.bisect_right(t, x)
            if j == 0:
                return w[0]
            if j == len(t):
                return w[-1]
            return w[j - 1] + (w[j] - w[j - 1]) * (x - t[j - 1]) / (t[j] - t[j - 1])

        lo, hi = bisect.bisect_right(t, t0_s), bisect.bisect_left(t, t1_s)
        pts = [(t0_s, power(t0_s))] + list(zip(t[lo:hi], w[lo:hi])) + [(t1_s, power(t1_s))]
        return sum((b[0] - a[0]) * (a[1] + b[1]) / 2.0 for a, b in zip(pts, pts[1:]))
