"""The request/reply transfer logger (over loopback, real sockets and processes) and the
predictor bench's scoring (pure)."""

import json
import socket
import struct
import threading

import numpy as np
import pytest

from robot_offload.bench import predictors as pb
from robot_offload.bench import report as bench_report
from robot_offload.testbed import Testbed, traces, transfers

MBIT = 1e6


def _server_thread():
    """serve() on loopback in a thread; returns (thread, port, errors)."""
    ready = threading.Event()
    box = {"errors": []}

    class Out:
        def write(self, text):
            if text.startswith("READY"):
                box["port"] = int(text.split()[1])
                ready.set()

        def flush(self):
            pass

    def run():
        try:
            transfers.serve("127.0.0.1", timeout_s=10.0, out=Out())
        except Exception as e:  # noqa: BLE001 - the test reads it
            box["errors"].append(e)
            ready.set()

    th = threading.Thread(target=run, daemon=True)
    th.start()
    assert ready.wait(10.0)
    return th, box


def test_client_and_server_over_loopback():
    th, box = _server_thread()
    log = transfers.client("127.0.0.1", box["port"], rate_hz=50.0, sizes=(20_000, 80_000),
                           reply_bytes=500, duration_s=0.4, pings=3, seed=2)
    th.join(10.0)
    assert not box["errors"]
    assert len(log["rtt_s"]) == 3 and all(r > 0 for r in log["rtt_s"])
    rows = log["transfers"]
    assert 1 <= len(rows) <= 20                       # at most one per 20 ms frame
    assert {up for _, _, up, _ in rows} <= {20_008, 80_008}
    assert all(down == 500 and t1 > t0 for t0, t1, _, down in rows)
    # closed loop: a request starts after the one before it ended
    assert all(nxt[0] >= prev[1] for prev, nxt in zip(rows, rows[1:]))


def test_server_refuses_a_request_over_its_bounds():
    th, box = _server_thread()
    with socket.create_connection(("127.0.0.1", box["port"]), timeout=5.0) as s:
        s.sendall(struct.pack("!II", transfers.MAX_PAYLOAD_BYTES + 1, 1))
        th.join(10.0)
    assert box["errors"] and isinstance(box["errors"][0], ValueError)


def test_record_on_the_loopback_testbed():
    """The same code path as the online bench, unshaped: the log comes back in trace
    position, with the trace replayed meanwhile."""
    trace = traces.steps(duration_s=2.0, period_s=0.5)
    with Testbed(loopback=True) as tb:
        log = transfers.record(tb, trace, duration_s=1.0, rate_hz=20.0,
                               sizes=(10_000, 40_000), reply_bytes=100)
    assert log["transfers"] and log["rtt_s"]
    t0s = [t0 for t0, _, _, _ in log["transfers"]]
    assert 0.0 < t0s[0] < trace.duration_s and t0s[-1] < trace.duration_s
    with Testbed(loopback=True) as tb, pytest.raises(ValueError):
        transfers.record(tb, trace, duration_s=1.8)


def test_mean_rate_over_an_interval():
    t = traces.Trace([10 * MBIT, 30 * MBIT, 50 * MBIT], 0.1)
    assert pb.mean_rate(t, 0.0, 0.1) == pytest.approx(10 * MBIT)
    assert pb.mean_rate(t, 0.05, 0.15) == pytest.approx(20 * MBIT)
    assert pb.mean_rate(t, 0.1, 0.3) == pytest.approx(40 * MBIT)


def test_online_scoring_by_hand():
    """Two transfers on a constant 10 Mbit/s trace: 1.25 MB in 1 s (10 Mbit/s) finishing
    at 1 s, then 2.5 MB in 1 s (20 Mbit/s, a reading twice the rate) finishing at 3 s.
    The instant at 0.5 s has no prediction yet; at 2.0 s `last` predicts 10 (error 0)."""
    trace = traces.constant(10 * MBIT, 5.0)
    log = {"rtt_s": [], "transfers": [[0.0, 1.0, 1_250_000, 0], [2.0, 3.0, 2_500_000, 0],
                                      [3.0, 3.5, 125_000, 0]]}
    rows = pb.online_rows(log, trace, specs=("last",), horizons=(0.1,))
    r = rows[("last", 0.1)]
    # instants 2.0 (predicts 10, error 0) and 3.0 (predicts 20, error 10)
    assert r["n"] == 2
    assert r["mae_bps"] == pytest.approx(5 * MBIT)
    assert r["mape_pct"] == pytest.approx(50.0)
    b = pb.measurement_bias(log, trace)
    assert b["used"] == 3 and b["median"] == pytest.approx(1.0)


def test_offline_rows_and_table():
    t = traces.steps(duration_s=20)
    res = pb.offline_rows(t, specs=("last", "kalman"), horizons=(0.1, 0.3))
    # on exact samples the kalman level is the last value
    for h in (0.1, 0.3):
        assert res[("kalman", h)]["mae_bps"] == pytest.approx(res[("last", h)]["mae_bps"], rel=1e-3)
    # a switch every 5 s between 100 and 5: 3 switches in 20 s; at 300 ms each costs
    # 95 * (1/3 + 2/3 + 3/3)
    n = res[("last", 0.3)]["n"]
    assert res[("last", 0.3)]["mae_bps"] == pytest.approx(3 * 95 * MBIT * 2 / n)
    text = pb.table([t], {t.name: res}, {}, ("last", "kalman"), (0.1, 0.3))
    assert text.count("\n") == 3 and "offline 300 ms" in text and "online" not in text


def test_main_offline_writes_a_report(tmp_path, capsys):
    assert pb.main(["--traces", "steps", "walk:3", "--duration-s", "10",
                    "--out", str(tmp_path)]) == 0
    text = (tmp_path / "report.md").read_text()
    assert "| walk:3 | kalman |" in text and "us" in text
    assert not (tmp_path / "transfers.json").exists()
    with pytest.raises(SystemExit):
        pb.main(["--predictors", "nope"])


def test_main_scores_saved_logs(tmp_path):
    trace = traces.from_spec("steps", 12.0)
    rng = np.random.default_rng(0)
    rows, t = [], 0.2
    while t < 9.5:
        size = int(rng.choice([150_000, 600_000]))
        d = size * 8 / trace.rate_at(t)
        rows.append([t, t + d, size, 0])
        t += d + 0.05
    saved = {"duration_s": 10.0, "testbed": "hand-made", "logs": {"steps": {"rtt_s": [1e-4],
                                                                          "transfers": rows}}}
    path = tmp_path / "transfers.json"
    path.write_text(json.dumps(saved))
    assert pb.main(["--logs", str(path), "--out", str(tmp_path)]) == 0
    text = (tmp_path / "report.md").read_text()
    assert "online 100 ms" in text and "hand-made" in text


def _bench_frames(trace, rate_read_bps, n=12, nbytes=1_250_000):
    """Bench frame rows of one cell on ``trace``: each frame one call moving ``nbytes`` at
    the trace's rate, 0.5 s apart (paired: trace_s = t_s), the estimate it used
    ``rate_read_bps``; a local frame between each (no transfer)."""
    rows = []
    for i in range(n):
        t = 0.5 * i
        d = nbytes * 8 / trace.rate_at(t)
        rows.append({"model": "m", "trace": trace.name, "mode_asked": "full_offload", "t_s": t,
                     "trace_s": t, "latency_s": d, "transfer_s": d, "round_trips": 1,
                     "executed_mode": "full_offload", "bytes_up": nbytes, "bytes_down": 0,
                     "predicted_bandwidth_bps": rate_read_bps, "lost": False})
        rows.append({"model": "m", "trace": trace.name, "mode_asked": "local", "t_s": t + d,
                     "trace_s": t, "latency_s": 0.01, "transfer_s": 0.0, "round_trips": 0,
                     "executed_mode": "local", "bytes_up": 0, "bytes_down": 0,
                     "predicted_bandwidth_bps": float("nan"), "lost": False})
    return rows


def test_a_bench_runs_estimates_are_scored_against_the_trace():
    """Frames on a constant 10 Mbit/s link whose estimate read 20: the frames' column is
    off by 10 Mbit/s (100 %); their transfers replayed read the rate exactly (with or
    without a burst learned: alike in size and idle time, they cannot tell one)."""
    trace = traces.constant(10 * MBIT, 60.0)
    text = bench_report.frames_online_table(_bench_frames(trace, 20 * MBIT), [trace])
    row = next(line for line in text.splitlines() if line.startswith("| const10M |"))
    cells = [c.strip() for c in row.strip("|").split("|")][1:]
    assert cells[0] == "10.0 / 10.0 (100 %, 0 %)"
    assert cells[1:] == ["0.0 / 0.0 (0 %, 0 %)"] * 4, cells
    # no frame of a known trace: nothing to say
    assert bench_report.frames_online_table(_bench_frames(trace, 20 * MBIT), [traces.constant(5 * MBIT)]) == ""


def test_frames_beside_background_work_replay_as_floors_and_a_false_drop_is_counted():
    """Two frames in every three on a 10 Mbit/s link stalled on the robot (calls 4x as
    long, marked ``background``): replayed as rates, two in a row would confirm a drop to
    2.5 Mbit/s; as floors (three needed) the estimate stays at the rate. The estimate those
    frames used (read 2.5 after each stall) counts two thirds below half the rate."""
    trace = traces.constant(10 * MBIT, 60.0)
    rows = _bench_frames(trace, 10 * MBIT)
    calls = [r for r in rows if r["round_trips"] == 1]
    for i, r in enumerate(calls):
        if i % 3:
            r["transfer_s"] *= 4
            r["detail_json"] = json.dumps({"background": True})
            r["predicted_bandwidth_bps"] = 2.5 * MBIT

    def cells():
        text = bench_report.frames_online_table(rows, [trace])
        row = next(line for line in text.splitlines() if line.startswith("| const10M |"))
        return [c.strip() for c in row.strip("|").split("|")][1:]
    assert cells()[0] == "5.0 / 5.0 (50 %, 67 %)"
    assert cells()[1] == "0.0 / 0.0 (0 %, 0 %)", cells()
    for r in calls:                     # unmarked, the same calls replay as false drops
        r.pop("detail_json", None)
    last = cells()[1]                   # e.g. "2.4 / 2.4 (24 %, 32 %)"
    assert float(last.split()[0]) > 2 and int(last.split()[-2]) >= 30, last


def test_main_scores_a_bench_runs_frames_csv(tmp_path):
    trace = traces.from_spec("const:10", 60.0)
    bench_report.write_csv(_bench_frames(trace, 12 * MBIT), str(tmp_path / "frames.csv"))
    assert pb.main(["--frames", str(tmp_path / "frames.csv"), "--out", str(tmp_path)]) == 0
    text = (tmp_path / "estimates.md").read_text()
    assert "| const10M | 2.0 / 2.0 (20 %, 0 %) | 0.0 / 0.0 (0 %, 0 %) |" in text
    assert pb.bench_trace("const2.5M", 60.0).mean_bps == pytest.approx(2.5 * MBIT)
    assert pb.bench_trace("walk:7", 60.0).name == "walk:7"
