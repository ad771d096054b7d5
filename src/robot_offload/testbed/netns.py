"""A robot and a server on one machine: two network namespaces joined by a shaped veth pair.

::

    with Testbed() as tb:
        if not tb.shaped:
            print("testbed:", tb.reason)        # loopback, unshaped: say so
        tb.set_rate(50e6)                        # both directions, bit/s
        srv = tb.run("server", [sys.executable, "-m", "my.server", "--host", tb.server_ip])
        cli = tb.run("robot", [sys.executable, "-m", "my.client", tb.server_ip])
        with TraceReplayer(tb, traces.outdoor()) as rp:
            cli.wait(timeout=60)

Shaping is an egress qdisc on each veth end (robot end = uplink robot->server, server end =
downlink). Rates are TCP goodput, as iperf reports them and as the papers' traces were
measured: with ``goodput=True`` (default) the qdisc is set to ``rate * wire_factor(mtu)``
(1514/1448 = 1.046 for a 1500-byte MTU) so that a bulk TCP transfer gets the stated rate;
``qdisc_rate_bps`` reads back that wire rate.

The rate limit is ``htb`` (one class with rate = ceil, a ``bfifo`` queue as its leaf), the
same on every machine. Where the kernel has ``netem`` (probed once per process) a fixed
one-way delay is available as a ``netem delay`` leaf under that class
(``delay_supported``). The development machine's kernel has no netem. There,
``link="tun"`` joins the namespaces with two TUN devices and a user-space relay that
delays every packet (:mod:`robot_offload.testbed.delay_link`). The htb shaping is the same
on the TUN devices. Measured choices:

- Trace replay uses ``tc class change`` / ``tc qdisc change``, which keep the queue and the
  class's tokens: replaying 9.5 s of the indoor / outdoor traces under a bulk TCP upload
  gave 92.4-93.1 / 71.4-72.2 Mbit/s for trace means of 92.7 / 71.9. ``qdisc="tbf"`` is
  available, but tbf refills its bucket on every change and the same replays gave
  111.5 / 83-86 Mbit/s (+20 % / +16 %).
- Bucket (:func:`shaper_sizes`): 20 ms at the rate, so tokens are not lost when a busy or
  virtualised host runs the qdisc timer late (with 4 ms, 50 Mbit/s measured 71-97 % of
  the rate on a VM with CPU steal; with 20 ms, 99-101 %).
- Queue: ``latency_s`` (default 0.2 s, WiFi-like) at the rate, at least 32 full frames, so
  TCP's start-up overshoot at low rates does not end in timeouts.
- GSO limited to 8 KB packets (``gso_max_bytes``, set as the veth's ``gso_max_size``),
  with a queue of at least three such packets. Measured on this 2-core VM with CPU steal:
  fully off (MTU packets, as WiFi frames), 100-200 Mbit/s measured 62-97 % of the rate
  but the outdoor replay 100 %; the kernel's 64 KB, 1-200 Mbit/s were exact but the
  outdoor replay got 68 % (each packet is a long burst in a fade); 8-9 KB, 1-200 Mbit/s
  within 1 %, indoor replay +0.5 %, outdoor -3 to -5 %.

Without root, or where ``ip netns add`` fails, the testbed is plain loopback, unshaped:
``shaped`` is False and ``reason`` says why; ``run`` starts commands in the host namespace and
``set_rate`` only records the rate. Callers must print ``reason`` next to any result.

Everything is removed by ``close()`` (context-manager exit), at interpreter exit (atexit),
on SIGTERM/SIGHUP (turned into SystemExit while a testbed is open and the signal had its
default action), and, after a SIGKILL, by ``python -m robot_offload.testbed cleanup``.
"""

import atexit
import ipaddress
import json
import logging
import math
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import threading
import time

from robot_offload.testbed import delay_link
from robot_offload.testbed._common import (
    PREFIX, TestbedError, owner_pid, pid_alive, run_cmd, unique_base, with_package_path)

log = logging.getLogger(__name__)

SIDES = ("robot", "server")
#: where `ip netns add` keeps named network namespaces (nsenter --net takes the path)
NETNS_DIR = "/run/netns"
#: Slowest rate a qdisc is set to; a trace's "zero" becomes this (bit/s).
MIN_RATE_BPS = 10_000.0
#: Fastest rate accepted (bit/s).
MAX_RATE_BPS = 10e9
#: Ethernet header bytes the qdisc counts on top of the IP MTU.
ETH_HEADER_BYTES = 14
#: IP + TCP header bytes per full segment (20 + 20 + 12 of timestamps).
TCP_IP_HEADER_BYTES = 52
#: Token bucket depth, as time at the rate (s).
BURST_S = 0.02
#: Smallest queue, in full frames.
MIN_QUEUE_FRAMES = 32
#: Default largest GSO packet the veth hands the qdisc (bytes); see the module docstring.
GSO_MAX_BYTES = 8192
#: htb quantum (bytes): at least the largest GSO packet; only matters between siblings.
HTB_QUANTUM = 65536
QDISCS = ("htb", "tbf")
#: How the namespaces are joined: a veth pair (kernel only; delay needs netem) or two TUN
#: devices and a delaying user-space relay (delay without netem).
LINKS = ("veth", "tun")

# Probe result for "does `tc qdisc add ... netem` work", shared by every testbed in the
# process (the kernel does not change under us).
_netem_probe = {"done": False, "ok": False}


def clamp_rate(rate_bps):
    """The rate actually applied for a requested one: finite, within [MIN, MAX]."""
    rate = float(rate_bps)
    if not math.isfinite(rate):
        raise ValueError(f"rate must be finite, got {rate_bps!r}")
    return min(max(rate, MIN_RATE_BPS), MAX_RATE_BPS)


def wire_factor(mtu=1500, l2_header_bytes=ETH_HEADER_BYTES):
    """Wire bytes per TCP payload byte for full segments: (mtu + 14) / (mtu - 52). A TUN
    device's qdisc sees bare IP packets: ``l2_header_bytes=0``."""
    return (mtu + l2_header_bytes) / (mtu - TCP_IP_HEADER_BYTES)


def shaper_sizes(rate_bps, *, latency_s=0.2, mtu=1500, gso_max_bytes=0):
    """(rate bit/s as int, burst bytes, queue limit bytes) for a wire rate.

    burst = max(BURST_S at the rate, 3 frames); queue = max(latency_s at the rate,
    MIN_QUEUE_FRAMES frames, 3 GSO packets) + burst; frame = mtu + 14."""
    rate = int(round(clamp_rate(rate_bps)))
    frame = mtu + ETH_HEADER_BYTES
    bytes_per_s = rate / 8.0
    burst = int(max(bytes_per_s * BURST_S, 3 * frame))
    floor = max(MIN_QUEUE_FRAMES * frame, 3 * int(gso_max_bytes or 0))
    limit = int(max(bytes_per_s * latency_s, floor)) + burst
    return rate, burst, limit


def shaping_batch(dev, rate_bps, *, qdisc="htb", create=True, delay_s=0.0, latency_s=0.2,
                  mtu=1500, gso_max_bytes=0):
    """``tc -batch`` lines shaping ``dev``'s egress to the wire rate ``rate_bps``.

    htb: root ``htb`` (handle 1:) with one class 1:1 (rate = ceil, burst = cburst) and a
    leaf (handle 10:) that is ``bfifo`` holding the queue, or ``netem delay`` (queue in
    packets) when ``delay_s`` > 0. ``create=False`` gives ``change`` lines that keep the
    queue and the class's tokens. tbf: one root ``tbf`` line; it cannot delay, and every
    ``change`` refills its bucket (see the module docstring). The caller deletes an old
    root before ``create``."""
    rate, burst, limit = shaper_sizes(rate_bps, latency_s=latency_s, mtu=mtu,
                                      gso_max_bytes=gso_max_bytes)
    verb = "add" if create else "change"
    if qdisc == "tbf":
        if delay_s:
            raise TestbedError("tbf cannot add delay; use qdisc='htb' with netem")
        return [f"qdisc {verb} dev {dev} root tbf rate {rate}bit burst {burst} "
                f"limit {limit}"]
    if qdisc != "htb":
        raise ValueError(f"unknown qdisc {qdisc!r}; supported: {', '.join(QDISCS)}")
    if delay_s:
        packets = max(100, math.ceil(limit / (mtu + ETH_HEADER_BYTES)))
        leaf = f"netem delay {int(round(delay_s * 1e6))}us limit {packets}"
    else:
        leaf = f"bfifo limit {limit}"
    lines = [f"qdisc add dev {dev} root handle 1: htb default 1"] if create else []
    lines += [f"class {verb} dev {dev} parent 1: classid 1:1 htb rate {rate}bit "
              f"ceil {rate}bit burst {burst} cburst {burst} quantum {HTB_QUANTUM}",
              f"qdisc {verb} dev {dev} parent 1:1 handle 10: {leaf}"]
    return lines


_UNITS = {"": 1.0, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
_RATE_RE = re.compile(r"\brate (\d+(?:\.\d+)?)([KMGT]?)bit\b")


def shape_end(tc, dev, wire_rate_bps, trees, key, tree, **batch_kw):
    """Shape one link end's egress (``tc``: the command prefix reaching ``dev``'s
    namespace) to ``wire_rate_bps`` with :func:`shaping_batch` (``batch_kw``). The qdisc
    tree is built when ``trees[key]`` is not ``tree``, else changed in place, which keeps
    its queue and tokens (trace replay)."""
    create = trees.get(key) != tree
    if create:
        run_cmd([*tc, "qdisc", "del", "dev", dev, "root"], check=False)
        trees.pop(key, None)
    lines = shaping_batch(dev, wire_rate_bps, create=create, **batch_kw)
    run_cmd([*tc, "-batch", "-"], input_text="\n".join(lines) + "\n")
    trees[key] = tree


def parse_tc_rate_bps(text):
    """The first ``rate <n>[KMGT]bit`` in ``tc class/qdisc show`` text (bit/s), or None."""
    m = _RATE_RE.search(text)
    return float(m.group(1)) * _UNITS[m.group(2)] if m else None


def qdisc_rate_bps(qdisc):
    """Rate in bit/s of a root qdisc as ``tc -j qdisc show`` prints it (tbf), or None."""
    opts = qdisc.get("options", {})
    for key in ("rate64", "rate"):
        value = opts.get(key)
        if isinstance(value, dict):  # netem prints {"rate": {...}} on some versions
            value = value.get("rate")
        if isinstance(value, (int, float)) and value > 0:
            return float(value) * 8.0
    return None


class NamespaceLifecycle:
    """Opening and closing a testbed of namespaces (:class:`Testbed`, and
    :class:`~robot_offload.testbed.star.StarTestbed`): registered for cleanup at exit and on
    signals, built by the subclass's ``_build`` (``_teardown`` undoes it, also of a build
    that failed half way), else loopback with ``reason`` saying why (or TestbedError with
    ``fallback=False``); then ``_apply_wanted`` sets the rates asked for at construction.
    ``close()`` stops replayers and processes and removes everything built."""

    label = "testbed"

    def _init_lifecycle(self):
        self.shaped = False
        self.reason = "not opened"
        self._created_ns = []          # namespaces made, removed at close
        self._procs = []               # processes started in them
        self._replayers = []
        self._lock = threading.RLock()
        self._opened = False
        self._closed = False

    def __enter__(self):
        self.open()
        return self

    def __exit__(self, exc_type, exc, tb):
        self.close()
        return False

    def _stop_started(self):
        """Stop the trace replayers and the processes started in the namespaces."""
        for rp in list(self._replayers):
            rp.stop()
        for proc in self._procs:
            _stop_process_group(proc)
        self._procs.clear()

    def _require_open(self):
        if not self._opened or self._closed:
            raise TestbedError(f"{self.label} is not open (use it as a context manager)")

    def _popen(self, cmd, env, cpu_limit, popen_kwargs):
        """Start ``cmd`` (in ``cpu_limit``'s cgroup from its start, if given; ``env``
        over this process's environment) in a session of its own, stopped by ``close()``."""
        if cpu_limit is not None:
            cmd = cpu_limit.wrap(cmd)
        if env is not None:
            env = {**os.environ, **{k: str(v) for k, v in env.items()}}
        popen_kwargs.setdefault("start_new_session", True)
        proc = subprocess.Popen(cmd, env=env, **popen_kwargs)
        self._procs.append(proc)
        return proc

    def open(self):
        if self._opened:
            return self
        self._opened = True
        _register(self)
        why = "loopback requested" if self._loopback else _cannot_namespace()
        if why is None:
            try:
                self._build()
                self.shaped = True
                self.reason = self._describe()
            except TestbedError as e:
                self._teardown()
                why = f"could not build namespaces: {e}"
            except BaseException:  # Ctrl-C while building: `with` will not call __exit__
                self.close()
                raise
        if why is not None:
            if not self._fallback and not self._loopback:
                self.close()
                raise TestbedError(why)
            self.shaped = False
            self.reason = f"loopback, unshaped: {why}"
            log.warning("%s: %s", self.label, self.reason)
        try:
            self._apply_wanted()
        except BaseException:
            self.close()
            raise
        return self

    def close(self):
        if self._closed:
            return
        self._closed = True
        try:
            self._teardown()
        finally:
            _unregister(self)


class Testbed(NamespaceLifecycle):
    """Two namespaces (robot, server) joined by a veth pair; see the module docstring.

    ``fallback=False`` raises TestbedError instead of falling back to loopback;
    ``loopback=True`` asks for the unshaped loopback testbed outright.
    ``gso_max_bytes`` caps the packets TCP hands the qdisc (0: MTU-sized, no GSO; see the
    module docstring for the measured trade-off; veth only, TUN devices have no GSO).
    ``link="tun"``: TUN devices and a delay relay instead of the veth pair, so that
    ``delay_s`` / ``set_delay`` work without netem (the relay costs CPU: about 0.1-0.4 ms
    per round trip and a share of a core at 100 Mbit/s).

    Attributes: ``shaped``, ``reason``, ``link``, ``netem``, ``delay_supported``, ``robot_ip``,
    ``server_ip``, ``robot_ns``, ``server_ns``, ``robot_if``, ``server_if``,
    ``rate_bps`` (last applied uplink rate or None), ``down_bps``, ``delay_s``.
    """

    __test__ = False  # not a pytest test class, despite the name

    def __init__(self, *, subnet="10.231.0.0/30", rate_bps=None, delay_s=0.0,
                 latency_s=0.2, mtu=1500, goodput=True, qdisc="htb",
                 gso_max_bytes=GSO_MAX_BYTES, fallback=True, loopback=False, prefix=PREFIX,
                 use_netem=True, link="veth"):
        if qdisc not in QDISCS:
            raise ValueError(f"unknown qdisc {qdisc!r}; supported: {', '.join(QDISCS)}")
        if link not in LINKS:
            raise ValueError(f"unknown link {link!r}; supported: {', '.join(LINKS)}")
        net = ipaddress.ip_network(subnet)
        if net.version != 4 or net.prefixlen > 30:
            raise ValueError(f"subnet must be IPv4 with at least 2 hosts, got {subnet}")
        hosts = list(net.hosts())[:2]
        self._prefixlen = net.prefixlen
        self._addr = {"robot": str(hosts[0]), "server": str(hosts[1])}
        self.latency_s = float(latency_s)
        self.mtu = int(mtu)
        self.goodput = bool(goodput)
        self.qdisc_kind = qdisc
        frame = self.mtu + ETH_HEADER_BYTES
        gso_max_bytes = int(gso_max_bytes or 0)
        self.gso_max_bytes = gso_max_bytes if gso_max_bytes > frame and link == "veth" else 0
        self.link = link
        self._trees = {}
        self._want_rate = rate_bps
        self._want_delay = float(delay_s)
        self._fallback = fallback
        self._loopback = loopback
        self._prefix = prefix
        self._use_netem = use_netem

        base = unique_base(prefix)
        self.robot_ns = f"{base}-robot"
        self.server_ns = f"{base}-server"
        self.robot_if = f"{link}-robot"
        self.server_if = f"{link}-server"
        # TUN names while the devices are still in the host namespace (unique there).
        self._tun_host_names = {side: f"ro{base.split('-', 1)[1]}{side[0]}" for side in SIDES}
        self._relay = None

        self._init_lifecycle()
        self.netem = False
        self.rate_bps = None
        self.down_bps = None
        self.delay_s = 0.0

    # -- properties -------------------------------------------------------------------
    @property
    def robot_ip(self):
        return self._addr["robot"] if self.shaped else "127.0.0.1"

    @property
    def server_ip(self):
        return self._addr["server"] if self.shaped else "127.0.0.1"

    @property
    def delay_supported(self):
        return self.shaped and (self.netem or self.link == "tun")

    def wire_rate_bps(self, rate_bps):
        """The qdisc rate used for a requested (clamped) rate."""
        l2_header_bytes = ETH_HEADER_BYTES if self.link == "veth" else 0
        return clamp_rate(rate_bps) * (wire_factor(self.mtu, l2_header_bytes) if self.goodput
                                       else 1.0)

    def ns(self, side):
        """Namespace name of a side ("robot" or "server")."""
        return {"robot": self.robot_ns, "server": self.server_ns}[_check_side(side)]

    def dev(self, side):
        """The veth end inside that side's namespace."""
        return {"robot": self.robot_if, "server": self.server_if}[_check_side(side)]

    # -- lifecycle --------------------------------------------------------------------
    def _describe(self):
        return (f"namespaces {self.robot_ns} / {self.server_ns}, {self.qdisc_kind} rate limit, "
                + ("TUN devices, delay by a user-space relay" if self.link == "tun"
                   else "netem available for delay" if self.netem
                   else "no netem in this kernel: no added delay"))

    def _apply_wanted(self):
        if self._want_rate is not None:
            self.set_rate(self._want_rate)
        if self._want_delay:
            self.set_delay(self._want_delay)

    def _build(self):
        self._ip("netns", "add", self.robot_ns)
        self._created_ns.append(self.robot_ns)
        self._ip("netns", "add", self.server_ns)
        self._created_ns.append(self.server_ns)
        if self.link == "tun":
            self._start_relay()
            for side in SIDES:
                host_name = self._tun_host_names[side]
                self._ip("link", "set", host_name, "netns", self.ns(side))
                self._ip("-n", self.ns(side), "link", "set", host_name, "name", self.dev(side))
        else:
            self._ip("-n", self.robot_ns, "link", "add", self.robot_if, "type", "veth",
                     "peer", "name", self.server_if, "netns", self.server_ns)
        for side in SIDES:
            ns, dev = self.ns(side), self.dev(side)
            self._ip("-n", ns, "link", "set", "lo", "up")
            self._ip("-n", ns, "link", "set", dev, "mtu", str(self.mtu))
            if self.gso_max_bytes:
                self._ip("-n", ns, "link", "set", dev, "gso_max_size", str(self.gso_max_bytes))
            elif self.link == "veth":
                self._ip("-n", ns, "link", "set", dev, "gso_max_segs", "1")
            self._ip("-n", ns, "addr", "add", f"{self._addr[side]}/{self._prefixlen}",
                     "dev", dev)
            self._ip("-n", ns, "link", "set", dev, "up")
        self.netem = self._use_netem and self._probe_netem()

    def _start_relay(self, timeout_s=10.0):
        """Start the delay relay (its own process, see delay_link) with no delay and wait
        for its TUN devices; ``open`` sets the delay asked for, as on a veth link."""
        # -c, not -m: "-m robot_offload.testbed.delay_link" would run a module the package
        # has already imported (runpy warns that it may behave unpredictably).
        self._relay = subprocess.Popen(
            [sys.executable, "-c", "import sys; from robot_offload.testbed.delay_link import "
             "main; sys.exit(main(sys.argv[1:]))", self._tun_host_names["robot"],
             self._tun_host_names["server"]],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            env={**os.environ, **with_package_path()}, start_new_session=True)
        ready, _, _ = select.select([self._relay.stdout], [], [], timeout_s)
        line = self._relay.stdout.readline() if ready else b""
        if line.strip() != b"ready":
            raise TestbedError(f"delay relay did not start (exit code {self._relay.poll()}, "
                               f"said {line!r}); TUN needs /dev/net/tun and root")

    def _stop_relay(self):
        """Close the relay's input (it exits and its TUN devices go) and wait for it."""
        relay, self._relay = self._relay, None
        if relay is None:
            return
        try:
            relay.stdin.close()
            relay.wait(5.0)
        except (OSError, subprocess.TimeoutExpired):
            _stop_process_group(relay)
        if relay.stdout is not None:
            relay.stdout.close()

    def _probe_netem(self):
        if not _netem_probe["done"]:
            ns, dev = self.robot_ns, self.robot_if
            proc = run_cmd(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "netem",
                            "delay", "0us"], check=False)
            _netem_probe["ok"] = proc.returncode == 0
            _netem_probe["done"] = True
            if proc.returncode == 0:
                run_cmd(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)
        return _netem_probe["ok"]

    def _teardown(self):
        self._stop_started()
        self._stop_relay()
        if self._created_ns:
            for ns in self._created_ns:
                _kill_namespace_pids(ns)
            # Deleting one veth end deletes its peer.
            run_cmd(["ip", "-n", self._created_ns[0], "link", "del", self.robot_if],
                    check=False)
            for ns in reversed(self._created_ns):
                proc = run_cmd(["ip", "netns", "del", ns], check=False)
                if proc.returncode != 0:
                    log.error("could not delete namespace %s: %s", ns, proc.stderr.strip())
            self._created_ns.clear()

    @staticmethod
    def _ip(*args):
        return run_cmd(["ip", *args])

    # -- shaping ----------------------------------------------------------------------
    def set_rate(self, bits_per_s, *, down_bps=None):
        """Shape uplink (robot egress) to ``bits_per_s`` and downlink (server egress) to
        ``down_bps`` (default: the same). Returns the uplink rate actually applied (clamped
        to [MIN_RATE_BPS, MAX_RATE_BPS]). The first call builds the qdiscs; later calls
        change them in place (queued packets stay queued)."""
        up = clamp_rate(bits_per_s)
        down = clamp_rate(bits_per_s if down_bps is None else down_bps)
        with self._lock:
            self._require_open()
            if self.shaped:
                for side, rate in (("robot", up), ("server", down)):
                    self._shape(side, rate)
            self.rate_bps, self.down_bps = up, down
        return up

    def _shape(self, side, rate_bps):
        netem_delay_s = self.delay_s if self.link == "veth" else 0.0  # tun: the relay delays
        shape_end(["tc", "-n", self.ns(side)], self.dev(side), self.wire_rate_bps(rate_bps),
                  self._trees, side, (self.qdisc_kind, bool(netem_delay_s)), qdisc=self.qdisc_kind,
                  delay_s=netem_delay_s, latency_s=self.latency_s, mtu=self.mtu,
                  gso_max_bytes=self.gso_max_bytes)

    def set_delay(self, delay_s):
        """Fixed one-way delay on both directions: with ``link="tun"`` the relay's, else a
        netem leaf under the rate class (TestbedError where the kernel has no netem). On a
        veth link it needs a rate: call set_rate first or give ``rate_bps`` to the
        constructor."""
        delay_s = delay_link.check_delay(delay_s)
        with self._lock:
            self._require_open()
            if delay_s and not self.delay_supported:
                raise TestbedError(
                    "fixed delay needs netem, which "
                    + ("this kernel lacks (Testbed(link='tun') delays without it)"
                       if self.shaped else "an unshaped testbed lacks")
                    + f" ({self.reason})")
            if self.link == "tun":
                try:
                    self._relay.stdin.write(f"delay {delay_s!r}\n".encode())
                    self._relay.stdin.flush()
                except (OSError, AttributeError) as e:
                    raise TestbedError(f"delay relay is gone: {e}") from e
                self.delay_s = delay_s
                return
            if delay_s and self.qdisc_kind != "htb":
                raise TestbedError("fixed delay needs qdisc='htb' (a netem leaf)")
            if self.rate_bps is None:
                raise TestbedError("set a rate before a delay")
            self.delay_s = delay_s
            self.set_rate(self.rate_bps, down_bps=self.down_bps)

    def clear_rate(self):
        """Remove shaping (and delay) from both ends."""
        with self._lock:
            self._require_open()
            if self.shaped:
                for side in SIDES:
                    run_cmd(["tc", "-n", self.ns(side), "qdisc", "del", "dev",
                             self.dev(side), "root"], check=False)
            self._trees.clear()
            self.rate_bps = self.down_bps = None
            if self.link == "tun" and self.delay_s and self._relay is not None:
                self.set_delay(0.0)
            self.delay_s = 0.0

    def qdisc(self, side):
        """The root qdisc of a side's veth end as a dict (``tc -j qdisc show``), or None."""
        if not self.shaped:
            return None
        out = run_cmd(["tc", "-j", "-n", self.ns(side), "qdisc", "show", "dev",
                       self.dev(side)]).stdout
        for q in json.loads(out or "[]"):
            if q.get("root"):
                return q
        return None

    def qdisc_rate_bps(self, side):
        """The wire rate the kernel reports for a side (bit/s; htb: class 1:1 from ``tc
        class show``, tbf: ``tc -j qdisc show``), or None; compare with
        ``wire_rate_bps(rate)``. tc prints htb rates truncated to 4+ digits (<0.1 %)."""
        if not self.shaped:
            return None
        if self.qdisc_kind == "tbf":
            q = self.qdisc(side)
            return None if q is None else qdisc_rate_bps(q)
        out = run_cmd(["tc", "-n", self.ns(side), "class", "show", "dev", self.dev(side),
                       "classid", "1:1"]).stdout
        return parse_tc_rate_bps(out)

    # -- processes --------------------------------------------------------------------
    def run(self, side, argv, env=None, cpu_limit=None, **popen_kwargs):
        """Start ``argv`` in a side's network namespace; returns the Popen.

        The process enters only the network namespace (``nsenter --net``), not the
        mount namespace ``ip netns exec`` makes: that one remounts /sys, which hides
        /sys/fs/cgroup, so a robot under the testbed's CPU quota could not read its quota
        and keyed its profiles as a machine at full speed. ``env`` entries are added to
        this process's environment. With ``cpu_limit`` (an open
        :class:`~robot_offload.testbed.cgroup.CpuLimit`) the process is in that cgroup
        from its start, children included (a shell joins it, then execs ``nsenter``).
        The process gets its own session and is terminated (with its process group) by
        ``close()``.
        """
        self._require_open()
        _check_side(side)
        argv = [str(a) for a in argv]
        cmd = (["nsenter", f"--net={os.path.join(NETNS_DIR, self.ns(side))}", "--", *argv]
               if self.shaped else argv)
        return self._popen(cmd, env, cpu_limit, popen_kwargs)


class TraceReplayer(threading.Thread):
    """Applies a :class:`~robot_offload.testbed.traces.Trace` to a testbed, one rate per
    ``trace.step_s``, with ``tc class/qdisc change`` on both veth ends.

    ``applied`` holds (trace position in s, applied uplink bit/s) for every rate applied;
    ``error`` the TestbedError that stopped it, if any; ``late_steps`` how many steps were
    applied more than one step late. ``repeat`` plays the trace that many times. Use as a
    context manager (starts on enter, stops on exit) or start()/stop().

    :meth:`seek` moves the replay to another position at once (the rate there is applied
    now, the steps after it follow on time from there): the benchmark plays the same stretch
    of the trace to every mode's frame i, so that modes taking turns are compared under the
    same bandwidth, not at moments seconds apart (an outdoor fade lasts half a second).
    """

    def __init__(self, testbed, trace, *, repeat=1, clock=time.monotonic):
        super().__init__(name=f"TraceReplayer-{trace.name}", daemon=True)
        if repeat < 1:
            raise ValueError("repeat must be >= 1")
        self.testbed = testbed
        self.trace = trace
        self.repeat = int(repeat)
        self.applied = []
        self.error = None
        self.late_steps = 0
        self._clock = clock
        self._stop_event = threading.Event()
        self._moved = threading.Event()     # a seek: the thread recomputes its next step
        self._lock = threading.Lock()       # one tc change at a time; guards the fields below
        self._t0 = None                     # clock time of trace position 0
        self._next = 0                      # index of the next step to apply

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, exc_type, exc, tb):
        self.stop()
        return False

    def start(self):
        self.testbed._replayers.append(self)
        with self._lock:
            self._t0 = self._clock()
        super().start()

    def stop(self, timeout_s=5.0):
        """Stop applying rates and wait for the thread (the last rate stays applied)."""
        self._stop_event.set()
        self._moved.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout_s)
        if self in self.testbed._replayers:
            self.testbed._replayers.remove(self)

    @property
    def finished(self):
        return self.ident is not None and not self.is_alive()

    @property
    def steps(self):
        return self.repeat * len(self.trace.rates_bps)

    def seek(self, position_s):
        """Apply the trace's rate at ``position_s`` (seconds from the trace's start, within
        its ``repeat`` plays) now, and play on from there. Raises TestbedError when the
        rate cannot be applied, ValueError for a position outside the replay."""
        step = self.trace.step_s
        position_s = float(position_s)
        if not 0.0 <= position_s < self.steps * step:
            raise ValueError(f"position {position_s!r} s is outside the replay "
                             f"(0 to {self.steps * step:g} s)")
        k = min(int(position_s / step + 1e-9), self.steps - 1)
        with self._lock:
            self._apply(k, position_s)
            self._t0 = self._clock() - position_s
            self._next = k + 1
        self._moved.set()

    def _apply(self, k, position_s):
        """Apply step ``k`` (the caller holds the lock)."""
        rates = self.trace.rates_bps
        applied = self.testbed.set_rate(float(rates[k % len(rates)]))
        self.applied.append((position_s, applied))

    def run(self):
        step = self.trace.step_s
        while not self._stop_event.is_set():
            with self._lock:
                self._moved.clear()
                k = self._next
                if k >= self.steps:
                    return
                due = self._t0 + k * step
            if self._moved.wait(max(0.0, due - self._clock())):
                continue            # stopped, or sought elsewhere: recompute
            with self._lock:
                if self._next != k or self._t0 + k * step != due:
                    continue        # a seek came between the wait and the lock
                try:
                    self._apply(k, k * step)
                except TestbedError as e:
                    self.error = e
                    log.error("trace replay stopped: %s", e)
                    return
                self._next = k + 1
                if self._clock() - due > step:
                    self.late_steps += 1


# -- helpers ---------------------------------------------------------------------------
def _check_side(side):
    if side not in SIDES:
        raise ValueError(f"side must be one of {SIDES}, got {side!r}")
    return side


def _cannot_namespace():
    """Why namespaces cannot be used here, or None if they can (probably)."""
    if os.geteuid() != 0:
        return f"not root (uid {os.geteuid()}); network namespaces and tc need root"
    for tool, package in (("ip", "iproute2"), ("tc", "iproute2"), ("nsenter", "util-linux")):
        if shutil.which(tool) is None:
            return f"'{tool}' not found (install {package})"
    return None


def _stop_process_group(proc, grace_s=2.0):
    if proc.poll() is not None:
        return
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, grace_s)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        except PermissionError:
            proc.send_signal(sig)
        try:
            proc.wait(wait_s)
            return
        except subprocess.TimeoutExpired:
            continue
    log.error("process %d did not exit after SIGKILL", proc.pid)


def _kill_namespace_pids(ns, grace_s=1.0):
    """Kill, by pid, processes still inside a namespace this testbed created."""
    proc = run_cmd(["ip", "netns", "pids", ns], check=False)
    pids = [int(p) for p in proc.stdout.split() if p.isdigit() and int(p) != os.getpid()]
    if not pids:
        return
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(pid_alive(p) for p in pids):
        time.sleep(0.05)
    for pid in pids:
        if pid_alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def list_namespaces(prefix=PREFIX):
    """Names of existing namespaces that start with ``prefix-``."""
    if shutil.which("ip") is None:
        return []
    proc = run_cmd(["ip", "-j", "netns", "list"], check=False)
    try:
        entries = json.loads(proc.stdout or "[]")
    except ValueError:
        entries = [{"name": line.split()[0]} for line in proc.stdout.splitlines() if line]
    return [e["name"] for e in entries if e.get("name", "").startswith(prefix + "-")]


def cleanup_namespaces(prefix=PREFIX, *, include_live=False):
    """Delete namespaces left by dead testbed processes (all of them with include_live).

    Kills processes still inside them (started by that testbed) first. Returns the names
    removed."""
    removed = []
    for ns in list_namespaces(prefix):
        pid = owner_pid(ns)
        if pid is None or (not include_live and (pid == os.getpid() or pid_alive(pid))):
            continue
        _kill_namespace_pids(ns)
        run_cmd(["ip", "-n", ns, "link", "del", "veth-robot"], check=False)
        if run_cmd(["ip", "netns", "del", ns], check=False).returncode == 0:
            removed.append(ns)
    return removed


# -- process-wide safety net: atexit and SIGTERM/SIGHUP ---------------------------------
_open_testbeds = []
_saved_handlers = {}
_atexit_registered = []


def _register(tb):
    _open_testbeds.append(tb)
    if not _atexit_registered:
        atexit.register(_close_all)
        _atexit_registered.append(True)
    if threading.current_thread() is threading.main_thread() and not _saved_handlers:
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) == signal.SIG_DFL:
                _saved_handlers[sig] = signal.SIG_DFL
                signal.signal(sig, _exit_on_signal)


def _unregister(tb):
    if tb in _open_testbeds:
        _open_testbeds.remove(tb)
    if (not _open_testbeds and _saved_handlers
            and threading.current_thread() is threading.main_thread()):
        for sig, handler in _saved_handlers.items():
            if signal.getsignal(sig) is _exit_on_signal:
                signal.signal(sig, handler)
        _saved_handlers.clear()


def _exit_on_signal(signum, frame):
    # SystemExit unwinds through `with Testbed()` / finally blocks, which tear down.
    raise SystemExit(128 + signum)


def _close_all():
    for tb in list(_open_testbeds):
        try:
            tb.close()
        except Exception:  # noqa: BLE001 - interpreter exit: log and keep closing others
            log.exception("closing testbed %s at exit", tb.robot_ns)
