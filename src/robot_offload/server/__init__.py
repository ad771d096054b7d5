"""The offload server, independent of ROS: :class:`OffloadServer` (the composition root,
:mod:`.core`), its settings (:mod:`.config`), the request checks (:mod:`.request_check`)
and one module per ``compute`` entry (:mod:`.executors`). Robot-side code never imports
this package."""

from robot_offload.server.base import Executor, LoadedModel, RequestRejected
from robot_offload.server.config import ServerConfig, resolve_device
from robot_offload.server.core import OffloadServer

__all__ = ["Executor", "LoadedModel", "OffloadServer", "RequestRejected", "ServerConfig", "resolve_device"]
