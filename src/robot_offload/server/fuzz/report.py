"""Driving the fuzz against a server and reporting it: the process watch (RSS of the node
and its sandboxes), the tally per status, kind and refusal reason, and :func:`run_fuzz`."""

import json
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional


from robot_offload.protocol import ComputeResponse, StatusCode
from robot_offload.protocol import LoadModelRequest, PingRequest
from robot_offload.server.fuzz.requests import FuzzRequest, make_request, request_strategy
from robot_offload.server.fuzz.state import FUZZ_CONFIG, FuzzState, catalog
from robot_offload.server.fuzz.valid_client import ValidClient

# -- watching the server's processes -------------------------------------------------------------
class ProcessWatch:
    """The server node's process and its sandbox workers (its children): whether it is
    alive and still the same process, and the RSS of it and of its children together."""

    def __init__(self, pid: int):
        import psutil
        self.psutil = psutil
        self.pid = pid
        self.proc = psutil.Process(pid)
        self.created = self.proc.create_time()

    def alive(self) -> bool:
        try:
            return self.proc.is_running() and self.proc.create_time() == self.created
        except self.psutil.Error:
            return False

    def sample(self) -> dict:
        """{"alive", "server_rss_mb", "sandbox_rss_mb" (sum over children), "sandbox_max_mb"
        (the largest child), "sandboxes" (their count)}."""
        if not self.alive():
            return {"alive": False}
        try:
            rss = self.proc.memory_info().rss
            kids = []
            for c in self.proc.children(recursive=True):
                try:
                    kids.append(c.memory_info().rss)
                except self.psutil.Error:
                    continue
        except self.psutil.Error:
            return {"alive": False}
        mb = 2 ** 20
        return {"alive": True, "server_rss_mb": rss / mb, "sandbox_rss_mb": sum(kids) / mb,
                "sandbox_max_mb": max(kids, default=0) / mb, "sandboxes": len(kids)}


# -- the run --------------------------------------------------------------------------------------
@dataclass
class FuzzReport:
    """What a fuzz run saw; :meth:`problems` lists what breaks the server's promises."""
    requests: int = 0
    by_status: Counter = field(default_factory=Counter)
    by_kind: Counter = field(default_factory=Counter)
    by_reason: Counter = field(default_factory=Counter)      # refusals by :func:`refusal_reason`
    reason_examples: Dict[str, str] = field(default_factory=dict)   # reason -> its first status_text
    ok_by_kind: Counter = field(default_factory=Counter)
    weight_writes_refused: int = 0
    weight_writes_allowed: List[str] = field(default_factory=list)   # writes into registry weights answered OK
    internal: List[str] = field(default_factory=list)        # INTERNAL answers: request and text
    errors: List[str] = field(default_factory=list)          # exceptions instead of answers
    sandbox_crashes: List[str] = field(default_factory=list)  # workers that died under a request
    sandbox_kills: int = 0                                    # requests past max_request_s
    valid_checks: int = 0
    valid_passed: int = 0
    valid_failures: List[str] = field(default_factory=list)
    pings_failed: int = 0
    restarts: int = 0                                         # the server process changed or died
    server_rss_mb: List[float] = field(default_factory=list)  # [first, max]
    sandbox_rss_mb: List[float] = field(default_factory=list)  # sum over sandboxes: [first, max]
    sandbox_max_mb: float = 0.0                               # the largest single sandbox
    max_sandboxes: int = 0
    wall_s: float = 0.0

    def note(self, sample: dict) -> None:
        if not sample.get("alive"):
            self.restarts += 1
            return
        for key in ("server_rss_mb", "sandbox_rss_mb"):
            figs = getattr(self, key)
            if not figs:
                figs[:] = [sample[key], sample[key]]
            figs[1] = max(figs[1], sample[key])
        self.sandbox_max_mb = max(self.sandbox_max_mb, sample["sandbox_max_mb"])
        self.max_sandboxes = max(self.max_sandboxes, sample["sandboxes"])

    def problems(self) -> List[str]:
        out = []
        if self.internal:
            out.append(f"{len(self.internal)} INTERNAL answers, e.g. {self.internal[0]}")
        if self.errors:
            out.append(f"{len(self.errors)} requests raised instead of answering, e.g. {self.errors[0]}")
        if self.restarts:
            out.append(f"the server process died or changed {self.restarts} times")
        if self.pings_failed:
            out.append(f"{self.pings_failed} pings failed")
        if self.weight_writes_allowed:
            out.append(f"{len(self.weight_writes_allowed)} writes into registry weights were answered OK, "
                       f"e.g. {self.weight_writes_allowed[0]}")
        if self.valid_failures or self.valid_passed < self.valid_checks:
            out.append(f"the valid client failed {self.valid_checks - self.valid_passed} of "
                       f"{self.valid_checks} checks, e.g. {self.valid_failures[:1]}")
        return out

    def table(self) -> str:
        rows = [("requests sent", self.requests)]
        rows += [(f"  {StatusCode(code).name}", n) for code, n in sorted(self.by_status.items())]
        ok = self.by_status.get(int(StatusCode.OK), 0)
        rows.append(("OK rate", "%.1f %%" % (100.0 * ok / max(1, self.requests))))
        rows += [(f"  kind {k} (OK)", f"{n} ({self.ok_by_kind.get(k, 0)})") for k, n in sorted(self.by_kind.items())]
        rows += [(f"  refused: {k}", n) for k, n in sorted(self.by_reason.items(), key=lambda kv: -kv[1])]
        rows += [("registry-weight writes refused", self.weight_writes_refused),
                 ("registry-weight writes answered OK", len(self.weight_writes_allowed))]
        rows += [("exceptions (no answer)", len(self.errors)),
                 ("sandbox crashes (contained)", len(self.sandbox_crashes)),
                 ("sandbox kills (max_request_s)", self.sandbox_kills),
                 ("server RSS MiB (first / max)", "%.0f / %.0f" % tuple(self.server_rss_mb or (0, 0))),
                 ("sandboxes RSS MiB, sum (first / max)", "%.0f / %.0f" % tuple(self.sandbox_rss_mb or (0, 0))),
                 ("largest sandbox RSS MiB", "%.0f" % self.sandbox_max_mb),
                 ("sandboxes at once (max)", self.max_sandboxes),
                 ("valid-client checks passed", f"{self.valid_passed} / {self.valid_checks}"),
                 ("pings failed", self.pings_failed),
                 ("server restarts", self.restarts),
                 ("wall time s", "%.0f" % self.wall_s)]
        width = max(len(r[0]) for r in rows)
        return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


#: (text in a refusal's status_text, short reason), first match wins
REASONS = (
    ("max_session_mib", "max_session_mib"), ("max_client_mib", "max_client_mib"),
    ("max_request_gflop", "max_request_gflop"), ("client_gflop_per_s", "client_gflop_per_s"),
    ("max_sandboxes", "max_sandboxes"), ("max_request_s", "max_request_s"),
    ("max_request_bytes", "max_request_bytes"), ("max_sessions", "max_sessions"),
    ("another client", "another client"), ("shares with every client", "registry weight write"),
    ("allow-list", "allow-list"), ("sandbox of this client stopped", "sandbox crash"),
    ("unknown tensor handle", "unknown handle"), ("unknown session", "unknown session"),
    ("unknown sequence", "unknown sequence"), ("no replay of", "no stopped replay"),
    ("size symbol", "size symbol"), (" failed: ", "operator failed"), ("upload", "upload"),
    ("not JSON", "bad JSON"), ("args_json must be", "bad JSON"), ("reference", "bad reference"),
    ("replay", "bad replay"), ("define", "bad define"), ("elements", "max_input_elements"),
    ("not allowed", "argument not allowed"), ("unknown entry", "unknown entry"),
)


def refusal_reason(code: int, text: str) -> str:
    """A short reason for a refusal (a status other than OK) from its status text."""
    for needle, reason in REASONS:
        if needle in text:
            return reason
    return f"other {StatusCode(code).name}"


class _Tally:
    """Sends a generated request (``repeat`` times) and counts what came back."""

    def __init__(self, send: Callable, report: FuzzReport, lock):
        self.send, self.report, self.lock = send, report, lock

    def __call__(self, fr: FuzzRequest, state: FuzzState) -> Optional[int]:
        """Send it; the last status (None: no answer)."""
        status = None
        for _ in range(max(1, fr.repeat)):
            resp = self._one(fr)
            status = None if resp is None else resp.status
            if resp is not None:
                state.observe(fr.request, fr.args, resp, fr)
                if resp.status == StatusCode.OK and not fr.request.session:
                    sid = json.loads(resp.result_json or "{}").get("session")
                    if sid and fr.repeat > 1:
                        fr.request.session = sid        # the repeats go to the session it opened
        return status

    def _one(self, fr: FuzzRequest) -> Optional[ComputeResponse]:
        report = self.report
        try:
            resp = self.send(fr.request)
        except Exception as e:  # noqa: BLE001 - a transport failure is a finding, not a crash of the fuzzer
            with self.lock:
                report.requests += 1
                report.by_kind[fr.kind] += 1
                report.errors.append(f"{type(e).__name__}: {str(e)[:200]} for {fr.request.args_json[:300]}")
            return None
        with self.lock:
            report.requests += 1
            report.by_kind[fr.kind] += 1
            if not isinstance(resp, ComputeResponse) or not isinstance(resp.status, int):
                report.errors.append(f"answer {type(resp).__name__} for {fr.request.args_json[:300]}")
                return None
            try:
                code = StatusCode(resp.status)
            except ValueError:
                report.errors.append(f"unknown status {resp.status} for {fr.request.args_json[:300]}")
                return None
            report.by_status[int(code)] += 1
            text = resp.status_text or ""
            if code == StatusCode.OK:
                report.ok_by_kind[fr.kind] += 1
            else:
                reason = refusal_reason(code, text)
                report.by_reason[reason] += 1
                report.reason_examples.setdefault(reason, text[:300])
            if code == StatusCode.INTERNAL:
                report.internal.append(f"{text[:300]} <- {fr.request.args_json[:1500]}")
            elif code == StatusCode.STALE_HANDLE and "sandbox of this client stopped" in text:
                report.sandbox_crashes.append(f"{text[:200]} <- {fr.request.args_json[:1500]}")
            elif code == StatusCode.BUSY and "max_request_s" in text:
                report.sandbox_kills += 1
            if fr.info.get("writes_weight"):
                if code == StatusCode.OK:
                    report.weight_writes_allowed.append(fr.request.args_json[:300])
                elif code == StatusCode.UNAUTHORIZED:
                    report.weight_writes_refused += 1
        return resp


def load_weights(load: Optional[Callable]) -> list:
    """Have the server load the registry model whose weights fit requests name by digest
    (``load(model) -> True`` when loaded) and return those weights as
    ``(digest, shape, dtype)``; [] without ``load`` or when it fails."""
    from robot_offload.server.fuzz import shapes as fuzz_shapes
    if load is None or not load(fuzz_shapes.WEIGHTS_MODEL):
        return []
    return fuzz_shapes.registry_weights(fuzz_shapes.WEIGHTS_MODEL)


def run_fuzz(send: Callable, n_requests: int, seed: int = 0, valid_every: int = 50,
             ping: Optional[Callable] = None, watch: Optional[ProcessWatch] = None,
             watch_every: int = 20, ops: Optional[Dict[str, object]] = None,
             progress: Optional[Callable] = None, report: Optional[FuzzReport] = None,
             load: Optional[Callable] = None, threads: int = 0) -> FuzzReport:
    """Send ``n_requests`` generated requests through ``send(ComputeRequest) ->
    ComputeResponse``, a :class:`ValidClient` check every ``valid_every`` of them, a
    ``ping()`` (True when answered OK) and a ``watch`` sample every ``watch_every``.
    ``load(model) -> bool`` loads a registry model on the server, whose weights fit
    requests then name by digest; ``threads`` more clients fuzz concurrently (identities
    of their own, :func:`make_request`), their requests counted in the same report.
    Never stops at a problem: everything is counted in the returned report."""
    import random
    import threading
    from hypothesis import HealthCheck, Phase, given, seed as hyp_seed, settings, strategies as st

    ops = ops or catalog()
    weights = load_weights(load)
    state = FuzzState(weights=weights)
    report = report or FuzzReport()
    valid = ValidClient(send, seed=seed)
    t0 = time.monotonic()
    lock = threading.Lock()
    tally = _Tally(send, report, lock)
    stop = threading.Event()

    def one(fr: FuzzRequest) -> None:
        tally(fr, state)

    def concurrent(i: int) -> None:
        rng = random.Random(seed * 7919 + i)
        own = FuzzState(clients=(f"fuzz-t{i}",), weights=weights)
        while not stop.is_set() and report.requests < n_requests:
            try:
                fr = make_request(own, ops, rng)
            except Exception as e:  # noqa: BLE001 - a generator bug is reported, not a hang
                with lock:
                    report.errors.append(f"generator: {type(e).__name__}: {e}")
                return
            if tally(fr, own) == StatusCode.BUSY:
                time.sleep(0.5)     # a refused client backs off rather than flood the count

    workers = [threading.Thread(target=concurrent, args=(i,), daemon=True) for i in range(threads)]
    for w in workers:
        w.start()

    last = {"valid": 0, "watch": 0, "progress": 0}

    def due(what: str, every: int) -> bool:
        """Whether ``every`` more requests were sent since ``what`` last ran (the
        concurrent clients add to the count too)."""
        if every and report.requests - last[what] >= every:
            last[what] = report.requests
            return True
        return False

    def between() -> None:
        if due("valid", valid_every):
            report.valid_checks += 1
            if valid.check():
                report.valid_passed += 1
            else:
                report.valid_failures.append(valid.failures[-1])
        if due("watch", watch_every):
            if ping is not None and not ping():
                report.pings_failed += 1
            if watch is not None:
                report.note(watch.sample())
        if progress is not None and due("progress", 500):
            progress(report)

    if watch is not None:
        report.note(watch.sample())
    strategy = st.data()
    while report.requests < n_requests:
        left = n_requests - report.requests

        @hyp_seed(seed + report.requests)
        @settings(max_examples=left, phases=[Phase.generate], deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(strategy)
        def step(data):
            fr = data.draw(request_strategy(state, ops))     # always drawn: hypothesis wants the
            if report.requests >= n_requests:                # same draws for the same choices
                return
            one(fr)
            between()
        step()
    stop.set()
    for w in workers:
        w.join(FUZZ_CONFIG["max_request_s"] + 60)
    report.wall_s = time.monotonic() - t0
    return report


def transport_calls(transport, timeout_s: float) -> tuple:
    """``(send, ping, load)`` over a transport, as :func:`run_fuzz` takes them: ``send``
    waits ``timeout_s``; a ping that raises counts as failed, a model that cannot be loaded
    leaves the fuzz without registry weights."""
    def send(req):
        return transport.call("compute", req, timeout_s)

    def ping():
        try:
            return transport.call("ping", PingRequest(client_id="fuzz-ping"), 30).status == StatusCode.OK
        except Exception:  # noqa: BLE001 - counted as a failed ping
            return False

    def load(model):
        try:
            return transport.call("load_model", LoadModelRequest(client_id="fuzz-load", model=model),
                                  300).status == StatusCode.OK
        except Exception:  # noqa: BLE001 - no registry weights to fuzz with then
            return False
    return send, ping, load
