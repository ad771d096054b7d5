"""With one server, a late ``full_offload`` call is hedged by the robot: it computes the
frame itself and the first answer wins (the server's copy cancelled, or the robot's
forward stopped), within the hedge budget (half the calls here) and only where the robot
can win."""

import threading
import time

import numpy as np
import pytest
import torch

from robot_offload.client import ClientConfig, OffloadClient
from robot_offload.local_hedge import STALL_WINDOW_S, LocalHedge, _Download, _Upload, forward_unless
from robot_offload.pool import MIN_SAMPLES
from robot_offload.transport.inproc import InProcessTransport

from devices import assert_same_as_local


class _SlowLink(InProcessTransport):
    """Every compute call takes ``link_s`` more; ``late_s`` more for the next ``late`` calls."""

    def __init__(self, server, link_s):
        super().__init__(server)
        self.link_s, self.late_s, self.late = link_s, 0.0, 0
        self.cancelled, self.request_ids = [], []
        self._lock = threading.Lock()

    def _call(self, method, request, timeout_s):
        if method == "compute" and request.entry == "cancel":
            self.cancelled.append(request.args_json)
        elif method == "compute":
            with self._lock:
                extra = self.late_s if self.late > 0 else 0.0
                self.late -= 1
            self.request_ids.append(request.request_id)
            time.sleep(self.link_s + extra)
        return super()._call(method, request, timeout_s)


class _FadingUpload(_SlowLink):
    """A :class:`_SlowLink` that also says how far each call's upload has got: all of it
    at once, or, for the next ``fading`` calls, ``fade_bps`` from when the call began."""

    def __init__(self, server, link_s):
        super().__init__(server, link_s)
        self.fade_bps, self.fading = 0.0, 0
        self._began = {}        # request_id -> (time the call began, fading)
        self.abandoned = []

    def _call(self, method, request, timeout_s):
        if method == "compute" and request.request_id and request.entry != "cancel":
            with self._lock:
                fading = self.fading > 0 and self.late > 0
                self.fading -= 1
            self._began[request.request_id] = (time.perf_counter(), fading)
        return super()._call(method, request, timeout_s)

    def abandon(self, request_id):
        self.abandoned.append(request_id)
        return True

    def upload_acked(self, request_id):
        began = self._began.get(request_id)
        if began is None:
            return None
        if not began[1]:
            return 10 ** 9
        return int((time.perf_counter() - began[0]) * self.fade_bps / 8)


class _FadingAnswer(_FadingUpload):
    """A :class:`_FadingUpload` whose uploads go through at once and whose answers, for
    the next ``fading`` late calls, arrive at ``fade_bps`` from 50 ms into the call (the
    server's compute before that); other answers cannot be watched."""

    def upload_acked(self, request_id):
        return 10 ** 9 if request_id in self._began else None

    def download_received(self, request_id):
        began = self._began.get(request_id)
        if began is None or not began[1]:
            return None
        return int(max(0.0, time.perf_counter() - began[0] - 0.05) * self.fade_bps / 8)


def _client(server, link_s, link_type=None, **kw):
    transport = (link_type or _SlowLink)(server, link_s)
    cfg = dict(model="resnet18", mode="full_offload", input_size=(64, 64), load_timeout_s=120,
               timeout_s=10, hedge_budget=0.5)
    cfg.update(kw)
    client = OffloadClient(ClientConfig(**cfg), transport)
    assert client.connect(), client.link.last_error
    client.warm_up()
    return client, transport


def _frame(seed):
    return np.random.default_rng(seed).integers(0, 256, (64, 64, 3), dtype=np.uint8)


def test_a_late_call_is_answered_by_the_robot_and_cancelled_on_the_server(shared_server):
    client, link = _client(shared_server, link_s=0.3)     # round trips well above a local forward
    try:
        for k in range(MIN_SAMPLES + 4):      # the round trips (one a little late may be hedged)
            _, stats = client.process(_frame(k))
            assert stats.executed_mode in ("full_offload", "local") and not stats.fallback_reason
        frame = _frame(99)
        with torch.inference_mode():
            ref = client.model(client.preprocess(frame))
        cancelled = len(link.cancelled)
        link.late_s, link.late = 3.0, 1
        y, stats = client.process(frame)
        assert stats.executed_mode == "local", stats.extra
        assert stats.extra["hedge"]["won"] == "local" and not stats.fallback_reason
        assert stats.processing_s < 2.0
        torch.testing.assert_close(y, ref, rtol=0, atol=0)
        assert len(link.cancelled) == cancelled + 1 and link.request_ids[-1] in link.cancelled[-1]
        figures = client._ctx.local_hedge.figures
        assert figures["hedges"] >= 1 and figures["local_won"] >= 1
    finally:
        client.close()


@pytest.mark.parametrize("where, budget, warm", [("upload", 0.5, True), ("download", 0.5, True),
                                                 ("upload", 0.0, True), ("upload", 0.5, False)])
def test_a_stalled_transfer_starts_the_robot_before_the_call_is_late(shared_server, where, budget, warm):
    """The link fades under a frame's upload, or, once that went through, under its
    answer: the robot starts once the transfer's rate says the rest would take longer
    than the robot's whole frame (a poll or two past the window, counted from the
    answer's first bytes), not at the percentile of the round trips (0.6 s here); its
    answer is the local one, the call is abandoned (no cancel needed: the server never had
    the request whole, or its answer is dropped), and the frame's details say how far the
    transfer had got. The budget bounds the late rule only: with none, a stall still
    starts the robot; and so it does on the first call, before any round trip is known."""
    client, link = _client(shared_server, link_s=0.6, hedge_budget=budget,
                           link_type=_FadingUpload if where == "upload" else _FadingAnswer)
    try:
        for k in range(MIN_SAMPLES + 4 if warm else 0):
            client.process(_frame(k))
        frame = _frame(98)
        with torch.inference_mode():
            ref = client.model(client.preprocess(frame))
        cancelled = len(link.cancelled)
        link.late_s, link.late, link.fade_bps, link.fading = 3.0, 1, 8e3, 1   # 1 kB/s
        y, stats = client.process(frame)
        assert stats.executed_mode == "local" and not stats.fallback_reason, stats.extra
        hedge = stats.extra["hedge"]
        assert hedge["won"] == "local" and set(hedge) & {"upload", "download"} == {where}, hedge
        assert STALL_WINDOW_S * 1e3 <= hedge["robot_started_after_ms"] < 450, hedge
        moved = hedge[where]
        done = moved["acked_bytes" if where == "upload" else "received_bytes"]
        assert 0 < done < moved["of_bytes"] and moved["rate_bps"] < 20e3, moved
        assert where == "upload" or moved["for_ms"] >= STALL_WINDOW_S * 1e3, moved
        torch.testing.assert_close(y, ref, rtol=0, atol=0)
        assert hedge["upload_abandoned" if where == "upload" else "answer_abandoned"], hedge
        assert link.abandoned == [link.request_ids[-1]] and len(link.cancelled) == cancelled
        assert stats.processing_s < 1.5
    finally:
        client.close()


def test_a_late_call_whose_upload_is_under_way_is_a_bandwidth_sample(shared_server, monkeypatch):
    """The late rule starts the robot before the upload's rate could be judged (the stall
    rule is kept out of the way here): how far the upload had got is in the frame's details
    all the same, and the bandwidth monitor takes it as a rate of the link."""
    import robot_offload.local_hedge as local_hedge
    from robot_offload import bandwidth
    monkeypatch.setattr(local_hedge, "STALL_WINDOW_S", 60.0)
    client, link = _client(shared_server, link_s=0.15, link_type=_FadingUpload)
    try:
        for k in range(MIN_SAMPLES + 4):
            client.process(_frame(k))
        link.late_s, link.late, link.fade_bps, link.fading = 3.0, 1, 80e3, 1   # 10 kB/s
        _, stats = client.process(_frame(96))
        hedge = stats.extra["hedge"]
        assert hedge["won"] == "local" and "upload" not in hedge, hedge
        moved = hedge["upload_under_way"]
        assert 0 < moved["acked_bytes"] < moved["of_bytes"], moved
        sample = bandwidth.frame_transfer(stats, 1.0)
        assert sample is not None and sample.acked and sample.bytes == moved["acked_bytes"]
        assert 20e3 < sample.bytes * 8 / sample.duration_s < 200e3, sample
    finally:
        client.close()


def test_an_upload_that_went_through_waits_for_the_late_rule(shared_server):
    """The same late frame whose upload the server's host acknowledged at once: what is
    slow is the server, so the robot starts at the percentile, as without upload readings."""
    client, link = _client(shared_server, link_s=0.6, link_type=_FadingUpload)
    try:
        for k in range(MIN_SAMPLES + 4):
            client.process(_frame(k))
        link.late_s, link.late = 3.0, 1
        _, stats = client.process(_frame(97))
        hedge = stats.extra["hedge"]
        assert hedge["won"] == "local" and "upload" not in hedge, hedge
        assert hedge["robot_started_after_ms"] >= 550, hedge
        # it went through: the server's copy is cancelled, not abandoned
        assert "upload_abandoned" not in hedge and not link.abandoned and link.cancelled
    finally:
        client.close()


def test_a_jpeg_frame_the_robot_answered_is_not_labelled_lossy(shared_server):
    """With JPEG frames asked for, a late call answered by the robot's hedge returns the
    robot's exact outputs: the frame is not labelled lossy, while the offloaded ones are."""
    from robot_offload.camera import natural_image
    client, link = _client(shared_server, link_s=0.3, input_jpeg_quality=90)
    try:
        for k in range(MIN_SAMPLES + 4):
            _, stats = client.process(natural_image(64, 64, seed=k))
            if stats.executed_mode == "full_offload":
                assert stats.extra["lossy_input"]["quality"] == 90, stats.plan
        frame = natural_image(64, 64, seed=99)
        with torch.inference_mode():
            ref = client.model(client.preprocess(frame))
        link.late_s, link.late = 3.0, 1
        y, stats = client.process(frame)
        assert stats.executed_mode == "local" and stats.extra["hedge"]["won"] == "local", stats.extra
        assert "lossy_input" not in stats.extra
        torch.testing.assert_close(y, ref, rtol=0, atol=0)
    finally:
        client.close()


def test_a_server_answering_first_stops_the_robots_forward(shared_server):
    client, link = _client(shared_server, link_s=0.3)
    try:
        for k in range(MIN_SAMPLES + 4):
            client.process(_frame(k))
        cancelled = len(link.cancelled)
        frame = _frame(7)
        with torch.inference_mode():
            ref = client.model(client.preprocess(frame))
        modules_run = []

        def slow(_module, _args):                   # the robot is slow this time: ~60 x 50 ms
            modules_run.append(1)
            time.sleep(0.05)
        handle = client.model.register_forward_pre_hook(slow)
        for m in client.model.modules():
            m.register_forward_pre_hook(slow)
        link.late_s, link.late = 0.4, 1             # late past the percentile, then answers
        try:
            y, stats = client.process(frame)
        finally:
            handle.remove()
            for m in client.model.modules():
                m._forward_pre_hooks.clear()
        assert stats.executed_mode == "full_offload", stats.fallback_reason
        assert stats.extra.get("hedge", {}).get("won") == "server", (stats.processing_s, stats.extra, client._ctx.local_hedge._round_trips, client._ctx.local_hedge._local_s)
        assert stats.processing_s < 1.5
        assert 0 < len(modules_run) < len(list(client.model.modules()))
        assert_same_as_local(y, ref, "the server's answer")
        assert len(link.cancelled) == cancelled
    finally:
        client.close()


@pytest.mark.robot_side
def test_the_robot_hedges_only_where_it_can_win():
    hedge = LocalHedge(percentile=95.0, budget=0.5)
    for _ in range(MIN_SAMPLES - 1):
        hedge.observe_round_trip("f", 0.1)
    hedge.observe_local(0.05)
    hedge.count(False)
    hedge.count(False)                               # two calls so far, neither hedged
    assert hedge.delay_s("f", 1.0) is None          # too few round trips measured
    hedge.observe_round_trip("f", 0.1)
    assert hedge.delay_s("f", 1.0) == 0.1
    assert hedge.delay_s("f", 0.12) is None         # no time left for the robot
    assert hedge.delay_s("other call", 1.0) == 0.1   # none of its own yet: all kinds' round trips
    for _ in range(MIN_SAMPLES - 1):
        hedge.observe_round_trip("other call", 0.3)
    assert hedge.delay_s("other call", 1.0) == 0.3   # all kinds' 95th percentile, its 7 among them
    hedge.observe_round_trip("other call", 0.3)
    assert hedge.delay_s("f", 1.0) == 0.1 and hedge.delay_s("other call", 1.0) == 0.3   # each its own
    assert hedge.delay_s("new call", 0.32) is None   # the percentile of all (0.3) leaves no time
    assert hedge.delay_s("f", 1.0, local_s=0.02) == 0.1
    assert hedge.delay_s("f", 1.0, local_s=0.07) == pytest.approx(0.14)
    slow = LocalHedge(percentile=95.0, budget=0.5)
    for _ in range(MIN_SAMPLES):
        slow.observe_round_trip("f", 0.1)
    slow.count(False)
    slow.count(False)
    slow.observe_local(0.06)                         # more than half a late answer: it waits longer
    assert slow.delay_s("f", 10.0) == pytest.approx(0.12) and slow.delay_s("f", 0.17) is None
    hedge.count(True, "local")
    assert hedge.delay_s("f", 1.0) is None           # one more: 2 hedges in 3 calls
    hedge.count(False)                               # one more: 2 of 4, half
    assert hedge.delay_s("f", 1.0) == 0.1


@pytest.mark.robot_side
def test_an_upload_is_stalled_when_its_rest_outlasts_the_robot():
    local_s = 0.2
    up = _Upload(100_000)                      # 800 kbit
    assert not up.stalled(0.0, 0, local_s)
    assert not up.stalled(0.05, 5_000, local_s)    # under the window: no rate yet
    # 100 kB/s (0.8 Mbit/s) over 0.1 s: the other 90 kB take 0.9 s > 0.2 s
    assert up.stalled(0.1, 10_000, local_s)
    assert up.stalled_at == {"acked_bytes": 10_000, "of_bytes": 100_000, "after_ms": 100.0,
                             "rate_bps": 800_000}
    quick = _Upload(100_000)
    for t, acked in ((0.0, 0), (0.05, 30_000), (0.1, 60_000)):   # 4.8 Mbit/s: 40 kB in 67 ms
        assert not quick.stalled(t, acked, local_s)
    assert not quick.stalled(0.15, 100_000, local_s) and not quick.readable   # sent
    # the rate of the latest window, not since the start: fast, then a fade
    fade = _Upload(1_000_000)
    for t, acked in ((0.0, 0), (0.1, 400_000), (0.2, 800_000)):
        assert not fade.stalled(t, acked, local_s)
    assert not fade.stalled(0.25, 801_000, local_s)   # the window still reaches back to 0.1 s
    assert fade.stalled(0.31, 802_000, local_s)      # 2 kB in the 0.11 s since 0.2 s
    unknown = _Upload(1000)
    assert not unknown.stalled(0.05, None, local_s) and unknown.readable
    assert not unknown.stalled(0.1, None, local_s) and not unknown.readable
    # a watch that begins late in the call (lop: after the robot's stripe) gives the
    # transport its window from then on
    late = _Upload(1000, watch_from_s=0.3)
    assert not late.stalled(0.35, None, local_s) and late.readable
    # the answer: nothing counts until its first bytes, then the same rule
    answer = _Download(100_000)
    assert not answer.stalled(0.3, 0, local_s) and not answer.stalled(0.5, 0, local_s) and answer.readable
    assert not answer.stalled(0.55, 1_000, local_s)
    assert answer.stalled(0.66, 2_000, local_s)           # 1 kB in 0.11 s: 98 kB left
    assert answer.stalled_at == {"received_bytes": 2_000, "of_bytes": 100_000, "after_ms": 660.0,
                                 "rate_bps": round(8_000 / 0.11), "for_ms": 110.0}
    blind = _Download(100_000)
    assert not blind.stalled(0.3, None, local_s) and not blind.readable


@pytest.mark.robot_side
def test_bytes_acked_counts_what_the_peer_acknowledged():
    import socket
    from robot_offload.transport.tcp import bytes_acked, bytes_received
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        with socket.create_connection(listener.getsockname()) as sender:
            receiver, _ = listener.accept()
            with receiver:
                before = bytes_acked(sender)
                assert before is not None
                received_before = bytes_received(receiver)
                sender.sendall(b"x" * 300_000)
                got = 0
                while got < 300_000:
                    got += len(receiver.recv(1 << 16))
                assert bytes_received(receiver) - received_before == 300_000
                deadline = time.monotonic() + 5
                while bytes_acked(sender) - before < 300_000 and time.monotonic() < deadline:
                    time.sleep(0.01)
                assert bytes_acked(sender) - before == 300_000
        assert bytes_acked(sender) is None           # closed
    assert bytes_acked(None) is None


@pytest.mark.robot_side
@pytest.mark.parametrize("aborted", [False, True])
def test_an_aborted_upload_is_dropped_not_sent_on(aborted):
    """A plain close goes on sending what the socket holds (the peer reads it all); closed
    after ``abort`` the connection is reset and the rest never arrives."""
    import socket
    from robot_offload.transport.tcp import abort
    payload = 8 << 20                                   # more than the socket buffers hold
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        sender = socket.create_connection(listener.getsockname())
        receiver, _ = listener.accept()
        with receiver:
            sender.setblocking(False)
            queued = 0
            try:
                while queued < payload:
                    queued += sender.send(b"x" * (1 << 16))
            except BlockingIOError:
                pass                                       # the buffers are full
            if aborted:
                abort(sender)
            sender.close()
            receiver.settimeout(5)
            got, reset = 0, False
            try:
                while True:
                    chunk = receiver.recv(1 << 16)
                    if not chunk:
                        break
                    got += len(chunk)
            except ConnectionResetError:
                reset = True
    if aborted:
        assert reset and got < queued, (got, queued)
    else:
        assert not reset and got == queued, (got, queued)
    abort(sender)                                         # closed: ignored


@pytest.mark.robot_side
def test_forward_unless_stops_at_the_next_module():
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(5)])
    x = torch.rand(1, 4)
    calls = []
    assert forward_unless(model, x, lambda: calls.append(1) or len(calls) > 3) is None
    assert len(calls) == 4
    with torch.inference_mode():
        torch.testing.assert_close(forward_unless(model, x, lambda: False), model(x), rtol=0, atol=0)


def test_no_hedge_when_hedging_is_off(shared_server):
    client, _ = _client(shared_server, link_s=0.0, hedge=False)
    try:
        assert client._ctx.local_hedge is None
        _, stats = client.process(_frame(1))
        assert stats.executed_mode == "full_offload"
    finally:
        client.close()


@pytest.mark.parametrize("new_cut", [False, True], ids=["same_cut", "new_cut"])
def test_a_late_partition_tail_is_finished_on_the_robot(shared_server, tmp_path, new_cut):
    """``layer_partition`` at a middle cut: when the tail's call is late, the robot runs the
    tail on its own head tensors, and the outputs are local's. Also at a cut whose first
    call that is (the plan moved): late by the round trips of the client's other cuts."""
    from robot_offload.partition.graph import INPUT_CUT, OUTPUT_CUT
    from robot_offload.partition.planner import plan_for
    from robot_offload.stats import FrameStats
    client, link = _client(shared_server, link_s=0.3, mode="layer_partition",
                           profile_dir=str(tmp_path), partition_codecs=("raw",))
    try:
        backend = client._get_backend("layer_partition")
        backend.calibration_inputs, backend.profile_repeats = 1, 1
        x = client.spec.example_input(client.input_size, seed=3)
        with torch.inference_mode():
            ref = client.model(x)
        st = backend.state(x)
        plans = [plan_for(st.profile, c.id, sorted(c.bytes)[0], 20e6, st.cfg) for c in st.profile.candidates
                 if c.kind not in (INPUT_CUT, OUTPUT_CUT)]
        plans = [p for p in plans if not backend.cut_of(p).statics]
        plan = plans[len(plans) // 2]
        for _ in range(MIN_SAMPLES + 4):        # its round trips (~0.3 s)
            y = backend.run_plan(x, plan, FrameStats(), 10.0)
        if new_cut:
            plan = plans[len(plans) // 2 + 1]
        link.late_s, link.late = 3.0, 1
        stats = FrameStats()
        t0 = time.perf_counter()
        y = backend.run_plan(x, plan, stats, 10.0)
        assert time.perf_counter() - t0 < 2.0
        assert stats.executed_mode == "local" and stats.extra["hedge"]["won"] == "local", stats.extra
        assert stats.extra["partition"]["server_compute_s"] is None
        assert_same_as_local(y, ref, "the tail on the robot")
    finally:
        client.close()


@pytest.mark.parametrize("robot_joins,stalled", [(True, False), (False, False), (False, True)],
                         ids=["robot_joins", "pair", "pair_stalled"])
def test_a_late_lop_frame_is_finished_on_the_robot(shared_server, tmp_path, robot_joins, stalled):
    """A spatial ``lop`` frame: its transfer A (and B, for a pair the server joins) went
    out before the robot computed its stripe. When the answers are late, the robot runs
    the rest of the model from the region's first cut on its own tensors, and the outputs
    are local's; every request of the frame is taken back (cancelled, or, when the
    uploads stalled, abandoned, the robot starting on the stall, not at the late rule)."""
    from robot_offload.stats import FrameStats
    from schedules import lop_schedules
    client, link = _client(shared_server, link_s=0.2, link_type=_FadingUpload, mode="lop",
                           model="mobilenet_v2", profile_dir=str(tmp_path), partition_codecs=("raw",))
    try:
        backend, x, ref, plans = lop_schedules(client, client._get_backend("lop"))
        plan = plans[robot_joins]
        for _ in range(MIN_SAMPLES + 3):       # its round trips (~0.2 s a request)
            stats = FrameStats()
            assert_same_as_local(backend.run_schedule(x, plan, stats, 10.0), ref, "served")
            assert stats.extra["lop"]["spatial"] and stats.executed_mode != "local", stats.extra
        requests = 1 if robot_joins else 2
        cancelled = len(link.cancelled)
        link.late_s, link.late = 3.0, requests
        if stalled:
            link.fade_bps, link.fading = 8e3, requests       # 1 kB/s
        stats = FrameStats()
        t0 = time.perf_counter()
        y = backend.run_schedule(x, plan, stats, 10.0)
        assert time.perf_counter() - t0 < 2.0
        hedge = stats.extra["hedge"]
        assert stats.executed_mode == "local" and hedge["won"] == "local", stats.extra
        assert stats.extra["lop"]["hedged"] and stats.round_trips == requests, stats.extra
        torch.testing.assert_close(y, ref, rtol=0, atol=0)
        sent = link.request_ids[-requests:]
        if stalled:
            upload = hedge["upload"]
            assert 0 < upload["acked_bytes"] < upload["of_bytes"], upload
            assert upload["of_bytes"] == stats.extra["lop"]["bytes_a"] + stats.extra["lop"]["bytes_b"]
            assert hedge["upload_abandoned"] and link.abandoned == sent, (link.abandoned, sent)
            assert len(link.cancelled) == cancelled
        else:
            assert "upload" not in hedge and not link.abandoned, hedge
            assert all(rid and any(rid in c for c in link.cancelled[cancelled:]) for rid in sent), link.cancelled
        # on time again: the server's answers are used
        time.sleep(3.5)
        stats = FrameStats()
        assert_same_as_local(backend.run_schedule(x, plan, stats, 10.0), ref, "served again")
        # (a hedge the server won is fine: this frame's round trip may just pass the percentile)
        assert stats.executed_mode != "local" and stats.extra.get("hedge", {}).get("won", "server") == "server", \
            stats.extra
    finally:
        client.close()
