"""Bounded TCP bulk transfer for measuring a testbed link (plain sockets, no iperf).

The receiver listens, prints ``READY <port>`` on stdout, accepts one connection, counts
bytes until the sender closes (or ``timeout_s``), and prints one JSON line with the
goodput measured after a warm-up. The sender connects and writes for ``duration_s``.

    python -m robot_offload.testbed.bulk recv --host 10.231.0.2 [--warmup-s 0.3]
    python -m robot_offload.testbed.bulk send --host 10.231.0.2 --port P --duration-s 2.5

:func:`measure` drives both through a :class:`~robot_offload.testbed.netns.Testbed`.
:func:`measure_rtt` does the same for round-trip time (``echo`` and ``ping``: one-byte
messages over one TCP connection).
"""

import argparse
import json
import socket
import subprocess
import sys
import time

from robot_offload.testbed._common import with_package_path

CHUNK = 64 * 1024


def _accept_one(host, port, timeout_s, out):
    """Listen on host:port (0: any free port), print ``READY <port>`` for the parent, and
    return the first connection (socket.timeout after ``timeout_s``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as lsock:
        lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        lsock.bind((host, port))
        lsock.listen(1)
        lsock.settimeout(timeout_s)
        print(f"READY {lsock.getsockname()[1]}", file=out, flush=True)
        conn, _ = lsock.accept()
    return conn


def receive(host, *, port=0, warmup_s=0.3, timeout_s=30.0, out=sys.stdout):
    """Accept one sender and return {"bytes", "seconds", "bps", "total_bytes"}."""
    conn = _accept_one(host, port, timeout_s, out)
    deadline = time.monotonic() + timeout_s
    total = 0
    t_first = t_mark = t_last = None
    bytes_at_mark = 0
    buf = bytearray(CHUNK)
    with conn:
        conn.settimeout(1.0)
        while time.monotonic() < deadline:
            try:
                n = conn.recv_into(buf)
            except socket.timeout:
                continue
            if n == 0:
                break
            now = time.monotonic()
            if t_first is None:
                t_first = now
            if t_mark is None and now - t_first >= warmup_s:
                t_mark, bytes_at_mark = now, total
            total += n
            t_last = now
    if t_mark is None or t_last <= t_mark:
        # Transfer shorter than the warm-up: measure all of it.
        t_mark, bytes_at_mark = t_first, 0
    seconds = (t_last - t_mark) if t_last and t_mark else 0.0
    counted = total - bytes_at_mark
    return {"bytes": counted, "seconds": seconds, "total_bytes": total,
            "bps": counted * 8.0 / seconds if seconds > 0 else 0.0}


def send(host, port, *, duration_s=2.5, connect_timeout_s=5.0):
    """Write zeros to host:port for duration_s; returns bytes sent."""
    payload = bytes(CHUNK)
    sent = 0
    with socket.create_connection((host, port), timeout=connect_timeout_s) as sock:
        sock.settimeout(max(5.0, duration_s))
        end = time.monotonic() + duration_s
        while time.monotonic() < end:
            sent += sock.send(payload)
    return sent


def echo(host, *, port=0, timeout_s=30.0, out=sys.stdout):
    """Accept one client and send back every byte it sends, until it closes."""
    conn = _accept_one(host, port, timeout_s, out)
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.settimeout(timeout_s)
        while True:
            data = conn.recv(CHUNK)
            if not data:
                return
            conn.sendall(data)


def ping(host, port, *, samples=50, connect_timeout_s=5.0):
    """Round-trip times (s) of ``samples`` one-byte messages over one TCP connection (the
    way a persistent ROS service connection is used), without Nagle's delay."""
    rtts = []
    with socket.create_connection((host, port), timeout=connect_timeout_s) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(samples):
            t0 = time.perf_counter()
            sock.sendall(b"x")
            if not sock.recv(1):
                raise RuntimeError("echo server closed the connection")
            rtts.append(time.perf_counter() - t0)
    return rtts


def measure_rtt(testbed, *, samples=50, python=None, env=None):
    """TCP round-trip time robot -> server -> robot: {"median_s", "min_s", "samples"}.

    Raises RuntimeError if either side fails."""
    python = python or sys.executable
    env = with_package_path(env)
    srv = testbed.run("server", [python, "-m", "robot_offload.testbed.bulk", "echo",
                                 "--host", testbed.server_ip],
                      env=env, stdout=subprocess.PIPE, text=True)
    try:
        ready = srv.stdout.readline().split()
        if len(ready) != 2 or ready[0] != "READY":
            raise RuntimeError(f"echo server did not start (said {ready!r})")
        cli = testbed.run("robot", [python, "-m", "robot_offload.testbed.bulk", "ping",
                                    "--host", testbed.server_ip, "--port", ready[1],
                                    "--samples", samples],
                          env=env, stdout=subprocess.PIPE, text=True)
        out, _ = cli.communicate(timeout=30.0 + samples)
        if cli.returncode != 0:
            raise RuntimeError(f"ping exited {cli.returncode}")
        rtts = sorted(json.loads(out.strip().splitlines()[-1]))
        return {"median_s": rtts[len(rtts) // 2], "min_s": rtts[0], "samples": len(rtts)}
    finally:
        if srv.poll() is None:
            srv.kill()
        srv.wait(5)


def measure(testbed, direction="up", *, duration_s=2.5, warmup_s=0.3, python=None,
            env=None):
    """Measure goodput across a testbed: "up" = robot sends to server, "down" = reverse.

    Returns the receiver's dict (bps = goodput after warm-up). Raises RuntimeError if
    either side fails."""
    if direction not in ("up", "down"):
        raise ValueError(f"direction must be 'up' or 'down', got {direction!r}")
    rx_side, tx_side = ("server", "robot") if direction == "up" else ("robot", "server")
    rx_ip = testbed.server_ip if rx_side == "server" else testbed.robot_ip
    python = python or sys.executable
    env = with_package_path(env)
    timeout_s = duration_s + 15.0
    rx = testbed.run(rx_side, [python, "-m", "robot_offload.testbed.bulk", "recv",
                               "--host", rx_ip, "--warmup-s", warmup_s,
                               "--timeout-s", timeout_s],
                     env=env, stdout=subprocess.PIPE, text=True)
    try:
        ready = rx.stdout.readline().split()
        if len(ready) != 2 or ready[0] != "READY":
            raise RuntimeError(f"receiver did not start (said {ready!r})")
        tx = testbed.run(tx_side, [python, "-m", "robot_offload.testbed.bulk", "send",
                                   "--host", rx_ip, "--port", ready[1],
                                   "--duration-s", duration_s], env=env)
        if tx.wait(timeout_s) != 0:
            raise RuntimeError(f"sender exited {tx.returncode}")
        out, _ = rx.communicate(timeout=timeout_s)
        if rx.returncode != 0:
            raise RuntimeError(f"receiver exited {rx.returncode}")
        return json.loads(out.strip().splitlines()[-1])
    finally:
        if rx.poll() is None:
            rx.kill()
            rx.wait(5)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m robot_offload.testbed.bulk")
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("recv")
    r.add_argument("--host", required=True)
    r.add_argument("--port", type=int, default=0)
    r.add_argument("--warmup-s", type=float, default=0.3)
    r.add_argument("--timeout-s", type=float, default=30.0)
    s = sub.add_parser("send")
    s.add_argument("--host", required=True)
    s.add_argument("--port", type=int, required=True)
    s.add_argument("--duration-s", type=float, default=2.5)
    e = sub.add_parser("echo")
    e.add_argument("--host", required=True)
    e.add_argument("--port", type=int, default=0)
    p = sub.add_parser("ping")
    p.add_argument("--host", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--samples", type=int, default=50)
    args = ap.parse_args(argv)
    if args.cmd == "echo":
        echo(args.host, port=args.port)
    elif args.cmd == "ping":
        print(json.dumps(ping(args.host, args.port, samples=args.samples)), flush=True)
    elif args.cmd == "recv":
        result = receive(args.host, port=args.port, warmup_s=args.warmup_s,
                         timeout_s=args.timeout_s)
        print(json.dumps(result), flush=True)
    else:
        send(args.host, args.port, duration_s=args.duration_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
