"""Testbed pieces that need no root: qdisc parameters, names, the loopback fallback."""

import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from robot_offload.testbed import TestbedError, TraceReplayer, delay_link, netns, traces
from robot_offload.testbed._common import owner_pid, pid_alive, unique_base


def test_sizes_at_10_mbit():
    # 10 Mbit/s = 1.25 MB/s: burst 20 ms = 25000 B; queue 200 ms = 250000 B + burst
    assert netns.shaper_sizes(10e6) == (10_000_000, 25_000, 275_000)


def test_sizes_floors_at_low_rates():
    # 100 kbit/s: 20 ms and 200 ms are less than a few frames, so the floors apply
    assert netns.shaper_sizes(100e3) == (100_000, 3 * 1514, 32 * 1514 + 3 * 1514)
    # with GSO the queue must hold three of the largest packets
    assert netns.shaper_sizes(100e3, gso_max_bytes=65536)[2] == 3 * 65536 + 3 * 1514
    assert netns.shaper_sizes(0)[0] == int(netns.MIN_RATE_BPS)  # zero is clamped
    with pytest.raises(ValueError):
        netns.clamp_rate(float("inf"))


def test_htb_batch_create_and_change():
    create = netns.shaping_batch("veth-robot", 10e6)
    assert create == [
        "qdisc add dev veth-robot root handle 1: htb default 1",
        "class add dev veth-robot parent 1: classid 1:1 htb rate 10000000bit "
        "ceil 10000000bit burst 25000 cburst 25000 quantum 65536",
        "qdisc add dev veth-robot parent 1:1 handle 10: bfifo limit 275000"]
    change = netns.shaping_batch("veth-robot", 20e6, create=False)
    assert [line.split()[:2] for line in change] == [["class", "change"],
                                                      ["qdisc", "change"]]
    assert "rate 20000000bit ceil 20000000bit" in change[0]


def test_netem_leaf_and_tbf_batches():
    # 100 Mbit/s: queue (2500000 + 250000 B) / 1514 B = 1816.4 -> 1817 packets
    lines = netns.shaping_batch("v", 100e6, delay_s=0.005)
    assert lines[-1] == "qdisc add dev v parent 1:1 handle 10: netem delay 5000us limit 1817"
    assert netns.shaping_batch("v", 10e6, qdisc="tbf", create=False) == [
        "qdisc change dev v root tbf rate 10000000bit burst 25000 limit 275000"]
    with pytest.raises(TestbedError):
        netns.shaping_batch("v", 10e6, qdisc="tbf", delay_s=0.01)
    with pytest.raises(ValueError):
        netns.shaping_batch("v", 10e6, qdisc="cake")


def test_wire_factor_and_rate_parsing():
    assert netns.wire_factor(1500) == pytest.approx(1514 / 1448)
    q = {"kind": "tbf", "root": True, "options": {"rate": 1250000, "burst": 5000}}
    assert netns.qdisc_rate_bps(q) == 10e6
    assert netns.qdisc_rate_bps({"kind": "noqueue"}) is None
    text = "class htb 1:1 root leaf 10: prio 0 rate 10456Kbit ceil 10456Kbit burst 24997b"
    assert netns.parse_tc_rate_bps(text) == 10_456_000
    assert netns.parse_tc_rate_bps("rate 104560bit ceil") == 104_560
    assert netns.parse_tc_rate_bps("rate 1.5Gbit") == 1.5e9
    assert netns.parse_tc_rate_bps("qdisc noqueue 0: root") is None


def test_names_carry_the_pid():
    base = unique_base()
    assert owner_pid(base + "-robot") == os.getpid()
    assert owner_pid("other-1-2-robot") is None
    assert pid_alive(os.getpid())
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    assert not pid_alive(dead.pid)


def test_loopback_testbed_is_unshaped_and_says_so():
    with netns.Testbed(loopback=True) as tb:
        assert not tb.shaped and "loopback" in tb.reason
        assert tb.robot_ip == tb.server_ip == "127.0.0.1"
        assert not tb.delay_supported
        assert tb.set_rate(5e6) == 5e6 and tb.rate_bps == 5e6
        assert tb.qdisc("robot") is None
        with pytest.raises(TestbedError, match="netem"):
            tb.set_delay(0.01)
        p = tb.run("robot", [sys.executable, "-c", "import os; print(os.environ['X'])"],
                   env={"X": "42"}, stdout=subprocess.PIPE, text=True)
        assert p.communicate(timeout=10)[0].strip() == "42"
        rp = TraceReplayer(tb, traces.Trace([1e6, 2e6, 3e6], 0.02, "t"))
        assert not rp.finished
        with rp:
            rp.join(5)
        assert [r for _, r in rp.applied] == [1e6, 2e6, 3e6] and rp.error is None
        assert rp.finished
        with pytest.raises(ValueError):
            tb.run("moon", ["true"])
    with pytest.raises(TestbedError, match="not open"):
        tb.set_rate(1e6)
    with pytest.raises(ValueError):
        netns.Testbed(qdisc="cake")


def test_trace_replayer_seek_plays_on_from_the_position():
    """TraceReplayer.seek applies the rate at the position at once and plays on from there
    on time; positions outside the replay are refused (the benchmark's paired traces)."""
    step = 0.05
    trace = traces.Trace([1e6, 2e6, 3e6, 4e6, 5e6, 6e6], step, "t")
    with netns.Testbed(loopback=True) as tb:
        with TraceReplayer(tb, trace, repeat=2) as rp:
            deadline = time.monotonic() + 5
            while len(rp.applied) < 4 and time.monotonic() < deadline:
                time.sleep(0.005)
            t_seek = time.monotonic()
            rp.seek(0.06)                   # inside step 1 (2 Mbit/s)
            assert rp.applied[-1] == (0.06, 2e6) and tb.rate_bps == 2e6
            while len(rp.applied) < 6 and time.monotonic() < deadline:
                time.sleep(0.002)
            t_next = time.monotonic()
            with pytest.raises(ValueError, match="outside"):
                rp.seek(2 * len(trace) * step)
            with pytest.raises(ValueError, match="outside"):
                rp.seek(-0.1)
        seen = [r for _, r in rp.applied]
        assert seen[:4] == [1e6, 2e6, 3e6, 4e6]
        # after the seek: step 1 now, then steps 2 and 3, each on time from the seek
        assert seen[4:6] == [2e6, 3e6]
        assert [p for p, _ in rp.applied[4:6]] == [0.06, pytest.approx(2 * step)]
        assert 0.02 <= t_next - t_seek <= 0.04 + 0.1, t_next - t_seek
        assert rp.error is None


# -- the delay relay (link="tun"), without TUN devices -----------------------------------
def test_delay_line_releases_in_order_after_the_delay():
    line = delay_link.DelayLine(0.010, max_packets=3)
    assert line.next_due() is None and line.pop_due(100.0) == []
    assert line.push(1.000, b"a") and line.push(1.002, b"b")
    assert line.next_due() == pytest.approx(1.010)
    assert line.pop_due(1.009) == []
    assert line.pop_due(1.010) == [b"a"]
    # a shorter delay never lets a packet overtake one pushed before it
    line.delay_s = 0.001
    assert line.push(1.003, b"c")
    assert line.pop_due(1.005) == []  # c would be due at 1.004, but b is due at 1.012
    assert line.pop_due(1.012) == [b"b", b"c"]
    # a full line drops and counts
    for p in (b"1", b"2", b"3"):
        assert line.push(2.0, p)
    assert not line.push(2.0, b"4") and line.dropped == 1 and len(line) == 3


@pytest.mark.parametrize("bad", [-0.001, float("nan"), float("inf"), 11.0, "x"])
def test_delay_is_checked(bad):
    with pytest.raises(ValueError):
        delay_link.check_delay(bad)


def test_relay_forwards_both_ways_with_the_delay_and_takes_new_delays():
    """relay() on datagram socket pairs standing in for the two TUN devices."""
    a_dev, a_host = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    b_dev, b_host = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    control_r, control_w = os.pipe()
    for s in (a_dev, b_dev):
        s.setblocking(False)
    result = {}
    thread = threading.Thread(target=lambda: result.update(delay_link.relay(
        a_dev.fileno(), b_dev.fileno(), 0.02, control=control_r)))
    thread.start()
    try:
        b_host.settimeout(2.0)
        a_host.settimeout(2.0)
        t0 = time.monotonic()
        for i in range(5):
            a_host.send(b"up%d" % i)
        got = [b_host.recv(100) for _ in range(5)]
        up_s = time.monotonic() - t0
        assert got == [b"up%d" % i for i in range(5)]
        assert 0.02 <= up_s < 1.0
        os.write(control_w, b"delay 0.1\nnonsense\n")
        time.sleep(0.05)  # the relay reads the control line before the next packet
        t0 = time.monotonic()
        b_host.send(b"down")
        assert a_host.recv(100) == b"down"
        assert time.monotonic() - t0 >= 0.1
    finally:
        os.close(control_w)
        thread.join(5.0)
        os.close(control_r)
        for s in (a_dev, a_host, b_dev, b_host):
            s.close()
    assert not thread.is_alive()
    assert result == {"a_to_b": 5, "b_to_a": 1, "dropped": 0, "write_errors": 0}


def test_tun_link_names_and_wire_factor():
    tb = netns.Testbed(link="tun", loopback=True)
    assert (tb.robot_if, tb.server_if) == ("tun-robot", "tun-server")
    assert all(len(n) <= 15 for n in tb._tun_host_names.values())
    # TUN qdiscs see bare IP packets: no Ethernet header in the wire factor
    assert tb.wire_rate_bps(10e6) == pytest.approx(10e6 * 1500 / 1448)
    with pytest.raises(ValueError, match="link"):
        netns.Testbed(link="wifi")
