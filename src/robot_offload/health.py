"""Health reports of the nodes, independent of ROS: what ``/diagnostics`` shows.

A :class:`Report` is one diagnostic status: a level (:data:`OK`, :data:`WARN`,
:data:`ERROR`, the values of ``diagnostic_msgs/DiagnosticStatus``), a message a user
understands and key/value pairs. The ROS side (:mod:`robot_offload.ros.diagnostics`)
publishes them through ``diagnostic_updater``.

Here: the machine's figures every node reports (:class:`MachineMonitor`: CPU load, memory,
temperatures and the node process itself, through psutil; :func:`process_figures` is also
the soak test's measure of a process), the offload client's (:class:`ClientHealth`), the
bandwidth monitor's (:func:`bandwidth_report`) and the power logger's
(:func:`power_report`). The server's is :mod:`robot_offload.server.health`.
"""

import collections
import math
import socket
import statistics
import threading
import time
from typing import Callable, Deque, List, Optional, Sequence, Tuple

import psutil

OK, WARN, ERROR = 0, 1, 2
LEVEL_NAMES = {OK: "OK", WARN: "WARN", ERROR: "ERROR"}


def _text(value) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e4 else f"{value:.0f}"
    if isinstance(value, (list, tuple)):
        return ", ".join(_text(v) for v in value) or "none"
    return str(value)


class Report:
    """One status: the worst level flagged, its message, and the values shown with it."""

    def __init__(self, ok_message: str):
        self.ok_message = ok_message
        self.problems: List[Tuple[int, str]] = []
        self.values: List[Tuple[str, str]] = []

    def add(self, key: str, value) -> "Report":
        self.values.append((key, _text(value)))
        return self

    def flag(self, level: int, text: str) -> "Report":
        """Raise the report to ``level`` (at least) with ``text`` as a reason."""
        if level not in LEVEL_NAMES:
            raise ValueError(f"unknown level {level!r}")
        if level > OK:
            self.problems.append((level, text))
        return self

    @property
    def level(self) -> int:
        return max((lvl for lvl, _ in self.problems), default=OK)

    @property
    def message(self) -> str:
        """The OK message, or the reasons, worst first."""
        if not self.problems:
            return self.ok_message
        ordered = sorted(self.problems, key=lambda p: -p[0])
        return "; ".join(text for _, text in ordered)

    def value(self, key: str) -> Optional[str]:
        return next((v for k, v in self.values if k == key), None)

    def __repr__(self):
        return f"Report({LEVEL_NAMES[self.level]}, {self.message!r}, {self.values!r})"


class RateMeter:
    """Events per second over the last ``window_s`` (bounded: at most ``max_events``)."""

    def __init__(self, window_s: float = 10.0, max_events: int = 10000,
                 clock: Callable[[], float] = time.monotonic):
        self.window_s = float(window_s)
        self.clock = clock
        self._t: Deque[float] = collections.deque(maxlen=max_events)
        self._lock = threading.Lock()
        self.started = clock()

    def tick(self, now: Optional[float] = None) -> None:
        with self._lock:
            self._t.append(self.clock() if now is None else now)

    def count(self, now: Optional[float] = None) -> int:
        """Events in the last ``window_s``."""
        now = self.clock() if now is None else now
        with self._lock:
            while self._t and now - self._t[0] > self.window_s:
                self._t.popleft()
            return len(self._t)

    def rate_hz(self, now: Optional[float] = None) -> float:
        now = self.clock() if now is None else now
        n = self.count(now)
        span = min(self.window_s, now - self.started)
        return n / span if span > 0 else 0.0

    @property
    def last(self) -> Optional[float]:
        return self._t[-1] if self._t else None


# -- the machine -------------------------------------------------------------------------
def process_figures(pid=None) -> dict:
    """RSS (MB), open file descriptors and OS threads of a process (default: this one).
    A process that is gone raises ProcessLookupError, one not ours to read
    PermissionError."""
    if pid == "self":
        pid = None
    try:
        p = psutil.Process(pid)
        with p.oneshot():
            return {"rss_mb": p.memory_info().rss / 2 ** 20, "fds": p.num_fds(),
                    "threads": p.num_threads()}
    except psutil.NoSuchProcess:
        raise ProcessLookupError(f"no process {pid}") from None
    except psutil.AccessDenied:
        raise PermissionError(f"cannot read process {pid}") from None


class MachineMonitor:
    """CPU load, memory and temperatures of this machine, and this process's own figures.

    Levels: WARN when the load average is above twice the cores (processes wait for a
    CPU), memory use at ``mem_warn`` (ERROR at ``mem_error``), a temperature at its
    sensor's ``high`` limit (ERROR at ``critical``), or where a sensor gives no limit (or
    one below 40 °C, not a real limit) at ``temp_warn_c`` / ``temp_error_c``. CPU use is
    the busy share of all cores since the previous report."""

    def __init__(self, mem_warn: float = 0.90, mem_error: float = 0.97,
                 temp_warn_c: float = 85.0, temp_error_c: float = 95.0, ps=psutil):
        self.mem_warn, self.mem_error = mem_warn, mem_error
        self.temp_warn_c, self.temp_error_c = temp_warn_c, temp_error_c
        self.ps = ps
        self.host = socket.gethostname()
        self._last_cpu = self._cpu_times()

    def _cpu_times(self):
        t = self.ps.cpu_times()
        idle = t.idle + getattr(t, "iowait", 0.0)
        return sum(t) - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0), idle

    def _cpu_percent(self) -> Optional[float]:
        total, idle = self._cpu_times()
        (total0, idle0), self._last_cpu = self._last_cpu, (total, idle)
        if total - total0 <= 0:
            return None
        return 100.0 * max(0.0, min(1.0, 1.0 - (idle - idle0) / (total - total0)))

    def report(self) -> Report:
        r = Report(f"{self.host}: load, memory and temperatures normal")
        cores = self.ps.cpu_count() or 1
        r.add("host", self.host).add("CPU cores", cores).add("CPU use (%)", self._cpu_percent())
        load1, load5, load15 = self.ps.getloadavg()
        r.add("load average (1, 5, 15 min)", f"{load1:.2f}, {load5:.2f}, {load15:.2f}")
        if load1 > 2 * cores:
            r.flag(WARN, f"CPU overloaded: load average {load1:.1f} on {cores} cores")
        mem = self.ps.virtual_memory()
        used = 1.0 - mem.available / mem.total if mem.total else 0.0
        r.add("memory used (%)", 100.0 * used).add("memory available (MB)", mem.available / 2 ** 20)
        if used >= self.mem_error:
            r.flag(ERROR, f"memory almost exhausted: {100 * used:.0f} % used")
        elif used >= self.mem_warn:
            r.flag(WARN, f"memory low: {100 * used:.0f} % used")
        self._temperatures(r)
        try:
            me = process_figures()
            r.add("this node: RSS (MB)", me["rss_mb"]).add("this node: threads", me["threads"])
            r.add("this node: open files", me["fds"])
        except OSError:
            pass
        return r

    def _temperatures(self, r: Report) -> None:
        read = getattr(self.ps, "sensors_temperatures", None)
        try:
            chips = read() if read is not None else {}
        except (OSError, RuntimeError):
            chips = {}
        if not chips:
            r.add("temperatures", "no sensors")
            return
        for chip, sensors in sorted(chips.items()):
            for i, s in enumerate(sensors):
                if s.current is None or not math.isfinite(s.current):
                    continue
                name = f"{chip} {s.label or i}".strip()
                r.add(f"temperature {name} (°C)", float(s.current))
                high = s.high if s.high and s.high >= 40 else self.temp_warn_c
                critical = s.critical if s.critical and s.critical >= 40 else self.temp_error_c
                if s.current >= critical:
                    r.flag(ERROR, f"{name} at {s.current:.0f} °C (critical {critical:.0f} °C)")
                elif s.current >= high:
                    r.flag(WARN, f"{name} hot: {s.current:.0f} °C (limit {high:.0f} °C)")


# -- the offload client ------------------------------------------------------------------
#: ServerLink.state (plus "off": no server configured) -> what the link report says
LINK_STATES = ("off", "connecting", "up", "recovering", "down", "refused")


class ClientHealth:
    """The offload client's recent frames and its link, as one report.

    :meth:`frame` records each processed frame; :meth:`report` looks at the last
    ``window_s``: frame rate, latency median, fallbacks (with the last reason), deadline
    misses (server calls abandoned at ``timeout_s``) and frames dropped by the
    newest-frame policy. Levels: ERROR when the current mode needs the server and the
    link is down or refused (frames are computed locally); WARN while connecting or
    recovering, when the server is unreachable in a mode that does not need it, when
    recent frames fell back although the link is up, and when no frame arrived in the
    window."""

    def __init__(self, window_s: float = 10.0, max_frames: int = 4096,
                 clock: Callable[[], float] = time.monotonic):
        self.window_s = float(window_s)
        self.clock = clock
        self.started = clock()
        # (t, executed_mode, fallback_reason, latency_s, deadline_missed, received, dropped)
        self._frames: Deque[tuple] = collections.deque(maxlen=max_frames)
        self._lock = threading.Lock()       # frames come from the worker, reports from a timer
        self.deadline_misses = 0
        self.last_executed_mode = ""
        self.last_fallback_reason = ""

    def frame(self, executed_mode: str, fallback_reason: str, latency_s: float,
              received: int, dropped: int, now: Optional[float] = None) -> None:
        now = self.clock() if now is None else now
        missed = fallback_reason.startswith("OffloadTimeout")
        with self._lock:
            self.deadline_misses += missed
            self.last_executed_mode = executed_mode
            if fallback_reason:
                self.last_fallback_reason = fallback_reason
            self._frames.append((now, executed_mode, fallback_reason, float(latency_s), missed,
                                 int(received), int(dropped)))

    def report(self, *, mode: str, needs_server: bool, link_state: str, link_error: str = "",
               server: str = "", received: int = 0, processed: int = 0, dropped: int = 0,
               fallbacks: int = 0, input_topic: str = "the input topic",
               now: Optional[float] = None) -> Report:
        now = self.clock() if now is None else now
        if link_state not in LINK_STATES:
            raise ValueError(f"unknown link state {link_state!r}")
        with self._lock:
            recent = [f for f in self._frames if now - f[0] <= self.window_s]
        r = Report(f"{mode}: " + ("offloading to the server" if needs_server and link_state == "up"
                                  else "computing on the robot"))
        self._link(r, mode, needs_server, link_state, link_error, server)
        r.add("mode", mode).add("executed mode (last frame)", self.last_executed_mode or None)
        span = min(self.window_s, now - self.started)
        r.add(f"frame rate (Hz, last {self.window_s:.0f} s)", len(recent) / span if span > 0 else 0.0)
        r.add("latency median (s)", statistics.median(f[3] for f in recent) if recent else None)
        fell = [f for f in recent if f[2]]
        missed = sum(f[4] for f in recent)
        r.add(f"fallbacks (last {self.window_s:.0f} s)", len(fell)).add("fallbacks (total)", fallbacks)
        r.add("last fallback reason", self.last_fallback_reason or None)
        r.add(f"deadline misses (last {self.window_s:.0f} s)", missed)
        r.add("deadline misses (total)", self.deadline_misses)
        window_dropped = recent[-1][6] - recent[0][6] if len(recent) > 1 else 0
        window_received = recent[-1][5] - recent[0][5] if len(recent) > 1 else 0
        r.add(f"frames dropped (last {self.window_s:.0f} s)", f"{window_dropped} of {window_received}")
        r.add("frames received, processed, dropped (total)", f"{received}, {processed}, {dropped}")
        if fell and link_state == "up" and needs_server:
            r.flag(WARN, f"{len(fell)} of {len(recent)} frames in the last {self.window_s:.0f} s "
                         f"computed locally ({missed} missed the deadline): {fell[-1][2]}")
        if not recent and now - self.started > self.window_s:
            r.flag(WARN, f"no frame processed in the last {self.window_s:.0f} s: is anything "
                         f"publishing on {input_topic}?")
        return r

    @staticmethod
    def _link(r: Report, mode: str, needs_server: bool, state: str, error: str, server: str) -> None:
        r.add("server link", "not used (~use_server false)" if state == "off" else state)
        r.add("server", server or None).add("last link error", error or None)
        why = f": {error}" if error else ""
        if state == "connecting":
            r.flag(WARN, "connecting to the offload server" + (" (frames computed locally meanwhile)"
                                                              if needs_server else ""))
        elif state == "recovering":
            r.flag(WARN, "the offload server answers again; offloading resumes after a short back-off")
        elif state in ("down", "refused"):
            what = ("offload server unreachable" if state == "down"
                    else "offloading disabled: the server refused this client")
            if needs_server:
                r.flag(ERROR, f"{what}, frames computed locally{why}")
            else:
                r.flag(WARN, f"{what} (not needed in {mode} mode){why}")


# -- bandwidth monitor and power logger ----------------------------------------------------
def _mbps(bps) -> str:
    return "n/a" if bps is None or not math.isfinite(bps) else f"{bps / 1e6:.3g} Mbit/s"


def bandwidth_report(*, predicted_bps: Optional[float], measured_bps: Optional[float],
                     rtt_s: Optional[float], sample_age_s: Optional[float], uptime_s: float,
                     stale_after_s: float, probing: bool, predictor: str,
                     samples_used: int = 0, samples_ignored: int = 0,
                     probe_error: str = "", burst_s: Optional[float] = None) -> Report:
    """The bandwidth monitor's estimate and how old its newest measurement is: WARN when
    that is older than ``stale_after_s`` (or, with probes, when none has measured the
    link that long after start), and when the last probe failed. ``burst_s``: what the
    link passes at line rate after an idle moment, as learned (s at its rate)."""
    r = Report(f"{_mbps(predicted_bps)} predicted")
    r.add("predicted", _mbps(predicted_bps)).add("last measured", _mbps(measured_bps))
    r.add("RTT (s)", rtt_s).add("last sample age (s)", sample_age_s)
    r.add("source", "probes and offloaded frames" if probing else "offloaded frames (passive)")
    r.add("predictor", predictor).add("samples used, ignored", f"{samples_used}, {samples_ignored}")
    if burst_s is not None:
        r.add("link burst learned (ms at the rate)", round(1e3 * burst_s, 1))
    if probe_error:
        r.add("last probe error", probe_error)
        r.flag(WARN, f"bandwidth probes fail: {probe_error}")
    if sample_age_s is None:
        if probing and uptime_s > stale_after_s:
            r.flag(WARN, f"no probe has measured the link in {uptime_s:.0f} s")
        elif not probe_error:
            r.ok_message = "no measurement yet: the client plans with its default bandwidth " + (
                "until the first probe" if probing else "until it offloads a frame")
    elif sample_age_s > stale_after_s:
        cause = "" if probing else " (the client is not offloading and probes are off)"
        r.flag(WARN, f"estimate stale: the last measurement is {sample_age_s:.0f} s old{cause}")
    return r


def power_report(*, source: str, description: str, modelled: bool, rails: Sequence[str],
                 rate_hz: float, achieved_hz: float, uptime_s: float, last_sample_age_s: Optional[float],
                 read_failures: int = 0, recent_failures: int = 0, last_error: str = "") -> Report:
    """The power logger's source and rails, and the rate it publishes at: ERROR when a
    sensor stopped answering (no sample for 5 periods, at least 2 s), WARN at under half
    the configured rate or when reads failed lately (``recent_failures``)."""
    r = Report(("modelled (no power sensor): " if modelled else "measuring: ") + description)
    r.add("source", source).add("measured", not modelled)
    r.add("rails", list(rails) if rails else ("none (state model)" if modelled else "none"))
    r.add("sample rate (Hz)", achieved_hz).add("configured rate (Hz)", rate_hz)
    r.add("last sample age (s)", last_sample_age_s).add("read failures", read_failures)
    if last_error:
        r.add("last read error", last_error)
    silent_s = max(5.0 / rate_hz, 2.0) if rate_hz > 0 else 2.0
    age = uptime_s if last_sample_age_s is None else last_sample_age_s
    if age > silent_s:
        r.flag(ERROR, f"no power sample for {age:.0f} s" + (f": {last_error}" if last_error else ""))
    elif uptime_s > silent_s and achieved_hz < 0.5 * rate_hz:
        r.flag(WARN, f"sampling at {achieved_hz:.1f} Hz of the configured {rate_hz:g} Hz")
    if recent_failures and age <= silent_s:
        r.flag(WARN, f"{recent_failures} sensor reads failed lately (last: {last_error or 'unknown'})")
    return r
