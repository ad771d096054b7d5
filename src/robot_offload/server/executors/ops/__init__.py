"""The ``ops`` entry (transparent and record_replay): :mod:`.executor` answers requests,
:mod:`.sessions` holds each client's tensors, :mod:`.sequence` compiles recorded sequences,
:mod:`.calls` bounds each operator."""

from robot_offload.server.executors.ops.executor import OpsExecutor

__all__ = ["OpsExecutor"]
