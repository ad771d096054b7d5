"""Many robots and the host on one machine: one network namespace per robot, each joined to
the host namespace (where the servers run) by its own shaped veth pair.

::

    with StarTestbed(3) as star:
        if not star.shaped:
            print("testbed:", star.reason)           # loopback, unshaped: say so
        srv = star.run_host([sys.executable, "-m", "my.server", "--host", star.server_ip])
        star.set_rate(0, 5e6)                         # robot 0: 5 Mbit/s both ways
        star.set_rate(1, 40e6, down_bps=80e6)         # robot 1: 40 up, 80 down
        cli = star.run(1, [sys.executable, "-m", "my.client", star.server_ip])
        with TraceReplayer(star.link(2), traces.outdoor()):
            ...

Layout (the star): the servers' address ``server_ip`` is a /32 on the host's ``lo``, so
one address is reachable from every robot namespace. Robot j has a /30 of the star's
subnet (a free /16 from 10.232.0.0 on, chosen at open; host end ``.4j+1``, robot end
``.4j+2``) on its veth pair and a default route through the host end. Nothing forwards
between robots (the host does not route): each robot reaches only the host.

Shaping is the two-namespace :class:`~robot_offload.testbed.netns.Testbed`'s, by the same
functions (:func:`~robot_offload.testbed.netns.shaping_batch`, ``wire_factor``, the 20 ms
bucket, the 8 KB GSO limit; see that module's docstring for the measured choices): an
``htb`` class on each veth end's egress, the robot end for the uplink and the host end for
the downlink, changed in place by ``set_rate`` so that trace replay keeps the queue and
the tokens. Rates are TCP goodput. :meth:`StarTestbed.link` gives a one-robot view with
the interface of a ``Testbed`` that :class:`~robot_offload.testbed.netns.TraceReplayer`
and :mod:`~robot_offload.testbed.bulk` use (``set_rate``, ``run("robot"|"server", ...)``,
``robot_ip``, ``server_ip``).

Without root, or where a namespace cannot be built, the star is plain loopback, unshaped
(``shaped`` False and ``reason`` says why), as a Testbed is; ``fallback=False`` raises
TestbedError instead. Callers that promise shaped links must refuse to run then.

Naming and cleanup follow the Testbed: robot j's namespace is ``rotb-<pid>-<seq>-robot``
with its veth end ``veth-robot`` inside (the host end goes with it), and ``server_ip`` is
labelled ``lo:rotb<pid>``. ``close()`` (context-manager exit, atexit, SIGTERM/SIGHUP)
removes everything; after a SIGKILL ``python -m robot_offload.testbed cleanup`` does
(:func:`cleanup_host_addresses` for the address on ``lo``).
"""

import ipaddress
import json
import logging
import os
import re
import shutil

from robot_offload.testbed._common import (
    PREFIX, TestbedError, pid_alive, run_cmd, unique_base)
from robot_offload.testbed.netns import (
    ETH_HEADER_BYTES, GSO_MAX_BYTES, NETNS_DIR, QDISCS,
    NamespaceLifecycle, _kill_namespace_pids, clamp_rate,
    parse_tc_rate_bps, shape_end, wire_factor)

log = logging.getLogger(__name__)

#: Subnets tried in turn for a star (the first that no host route overlaps).
CANDIDATE_SUBNETS = tuple(f"10.{b}.0.0/16" for b in range(232, 240))
#: Name of the robot's veth end inside its namespace (as the Testbed's, so that
#: cleanup_namespaces deletes it).
ROBOT_IF = "veth-robot"
#: Linux interface names (and address labels) are at most this long.
IFNAMSIZ = 15


def host_label(pid=None, prefix=PREFIX):
    """Label of the server address on ``lo``: ``lo:rotb<pid>`` (owner pid for cleanup)."""
    return f"lo:{prefix}{os.getpid() if pid is None else pid}"


def star_addresses(subnet, n_robots):
    """(server_ip, [(host end ip, robot end ip) per robot], prefix length of a robot's
    link) for a star in ``subnet``: robot j gets the j-th /30, the server the subnet's
    last host address. ValueError if the subnet is too small."""
    net = ipaddress.ip_network(subnet)
    if net.version != 4:
        raise ValueError(f"subnet must be IPv4, got {subnet}")
    if n_robots < 1:
        raise ValueError("a star needs at least one robot")
    if 4 * (n_robots + 1) > net.num_addresses:
        raise ValueError(f"subnet {subnet} holds fewer than {n_robots} robots and a server")
    base = int(net.network_address)
    pairs = [(str(ipaddress.ip_address(base + 4 * j + 1)),
              str(ipaddress.ip_address(base + 4 * j + 2))) for j in range(n_robots)]
    return str(net.broadcast_address - 1), pairs, 30


def free_subnet(candidates=CANDIDATE_SUBNETS):
    """The first candidate subnet that no route of the host namespace (any table)
    overlaps, or TestbedError. Another process may take it before this one does."""
    out = run_cmd(["ip", "-j", "-4", "route", "show", "table", "all"]).stdout
    used = []
    for route in json.loads(out or "[]"):
        dst = route.get("dst", "")
        if dst and dst != "default":
            try:
                used.append(ipaddress.ip_network(dst, strict=False))
            except ValueError:
                continue
    for cand in candidates:
        net = ipaddress.ip_network(cand)
        if not any(net.overlaps(u) for u in used):
            return cand
    raise TestbedError(f"every candidate subnet is in use: {', '.join(candidates)}")


class StarTestbed(NamespaceLifecycle):
    """``n_robots`` robot namespaces around the host namespace; see the module docstring.

    ``subnet`` (default: a free one of CANDIDATE_SUBNETS), ``latency_s``, ``mtu``,
    ``goodput``, ``qdisc`` and ``gso_max_bytes`` mean what they mean for a Testbed.
    ``rate_bps`` shapes every robot at open. Attributes: ``shaped``, ``reason``,
    ``n_robots``, ``server_ip``, ``namespaces`` (robot j's at j), ``host_ifs``,
    ``rates`` ([(up, down) bit/s or None] per robot).
    """

    __test__ = False  # not a pytest test class
    label = "star testbed"

    def __init__(self, n_robots, *, subnet=None, rate_bps=None, latency_s=0.2, mtu=1500,
                 goodput=True, qdisc="htb", gso_max_bytes=GSO_MAX_BYTES, fallback=True,
                 loopback=False, prefix=PREFIX):
        if qdisc not in QDISCS:
            raise ValueError(f"unknown qdisc {qdisc!r}; supported: {', '.join(QDISCS)}")
        self.n_robots = int(n_robots)
        if subnet is not None:
            star_addresses(subnet, self.n_robots)   # ValueError now, not at open
        elif self.n_robots < 1:
            raise ValueError("a star needs at least one robot")
        self._subnet = subnet
        self.subnet = None
        self.latency_s = float(latency_s)
        self.mtu = int(mtu)
        self.goodput = bool(goodput)
        self.qdisc_kind = qdisc
        gso_max_bytes = int(gso_max_bytes or 0)
        self.gso_max_bytes = gso_max_bytes if gso_max_bytes > self.mtu + ETH_HEADER_BYTES else 0
        self._want_rate = rate_bps
        self._fallback = fallback
        self._loopback = loopback
        self._prefix = prefix
        self.namespaces = [f"{unique_base(prefix)}-robot" for _ in range(self.n_robots)]
        # host ends: "rs<pid>-<seq>" of the robot's namespace (unique on the host)
        self.host_ifs = ["rs" + ns[len(prefix) + 1:-len("-robot")] for ns in self.namespaces]
        too_long = [n for n in self.host_ifs if len(n) > IFNAMSIZ]
        if too_long:
            raise TestbedError(f"interface names too long: {too_long}")
        self._server_ip = None
        self._pairs = []
        self._lo_addr = None
        self._init_lifecycle()
        self.rates = [None] * self.n_robots
        self._trees = {}

    # -- addresses --------------------------------------------------------------------
    @property
    def server_ip(self):
        """The servers' address, reachable from every robot namespace (127.0.0.1 when
        unshaped)."""
        return self._server_ip if self.shaped else "127.0.0.1"

    def robot_ip(self, j):
        """Robot j's address (its veth end; 127.0.0.1 when unshaped)."""
        self._check_robot(j)
        return self._pairs[j][1] if self.shaped else "127.0.0.1"

    def host_ip(self, j):
        """The host end of robot j's link (its default gateway), or None when unshaped."""
        self._check_robot(j)
        return self._pairs[j][0] if self.shaped else None

    @property
    def robot_ns(self):
        """The robots' namespaces in one string (what the shared exit handler logs)."""
        return ",".join(self.namespaces)

    def wire_rate_bps(self, rate_bps):
        """The qdisc rate used for a requested (clamped) goodput rate."""
        return clamp_rate(rate_bps) * (wire_factor(self.mtu) if self.goodput else 1.0)

    def link(self, j):
        """A one-robot view of the star with a Testbed's interface (see :class:`StarLink`)."""
        self._check_robot(j)
        return StarLink(self, j)

    # -- lifecycle (NamespaceLifecycle's open and close) ---------------------------------
    def _describe(self):
        return (f"{self.n_robots} robot namespaces ({self.namespaces[0]}, ...) on veth links to "
                f"the host, subnet {self.subnet}, servers at {self._server_ip}, "
                f"{self.qdisc_kind} rate limit each way")

    def _apply_wanted(self):
        if self._want_rate is not None:
            for j in range(self.n_robots):
                self.set_rate(j, self._want_rate)

    def _build(self):
        self.subnet = self._subnet or free_subnet()
        self._server_ip, self._pairs, plen = star_addresses(self.subnet, self.n_robots)
        run_cmd(["ip", "addr", "add", f"{self._server_ip}/32", "dev", "lo",
                 "label", host_label(prefix=self._prefix)])
        self._lo_addr = self._server_ip
        for j, (ns, host_if) in enumerate(zip(self.namespaces, self.host_ifs)):
            host_ip, robot_ip = self._pairs[j]
            run_cmd(["ip", "netns", "add", ns])
            self._created_ns.append(ns)
            run_cmd(["ip", "link", "add", host_if, "type", "veth", "peer", "name", ROBOT_IF,
                     "netns", ns])
            run_cmd(["ip", "-n", ns, "link", "set", "lo", "up"])
            for pre, dev, addr in ((["ip"], host_if, host_ip),
                                   (["ip", "-n", ns], ROBOT_IF, robot_ip)):
                run_cmd([*pre, "link", "set", dev, "mtu", str(self.mtu)])
                if self.gso_max_bytes:
                    run_cmd([*pre, "link", "set", dev, "gso_max_size", str(self.gso_max_bytes)])
                else:
                    run_cmd([*pre, "link", "set", dev, "gso_max_segs", "1"])
                run_cmd([*pre, "addr", "add", f"{addr}/{plen}", "dev", dev])
                run_cmd([*pre, "link", "set", dev, "up"])
            run_cmd(["ip", "-n", ns, "route", "add", "default", "via", host_ip])

    def _teardown(self):
        self._stop_started()
        for ns in self._created_ns:
            _kill_namespace_pids(ns)
        for ns in reversed(self._created_ns):
            # Deleting one veth end deletes its peer (the host end).
            run_cmd(["ip", "-n", ns, "link", "del", ROBOT_IF], check=False)
            proc = run_cmd(["ip", "netns", "del", ns], check=False)
            if proc.returncode != 0:
                log.error("could not delete namespace %s: %s", ns, proc.stderr.strip())
        self._created_ns.clear()
        if self._lo_addr is not None:
            proc = run_cmd(["ip", "addr", "del", f"{self._lo_addr}/32", "dev", "lo"],
                           check=False)
            if proc.returncode != 0:
                log.error("could not remove %s from lo: %s", self._lo_addr,
                          proc.stderr.strip())
            self._lo_addr = None
        self._trees.clear()

    # -- shaping ----------------------------------------------------------------------
    def set_rate(self, j, up_bps, down_bps=None):
        """Shape robot j's uplink (its veth end's egress) to ``up_bps`` and downlink (the
        host end's egress) to ``down_bps`` (default: the same), TCP goodput in bit/s.
        Returns the uplink rate applied (clamped). The first call builds the qdiscs, later
        ones change them in place."""
        self._check_robot(j)
        up = clamp_rate(up_bps)
        down = clamp_rate(up_bps if down_bps is None else down_bps)
        with self._lock:
            self._require_open()
            if self.shaped:
                self._shape(j, "robot", up)
                self._shape(j, "host", down)
            self.rates[j] = (up, down)
        return up

    def _tc(self, j, side):
        """(tc command prefix, device) of robot j's link end on ``side``."""
        if side == "robot":
            return ["tc", "-n", self.namespaces[j]], ROBOT_IF
        return ["tc"], self.host_ifs[j]

    def _shape(self, j, side, rate_bps):
        tc, dev = self._tc(j, side)
        shape_end(tc, dev, self.wire_rate_bps(rate_bps), self._trees, (j, side), self.qdisc_kind,
                  qdisc=self.qdisc_kind, latency_s=self.latency_s, mtu=self.mtu,
                  gso_max_bytes=self.gso_max_bytes)

    def clear_rate(self, j):
        """Remove robot j's shaping in both directions."""
        self._check_robot(j)
        with self._lock:
            self._require_open()
            if self.shaped:
                for side in ("robot", "host"):
                    tc, dev = self._tc(j, side)
                    run_cmd([*tc, "qdisc", "del", "dev", dev, "root"], check=False)
                    self._trees.pop((j, side), None)
            self.rates[j] = None

    def qdisc_rate_bps(self, j, side="robot"):
        """The wire rate the kernel reports for robot j's ``side`` ("robot": uplink,
        "host": downlink) in bit/s, or None; compare with ``wire_rate_bps(rate)``."""
        self._check_robot(j)
        if not self.shaped:
            return None
        tc, dev = self._tc(j, side)
        if self.qdisc_kind == "tbf":
            out = run_cmd([*tc, "qdisc", "show", "dev", dev, "root"]).stdout
        else:
            out = run_cmd([*tc, "class", "show", "dev", dev, "classid", "1:1"]).stdout
        return parse_tc_rate_bps(out)

    # -- processes --------------------------------------------------------------------
    def run(self, j, argv, env=None, cpu_limit=None, **popen_kwargs):
        """Start ``argv`` in robot j's network namespace (``nsenter --net``, as
        ``Testbed.run``: /sys stays the host's); returns the Popen. ``env`` entries are
        added to this process's environment; ``cpu_limit`` an open CpuLimit to start in.
        The process gets its own session and is stopped by ``close()``."""
        self._check_robot(j)
        self._require_open()
        argv = [str(a) for a in argv]
        cmd = (["nsenter", f"--net={os.path.join(NETNS_DIR, self.namespaces[j])}", "--",
                *argv] if self.shaped else argv)
        return self._popen(cmd, env, cpu_limit, popen_kwargs)

    def run_host(self, argv, env=None, cpu_limit=None, **popen_kwargs):
        """Start ``argv`` in the host namespace (a server), stopped by ``close()``."""
        self._require_open()
        return self._popen([str(a) for a in argv], env, cpu_limit, popen_kwargs)

    def _check_robot(self, j):
        if not (isinstance(j, int) and 0 <= j < self.n_robots):
            raise ValueError(f"robot index must be 0..{self.n_robots - 1}, got {j!r}")


class StarLink:
    """Robot j's link of a :class:`StarTestbed`, with the parts of a Testbed's interface
    that :class:`~robot_offload.testbed.netns.TraceReplayer` and the
    :mod:`~robot_offload.testbed.bulk` measurements use: ``set_rate(bps, down_bps=None)``,
    ``run("robot"|"server", argv, ...)`` (robot j's namespace, or the host's),
    ``robot_ip``, ``server_ip``, ``shaped``, ``reason``, ``rate_bps``, ``down_bps``.
    Replayers started on it are stopped by the star's ``close()``."""

    def __init__(self, star, j):
        self.star = star
        self.j = j

    def __repr__(self):
        return f"StarLink(robot {self.j} of {self.star.robot_ns})"

    @property
    def _replayers(self):           # TraceReplayer registers itself here
        return self.star._replayers

    @property
    def shaped(self):
        return self.star.shaped

    @property
    def reason(self):
        return self.star.reason

    @property
    def robot_ip(self):
        return self.star.robot_ip(self.j)

    @property
    def server_ip(self):
        return self.star.server_ip

    @property
    def rate_bps(self):
        rates = self.star.rates[self.j]
        return None if rates is None else rates[0]

    @property
    def down_bps(self):
        rates = self.star.rates[self.j]
        return None if rates is None else rates[1]

    def set_rate(self, bits_per_s, *, down_bps=None):
        return self.star.set_rate(self.j, bits_per_s, down_bps=down_bps)

    def wire_rate_bps(self, rate_bps):
        return self.star.wire_rate_bps(rate_bps)

    def qdisc_rate_bps(self, side="robot"):
        return self.star.qdisc_rate_bps(self.j, "robot" if side == "robot" else "host")

    def run(self, side, argv, env=None, **popen_kwargs):
        if side == "robot":
            return self.star.run(self.j, argv, env=env, **popen_kwargs)
        if side == "server":
            return self.star.run_host(argv, env=env, **popen_kwargs)
        raise ValueError(f"side must be 'robot' or 'server', got {side!r}")


def list_host_addresses(prefix=PREFIX):
    """[(address/prefixlen, owner pid)] of the star server addresses on the host's ``lo``."""
    if shutil.which("ip") is None:
        return []
    proc = run_cmd(["ip", "-j", "-4", "addr", "show", "dev", "lo"], check=False)
    try:
        entries = json.loads(proc.stdout or "[]")
    except ValueError:
        return []
    label_re = re.compile(r"^lo:" + re.escape(prefix) + r"(\d+)$")
    found = []
    for entry in entries:
        for info in entry.get("addr_info", []):
            m = label_re.match(info.get("label", ""))
            if m:
                found.append((f"{info['local']}/{info['prefixlen']}", int(m.group(1))))
    return found


def cleanup_host_addresses(prefix=PREFIX, *, include_live=False):
    """Remove star server addresses left on ``lo`` by dead processes (all of them with
    include_live). Returns the addresses removed. (A dead star's namespaces, and with them
    its veth pairs, go with :func:`~robot_offload.testbed.netns.cleanup_namespaces`.)"""
    removed = []
    for addr, pid in list_host_addresses(prefix):
        if not include_live and (pid == os.getpid() or pid_alive(pid)):
            continue
        if run_cmd(["ip", "addr", "del", addr, "dev", "lo"], check=False).returncode == 0:
            removed.append(addr)
    return removed
