"""Power sources and energy integration (DESIGN.md section 5). Pure: no rospy.

Every source has ``read() -> PowerReading(t_s, watts, rails, source, modelled)``:

- :class:`JetsonIna3221Source`: the Jetson's INA3221 rail monitors in sysfs (JetPack 4 iio
  layout in mW, JetPack 5 hwmon layout in mV / mA). ``watts`` is the board input rail
  (``VDD_IN`` on Xavier NX / TX2 / Orin, ``POM_5V_IN`` on Nano) alone when the board has one,
  since the other rails are parts of it; otherwise (e.g. AGX Xavier) the sum of all rails,
  which misses regulator losses and unmonitored parts. ``rails`` has every rail.
- :class:`RaplSource`: Intel/AMD RAPL powercap counters (``energy_uj``), power from
  successive readings with ``max_energy_range_uj`` wraparound. ``watts`` is the ``psys``
  (platform) domain alone if present, else the sum of the package domains: CPU packages
  only, not a whole machine.
- :class:`StateModelSource`: a state model driven by the client's own timeline, always
  ``modelled=True``, source "model". Defaults from Intra-DP Table 3 (Jetson Xavier NX robot):
  inference 13.35 W, transmission 4.25 W, standby 4.04 W.
- :func:`detect_source` picks Jetson, then RAPL, then the model.
- :class:`EnergyMeter` integrates any source's readings (trapezoid) over an interval.

Overlap rule of the model: power = idle_w + [computing] (compute_w - idle_w) +
[transmitting] (transmit_w - idle_w). Table 3's states are whole-robot powers, so the idle
floor is counted once and the radio adds its 0.21 W on top of computing: 13.56 W, i.e.
+1.6 %, which is the "only 1.5 %" extra the paper reports for overlapping computation and
transmission (Sec. 3).
"""

import abc
import bisect
import glob
import math
import os
import re
import threading
import time
from dataclasses import dataclass, field, replace

from robot_offload import checks
from robot_offload.errors import ConfigError, OffloadError

#: Table 3 of Intra-DP (W).
COMPUTE_W = 13.35
TRANSMIT_W = 4.25
IDLE_W = 4.04

#: Rails that measure the whole board's input; when present they are the total.
INPUT_RAILS = ("VDD_IN", "POM_5V_IN")


class PowerSourceUnavailable(OffloadError):
    """The requested power source does not exist or cannot be read here."""


@dataclass(frozen=True)
class PowerReading:
    """Power at ``t_s`` (the source's clock, s): total ``watts``, per-rail watts, the source
    name, and whether the value is modelled rather than measured."""

    t_s: float
    watts: float
    rails: dict = field(default_factory=dict)
    source: str = ""
    modelled: bool = False


class PowerSource(abc.ABC):
    name = "source"
    modelled = False

    @abc.abstractmethod
    def read(self):
        """A :class:`PowerReading` now."""

    def describe(self):
        return self.name


def _read_text(path):
    with open(path, encoding="ascii", errors="replace") as f:
        return f.read().strip()


def _read_number(path):
    return float(_read_text(path))


def _sys(root, *parts):
    return os.path.join(root, "sys", *parts)


# -- Jetson INA3221 ----------------------------------------------------------------------
@dataclass(frozen=True)
class _Rail:
    name: str
    power_mw: str = ""     # JetPack 4: in_powerN_input (mW)
    voltage_mv: str = ""   # JetPack 5: inN_input (mV)
    current_ma: str = ""   # JetPack 5: currN_input (mA)

    def watts(self):
        if self.power_mw:
            return _read_number(self.power_mw) / 1e3
        return _read_number(self.voltage_mv) * _read_number(self.current_ma) / 1e6


def _jetpack4_rails(root):
    rails = []
    pattern = _sys(root, "bus", "i2c", "drivers", "ina3221x", "*", "iio:device*")
    for dev in sorted(glob.glob(pattern)):
        for ch in range(3):
            power = os.path.join(dev, f"in_power{ch}_input")
            label = os.path.join(dev, f"rail_name_{ch}")
            if os.path.isfile(power):
                name = _read_text(label) if os.path.isfile(label) else f"{dev}:ch{ch}"
                rails.append(_Rail(name, power_mw=power))
    return rails


def _jetpack5_rails(root):
    rails = []
    pattern = _sys(root, "bus", "i2c", "drivers", "ina3221", "*", "hwmon", "hwmon*")
    for dev in sorted(glob.glob(pattern)):
        for ch in range(1, 4):
            volt = os.path.join(dev, f"in{ch}_input")
            curr = os.path.join(dev, f"curr{ch}_input")
            label = os.path.join(dev, f"in{ch}_label")
            if os.path.isfile(volt) and os.path.isfile(curr):
                name = _read_text(label) if os.path.isfile(label) else f"{dev}:in{ch}"
                rails.append(_Rail(name, voltage_mv=volt, current_ma=curr))
    return rails


class JetsonIna3221Source(PowerSource):
    """Jetson INA3221 rails from sysfs; see the module docstring for which are summed.

    Rails labelled "NC" (not connected) are skipped; duplicate labels get a suffix."""

    name = "jetson-ina3221"

    def __init__(self, sysfs_root="/", clock=time.monotonic):
        self._clock = clock
        rails = _jetpack4_rails(sysfs_root)
        self.layout = "jetpack4"
        if not rails:
            rails = _jetpack5_rails(sysfs_root)
            self.layout = "jetpack5"
        rails = [r for r in rails if r.name.upper() not in ("NC", "")]
        if not rails:
            raise PowerSourceUnavailable(
                f"no INA3221 rails under {_sys(sysfs_root, 'bus', 'i2c', 'drivers')}"
                "/ina3221x (JetPack 4) or /ina3221 (JetPack 5)")
        seen = {}
        self._rails = []
        for r in rails:
            n = seen.get(r.name, 0)
            seen[r.name] = n + 1
            self._rails.append(r if n == 0 else _Rail(f"{r.name}#{n}", r.power_mw,
                                                      r.voltage_mv, r.current_ma))
        self.input_rail = next((r.name for r in self._rails if r.name in INPUT_RAILS), None)

    @property
    def rail_names(self):
        return [r.name for r in self._rails]

    def describe(self):
        rule = (f"total = {self.input_rail}" if self.input_rail
                else "total = sum of " + "+".join(self.rail_names))
        return f"{self.name} ({self.layout}; {rule})"

    def read(self):
        t = self._clock()
        try:
            rails = {r.name: r.watts() for r in self._rails}
        except (OSError, ValueError) as e:
            raise PowerSourceUnavailable(f"reading INA3221 rails: {e}") from e
        total = rails[self.input_rail] if self.input_rail else sum(rails.values())
        return PowerReading(t, total, rails, self.name, False)


# -- RAPL --------------------------------------------------------------------------------
_RAPL_TOP = re.compile(r"^intel-rapl:\d+$")


class RaplSource(PowerSource):
    """RAPL package (or psys) power from powercap energy counters.

    The constructor takes a baseline; each ``read()`` gives the mean power since the
    previous one (or since the baseline). If less than ``min_interval_s`` has passed since
    the baseline on the first read, it waits (``sleep``) so the value means something."""

    name = "rapl"

    def __init__(self, sysfs_root="/", clock=time.monotonic, sleep=time.sleep,
                 min_interval_s=0.05):
        self._clock = clock
        self._sleep = sleep
        self.min_interval_s = float(min_interval_s)
        base = _sys(sysfs_root, "class", "powercap")
        self._domains = []
        for path in sorted(glob.glob(os.path.join(base, "intel-rapl:*"))):
            if not _RAPL_TOP.match(os.path.basename(path)):
                continue  # sub-domains (core, uncore, dram) are inside their package
            energy = os.path.join(path, "energy_uj")
            if not os.path.isfile(energy):
                continue
            name_file = os.path.join(path, "name")
            name = _read_text(name_file) if os.path.isfile(name_file) else os.path.basename(path)
            range_file = os.path.join(path, "max_energy_range_uj")
            max_range = _read_number(range_file) if os.path.isfile(range_file) else 2.0 ** 32
            self._domains.append((name, energy, max_range))
        if not self._domains:
            raise PowerSourceUnavailable(f"no RAPL domains under {base}/intel-rapl:*")
        names = [d[0] for d in self._domains]
        self.total_domains = ["psys"] if "psys" in names else [
            n for n in names if n.startswith("package")] or names
        self._prev = self._sample()
        self._last_watts = None

    def describe(self):
        return f"{self.name} (total = {'+'.join(self.total_domains)})"

    def _sample(self):
        t = self._clock()
        try:
            return t, {name: _read_number(path) for name, path, _ in self._domains}
        except PermissionError as e:
            raise PowerSourceUnavailable(
                f"RAPL energy_uj is not readable (root only on recent kernels): {e}") from e
        except (OSError, ValueError) as e:
            raise PowerSourceUnavailable(f"reading RAPL: {e}") from e

    @staticmethod
    def energy_delta_uj(prev_uj, now_uj, max_range_uj):
        """Energy between two counter values, allowing one wraparound."""
        delta = now_uj - prev_uj
        return delta + max_range_uj if delta < 0 else delta

    def read(self):
        t, energy = self._sample()
        if self._last_watts is None and t - self._prev[0] < self.min_interval_s:
            self._sleep(self.min_interval_s - (t - self._prev[0]))
            t, energy = self._sample()
        t_prev, e_prev = self._prev
        dt = t - t_prev
        if dt <= 0:
            rails = self._last_watts or {n: 0.0 for n, _, _ in self._domains}
        else:
            rails = {name: self.energy_delta_uj(e_prev[name], energy[name], max_range)
                     / 1e6 / dt for name, _, max_range in self._domains}
            self._prev = (t, energy)
        self._last_watts = rails
        return PowerReading(t, sum(rails[n] for n in self.total_domains), dict(rails),
                            self.name, False)


# -- state model -------------------------------------------------------------------------
ACTIVITIES = ("compute", "transmit")


def _parse_state(state):
    """frozenset of activities from "idle" / "compute" / "transmit" / "compute+transmit"
    or an iterable of activity names."""
    if isinstance(state, str):
        parts = [] if state == "idle" else state.split("+")
    else:
        parts = list(state)
    bad = [p for p in parts if p not in ACTIVITIES]
    if bad:
        raise ValueError(f"unknown state {state!r}; use idle, compute, transmit or "
                         "compute+transmit")
    return frozenset(parts)


def _state_name(activities):
    return "+".join(a for a in ACTIVITIES if a in activities) or "idle"


class StateModelSource(PowerSource):
    """Modelled power from a compute / transmit / idle timeline (see the module docstring
    for the overlap rule). Feed it with ``set_state`` or ``begin``/``end`` (reference
    counted, so overlapping transfers from several threads work). Times are on ``clock``.

    Before the first change the robot is idle. The timeline keeps at most ``max_changes``
    entries; older history is dropped and intervals before ``history_start_s`` raise."""

    name = "model"
    modelled = True

    def __init__(self, compute_w=COMPUTE_W, transmit_w=TRANSMIT_W, idle_w=IDLE_W, *,
                 clock=time.monotonic, max_changes=100_000):
        if not (compute_w >= idle_w >= 0 and transmit_w >= idle_w):
            raise ValueError("need compute_w >= idle_w >= 0 and transmit_w >= idle_w")
        self.compute_w = float(compute_w)
        self.transmit_w = float(transmit_w)
        self.idle_w = float(idle_w)
        self._clock = clock
        self._max_changes = int(max_changes)
        self._times = [-math.inf]
        self._states = [frozenset()]
        self._counts = {a: 0 for a in ACTIVITIES}
        self._lock = threading.Lock()

    def describe(self):
        return (f"model (compute {self.compute_w} W, transmit {self.transmit_w} W, "
                f"idle {self.idle_w} W; overlap adds the radio's extra)")

    def power_of(self, state):
        """Watts in a state (name or iterable of activities)."""
        acts = _parse_state(state)
        return (self.idle_w + ("compute" in acts) * (self.compute_w - self.idle_w)
                + ("transmit" in acts) * (self.transmit_w - self.idle_w))

    def _append(self, activities, t_s):
        t = self._clock() if t_s is None else float(t_s)
        if t < self._times[-1]:
            raise ValueError(f"state change at {t} s is before the last one at "
                             f"{self._times[-1]} s")
        if activities == self._states[-1]:
            return
        if t == self._times[-1]:
            self._states[-1] = activities
        else:
            self._times.append(t)
            self._states.append(activities)
        if len(self._times) > self._max_changes:
            drop = len(self._times) - self._max_changes
            del self._times[:drop]
            del self._states[:drop]

    def set_state(self, state, t_s=None):
        """From t_s (default now) on, the robot is in ``state``; resets begin/end counts."""
        acts = _parse_state(state)
        with self._lock:
            self._counts = {a: int(a in acts) for a in ACTIVITIES}
            self._append(acts, t_s)

    def begin(self, activity, t_s=None):
        """An activity ("compute" or "transmit") starts; counted, so nesting works."""
        self._change(activity, +1, t_s)

    def end(self, activity, t_s=None):
        self._change(activity, -1, t_s)

    def _change(self, activity, delta, t_s):
        if activity not in ACTIVITIES:
            raise ValueError(f"unknown activity {activity!r}; use {ACTIVITIES}")
        with self._lock:
            count = self._counts[activity] + delta
            if count < 0:
                raise ValueError(f"end({activity!r}) without begin")
            self._counts[activity] = count
            self._append(frozenset(a for a, c in self._counts.items() if c > 0), t_s)

    def activity(self, activity):
        """Context manager: begin(activity) ... end(activity)."""
        return _Activity(self, activity)

    @property
    def history_start_s(self):
        return self._times[0]

    def state_at(self, t_s):
        with self._lock:
            return _state_name(self._states[bisect.bisect_right(self._times, t_s) - 1])

    def read(self):
        t = self._clock()
        with self._lock:
            acts = self._states[bisect.bisect_right(self._times, t) - 1]
        rails = {"idle": self.idle_w,
                 "compute": (self.compute_w - self.idle_w) if "compute" in acts else 0.0,
                 "transmit": (self.transmit_w - self.idle_w) if "transmit" in acts else 0.0}
        return PowerReading(t, sum(rails.values()), rails, self.name, True)

    def energy_between(self, t0_s, t1_s):
        """Exact energy (J) of the timeline over [t0_s, t1_s]; the current state is
        assumed to last past the last change."""
        if t1_s < t0_s:
            raise ValueError(f"t1 {t1_s} < t0 {t0_s}")
        with self._lock:
            if t0_s < self._times[0]:
                raise ValueError(f"t0 {t0_s} s is before the kept history "
                                 f"({self._times[0]} s)")
            i = bisect.bisect_right(self._times, t0_s) - 1
            energy, t = 0.0, t0_s
            while t < t1_s:
                end = self._times[i + 1] if i + 1 < len(self._times) else math.inf
                seg_end = min(end, t1_s)
                energy += self.power_of(self._states[i]) * (seg_end - t)
                t = seg_end
                i += 1
            return energy

    def time_in_states(self, t0_s, t1_s):
        """Seconds spent in each state name over [t0_s, t1_s]."""
        out = {}
        with self._lock:
            i = bisect.bisect_right(self._times, t0_s) - 1
            t = t0_s
            while t < t1_s:
                end = self._times[i + 1] if i + 1 < len(self._times) else math.inf
                seg_end = min(end, t1_s)
                name = _state_name(self._states[i])
                out[name] = out.get(name, 0.0) + seg_end - t
                t = seg_end
                i += 1
        return out


class _Activity:
    def __init__(self, model, activity):
        self._model, self._activity = model, activity

    def __enter__(self):
        self._model.begin(self._activity)
        return self

    def __exit__(self, exc_type, exc, tb):
        self._model.end(self._activity)
        return False


def detect_source(sysfs_root="/", clock=time.monotonic, **model_kwargs):
    """Jetson INA3221 if present, else RAPL if readable, else the state model."""
    for make in (JetsonIna3221Source, RaplSource):
        try:
            return make(sysfs_root, clock=clock)
        except PowerSourceUnavailable:
            continue
    return StateModelSource(clock=clock, **model_kwargs)


@dataclass
class PowerLoggerConfig:
    """Settings of power_logger (its ``~`` parameters)."""

    source: str = "auto"            # auto (jetson, then rapl, then model) | jetson | rapl | model
    sysfs_root: str = "/"           # root of the sysfs tree to read
    rate_hz: float = 10.0           # sampling / publishing rate (Hz)
    model_lag_s: float = 0.5        # model: samples describe now minus this (s)
    compute_w: float = COMPUTE_W    # model: power while computing (W)
    transmit_w: float = TRANSMIT_W  # model: power while transmitting (W)
    idle_w: float = IDLE_W          # model: power while waiting (W)

    SOURCES = ("auto", "jetson", "rapl", "model")

    def validate(self) -> "PowerLoggerConfig":
        if self.source not in self.SOURCES:
            raise ConfigError(f"unknown source {self.source!r}; known: {list(self.SOURCES)}")
        watts = {name: checks.number(name, getattr(self, name), 0.0, 10000.0)
                 for name in ("compute_w", "transmit_w", "idle_w")}
        if not (watts["compute_w"] >= watts["idle_w"] and watts["transmit_w"] >= watts["idle_w"]):
            raise ConfigError("need compute_w >= idle_w and transmit_w >= idle_w, got "
                              f"{watts['compute_w']}, {watts['transmit_w']}, {watts['idle_w']}")
        return replace(self, sysfs_root=checks.text("sysfs_root", self.sysfs_root, empty=False),
                       rate_hz=checks.number("rate_hz", self.rate_hz, 0.0, 1000.0, low_open=True),
                       model_lag_s=checks.number("model_lag_s", self.model_lag_s, 0.0, 60.0), **watts)


# -- integration -------------------------------------------------------------------------
class EnergyMeter:
    """Samples a power source and integrates watts over time (trapezoid, with linear
    interpolation at the interval ends).

    ``sample()`` takes one reading; ``start(period_s)`` samples in a background thread
    until ``stop()`` (or use as a context manager). Keeps the last ``max_samples``."""

    def __init__(self, source, *, max_samples=200_000):
        self.source = source
        self._t = []
        self._w = []
        self._max = int(max_samples)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = None
        self.last = None

    def sample(self):
        reading = self.source.read()
        self.add(reading.t_s, reading.watts)
        self.last = reading
        return reading

    def add(self, t_s, watts):
        """Add a reading pushed from elsewhere (e.g. a PowerSample topic). Readings must
        not go back in time."""
        with self._lock:
            if self._t and t_s < self._t[-1]:
                raise ValueError("power readings went back in time")
            self._t.append(t_s)
            self._w.append(watts)
            if len(self._t) > self._max:
                del self._t[:len(self._t) - self._max]
                del self._w[:len(self._w) - self._max]

    def start(self, period_s=0.05):
        if self._thread is not None:
            return self
        self._stop.clear()
        self.sample()
        self._thread = threading.Thread(target=self._loop, args=(float(period_s),),
                                        name="EnergyMeter", daemon=True)
        self._thread.start()
        return self

    def _loop(self, period_s):
        while not self._stop.wait(period_s):
            try:
                self.sample()
            except PowerSourceUnavailable:
                return

    def stop(self):
        if self._thread is not None:
            self._stop.set()
            self._thread.join(5.0)
            self._thread = None
            self.sample()

    def __enter__(self):
        return self.start()

    def __exit__(self, exc_type, exc, tb):
        self.stop()
        return False

    @property
    def span_s(self):
        with self._lock:
            return (self._t[0], self._t[-1]) if self._t else (None, None)

    def energy_between(self, t0_s, t1_s, hold_last=False):
        """Energy (J) over [t0_s, t1_s]; the samples must cover the interval, except that
        with ``hold_last`` the last reading's power is held after it (for an interval that
        ends before the next reading has arrived)."""
        if t1_s < t0_s:
            raise ValueError(f"t1 {t1_s} < t0 {t0_s}")
        with self._lock:
            t, w = list(self._t), list(self._w)
        if hold_last and t and t1_s > t[-1]:
            t.append(t1_s)
            w.append(w[-1])
        eps = 1e-9
        if not t or t0_s < t[0] - eps or t1_s > t[-1] + eps:
            span = f"[{t[0]}, {t[-1]}]" if t else "no samples"
            raise ValueError(f"interval [{t0_s}, {t1_s}] not covered by samples {span}; "
                             "call sample() at both ends")
        t0_s, t1_s = max(t0_s, t[0]), min(t1_s, t[-1])

        def interp(x):
            j = min(max(bisect.bisect_right(t, x), 1), len(t) - 1)
            if t[j] == t[j - 1]:
                return w[j]
            return w[j - 1] + (w[j] - w[j - 1]) * (x - t[j - 1]) / (t[j] - t[j - 1])

        if len(t) == 1 or t1_s == t0_s:
            return 0.0
        pts = [(t0_s, interp(t0_s))]
        lo, hi = bisect.bisect_right(t, t0_s), bisect.bisect_left(t, t1_s)
        pts += list(zip(t[lo:hi], w[lo:hi]))
        pts.append((t1_s, interp(t1_s)))
        return sum((b[0] - a[0]) * (a[1] + b[1]) / 2.0 for a, b in zip(pts, pts[1:]))

    def mean_power_w(self, t0_s, t1_s):
        return self.energy_between(t0_s, t1_s) / (t1_s - t0_s) if t1_s > t0_s else 0.0
