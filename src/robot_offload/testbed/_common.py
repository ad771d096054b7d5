"""Names, errors and small helpers shared by the testbed modules.

Every kernel object the testbed creates (network namespaces, cgroups) is named
``<PREFIX>-<pid>-<seq>...`` so that ``python -m robot_offload.testbed cleanup`` can find what
a crashed run left behind and tell whose it was from the pid.
"""

import itertools
import os
import re
import subprocess

from robot_offload.errors import OffloadError

#: Prefix of every namespace and cgroup the testbed creates.
PREFIX = "rotb"

#: ``rotb-<pid>-<seq>`` at the start of a name; the rest is a role suffix.
NAME_RE = re.compile(r"^" + PREFIX + r"-(\d+)-(\d+)(?:-[a-z]+)?$")

_seq = itertools.count()


class TestbedError(OffloadError):
    """A namespace, qdisc or cgroup could not be created, changed or removed."""

    __test__ = False  # not a pytest test class


def free_port() -> int:
    """A TCP port on 127.0.0.1 free now (another process may take it before it is bound)."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_on_free_port(start, wait, attempts: int = 3):
    """Start a process listening on a free port (a roscore): ``start(port)`` -> Popen,
    ``wait(proc)`` returns once it answers and raises once it has exited. A port chosen
    free can be taken before the process binds it ("Address already in use"): then try
    another. Returns (proc, port)."""
    for attempt in range(attempts):
        port = free_port()
        proc = start(port)
        try:
            wait(proc)
            return proc, port
        except (RuntimeError, TimeoutError):
            if proc.poll() is None or attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


def unique_base(prefix=PREFIX):
    """``prefix-<pid>-<n>``: unique within this host while this process lives."""
    return f"{prefix}-{os.getpid()}-{next(_seq)}"


def owner_pid(name):
    """The pid encoded in a testbed object's name, or None if the name is not ours."""
    m = NAME_RE.match(name)
    return int(m.group(1)) if m else None


def pid_alive(pid):
    """True if a process with this pid exists (zombies count as gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != b"Z"


def run_cmd(argv, *, check=True, timeout_s=10.0, input_text=None):
    """Run a short command (ip, tc), returning CompletedProcess; TestbedError on failure."""
    try:
        proc = subprocess.run(argv, input=input_text, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, timeout=timeout_s,
                              check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise TestbedError(f"{' '.join(argv)}: {e}") from e
    if check and proc.returncode != 0:
        what = " ".join(argv) + (f" <<< {input_text.strip()!r}" if input_text else "")
        raise TestbedError(f"{what} exited {proc.returncode}: "
                           f"{proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def with_package_path(env=None):
    """``env`` plus PYTHONPATH pointing at the directory holding robot_offload, so that
    ``python -m robot_offload...`` works in a child whatever its working directory."""
    import robot_offload

    src = os.path.dirname(os.path.dirname(os.path.abspath(robot_offload.__file__)))
    env = dict(env or {})
    current = env.get("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, current) if p)
    return env
