"""Request/reply transfers of a robot's sizes across a testbed, logged for bandwidth estimation.

The server accepts one connection and answers requests: an 8-byte header (payload bytes,
reply bytes; big-endian uint32), the payload, then it sends the reply. The client makes
requests closed-loop as an offload client does: a frame is due every ``1 / rate_hz`` s, a
frame due while the previous request is still out is skipped, and each request's payload
size is drawn from ``sizes`` (a seeded choice: camera frames and intermediate tensors
mixed, as a client switching between full offload and partitioned plans sends them). It
first sends ``pings`` empty requests for the round-trip time, and prints one JSON object:
``{"rtt_s": [...], "transfers": [[t_start, t_end, bytes_up, bytes_down], ...]}`` with
``time.monotonic()`` times (one clock for every namespace of the machine).

    python -m robot_offload.testbed.transfers serve --host 10.231.0.2
    python -m robot_offload.testbed.transfers client --host 10.231.0.2 --port P \\
        --rate-hz 20 --sizes 150000,600000 --duration-s 30

:func:`record` runs both across a :class:`~robot_offload.testbed.netns.Testbed` while a
trace replays and returns the log with the trace position of every time.
"""

import argparse
import json
import random
import socket
import struct
import subprocess
import sys
import time

from robot_offload.testbed._common import with_package_path
from robot_offload.testbed.netns import TraceReplayer

HEADER = struct.Struct("!II")
#: Largest payload / reply a request may ask for (bytes): the server is a test tool, but
#: still does not allocate what a header says without a bound.
MAX_PAYLOAD_BYTES = 64 * 1024 * 1024
MAX_REPLY_BYTES = 16 * 1024 * 1024
CHUNK = 64 * 1024


def _recv_exact(sock, n, buf):
    """Read exactly n bytes (discarded into buf); False if the peer closed first."""
    view = memoryview(buf)
    while n > 0:
        got = sock.recv_into(view, min(n, len(buf)))
        if got == 0:
            return False
        n -= got
    return True


def serve(host, *, port=0, timeout_s=60.0, out=sys.stdout):
    """Accept one client and answer its requests until it closes."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as lsock:
        lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        lsock.bind((host, port))
        lsock.listen(1)
        lsock.settimeout(timeout_s)
        print(f"READY {lsock.getsockname()[1]}", file=out, flush=True)
        conn, _ = lsock.accept()
    buf = bytearray(CHUNK)
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.settimeout(timeout_s)
        while True:
            if not _recv_exact(conn, HEADER.size, buf):
                return
            payload, reply = HEADER.unpack_from(buf)
            if payload > MAX_PAYLOAD_BYTES or reply > MAX_REPLY_BYTES:
                raise ValueError(f"request of {payload} B asking {reply} B is over the bounds")
            if not _recv_exact(conn, payload, buf):
                return
            conn.sendall(bytes(reply))


def client(host, port, *, rate_hz=20.0, sizes=(150_000, 600_000), reply_bytes=2_000,
           duration_s=30.0, pings=20, seed=0, connect_timeout_s=5.0):
    """Make requests for ``duration_s`` (see the module docstring); returns the log."""
    if not rate_hz > 0 or not sizes or min(sizes) < 0 or max(sizes) > MAX_PAYLOAD_BYTES:
        raise ValueError("rate_hz must be > 0 and sizes within [0, MAX_PAYLOAD_BYTES]")
    rng = random.Random(seed)
    period = 1.0 / rate_hz
    buf = bytearray(CHUNK)
    payloads = {s: bytes(s) for s in set(sizes)}
    rtts, log = [], []
    with socket.create_connection((host, port), timeout=connect_timeout_s) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(max(30.0, duration_s))

        def request(size, reply):
            sock.sendall(HEADER.pack(size, reply) + payloads.get(size, b""))
            if not _recv_exact(sock, reply, buf):
                raise RuntimeError("server closed the connection")

        payloads[0] = b""
        for _ in range(pings):
            t0 = time.monotonic()
            request(0, 1)
            rtts.append(time.monotonic() - t0)
        frames = max(1, int(round(duration_s * rate_hz)))
        start = time.monotonic()
        k = 0
        while k < frames:
            due = start + k * period
            now = time.monotonic()
            if due > now:
                time.sleep(due - now)
            size = rng.choice(sizes)
            t0 = time.monotonic()
            request(size, reply_bytes)
            t1 = time.monotonic()
            log.append([t0, t1, size + HEADER.size, reply_bytes])
            # the next frame due after this one finished (frames due meanwhile are skipped)
            k = max(k + 1, int((t1 - start) / period) + 1)
    return {"rtt_s": rtts, "transfers": log}


def record(testbed, trace, *, rate_hz=20.0, sizes=(150_000, 600_000), reply_bytes=2_000,
           duration_s=None, seed=0, python=None, env=None):
    """Replay ``trace`` on the testbed while a client makes requests across it.

    Returns {"rtt_s", "transfers" (as the client's, times now in trace position, s),
    "late_steps"}. Raises RuntimeError if either side fails."""
    python = python or sys.executable
    env = with_package_path(env)
    duration_s = float(duration_s or trace.duration_s - 1.0)
    if duration_s > trace.duration_s - 0.5:
        raise ValueError("the trace must outlast the client by at least 0.5 s")
    timeout_s = duration_s + 30.0
    srv = testbed.run("server", [python, "-m", "robot_offload.testbed.transfers", "serve",
                                 "--host", testbed.server_ip, "--timeout-s", timeout_s],
                      env=env, stdout=subprocess.PIPE, text=True)
    try:
        ready = srv.stdout.readline().split()
        if len(ready) != 2 or ready[0] != "READY":
            raise RuntimeError(f"request server did not start (said {ready!r})")
        testbed.set_rate(trace.rates_bps[0])
        t_zero = time.monotonic()
        with TraceReplayer(testbed, trace) as rp:
            cli = testbed.run("robot", [python, "-m", "robot_offload.testbed.transfers",
                                        "client", "--host", testbed.server_ip,
                                        "--port", ready[1], "--rate-hz", rate_hz,
                                        "--sizes", ",".join(str(s) for s in sizes),
                                        "--reply-bytes", reply_bytes,
                                        "--duration-s", duration_s, "--seed", seed],
                              env=env, stdout=subprocess.PIPE, text=True)
            out, _ = cli.communicate(timeout=timeout_s)
        if cli.returncode != 0:
            raise RuntimeError(f"request client exited {cli.returncode}")
        if rp.error is not None:
            raise RuntimeError(f"trace replay failed: {rp.error}")
        got = json.loads(out.strip().splitlines()[-1])
        got["transfers"] = [[t0 - t_zero, t1 - t_zero, up, down]
                            for t0, t1, up, down in got["transfers"]]
        got["late_steps"] = rp.late_steps
        return got
    finally:
        if srv.poll() is None:
            srv.kill()
        srv.wait(5)


def _sizes(text):
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--sizes: {e}") from e
    if not sizes or min(sizes) < 0 or max(sizes) > MAX_PAYLOAD_BYTES:
        raise argparse.ArgumentTypeError(f"--sizes: bytes in [0, {MAX_PAYLOAD_BYTES}]")
    return sizes


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m robot_offload.testbed.transfers")
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve")
    s.add_argument("--host", required=True)
    s.add_argument("--port", type=int, default=0)
    s.add_argument("--timeout-s", type=float, default=60.0)
    c = sub.add_parser("client")
    c.add_argument("--host", required=True)
    c.add_argument("--port", type=int, required=True)
    c.add_argument("--rate-hz", type=float, default=20.0)
    c.add_argument("--sizes", type=_sizes, default=[150_000, 600_000])
    c.add_argument("--reply-bytes", type=int, default=2_000)
    c.add_argument("--duration-s", type=float, default=30.0)
    c.add_argument("--pings", type=int, default=20)
    c.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.cmd == "serve":
        serve(args.host, port=args.port, timeout_s=args.timeout_s)
    else:
        log = client(args.host, args.port, rate_hz=args.rate_hz, sizes=args.sizes,
                     reply_bytes=args.reply_bytes, duration_s=args.duration_s,
                     pings=args.pings, seed=args.seed)
        print(json.dumps(log), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
