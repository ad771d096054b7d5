"""What a transport holds (worker threads, connections) and the soak's leak accounting:
the pools fill as calls overlap and stay within their bound, and growth they do not
account for is reported as a leak, by thread name and fd kind."""

import os
import threading
import time

import pytest

from robot_offload.protocol import ComputeRequest, PingRequest
from robot_offload.server import OffloadServer, ServerConfig
from robot_offload.health import process_figures
from robot_offload.soak import grown, inventory, leaked
from robot_offload.transport.inproc import InProcessTransport


def test_pools_fill_with_overlapping_calls_within_their_bound():
    transport = InProcessTransport(OffloadServer(ServerConfig(ops_sandbox=False, device="cpu")), max_parallel_calls=3)
    try:
        assert transport.held() == {"threads": 0, "connections": 0}
        limits = transport.held_limits()
        assert limits == {"threads": 6, "connections": 0}     # submit pool + server runners
        for _ in range(5):
            futures = [transport.submit("ping", PingRequest(client_id="t"), 10.0) for _ in range(8)]
            assert all(f.result(10).status == 0 for f in futures)
        held = transport.held()
        assert 2 <= held["threads"] <= limits["threads"], held
    finally:
        transport.close()


def _quiet(timeout_s: float = 5.0) -> None:
    """Wait until no thread has started or ended for 0.3 s (pools of earlier tests in this
    process wind down asynchronously)."""
    deadline = time.monotonic() + timeout_s
    n = threading.active_count()
    while time.monotonic() < deadline:
        time.sleep(0.3)
        if threading.active_count() == n:
            return
        n = threading.active_count()


def test_growth_outside_the_pools_is_a_leak_and_is_named():
    transport = InProcessTransport(OffloadServer(ServerConfig(ops_sandbox=False, device="cpu")))
    stop = threading.Event()
    r = w = None
    try:
        _quiet()
        before, before_held, before_pools = process_figures(), inventory(), transport.held()
        transport.call("ping", PingRequest(client_id="t"), 10.0)      # the pool grows: no leak
        pools = transport.held()
        assert pools["threads"] == before_pools["threads"] + 1
        assert leaked(before, process_figures(), before_pools, pools) == {"threads": 0, "fds": 0}
        stray = threading.Thread(target=stop.wait, name="stray-worker", daemon=True)
        stray.start()
        r, w = os.pipe()
        after, after_held, after_pools = process_figures(), inventory(), transport.held()
        assert leaked(before, after, before_pools, after_pools) == {"threads": 1, "fds": 2}
        text = grown(before_held, after_held)
        assert "stray-worker x1" in text and "pipe x2" in text, text
    finally:
        stop.set()
        for fd in (r, w):
            if fd is not None:
                os.close(fd)
        transport.close()


def test_a_ros_request_that_fails_to_convert_closes_its_connection(monkeypatch):
    """A request the srv conversion refuses (here a tensor that is not an EncodedTensor)
    never reaches the wire, and the persistent connection taken for it is closed, neither
    returned to the pool (a later call would inherit it half-used) nor counted as in use."""
    from robot_offload.ros import transport as ros_transport

    opened, closed = [], []

    class Proxy:
        def __init__(self, name, srv_type, persistent=False):
            opened.append(self)

        def call(self, request):
            raise AssertionError("a request that did not convert was sent")

        def close(self):
            closed.append(self)

    monkeypatch.setattr(ros_transport.rospy, "ServiceProxy", Proxy)
    transport = ros_transport.RosServiceTransport("/nowhere")
    try:
        bad = ComputeRequest(client_id="t", model="m", entry="forward", tensors=[object()])
        for _ in range(2):
            with pytest.raises(Exception):
                transport.call("compute", bad, 1.0)
        assert len(opened) == 2 and closed == opened
        assert transport.held()["connections"] == 0
    finally:
        transport.close()


def test_a_call_abandoned_as_its_answer_arrives_leaves_its_connection_out_of_the_pool(monkeypatch):
    """The robot's hedge may abandon a call whose answer is arriving (it resets and closes
    that connection) just as the call completes: the closed connection must not go back
    to the pool, where the next call would write to it (rospy then fails inside
    serialize_message); a call that completes first is no longer abandonable."""
    import socket

    from robot_offload.ros import transport as ros_transport

    opened, closed = [], []
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    _, srv_type, _, _ = ros_transport.SERVICES["compute"]

    class Proxy:
        abandon_on_call = None      # (transport, request_id) to abandon while answering

        def __init__(self, name, srv, persistent=False):
            opened.append(self)
            self.transport = type("T", (), {})()
            self.transport.socket = socket.create_connection(listener.getsockname())
            self.peer, _ = listener.accept()

        def call(self, request):
            if Proxy.abandon_on_call is not None:
                transport, request_id = Proxy.abandon_on_call
                Proxy.abandon_on_call = None
                assert transport.abandon(request_id)
            return srv_type._response_class()

        def close(self):
            closed.append(self)
            self.transport.socket.close()
            self.peer.close()

    monkeypatch.setattr(ros_transport.rospy, "ServiceProxy", Proxy)
    transport = ros_transport.RosServiceTransport("/nowhere")
    try:
        request = ComputeRequest(client_id="t", model="m", entry="forward", tensors=[], request_id="ab" * 8)
        Proxy.abandon_on_call = (transport, request.request_id)
        transport.call("compute", request, 5.0)
        assert set(closed) == set(opened) and transport.held()["connections"] == 0
        transport.call("compute", request, 5.0)        # a new connection, not the closed one
        assert len(opened) == 2 and set(closed) == {opened[0]} and transport.held()["connections"] == 1
        assert not transport.abandon(request.request_id)  # completed: nothing to abandon
        assert set(closed) == {opened[0]}
    finally:
        transport.close()
        listener.close()
