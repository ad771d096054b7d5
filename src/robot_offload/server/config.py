"""Settings of the offload server (the ``~`` parameters of offload_server)."""

from dataclasses import dataclass, field

import torch

from robot_offload import auth
from robot_offload.errors import ConfigError


@dataclass
class ServerConfig:
    """Settings of the offload server (``~`` parameters of offload_server)."""

    device: str = "auto"                 # auto, cpu, cuda, cuda:N
    # TF32 convolutions and matrix products on CUDA: faster, but PyTorch's default (TF32
    # convolutions) put full_offload's ResNet-18 logits 1.8e-3 from the robot's float32 on an
    # H100; with TF32 off every registry model's outputs stayed within 4.2e-5 of their scale
    # (median 1.5e-6), as lossless plans promise. Off by default.
    allow_tf32: bool = False
    max_request_bytes: int = 256 * 1024 * 1024  # summed tensor payload of one request (bytes)
    max_input_elements: int = 64 * 1024 * 1024  # elements of one decoded input tensor
    allowed_models: tuple = ()           # empty: every registry model may be loaded
    preload: tuple = ()                  # models built at start (the server node)
    # client_id -> models that client may load and use ({} = no per-client lists; key "*":
    # every client not listed). Refusals are UNAUTHORIZED. client_id is only as
    # trustworthy as the (shared-secret) authentication: see robot_offload.auth.
    client_models: dict = field(default_factory=dict)
    auth_max_skew_s: float = auth.DEFAULT_MAX_SKEW_S  # with a secret: token age / clock difference (s)
    weights_dir: str = ""                # optional: <weights_dir>/<model>.pt|.safetensors
    transparent: bool = True             # accept per-operator sessions (transparent, record_replay)
    jpeg_frames: bool = True             # decode camera frames robots send as JPEG (robot_offload.frame_codec)
    max_session_mib: int = 2048          # tensors one transparent session may hold (MiB; XML-RPC ints are 32-bit)
    max_sessions: int = 64               # transparent sessions in all (a new one past it: BUSY)
    max_sessions_per_client: int = 4     # per client identity (its least recently used is dropped)
    max_client_mib: int = 4096           # tensors all sessions of one client may hold (MiB)
    session_idle_s: float = 600.0        # a session unused this long is dropped (s)
    # Compute bounds of the ops entry, in estimated floating-point operations (matrix
    # products and convolutions by formula, else one per element): one request at most
    # max_request_gflop; a client at most client_gflop_per_s on average (a token bucket
    # holding max_request_gflop). Refusals are TOO_LARGE and BUSY.
    max_request_gflop: float = 2000.0
    client_gflop_per_s: float = 1000.0
    # Each client's operator sessions in a process of its own (robot_offload.server.sandbox):
    # a crash or a request past max_request_s ends that process, not the server.
    ops_sandbox: bool = True
    max_sandboxes: int = 8               # clients with operator sessions at once (a new one past it: BUSY)
    max_request_s: float = 60.0          # wall-clock bound of one ops request (s)
    # Whole models and partition tails share compute slots fairly among clients and are
    # refused BUSY when they cannot start before their client's deadline
    # (robot_offload.server.scheduler).
    compute_slots: int = 1               # requests computing at once
    max_queued_per_client: int = 8       # requests of one client waiting for a slot
    # Whole models of several clients for one model and input shape run as one batch of up
    # to this many (1: each alone). Batched outputs equal single ones within float rounding
    # (not bit for bit), hence off by default.
    max_batch: int = 1
    # How long a request that could lead a batch holds its slot for others to join (s); 0:
    # a batch is what already waits. Bounded by the request's own deadline.
    batch_wait_s: float = 0.0

    def validate(self) -> "ServerConfig":
        if min(self.max_session_mib, self.max_sessions, self.max_sessions_per_client,
               self.max_client_mib) <= 0 or not self.session_idle_s > 0:
            raise ConfigError("max_session_mib, max_sessions, max_sessions_per_client, max_client_mib "
                              "and session_idle_s must be positive")
        if self.compute_slots <= 0 or self.max_queued_per_client <= 0 or not 1 <= self.max_batch <= 64:
            raise ConfigError("compute_slots and max_queued_per_client must be positive, max_batch in 1..64")
        if not 0.0 <= self.batch_wait_s <= 1.0:
            raise ConfigError(f"batch_wait_s must be in 0..1 s, got {self.batch_wait_s}")
        if self.max_sandboxes <= 0 or not self.max_request_s > 0:
            raise ConfigError("max_sandboxes and max_request_s must be positive")
        if not (self.max_request_gflop > 0 and self.client_gflop_per_s > 0):
            raise ConfigError("max_request_gflop and client_gflop_per_s must be positive")
        if self.max_request_bytes <= 0 or self.max_input_elements <= 0:
            raise ConfigError("max_request_bytes and max_input_elements must be positive")
        if not self.auth_max_skew_s > 0:
            raise ConfigError(f"auth_max_skew_s must be positive, got {self.auth_max_skew_s}")
        if not isinstance(self.client_models, dict) or not all(
                isinstance(k, str) and isinstance(v, (list, tuple)) and all(isinstance(m, str) for m in v)
                for k, v in self.client_models.items()):
            raise ConfigError("client_models must map client ids to lists of model names, "
                              f"got {self.client_models!r}")
        resolve_device(self.device)
        return self


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError as e:
        raise ConfigError(f"unknown device {name!r}") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} asked for but CUDA is not available")
    return dev

