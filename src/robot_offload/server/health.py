"""The offload server's health report, independent of ROS (see :mod:`robot_offload.health`).

:class:`ServerHealth` turns :meth:`OffloadServer.activity` snapshots into a
:class:`~robot_offload.health.Report`: clients, requests served and refused (in all and in
the last ``window_s``), requests in flight, the compute slots and each recent client's
share of them (served, refused, dropped, mean wait and compute), operator sandboxes or sessions, the device and
its memory. Levels: WARN when, in the window, requests were refused as ``BUSY`` (a bound
reached: sandboxes, sessions, compute budgets, GPU memory), failed inside the server
(``INTERNAL``) or were refused for authentication or allow lists (``UNAUTHORIZED``: a
misconfigured or unknown client); when an operator sandbox crashed or was stopped, when
every sandbox is taken, and when GPU memory is nearly full.
"""

import collections
import time
from typing import Callable, Optional

import torch

from robot_offload.health import WARN, Report

#: refusals that say something is wrong (others, e.g. MODEL_NOT_LOADED after a restart or
#: STALE_HANDLE, are the protocol working as designed)
_WARN_REFUSALS = {
    "BUSY": "refused as BUSY (a bound reached: sandboxes, sessions, compute budget or GPU memory)",
    "INTERNAL": "failed inside the server (see its log)",
    "UNAUTHORIZED": "refused: authentication or allow lists (a client's key or client_models?)",
}


def device_memory(device: torch.device) -> dict:
    """``{"allocated_mb", "reserved_mb", "free_mb", "total_mb"}`` of a CUDA device; {} on CPU."""
    if device.type != "cuda":
        return {}
    free, total = torch.cuda.mem_get_info(device)
    return {"allocated_mb": torch.cuda.memory_allocated(device) / 2 ** 20,
            "reserved_mb": torch.cuda.memory_reserved(device) / 2 ** 20,
            "free_mb": free / 2 ** 20, "total_mb": total / 2 ** 20}


class ServerHealth:
    def __init__(self, window_s: float = 60.0, gpu_warn: float = 0.95,
                 clock: Callable[[], float] = time.monotonic):
        self.window_s = float(window_s)
        self.gpu_warn = gpu_warn
        self.clock = clock
        self._history = collections.deque()     # (t, requests, refused counts, executors)

    def _baseline(self, now: float, snapshot: dict):
        """The oldest snapshot within the window (this one when it is the first)."""
        self._history.append((now, snapshot))
        while len(self._history) > 1 and now - self._history[1][0] >= self.window_s:
            self._history.popleft()
        return self._history[0][1]

    def report(self, activity: dict, memory: Optional[dict] = None,
               now: Optional[float] = None) -> Report:
        now = self.clock() if now is None else now
        base = self._baseline(now, activity)
        w = f"last {self.window_s:.0f} s"
        served = activity["requests"] - base["requests"]
        r = Report(f"serving {activity['clients']} client(s) on {activity['device']}, "
                   f"{served} requests in the {w}")
        r.add("server id", activity.get("server_id")).add("device", activity["device"])
        r.add("models loaded", activity["models"])
        r.add(f"clients (requests in the last {activity.get('client_window_s', self.window_s):.0f} s)",
              activity["clients"])
        r.add("requests (total)", activity["requests"]).add(f"requests ({w})", served)
        r.add("refused (total)", activity["failed"])
        refused = activity["refused"]
        r.add("refused by status (total)",
              ", ".join(f"{k} {v}" for k, v in sorted(refused.items())) or "none")
        r.add("requests in flight", activity["in_flight"])
        for name, why in _WARN_REFUSALS.items():
            n = refused.get(name, 0) - base["refused"].get(name, 0)
            if n > 0:
                r.flag(WARN, f"{n} request{'' if n == 1 else 's'} {why} in the {w}")
        compute = activity.get("compute")
        if compute:
            r.add("compute slots busy", f"{compute['running']} of {compute['slots']}")
            r.add("requests waiting for a slot", compute["queued"])
            for client, f in compute["clients"].items():
                r.add(f"client {client}", (
                    f"{f['served']} served, {f['busy']} refused BUSY, {f['dropped']} dropped at their "
                    f"deadline; wait {1e3 * f['mean_wait_s']:.1f} ms, compute {1e3 * f['mean_compute_s']:.1f} ms"))
        for entry, figures in sorted(activity.get("executors", {}).items()):
            self._executor(r, entry, figures, base.get("executors", {}).get(entry, {}), w)
        for key, value in (memory or {}).items():
            r.add(f"GPU memory {key.replace('_mb', '')} (MB)", value)
        if memory and memory.get("total_mb"):
            used = 1.0 - memory["free_mb"] / memory["total_mb"]
            if used >= self.gpu_warn:
                r.flag(WARN, f"GPU memory {100 * used:.0f} % used")
        return r

    @staticmethod
    def _executor(r: Report, entry: str, now: dict, before: dict, w: str) -> None:
        if "sandboxes" in now:
            r.add(f"{entry}: sandboxes", f"{now['sandboxes']} of {now['max_sandboxes']}")
            r.add(f"{entry}: sandboxes crashed, stopped (total)", f"{now['crashed']}, {now['stopped']}")
            r.add(f"{entry}: spare sandbox ready", now.get("spare ready"))
            crashed = now["crashed"] - before.get("crashed", now["crashed"])
            stopped = now["stopped"] - before.get("stopped", now["stopped"])
            if crashed or stopped:
                r.flag(WARN, f"{crashed + stopped} operator sandbox(es) ended under a request in the "
                             f"{w} ({crashed} crashed, {stopped} ran past max_request_s)")
            if now["sandboxes"] >= now["max_sandboxes"]:
                r.flag(WARN, f"every operator sandbox is taken ({now['max_sandboxes']}, "
                             "max_sandboxes): a new client is refused")
        if "sessions" in now:
            r.add(f"{entry}: sessions", f"{now['sessions']} of {now['max_sessions']}")
