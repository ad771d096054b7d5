"""The real testbed with the real nodes: the bandwidth monitor follows a rate
change within 1 s, power samples and energy per inference reach the stats, and the
benchmark's --quick profile produces its table, CSV and plots."""

import csv
import os
import subprocess
import sys
import time

import pytest

from robot_offload.bench.order import balanced_orders
from robot_offload.bench.runner import wait_for_master
from robot_offload.testbed import Testbed, cgroup

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root for network namespaces")


class EchoReader:
    """`rostopic echo -p` of a topic inside the robot namespace, parsed as it arrives. Its
    string fields are left out (``--nostr``): `-p` writes them unquoted, so a comma in one
    (a fallback reason, ``detail_json``) would shift the columns after it."""

    def __init__(self, tb, env, topic):
        self.proc = tb.run("robot", ["rostopic", "echo", "-p", "--nostr", topic], env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self.header = None

    def rows(self, until_s):
        import select
        out = []
        while time.monotonic() < until_s:
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.2)
            if not ready:
                continue
            line = self.proc.stdout.readline().strip()
            if not line:
                continue
            if line.startswith("%time"):
                self.header = line.split(",")
                continue
            if self.header:
                out.append((time.monotonic(), dict(zip(self.header, line.split(",")))))
        return out


@needs_root
def test_monitor_follows_rate_change_and_energy_in_stats(tmp_path):
    with Testbed(fallback=False) as tb:
        port = 23311
        env = {"ROS_MASTER_URI": f"http://{tb.server_ip}:{port}", "ROS_HOME": str(tmp_path),
               "PYTHONUNBUFFERED": "1"}
        senv, renv = dict(env, ROS_IP=tb.server_ip), dict(env, ROS_IP=tb.robot_ip)
        log = open(tmp_path / "nodes.log", "w")
        tb.set_rate(50e6)
        tb.run("server", ["roscore", "-p", str(port)], env=senv, stdout=log, stderr=subprocess.STDOUT)
        wait_for_master(tb, senv)
        tb.run("server", ["roslaunch", "robot_offload", "server.launch", "preload:=[resnet18]"],
               env=senv, stdout=log, stderr=subprocess.STDOUT)
        tb.run("robot", ["roslaunch", "robot_offload", "robot.launch", "model:=resnet18",
                         "mode:=full_offload", "rate_hz:=10", "input_size:=[224,224]", "timeout_s:=3.0",
                         "probe_period_s:=0.25"],
               env=renv, stdout=log, stderr=subprocess.STDOUT)
        estimates = EchoReader(tb, renv, "/bandwidth_monitor/estimate")
        stats = EchoReader(tb, renv, "/offload_client/stats")
        power = EchoReader(tb, renv, "/power_logger/power")
        warm = estimates.rows(time.monotonic() + 40)
        at50 = [float(r["field.measured_bps"]) for _, r in warm[-10:] if r["field.measured_bps"] != "nan"]
        assert at50, "no passive bandwidth estimate at 50 Mbit/s"
        # Transfers of a few hundred KB are short next to the shaper's 20 ms token bucket
        # (125 KB at 50 Mbit/s passes at line rate), so at 50 Mbit/s estimates read high
        # (measured 60-140 Mbit/s); at 10 Mbit/s the bucket is 25 KB and they are close.
        before = sorted(at50)[len(at50) // 2]
        assert before > 35e6, at50
        t_change = time.monotonic()
        tb.set_rate(10e6)
        after = estimates.rows(time.monotonic() + 4.5)
        # Passive samples alone follow within one frame's transfer (0.5 s for 600 KB at
        # 10 Mbit/s) after the one in flight, which itself may need up to 0.5 s more at the
        # new rate and reads in between; the probes (every 0.25 s) add more. On a loaded
        # machine the frames and probes come later (a CI run read only the straddling
        # sample, 31.7 Mbit/s, for the first 0.6 s and none under 20 Mbit/s by 1.5 s).
        # So: within 2.5 s the estimate has dropped to under twice the new rate, and
        # within 4 s one reads within +-40 %.
        est = [(t - t_change, float(r["field.measured_bps"])) for t, r in after]
        soon = [(dt, bps) for dt, bps in est if dt <= 2.5]
        assert any(bps < 20e6 for _, bps in soon), est
        assert any(6e6 < bps < 14e6 for dt, bps in est if dt <= 4.0), est
        assert before > 3 * min(bps for _, bps in soon), (before, soon)
        # the forecast clients use follows too: a drop under half lowers it once a second
        # transfer agrees (PassiveEstimator.add)
        predicted = [(t - t_change, float(r["field.predicted_bps"])) for t, r in after]
        assert any(bps < 20e6 for dt, bps in predicted if dt <= 4.0), predicted
        stat_rows = [r for _, r in stats.rows(time.monotonic() + 3)]
        power_rows = [r for _, r in power.rows(time.monotonic() + 2)]
        assert stat_rows and power_rows
        for r in stat_rows:
            energy = float(r["field.energy_j"])
            # modelled: at least idle power over the processing time, at most compute+radio
            assert 0 < energy < 13.56 * (float(r["field.latency_s"]) + 0.05), r
            assert r["field.energy_modelled"] in ("True", "1")
        assert any(float(r["field.predicted_bandwidth_bps"]) > 0 for r in stat_rows)
        watts = [float(r["field.watts"]) for r in power_rows]
        assert all(4.04 - 1e-6 <= w <= 13.56 + 1e-6 for w in watts) and power_rows[0]["field.modelled"] in ("True", "1")
        assert float(power_rows[-1]["field.energy_j"]) > float(power_rows[0]["field.energy_j"])
        log.close()


def test_bench_quick_writes_report(tmp_path):
    """The --quick profile (fewer frames, modes interleaved): the table, CSV, plots,
    predictor evaluation and the physical-limit check exist and say what they measured,
    and the modes took turns frame by frame."""
    out = tmp_path / "bench"
    cmd = [sys.executable, "-m", "robot_offload.bench", "--quick", "--frames", "3", "--warmup", "2",
           "--models", "resnet18", "--interleave", "--objective", "energy", "--no-hedge", "--out", str(out)]
    if os.geteuid() != 0:
        cmd.append("--loopback")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = (out / "report.md").read_text()
    assert "| resnet18 | const50M | local |" in report and "| resnet18 | outdoor | full_offload |" in report
    assert "## Physical-limit check" in report and "ok: resnet18 @ const50M" in report
    assert "Best (lowest mean MAE" in report
    rows = list(csv.DictReader(open(out / "frames.csv")))
    assert len(rows) == 3 * 2 * 2 and {r["mode_asked"] for r in rows} == {"local", "full_offload"}
    assert all(r["lost"] == "False" for r in rows)
    assert {r["executed_mode"] for r in rows if r["mode_asked"] == "full_offload"} == {"full_offload"}
    assert "modes interleaved" in report
    # the client's objective and hedge parameters, loaded over config/client.yaml
    assert "client objective: energy" in report and "hedging off" in report
    assert (out / "logs" / "client-params.yaml").read_text() == "objective: energy\nhedge: false\n"
    # the robot's quota, its period and the bandwidth slice are stated (long periods and
    # slices let bursts run at full speed); where no cgroup is writable the report says
    # the CPU was not limited
    shape = ("quota 2 ms per 4 ms period, a 1 ms bandwidth slice" if cgroup.slice_settable()
             else "quota 10 ms per 20 ms period, the kernel's bandwidth slice")
    assert ("robot side limited to 0.5 CPU" in report and shape in report
            or "robot CPU NOT limited" in report), report[:3000]
    assert "50 ms of idle before every frame" in report
    for trace in ("const50M", "outdoor"):
        # publication order: frame by frame, in the balanced orders of bench.order (for
        # two modes: local 0, full_offload 0, local 1, full_offload 1, ...)
        order = sorted((float(r["t_s"]), int(r["frame"]), r["mode_asked"], float(r["roundtrip_wall_s"]))
                       for r in rows if r["trace"] == trace)
        modes = ("local", "full_offload")
        orders = balanced_orders(2)
        assert [(f, m) for _, f, m, _ in order] == [(f, modes[k]) for f in range(3)
                                                          for k in orders[f % len(orders)]]
        # the robot idles --settle-s (default 50 ms) between a frame's answer and the next
        gaps = [b[0] - (a[0] + a[3]) for a, b in zip(order, order[1:])]
        assert min(gaps) >= 0.045, gaps
        # paired trace: both modes' frame i started at the same point of the trace, and
        # frame i + 1 where the slower of the two ended (plus the settle time)
        start = {}
        for r in rows:
            if r["trace"] == trace:
                start.setdefault(int(r["frame"]), set()).add(float(r["trace_s"]))
        assert all(len(v) == 1 for v in start.values()), start
        pos = [start[f].pop() for f in range(3)]
        slowest = [max(w for _, f2, _, w in order if f2 == f) for f in range(3)]
        assert pos[0] == 0.0
        assert [b - a for a, b in zip(pos, pos[1:])] == [pytest.approx(0.05 + w, abs=2e-3) for w in slowest[:2]]
    assert "paired trace" in report
    for r in rows:
        if r["mode_asked"] == "full_offload" and r["trace"] == "const50M":
            assert float(r["latency_s"]) >= int(r["bytes_up"]) * 8 / 50e6
    assert sorted(p.name for p in out.glob("*.png")) == ["latency-resnet18-const50M.png",
                                                         "latency-resnet18-outdoor.png"]
