"""The fleet benchmark: N robots and M offload servers on one machine, with one real ROS
master, real ``offload_server`` nodes and one ROS node per robot
(:mod:`robot_offload.ros.fleet_robot`).

::

    rosrun robot_offload bench --fleet 4:2 --model resnet18 --mode full_offload \\
        --server-cpus 0.5 --duration-s 40 --slow 1:3@15 --out docs/bench/fleet

* Each server is its own process under its own CPU quota (``--server-cpus`` CPUs, a
  cgroup: :class:`~robot_offload.testbed.cgroup.CpuLimit`), found by the robots through
  the master under ``/fleet``, with ``--server-threads`` torch threads (1: on a fleet each
  server has its own GPU, and two servers' thread bursts on this machine's shared cores
  would slow each other beyond their quotas). ``--slow I:F@T`` divides server I's quota by
  F at T s into the run; ``--kill I@T`` SIGKILLs it at T s.
* ``--robot-cpus`` puts each robot under a CPU quota of its own too (for modes that
  compute on the robot: unlimited, four robots would take the whole machine).
* Each robot offers frames at ``--rate-hz`` (robot 0 at ``--fast-factor`` times that) from
  one shared start; a frame due while the last one runs is dropped, as the client node's
  newest-frame queue would, so offered = processed + dropped for every robot.
* The links are loopback, unshaped by default: this measures how servers share their
  compute among robots, not a wireless link. ``--robot-links indoor,outdoor,const:20``
  (one trace per robot, as ``bench --traces`` names them, cycled over the robots) puts
  each robot in its own network namespace with its own veth link to the host, where the
  master and the servers stay, shaped both ways (htb) and replaying its trace from the
  shared start (:class:`~robot_offload.testbed.star.StarTestbed`; root only: without
  namespaces the run is refused, never silently unshaped).

Writes ``results.json`` (every frame of every robot) and ``report.md``: per robot and in
all, frames processed per second, latency median / P95 / P99 with a 95 % interval of the
median, frames computed locally, hedges (share of calls, wins, extra bytes) and the
fairness ratio (worst robot's median / best robot's), plus ``latency.png``.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from typing import List

import numpy as np

from robot_offload.errors import ConfigError
from robot_offload.pool import FIGURE_KEYS
from robot_offload.testbed import traces as tr
from robot_offload.testbed._common import TestbedError, start_on_free_port
from robot_offload.testbed.cgroup import CpuLimit, choose_mechanism
from robot_offload.testbed.netns import TraceReplayer
from robot_offload.testbed.star import StarTestbed

FLEET_NS = "/fleet"


def _event(text: str, with_factor: bool):
    """``I:F@T`` (with_factor) or ``I@T`` -> (I, F, T)."""
    head, at = text.split("@")
    if with_factor:
        index, factor = head.split(":")
        return int(index), float(factor), float(at)
    return int(head), 1.0, float(at)


def robot_link_specs(text: str, n_robots: int) -> List[str]:
    """``--robot-links`` -> one trace spec per robot (the list cycled over the robots);
    ConfigError for a spec :func:`~robot_offload.testbed.traces.from_spec` rejects."""
    specs = [s.strip() for s in text.split(",") if s.strip()]
    if not specs:
        raise ConfigError("--robot-links: no trace given (e.g. indoor,outdoor,const:20)")
    for spec in dict.fromkeys(specs):
        tr.from_spec(spec, 1.0)
    return [specs[j % len(specs)] for j in range(n_robots)]


def _run_rates(trace, duration_s: float):
    """The trace's rates (bit/s) over the run's ``duration_s`` from the shared start."""
    return trace.rates_bps[:max(1, int(round(duration_s / trace.step_s)))]


def link_text(specs: List[str], trace_list, duration_s: float) -> str:
    """The report's ``link`` entry for shaped per-robot links."""
    parts = []
    for j, (spec, trace) in enumerate(zip(specs, trace_list)):
        rates = _run_rates(trace, duration_s)
        steady = float(rates.min()) == float(rates.max())
        parts.append(f"robot{j} {spec}" + ("" if steady else f" (mean {rates.mean() / 1e6:.0f} Mbit/s over the run)"))
    return ("own namespace and veth per robot, htb both ways, TCP goodput: " + "; ".join(parts))


def percentile_ci(values, q, level=0.95):
    """The ``q`` quantile of ``values`` and a distribution-free interval for it (order
    statistics of the binomial), as (value, low, high)."""
    v = np.sort(np.asarray(values, dtype=float))
    n = len(v)
    if n == 0:
        return (float("nan"),) * 3
    z = 1.96 if level == 0.95 else 2.58
    half = z * np.sqrt(n * q * (1 - q))
    lo = int(max(0, np.floor(n * q - half)))
    hi = int(min(n - 1, np.ceil(n * q + half)))
    return float(np.quantile(v, q)), float(v[lo]), float(v[hi])


def summarise(robots: List[dict], duration_s: float) -> dict:
    """Per-robot and aggregate figures from the robots' result files."""
    rows = []
    every = []
    for r in robots:
        lat = [f["latency_s"] for f in r["frames"]]
        every += lat
        local = sum(1 for f in r["frames"] if f["mode"] == "local")
        med = percentile_ci(lat, 0.5)
        rows.append({"robot": r["client_id"], "rate_hz": r["rate_hz"], "offered": r["offered"],
                     "processed": len(lat), "dropped": r["dropped"], "local": local,
                     "fps": len(lat) / duration_s, "offloaded_fps": (len(lat) - local) / duration_s,
                     "p50_s": med[0], "p50_ci_s": med[1:], "p95_s": percentile_ci(lat, 0.95)[0],
                     "p99_s": percentile_ci(lat, 0.99)[0], **{k: r["pool"].get(k, 0) for k in FIGURE_KEYS}})
    medians = [row["p50_s"] for row in rows if row["processed"]]
    pool = {k: sum(row[k] for row in rows) for k in FIGURE_KEYS}
    calls, hedges = pool["calls"], pool["hedges"]
    total = {**pool, "fps": sum(row["fps"] for row in rows),
             "offloaded_fps": sum(row["offloaded_fps"] for row in rows),
             "p50_s": percentile_ci(every, 0.5), "p95_s": percentile_ci(every, 0.95),
             "p99_s": percentile_ci(every, 0.99),
             "fairness": max(medians) / min(medians) if medians else float("nan"),
             "local": sum(row["local"] for row in rows),
             "accounted": all(row["processed"] + row["dropped"] == row["offered"] for row in rows),
             "hedge_share": hedges / calls if calls else 0.0,
             "hedge_mb_up": pool["hedge_bytes_up"] / 1e6}
    return {"robots": rows, "total": total}


def report_markdown(summary: dict, setup: dict) -> str:
    ms = lambda s: f"{1e3 * s:.0f}"  # noqa: E731
    lines = [f"# Fleet: {setup['robots']} robots, {setup['servers']} servers", "",
             "Setup: " + ", ".join(f"{k} {v}" for k, v in setup.items()), "",
             "| robot | rate (Hz) | offered | processed | dropped | local | fps | median ms [95% CI] | P95 ms | P99 ms | hedges (won) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in summary["robots"]:
        lines.append(f"| {r['robot']} | {r['rate_hz']:g} | {r['offered']} | {r['processed']} | {r['dropped']} | "
                     f"{r['local']} | {r['fps']:.2f} | {ms(r['p50_s'])} [{ms(r['p50_ci_s'][0])}-{ms(r['p50_ci_s'][1])}] | "
                     f"{ms(r['p95_s'])} | {ms(r['p99_s'])} | {r['hedges']} ({r['hedges_won']}) |")
    t = summary["total"]
    lines += ["", "| in all | value |", "| --- | --- |",
              f"| frames/s processed (offloaded) | {t['fps']:.2f} ({t['offloaded_fps']:.2f}) |",
              f"| latency median [95% CI] | {ms(t['p50_s'][0])} [{ms(t['p50_s'][1])}-{ms(t['p50_s'][2])}] ms |",
              f"| latency P95, P99 [95% CI] | {ms(t['p95_s'][0])}, {ms(t['p99_s'][0])} [{ms(t['p99_s'][1])}-{ms(t['p99_s'][2])}] ms |",
              f"| fairness (worst / best robot median) | {t['fairness']:.2f} |",
              f"| frames computed locally | {t['local']} |",
              f"| every offered frame processed or dropped | {'yes' if t['accounted'] else 'NO'} |",
              f"| hedges: share of calls, won, extra MB up | {100 * t['hedge_share']:.1f} %, {t['hedges_won']}, {t['hedge_mb_up']:.1f} |",
              f"| ... of them copies re-measuring a server not used lately | {t['explored']} |",
              f"| losers cancelled before they started | {t['cancelled']} |",
              f"| calls failed over to another server | {t['failovers']} |", ""]
    return "\n".join(lines)


def plot(robots: List[dict], events: List[tuple], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(9, 4))
    for r in robots:
        ax.plot([f["t"] for f in r["frames"]], [1e3 * f["latency_s"] for f in r["frames"]], ".",
                markersize=3, label=r["client_id"])
    for what, t in events:
        ax.axvline(t, color="k", linestyle="--", linewidth=0.8)
        ax.text(t, ax.get_ylim()[1] * 0.95, what, fontsize=8)
    ax.set_xlabel("time into the run (s)")
    ax.set_ylabel("frame latency (ms)")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args) -> dict:
    n_robots, n_servers = (int(x) for x in args.fleet.split(":"))
    try:
        specs = robot_link_specs(args.robot_links, n_robots) if args.robot_links else []
        # the replay starts at the shared start; the last frames may end a timeout later
        trace_list = [tr.from_spec(s, args.duration_s + args.timeout_s + 30.0) for s in specs]
    except ConfigError as e:
        raise SystemExit(str(e))
    out = os.path.abspath(args.out)
    os.makedirs(os.path.join(out, "logs"), exist_ok=True)
    env = dict(os.environ, ROS_IP="127.0.0.1", ROS_HOME=os.path.join(out, "logs"))
    env.pop("ROS_HOSTNAME", None)
    log = lambda name: open(os.path.join(out, "logs", name), "a")  # noqa: E731
    procs, limits, replayers = [], [], []
    star = None

    def quota(cpus):
        """An open CPU quota of ``cpus`` (closed at the end), or None for 0."""
        if cpus <= 0:
            return None
        limits.append(CpuLimit(ratio=cpus).open())
        return limits[-1]

    def start(argv, lim, process_env, log_name):
        """``argv`` in its own session (and in ``lim``'s cgroup from its start)."""
        return subprocess.Popen(argv if lim is None else lim.wrap(argv), env=process_env,
                                stdout=log(log_name), stderr=subprocess.STDOUT, start_new_session=True)
    mechanism = choose_mechanism()
    if mechanism.kind == "threads" and (args.server_cpus > 0 or args.robot_cpus > 0):
        raise SystemExit(f"--server-cpus and --robot-cpus need a writable cgroup CPU controller: "
                         f"{mechanism.reason}")
    try:
        if specs:
            try:
                star = StarTestbed(n_robots, fallback=False).open()
            except TestbedError as e:
                raise SystemExit(f"--robot-links needs a network namespace per robot (root, ip, tc, "
                                 f"nsenter); refusing to run unshaped: {e}")
            env["ROS_IP"] = star.server_ip      # master and servers advertise the star's centre
            for j, trace in enumerate(trace_list):
                star.set_rate(j, float(trace.rates_bps[0]))

        def start_master(port):
            env["ROS_MASTER_URI"] = f"http://{env['ROS_IP']}:{port}"
            procs.append(subprocess.Popen(["roscore", "-p", str(port)], env=env, stdout=log("roscore.log"),
                                          stderr=subprocess.STDOUT, start_new_session=True))
            return procs[-1]
        start_on_free_port(start_master, lambda core: _wait_master(env, core))
        servers = []
        # each server's torch threads: on a real fleet every server has its own GPU; here
        # two servers' thread bursts would collide on the shared cores beyond their quotas
        server_env = dict(env, OMP_NUM_THREADS=str(args.server_threads),
                          MKL_NUM_THREADS=str(args.server_threads))
        for i in range(n_servers):
            argv = ["rosrun", "robot_offload", "offload_server", f"__ns:={FLEET_NS}", f"__name:=s{i}",
                    "_device:=cpu", f"_preload:=[{args.model}]", "_ops_sandbox:=false",
                    f"_compute_slots:={args.compute_slots}", f"_max_batch:={args.max_batch}"]
            lim = quota(args.server_cpus)
            proc = start(argv, lim, server_env, f"server{i}.log")
            procs.append(proc)
            servers.append((proc, lim))
        _wait_services(env, [f"{FLEET_NS}/s{i}/compute" for i in range(n_servers)])
        start_at = time.time() + args.ready_s
        robots = []
        for j in range(n_robots):
            rate = args.rate_hz * (args.fast_factor if j == 0 else 1.0)
            argv = [sys.executable, "-m", "robot_offload.ros.fleet_robot", "--fleet-ns", FLEET_NS,
                    "--client-id", f"robot{j}", "--model", args.model, "--mode", args.mode,
                    "--input-size", args.input_size, "--rate-hz", str(rate), "--start-at", str(start_at),
                    "--duration-s", str(args.duration_s), "--timeout-s", str(args.timeout_s),
                    "--balance", args.balance, "--hedge", str(int(args.hedge)),
                    "--hedge-budget", str(args.hedge_budget), "--out", os.path.join(out, f"robot{j}.json")]
            robot_lim = quota(args.robot_cpus)      # a robot's own compute (its local layers)
            if star is not None:        # in its own namespace, advertising its own address
                robots.append(star.run(j, argv, env=dict(env, ROS_IP=star.robot_ip(j)), cpu_limit=robot_lim,
                                       stdout=log(f"robot{j}.log"), stderr=subprocess.STDOUT))
            else:
                robots.append(start(argv, robot_lim, env, f"robot{j}.log"))
        procs += robots
        events = sorted([("slow", *_event(e, True)) for e in args.slow] +
                        [("kill", *_event(e, False)) for e in args.kill], key=lambda e: e[3])
        done_events = []
        while time.time() < start_at:
            if any(p.poll() not in (None, 0) for p in robots):
                raise SystemExit("a robot failed before the start; see logs/robot*.log")
            time.sleep(min(0.1, max(0.0, start_at - time.time())))
        for j, trace in enumerate(trace_list):
            replayers.append(TraceReplayer(star.link(j), trace))
            replayers[-1].start()
        for what, index, factor, at in events:
            while time.time() < start_at + at:
                time.sleep(0.05)
            proc, lim = servers[index]
            if what == "slow":
                lim.set_ratio(args.server_cpus / factor)
                done_events.append((f"s{index} {factor:g}x slower", at))
            else:
                os.killpg(proc.pid, signal.SIGKILL)
                done_events.append((f"s{index} killed", at))
        for p in robots:
            p.wait(timeout=args.duration_s + args.ready_s + 300)
        if any(p.returncode != 0 for p in robots):
            raise SystemExit("a robot failed; see logs/robot*.log")
        for rp in replayers:
            rp.stop()
    finally:
        for rp in replayers:
            rp.stop()
        for p in reversed(procs):
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGINT)
                    p.wait(timeout=15)
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    try:
                        os.killpg(p.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
        if star is not None:
            star.close()
        for lim in limits:
            lim.close()
    robots_data = []
    for j in range(n_robots):
        with open(os.path.join(out, f"robot{j}.json")) as f:
            robots_data.append(json.load(f))
    summary = summarise(robots_data, args.duration_s)
    setup = {"robots": n_robots, "servers": n_servers, "model": args.model, "mode": args.mode,
             "input": args.input_size or "default", "rate Hz": args.rate_hz,
             "robot0 rate x": args.fast_factor, "server CPUs each": args.server_cpus,
             "server threads": args.server_threads, "robot CPUs each": args.robot_cpus or "no quota",
             "compute_slots": args.compute_slots, "max_batch": args.max_batch, "balance": args.balance,
             "hedge": f"{args.hedge} (budget {args.hedge_budget:g})", "timeout s": args.timeout_s,
             "duration s": args.duration_s, "events": "; ".join(f"{w} at {t:g} s" for w, t in done_events) or "none",
             "link": link_text(specs, trace_list, args.duration_s) if specs else "loopback, unshaped"}
    results = {"setup": setup, "summary": summary, "robots": robots_data}
    if specs:   # each robot's link: its trace and how the replay went
        results["links"] = [{"robot": f"robot{j}", "trace": spec, "trace_name": trace.name,
                             "run_mean_mbps": float(_run_rates(trace, args.duration_s).mean()) / 1e6,
                             "steps_applied": len(rp.applied), "late_steps": rp.late_steps,
                             "error": None if rp.error is None else str(rp.error)}
                            for j, (spec, trace, rp) in enumerate(zip(specs, trace_list, replayers))]
        failed = [f"{x['robot']}: {x['error']}" for x in results["links"] if x["error"]]
        if failed:
            setup["link"] += " -- REPLAY FAILED: " + "; ".join(failed)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(results, f)
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write(report_markdown(summary, setup))
    plot(robots_data, done_events, os.path.join(out, "latency.png"))
    return summary


def _wait_master(env, core, timeout_s=60.0):
    probe = [sys.executable, "-c", "import rosgraph, sys; sys.exit(0 if rosgraph.is_master_online() else 1)"]
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if subprocess.run(probe, env=env).returncode == 0:
            return
        if core.poll() is not None:
            raise RuntimeError("roscore exited; see logs/roscore.log")
        time.sleep(0.3)
    raise TimeoutError("roscore did not come up")


def _wait_services(env, names: List[str], timeout_s=300.0):
    code = ("import rospy, sys\n"
            "for n in sys.argv[1:]:\n    rospy.wait_for_service(n, %f)\n" % timeout_s)
    subprocess.run([sys.executable, "-c", code, *names], env=env, check=True, timeout=timeout_s + 30)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--fleet", required=True, metavar="ROBOTS:SERVERS")
    ap.add_argument("--model", default="resnet18")
    ap.add_argument("--mode", default="full_offload")
    ap.add_argument("--input-size", default="", help="H,W of the model input (default: the model's)")
    ap.add_argument("--rate-hz", type=float, default=4.0, help="frames offered per second by each robot")
    ap.add_argument("--fast-factor", type=float, default=1.0, help="robot0 offers this many times the rate")
    ap.add_argument("--server-cpus", type=float, default=0.5, help="CPU quota of each server (0 = none)")
    ap.add_argument("--server-threads", type=int, default=1, help="torch threads of each server")
    ap.add_argument("--robot-cpus", type=float, default=0.0,
                    help="CPU quota of each robot (0 = none): modes that compute on the robot need one")
    ap.add_argument("--compute-slots", type=int, default=1)
    ap.add_argument("--max-batch", type=int, default=1, help="the servers' max_batch")
    ap.add_argument("--duration-s", type=float, default=30.0)
    ap.add_argument("--ready-s", type=float, default=60.0, help="time the robots get to connect before the start")
    ap.add_argument("--timeout-s", type=float, default=2.0)
    ap.add_argument("--balance", default="least_predicted_latency")
    ap.add_argument("--hedge", type=int, default=1, help="1: hedge late calls, 0: never")
    ap.add_argument("--hedge-budget", type=float, default=0.1)
    ap.add_argument("--slow", action="append", default=[], metavar="I:F@T",
                    help="divide server I's CPU quota by F at T s into the run")
    ap.add_argument("--kill", action="append", default=[], metavar="I@T", help="SIGKILL server I at T s")
    ap.add_argument("--robot-links", default="", metavar="TRACE,...",
                    help="shape each robot's own link (namespace + veth, htb both ways; root): one "
                         "trace per robot, cycled (const:MBPS, indoor, outdoor, steps, walk (NAME:SEED), "
                         "iperf:PATH, csv:PATH; a name twice is the same trace at the same times, "
                         "outdoor:1,outdoor:2 are two); default: loopback, unshaped")
    ap.add_argument("--out", default="bench-fleet")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="bench --fleet", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap)
    args = ap.parse_args(argv)
    run(args)
    with open(os.path.join(args.out, "report.md")) as f:
        print(f.read())
