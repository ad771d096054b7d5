"""Several servers behind one client (robot_offload.pool), in process: calls balanced,
late calls hedged, a lost server survived -- every output still the local model's."""

import contextlib
import threading
import time

import numpy as np
import pytest
import torch

from robot_offload.client import ClientConfig, OffloadClient
from robot_offload.errors import OffloadTimeout, ServerUnavailable
from robot_offload.pool import ServerDirectory, _Member
from robot_offload.server import OffloadServer, ServerConfig
from robot_offload.transport.inproc import InProcessTransport

from schedules import lop_schedules

MODEL = "mobilenet_v2"
SIZE = [64, 64]


class _Server(InProcessTransport):
    """An in-process server that can be slowed down or killed."""

    def __init__(self, server):
        super().__init__(server)
        self.delay_s = 0.0
        self.dead = False
        self.computes = 0

    def _call(self, method, request, timeout_s):
        if self.dead:
            raise ServerUnavailable("killed")
        if method == "compute":
            self.computes += 1
            if self.delay_s:
                time.sleep(min(self.delay_s, timeout_s))
                if self.delay_s >= timeout_s:
                    raise OffloadTimeout("slowed past the deadline")
                timeout_s -= self.delay_s
        return super()._call(method, request, timeout_s)


@pytest.fixture(scope="module")
def servers():
    made = {name: OffloadServer(ServerConfig(device="cpu", ops_sandbox=False)) for name in ("/a", "/b")}
    yield made
    for s in made.values():
        s.close()


def _fleet(servers, names=("/a", "/b"), **config):
    transports = {}

    def connect(name):
        transports[name] = _Server(servers[name])
        return transports[name]

    cfg = ClientConfig(model=MODEL, input_size=SIZE, timeout_s=5.0, **config)
    client = OffloadClient(cfg, ServerDirectory(lambda: list(names), connect))
    assert client.connect(30.0)
    return client, transports


@contextlib.contextmanager
def _slot_held_by_another_robot(server, most_s=30.0):
    """Another client's request holding ``server``'s one compute slot for the ``with``
    body (at most ``most_s``)."""
    held, release = threading.Event(), threading.Event()

    def hold():
        with server.scheduler.slot("another-robot", ("forward", MODEL)):
            held.set()
            release.wait(most_s)

    intruder = threading.Thread(target=hold, daemon=True)
    intruder.start()
    try:
        assert held.wait(5.0)
        yield
    finally:
        release.set()
        intruder.join(5.0)


def _frames(n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (64, 64, 3), dtype=np.uint8) for _ in range(n)]


def _local(client, frame):
    with torch.inference_mode():
        return client.model(client.preprocess(frame))


def test_round_robin_spreads_calls_over_every_server_with_the_local_outputs(servers):
    client, transports = _fleet(servers, mode="full_offload", balance="round_robin", hedge=False)
    try:
        for frame in _frames(8):
            y, stats = client.process(frame)
            assert stats.executed_mode == "full_offload", stats.fallback_reason
            torch.testing.assert_close(y, _local(client, frame))
            assert len(stats.extra["pool"]["servers"]) == 1
        assert transports["/a"].computes == 4 and transports["/b"].computes == 4
        assert client.link.state == "up"
    finally:
        client.close()


def test_least_predicted_latency_sends_most_calls_to_the_fast_server(servers):
    client, transports = _fleet(servers, mode="full_offload", hedge=False)
    transports["/b"].delay_s = 0.3
    try:
        for frame in _frames(12):
            y, stats = client.process(frame)
            torch.testing.assert_close(y, _local(client, frame))
        assert transports["/a"].computes >= 10, client.link.figures()
    finally:
        client.close()


def test_a_server_busy_with_another_robots_work_is_avoided_before_this_client_waits_there(servers):
    """Least predicted latency reads the server's reported wait (pings and replies): a
    server whose slot another client holds is avoided without this client first paying
    for a call there."""
    client, transports = _fleet(servers, mode="full_offload", hedge=False)
    try:
        for frame in _frames(6):                 # both servers measured idle
            client.process(frame)
        with _slot_held_by_another_robot(servers["/a"]):
            time.sleep(4 * client.link.load_probe_s)  # a few load reports
            before = transports["/a"].computes
            for frame in _frames(8, seed=4):
                y, stats = client.process(frame)
                assert stats.executed_mode == "full_offload", stats.fallback_reason
                assert stats.extra["pool"]["servers"] == ["/b"], client.link.figures()
                torch.testing.assert_close(y, _local(client, frame))
            assert transports["/a"].computes == before
    finally:
        client.close()


def _latencies(client, frames, gap_s=0.05):
    out = []
    for frame in frames:
        y, stats = client.process(frame)
        assert stats.executed_mode == "full_offload", stats.fallback_reason
        torch.testing.assert_close(y, _local(client, frame))
        out.append(stats.processing_s)
        time.sleep(gap_s)
    return out


@pytest.mark.parametrize("hedge", [True, False])
def test_a_call_to_a_slow_server_is_hedged_and_the_first_answer_wins(servers, hedge):
    client, transports = _fleet(servers, mode="full_offload", hedge=hedge, hedge_budget=0.5)
    client.link.explore_after_s = 0.3          # try the slow server again often
    try:
        _latencies(client, _frames(10, seed=1), gap_s=0.0)      # measure both
        transports["/b"].delay_s = 1.5
        before = transports["/b"].computes
        latencies = _latencies(client, _frames(24, seed=2))
        figures = client.link.figures()
        slow_calls = transports["/b"].computes - before
        if hedge:
            # the slow server was tried again (a frame hedged, or a copy exploring it) ...
            assert slow_calls >= 1 and figures.get("hedges", 0) >= 1, figures
            # ... and no frame waited for it
            assert figures["hedges"] <= 0.5 * figures["calls"] + 1
            assert max(latencies) < 1.2, (latencies, figures)
            assert figures["hedge_bytes_up"] > 0
        else:
            # the same run without hedging waits for the slow server whenever it tries it
            assert slow_calls >= 1 and max(latencies) >= 1.4, (latencies, figures)
    finally:
        client.close()


@pytest.mark.parametrize("mode", ["full_offload", "layer_partition", "record_replay"])
def test_a_killed_server_is_survived_on_the_other_with_the_local_outputs(servers, mode):
    client, transports = _fleet(servers, mode=mode, hedge=False)
    try:
        frames = _frames(14, seed=3)
        for frame in frames[:5]:
            y, stats = client.process(frame)
            torch.testing.assert_close(y, _local(client, frame), rtol=1e-4, atol=1e-4)
        home = client.link.home.name if mode == "record_replay" else "/a"
        transports[home].dead = True
        after = []
        for frame in frames[5:]:
            y, stats = client.process(frame)
            torch.testing.assert_close(y, _local(client, frame), rtol=1e-4, atol=1e-4)
            assert stats.processing_s < client.config.timeout_s + 2.0
            after.append(stats.executed_mode)
        # at most one frame computed locally while the session moved; the rest offloaded
        assert after.count(mode) >= len(after) - 1, after
        if mode == "record_replay":
            assert client.link.home.name != home
            assert stats.phase == "replaying", stats.phase
    finally:
        client.close()


def test_a_busy_server_sends_the_call_to_the_other(servers):
    client, transports = _fleet(servers, mode="full_offload", balance="round_robin", hedge=False)
    try:
        client.process(_frames(1)[0])
        # /a's one compute slot is taken by another robot's long request
        import threading
        release, started = threading.Event(), threading.Event()

        def hold():
            with servers["/a"].scheduler.slot("other robot", ("forward_image", MODEL)):
                started.set()
                release.wait(10)
        holder = threading.Thread(target=hold, daemon=True)
        holder.start()
        assert started.wait(5)
        time.sleep(0.6)       # it has run longer than the client will wait
        client.config.timeout_s = 0.5
        for frame in _frames(4, seed=4):
            y, stats = client.process(frame)
            assert stats.executed_mode == "full_offload", stats.fallback_reason
            torch.testing.assert_close(y, _local(client, frame))
        release.set()
        holder.join(5)
        assert client.link.figures().get("failovers", 0) >= 1
    finally:
        client.close()


def test_a_reported_wait_that_is_no_number_of_seconds_is_ignored():
    member = _Member("/x", link=None)
    for bad in (float("nan"), float("inf"), -1.0, 1e9, True, "0.5", None):
        member.note_backlog(bad, now=1.0)
        assert member.backlog_at == float("-inf"), bad
    member.note_backlog(0.25, now=2.0)
    assert (member.backlog_s, member.backlog_at) == (0.25, 2.0)


def test_no_hedge_goes_to_a_server_that_would_answer_no_sooner(servers):
    """A late call is copied to a second server only once it has waited longer than that
    server is predicted to take, its reported queue included: a copy to a server busy with
    other robots' work would only add to it."""
    client, transports = _fleet(servers, mode="full_offload", hedge=True, hedge_budget=0.5)
    # No copy re-measures a server left unused meanwhile (on a loaded machine /b may be
    # idle past explore_after_s before the last frames): only hedges are under test here.
    client.link.explore_after_s = 600.0
    try:
        _latencies(client, _frames(16, seed=5), gap_s=0.0)      # both measured, fast
        transports["/a"].delay_s = 0.4
        with _slot_held_by_another_robot(servers["/b"]):
            time.sleep(1.0 + 4 * client.link.load_probe_s)      # /b's wait grows and is reported
            before = client.link.figures().get("hedges", 0)
            # the calls to /a are late: a hedge is due
            assert client.link._hedge_delay_s("forward_image") < 0.2
            for frame in _frames(4, seed=6):
                y, stats = client.process(frame)
                assert stats.executed_mode == "full_offload", stats.fallback_reason
                assert stats.extra["pool"]["servers"] == ["/a"], client.link.figures()
                torch.testing.assert_close(y, _local(client, frame))
            assert client.link.figures().get("hedges", 0) == before
    finally:
        client.close()


def test_lop_parts_the_robot_joins_are_balanced_and_hedged_and_pairs_stay_home(servers, tmp_path):
    """A lop frame whose rows the robot joins is one request that keeps nothing on the
    server: any server may answer it, and a late one is hedged. A frame joined on the
    server is a pair (the stripe waits there for B), so both go to the home server. Each
    output equals local."""
    from robot_offload.stats import FrameStats
    client, transports = _fleet(servers, mode="lop", balance="round_robin", hedge=False,
                                profile_dir=str(tmp_path))
    try:
        backend, x, ref, plans = lop_schedules(client)
        home = client.link.home.name
        # the graph capture at this shape goes to every server, the others not waited for
        before = {k: t.computes for k, t in transports.items()}
        backend._prepare(backend.lop_state(x), tuple(x.shape), 30.0)
        waited = time.monotonic() + 30.0
        while any(t.computes == before[k] for k, t in transports.items()) and time.monotonic() < waited:
            time.sleep(0.05)
        assert {k: t.computes - before[k] for k, t in transports.items()} == {"/a": 1, "/b": 1}

        def run(plan, n):
            before = {k: t.computes for k, t in transports.items()}
            used, latencies = [], []
            for _ in range(n):
                stats = FrameStats()
                t0 = time.perf_counter()
                y = backend.run_schedule(x, plan, stats, 10.0)
                latencies.append(time.perf_counter() - t0)
                torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4)
                used.append(client.link.take_frame_report()["servers"])
            return used, {k: t.computes - before[k] for k, t in transports.items()}, latencies

        used, calls, _ = run(plans[True], 6)
        assert calls["/a"] >= 2 and calls["/b"] >= 2, (used, calls)     # balanced
        used, calls, _ = run(plans[False], 4)
        assert all(u == [home, home] for u in used), used                  # a pair, at home
        assert calls[home] == 8 and sum(calls.values()) == 8, calls
        # hedged: one server slowed past the hedge delay; no frame waits for it
        client.link.hedge, client.link.hedge_budget = True, 0.5
        other = "/b" if home == "/a" else "/a"
        transports[other].delay_s = 1.5
        used, calls, latencies = run(plans[True], 8)
        figures = client.link.figures()
        assert figures.get("hedges_won", 0) >= 1, (used, figures)
        # a hedge does not take the next frame's turn: frames still alternate
        assert [u[0] for u in used[:4]] in (["/a", "/b"] * 2, ["/b", "/a"] * 2), used
        assert max(latencies) < 1.2, (latencies, used, figures)
    finally:
        client.close()


def test_a_late_lop_pair_is_hedged_by_the_robot(servers, tmp_path):
    """A pair stays on the home server, so no other server can hedge it: when the home
    server is late, the robot runs the rest of the frame itself, its outputs are local's,
    and both requests are taken back."""
    from robot_offload.pool import MIN_SAMPLES
    from robot_offload.stats import FrameStats
    client, transports = _fleet(servers, mode="lop", hedge=True, hedge_budget=0.5,
                                profile_dir=str(tmp_path))
    try:
        assert client._ctx.local_hedge is None and client._ctx.home_hedge is not None
        backend, x, ref, plans = lop_schedules(client, client._get_backend("lop"))
        home = client.link.home.name
        transports[home].delay_s = 0.2
        for _ in range(MIN_SAMPLES + 3):
            stats = FrameStats()
            y = backend.run_schedule(x, plans[False], stats, 10.0)
            torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4)
            assert stats.executed_mode != "local" and stats.extra["lop"]["join"] == "server", stats.extra
        computes = transports[home].computes
        transports[home].delay_s = 3.0
        stats = FrameStats()
        t0 = time.perf_counter()
        y = backend.run_schedule(x, plans[False], stats, 10.0)
        assert time.perf_counter() - t0 < 2.0
        assert stats.executed_mode == "local" and stats.extra["hedge"]["won"] == "local", stats.extra
        assert stats.extra["lop"]["hedged"], stats.extra
        torch.testing.assert_close(y, ref, rtol=0, atol=0)
        deadline = time.monotonic() + 2.0        # A, B and their two cancels reached home
        while transports[home].computes < computes + 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert transports[home].computes == computes + 4
    finally:
        client.close()


def test_a_hedges_loser_still_waiting_for_a_slot_is_cancelled_there(servers):
    """The first answer wins and the loser is taken back: where it still waits for a
    compute slot (another robot's request holds /a's), /a drops it without computing it."""
    client, transports = _fleet(servers, mode="full_offload", balance="round_robin", hedge=True,
                                hedge_budget=0.5)
    cid = client.config.client_id
    try:
        _latencies(client, _frames(12, seed=8), gap_s=0.0)      # round trips for the hedge delay
        before = servers["/a"].scheduler.client_figures(cid)
        with _slot_held_by_another_robot(servers["/a"]):
            latencies = _latencies(client, _frames(4, seed=9), gap_s=0.0)
            # every cancel arrives while the slot is still held (nothing else queues at /a)
            waited = time.monotonic() + 10.0
            while ((servers["/a"].scheduler.client_figures(cid)["cancelled"] == before["cancelled"]
                    or servers["/a"].scheduler.status()["queued"] > 0) and time.monotonic() < waited):
                time.sleep(0.02)
            during = servers["/a"].scheduler.client_figures(cid)
        time.sleep(0.5)               # the pool counts a cancel once its answer is back
        after = servers["/a"].scheduler.client_figures(cid)
        figures = client.link.figures()
        assert figures.get("hedges_won", 0) >= 1, figures
        assert during["cancelled"] > before["cancelled"], (before, during)
        assert figures.get("cancelled", 0) == after["cancelled"] - before["cancelled"], (figures, after)
        # what was cancelled never ran once the slot was free
        assert after["served"] == during["served"] and during["served"] == before["served"], (before, after)
        assert max(latencies) < 2.0, latencies
    finally:
        client.close()
