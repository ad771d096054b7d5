"""Testbed pieces that need no root: qdisc parameters, names, the loopback fallback."""

import os
import subprocess
import sys

import pytest

from robot_offload.testbed import TestbedError, TraceReplayer, netns, traces
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
