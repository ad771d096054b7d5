"""The testbed: robot and server network namespaces on one machine, a shaped link replaying
bandwidth traces, and a CPU quota that slows the robot's compute (DESIGN.md section 6).

Pure Python (no rospy). ``python -m robot_offload.testbed selfcheck|cleanup|traces``.
"""

from robot_offload.testbed._common import PREFIX, TestbedError
from robot_offload.testbed.cgroup import (
    CpuLimit, Mechanism, available as cgroup_available, choose_mechanism, threads_for_ratio)
from robot_offload.testbed.netns import (
    MIN_RATE_BPS, Testbed, TraceReplayer, cleanup_namespaces, list_namespaces)
from robot_offload.testbed.star import StarLink, StarTestbed, cleanup_host_addresses
from robot_offload.testbed.traces import (
    Trace, constant, indoor, load_csv, load_iperf3_json, outdoor, to_csv)

__all__ = [
    "PREFIX", "TestbedError", "CpuLimit", "Mechanism", "cgroup_available",
    "choose_mechanism", "threads_for_ratio", "MIN_RATE_BPS", "Testbed", "TraceReplayer",
    "cleanup_namespaces", "list_namespaces", "StarTestbed", "StarLink",
    "cleanup_host_addresses", "Trace", "constant", "indoor", "outdoor",
    "load_csv", "load_iperf3_json", "to_csv", "cleanup",
]


def cleanup(*, include_live=False):
    """Remove stale testbed namespaces, star server addresses on ``lo`` and cgroups (of dead
    processes, or all), and put back the CFS bandwidth slice a dead run left changed.

    Returns {"namespaces": [...], "host_addrs": [...], "cgroups": [...]} removed, and
    "slice": the CFS bandwidth slice put back where a dead run had left it at 1 ms (None:
    none was)."""
    from robot_offload.testbed.cgroup import cleanup_cgroups, restore_slice

    removed = {"namespaces": cleanup_namespaces(include_live=include_live),
               "host_addrs": cleanup_host_addresses(include_live=include_live),
               "cgroups": cleanup_cgroups(include_live=include_live)}
    try:
        removed["slice"] = restore_slice(include_live=include_live)
    except OSError:   # not root or a read-only /proc/sys: nothing of ours to put back
        removed["slice"] = None
    return removed
