"""Energy of one inference on the robot.

Two ways, chosen per frame by what is available:

* measured: power samples from a sensor (Jetson INA3221, RAPL) published by power_logger,
  pushed into a :class:`robot_offload.power.EnergyMeter` and integrated over the frame
  (``hold_last``: the sample after the frame has not arrived when its stats are published);
* modelled: the frame's own compute / transmit intervals through the state model of
  :class:`robot_offload.power.StateModelSource` (Intra-DP Table 3 watts by default).
"""

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
