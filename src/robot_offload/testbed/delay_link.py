"""A point-to-point link with a fixed one-way delay, for kernels without ``netem``.

The development machine's kernel has no netem and cannot load modules, so the usual way of
adding delay (a ``netem delay`` qdisc) is missing. TUN devices work there. This module
joins the two testbed namespaces with a pair of TUN devices instead of a veth pair. A
relay process holds both devices' file descriptors and forwards every IP packet from one
to the other once ``delay_s`` has passed since it read the packet:

::

    robot ns                      host (this process)                     server ns
    tun-robot --egress htb-->  read -> DelayLine(delay_s) -> write  --> tun-server
    tun-robot <--  write <- DelayLine(delay_s) <- read  <--egress htb-- tun-server

Rate shaping is unchanged: the ``htb`` qdiscs sit on each TUN device's egress, as they do on
the veth ends, so a packet is first paced by the rate, then delayed. This is the order of a
``netem`` leaf under the rate class. The kernel still does all of TCP/IP. Only the hop
between the two devices is in user space, so RTT = 2 x ``delay_s`` + the relay's own cost
(about 0.1-0.4 ms on the 2-core VM, measured in the tests and printed by the bench as
request RTT).

Why a separate process: the relay must wake within a fraction of a millisecond. In the
benchmark driver's process it would wait for the GIL behind the driver's threads. It exits
when its stdin closes, so a killed driver cannot leave it forwarding. Its TUN devices go
away with it.

Command (what :class:`~robot_offload.testbed.netns.Testbed` starts with ``link="tun"``)::

    python -m robot_offload.testbed.delay_link NAME_A NAME_B --delay-s 0.001

It creates the two devices in the current namespace and prints ``ready``; the caller then
moves them into the namespaces. Lines on stdin: ``delay <seconds>`` changes the delay of
packets read from then on. End of input stops it, and it prints its counters as one JSON
line on stdout.
"""

import argparse
import collections
import ctypes
import fcntl
import json
import math
import os
import select
import struct
import sys
import time

#: ioctl and flags from <linux/if_tun.h>.
TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
#: prctl option from <linux/prctl.h>.
PR_SET_TIMERSLACK = 29
#: Largest IP packet a TUN device hands over (bytes).
MAX_PACKET_BYTES = 65535
#: Packets a direction may hold in flight before it drops (a full queue, as on a router).
#: At 200 Mbit/s and 1500-byte packets this is over 1 s of traffic; the htb queue in front
#: holds far less.
MAX_QUEUED_PACKETS = 20000
#: Largest delay accepted (s); a typo like 1000 would otherwise stall the link for minutes.
MAX_DELAY_S = 10.0


def check_delay(delay_s):
    """``delay_s`` as a float in [0, MAX_DELAY_S]; ValueError otherwise."""
    value = float(delay_s)
    if not math.isfinite(value) or value < 0 or value > MAX_DELAY_S:
        raise ValueError(f"delay must be in [0, {MAX_DELAY_S}] s, got {delay_s!r}")
    return value


class DelayLine:
    """Packets of one direction, each released ``delay_s`` after it was pushed.

    The delay is the same for every packet pushed under it, so due times only grow and a
    FIFO is enough. When the delay shrinks, a packet is never released before the packets
    that were pushed ahead of it, so order is kept (TCP sees no reordering, as with netem's
    default). Pure: the caller passes the clock."""

    def __init__(self, delay_s, max_packets=MAX_QUEUED_PACKETS):
        self.delay_s = check_delay(delay_s)
        self.max_packets = int(max_packets)
        self._queue = collections.deque()
        self.forwarded = 0
        self.dropped = 0

    def __len__(self):
        return len(self._queue)

    def push(self, now, packet):
        """Queue ``packet`` read at ``now``; False (and counted) when the queue is full."""
        if len(self._queue) >= self.max_packets:
            self.dropped += 1
            return False
        due = now + self.delay_s
        if self._queue and due < self._queue[-1][0]:
            due = self._queue[-1][0]
        self._queue.append((due, packet))
        return True

    def next_due(self):
        """When the oldest packet is due (clock of ``push``), or None when empty."""
        return self._queue[0][0] if self._queue else None

    def pop_due(self, now):
        """The packets due at ``now``, oldest first."""
        out = []
        while self._queue and self._queue[0][0] <= now:
            out.append(self._queue.popleft()[1])
        return out


def open_tun(name):
    """A non-blocking fd for a new TUN device ``name`` (raw IP packets, no header)."""
    if not name or len(name) > 15:
        raise ValueError(f"interface names are 1-15 characters, got {name!r}")
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)  # novm: flags, not a union type
    try:
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    return fd


def relay(fd_a, fd_b, delay_s, control=None, clock=time.monotonic):
    """Forward packets between two TUN fds, each after ``delay_s``, until ``control`` (an
    fd carrying ``delay <s>`` lines) reaches end of input. Returns the counters."""
    lines = {fd_a: DelayLine(delay_s), fd_b: DelayLine(delay_s)}  # keyed by source fd
    peer = {fd_a: fd_b, fd_b: fd_a}
    write_errors = 0
    pending = b""
    watch = [fd_a, fd_b] + ([control] if control is not None else [])
    while True:
        now = clock()
        due = [d for d in (lines[fd_a].next_due(), lines[fd_b].next_due()) if d is not None]
        timeout = None if not due else max(0.0, min(due) - now)
        readable, _, _ = select.select(watch, [], [], timeout)
        for src in (fd_a, fd_b):
            if src not in readable:
                continue
            # Drain what is there: one select per packet would cost more than the packet.
            while True:
                try:
                    packet = os.read(src, MAX_PACKET_BYTES)
                except BlockingIOError:
                    break
                except OSError:  # device going away: nothing more to read now
                    break
                lines[src].push(clock(), packet)
        if control is not None and control in readable:
            chunk = os.read(control, 4096)
            if not chunk:
                break
            pending += chunk
            while b"\n" in pending:
                text, pending = pending.split(b"\n", 1)
                parts = text.decode(errors="replace").split()
                if len(parts) != 2 or parts[0] != "delay":
                    print(f"delay_link: ignored control line {text!r}", file=sys.stderr,
                          flush=True)
                    continue
                try:
                    value = check_delay(parts[1])
                except ValueError as e:
                    print(f"delay_link: {e}", file=sys.stderr, flush=True)
                else:
                    lines[fd_a].delay_s = lines[fd_b].delay_s = value
        now = clock()
        for src, line in lines.items():
            for packet in line.pop_due(now):
                try:
                    os.write(peer[src], packet)
                    line.forwarded += 1
                except OSError:  # device down or gone: the packet is lost, as on a wire
                    write_errors += 1
    return {"a_to_b": lines[fd_a].forwarded, "b_to_a": lines[fd_b].forwarded,
            "dropped": lines[fd_a].dropped + lines[fd_b].dropped,
            "write_errors": write_errors}


def tighten_timer_slack():
    """Ask the kernel to wake this thread on time (1 ns timer slack instead of 50 us).

    select() sleeps end at the timeout plus the thread's timer slack plus scheduling;
    without this the relay added about 0.15 ms to each hop's delay. Best effort: True if
    the kernel accepted it."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_TIMERSLACK, ctypes.c_ulong(1), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m robot_offload.testbed.delay_link",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("name_a")
    ap.add_argument("name_b")
    ap.add_argument("--delay-s", type=check_delay, default=0.0, help="one-way delay (s)")
    args = ap.parse_args(argv)
    tighten_timer_slack()
    fd_a = open_tun(args.name_a)
    fd_b = open_tun(args.name_b)
    print("ready", flush=True)
    counters = relay(fd_a, fd_b, args.delay_s, control=sys.stdin.fileno())
    try:
        print(json.dumps(counters), flush=True)
    except OSError:  # the testbed (our stdout) is gone: nobody to tell
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
