"""The server's compute slots: clients served in turn, work refused BUSY when it cannot
start before its deadline, dropped when its deadline passes while it waits."""

import json
import threading
import time

import pytest
import torch

from robot_offload import codec
from robot_offload.protocol import ComputeRequest, LoadModelRequest, PingRequest, StatusCode
from robot_offload.server import OffloadServer, ServerConfig
from robot_offload.server.base import RequestRejected
from robot_offload.server.health import ServerHealth
from robot_offload.server.scheduler import FairScheduler


class _Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def _hold(sched, client, key=("forward", "m"), deadline_s=0.0, started=None, release=None, order=None):
    """A thread that takes a slot, notes its turn and holds the slot until ``release``."""
    def run():
        try:
            with sched.slot(client, key, deadline_s):
                if order is not None:
                    order.append(client)
                if started is not None:
                    started.set()
                if release is not None:
                    release.wait(10)
        except RequestRejected as e:
            if order is not None:
                order.append(f"{client}:{StatusCode(e.code).name}")
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _queued(sched, n, timeout_s=5.0):
    end = time.monotonic() + timeout_s
    while sched.status()["queued"] < n:
        assert time.monotonic() < end, f"never {n} queued: {sched.status()}"
        time.sleep(0.005)


def test_waiting_clients_are_served_in_turn_not_in_arrival_order():
    sched = FairScheduler(slots=1, max_queued_per_client=8)
    release = threading.Event()
    started = threading.Event()
    order = []
    holder = _hold(sched, "x", started=started, release=release, order=order)
    assert started.wait(5)
    order.clear()
    # a greedy client queues four requests, then a modest one queues one
    threads = []
    for _ in range(4):
        threads.append(_hold(sched, "greedy", order=order))
        _queued(sched, len(threads))
    threads.append(_hold(sched, "modest", order=order))
    _queued(sched, 5)
    release.set()
    for t in threads + [holder]:
        t.join(5)
    # the modest client's one request goes second, not fifth
    assert order == ["greedy", "modest", "greedy", "greedy", "greedy"]
    figures = sched.status()["clients"]
    assert figures["greedy"]["served"] == 4 and figures["modest"]["served"] == 1


def test_a_request_that_cannot_start_before_its_deadline_is_busy_at_once():
    clock = _Clock()
    sched = FairScheduler(slots=1, clock=clock)
    # teach it that this entry takes 0.5 s
    with sched.slot("a", ("forward", "m"), 0.0):
        clock.t += 0.5
    assert sched.expected_s(("forward", "m")) == pytest.approx(0.5)
    release, started = threading.Event(), threading.Event()
    holder = _hold(sched, "a", started=started, release=release)
    assert started.wait(5)
    # 0.5 s of running work ahead and 0.5 s of its own: a 0.8 s deadline cannot be met
    with pytest.raises(RequestRejected) as e:
        with sched.slot("b", ("forward", "m"), 0.8):
            pass
    assert e.value.code == StatusCode.BUSY and "deadline" in e.value.text
    assert sched.client_figures("b")["busy"] == 1
    release.set()
    holder.join(5)
    # with the slot free the same request is admitted
    with sched.slot("b", ("forward", "m"), 0.8) as ticket:
        assert ticket.waited_s == 0.0


def test_a_request_still_waiting_at_its_deadline_is_dropped_and_its_turn_passes():
    sched = FairScheduler(slots=1)
    release, started = threading.Event(), threading.Event()
    holder = _hold(sched, "a", started=started, release=release)
    assert started.wait(5)
    t0 = time.monotonic()
    with pytest.raises(RequestRejected) as e:
        with sched.slot("b", ("forward", "m"), 0.2):
            pass
    assert e.value.code == StatusCode.BUSY and "dropped" in e.value.text
    assert 0.15 <= time.monotonic() - t0 < 5.0
    assert sched.status()["queued"] == 0 and sched.client_figures("b")["dropped"] == 1
    release.set()
    holder.join(5)
    with sched.slot("c", ("forward", "m"), 1.0):
        assert sched.status()["running"] == 1


def test_one_client_may_queue_only_so_many_requests():
    sched = FairScheduler(slots=1, max_queued_per_client=2)
    release, started = threading.Event(), threading.Event()
    holders = [_hold(sched, "a", started=started, release=release)]
    assert started.wait(5)
    order = []
    holders += [_hold(sched, "a", order=order) for _ in range(2)]
    _queued(sched, 2)
    with pytest.raises(RequestRejected) as e:
        with sched.slot("a", ("forward", "m")):
            pass
    assert e.value.code == StatusCode.BUSY and "max_queued_per_client" in e.value.text
    holders.append(_hold(sched, "b", order=order))     # another client still queues
    _queued(sched, 3)
    release.set()
    for t in holders:
        t.join(5)
    assert sorted(order) == ["a", "a", "b"] and order[1] == "b"


def _forward_request(client, x, deadline_s=0.0):
    return ComputeRequest(client_id=client, model="mobilenet_v2", entry="forward",
                          tensors=[codec.encode(x, "input")], deadline_s=deadline_s)


def test_the_server_answers_busy_fast_instead_of_queueing_past_the_deadline():
    server = OffloadServer(ServerConfig(device="cpu"))
    server.handle("load_model", LoadModelRequest(client_id="a", model="mobilenet_v2"))
    x = torch.randn(1, 3, 64, 64)
    ok = server.handle("compute", _forward_request("a", x, 5.0))
    assert ok.status == StatusCode.OK and 0.0 <= ok.server_queue_s < 0.5
    assert ok.server_backlog_s == 0.0              # idle again as the reply left
    assert server.handle("ping", PingRequest(client_id="a")).server_backlog_s == 0.0
    # hold the one slot, as a long request of another robot would
    release, started = threading.Event(), threading.Event()
    holder = _hold(server.scheduler, "other", key=("forward", "mobilenet_v2"), started=started, release=release)
    assert started.wait(5)
    time.sleep(0.2)
    t0 = time.monotonic()
    busy = server.handle("compute", _forward_request("a", x, 0.05))
    assert busy.status == StatusCode.BUSY
    assert time.monotonic() - t0 < 2.0
    # the reported wait: at least what the held slot has run (it is past its expected time)
    assert busy.server_backlog_s >= 0.2
    assert server.handle("ping", PingRequest(client_id="a")).server_backlog_s >= 0.2
    refused = server.handle("compute", ComputeRequest(client_id="a", model="mobilenet_v2", entry="nope"))
    assert refused.status == StatusCode.UNKNOWN_ENTRY and refused.server_backlog_s == 0.0
    release.set()
    holder.join(5)
    figures = server.activity()["compute"]
    assert figures["clients"]["a"]["served"] == 1
    assert figures["clients"]["a"]["busy"] + figures["clients"]["a"]["dropped"] == 1
    report = dict(ServerHealth().report(server.activity()).values)
    assert report["compute slots busy"] == "0 of 1"
    assert report["client a"].startswith("1 served, ") and "dropped" in report["client a"]
    # a deadline that is no number of seconds is refused before anything runs
    for bad in (float("nan"), -1.0, 1e9, True):
        resp = server.handle("compute", _forward_request("a", x, bad))
        assert resp.status == StatusCode.BAD_REQUEST and "deadline_s" in resp.status_text
    server.close()


def test_an_idle_server_always_tries_and_one_slow_first_run_is_soon_forgotten():
    """A slow first request (cold caches) must not get every later one refused."""
    clock = _Clock()
    sched = FairScheduler(slots=1, clock=clock)
    with sched.slot("a", ("forward", "m"), 0.0):
        clock.t += 3.0                       # the first run: 3 s
    for _ in range(5):
        with sched.slot("a", ("forward", "m"), 1.0):   # idle: admitted despite 3 s expected
            clock.t += 0.1
    assert sched.expected_s(("forward", "m")) == pytest.approx(0.1)
    assert sched.client_figures("a")["busy"] == 0


def test_requests_of_several_clients_run_as_one_batch_each_getting_its_own_rows():
    server = OffloadServer(ServerConfig(device="cpu", max_batch=4, ops_sandbox=False))
    server.handle("load_model", LoadModelRequest(client_id="a", model="mobilenet_v2"))
    model = server.load("mobilenet_v2").module
    inputs = {c: torch.randn(1, 3, 64, 64) for c in ("r1", "r2", "r3")}
    inputs["r1-again"] = torch.randn(1, 3, 64, 64)
    odd = torch.randn(1, 3, 48, 48)            # another shape: never in their batch
    release, started = threading.Event(), threading.Event()
    holder = _hold(server.scheduler, "other", key=("forward", "mobilenet_v2"), started=started, release=release)
    assert started.wait(5)
    replies = {}

    def send(name, client, x):
        replies[name] = server.handle("compute", _forward_request(client, x, 30.0))
    threads = []
    for name, client, x in (("r1", "r1", inputs["r1"]), ("r2", "r2", inputs["r2"]), ("odd", "r4", odd),
                            ("r3", "r3", inputs["r3"]), ("r1-again", "r1", inputs["r1-again"])):
        threads.append(threading.Thread(target=send, args=(name, client, x), daemon=True))
        threads[-1].start()
        _queued(server.scheduler, len(threads))
    release.set()
    for t in threads + [holder]:
        t.join(60)
    batches = {name: json.loads(r.result_json)["batch"] for name, r in replies.items()}
    # r1 leads and takes r2 and r3 (each the first of its client); r4's other shape and
    # r1's second request run alone
    assert batches == {"r1": 3, "r2": 3, "r3": 3, "odd": 1, "r1-again": 1}, batches
    with torch.inference_mode():
        for name, x in list(inputs.items()) + [("odd", odd)]:
            assert replies[name].status == StatusCode.OK, replies[name].status_text
            torch.testing.assert_close(codec.decode(replies[name].tensors[0]), model(x))
    assert server.activity()["compute"]["clients"]["r2"]["served"] == 1
    server.close()


@pytest.mark.parametrize("wait_s, batch", [(0.0, 1), (1.0, 2)])
def test_a_batch_waits_batch_wait_s_for_another_clients_request_to_join(wait_s, batch):
    """With a free slot the first request leads at once; with ``batch_wait_s`` it holds
    the slot for a request arriving a little later to join its batch."""
    server = OffloadServer(ServerConfig(device="cpu", max_batch=4, batch_wait_s=wait_s))
    server.handle("load_model", LoadModelRequest(client_id="a", model="mobilenet_v2"))
    model = server.load("mobilenet_v2").module
    inputs = {"r1": torch.randn(1, 3, 64, 64), "r2": torch.randn(1, 3, 64, 64)}
    replies = {}

    def send(client):
        replies[client] = server.handle("compute", _forward_request(client, inputs[client], 30.0))
    first = threading.Thread(target=send, args=("r1",), daemon=True)
    first.start()
    end = time.monotonic() + 10
    while server.scheduler.status()["running"] == 0:     # r1 has the slot
        assert time.monotonic() < end
        time.sleep(0.005)
    time.sleep(0.2)
    send("r2")
    first.join(30)
    batches = {c: json.loads(r.result_json)["batch"] for c, r in replies.items()}
    assert batches == {"r1": batch, "r2": batch}, batches
    with torch.inference_mode():
        for c, x in inputs.items():
            assert replies[c].status == StatusCode.OK, replies[c].status_text
            torch.testing.assert_close(codec.decode(replies[c].tensors[0]), model(x))
    server.close()


def test_a_waiting_request_is_cancelled_by_its_own_client_only():
    """A client takes back a request that waits for a slot (a hedge's loser): it answers
    BUSY at once and never computes. Another client cannot take it back, and a started
    one runs to its end."""
    sched = FairScheduler(slots=1)
    release, started = threading.Event(), threading.Event()
    holder = _hold(sched, "a", started=started, release=release)
    assert started.wait(5)
    outcome = []

    def waiter():
        try:
            with sched.slot("b", ("forward", "m"), 30.0, request_id="00ff00ff00ff00ff"):
                outcome.append("ran")
        except RequestRejected as e:
            outcome.append((StatusCode(e.code).name, e.text))
    t = threading.Thread(target=waiter, daemon=True)
    t.start()
    _queued(sched, 1)
    assert sched.cancel("a", "00ff00ff00ff00ff") == "unknown"        # not a's to take back
    assert sched.cancel("b", "0000000000000000") == "unknown"
    assert sched.status()["queued"] == 1
    t0 = time.monotonic()
    assert sched.cancel("b", "00ff00ff00ff00ff") == "cancelled"
    t.join(5)
    assert time.monotonic() - t0 < 2.0
    assert outcome and outcome[0][0] == "BUSY" and "cancelled" in outcome[0][1], outcome
    assert sched.status()["queued"] == 0 and sched.client_figures("b")["cancelled"] == 1
    release.set()
    holder.join(5)
    # one that runs is not taken back
    going, done = threading.Event(), threading.Event()

    def runner():
        with sched.slot("c", ("forward", "m"), 30.0, request_id="abcdefabcdefabcd"):
            going.set()
            done.wait(5)
    r = threading.Thread(target=runner, daemon=True)
    r.start()
    assert going.wait(5)
    assert sched.cancel("c", "abcdefabcdefabcd") == "running"
    done.set()
    r.join(5)
    assert sched.client_figures("c")["served"] == 1


def test_the_cancel_entry_takes_back_only_the_callers_request():
    server = OffloadServer(ServerConfig(device="cpu"))
    try:
        cancel = ComputeRequest(client_id="b", model="", entry="cancel",
                                args_json=json.dumps({"request_id": "1234abcd1234abcd"}))
        r = server.handle("compute", cancel)
        assert r.status == StatusCode.OK and json.loads(r.result_json) == {"state": "unknown"}
        for bad in ('{"request_id": "XYZ"}', '{"request_id": 1}', "{}", '{"request_id": "1234abcd", "x": 1}'):
            r = server.handle("compute", ComputeRequest(client_id="b", model="", entry="cancel", args_json=bad))
            assert r.status == StatusCode.BAD_REQUEST, bad
        r = server.handle("compute", ComputeRequest(client_id="b", model="mobilenet_v2", entry="forward",
                                                    request_id="not-hex"))
        assert r.status == StatusCode.BAD_REQUEST and "request_id" in r.status_text
    finally:
        server.close()
