"""transparent and record_replay: unmodified programs and registry models give the same
outputs as without interception; replay needs at most 2 round trips per inference once
identified; divergences are detected; the server's ops entry refuses bad requests."""

import copy
import json
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from torch import nn

from robot_offload.client import ClientConfig, OffloadClient
from robot_offload.models import get_spec, names
from robot_offload.protocol import ComputeRequest, StatusCode, method_of
from robot_offload.server import OffloadServer, ServerConfig
from robot_offload.transparent.wire import content_digest
from robot_offload.transparent.session import RemoteSession
from robot_offload.transport.inproc import InProcessTransport

from devices import SERVER_DEVICE, assert_same_as_local, skip_off_cpu

PROGRAMS = os.path.join(os.path.dirname(__file__), "..", "programs")
#: Every unmodified program of the corpus: each must give its plain run's outputs through
#: the launcher in both modes, or stop with a message naming why (REFUSED).
ALL_PROGRAMS = sorted(f[:-3] for f in os.listdir(PROGRAMS) if f.endswith(".py"))
#: program -> a pattern its refusal message must match (a clear stop instead of a result).
REFUSED = {}
#: Registry models whose operator sequence changes with the data (the number of boxes
#: kept changes which operators run): they must stay op by op and still be correct.
NOT_STATIC = {"fasterrcnn_resnet50_fpn"}
DETECTORS = {"fasterrcnn_resnet50_fpn", "retinanet_resnet50_fpn"}


def _run(args, cwd, check=True):
    proc = subprocess.run([sys.executable] + args, cwd=cwd, capture_output=True, text=True, timeout=300)
    if check:
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


#: The program corpus runs once per module (three runs of each program, a few seconds
#: each); the first test that asks for it pays for all of them, so on a loaded machine it
#: needs more than the suite's per-test limit.
CORPUS_TIMEOUT_S = 3000


@pytest.fixture(scope="module")
def program_runs(tmp_path_factory):
    """Each test program plain, and under the launcher in each mode (in-process server):
    (plain outputs, offloaded outputs or None, stats, the launcher's process)."""
    out = tmp_path_factory.mktemp("programs")
    runs = {}
    for prog in ALL_PROGRAMS:
        path = os.path.join(PROGRAMS, prog + ".py")
        _run([path, "--out", str(out / f"{prog}.plain.npz")], out)
        for mode in ("transparent", "record_replay", "auto"):
            stats = out / f"{prog}.{mode}.json"
            result = out / f"{prog}.{mode}.npz"
            proc = _run(["-m", "robot_offload.transparent", "--inproc", "--inproc-device", SERVER_DEVICE,
                         "--mode", mode, "--stats-out", str(stats),
                         "--", "python", path, "--out", str(result)], out, check=prog not in REFUSED)
            runs[prog, mode] = (np.load(out / f"{prog}.plain.npz"),
                                np.load(result) if proc.returncode == 0 else None,
                                json.loads(stats.read_text()), proc)
    return runs


@pytest.mark.timeout(CORPUS_TIMEOUT_S)
@pytest.mark.parametrize("mode", ["transparent", "record_replay", "auto"])
@pytest.mark.parametrize("prog", ALL_PROGRAMS)
def test_program_outputs_equal_uninstrumented(program_runs, prog, mode):
    """Every saved array of the offloaded run equals the plain run's bit for bit: the
    in-process server runs the same float32 kernels on the same CPU, in the same order, so
    any difference is a wrong answer, not rounding (on another server device
    assert_same_as_local compares within its cross-device tolerance). A program in
    REFUSED must instead fail with a message naming the cause."""
    plain, offloaded, stats, proc = program_runs[prog, mode]
    if prog in REFUSED:
        assert proc.returncode != 0 and re.search(REFUSED[prog], proc.stderr), proc.stderr[-3000:]
        return
    assert plain.files == offloaded.files
    for key in plain.files:
        assert_same_as_local(torch.from_numpy(offloaded[key]), torch.from_numpy(plain[key]),
                             msg=f"{prog} {mode} {key}", rtol=0, atol=0)
    assert stats["ops_remote"] > 0, "nothing was offloaded"
    if mode == "transparent":
        assert stats["ops_replayed"] == 0 and stats["round_trips"] >= stats["ops_remote"]


def test_launcher_local_mode_runs_the_program_as_it_is(tmp_path):
    """--mode local: nothing intercepted, no server needed (the reference a launch file's
    mode switch compares with); the program's output and exit status are its own."""
    prog = tmp_path / "prog.py"
    prog.write_text("import sys, torch\nw = torch.nn.Linear(4, 2)\ntorch.manual_seed(1)\n"
                    "print('sum', torch.nn.Linear(4, 2)(torch.ones(1, 4)).sum().item())\nsys.exit(3)\n")
    plain = _run([str(prog)], tmp_path, check=False)
    proc = _run(["-m", "robot_offload.transparent", "--mode", "local", "--", "python", str(prog)],
                tmp_path, check=False)
    assert plain.returncode == proc.returncode == 3
    assert plain.stdout == proc.stdout and plain.stdout.startswith("sum ")
    assert "[transparent] mode=local" in proc.stderr and "round_trips" not in proc.stderr


def test_launcher_runs_a_program_in_auto_unless_told_otherwise(tmp_path):
    """Without --mode the launcher runs ``auto`` (as the launch files do): the summary
    names the mode, and the program's output is its own."""
    prog = tmp_path / "prog.py"
    prog.write_text("import torch\ntorch.manual_seed(0)\nw = torch.nn.Linear(4, 2)\n"
                    "print('sum', w(torch.ones(1, 4)).sum().item())\n")
    plain = _run([str(prog)], tmp_path)
    proc = _run(["-m", "robot_offload.transparent", "--inproc", "--", "python", str(prog)], tmp_path)
    assert proc.stdout == plain.stdout and plain.stdout.startswith("sum ")
    assert "[transparent] mode=auto " in proc.stderr, proc.stderr[-2000:]


def test_launcher_reports_when_the_program_raises(tmp_path):
    """The summary and --stats-out come also from a program that raises; the exception
    then reaches the caller (a traceback and a non-zero exit status)."""
    prog = tmp_path / "raises.py"
    prog.write_text("import torch\nw = torch.nn.Linear(4, 2)\nprint(w(torch.ones(1, 4)).sum().item())\n"
                    "raise ValueError('the program failed')\n")
    stats = tmp_path / "stats.json"
    proc = _run(["-m", "robot_offload.transparent", "--inproc", "--mode", "transparent",
                 "--stats-out", str(stats), "--", "python", str(prog)], tmp_path, check=False)
    assert proc.returncode != 0
    assert "ValueError: the program failed" in proc.stderr
    assert "[transparent] mode=transparent round_trips=" in proc.stderr
    assert json.loads(stats.read_text())["ops_remote"] > 0


@pytest.mark.timeout(CORPUS_TIMEOUT_S)
@pytest.mark.parametrize("prog,sequences", [("classifier_loop", 1), ("kapao_loop", 1), ("two_models", 2)])
def test_replay_after_identification(program_runs, prog, sequences):
    _, _, stats, _ = program_runs[prog, "record_replay"]
    assert stats["sequences_identified"] >= sequences
    assert stats["divergences"] == 0
    infs = stats["inferences"]
    replayed = [i for i in infs if i["phase"] == "replaying"]
    assert len(replayed) >= 2, infs
    assert all(i["round_trips"] <= 2 for i in replayed), infs
    recorded = [i for i in infs if i["phase"] == "recording"]
    assert min(i["round_trips"] for i in recorded) > 20 * max(i["round_trips"] for i in replayed)


@pytest.mark.timeout(CORPUS_TIMEOUT_S)
@pytest.mark.parametrize("prog", ["classifier_loop", "kapao_loop", "two_models", "preallocated_outputs"])
def test_auto_times_the_robot_on_a_real_inference(program_runs, prog):
    """auto: after two replays of a sequence, the robot computes an inference of it with
    no round trip (the outputs of every inference are compared bit for bit above)."""
    _, _, stats, _ = program_runs[prog, "auto"]
    infs = stats["inferences"]
    assert stats["sequences_identified"] >= 1 and stats["robot_inferences"] >= 1, infs
    assert any(i["phase"] == "robot" and i["round_trips"] == 0 for i in infs), infs


@pytest.mark.timeout(CORPUS_TIMEOUT_S)
def test_rebuilt_model_replays_and_its_weights_stay_on_the_server(program_runs):
    """A model built again every loop (a new object, the same weights) is recognised by
    content: its sequence replays in one round trip, and its weights cross the link once.
    New weights (the last frames' other seed) are a new sequence, recorded again."""
    _, _, stats, _ = program_runs["rebuild_each_frame", "record_replay"]
    infs = stats["inferences"]
    assert [i["phase"] for i in infs[3:4]] == ["replaying"] and infs[-1]["phase"] == "recording", infs
    replayed = [i for i in infs if i["phase"] == "replaying"]
    assert replayed and all(i["round_trips"] == 1 for i in replayed), infs
    assert all(i["bytes_up"] < infs[0]["bytes_up"] / 4 for i in infs[1:4]), infs


@pytest.mark.timeout(CORPUS_TIMEOUT_S)
def test_detector_postprocessing_replays_in_one_round_trip(program_runs):
    """Per-class NMS on the model's output (sync points: data-dependent sizes, values read
    mid-way) settles at one round trip per frame once the replay has seen what the
    program reads."""
    _, _, stats, _ = program_runs["detector_nms", "record_replay"]
    replayed = [i for i in stats["inferences"] if i["phase"] == "replaying"]
    assert replayed and replayed[-1]["round_trips"] <= 2, stats["inferences"]


@pytest.mark.timeout(CORPUS_TIMEOUT_S)
def test_kapao_first_inference_differs_and_is_ignored(program_runs):
    """KAPAO's decoder builds its grids in the first call: that inference uploads them and
    differs from the later ones; the sequence is still identified from inferences 2 and 3."""
    _, _, stats, _ = program_runs["kapao_loop", "record_replay"]
    first, second = stats["inferences"][0], stats["inferences"][1]
    assert first["phase"] == second["phase"] == "recording"
    assert first["bytes_up"] > second["bytes_up"]
    assert stats["inferences"][3]["phase"] == "replaying"


@pytest.mark.timeout(CORPUS_TIMEOUT_S)
def test_control_flow_divergence_detected_never_wrong(program_runs):
    _, _, stats, _ = program_runs["control_flow", "record_replay"]
    assert stats["sequences_identified"] >= 1
    assert stats["divergences"] >= 1
    assert any(i["phase"] == "fallback" for i in stats["inferences"])


# -- registry models through the client's modes --------------------------------------------

def _client(server, model, mode, **config):
    spec = get_spec(model)
    cfg = ClientConfig(model=model, mode=mode, input_size=spec.test_input_size,
                       load_timeout_s=120, timeout_s=120, **config)
    client = OffloadClient(cfg, InProcessTransport(server))
    assert client.connect(), client.link.last_error
    return client


def _offloaded_equals_local(client, mode, x):
    """Run frame ``x`` in ``mode`` (it must not fall back) and locally; assert the outputs
    are equal; return the offloaded frame's stats."""
    client.set_mode(mode)
    y, stats = client.infer(x)
    assert stats.executed_mode == mode, stats.fallback_reason
    client.set_mode("local")
    ref, _ = client.infer(x)
    assert_same_as_local(y, ref, rtol=1e-5, atol=1e-5)
    return stats


@pytest.mark.parametrize("model", names())
def test_registry_models_record_replay_equals_local(shared_server, model):
    if model == "fasterrcnn_resnet50_fpn":
        skip_off_cpu("its random-weight proposals are picked among near-ties, which float "
                     "rounding reorders")
    client = _client(shared_server, model, "record_replay")
    try:
        phases = []
        # RetinaNet: its box decoding builds tensors after its sync points (top-k, score
        # masks); they are predicted once their content has repeated (two replays)
        for i in range(7 if model == "retinanet_resnet50_fpn" else 5):
            x = client.spec.example_input(client.input_size, seed=i)
            stats = _offloaded_equals_local(client, "record_replay", x)
            phases.append((stats.phase, stats.round_trips, stats.bytes_up))
        if model in NOT_STATIC:
            assert all(p == "recording" for p, _, _ in phases), phases
        else:
            assert phases[-1][0] == "replaying", phases
            assert phases[-1][1] <= 2, phases
        # Weights were found on the server by digest: no frame uploads them. (The detectors
        # resize and normalise inside the model, on the robot: their resized image goes up.)
        weight_bytes = sum(p.numel() * p.element_size() for p in client.model.parameters())
        limit = weight_bytes // 4 if model in DETECTORS else 64 * 1024 + 4 * x.numel() * 4
        assert all(up < limit for _, _, up in phases[1:]), phases
    finally:
        client.close()


@pytest.mark.parametrize("early_replay", [True, False])
def test_client_early_replay_parameter(shared_server, early_replay):
    """~early_replay reaches the client's record_replay session; both orders give local's
    outputs in one round trip per replayed frame."""
    client = _client(shared_server, "resnet18", "record_replay", early_replay=early_replay)
    try:
        trips = []
        for i in range(6):
            x = client.spec.example_input(client.input_size, seed=i)
            trips.append(_offloaded_equals_local(client, "record_replay", x).round_trips)
        session = client._backends["record_replay"].session
        assert session.early_replay == early_replay
        assert (session.stats.early_replays >= 2) == early_replay
        assert trips[-2:] == [1, 1], trips
    finally:
        client.close()


def test_an_input_tensor_passed_again_is_replayed(shared_server):
    """A program that passes the same input tensor object again (frames cycled, the same
    image twice) finds its upload cached: the sequence's start must still take it as the
    input, not as a constant, and replay in one round trip (it went op by op before)."""
    client = _client(shared_server, "resnet18", "record_replay")
    try:
        frames = [client.spec.example_input(client.input_size, seed=i) for i in range(3)]
        trips = [_offloaded_equals_local(client, "record_replay", frames[i % 3]).round_trips
                 for i in range(9)]
        assert trips[3:] == [1] * 6, trips
    finally:
        client.close()


@pytest.mark.parametrize("model", ["resnet18", "kapao_l", "agrnav"])
def test_registry_models_transparent_equals_local(shared_server, model):
    client = _client(shared_server, model, "transparent")
    try:
        stats = _offloaded_equals_local(client, "transparent",
                                        client.spec.example_input(client.input_size, seed=4))
        assert stats.phase == "transparent"
        assert stats.round_trips > 20
    finally:
        client.close()


# -- the session in process --------------------------------------------------------------------

def _session(server=None, mode="record_replay", **kwargs):
    transport = InProcessTransport(server or OffloadServer(ServerConfig(ops_sandbox=False, device=SERVER_DEVICE)))
    return RemoteSession(lambda r, t: transport.call(method_of(r), r, t), mode=mode, **kwargs)


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(3, 4, 3)
        self.b = nn.Linear(4, 2)

    def forward(self, x):
        h = torch.relu(self.a(x)).mean(dim=(2, 3))
        return self.b(h)


def test_a_compiled_value_list_takes_no_tensor_for_a_number():
    """A list argument recorded as [2, 2] matches [2, 2] by its compiled check; a tensor
    equal to 2 in its place (list equality would take it) and a tuple go to the generic
    match, which decides them."""
    from robot_offload.transparent.replay import _compile_arg
    sess = _session()
    kind, want = _compile_arg({"l": [2, 2]})
    assert sess._compiled_arg(None, kind, want, [2, 2])
    assert not sess._compiled_arg(None, kind, want, [torch.tensor(2), 2])
    assert not sess._compiled_arg(None, kind, want, [2, 3])
    assert not sess._compiled_arg(None, kind, want, (2, 2))


def test_a_fresh_frame_each_replay_is_not_digested_every_time(monkeypatch):
    """The content digest of a sequence input (for inputs that repeat, like RetinaNet's
    anchors) comes before the early replay can leave; an input that changed in
    VOLATILE_AFTER replays in a row is digested only every VOLATILE_RECHECK replays."""
    from robot_offload.transparent import replay_requests, uploads
    digested = []

    def counting_digest(t):
        digested.append(tuple(t.shape))
        return content_digest(t)
    monkeypatch.setattr(uploads, "content_digest", counting_digest)
    torch.manual_seed(0)
    net = _Net().eval()
    sess = _session()
    frames = 3 + replay_requests.VOLATILE_AFTER + replay_requests.VOLATILE_RECHECK
    with torch.no_grad():
        for i in range(frames):
            x = torch.randn(1, 3, 8, 8)
            ref = net(x)
            with sess:
                y = net(x).cpu()
            assert_same_as_local(y, ref)
    replays = sess.stats.replays
    frame_digests = digested.count((1, 3, 8, 8))
    assert replays >= replay_requests.VOLATILE_AFTER + replay_requests.VOLATILE_RECHECK - 1
    # digested while it might still repeat, then at one recheck, not at every replay
    assert frame_digests <= replay_requests.VOLATILE_AFTER + 2 < replays, (frame_digests, replays)


class _PoolNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(3, 4, 3)
        self.k = 2

    def forward(self, x):
        return torch.nn.functional.avg_pool2d(torch.relu(self.a(x)), self.k)


@pytest.mark.parametrize("early_replay", [True, False])
def test_a_call_that_fails_its_compiled_check_diverges_and_stays_correct(early_replay):
    """The robot checks most replayed calls by the check compiled for them
    (replay._compile_check). A call that differs there (another kernel size) must end
    the speculation like any divergence, never be answered with the recorded shape."""
    torch.manual_seed(0)
    net = _PoolNet().eval()
    sess = _session(early_replay=early_replay)
    compiled = []
    with torch.no_grad():
        for i in range(6):
            x = torch.randn(1, 3, 10, 10)
            if i == 5:
                net.k = 4
                compiled = [c[0] for s in sess.recorder.sequences.values()
                            for c in (s.robot_checks or []) if c is not None]
            ref = net(x)
            with sess:
                y = net(x).cpu()
            assert_same_as_local(y, ref)
    assert torch.ops.aten.avg_pool2d.default in compiled, compiled
    assert sess.stats.sequences_identified >= 1 and sess.stats.divergences == 1


@pytest.mark.parametrize("early_replay", [True, False])
def test_modified_weight_diverges_and_stays_correct(early_replay):
    torch.manual_seed(0)
    net = _Net().eval()
    sess = _session(early_replay=early_replay)
    with torch.no_grad():
        for i in range(6):
            x = torch.randn(1, 3, 8, 8)
            if i == 5:
                net.b.weight.mul_(2.0)     # in place: the cached upload is stale
            ref = net(x)
            with sess:
                y = net(x).cpu()
            assert_same_as_local(y, ref)
    assert sess.stats.sequences_identified >= 1
    assert sess.stats.divergences == 1
    # Early: the replay left at the convolution; the changed weight is found at the linear
    # layer after it, so that reply is dropped and the matched prefix replayed again.
    assert sess.stats.early_dropped == (1 if early_replay else 0)
    assert (sess.stats.early_replays >= 1) == early_replay


def test_early_replay_overlaps_the_checks():
    """The replay request leaves on the worker thread while the program's thread is still
    checking calls: the call below holds each replay until the program has matched the
    whole sequence, which a replay sent at the end of the sequence could never see."""
    import threading
    torch.manual_seed(0)
    net = _Net().eval()
    transport = InProcessTransport(OffloadServer(ServerConfig(ops_sandbox=False, device=SERVER_DEVICE)))
    seen = []   # (thread name, replay n, the program had matched all n calls meanwhile)
    sess = None

    def call(req, timeout):
        body = json.loads(req.args_json)
        if "replay" in body:
            spec = sess._spec
            deadline = time.monotonic() + 5.0
            while spec.pos < spec.seq.n_ops and time.monotonic() < deadline:
                time.sleep(0.001)
            seen.append((threading.current_thread().name, body["replay"]["n"],
                         spec.pos == spec.seq.n_ops))
        return transport.call("compute", req, timeout)

    sess = RemoteSession(call)
    with torch.no_grad():
        for i in range(6):
            x = torch.randn(1, 3, 8, 8)
            ref = net(x)
            with sess:
                y = net(x).cpu()
            assert_same_as_local(y, ref)
    assert sess.stats.early_replays >= 2 and sess.stats.early_dropped == 0
    # The first replay of the sequence goes at its end (it learns what the program holds).
    assert sess.stats.replays == sess.stats.early_replays + 1
    early = [(n, done) for name, n, done in seen if name.startswith("rr-early-replay")]
    assert len(early) == sess.stats.early_replays, seen
    assert all(done for _, done in early), seen
    replayed = [i for i in sess.stats.inferences if i.phase == "replaying"]
    assert replayed and all(i.round_trips == 1 for i in replayed)
    # Each early-replayed inference says when it sent the replay, ended its checks and had
    # the reply: the request left before the checks ended (here the call held it until then).
    timed = [i for i in replayed if i.reply_ms is not None]
    assert len(timed) == sess.stats.early_replays, replayed
    assert all(i.early_sent_ms <= i.checks_end_ms and i.early_sent_ms <= i.reply_ms
               for i in timed), timed


def test_early_replay_stops_after_repeated_misses():
    """Each dropped early reply costs a second round trip: after EARLY_MAX_MISSES in a row
    the sequence is replayed at its end only, still correct."""
    from robot_offload.transparent.recorder import EARLY_MAX_MISSES
    torch.manual_seed(0)
    net = _KeepsHidden().eval()
    sess = _session()
    with torch.no_grad():
        for i in range(10):
            x = torch.randn(1, 3, 8, 8)
            ref = net(x)
            ref_hidden = net.hidden
            for seq in sess.recorder.sequences.values():
                seq.early_keep = []   # as if the program held nothing at the end before
            with sess:
                y = net(x).cpu()
                hidden = net.hidden.cpu()
            assert_same_as_local(y, ref)
            assert_same_as_local(hidden, ref_hidden)
    assert sess.stats.early_dropped == EARLY_MAX_MISSES and sess.stats.early_replays == 0
    replayed = [i for i in sess.stats.inferences if i.phase == "replaying"]
    assert [i.round_trips for i in replayed][-2:] == [1, 1]


def test_dropped_proxies_are_freed_without_the_garbage_collector():
    """Proxies die when the program drops them, not at the next garbage collection (a
    recursive closure once kept every operator's arguments in a reference cycle): the
    server's tensors are released at once, and an early replay's check of what the
    program holds is not fooled by garbage."""
    import gc
    from robot_offload.transparent.proxy import RemoteTensor
    torch.manual_seed(0)
    net = _Net().eval()
    sess = _session()
    gc.collect()
    gc.disable()
    try:
        with torch.no_grad():
            for i in range(6):
                with sess:
                    y = net(torch.randn(1, 3, 8, 8)).cpu()
        left = [o for o in gc.get_objects() if type(o) is RemoteTensor]
    finally:
        gc.enable()
    assert sess.stats.early_replays >= 1 and y.shape == (1, 2)
    assert left == []


class _KeepsHidden(_Net):
    """Keeps an intermediate tensor and reads it after the frame, as a tracker keeps
    features."""

    def forward(self, x):
        self.hidden = torch.relu(self.a(x))
        return self.b(self.hidden.mean(dim=(2, 3)))


def test_early_replay_not_used_when_the_program_holds_more():
    """The early reply keeps what the program held at the end of the previous replay. When
    it holds more (here: the record is made to forget the kept tensor, as if the program
    had not held it before), the reply is dropped and the sequence replayed at its end,
    so the tensor read after the frame still has its value."""
    torch.manual_seed(0)
    net = _KeepsHidden().eval()
    sess = _session()
    counts = []
    with torch.no_grad():
        for i in range(8):
            x = torch.randn(1, 3, 8, 8)
            ref = net(x)
            ref_hidden = net.hidden
            if i == 5:
                seq, = sess.recorder.sequences.values()
                assert seq.early_keep is not None and (1, 0) in seq.early_keep
                seq.early_keep = [k for k in seq.early_keep if k != (1, 0)]
            with sess:
                y = net(x).cpu()
                # read after the sequence (from frame 5: not during recording, so not
                # fetched with the reply): needs the server to have kept it
                hidden = net.hidden.cpu() if i >= 5 else ref_hidden
            assert_same_as_local(y, ref)
            assert_same_as_local(hidden, ref_hidden)
            counts.append((sess.stats.early_replays, sess.stats.early_dropped))
    # frame 3: the first replay (at the end); 4: early; 5: dropped; 6, 7: early again
    assert counts[3:] == [(0, 0), (1, 0), (1, 1), (2, 1), (3, 1)], counts
    assert sess.stats.divergences == 0


class _Forward(nn.Module):
    """``f`` as a module's forward: operators on weights are offloaded inside one."""

    def __init__(self, f):
        super().__init__()
        self.f = f

    def forward(self, *args):
        return self.f(*args)


def _frame(sess, f, x) -> int:
    """Run ``f(x)`` plainly and under ``sess`` (as a module's forward); assert the same
    output; return the round trips the intercepted frame took."""
    ref = f(x)
    before = sess.stats.round_trips
    with sess:
        y = _Forward(f)(x).cpu()
    assert_same_as_local(y, ref)
    return sess.stats.round_trips - before


def _fuse_conv_bn(conv: nn.Conv2d, bn: nn.BatchNorm2d) -> nn.Conv2d:
    """A conv-BN fusion as detectors' ``fuse()`` writes it: a new conv whose weight and
    bias are copied in from products of the two layers' weights."""
    fused = nn.Conv2d(conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride,
                      conv.padding, bias=True).requires_grad_(False)
    scale = torch.diag(bn.weight.div(torch.sqrt(bn.eps + bn.running_var)))
    fused.weight.copy_(torch.mm(scale, conv.weight.clone().view(conv.out_channels, -1)).view(fused.weight.shape))
    fused.bias.copy_(bn.bias - bn.weight.mul(bn.running_mean).div(torch.sqrt(bn.running_var + bn.eps)))
    return fused


def test_weights_converted_and_fused_outside_forward_stay_on_the_robot():
    """A float16 checkpoint converted with ``.float()`` and conv-BN fused before the first
    inference (KAPAO's ``attempt_load``): that work reads weights outside any forward, so
    it runs on the robot -- no round trip, no byte either way -- and the first inference
    uploads the fused float32 weights once. Outputs equal the plain run's."""
    torch.manual_seed(0)

    def build():
        return nn.Sequential(*[nn.Sequential(nn.Conv2d(c, 64, 3, padding=1, bias=False),
                                             nn.BatchNorm2d(64), nn.ReLU()) for c in (3, 64, 64, 64)])

    def load_and_fuse(model):
        model.float()
        for block in model:
            block[0] = _fuse_conv_bn(block[0], block[1])
            block[1] = nn.Identity()
        return model

    model = build().eval()
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
    model.half()                                   # the checkpoint's format
    plain = copy.deepcopy(model)
    sess = _session()
    x = torch.rand(1, 3, 32, 32)
    with torch.no_grad():
        ref = load_and_fuse(plain)(x)
        with sess:
            load_and_fuse(model)
        assert (sess.stats.round_trips, sess.stats.bytes_up, sess.stats.bytes_down) == (0, 0, 0)
        with sess:
            y = model(x).cpu()
    assert_same_as_local(y, ref)
    fused_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert fused_bytes <= sess.stats.bytes_up < 1.2 * fused_bytes + 2 * x.numel() * 4, sess.stats
    out_bytes = y.numel() * y.element_size()
    assert sess.stats.bytes_down < out_bytes + fused_bytes / 10, sess.stats


def test_data_dependent_shape_is_a_sync_point():
    """A boolean mask's output size depends on values: a sync point. Once the sequence is
    known, the early replay runs through it: the server returns the mask's real shape with
    the whole replay, the robot checks it against the record when the program gets there,
    and the frame costs one round trip. When the size differs from the record, the early
    reply is dropped and the inference continues op by op, correctly."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.full((16,), 0.5))
    sess = _session()
    trips, answered = [], []
    with torch.no_grad():
        for i in range(8):
            # 8 positive products per frame, then 16 from frame 6 on
            x = torch.linspace(-1, 1, 16) + (2.0 if i >= 6 else 0.01 * i)
            def f(x):
                h = x * w
                return (h[h > 0] * 3).sum()
            trips.append(_frame(sess, f, x))
            answered.append((sess.stats.early_sync_answers, sess.stats.early_dropped))
    assert sess.stats.sequences_identified >= 1
    assert sess.stats.divergences >= 1
    # frames 4 and 5: one round trip, the sync point answered from the early reply;
    # frame 6: the mask's size changed, the early reply is dropped
    assert trips[4:6] == [1, 1], (trips, answered)
    assert [a for a, _ in answered[3:6]] == [0, 1, 2], answered
    assert answered[6][1] == answered[5][1] + 1, answered


def test_inputs_built_after_a_sync_point_are_predicted_when_they_repeat():
    """A program that builds a tensor after a sync point every frame (RetinaNet's anchors):
    once its content has repeated, the server keeps it and the early replay names it
    before the program has built it; the robot checks the new one's digest when it comes.
    One round trip per frame; when the content changes, the early reply is dropped and
    the frame is still correct."""
    w = nn.Parameter(torch.full((16,), 0.5))
    sess = _session()
    trips = []
    with torch.no_grad():
        for i in range(9):
            x = torch.linspace(-1, 1, 16) + 0.001 * i      # 8 positive products each frame
            scale = 2.0 if i < 7 else 3.0                    # the built tensor changes at 7
            def f(x):
                h = x * w
                pos = h[h > 0]                               # sync point
                anchors = torch.linspace(0, 1, 8) * scale    # built on the robot, after it
                return (pos * anchors).sum()
            trips.append(_frame(sess, f, x))
    assert trips[5:7] == [1, 1], trips
    assert sess.stats.early_replays >= 2 and sess.stats.early_dropped >= 1, sess.stats
    assert sess.stats.divergences == 0


def test_early_replay_through_a_sync_point_refused_by_the_server():
    """The early replay runs past a sync point with the record's arguments; when the data
    make a later operator fail on the server (an index beyond the new size), the request is
    refused, dropped, and the frame completes correctly as the program goes."""
    w = nn.Parameter(torch.ones(16))
    sess = _session()
    with torch.no_grad():
        for i in range(7):
            n = 8 if i < 5 else 3          # positives: 8, then 3 from frame 5 on
            x = torch.cat([torch.ones(n), -torch.ones(16 - n)])
            def f(x):
                h = (x * w)[x * w > 0]     # a sync point (data-dependent size)
                k = h.shape[0]
                a, b = h.split([k // 2, k - k // 2])   # the record's sizes fail on 3 values
                return a.sum() * 2 + b.sum()
            _frame(sess, f, x)
    assert sess.stats.early_sync_answers >= 1 and sess.stats.early_refused == 1, sess.stats
    assert sess.stats.divergences >= 1


def _detector_like(w):
    """A post-processing step as in a detector: keep the scores above a threshold (a
    data-dependent count n), take the top min(100, n) of them (n, as a plain int, is an
    argument of topk and view), gather their positions."""
    def f(x):
        h = x * w
        keep = h > 0.1
        scores = h[keep]                                  # sync point: n values
        where = torch.nonzero(keep).view(-1)              # sync point: n positions
        n = scores.numel()
        top, order = scores.topk(min(100, n))             # k = n: a size symbol
        boxes = where[order].float().view(top.numel(), 1) * 2.0   # a size symbol too
        pairs = torch.stack([top, top], 1).reshape(top.numel() * 2)  # twice a size
        return torch.cat([(boxes * top.view(-1, 1)).sum(0), top[:1], pairs[-1:]])
    return f


def test_data_dependent_sizes_replay_in_one_round_trip():
    """The number of kept scores changes every frame. The two recorded inferences differ
    only in integers that equal what the sync points returned, so the sequence is
    identified with size symbols: the server fills them from its own run, the robot checks
    the program's arguments against this frame's values, and every frame after
    identification takes one round trip, with the outputs of the plain program."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.ones(64))
    sess = _session()
    f = _detector_like(w)
    trips, counts = [], []
    with torch.no_grad():
        for i in range(9):
            x = torch.rand(64) * (0.3 + 0.05 * i)        # 40-80 % above the threshold
            counts.append(int((x * w > 0.1).sum()))
            trips.append(_frame(sess, f, x))
    assert len(set(counts)) >= 6, counts                 # the sizes did change
    assert sess.stats.sequences_identified == 1, sess.stats
    assert sess.stats.divergences == 0, sess.stats
    # frames 0-2 recorded (the first uploads the weight), identified at frame 3, whose
    # replay learns what the program keeps; then one round trip a frame
    assert trips[3] <= 2 and trips[4:] == [1] * 5, (trips, counts)
    assert sess.stats.early_sync_answers >= 2 * 5, sess.stats
    seq = next(iter(sess.recorder.sequences.values()))
    assert seq.size_ops and any(seq.sized), "identified without size symbols"
    # reshape(top.numel() * 2): twice a size, {"z": [op, i, 2]}
    assert any('"z": [' in json.dumps(op["a"]) and ', 2]}' in json.dumps(op["a"]) for op in seq.ops)


def test_a_size_the_program_does_not_pass_on_diverges_and_stays_correct():
    """When n crosses the cap (topk takes 100, not n), the program's argument is not the
    symbol's value: a divergence, detected at that call; the frame completes op by op
    with the plain program's output. Without early replay, the sync points are replayed
    as the program reaches them (a round trip each), still with the real sizes."""
    torch.manual_seed(1)
    w = nn.Parameter(torch.ones(256))
    for early in (True, False):
        sess = _session(early_replay=early)
        f = _detector_like(w)
        trips = []
        with torch.no_grad():
            for i in range(6):
                frac = 0.2 + 0.02 * i if i < 5 else 0.9        # frame 5: n > 100
                x = (torch.rand(256) < frac).float() * 0.5
                trips.append(_frame(sess, f, x))
        assert sess.stats.sequences_identified == 1, (early, sess.stats)
        assert sess.stats.divergences == 1, (early, sess.stats)
        if early:
            assert trips[4] == 1, trips
        else:
            assert all(t <= 3 for t in trips[3:5]), trips   # two sync points, the end


@pytest.mark.parametrize("early_replay", [True, False])
def test_a_robot_write_into_an_input_between_two_reads(early_replay):
    """The program reads its tensor, doubles it in place on the robot, reads it again.
    The replay sends its inputs when it is sent, after the write: it must send what the
    program passed at the first read (it used to send the doubled tensor for both, a
    wrong output from the fourth frame on)."""
    w = nn.Parameter(torch.full((16,), 0.5))
    sess = _session(early_replay=early_replay)
    trips = []
    with torch.no_grad():
        for i in range(7):
            def f(x):
                x = x.clone()          # the inference's own robot tensor
                h = x * w
                x.mul_(2)              # robot-side, in place, between the two reads
                return h + x * w
            trips.append(_frame(sess, f, torch.linspace(-1, 1, 16) + i))
    assert sess.stats.divergences == 0 and trips[4:] == [1] * 3, (trips, sess.stats)


def _selection_frames(seed, after_selection, frames=8):
    """Frames of ``after_selection(h[h > 0.1])`` with ``h = x * w``, whose selection has a
    different length each frame, plainly and under a record_replay session (asserting the
    same output); (session, round trips of each frame)."""
    torch.manual_seed(seed)
    w = nn.Parameter(torch.ones(64))
    sess = _session()
    trips = []
    with torch.no_grad():
        for i in range(frames):
            x = torch.rand(64) * (0.3 + 0.05 * i)
            def f(x):
                h = x * w
                return after_selection(h[h > 0.1])               # n values: a sync point
            trips.append(_frame(sess, f, x))
    return sess, trips


def test_in_place_writes_into_a_tensor_of_a_data_dependent_size():
    """``flags[sel > 0.3] = True`` writes in place into a tensor as long as the selection:
    its result is its input (no shape of its own to take from the reply); the frames
    replay in one round trip with the plain program's output."""
    def after(sel):
        flags = torch.zeros_like(sel, dtype=torch.bool)
        flags[sel > 0.3] = True                           # in place, n long
        return torch.stack([sel[flags].sum(), sel.view(sel.numel(), 1).sum()])
    sess, trips = _selection_frames(3, after)
    assert sess.stats.sequences_identified == 1 and sess.stats.divergences == 0, sess.stats
    # (the True written is a robot tensor built after the sync point: predicted, and the
    # early replay possible, once its content has repeated in two replays)
    assert trips[5:] == [1] * 3, trips


def test_a_tensor_the_program_builds_of_a_data_dependent_size():
    """After its sync point the program builds a robot tensor as long as the selection
    (``torch.full((n,), 1.5)``, as detectors build level indices): the sequence's input of
    that shape is a size symbol too. Its content changes with n, so it is uploaded when
    the program builds it: the early replay cannot leave before, and the sync point costs
    a round trip. Identified with symbols, no divergence, the plain program's outputs."""
    def after(sel):
        scale = torch.full((sel.numel(),), 1.5)           # a robot tensor of n
        return (sel * scale).sort().values[-3:]
    sess, trips = _selection_frames(2, after)
    assert sess.stats.sequences_identified == 1 and sess.stats.divergences == 0, sess.stats
    seq = next(iter(sess.recorder.sequences.values()))
    assert any("z" in json.dumps(m) for m in seq.input_metas), seq.input_metas
    assert all(t <= 2 for t in trips[4:]), trips


def test_a_shape_the_record_saw_twice_is_still_checked_downstream_of_a_size():
    """``sel[:10]`` had 10 elements in both recorded inferences (12 and 15 selected), so
    its recorded shape is the same in both; with 5 selected it has 5. An operator that
    reads a tensor whose size changes takes its shapes from this frame's reply, never from
    the record: the frame gives the plain program's output (a divergence, or a replay)."""
    w = nn.Parameter(torch.ones(32))
    sess = _session()
    with torch.no_grad():
        for n in (12, 15, 13, 14, 17, 5, 11, 4):
            x = torch.cat([torch.ones(n), -torch.ones(32 - n)]) * torch.linspace(1, 2, 32)
            def f(x):
                h = x * w
                sel = h[h > 0]                               # n values: a sync point
                col = sel.view(sel.numel(), 1)               # n as an argument: a symbol
                return torch.cat([sel[:10] * 3, col[:1, 0]])  # 10 values while n >= 10
            _frame(sess, f, x)
    seq = sess.recorder.sequences and next(iter(sess.recorder.sequences.values()))
    assert sess.stats.sequences_identified >= 1 and (not seq or seq.size_ops), sess.stats


def test_retinanet_whose_box_count_changes_replays_in_one_round_trip():
    """RetinaNet with its score threshold set where a trained detector's would keep a
    handful of boxes (here: the 99.99th percentile of frame 0's random-weight scores), so
    that the number of boxes changes from frame to frame: identified with size symbols,
    one round trip per frame once its anchors are predicted, the outputs of the plain
    model on every frame."""
    skip_off_cpu("its thresholded random-weight scores hold near-ties, which float rounding "
                 "reorders")
    spec = get_spec("retinanet_resnet50_fpn")
    model = spec.build().eval()
    inner = model.model
    xs = [spec.example_input(spec.test_input_size, seed=i) for i in range(10)]
    with torch.no_grad():
        feats = inner.backbone(inner.transform(list(xs[0]))[0].tensors)
        logits = inner.head.classification_head(list(feats.values()))
        inner.score_thresh = float(torch.sigmoid(logits).flatten().quantile(0.9999))
    sess = _session()
    trips, boxes = [], []
    with torch.no_grad():
        for x in xs:
            ref = model(x)
            before = sess.stats.round_trips
            with sess:
                out = sess.materialize_tree(model(x))
            trips.append(sess.stats.round_trips - before)
            boxes.append(len(ref[0]["boxes"]))
            for key in ("boxes", "scores", "labels"):
                assert_same_as_local(out[0][key], ref[0][key], rtol=1e-4, atol=1e-4)
    assert len(set(boxes)) >= 3, boxes
    assert trips[6:] == [1] * 4, (trips, boxes)
    assert sess.stats.divergences == 0, sess.stats


def _ops_request(args, tensors=(), session="", client_id="t"):
    return ComputeRequest(client_id=client_id, model="", entry="ops", session=session, tensors=list(tensors),
                          args_json=json.dumps(args))


def _open_session(server, client_id="t") -> str:
    """A new ops session of ``client_id``: its id, as the server issued it."""
    resp = server.handle("compute", _ops_request({"ops": []}, client_id=client_id))
    assert resp.status == StatusCode.OK, resp.status_text
    return json.loads(resp.result_json)["session"]


@pytest.mark.parametrize("args,code", [
    ({"ops": [{"op": "os::system", "a": {"l": []}, "k": {}}]}, StatusCode.BAD_REQUEST),
    ({"ops": [{"op": "aten::from_file", "a": {"l": ["/etc/passwd"]}, "k": {}}]}, StatusCode.BAD_REQUEST),
    ({"ops": [{"op": "aten::relu", "a": {"l": [{"t": {"h": 12345}}]}, "k": {}}]}, StatusCode.STALE_HANDLE),
    ({"ops": [{"op": "aten::relu", "a": [1], "k": {}}]}, StatusCode.BAD_REQUEST),
    ({"ops": [{"op": "aten::ones", "a": {"l": [{"l": [1 << 20, 1 << 20]}]}, "k": {}}]}, StatusCode.TOO_LARGE),
    ({"replay": {"id": "nope", "n": 1}}, StatusCode.STALE_HANDLE),
    ({"fetch": [7]}, StatusCode.STALE_HANDLE),
    ({"evil": 1}, StatusCode.BAD_REQUEST),
    ({"define": {"id": "x", "n_inputs": 0, "ops": [{"op": "aten::relu", "a": {"l": [{"t": {"o": [3, 0]}}]}}]}},
     StatusCode.BAD_REQUEST),
    ({"define": {"id": "x", "n_inputs": 1, "ops": [{"op": "aten::view", "a": {"l": [{"t": {"i": 0}}, {"l": [{"z": [0, 0]}]}]}}]}},
     StatusCode.BAD_REQUEST),     # a size symbol of an operator not before it
    ({"define": {"id": "x", "n_inputs": 1, "ops": [{"op": "aten::view", "a": {"l": [{"t": {"i": 0}}, {"z": [-1, "a"]}]}}]}},
     StatusCode.BAD_REQUEST),
    ({"ops": [{"op": "aten::ones", "a": {"l": [{"l": [{"z": [0, 0]}]}]}, "k": {}}]}, StatusCode.BAD_REQUEST),
])
def test_server_refuses_bad_ops_requests(args, code):
    server = OffloadServer(ServerConfig(ops_sandbox=False, device=SERVER_DEVICE, max_session_mib=64))
    sid = _open_session(server)
    resp = server.handle("compute", _ops_request(args, session=sid))
    assert resp.status == code, resp.status_text
    ok = server.handle("compute", _ops_request({"ops": [{"op": "aten::ones", "a": {"l": [{"l": [2]}]}, "k": {}}]},
                                               session=sid))
    assert ok.status == StatusCode.OK, ok.status_text


def test_server_can_refuse_transparent_sessions():
    server = OffloadServer(ServerConfig(ops_sandbox=False, device=SERVER_DEVICE, transparent=False))
    resp = server.handle("compute", _ops_request({"ops": []}))
    assert resp.status == StatusCode.UNAUTHORIZED


@pytest.mark.parametrize("early_replay", [False, True])
def test_launcher_session_survives_server_loss_and_resumes(early_replay):
    """With local_fallback (the launcher), a server that disappears mid-program costs no
    result: proxies are recomputed on the robot from their recipes, operators run locally
    while the server is gone, and offloading resumes once a probe reaches it again. (An
    early replay leaves at the first operator, so there the server dies just before it.)"""
    torch.manual_seed(0)
    net = _Net().eval()
    transport = InProcessTransport(OffloadServer(ServerConfig(ops_sandbox=False, device=SERVER_DEVICE)))
    server = transport.server
    sess = RemoteSession(lambda r, t: transport.call(method_of(r), r, t), mode="record_replay",
                         local_fallback=True, retry_interval_s=0.05, timeout_s=2.0,
                         early_replay=early_replay)
    with torch.no_grad():
        for i in range(12):
            x = torch.randn(1, 3, 8, 8)
            ref = net(x)
            with sess:
                if i in (4, 8) and early_replay:
                    transport.server = None       # the server dies as the inference starts
                h = torch.relu(net.a(x))          # remote
                if i in (4, 8):
                    transport.server = None       # the server dies mid-inference
                y = net.b(h.mean(dim=(2, 3))).cpu()
            assert_same_as_local(y, ref)
            if i in (4, 8):
                assert sess.down.is_set()
                remote_before = sess.stats.ops_remote
                transport.server = server         # and comes back
                deadline = time.monotonic() + 5
                while sess.down.is_set() and time.monotonic() < deadline:
                    time.sleep(0.02)
                assert not sess.down.is_set()
    assert sess.stats.server_losses == 2
    assert sum(i.server_lost for i in sess.stats.inferences) == 2, sess.stats.inferences
    assert sess.stats.ops_remote + sess.stats.ops_replayed > remote_before


def test_compiled_replay_matches_eager_with_multi_outputs_lists_and_continuations():
    """The server's compiled replay (slots, fills, last-use frees) against eager torch on a
    sequence with a multi-output operator whose second tensor is read later, a list of
    tensors as an argument, a tensor and a scalar as keyword arguments, a session tensor
    and a continuation that starts where a sync point stopped."""
    server = OffloadServer(ServerConfig(ops_sandbox=False, device=SERVER_DEVICE, max_session_mib=64))
    sid = _open_session(server)

    def call(args):
        resp = server.handle("compute", _ops_request(args, session=sid))
        assert resp.status == StatusCode.OK, resp.status_text
        return json.loads(resp.result_json), resp

    made, _ = call({"ops": [{"op": "aten::arange.start", "a": {"l": [0, 12]}, "k": {"dtype": {"dtype": "float32"}}},
                            {"op": "aten::full", "a": {"l": [{"l": [2, 3]}, 0.5]}, "k": {}}]})
    h_range, h_half = made["ops"][0]["t"]["h"], made["ops"][1]["t"]["h"]
    shaped, _ = call({"ops": [{"op": "aten::reshape", "a": {"l": [{"t": {"h": h_range}}, {"l": [2, 6]}]}, "k": {}}]})
    h_x = shaped["ops"][0]["t"]["h"]
    ops = [
        {"op": "aten::split.Tensor", "a": {"l": [{"t": {"i": 0}}, 3, 1]}},
        {"op": "aten::mul.Tensor", "a": {"l": [{"t": {"c": h_half}}]}, "k": {"other": {"t": {"o": [0, 1]}}}},
        {"op": "aten::cat", "a": {"l": [{"l": [{"t": {"o": [1, 0]}}, {"t": {"o": [0, 0]}}]}, 1]}},
        {"op": "aten::add.Tensor", "a": {"l": [{"t": {"o": [2, 0]}}]}, "k": {"other": {"t": {"i": 0}}, "alpha": 2}},
        {"op": "aten::sum.dim_IntList", "a": {"l": [{"t": {"o": [3, 0]}}, {"l": [1]}]}},
    ]
    x = torch.arange(0, 12, dtype=torch.float32).reshape(2, 6)
    a, b = torch.split(x, 3, 1)
    m = b * 0.5
    c = torch.cat([m, a], 1)
    d = torch.add(c, x, alpha=2)
    expected = {(4, 0): d.sum(1), (1, 0): m}

    def fetched(resp, keys):
        from robot_offload import codec
        return {k: codec.decode(t) for k, t in zip(keys, resp.tensors)}

    want = [[4, 0], [1, 0]]
    res, resp = call({"define": {"id": "seq", "n_inputs": 1, "ops": ops},
                      "replay": {"id": "seq", "n": 5, "inputs": [[0, {"h": h_x}]], "keep": [[0, 1]],
                                 "fetch": want, "sync": [2]}})
    got = fetched(resp, [tuple(k) for k in want])
    for k, v in expected.items():
        torch.testing.assert_close(got[k], v)
    assert [k[:2] for k in res["replay"]["kept"]] == [[0, 1]]
    assert res["replay"]["rets"]["2"]["t"]["s"] == [2, 6]
    # The same sequence in two requests: up to a sync point, then the rest.
    first, _ = call({"replay": {"id": "seq", "n": 3, "inputs": [[0, {"h": h_x}]], "sync": [2],
                                "keep": [[1, 0]]}})
    assert first["replay"]["rets"]["2"]["t"]["s"] == [2, 6]
    _, resp = call({"replay": {"id": "seq", "from": 3, "n": 5, "fetch": want}})
    got = fetched(resp, [tuple(k) for k in want])
    torch.testing.assert_close(got[(4, 0)], expected[(4, 0)])
    torch.testing.assert_close(got[(1, 0)], expected[(1, 0)])
    # A released session tensor is refused, not read as a missing (None) argument.
    call({"release": [h_half], "ops": []})
    resp = server.handle("compute", _ops_request({"replay": {"id": "seq", "n": 5, "inputs": [[0, {"h": h_x}]]}},
                                                 session=sid))
    assert resp.status == StatusCode.STALE_HANDLE, resp.status_text


def test_stats_written_by_the_periodic_and_the_final_writer_at_once_stay_whole(tmp_path):
    """``--stats-out`` is rewritten every few seconds on a thread and once more at the end:
    the two writers at once never lose a file (one's temporary file renamed by the other)
    or leave half of one."""
    import json
    import threading
    from types import SimpleNamespace
    from robot_offload.transparent import launcher

    args = SimpleNamespace(stats_out=str(tmp_path / "stats.json"), mode="auto")
    session = SimpleNamespace(stats=SimpleNamespace(summary=lambda: {"round_trips": 3}), not_static=False)
    errors = []

    def writer():
        for _ in range(400):
            try:
                launcher._write_stats(args, session)
            except OSError as e:
                errors.append(e)

    threads = [threading.Thread(target=writer) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    with open(args.stats_out) as f:
        assert json.load(f) == {"round_trips": 3, "mode": "auto", "not_static": False}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stats.json"]     # no temporary left
