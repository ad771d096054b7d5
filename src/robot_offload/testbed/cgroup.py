"""Slow the "robot" down: a CPU quota for given processes (cgroup v1 ``cpu`` or v2 ``cpu.max``).

::

    with CpuLimit(ratio=0.25) as lim:           # a quarter of one CPU
        proc = lim.popen([sys.executable, "robot_client.py"])   # in the group from exec
        tb.run("robot", argv, cpu_limit=lim)     # the same, inside a testbed namespace
        lim.add(other_pid)                       # or move a running process (all threads)
        ...
    # processes still alive are moved back to their own cgroup; the group is removed

``ratio`` is in CPUs (0.25 = a quarter of one core, 2.0 = two cores), turned into
``quota = ratio * period``. Children a process forks later stay in its cgroup.

The quota stands in for a slower robot CPU, which is slower at every instant, so it is
handed out in short pieces: a 4 ms period (2 ms of quota at 0.5 CPU), with the kernel's
CFS bandwidth slice (``kernel.sched_cfs_bandwidth_slice_us``, 5 ms by default) set to
1 ms while a limit is open and put back when the last one closes. A burst shorter than
the quota runs at full speed, and the kernel grants quota a slice at a time, so long
periods and long slices make short work fast and its timings bimodal. MobileNetV2 (15 ms
alone on a core), 40 forwards under 0.5 CPU, median [p10-p90] in ms:

=====================  =====================  =====================
period / slice         spaced 30 ms apart     back to back
=====================  =====================  =====================
100 ms / 5 ms          40 (36 ms alone then)  79
20 ms / 5 ms           16-25 [15-29]          27-36 [23-38]
4 ms / 1 ms            28-31 [24-32]          30-32 [26-34]
2 ms / 1 ms            42 [36-43]             43 [39-47]
=====================  =====================  =====================

Only 4 ms / 1 ms is twice as slow spaced as back to back, with a narrow spread; with
20 ms a spaced frame ran unthrottled half the time (16 ms), so a small model's latency
flipped between two values from frame to frame and a profile (forwards back to back)
did not predict a frame. Where the slice cannot be written (no root, a read-only
``/proc/sys``), the period falls back to 20 ms (:data:`DEFAULT_PERIOD_US`), and
:attr:`CpuLimit.slice_us` is None. The slice is machine-wide: a process that sets it
records the value from before in ``/var/tmp/rotb-<pid>-0-slice``; the last live holder
puts it back, and after a SIGKILL ``python -m robot_offload.testbed cleanup`` does
(:func:`restore_slice`). Not /run: in a container the host's kernel, and so the slice,
outlives a restart that empties the container's /run (seen: the slice stayed at 1 ms with
no record left).

Where no cgroup is writable (not root, no ``cpu`` controller), :func:`choose_mechanism`
says "threads" and why; limiting threads (``torch.set_num_threads(threads_for_ratio(r))``)
is then the caller's job, and it only caps parallelism, not single-thread speed.
"""

import errno
import math
import os
import threading
import time
from dataclasses import dataclass

from robot_offload.testbed._common import PREFIX, TestbedError, owner_pid, pid_alive, unique_base

V1_ROOT = "/sys/fs/cgroup/cpu"
V2_CANDIDATES = ("/sys/fs/cgroup", "/sys/fs/cgroup/unified")
DEFAULT_PERIOD_US = 20_000     # where the bandwidth slice cannot be set (module docstring)
FINE_PERIOD_US = 4_000         # with a FINE_SLICE_US slice: slower at every instant
FINE_SLICE_US = 1_000
SLICE_SYSCTL = "/proc/sys/kernel/sched_cfs_bandwidth_slice_us"
SLICE_STATE_DIR = "/var/tmp"   # where the value from before is kept (see _hold_slice)
MIN_QUOTA_US = 1_000
MAX_PERIOD_US = 1_000_000


@dataclass(frozen=True)
class Mechanism:
    """How the CPU will be limited: kind "cgroup-v1", "cgroup-v2" or "threads"."""

    kind: str
    root: str = ""
    reason: str = ""


def period_for_ratio(ratio, base_period_us=DEFAULT_PERIOD_US):
    """The CFS period (us) for ``ratio`` CPUs: ``base_period_us``, or as long as the 1 ms
    minimum quota needs (0.02 CPU: 50 ms), at most 1 s."""
    ratio = float(ratio)
    if not ratio > 0:
        raise ValueError(f"ratio must be > 0 CPUs, got {ratio}")
    return min(MAX_PERIOD_US, max(int(base_period_us), math.ceil(MIN_QUOTA_US / ratio)))


def quota_for_ratio(ratio, period_us=None):
    """CFS quota (us) giving ``ratio`` CPUs per ``period_us`` (default
    :func:`period_for_ratio`); at least 1 ms."""
    ratio = float(ratio)
    if not ratio > 0:
        raise ValueError(f"ratio must be > 0 CPUs, got {ratio}")
    if period_us is None:
        period_us = period_for_ratio(ratio)
    if not MIN_QUOTA_US <= period_us <= MAX_PERIOD_US:
        raise ValueError(f"period must be in [1000, 1000000] us, got {period_us}")
    return max(MIN_QUOTA_US, int(round(ratio * period_us)))


def format_cpu_max(quota_us, period_us=DEFAULT_PERIOD_US):
    """The v2 ``cpu.max`` line: "<quota> <period>", or "max <period>" for no limit."""
    return f"{'max' if quota_us is None else int(quota_us)} {int(period_us)}"


def parse_cpu_max(text):
    """(quota_us or None for "max", period_us) from a ``cpu.max`` line."""
    parts = text.split()
    if len(parts) != 2:
        raise ValueError(f"not a cpu.max line: {text!r}")
    return (None if parts[0] == "max" else int(parts[0])), int(parts[1])


def threads_for_ratio(ratio, ncpu=None):
    """Thread count approximating ``ratio`` CPUs (at least 1, at most ncpu)."""
    ncpu = ncpu or os.cpu_count() or 1
    return int(min(ncpu, max(1, round(float(ratio)))))


def _read(path):
    with open(path, encoding="ascii") as f:
        return f.read().strip()


def _write(path, text):
    with open(path, "w", encoding="ascii") as f:
        f.write(str(text))


def _v1_ok(root):
    if not os.path.isfile(os.path.join(root, "cpu.cfs_quota_us")):
        return f"{root}: no cgroup v1 cpu controller (cpu.cfs_quota_us missing)"
    if not os.access(root, os.W_OK):
        return f"{root}: not writable (need root)"
    return None


def _v2_ok(root):
    controllers = os.path.join(root, "cgroup.controllers")
    if not os.path.isfile(controllers):
        return f"{root}: not a cgroup v2 hierarchy"
    if "cpu" not in _read(controllers).split():
        return f"{root}: cgroup v2 without the cpu controller (it is bound to v1 here?)"
    if not os.access(root, os.W_OK):
        return f"{root}: not writable (need root)"
    return None


def choose_mechanism(v1_root=V1_ROOT, v2_roots=V2_CANDIDATES):
    """The first usable of cgroup v1 cpu, cgroup v2 cpu.max; else "threads" with why."""
    reasons = []
    why = _v1_ok(v1_root)
    if why is None:
        return Mechanism("cgroup-v1", v1_root)
    reasons.append(why)
    for root in v2_roots:
        why = _v2_ok(root)
        if why is None:
            return Mechanism("cgroup-v2", root)
        reasons.append(why)
    return Mechanism("threads", "", "; ".join(reasons))


def available(v1_root=V1_ROOT, v2_roots=V2_CANDIDATES):
    """True if a cgroup CPU quota can be set here."""
    return choose_mechanism(v1_root, v2_roots).kind != "threads"


def _own_cgroup(pid, kind, proc_root="/proc"):
    """The cgroup path (relative to the hierarchy root) a pid is in, or "/"."""
    try:
        lines = _read(os.path.join(proc_root, str(pid), "cgroup")).splitlines()
    except OSError:
        return "/"
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if kind == "cgroup-v2" and controllers == "":
            return path or "/"
        if kind == "cgroup-v1" and "cpu" in controllers.split(","):
            return path or "/"
    return "/"


def quota_cpus(pid="self", v1_root=V1_ROOT, v2_root=V2_CANDIDATES[0], proc_root="/proc"):
    """The CPU quota a process runs under, in CPUs (0.5 = half a core), or None for none:
    the smallest quota of its cgroup and the cgroups above it, v1 ``cpu`` or v2
    ``cpu.max``. Profiles key on it (with the CPUs the process may run on): the same
    machine under another quota is, for timings, another machine."""
    limit = quota_limit(pid, v1_root, v2_root, proc_root)
    return None if limit is None else limit[0]


def quota_limit(pid="self", v1_root=V1_ROOT, v2_root=V2_CANDIDATES[0], proc_root="/proc"):
    """(CPUs, period in us) of the smallest quota on a process's cgroup path (see
    :func:`quota_cpus`), or None for none. The period matters too: the same 0.5 CPU over
    20 ms and over 4 ms run short work at different speeds (module docstring)."""
    best = None
    for kind, root in (("cgroup-v1", v1_root), ("cgroup-v2", v2_root)):
        path = _own_cgroup(pid, kind, proc_root)
        while True:
            d = os.path.join(root, path.lstrip("/"))
            try:
                if kind == "cgroup-v1":
                    quota = int(_read(os.path.join(d, "cpu.cfs_quota_us")))
                    period = int(_read(os.path.join(d, "cpu.cfs_period_us")))
                    quota = None if quota < 0 else quota
                else:
                    quota, period = parse_cpu_max(_read(os.path.join(d, "cpu.max")))
            except (OSError, ValueError):
                quota = None
            if quota is not None and period > 0 and (best is None or quota / period < best[0]):
                best = (quota / period, period)
            if path in ("", "/"):
                break
            path = os.path.dirname(path.rstrip("/")) or "/"
    return best


_slice_lock = threading.Lock()
_slice_holds = {}    # (sysctl path, state dir) -> open limits of this process holding it


def slice_settable(path=SLICE_SYSCTL):
    """True if the CFS bandwidth slice can be written here: its value is written back
    unchanged, which fails where ``/proc/sys`` is read-only or we are not root."""
    try:
        _write(path, int(_read(path)))
    except (OSError, ValueError):
        return False
    return True


def bandwidth_slice_us(path=SLICE_SYSCTL):
    """The kernel's CFS bandwidth slice (us), or None where it cannot be read."""
    try:
        return int(_read(path))
    except (OSError, ValueError):
        return None


def _slice_files(state_dir, prefix=PREFIX):
    """{pid: (file, value saved)} of the processes that set the slice: each writes
    ``<prefix>-<pid>-0-slice`` in ``state_dir`` holding the value it found, so that the
    last one to let go, or :func:`restore_slice` after a crash, can put it back."""
    found = {}
    try:
        names = os.listdir(state_dir)
    except OSError:
        return found
    for name in names:
        if not name.endswith("-slice"):
            continue
        pid = owner_pid(name)
        path = os.path.join(state_dir, name)
        try:
            found[pid] = (path, int(_read(path)))
        except (OSError, ValueError, TypeError):
            continue
    found.pop(None, None)
    return found


def _hold_slice(slice_us, path, state_dir):
    """Set the machine-wide slice for an opening limit. The first limit of a process
    records the value from before any testbed process changed it (another live one's
    record, or the sysctl itself)."""
    key = (path, state_dir)
    with _slice_lock:
        if _slice_holds.get(key):
            _slice_holds[key] += 1
            return
        others = {pid: v for pid, v in _slice_files(state_dir).items()
                  if pid != os.getpid() and pid_alive(pid)}
        before = next(iter(others.values()))[1] if others else int(_read(path))
        _write(os.path.join(state_dir, f"{PREFIX}-{os.getpid()}-0-slice"), before)
        if int(_read(path)) != slice_us:
            _write(path, slice_us)
        _slice_holds[key] = 1


def _release_slice(path, state_dir):
    """The last limit of the last process holding the slice puts it back."""
    key = (path, state_dir)
    with _slice_lock:
        if not _slice_holds.get(key):
            return
        _slice_holds[key] -= 1
        if _slice_holds[key] == 0:
            del _slice_holds[key]
            restore_slice(path, state_dir, mine=True)


def restore_slice(path=SLICE_SYSCTL, state_dir=SLICE_STATE_DIR, *, mine=False,
                  include_live=False):
    """Remove the slice records of dead processes (this one's too with ``mine``, every
    one with ``include_live``); once no live process holds the slice, put back the value
    they found. Returns that value, or None if nothing was put back."""
    files = _slice_files(state_dir)
    live = set() if include_live else {
        pid for pid in files if pid_alive(pid) and not (mine and pid == os.getpid())}
    saved = None
    for pid, (f, value) in files.items():
        if pid in live:
            continue
        saved = value
        try:
            os.unlink(f)
        except OSError:
            pass
    if live or saved is None:
        return None
    _write(path, saved)
    return saved


class CpuLimit:
    """A cgroup with a CPU quota, holding the given pids; see the module docstring.

    ``mechanism`` defaults to :func:`choose_mechanism`; TestbedError (with the reasons)
    if it is "threads". ``slice_path`` is the bandwidth-slice sysctl (None: leave the
    kernel's slice, and the period defaults to 20 ms), ``slice_state_dir`` where the value
    it replaced is recorded. ``remove_dir``, ``proc_root`` and the two slice paths exist
    for tests on fake trees.
    """

    def __init__(self, ratio=None, *, quota_us=None, period_us=None, pids=(),
                 mechanism=None, prefix=PREFIX, remove_dir=os.rmdir, proc_root="/proc",
                 slice_path=SLICE_SYSCTL, slice_state_dir=SLICE_STATE_DIR):
        if (ratio is None) == (quota_us is None):
            raise ValueError("give exactly one of ratio (CPUs) or quota_us")
        self._slice_path, self._slice_state_dir = slice_path, slice_state_dir
        # The slice the group runs with while open (us), None where it cannot be set.
        self.slice_us = FINE_SLICE_US if slice_path and slice_settable(slice_path) else None
        self._holds_slice = False
        if period_us is None:
            base = FINE_PERIOD_US if self.slice_us else DEFAULT_PERIOD_US
            period_us = base if ratio is None else period_for_ratio(ratio, base)
        self.period_us = int(period_us)
        self.quota_us = (quota_for_ratio(ratio, self.period_us) if quota_us is None
                         else int(quota_us))
        if self.quota_us < MIN_QUOTA_US:
            raise ValueError(f"quota must be >= {MIN_QUOTA_US} us, got {self.quota_us}")
        self.ratio = self.quota_us / self.period_us
        self.mechanism = mechanism or choose_mechanism()
        self.path = None
        self._initial_pids = [int(p) for p in pids]
        self._origin = {}
        self._prefix = prefix
        self._remove_dir = remove_dir
        self._proc_root = proc_root

    def __enter__(self):
        self.open()
        return self

    def __exit__(self, exc_type, exc, tb):
        self.close()
        return False

    def open(self):
        if self.mechanism.kind == "threads":
            raise TestbedError(
                "no writable cgroup CPU controller (v1 cpu.cfs_quota_us or v2 cpu.max): "
                f"{self.mechanism.reason}; limit threads instead (threads_for_ratio)")
        self.path = os.path.join(self.mechanism.root, unique_base(self._prefix))
        try:
            os.mkdir(self.path)
        except OSError as e:
            raise TestbedError(f"cannot create cgroup {self.path}: {e}") from e
        try:
            if self.mechanism.kind == "cgroup-v1":
                _write(os.path.join(self.path, "cpu.cfs_period_us"), self.period_us)
                _write(os.path.join(self.path, "cpu.cfs_quota_us"), self.quota_us)
            else:
                self._enable_v2_cpu()
                _write(os.path.join(self.path, "cpu.max"),
                       format_cpu_max(self.quota_us, self.period_us))
            if self.slice_us:
                try:
                    _hold_slice(self.slice_us, self._slice_path, self._slice_state_dir)
                except (OSError, ValueError) as e:
                    raise TestbedError(f"cannot set {self._slice_path}: {e}") from e
                self._holds_slice = True
            for pid in self._initial_pids:
                self.add(pid)
        except BaseException:
            self.close()
            raise
        return self

    def set_ratio(self, ratio):
        """Change the quota of the open group to ``ratio`` CPUs (same period), e.g. to slow
        one server down in the middle of a run."""
        if self.path is None:
            raise TestbedError("CpuLimit is not open")
        quota_us = quota_for_ratio(ratio, self.period_us)
        if quota_us < MIN_QUOTA_US:
            raise ValueError(f"quota must be >= {MIN_QUOTA_US} us, got {quota_us}")
        if self.mechanism.kind == "cgroup-v1":
            _write(os.path.join(self.path, "cpu.cfs_quota_us"), quota_us)
        else:
            _write(os.path.join(self.path, "cpu.max"), format_cpu_max(quota_us, self.period_us))
        self.quota_us, self.ratio = quota_us, quota_us / self.period_us

    def _enable_v2_cpu(self):
        # The parent must delegate "cpu" to its children; systemd hosts usually do.
        control = os.path.join(self.mechanism.root, "cgroup.subtree_control")
        try:
            if "cpu" not in _read(control).split():
                _write(control, "+cpu")
        except OSError as e:
            raise TestbedError(f"cannot enable the cpu controller in {control}: {e}") from e

    @property
    def procs_file(self):
        return os.path.join(self.path, "cgroup.procs")

    def add(self, pid):
        """Move a running process (all its threads) into the group."""
        if self.path is None:
            raise TestbedError("CpuLimit is not open")
        pid = int(pid)
        self._origin.setdefault(pid, _own_cgroup(pid, self.mechanism.kind, self._proc_root))
        try:
            _write(self.procs_file, pid)
        except OSError as e:
            raise TestbedError(f"cannot move pid {pid} into {self.path}: {e}") from e

    def wrap(self, argv):
        """``argv`` behind a shell that puts itself in the group and then execs it, so the
        command is limited from its first instruction (no preexec_fn: safe with threads)."""
        if self.path is None:
            raise TestbedError("CpuLimit is not open")
        return ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', self.procs_file,
                *[str(a) for a in argv]]

    def popen(self, argv, **popen_kwargs):
        """Start ``argv`` in the group (see :meth:`wrap`); returns the Popen."""
        import subprocess

        return subprocess.Popen(self.wrap(argv), **popen_kwargs)

    def pids(self):
        """Pids currently in the group."""
        try:
            return [int(p) for p in _read(self.procs_file).split()]
        except OSError:
            return []

    def stats(self):
        """The group's cpu.stat as a dict of ints (nr_throttled, throttled_time, ...)."""
        try:
            text = _read(os.path.join(self.path, "cpu.stat"))
        except (OSError, TypeError):
            return {}
        return {k: int(v) for k, v in (line.split() for line in text.splitlines())
                if v.lstrip("-").isdigit()}

    def close(self):
        """Move remaining processes back to where they came from and remove the group."""
        if self._holds_slice:
            self._holds_slice = False
            _release_slice(self._slice_path, self._slice_state_dir)
        if self.path is None:
            return
        path, self.path = self.path, None
        try:
            remove_cgroup(path, self.mechanism.root, origin=self._origin,
                          remove_dir=self._remove_dir)
        finally:
            self._origin.clear()


def remove_cgroup(path, root, *, origin=None, remove_dir=os.rmdir, attempts=50):
    """Move every pid in ``path`` to its origin cgroup (or ``root``) and rmdir ``path``."""
    origin = origin or {}
    procs = os.path.join(path, "cgroup.procs")
    last_error = None
    for _ in range(attempts):
        try:
            pids = [int(p) for p in _read(procs).split()]
        except OSError:
            pids = []
        for pid in pids:
            target = os.path.join(root, origin.get(pid, "/").lstrip("/"))
            for dest in (target, root):
                try:
                    _write(os.path.join(dest, "cgroup.procs"), pid)
                    break
                except OSError as e:
                    if e.errno == errno.ESRCH:
                        break
                    last_error = e
        try:
            remove_dir(path)
            return
        except FileNotFoundError:
            return
        except OSError as e:  # EBUSY while exiting processes leave the group
            last_error = e
            time.sleep(0.02)
    raise TestbedError(f"could not remove cgroup {path}: {last_error}")


def cleanup_cgroups(prefix=PREFIX, *, include_live=False, v1_root=V1_ROOT,
                    v2_roots=V2_CANDIDATES):
    """Remove ``prefix-*`` cgroups left by dead processes (all with include_live)."""
    removed = []
    for root in (v1_root, *v2_roots):
        try:
            names = os.listdir(root)
        except OSError:
            continue
        for name in names:
            pid = owner_pid(name)
            path = os.path.join(root, name)
            if pid is None or not os.path.isdir(path):
                continue
            if not include_live and (pid == os.getpid() or pid_alive(pid)):
                continue
            try:
                remove_cgroup(path, root)
                removed.append(path)
            except TestbedError:
                pass
    return removed
