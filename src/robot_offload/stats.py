"""What one frame cost, filled by the backends (mirrors ``msg/InferenceStats.msg``)."""

import math
from dataclasses import dataclass, field


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
    processing_s: float = 0.0       # wall time of OffloadClient.infer (s)
    extra: dict = field(default_factory=dict)

    def add_call(self, wall_s: float, server_s: float, up: int, down: int) -> None:
        """Account one server round trip."""
        self.round_trips += 1
        self.server_compute_s += server_s
        self.transfer_s += max(0.0, wall_s - server_s)
        self.bytes_up += up
        self.bytes_down += down
