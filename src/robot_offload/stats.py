"""What one frame cost, filled by the backends (mirrors ``msg/InferenceStats.msg``).

Besides the totals, a frame keeps its activity intervals (``compute`` and ``transmit``,
``time.perf_counter`` seconds, possibly overlapping): the energy model integrates them
and power_logger receives them as ``RobotActivity``.
"""

import math
from dataclasses import dataclass, field
from typing import List, Tuple


@dataclass
class FrameStats:
    mode: str = ""                  # backend asked for
    executed_mode: str = ""         # backend that produced the result
    model: str = ""
    plan: str = ""
    phase: str = "none"
    fallback_reason: str = ""
    queue_s: float = 0.0            # arrival at the client to start of processing (s)
    robot_compute_s: float = 0.0    # preprocessing, local layers, encode/decode (s)
    transfer_s: float = 0.0         # wall time in server calls minus server time (s)
    server_compute_s: float = 0.0   # server time reported in the replies (s)
    predicted_latency_s: float = math.nan
    bytes_up: int = 0               # tensor payload sent (bytes)
    bytes_down: int = 0             # tensor payload received (bytes)
    round_trips: int = 0
    energy_j: float = math.nan
    energy_modelled: bool = True
    predicted_bandwidth_bps: float = math.nan
    processing_s: float = 0.0       # wall time of OffloadClient.infer (s)
    intervals: List[Tuple[str, float, float]] = field(default_factory=list)
    extra: dict = field(default_factory=dict)

    def add_compute(self, t0: float, t1: float) -> None:
        """The robot computed from t0 to t1 (perf_counter s)."""
        self.robot_compute_s += t1 - t0
        self.intervals.append(("compute", t0, t1))

    def add_call(self, t0: float, t1: float, server_s: float, up: int, down: int) -> None:
        """Account one server round trip from t0 to t1 (perf_counter s). The robot's radio
        is busy for the call minus the server's time, split between the upload at the
        start and the download at the end in proportion to the bytes; it waits between."""
        wall_s = t1 - t0
        busy_s = max(0.0, wall_s - server_s)
        self.round_trips += 1
        self.server_compute_s += server_s
        self.transfer_s += busy_s
        self.bytes_up += up
        self.bytes_down += down
        up_share = up / (up + down) if up + down else 0.5
        if busy_s > 0:
            self.intervals.append(("transmit", t0, t0 + busy_s * up_share))
            self.intervals.append(("transmit", t1 - busy_s * (1 - up_share), t1))
