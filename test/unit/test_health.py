"""The nodes' health reports without ROS: levels and messages for each state, the machine
figures through psutil, and the server's figures from a real in-process server."""

import time
from collections import namedtuple

import pytest
import torch

from robot_offload import health
from robot_offload.client import ClientConfig, OffloadClient
from robot_offload.health import ERROR, OK, WARN, ClientHealth, RateMeter, Report
from robot_offload.protocol import ComputeRequest, LoadModelRequest, PingRequest, StatusCode
from robot_offload.server import OffloadServer, ServerConfig
from robot_offload.server.health import ServerHealth, device_memory
from robot_offload.transport.inproc import InProcessTransport

from devices import SERVER_DEVICE


class Clock:
    def __init__(self, t=1000.0):
        self.t = t

    def __call__(self):
        return self.t


# -- Report and RateMeter ----------------------------------------------------------------
def test_report_takes_the_worst_level_and_lists_reasons_worst_first():
    r = Report("all good").add("x", 1.23456).add("missing", None).add("flag", True)
    assert (r.level, r.message) == (OK, "all good")
    assert r.value("x") == "1.235" and r.value("missing") == "n/a" and r.value("flag") == "yes"
    r.flag(WARN, "slow").flag(ERROR, "gone").flag(OK, "ignored")
    assert r.level == ERROR and r.message == "gone; slow"
    with pytest.raises(ValueError):
        r.flag(7, "no such level")


def test_rate_meter_counts_only_the_window():
    clock = Clock()
    m = RateMeter(window_s=10.0, clock=clock)
    assert m.rate_hz() == 0.0 and m.last is None
    for i in range(50):                     # 5 Hz for 10 s
        clock.t += 0.2
        m.tick()
    assert m.rate_hz() == pytest.approx(5.0)
    clock.t += 8.0                           # the last 2 s of ticks remain
    assert m.count() == 10 and m.rate_hz() == pytest.approx(1.0)


# -- machine -----------------------------------------------------------------------------
def test_machine_report_with_this_machine():
    r = health.MachineMonitor().report()
    assert r.level in (OK, WARN, ERROR)
    assert int(r.value("CPU cores")) >= 1
    assert 0 <= float(r.value("memory used (%)")) <= 100
    assert float(r.value("this node: RSS (MB)")) > 10         # a Python process with torch
    assert r.value("temperatures") == "no sensors" or any(k.startswith("temperature ") for k, _ in r.values)


Temp = namedtuple("Temp", "label current high critical")
CpuTimes = namedtuple("CpuTimes", "user system idle iowait")
Mem = namedtuple("Mem", "total available")


class FakePs:
    """A machine with given figures (this VM has no temperature sensors)."""

    def __init__(self, temps=None, load=0.5, mem_free=0.5):
        self.temps, self.load, self.mem_free = temps or {}, load, mem_free
        self.busy = 0.0

    def cpu_times(self):
        self.busy += 3.0
        return CpuTimes(self.busy, 0.0, 100.0 + self.busy / 3, 0.0)

    def cpu_count(self):
        return 4

    def getloadavg(self):
        return (self.load, self.load, self.load)

    def virtual_memory(self):
        return Mem(1000, 1000 * self.mem_free)

    def sensors_temperatures(self):
        return self.temps


def test_machine_levels_from_load_memory_and_temperatures():
    ok = health.MachineMonitor(ps=FakePs({"cpu": [Temp("core0", 50.0, 80.0, 100.0)]})).report()
    assert ok.level == OK and ok.value("temperature cpu core0 (°C)") == "50"
    assert float(ok.value("CPU use (%)")) == pytest.approx(75.0)
    hot = health.MachineMonitor(ps=FakePs({"cpu": [Temp("core0", 82.0, 80.0, 100.0)]})).report()
    assert hot.level == WARN and "core0 hot: 82 °C" in hot.message
    # no limit from the sensor (or a bogus one): the defaults, 85 / 95 °C
    burning = health.MachineMonitor(ps=FakePs({"soc": [Temp("", 96.0, None, 0.0)]})).report()
    assert burning.level == ERROR and "soc 0 at 96 °C" in burning.message
    assert health.MachineMonitor(ps=FakePs(load=9.0)).report().message.startswith("CPU overloaded")
    low = health.MachineMonitor(ps=FakePs(mem_free=0.05)).report()
    assert low.level == WARN and "memory low: 95 %" in low.message
    assert health.MachineMonitor(ps=FakePs(mem_free=0.01)).report().level == ERROR


def test_process_figures_of_this_and_of_a_gone_process():
    me = health.process_figures()
    assert me["rss_mb"] > 10 and me["threads"] >= 1 and me["fds"] >= 3
    assert health.process_figures("self").keys() == me.keys()
    with pytest.raises(ProcessLookupError):
        health.process_figures(2 ** 22 + 12345)          # above pid_max: never a process


# -- client ------------------------------------------------------------------------------
def _report(h, **kw):
    args = dict(mode="full_offload", needs_server=True, link_state="up", received=0, processed=0,
                dropped=0, fallbacks=0, input_topic="/camera/image")
    args.update(kw)
    return h.report(**args)


def test_client_link_states():
    clock = Clock()
    h = ClientHealth(clock=clock)
    for i in range(20):
        clock.t += 0.1
        h.frame("full_offload", "", 0.05 + 0.001 * i, received=i + 1, dropped=0)
    up = _report(h)
    assert up.level == OK and up.message == "full_offload: offloading to the server"
    assert float(up.value("frame rate (Hz, last 10 s)")) == pytest.approx(10.0)
    assert float(up.value("latency median (s)")) == pytest.approx(0.0595)
    down = _report(h, link_state="down", link_error="/offload_server/compute: connection refused")
    assert down.level == ERROR
    assert down.message == ("offload server unreachable, frames computed locally: "
                            "/offload_server/compute: connection refused")
    local = _report(h, mode="local", needs_server=False, link_state="down", link_error="x")
    assert local.level == WARN and "not needed in local mode" in local.message
    assert _report(h, link_state="refused", link_error="weights differ").level == ERROR
    assert _report(h, link_state="connecting").level == WARN
    assert _report(h, link_state="recovering").level == WARN
    off = _report(h, mode="local", needs_server=False, link_state="off")
    assert off.level == OK and off.value("server link") == "not used (~use_server false)"
    with pytest.raises(ValueError):
        _report(h, link_state="sideways")


def test_client_fallbacks_deadline_misses_drops_and_silence():
    clock = Clock()
    h = ClientHealth(window_s=10.0, clock=clock)
    received = dropped = 0
    for i in range(30):
        clock.t += 0.2
        received += 2
        dropped += 1
        reason = "OffloadTimeout: /offload_server/compute did not answer within 0.500 s" if i % 10 == 0 else ""
        h.frame("local" if reason else "full_offload", reason, 0.1, received=received, dropped=dropped)
    r = _report(h, received=received, processed=30, dropped=dropped, fallbacks=3)
    assert r.level == WARN
    assert r.message.startswith("3 of 30 frames in the last 10 s computed locally (3 missed the deadline): "
                                "OffloadTimeout")
    assert r.value("deadline misses (total)") == "3" and r.value("fallbacks (total)") == "3"
    assert r.value("frames dropped (last 10 s)") == "29 of 58"
    assert r.value("frames received, processed, dropped (total)") == "60, 30, 30"
    # the window moves on: old fallbacks no longer warn, the totals stay
    for i in range(60):
        clock.t += 0.2
        h.frame("full_offload", "", 0.1, received=received, dropped=dropped)
    r = _report(h, fallbacks=3)
    assert r.level == OK and r.value("fallbacks (last 10 s)") == "0"
    assert r.value("deadline misses (total)") == "3" and r.value("deadline misses (last 10 s)") == "0"
    clock.t += 11.0
    silent = _report(h)
    assert silent.level == WARN and "no frame processed in the last 10 s" in silent.message
    assert "/camera/image" in silent.message


def test_link_state_follows_a_real_link():
    """ServerLink.state on a real client: connecting, down, up after the server comes, and
    refused for good with other weights."""
    transport = InProcessTransport(None)
    c = OffloadClient(ClientConfig(model="resnet18", mode="full_offload", input_size=(32, 32),
                                   timeout_s=10.0, retry_interval_s=0.1), transport)
    try:
        assert c.link.state == "connecting"
        assert not c.connect(timeout_s=0.5)
        assert c.link.state == "down"
        h = ClientHealth()
        r = h.report(mode=c.mode, needs_server=c.needs_server(), link_state=c.link.state,
                     link_error=c.link.last_error)
        assert r.level == ERROR and "unreachable" in r.message
        transport.server = OffloadServer(ServerConfig(ops_sandbox=False, device=SERVER_DEVICE))
        deadline = time.monotonic() + 30
        while c.link.state != "up" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert c.link.state == "up"
        assert h.report(mode=c.mode, needs_server=True, link_state=c.link.state).level == OK
        assert not c.needs_server("local")
    finally:
        c.close()


# -- bandwidth monitor and power logger ----------------------------------------------------
def _bw(**kw):
    args = dict(predicted_bps=42e6, measured_bps=40e6, rtt_s=0.002, sample_age_s=1.0, uptime_s=60.0,
                stale_after_s=10.0, probing=False, predictor="last")
    args.update(kw)
    return health.bandwidth_report(**args)


def test_bandwidth_fresh_stale_and_unmeasured():
    fresh = _bw()
    assert fresh.level == OK and fresh.message == "42 Mbit/s predicted"
    assert fresh.value("last sample age (s)") == "1"
    stale = _bw(sample_age_s=42.0)
    assert stale.level == WARN and stale.message == (
        "estimate stale: the last measurement is 42 s old (the client is not offloading and probes are off)")
    waiting = _bw(predicted_bps=None, measured_bps=None, sample_age_s=None)
    assert waiting.level == OK and "until it offloads a frame" in waiting.message
    assert waiting.value("predicted") == "n/a"
    never = _bw(predicted_bps=None, sample_age_s=None, probing=True, uptime_s=30.0)
    assert never.level == WARN and "no probe has measured the link in 30 s" in never.message
    failing = _bw(probing=True, probe_error="/offload_server/ping did not answer within 2.000 s")
    assert failing.level == WARN and failing.message.startswith("bandwidth probes fail: ")
    assert fresh.value("link burst learned (ms at the rate)") is None
    assert _bw(burst_s=0.0175).value("link burst learned (ms at the rate)") == "17.5"


def _power(**kw):
    args = dict(source="jetson_ina3221", description="jetson_ina3221 (3 rails)", modelled=False,
                rails=["VDD_IN", "VDD_CPU_GPU_CV", "VDD_SOC"], rate_hz=10.0, achieved_hz=9.9,
                uptime_s=60.0, last_sample_age_s=0.1)
    args.update(kw)
    return health.power_report(**args)


def test_power_rails_rate_and_silence():
    ok = _power()
    assert ok.level == OK and ok.message == "measuring: jetson_ina3221 (3 rails)"
    assert ok.value("rails") == "VDD_IN, VDD_CPU_GPU_CV, VDD_SOC" and ok.value("measured") == "yes"
    modelled = _power(source="model", description="state model", modelled=True, rails=[])
    assert modelled.level == OK and modelled.message.startswith("modelled (no power sensor)")
    assert modelled.value("rails") == "none (state model)"
    slow = _power(achieved_hz=3.0)
    assert slow.level == WARN and slow.message == "sampling at 3.0 Hz of the configured 10 Hz"
    failing = _power(read_failures=4, recent_failures=2, last_error="[Errno 5] Input/output error")
    assert failing.level == WARN and "2 sensor reads failed lately" in failing.message
    dead = _power(last_sample_age_s=30.0, read_failures=300, recent_failures=100, last_error="EIO")
    assert dead.level == ERROR and dead.message.startswith("no power sample for 30 s: EIO")
    assert _power(last_sample_age_s=None, uptime_s=1.0, achieved_hz=0.0).level == OK   # starting


# -- server --------------------------------------------------------------------------------
def test_server_report_from_a_real_server():
    server = OffloadServer(ServerConfig(ops_sandbox=False, device=SERVER_DEVICE, max_sessions=2))
    clock = Clock()
    h = ServerHealth(window_s=60.0, clock=clock)
    try:
        first = h.report(server.activity(), device_memory(server.device))
        assert first.level == OK and first.value("requests (total)") == "0"
        assert first.value("device") == str(server.device) and first.value("ops: sessions") == "0 of 2"
        assert server.handle("ping", PingRequest(client_id="robot_a")).status == StatusCode.OK
        assert server.handle("load_model", LoadModelRequest(client_id="robot_b", model="resnet18")).status == 0
        refused = server.handle("compute", ComputeRequest(client_id="robot_a", model="vgg19", entry="forward"))
        assert refused.status == StatusCode.MODEL_NOT_LOADED
        clock.t += 5
        r = h.report(server.activity(), device_memory(server.device))
        assert r.level == OK, r.message             # MODEL_NOT_LOADED is no warning
        assert r.value("clients (requests in the last 60 s)") == "2"
        assert r.value("requests (last 60 s)") == "3" and r.value("requests in flight") == "0"
        assert r.value("refused by status (total)") == "MODEL_NOT_LOADED 1"
        assert r.value("models loaded") == "resnet18"
        # a bound reached: two sessions (max_sessions), the third is BUSY
        codes = [server.handle("compute", ComputeRequest(client_id=c, model="", entry="ops",
                                                         args_json='{"ops": []}')).status
                 for c in ("robot_c", "robot_d", "robot_e")]
        assert codes == [StatusCode.OK, StatusCode.OK, StatusCode.BUSY]
        clock.t += 5
        r = h.report(server.activity())
        assert r.level == WARN and r.message.startswith("1 request refused as BUSY")
        assert r.value("ops: sessions") == "2 of 2" and r.value("clients (requests in the last 60 s)") == "5"
        clock.t += 120                        # the window has passed: no more warning
        h.report(server.activity())
        assert h.report(server.activity()).level == OK
    finally:
        server.close()


def test_server_report_warns_on_sandbox_crashes_and_a_full_gpu():
    h = ServerHealth(window_s=60.0, clock=Clock())
    act = dict(requests=10, refused={}, failed=0, in_flight=1, clients=2, models=[], device="cuda:0",
               server_id="abc", executors={"ops": {"sandboxes": 1, "max_sandboxes": 2, "crashed": 0,
                                                   "stopped": 0, "spare ready": True}})
    assert h.report(act).level == OK
    act2 = dict(act, requests=20, refused={"INTERNAL": 2}, failed=2,
                executors={"ops": {"sandboxes": 2, "max_sandboxes": 2, "crashed": 1, "stopped": 0,
                                   "spare ready": True}})
    r = h.report(act2, {"allocated_mb": 70000.0, "reserved_mb": 76000.0, "free_mb": 1000.0,
                        "total_mb": 80000.0})
    assert r.level == WARN
    for text in ("2 requests failed inside the server", "1 operator sandbox(es) ended under a request",
                 "every operator sandbox is taken", "GPU memory 99 % used"):
        assert text in r.message, r.message
    assert r.value("GPU memory total (MB)") == "80000"
    assert device_memory(torch.device("cpu")) == {}
