"""Soak test: many inferences through every mode, a server crash in the middle, and a
check that the client process does not leak memory, threads or file descriptors.

::

    python -m robot_offload.soak --inferences 10000 --switch-every 100 --restart-at 5000

With ``--transport ros`` (default) it starts its own ``roscore`` on a free port and a real
``offload_server`` node (``rosrun robot_offload offload_server``), and runs an
:class:`~robot_offload.client.OffloadClient` in this process as a rospy node over the same
persistent service connections as ``offload_client``; the restart is a crash (SIGKILL of the
server node, nothing unregisters) followed by a fresh node. ``--transport inproc`` uses an
in-process :class:`~robot_offload.server.OffloadServer` (replaced by a new object at the
restart) and no ROS at all. rospy is imported only for ``--transport ros``.

The mode changes every ``--switch-every`` inferences, cycling through
``robot_offload.backends.modes()``. Before the counted inferences each mode runs
``--warmup-per-mode`` times (profiles, graph captures, caches and thread pools are made
then); the baseline is taken after that. At the end (and after the client is idle again)
RSS, open file descriptors and OS threads of this process are compared with the baseline,
and likewise for each server instance (ROS only) from its first answered request to its
end. Exit status 1 if RSS grew by more than ``--max-rss-growth-mb`` or the thread or fd
count grew at all (``--max-thread-growth`` / ``--max-fd-growth``) beyond what the
transport's bounded pools account for (worker threads and persistent connections are added
when calls overlap, more of them on a loaded machine; they are subtracted, reported as
``transport_pools`` and must stay within the transport's bound), or while threads and fds
have not settled back within ``--settle-s``; a failed check names what grew, by thread
name and fd kind. Also 1 if an output was
malformed, or if a ``layer_partition`` output erred more than the client's
``error_tolerance`` against the local outputs (the error of
:func:`~robot_offload.partition.profile.output_error`, reported per executed mode as
``max_relative_error``); 2 for bad arguments or an environment that cannot run it.
"""

import argparse
import gc
import json
import logging
import os
import re
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict

import torch

from robot_offload import auth, backends
from robot_offload.client import ClientConfig, OffloadClient
from robot_offload.errors import ConfigError
from robot_offload.health import process_figures
from robot_offload.partition.profile import output_error


def _say(msg: str) -> None:
    """Progress on stderr (rospy.init_node reconfigures logging, so not via logging)."""
    print(f"{time.strftime('%H:%M:%S')} soak: {msg}", file=sys.stderr, flush=True)


# -- process figures (RSS, fds, threads: robot_offload.health.process_figures) -------------------
def inventory() -> dict:
    """What this process holds, by kind: Python threads by name and open file descriptors
    by target (``socket``, ``pipe``, a path), so that a failed leak check says what grew."""
    fds = Counter()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        fds[target.split(":", 1)[0] if ":" in target else target] += 1
    names = Counter(re.sub(r"[-_ ]?\d+$", "", t.name) for t in threading.enumerate())
    return {"threads": names, "fds": fds}


def grown(a: dict, b: dict) -> str:
    """The kinds :func:`inventory` counted more of in ``b`` than in ``a``, e.g.
    "threads: Thread x1; fds: socket x1"."""
    parts = []
    for kind in ("threads", "fds"):
        more = b[kind] - a[kind]
        if more:
            parts.append(f"{kind}: " + ", ".join(f"{k} x{n}" for k, n in sorted(more.items())))
    return "; ".join(parts) or "nothing Python sees (native threads)"


def leaked(a: dict, b: dict, pools_a: dict, pools_b: dict) -> dict:
    """Growth of threads and fds from figures ``a`` to ``b`` that the transport's pools
    (:meth:`~robot_offload.transport.base.Transport.held`, one socket per connection) do
    not account for. The pools fill lazily and stay bounded; anything else that grew is
    held by nobody who will give it back."""
    g = _delta(a, b)
    return {"threads": g["threads"] - (pools_b["threads"] - pools_a["threads"]),
            "fds": g["fds"] - (pools_b["connections"] - pools_a["connections"])}


def _delta(a: dict, b: dict) -> dict:
    return {"rss_mb": round(b["rss_mb"] - a["rss_mb"], 1), "fds": b["fds"] - a["fds"],
            "threads": b["threads"] - a["threads"]}


# -- servers -------------------------------------------------------------------------------------
class InProcServer:
    """An OffloadServer object behind an InProcessTransport; restart = a new object."""

    def __init__(self, secret):
        from robot_offload.server import OffloadServer, ServerConfig
        from robot_offload.transport.inproc import InProcessTransport
        self._make = lambda: OffloadServer(ServerConfig(device="cpu"), auth_secret=secret)
        self.transport = InProcessTransport(self._make(), auth_secret=secret)
        self.instances = []

    def restart(self):
        self.transport.server = None          # crash: calls fail while it is gone
        time.sleep(0.5)
        self.transport.server = self._make()

    def figures(self):
        return None

    def close(self):
        self.transport.close()


def _check_output(out) -> bool:
    return isinstance(out, torch.Tensor) and out.ndim == 2 and bool(torch.isfinite(out).all())


def run(args) -> dict:
    start = process_figures()
    modes = args.modes or backends.modes()
    workdir = args.workdir or tempfile.mkdtemp(prefix="robot_offload_soak-")
    os.makedirs(workdir, exist_ok=True)
    secret = auth.load_secret(args.auth_secret_file or "")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.transport == "ros":
        from robot_offload.ros.server_process import RosServer   # ROS only from here on
    server = (RosServer(args.auth_secret_file, workdir, args.threads) if args.transport == "ros"
              else InProcServer(secret))
    cfg = ClientConfig(model=args.model, mode="local", input_size=tuple(args.input_size),
                       timeout_s=args.timeout_s, profile_dir=os.path.join(workdir, "profiles"),
                       load_timeout_s=120.0, num_threads=args.threads)
    client = OffloadClient(cfg, server.transport)
    executed = defaultdict(Counter)
    errors = Counter()
    bad_outputs = 0
    max_err = defaultdict(float)
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn((1, 3, *args.input_size), generator=gen) for _ in range(8)]
    with torch.inference_mode():
        references = [client.model(x) for x in inputs]
    try:
        if not client.connect(120):
            raise RuntimeError(f"server not reachable: {client.link.last_error}")

        served_since_restart = set()
        after_restart = Counter()
        restart_t = resume_s = None

        def infer(i, mode):
            nonlocal bad_outputs, resume_s
            if client.mode != mode:
                client.set_mode(mode)
            k = i % len(inputs)
            out, stats = client.infer(inputs[k])
            executed[mode][stats.executed_mode] += 1
            served_since_restart.add(stats.executed_mode)
            if restart_t is not None:
                after_restart[stats.executed_mode] += 1
                if resume_s is None and stats.executed_mode != "local":
                    resume_s = time.monotonic() - restart_t
            if stats.fallback_reason:
                errors[stats.fallback_reason.split(":")[0]] += 1
            if not _check_output(out) or out.shape != references[k].shape:
                bad_outputs += 1
            else:
                err = output_error(out, references[k])
                max_err[stats.executed_mode] = max(max_err[stats.executed_mode], err)

        t0 = time.perf_counter()
        for mode in modes:                         # warm-up, not counted
            for i in range(args.warmup_per_mode):
                infer(i, mode)
        # the prober's ping connection is opened at the first outage otherwise
        from robot_offload.protocol import PingRequest
        server.transport.call("ping", PingRequest(client_id=cfg.client_id), 10.0)
        if hasattr(server, "note_server"):
            server.note_server(baseline=True)
        gc.collect()
        baseline = process_figures()
        baseline_held = inventory()
        baseline_pools = server.transport.held()
        warmup_s = time.perf_counter() - t0
        _say(f"warm-up done in {warmup_s:.1f} s: {baseline}")
        t0 = time.perf_counter()
        restarted = False
        new_server_warm = False
        for i in range(args.inferences):
            mode = modes[(i // args.switch_every) % len(modes)]
            if args.restart_at is not None and i == args.restart_at and not restarted:
                _say(f"inference {i}: restarting the server (SIGKILL, then a new one)")
                server.restart()
                restarted = True
                restart_t = time.monotonic()
                served_since_restart.clear()
            if args.rate_hz:
                time.sleep(max(0.0, t0 + i / args.rate_hz - time.perf_counter()))
            infer(i, mode)
            if (restarted and not new_server_warm and hasattr(server, "note_server")
                    and served_since_restart >= set(modes)):
                server.note_server(baseline=True)      # the new server has served every mode
                new_server_warm = True
            if args.progress and (i + 1) % args.progress == 0:
                _say(f"{i + 1}/{args.inferences} inferences, {time.perf_counter() - t0:.1f} s, "
                     f"{process_figures()}")
        run_s = time.perf_counter() - t0
        # Let the client settle (prober done, calls finished) before the final figures.
        end_wait = time.monotonic() + 10
        while client.link is not None and not client.link.available and time.monotonic() < end_wait:
            time.sleep(0.1)
        # Threads and sockets still finishing (a background re-plan, a reconnect's last
        # call on a loaded machine) are not leaks: the figures are read again until they
        # are back within the limits or ``settle_s`` has passed; a leak stays.
        settle_end = time.monotonic() + args.settle_s
        while True:
            time.sleep(1.0)
            gc.collect()
            end = process_figures()
            end_held = inventory()
            end_pools = server.transport.held()
            leak = leaked(baseline, end, baseline_pools, end_pools)
            leaks = leak["threads"] > args.max_thread_growth or leak["fds"] > args.max_fd_growth
            if not leaks or time.monotonic() > settle_end:
                break
        if hasattr(server, "note_server"):
            server.note_server()
    finally:
        client.close()
        server.close()

    growth = _delta(baseline, end)
    limits = server.transport.held_limits()
    failures = []
    if growth["rss_mb"] > args.max_rss_growth_mb:
        failures.append(f"RSS grew by {growth['rss_mb']} MB (limit {args.max_rss_growth_mb})")
    if leak["threads"] > args.max_thread_growth:
        failures.append(f"threads grew by {leak['threads']} beyond the transport's pools")
    if leak["fds"] > args.max_fd_growth:
        failures.append(f"open fds grew by {leak['fds']} beyond the transport's connections")
    if leaks:
        failures.append(f"new since the baseline: {grown(baseline_held, end_held)}")
    for kind in ("threads", "connections"):
        if end_pools[kind] > limits[kind]:
            failures.append(f"the transport holds {end_pools[kind]} {kind}, more than its "
                            f"bound of {limits[kind]}")
    servers = []
    for n, inst in enumerate(server.figures() or []):
        if inst["baseline"] and inst["end"]:
            d = _delta(inst["baseline"], inst["end"])
            servers.append({"instance": n, "baseline": inst["baseline"], "end": inst["end"], "growth": d})
            if d["rss_mb"] > args.max_rss_growth_mb:
                failures.append(f"server instance {n}: RSS grew by {d['rss_mb']} MB")
    if bad_outputs:
        failures.append(f"{bad_outputs} malformed outputs")
    if max_err.get("layer_partition", 0.0) > cfg.error_tolerance:
        failures.append(f"layer_partition erred {max_err['layer_partition']:.5f} against local "
                        f"(error_tolerance {cfg.error_tolerance})")
    offloading = [m for m in modes if m != "local"]
    never = [m for m in offloading if executed[m].get(m, 0) == 0]
    if never:
        failures.append(f"modes that never ran on the server: {never}")
    offloaded_after = sum(n for m, n in after_restart.items() if m != "local")
    if args.restart_at is not None and offloading and not offloaded_after:
        failures.append("offloading never resumed after the server restart")
    return {
        "transport": args.transport, "model": args.model, "input_size": list(args.input_size),
        "inferences": args.inferences, "switch_every": args.switch_every, "restart_at": args.restart_at,
        "modes": modes, "warmup_s": round(warmup_s, 1), "run_s": round(run_s, 1),
        "inferences_per_s": round(args.inferences / run_s, 1) if run_s else None,
        "start": start, "baseline": baseline, "end": end, "growth": growth,
        "transport_pools": {"baseline": baseline_pools, "end": end_pools, "limits": limits},
        "leaked": leak, "servers": servers,
        "held": {"baseline": {k: dict(v) for k, v in baseline_held.items()},
                 "end": {k: dict(v) for k, v in end_held.items()}},
        "executed": {m: dict(c) for m, c in executed.items()},
        "fallback_reasons": dict(errors.most_common(10)),
        "after_restart": dict(after_restart),
        "resume_after_restart_s": None if resume_s is None else round(resume_s, 2),
        "max_relative_error": {m: round(e, 6) for m, e in max_err.items()},
        "bad_outputs": bad_outputs, "failures": failures, "ok": not failures,
        "workdir": workdir,
    }


def _positive_int(text):
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def _size(text):
    parts = [int(p) for p in text.replace("x", ",").split(",") if p]
    if len(parts) != 2 or min(parts) <= 0:
        raise argparse.ArgumentTypeError(f"expected H,W, got {text!r}")
    return parts


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m robot_offload.soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--inferences", type=_positive_int, default=10000)
    p.add_argument("--switch-every", type=_positive_int, default=100, help="inferences per mode")
    p.add_argument("--restart-at", type=int, default=None, help="inference index at which the server crashes and restarts")
    p.add_argument("--modes", nargs="+", default=None, help="default: every registered mode")
    p.add_argument("--model", default="resnet18")
    p.add_argument("--input-size", type=_size, default=[32, 32], help="H,W (default 32,32)")
    p.add_argument("--rate-hz", type=float, default=0.0,
                   help="pace the inferences like a camera (0: back to back)")
    p.add_argument("--timeout-s", type=float, default=2.0, help="the client's per-frame deadline")
    p.add_argument("--transport", choices=("ros", "inproc"), default="ros")
    p.add_argument("--auth-secret-file", default="", help="sign requests (server and client) with this secret file")
    p.add_argument("--warmup-per-mode", type=int, default=5)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads of client and server (0: torch's default; 1 keeps two processes "
                        "from fighting over a small machine's cores)")
    p.add_argument("--max-rss-growth-mb", type=float, default=50.0)
    p.add_argument("--max-thread-growth", type=int, default=0)
    p.add_argument("--max-fd-growth", type=int, default=0)
    p.add_argument("--settle-s", type=float, default=15.0,
                   help="how long threads and fds may take to return to the baseline after the "
                        "last inference (s)")
    p.add_argument("--progress", type=int, default=1000, help="log every N inferences (0: never)")
    p.add_argument("--workdir", default="", help="logs and profiles (default: a new temp dir)")
    p.add_argument("--out", default="", help="also write the JSON report here")
    args = p.parse_args(argv)
    if args.restart_at is not None and not 0 <= args.restart_at < args.inferences:
        p.error(f"--restart-at must be within [0, {args.inferences})")
    unknown = [m for m in args.modes or () if m not in backends.modes()]
    if unknown:
        p.error(f"unknown modes {unknown}; known: {backends.modes()}")
    return args


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("robot_offload.server").setLevel(logging.ERROR)
    args = parse_args(argv)
    try:
        report = run(args)
    except (ConfigError, RuntimeError, OSError) as e:
        print(f"soak: {e}", file=sys.stderr)
        return 2
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    g = report["growth"]
    print(f"soak: {args.inferences} inferences in {report['run_s']} s; RSS {report['baseline']['rss_mb']:.1f} -> "
          f"{report['end']['rss_mb']:.1f} MB ({g['rss_mb']:+} MB), threads {report['baseline']['threads']} -> "
          f"{report['end']['threads']}, fds {report['baseline']['fds']} -> {report['end']['fds']}: "
          + ("OK" if report["ok"] else "FAILED: " + "; ".join(report["failures"])), file=sys.stderr)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
