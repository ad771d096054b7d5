"""``python -m robot_offload.server.fuzz --requests 10000``: a roscore and a real
offload_server node, the fuzz over its ``compute`` service, a summary table."""

import argparse
import json
import os
import sys
import tempfile
import time


from robot_offload.protocol import StatusCode
from robot_offload.server.fuzz.report import ProcessWatch, run_fuzz, transport_calls
from robot_offload.server.fuzz.state import FUZZ_CONFIG

# -- command line ---------------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m robot_offload.server.fuzz", description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=10000, help="generated requests to send")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--valid-every", type=int, default=50, help="a valid-client check every N requests")
    p.add_argument("--workdir", default="", help="logs of roscore and the server (default: a temporary folder)")
    p.add_argument("--out", default="", help="write the report as JSON here")
    p.add_argument("--threads", type=int, default=2, help="clients fuzzing concurrently besides the main one")
    args = p.parse_args(argv)
    if args.requests <= 0 or args.valid_every < 0:
        p.error("--requests must be positive and --valid-every not negative")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    # The server runs in a ROS node of its own: its tools live under robot_offload.ros.
    from robot_offload.ros.server_process import RosServer

    workdir = args.workdir or tempfile.mkdtemp(prefix="fuzz_")
    os.makedirs(workdir, exist_ok=True)
    server = RosServer(None, workdir, threads=2, params=FUZZ_CONFIG)
    try:
        transport = server.transport

        send, ping, load = transport_calls(transport, FUZZ_CONFIG["max_request_s"] + 40)

        def progress(r):
            print(f"[fuzz] {r.requests} requests, {dict(r.by_status)}, valid {r.valid_passed}/"
                  f"{r.valid_checks}, {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        report = run_fuzz(send, args.requests, seed=args.seed, valid_every=args.valid_every, ping=ping,
                          watch=ProcessWatch(server.node.pid), progress=progress, load=load,
                          threads=max(0, args.threads))
    finally:
        server.close()
    print(report.table())
    problems = report.problems()
    for line in problems:
        print("PROBLEM:", line)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(vars(report), by_status={StatusCode(k).name: v for k, v in report.by_status.items()},
                           problems=problems, seed=args.seed, config=FUZZ_CONFIG, workdir=workdir), f, indent=1)
    print(f"logs in {workdir}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

