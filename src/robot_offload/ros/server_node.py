"""offload_server: advertises the protocol's services and hands requests to the pure
:class:`~robot_offload.server.OffloadServer`. rospy runs each client connection on its
own thread, so several robots are served at once."""

import rospy

from robot_offload.protocol import METHODS, StatusCode
from robot_offload.ros import conversions as conv, logbridge
from robot_offload.ros.diagnostics import NodeDiagnostics
from robot_offload.ros.params import load_params, load_server_auth
from robot_offload.server import OffloadServer, ServerConfig
from robot_offload.server.health import ServerHealth, device_memory
from robot_offload.srv import Compute, LoadModel, Ping


class OffloadServerNode:
    def __init__(self):
        logbridge.install()
        self.config = load_params(ServerConfig)
        secret, keys = load_server_auth()
        self.server = OffloadServer(self.config, auth_secret=secret, auth_keys=keys)
        for name in self.config.preload:
            self.server.load(name)
        warm = getattr(self.server.executors.get("ops"), "warm", None)
        if warm is not None:
            warm()                        # the ops sandbox's first worker
        self._services = [
            rospy.Service("~load_model", LoadModel, self._wrap("load_model", conv.load_req_from_srv,
                                                                conv.load_resp_to_srv)),
            rospy.Service("~compute", Compute, self._wrap("compute", conv.compute_req_from_srv,
                                                           conv.compute_resp_to_srv)),
            rospy.Service("~ping", Ping, self._wrap("ping", conv.ping_req_from_srv, conv.ping_resp_to_srv)),
        ]
        self.health = ServerHealth()
        self.diagnostics = NodeDiagnostics("server", lambda: self.health.report(
            self.server.activity(), device_memory(self.server.device)))
        rospy.loginfo("offload_server %s ready on %s", self.server.server_id, self.server.device)

    def _wrap(self, method, from_srv, to_srv):
        def handler(msg):
            try:
                request = from_srv(msg)
            except Exception as e:  # noqa: BLE001 - a malformed message must not kill the server
                rospy.logwarn_throttle(1.0, f"{method}: undecodable request: {e}")
                request = None
            if request is None:
                return to_srv(METHODS[method][1](status=StatusCode.BAD_REQUEST,
                                                 status_text="undecodable request"))
            return to_srv(self.server.handle(method, request))
        return handler

    def shutdown(self):
        self.diagnostics.close()
        for s in self._services:
            s.shutdown()
        self.server.close()
