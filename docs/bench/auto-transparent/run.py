"""The launcher's modes on the testbed while the link steps 100 -> 2 -> 100 Mbit/s.

Robot and server in two network namespaces joined by a veth pair shaped both ways (htb);
the robot under a 0.5-CPU quota (one torch thread); roscore and offload_server (CPU) on the server side.
For each mode in turn (``local``, ``record_replay``, ``auto``), camera_loop.py runs under
the transparent launcher on the robot side: warm frames at 100 Mbit/s, then 20 s at
100 Mbit/s, 20 s at 2 (``--low-mbit``) and 20 s at 100. As root:

    python run.py --out OUT_DIR [--model resnet50] [--segment-s 20] [--low-mbit 2]

Writes OUT_DIR/report.md, and per mode frames_MODE.csv and stats_MODE.json.
"""
import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import time

from robot_offload.testbed import CpuLimit, Testbed, threads_for_ratio

HERE = os.path.dirname(os.path.abspath(__file__))
PORT = 23471
ROBOT_CPUS = 0.5


def wait_file(path, timeout_s, proc):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if os.path.exists(path):
            return
        if proc.poll() is not None:
            raise SystemExit(f"the program ended before {path}: exit {proc.returncode}")
        time.sleep(0.2)
    raise SystemExit(f"no {path} within {timeout_s} s")


def run_mode(tb, mode, args, renv, limit):
    out = args.out
    ready, stop = os.path.join(out, f"ready_{mode}"), os.path.join(out, f"stop_{mode}")
    frames, stats = os.path.join(out, f"frames_{mode}.csv"), os.path.join(out, f"stats_{mode}.json")
    tb.set_rate(100e6)
    cmd = [sys.executable, "-m", "robot_offload.transparent", "--mode", mode, "--timeout-s", "30"]
    if mode != "local":
        cmd += ["--stats-out", stats]
    cmd += ["--", "python", os.path.join(HERE, "camera_loop.py"), "--model", args.model,
            "--out", frames, "--ready", ready, "--stop", stop]
    log = open(os.path.join(out, f"launcher_{mode}.log"), "w")
    proc = tb.run("robot", cmd, env=renv, cpu_limit=limit, stdout=log, stderr=subprocess.STDOUT)
    wait_file(ready, 600, proc)
    segments = []
    schedule = [("100 Mbit/s", 100e6), (f"{args.low_mbit:g} Mbit/s", args.low_mbit * 1e6),
                ("100 Mbit/s again", 100e6)]
    for name, rate in schedule:
        tb.set_rate(rate)
        t0 = time.time()
        time.sleep(args.segment_s)
        segments.append((name, t0, time.time()))
    open(stop, "w").close()
    proc.wait(300)
    return segments


def summarise(out, mode, segments):
    rows = list(csv.DictReader(open(os.path.join(out, f"frames_{mode}.csv"))))
    phases = None
    path = os.path.join(out, f"stats_{mode}.json")
    if os.path.exists(path):
        infs = json.load(open(path))["inferences"]
        if len(infs) == len(rows):     # one inference per frame, in order
            phases = [i["phase"] for i in infs]
    cells = []
    for name, t0, t1 in segments:
        idx = [k for k, r in enumerate(rows) if t0 <= float(r["wall_s"]) < t1]
        lat = [float(rows[k]["latency_ms"]) for k in idx]
        robot = sum(phases[k] == "robot" for k in idx) if phases else None
        cells.append((name, len(lat), statistics.median(lat) if lat else None,
                      statistics.mean(lat) if lat else None, robot))
    return cells


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--segment-s", type=float, default=20.0)
    ap.add_argument("--low-mbit", type=float, default=2.0, help="the rate of the middle segment")
    ap.add_argument("--modes", nargs="+", default=["local", "record_replay", "auto"])
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    results = {}
    with Testbed(fallback=False) as tb:
        env = {"ROS_MASTER_URI": f"http://{tb.server_ip}:{PORT}", "ROS_HOME": os.path.abspath(args.out),
               "ROS_LOG_DIR": os.path.join(os.path.abspath(args.out), "log"), "PYTHONUNBUFFERED": "1"}
        senv, renv = dict(env, ROS_IP=tb.server_ip), dict(env, ROS_IP=tb.robot_ip)
        # As many torch threads as the robot's quota has CPUs: two threads under 0.5 CPU
        # spin-wait for each other and made a plain forward 2-15x slower, varying by run.
        renv["OMP_NUM_THREADS"] = str(threads_for_ratio(ROBOT_CPUS))
        tb.run("server", ["roscore", "-p", str(PORT)], env=senv, stdout=subprocess.DEVNULL,
               stderr=subprocess.DEVNULL)
        time.sleep(5)
        slog = open(os.path.join(args.out, "server.log"), "w")
        tb.run("server", ["roslaunch", "--screen", "robot_offload", "server.launch", "device:=cpu"],
               env=senv, stdout=slog, stderr=subprocess.STDOUT)
        end = time.monotonic() + 180
        while "ready on" not in open(os.path.join(args.out, "server.log")).read() and time.monotonic() < end:
            time.sleep(0.5)
        with CpuLimit(ROBOT_CPUS) as limit:
            for mode in args.modes:
                segments = run_mode(tb, mode, args, renv, limit)
                results[mode] = summarise(args.out, mode, segments)
                print(mode, results[mode], flush=True)
    with open(os.path.join(args.out, "report.md"), "w") as f:
        f.write(f"# The launcher's modes while the link steps (`{args.model}`, 224², robot at "
                f"{ROBOT_CPUS:g} CPU, {renv['OMP_NUM_THREADS']} torch thread)\n\n")
        f.write(f"    python run.py --out {args.out} --model {args.model} --segment-s {args.segment_s:g} "
                f"--low-mbit {args.low_mbit:g}\n\n")
        f.write("Modes one after the other, each through the same schedule of "
                f"{args.segment_s:g} s segments. Frames: per segment; latency in ms (the program's "
                "own timing of `model(frame).argmax()`); robot: frames `auto` computed on the robot.\n\n")
        f.write("| mode | segment | frames | median ms | mean ms | on the robot |\n| --- | --- | --- | --- | --- | --- |\n")
        for mode, cells in results.items():
            for name, n, med, mean, robot in cells:
                f.write(f"| {mode} | {name} | {n} | {med and round(med)} | {mean and round(mean)} | "
                        f"{'' if robot is None else robot} |\n")
    print(open(os.path.join(args.out, "report.md")).read())


if __name__ == "__main__":
    main()
