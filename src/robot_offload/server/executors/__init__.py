"""The server's ``compute`` entries, one module each. :func:`build` makes one instance of
each for one server (their state is theirs, not the modules')."""

from typing import Dict

from robot_offload.server.base import Executor
from robot_offload.server.executors.cancel import CancelExecutor
from robot_offload.server.executors.forward import ForwardExecutor
from robot_offload.server.executors.forward_image import ForwardImageExecutor
from robot_offload.server.executors.lop import LopExecutor
from robot_offload.server.executors.ops import OpsExecutor
from robot_offload.server.executors.partition import PartitionTailExecutor
from robot_offload.server.sandbox import SandboxedOps

CLASSES = (ForwardExecutor, ForwardImageExecutor, PartitionTailExecutor, LopExecutor, OpsExecutor,
           CancelExecutor)


def build(server) -> Dict[str, Executor]:
    """entry -> executor, for ``server`` (the ``ops`` entry in sandbox processes when
    ``ops_sandbox`` is on)."""
    classes = [SandboxedOps if cls is OpsExecutor and server.config.ops_sandbox else cls for cls in CLASSES]
    return {cls.ENTRY: cls(server) for cls in classes}
