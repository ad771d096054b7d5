"""server.launch brings a crashed offload_server back (respawn), with its preloaded models
and fresh ops sandboxes; the crash of one client's ops sandbox leaves the node itself up."""

import json
import os
import signal
import time
import xmlrpc.client

import psutil
import rosgraph
import rosnode
import rospy

from robot_offload.protocol import ComputeRequest, PingRequest, StatusCode
from robot_offload.ros.transport import RosServiceTransport


def _node_pid(name="/offload_server"):
    uri = rosnode.get_api_uri(rosgraph.Master("/pytest"), name, skip_cache=True)
    return xmlrpc.client.ServerProxy(uri).getPid("/pytest")[2]


def _wait_new_pid(old, timeout_s):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            pid = _node_pid()
            if pid != old:
                return pid
        except Exception:  # noqa: BLE001 - not registered yet, or the old one's stale entry
            pass
        time.sleep(0.5)
    raise AssertionError(f"offload_server did not come back within {timeout_s} s")


def _ops(transport, client_id, args, session=""):
    req = ComputeRequest(client_id=client_id, model="", entry="ops", session=session, args_json=json.dumps(args))
    return transport.call("compute", req, 120.0)


def test_a_crashed_server_is_respawned_and_a_crashed_sandbox_is_not_the_servers(launch):
    launch.start("server.launch", "preload:=[resnet18]")
    rospy.wait_for_service("/offload_server/ping", 120)
    transport = RosServiceTransport("/offload_server")
    pid = _node_pid()
    # One client's sandbox dies: the node stays, the other client's session stays.
    a = _ops(transport, "robot_a", {"ops": [{"op": "aten::ones", "a": {"l": [{"l": [2]}]}, "k": {}}]})
    b = _ops(transport, "robot_b", {"ops": [{"op": "aten::ones", "a": {"l": [{"l": [2]}]}, "k": {}}]})
    assert a.status == b.status == StatusCode.OK, (a.status_text, b.status_text)
    sid_b = json.loads(b.result_json)["session"]
    hb = json.loads(b.result_json)["ops"][0]["t"]["h"]
    sandboxes = [p for p in psutil.Process(pid).children(recursive=True)
                 if "sandbox_worker" in " ".join(p.cmdline())]
    assert len(sandboxes) >= 2                      # robot_a's and robot_b's
    for p in sandboxes:                             # every sandbox dies as a segfault would end it
        os.kill(p.pid, signal.SIGSEGV)
    time.sleep(1.0)
    assert _node_pid() == pid                       # the node is still the same process
    assert transport.call("ping", PingRequest("t"), 30.0).status == StatusCode.OK
    fresh = _ops(transport, "robot_a", {"ops": [{"op": "aten::ones", "a": {"l": [{"l": [2]}]}, "k": {}}]})
    assert fresh.status == StatusCode.OK, fresh.status_text
    # The node itself dies: roslaunch starts it again, preloading its models.
    os.kill(pid, signal.SIGKILL)
    new = _wait_new_pid(pid, 180)
    rospy.wait_for_service("/offload_server/ping", 120)
    transport.close()
    transport = RosServiceTransport("/offload_server")
    deadline = time.monotonic() + 120
    while True:
        try:
            pong = transport.call("ping", PingRequest("t"), 30.0)
            if pong.status == StatusCode.OK and "resnet18" in pong.loaded_models:
                break
        except Exception:  # noqa: BLE001 - the new node's services may still be coming up
            pass
        assert time.monotonic() < deadline, "the respawned server never answered with its preloaded model"
        time.sleep(1.0)
    assert new != pid
    # sessions of the old process are gone: the client is told so, and can open a new one
    stale = _ops(transport, "robot_b", {"fetch": [hb]}, session=sid_b)
    assert stale.status == StatusCode.STALE_HANDLE
    again = _ops(transport, "robot_b", {"ops": [{"op": "aten::ones", "a": {"l": [{"l": [2]}]}, "k": {}}]})
    assert again.status == StatusCode.OK, again.status_text
    transport.close()
