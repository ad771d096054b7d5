"""Run an unmodified Python program with its PyTorch operators offloaded.

    rosrun robot_offload transparent [options] -- python my_app.py [its arguments]
    rosrun robot_offload transparent [options] -- python -m my_package.app [its arguments]
    python -m robot_offload.transparent --inproc -- python my_app.py     (no ROS: in-process server)

The program runs in this interpreter (``runpy``), as ``__main__``, with its own
``sys.argv``, while a :class:`~robot_offload.transparent.proxy.Interceptor` is active on
the main thread and on every thread the program starts
(:func:`~robot_offload.transparent.threads.follow_threads`): nothing in the program
changes. The ROS transport calls the offload
server's services without initialising a node, so a program that is itself a ROS node
calls ``rospy.init_node`` as usual.

At exit -- also when the program raises -- the launcher prints a one-line summary (round
trips, bytes, replays, divergences) to stderr and, with ``--stats-out``, writes the
session's counters as JSON; then the program's exit status or exception is passed on.
"""

import argparse
import contextlib
import json
import os
import runpy
import sys
import threading
import time
from typing import Optional

import torch

from robot_offload.errors import Incompatible
from robot_offload.protocol import method_of
from robot_offload.transparent.session import MODES, RemoteSession
from robot_offload.transparent.threads import follow_threads

PYTHONS = ("python", "python3", os.path.basename(sys.executable))


def split_command(argv):
    """(launcher options, program command) from ``[options] -- python prog args``."""
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    return argv, []


def run_program(command, session: Optional[RemoteSession]) -> int:
    """Run ``command`` (``[python] script.py args`` or ``[python] -m module args``) under
    interception; returns its exit status."""
    if command and command[0] in PYTHONS:
        command = command[1:]
    if not command:
        raise SystemExit("transparent: no program given; usage: transparent [options] -- python app.py [args]")
    if command[0].endswith(("sh", "bash")) or (not command[0].endswith(".py") and command[0] != "-m"
                                                and not os.path.isfile(command[0])):
        raise SystemExit(f"transparent: only Python programs can be intercepted, got {command[0]!r}")
    saved_argv, saved_path = list(sys.argv), list(sys.path)
    status = 0
    try:
        with contextlib.ExitStack() as interception:
            if session is not None:
                interception.enter_context(session)
                interception.enter_context(follow_threads(session))
            if command[0] == "-m":
                if len(command) < 2:
                    raise SystemExit("transparent: -m needs a module name")
                sys.argv = [command[1]] + command[2:]
                runpy.run_module(command[1], run_name="__main__", alter_sys=True)
            else:
                sys.argv = list(command)
                sys.path.insert(0, os.path.dirname(os.path.abspath(command[0])))
                runpy.run_path(command[0], run_name="__main__")
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int) and e.code is not None:
            print(e.code, file=sys.stderr)
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    return status


def make_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="transparent", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=MODES + ("local",), default="auto",
                    help="auto (default: record_replay, each inference on the robot or replayed on the "
                         "server, whichever measured faster), record_replay (RRTO: every identified "
                         "inference replayed on the server), transparent (one "
                         "request per operator) or local (the program as it is, nothing intercepted: "
                         "the reference to compare with)")
    ap.add_argument("--server-ns", default="/offload_server", help="namespace of the offload_server services")
    ap.add_argument("--inproc", action="store_true", help="run the server in this process (no ROS; for tests)")
    ap.add_argument("--inproc-device", default="cpu",
                    help="the in-process server's device (cpu, cuda, auto; default cpu)")
    ap.add_argument("--timeout-s", type=float, default=30.0,
                    help="deadline of one server call (s); past it the program goes on on the robot")
    ap.add_argument("--retry-interval-s", type=float, default=0.5,
                    help="how often a lost server is probed (s)")
    ap.add_argument("--auth-secret-file", default="", help="shared secret for signed requests (file, 0600)")
    ap.add_argument("--stats-out", default="", help="write the session counters here (JSON)")
    return ap


def main(argv=None, make_call=None) -> int:
    """``make_call(args) -> (call(request, timeout_s), close())``, ``call`` taking a compute
    or a ping request; default: ROS services (or the in-process server with ``--inproc``).
    Returns the program's exit status, 2 when the server refuses this robot's versions."""
    argv = list(sys.argv[1:] if argv is None else argv)
    options, command = split_command(argv)
    args = make_parser().parse_args(options)
    if args.mode == "local":
        t0 = time.perf_counter()
        try:
            return run_program(command, None)
        finally:
            print(f"[transparent] mode=local wall_s={time.perf_counter() - t0:.2f}", file=sys.stderr)
    call, close = (make_call or _default_call)(args)
    session = RemoteSession(call, mode=args.mode, timeout_s=args.timeout_s, local_fallback=True,
                            retry_interval_s=args.retry_interval_s)
    try:
        session.connect(args.timeout_s)
    except Incompatible as e:
        close()
        print(f"transparent: the offload server refuses this robot: {e.text}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    stop = threading.Event()
    writer = None
    if args.stats_out:
        # Also while the program runs: a node stopped by roslaunch may be killed mid-frame.
        writer = threading.Thread(target=_write_stats_every, args=(args, session, stop, STATS_EVERY_S),
                                  daemon=True, name="transparent-stats")
        writer.start()
    try:
        return run_program(command, session)
    finally:
        stop.set()
        if writer is not None:
            writer.join(timeout=5.0)     # its last write before the final one
        # also when the program raised: what ran until then is reported, then the
        # exception goes on
        try:
            close()
        finally:
            _report(args, session, t0)


def _report(args, session: RemoteSession, t0: float) -> None:
    """The one-line summary on stderr and, with ``--stats-out``, the counters as JSON."""
    s = session.stats
    print(f"[transparent] mode={args.mode} round_trips={s.round_trips} bytes_up={s.bytes_up} "
          f"bytes_down={s.bytes_down} ops_remote={s.ops_remote} ops_replayed={s.ops_replayed} "
          f"replays={s.replays} divergences={s.divergences} sequences={s.sequences_identified} "
          f"server_losses={s.server_losses} robot_inferences={s.robot_inferences} "
          f"not_static={session.not_static} wall_s={time.perf_counter() - t0:.2f}", file=sys.stderr)
    if s.ops_remote == 0 and s.ops_local > 0:
        print("[transparent] nothing was offloaded: operators run on the server when they read "
              "a server tensor, or a model's weights inside its forward (call the model as "
              "model(x)); this program's ran on the robot", file=sys.stderr)
    if args.stats_out:
        _write_stats(args, session)


#: How often --stats-out is rewritten while the program runs (s).
STATS_EVERY_S = 2.0


def _write_stats(args, session: RemoteSession) -> None:
    """The session's counters as JSON in ``--stats-out``, replaced at once (never half a
    file). Each writer has its own temporary file: the periodic writer and the final one
    may overlap, and with one name each could rename the other's."""
    tmp = f"{args.stats_out}.{os.getpid()}-{threading.get_ident()}.partial"
    with open(tmp, "w") as f:
        json.dump(dict(session.stats.summary(), mode=args.mode, not_static=session.not_static), f, indent=1)
    os.replace(tmp, args.stats_out)


def _write_stats_every(args, session: RemoteSession, stop: threading.Event, period_s: float) -> None:
    while not stop.wait(period_s):
        try:
            _write_stats(args, session)
        except (OSError, RuntimeError, ValueError):    # a counter list changed under us: next time
            pass


def _default_call(args):
    from robot_offload.auth import load_secret
    secret = load_secret(args.auth_secret_file)     # the file, else $ROBOT_OFFLOAD_SECRET
    if args.inproc:
        from robot_offload.server import OffloadServer, ServerConfig  # in-process server (test and local use only)
        from robot_offload.transport.inproc import InProcessTransport
        transport = InProcessTransport(OffloadServer(ServerConfig(device=args.inproc_device)))
    else:
        from robot_offload.ros.transport import RosServiceTransport   # rospy only when used
        transport = RosServiceTransport(args.server_ns)
    if secret:
        transport.set_auth_secret(secret)

    if not args.inproc:
        def call(request, timeout_s):
            return transport.call(method_of(request), request, timeout_s)
        return call, transport.close
    # The in-process server draws random numbers from its own generator state, as a
    # server process would, never from the program's.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0x5e4e)
        server_rng = [torch.get_rng_state()]

    def inproc_call(request, timeout_s):
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(server_rng[0])
            try:
                return transport.call(method_of(request), request, timeout_s)
            finally:
                server_rng[0] = torch.get_rng_state()
    return inproc_call, transport.close
