"""Offload servers found through the ROS master: the master is the registry.

Every offload_server advertises ``compute``, ``load_model`` and ``ping`` under its own
name; several started under one namespace (``server.launch ns:=/offload_servers
server_name:=gpu0``) are found by listing the services the master knows and keeping
each ``<fleet_ns>/<name>/compute``. A server that starts later is found at the next look
(:class:`~robot_offload.pool.ServerPool` looks every ``rediscover_s``); one that stops is
dropped when its services are unregistered, and until then its link is down (a killed
process leaves its registrations behind until it is restarted or ``rosnode cleanup``).
"""

from typing import List, Optional

import rosgraph
import rospy

from robot_offload.pool import ServerDirectory
from robot_offload.ros.transport import RosServiceTransport


def server_namespaces(fleet_ns: str, master: Optional[rosgraph.Master] = None) -> List[str]:
    """The namespaces of the offload servers registered directly under ``fleet_ns``."""
    master = master or rosgraph.Master(rospy.get_name() if rospy.core.is_initialized() else "/robot_offload")
    _, _, services = master.getSystemState()
    prefix = fleet_ns.rstrip("/") + "/"
    found = set()
    for name, providers in services:
        if providers and name.startswith(prefix) and name.endswith("/compute"):
            ns = name[:-len("/compute")]
            if ns[len(prefix):] and "/" not in ns[len(prefix):]:
                found.add(ns)
    return sorted(found)


def master_directory(fleet_ns: str, auth_secret: Optional[bytes] = None) -> ServerDirectory:
    """A :class:`~robot_offload.pool.ServerDirectory` of the servers under ``fleet_ns``."""
    return ServerDirectory(lambda: server_namespaces(fleet_ns),
                           lambda ns: RosServiceTransport(ns, auth_secret=auth_secret))
