"""Run the real nodes on the testbed and collect one row per frame.

Per model: roscore and offload_server (server.launch) in the server namespace; the robot
side (robot.launch: offload_client, bandwidth_monitor, power_logger) in the robot
namespace under a CPU quota; then per trace and mode a frame driver
(:mod:`robot_offload.ros.bench_driver`) that switches the mode, warms up, and runs the same
frames closed-loop while the trace replays from its start. With ``interleave`` there is one
driver per trace that warms every mode up and then runs the modes in turn frame by frame,
so that drift in the shared machine's speed hits every mode alike. Without root the same runs go
over loopback, unshaped, and every output says so.
"""

import json
import os
import random
import subprocess
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from robot_offload.errors import ConfigError
from robot_offload.models import get_spec
from robot_offload.testbed import CpuLimit, Testbed, TraceReplayer, choose_mechanism
from robot_offload.testbed import traces as tr
from robot_offload.testbed.cgroup import DEFAULT_PERIOD_US

#: Wait per warm-up frame (s): the first layer_partition / lop frame profiles the model on
#: the robot (every cut, codec and compression), minutes under a 0.5-CPU quota.
WARMUP_FRAME_TIMEOUT_S = 900.0


def parse_trace(spec: str, duration_s: float) -> tr.Trace:
    """See :func:`robot_offload.testbed.traces.from_spec`."""
    return tr.from_spec(spec, duration_s)


@dataclass
class BenchConfig:
    models: Sequence[str]
    modes: Sequence[str]
    traces: Sequence[str]
    out_dir: str
    frames: int = 20
    warmup: int = 3
    warmup_for: Dict[str, int] = field(default_factory=dict)   # mode -> its own warm-up frames
    robot_cpus: float = 0.5          # CPU quota of the robot side (CPUs); 0 = none
    input_sizes: Dict[str, List[int]] = field(default_factory=dict)
    timeout_s: float = 5.0           # the client's per-frame deadline (s)
    trace_duration_s: float = 60.0
    loopback: bool = False           # force the unshaped loopback testbed
    delay_ms: float = 0.0            # one-way delay added to each direction (ms); > 0 joins
                                     # the namespaces with TUN devices and a delay relay
    progress: Optional[object] = None  # a callable(str) told after every segment
    interleave: bool = False         # modes take turns frame by frame within one segment per
                                     # trace (robust to machine drift), not one after the other
    pin_cpus: bool = False           # robot side on CPU 0, server side on the others (see
                                     # :func:`side_cpus`), so neither steals the other's cores
    min_span_s: float = 0.0          # a cell goes on past `frames` until its frames span
    max_frames: int = 0              # this long (s), up to `max_frames` (cheap models)
    settle_s: float = 2.5 * DEFAULT_PERIOD_US / 1e6   # robot idle before every frame (s):
                                     # over two of the longest periods its CPU quota may have
                                     # (50 ms), so no frame starts on quota the frame before
                                     # it used up
    paired_trace: bool = True        # interleaved modes: every mode's frame i starts at the
                                     # same point of the trace (Driver.seek, TraceReplayer.seek)
    frames_source: str = "natural"   # image frames (camera.open_source): natural compresses
                                     # like a photograph; synthetic (flat squares) 100x or more,
                                     # which makes sending the input look nearly free
    camera_size: Tuple[int, int] = (640, 480)   # image frames' width and height (px)
    objective: str = "latency"       # the client's objective parameter (latency | energy | deadline)
    deadline_s: float = 0.1          # the client's deadline_s (objective deadline)
    hedge: bool = True               # the client's hedge parameter (a late call hedged)
    input_jpeg_quality: int = 0      # the client's input_jpeg_quality (frames as JPEG; 0 = off)

    @property
    def pairs_traces(self) -> bool:
        """Whether the modes of a trace's segment meet the same stretch of it frame for
        frame (``paired_trace`` with several interleaved modes; see Driver.seek)."""
        return self.paired_trace and self.interleave and len(self.modes) > 1


def side_cpus(available: Sequence[int]) -> Dict[str, str]:
    """``taskset -c`` lists for each side: the robot on the lowest CPU, the server on the
    rest. On one machine the two sides otherwise share every core: whatever the robot
    computes while the server works (record_replay's answers from the record, lop's own
    rows) slows the server's intra-op threads, which a Jetson and a separate GPU PC do not
    do to each other. Needs at least two CPUs."""
    cpus = sorted(int(c) for c in available)
    if len(cpus) < 2:
        raise ConfigError(f"pinning the two sides needs at least 2 CPUs, this process may use {cpus}")
    return {"robot": str(cpus[0]), "server": ",".join(str(c) for c in cpus[1:])}


def _wait_for_line(proc, token, timeout_s: float) -> str:
    """Read the process's stdout until a line starting with ``token`` (a string, or a tuple
    of them)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        line = proc.stdout.readline()
        if not line:
            if proc.poll() is not None:
                raise RuntimeError(f"driver exited ({proc.returncode}) before {token}")
            continue
        if line.startswith(token):
            return line.strip()
        if line.startswith("ERROR"):
            raise RuntimeError(line.strip())
    raise TimeoutError(f"no {token} within {timeout_s} s")


def wait_for_master(tb, env, core=None, timeout_s=60.0):
    """Wait until a roscore answers in the testbed's server namespace (roslaunch would
    start a master of its own otherwise). ``core``: the roscore process, if ours."""
    probe = [sys.executable, "-c", "import rosgraph, sys; sys.exit(0 if rosgraph.is_master_online() else 1)"]
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if core is not None and core.poll() is not None:
            raise RuntimeError("roscore exited; see logs/roscore.log")
        if tb.run("server", probe, env=env).wait(timeout=30) == 0:
            return
        time.sleep(0.5)
    raise TimeoutError("roscore did not come up")


def _stop(proc, timeout_s=20.0):
    import signal
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=timeout_s)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass


class BenchRunner:
    def __init__(self, config: BenchConfig):
        self.cfg = config
        for m in config.models:
            get_spec(m)
        self.traces = [parse_trace(t, config.trace_duration_s) for t in config.traces]
        os.makedirs(config.out_dir, exist_ok=True)
        self.log_dir = os.path.join(config.out_dir, "logs")
        os.makedirs(self.log_dir, exist_ok=True)
        self.notes: List[str] = []
        self.failed: List[str] = []
        self.applied: Dict[str, list] = {}
        # ``taskset -c`` CPU list per side when pinned (set when the run starts).
        self._pins: Dict[str, str] = {}

    def _log(self, name):
        return open(os.path.join(self.log_dir, name), "w")

    def _client_config(self) -> Optional[str]:
        """A client parameter file (loaded over config/client.yaml) setting what the run
        sets apart from the defaults (the objective, hedging, JPEG frames), or None."""
        params = {}
        if self.cfg.objective != "latency":
            params["objective"] = self.cfg.objective
        if self.cfg.objective == "deadline":
            params["deadline_s"] = float(self.cfg.deadline_s)
        if not self.cfg.hedge:
            params["hedge"] = "false"
        if self.cfg.input_jpeg_quality:
            params["input_jpeg_quality"] = int(self.cfg.input_jpeg_quality)
        if not params:
            return None
        path = os.path.abspath(os.path.join(self.log_dir, "client-params.yaml"))
        with open(path, "w") as f:
            f.writelines(f"{k}: {v}\n" for k, v in params.items())
        return path

    def run(self) -> List[dict]:
        cfg = self.cfg
        rows: List[dict] = []
        with Testbed(loopback=cfg.loopback, link="tun" if cfg.delay_ms else "veth",
                     delay_s=cfg.delay_ms / 1e3) as tb:
            if not tb.shaped:
                self.notes.append(f"UNSHAPED loopback run: {tb.reason}")
            else:
                self.notes.append(f"link shaped with {tb.qdisc_kind} between network namespaces "
                                  f"(netem {'available' if tb.netem else 'missing'})")
            self.notes.append(f"image frames: {cfg.frames_source}, {cfg.camera_size[0]}x{cfg.camera_size[1]} "
                              "(camera.open_source; the same frames for every mode)")
            if cfg.min_span_s > 0:
                self.notes.append(f"cells of at least {cfg.frames} frames, extended until their frames "
                                  f"spanned {cfg.min_span_s:g} s of "
                                  f"{'the trace' if cfg.pairs_traces else 'wall time'} (at most {cfg.max_frames} frames)")
            if cfg.interleave and len(cfg.modes) > 1:
                self.notes.append("modes interleaved: after every mode's warm-up, frame i ran in "
                                  f"each of {', '.join(cfg.modes)} back to back, then frame i + 1; "
                                  "the orders balanced so that every mode followed every other "
                                  "equally often, across frames too (bench.order)")
            if cfg.pairs_traces:
                self.notes.append("paired trace: every mode's frame i started at the same point of "
                                  "the bandwidth trace, and frame i + 1 where the slowest mode's "
                                  "frame i ended (frames.csv: trace_s)")
            if cfg.objective != "latency":
                deadline = f", deadline {1e3 * cfg.deadline_s:g} ms" if cfg.objective == "deadline" else ""
                self.notes.append(f"client objective: {cfg.objective}{deadline} (what the plans of "
                                  "layer_partition and lop, and auto's choice, minimise)")
            if not cfg.hedge:
                self.notes.append("hedging off (hedge: false): no late call is hedged")
            if cfg.input_jpeg_quality:
                self.notes.append(f"camera frames offloaded as JPEG (input_jpeg_quality: "
                                  f"{cfg.input_jpeg_quality}): lossy, accuracy in bench.lossy_input")
            if cfg.settle_s > 0:
                self.notes.append(f"{1e3 * cfg.settle_s:g} ms of idle before every frame "
                                  "(the robot's CPU quota refilled)")
            if tb.delay_s:
                self.notes.append(
                    f"added delay: {1e3 * tb.delay_s:g} ms each way, by a user-space relay "
                    "between two TUN devices (robot_offload.testbed.delay_link; the relay "
                    "runs outside the robot's CPU quota)")
            port = random.randint(20000, 40000)
            env = {"ROS_MASTER_URI": f"http://{tb.server_ip}:{port}",
                   "ROS_HOME": os.path.join(cfg.out_dir, "ros_home"), "PYTHONUNBUFFERED": "1"}
            env["ROS_LOG_DIR"] = os.path.join(env["ROS_HOME"], "log")
            server_env = dict(env, ROS_IP=tb.server_ip)
            robot_env = dict(env, ROS_IP=tb.robot_ip)
            limit = self._cpu_limit()
            if cfg.pin_cpus:
                self._pins = side_cpus(os.sched_getaffinity(0))
                self.notes.append(f"sides pinned (taskset): robot on CPU {self._pins['robot']}, "
                                  f"server side (roscore, offload_server) on CPU {self._pins['server']}")
            core = self._run(tb, "server", ["roscore", "-p", str(port)], env=server_env,
                             stdout=self._log("roscore.log"), stderr=subprocess.STDOUT)
            try:
                wait_for_master(tb, server_env, core)
                with limit as lim:
                    for model in cfg.models:
                        try:
                            rows += self._run_model(tb, lim, model, server_env, robot_env)
                        except (RuntimeError, TimeoutError, OSError) as e:
                            # One model failing (a crashed node, a timeout) must not cost
                            # the others' results: say so in the report and go on.
                            self.notes.append(f"FAILED {model}: {e} (see {self.log_dir})")
                            self.failed.append(model)
            finally:
                _stop(core)
        return rows

    def _run(self, tb, side, argv, **kw):
        """``tb.run`` on ``side``, under ``taskset -c`` when the sides are pinned."""
        pin = self._pins.get(side)
        return tb.run(side, (["taskset", "-c", pin] if pin else []) + list(argv), **kw)

    def _cpu_limit(self):
        cfg = self.cfg
        if cfg.robot_cpus <= 0:
            self.notes.append("robot CPU not limited")
            return nullcontext(None)
        mech = choose_mechanism()
        if mech.kind == "threads":
            self.notes.append(f"robot CPU NOT limited (no writable cgroup: {mech.reason})")
            return nullcontext(None)
        lim = CpuLimit(ratio=cfg.robot_cpus)
        piece = (f"a {lim.slice_us / 1000:g} ms bandwidth slice" if lim.slice_us else
                 "the kernel's bandwidth slice, which could not be set")
        self.notes.append(f"robot side limited to {cfg.robot_cpus:g} CPU ({mech.kind}, quota "
                          f"{lim.quota_us / 1000:g} ms per {lim.period_us / 1000:g} ms period, "
                          f"{piece}); the server side shares the remaining "
                          f"{os.cpu_count()}-CPU machine")
        return lim

    def _run_model(self, tb, lim, model, server_env, robot_env) -> List[dict]:
        cfg = self.cfg
        spec = get_spec(model)
        size = list(cfg.input_sizes.get(model) or spec.input_size)
        server = self._run(tb, "server", ["roslaunch", "robot_offload", "server.launch",
                                          f"preload:=[{model}]"],
                           env=server_env, stdout=self._log(f"server-{model}.log"), stderr=subprocess.STDOUT)
        robot_argv = ["roslaunch", "robot_offload", "robot.launch", "camera:=false", f"model:={model}",
                      "mode:=local", f"input_size:=[{','.join(map(str, size))}]",
                      "image_topic:=/bench/image", "points_topic:=/bench/points",
                      f"timeout_s:={cfg.timeout_s}"]
        client_config = self._client_config()
        if client_config is not None:
            robot_argv.append(f"client_config:={client_config}")
        # Robot nodes inherit the CPU quota from roslaunch (None: no limit).
        robot = self._run(tb, "robot", robot_argv, env=robot_env, cpu_limit=lim,
                          stdout=self._log(f"robot-{model}.log"), stderr=subprocess.STDOUT)
        rows = []
        try:
            for trace in self.traces:
                if robot.poll() is not None:
                    raise RuntimeError(f"robot.launch for {model} exited; see logs/robot-{model}.log")
                groups = [list(cfg.modes)] if cfg.interleave else [[m] for m in cfg.modes]
                for modes in groups:
                    rows += self._segment(tb, model, spec, trace, modes, robot_env)
        finally:
            _stop(robot)
            _stop(server)
        return rows

    def _segment(self, tb, model, spec, trace, modes, robot_env) -> List[dict]:
        """One driver run: ``modes`` (one, or several in turn frame by frame) over ``trace``."""
        cfg = self.cfg
        tag = "-".join(modes)
        out = os.path.join(self.log_dir, f"rows-{model}-{trace.name}-{tag}.jsonl")
        tb.set_rate(trace.rates_bps[0])
        kind = spec.input_kind
        argv = [sys.executable, "-m", "robot_offload.ros.bench_driver", "--mode", *modes,
                "--frames", cfg.frames, "--warmup", cfg.warmup, "--out", out, "--input-kind", kind,
                "--source", cfg.frames_source,
                "--width", cfg.camera_size[0], "--height", cfg.camera_size[1],
                "--min-span-s", cfg.min_span_s, "--max-frames", cfg.max_frames,
                "--settle-s", cfg.settle_s,
                "--input-topic", "/bench/points" if kind == "pointcloud" else "/bench/image",
                "--frame-timeout-s", max(30.0, 3 * cfg.timeout_s),
                "--warmup-timeout-s", WARMUP_FRAME_TIMEOUT_S]
        for mode, count in cfg.warmup_for.items():
            if mode in modes:
                argv += ["--warmup-for", f"{mode}={count}"]
        if cfg.pairs_traces:
            argv.append("--paired-trace")
        driver = self._run(tb, "robot", argv, env=robot_env, stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE,
                           stderr=self._log(f"driver-{model}-{trace.name}-{tag}.log"), text=True)
        frames = max(cfg.frames, cfg.max_frames if cfg.min_span_s > 0 else 0) * len(modes)
        try:
            _wait_for_line(driver, "READY", 60 + WARMUP_FRAME_TIMEOUT_S * max(1, cfg.warmup) * len(modes))
            repeat = 1 + int(frames * 60 / max(trace.duration_s, 1))   # never run out of trace
            with TraceReplayer(tb, trace, repeat=repeat) as replayer:
                driver.stdin.write("GO\n")
                driver.stdin.flush()
                end = time.monotonic() + 60 + frames * max(30.0, 3 * cfg.timeout_s)
                while True:
                    line = _wait_for_line(driver, ("SEEK", "DONE"), end - time.monotonic())
                    if line.startswith("DONE"):
                        break
                    replayer.seek(float(line.split()[1]))     # the driver waits for the OK
                    driver.stdin.write("OK\n")
                    driver.stdin.flush()
                driver.wait(timeout=30)
            self.applied[trace.name] = list(replayer.applied)
        finally:
            _stop(driver, 5)
        rows = []
        with open(out) as f:
            for line in f:
                row = json.loads(line)
                row.update(model=model, trace=trace.name)
                row.setdefault("mode_asked", tag)    # bandwidth samples: the segment's modes
                rows.append(row)
        if cfg.progress:
            for m in modes:
                done = [r for r in rows if r["mode_asked"] == m and not r.get("bandwidth")
                        and not r.get("lost")]
                cfg.progress(f"{model} {trace.name} {m}: {len(done)} frames")
        return rows
