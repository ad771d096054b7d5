"""``auto`` for programs run through interception: each inference of an identified
sequence runs on the robot or is replayed on the server, whichever measured faster, and
gives what a plain run gives either way."""

import time

import pytest
import torch
from torch import nn

from robot_offload.transparent import proxy, robot_choice
from robot_offload.transparent.robot_choice import ROBOT, SERVER, RobotOrServer


def _feed(chooser, robot_s, server_s, n):
    """n inferences, each timed as the given latencies: the choices made."""
    made = []
    for _ in range(n):
        where = chooser.choose()
        chooser.observe(where, robot_s if where == ROBOT else server_s)
        made.append(where)
    return made


@pytest.mark.robot_side
def test_the_server_first_then_one_robot_probe_then_the_faster():
    c = RobotOrServer()
    made = _feed(c, robot_s=0.010, server_s=0.030, n=6)
    assert made[:3] == [SERVER, SERVER, ROBOT], made       # the robot timed after two replays
    assert made[3:] == [ROBOT] * 3 and c.serving == ROBOT and c.last["reason"] == "served"
    c = RobotOrServer()
    made = _feed(c, robot_s=0.030, server_s=0.010, n=8)
    assert made.count(ROBOT) == 1 and made[-1] == SERVER, made


@pytest.mark.robot_side
def test_it_follows_a_slower_link_within_a_few_inferences_and_probes_back():
    c = RobotOrServer(probe_every=5, probe_every_max=20)
    _feed(c, robot_s=0.020, server_s=0.010, n=10)
    assert c.serving == SERVER
    made = _feed(c, robot_s=0.020, server_s=0.080, n=6)   # the link slows
    assert made.index(ROBOT) <= 3 and c.serving == ROBOT, made
    made = _feed(c, robot_s=0.020, server_s=0.010, n=25)  # and recovers: a probe finds it
    first = made.index(SERVER)
    assert first <= 20 and all(m == SERVER for m in made[first:]), made


@pytest.mark.robot_side
def test_probes_of_a_slow_choice_cost_about_the_probe_cost():
    c = RobotOrServer(probe_every=10, probe_every_max=100, probe_cost=0.05)
    assert c.probe_interval(0.010, 0.011) == 10          # close: every probe_every
    assert c.probe_interval(0.010, 0.030) == 40          # 20 ms more, 5 % of 10 ms: 1 in 40
    assert c.probe_interval(0.010, 5.0) == 100           # never rarer than probe_every_max
    made = _feed(c, robot_s=0.010, server_s=0.030, n=203)
    # After the first replays, one server probe every 40 robot inferences.
    assert 4 <= made[3:].count(SERVER) <= 6, made


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(3, 8, 3)
        self.b = nn.Conv2d(8, 8, 3)
        self.c = nn.Linear(8, 2)

    def forward(self, x):
        h = torch.relu(self.b(torch.relu(self.a(x))))
        return self.c(h.mean(dim=(2, 3)))


class _DelayedTransport:
    """The in-process server behind a link whose extra delay per call the test sets."""

    def __init__(self, server):
        from robot_offload.protocol import method_of
        from robot_offload.transport.inproc import InProcessTransport
        self.transport, self.method_of = InProcessTransport(server), method_of
        self.delay_s = 0.0

    def __call__(self, request, timeout_s):
        time.sleep(self.delay_s)
        return self.transport.call(self.method_of(request), request, timeout_s)


def _frames(sess, net, n, seed):
    """n frames of a camera loop through ``sess``: (phase of each frame, whether every
    output equalled the plain run's bit for bit)."""
    from robot_offload.stats import FrameStats
    g = torch.Generator().manual_seed(seed)
    phases, equal = [], True
    for _ in range(n):
        x = torch.rand(1, 3, 16, 16, generator=g)
        with torch.no_grad():
            ref = net(x)
            stats = FrameStats(mode="auto", model="net")
            with sess.frame(stats), sess:
                y = net(x).cpu()
        phases.append(stats.phase)
        equal = equal and torch.equal(y, ref)
    return phases, equal


@pytest.fixture
def slow_robot(monkeypatch):
    """The robot computes each module call of a robot inference 10 ms slower (a Jetson's
    CPU beside the server's), and the choosers probe at least every 8 inferences. Only
    module calls that run without interception are slowed: a robot inference that stayed
    intercepted would not be, and would not win on a slow link."""
    from torch.nn.modules import module as nn_module

    def slower(module, args):
        if proxy.interception_suspended():
            time.sleep(0.010)
    hook = nn_module.register_module_forward_pre_hook(slower)
    monkeypatch.setattr(robot_choice, "RobotOrServer",
                        lambda: RobotOrServer(probe_every=4, probe_every_max=8))
    yield
    hook.remove()


def test_auto_session_follows_the_link_and_equals_the_plain_run(shared_server, slow_robot):
    from robot_offload.transparent.session import RemoteSession
    torch.manual_seed(0)
    net = _Net().eval()
    link = _DelayedTransport(shared_server)
    sess = RemoteSession(link, mode="auto", timeout_s=10.0, local_fallback=True)
    # A fast link: after recording and one robot probe, the server serves.
    phases, equal = _frames(sess, net, 14, seed=1)
    assert equal
    assert phases.count("robot") <= 2 and phases[-4:].count("replaying") >= 3, phases
    assert sess.last_choice["server_ms"] < sess.last_choice["robot_ms"], sess.last_choice
    # The link slows by 60 ms a call: within a few frames the robot computes them.
    link.delay_s = 0.06
    phases, equal = _frames(sess, net, 8, seed=2)
    assert equal
    assert phases[-4:] == ["robot"] * 4, phases
    # It recovers: a probe finds the server faster again.
    link.delay_s = 0.0
    phases, equal = _frames(sess, net, 14, seed=3)
    assert equal
    assert phases[-4:].count("replaying") >= 3, phases
    assert sess.stats.divergences == 0 and sess.stats.server_losses == 0


def test_a_robot_inference_runs_nothing_on_the_server(shared_server, monkeypatch):
    """Once the robot serves, its frames make no round trip: the robot computes them as a
    plain run does."""
    from robot_offload.transparent.session import RemoteSession
    monkeypatch.setattr(robot_choice, "RobotOrServer", lambda: RobotOrServer(probe_every_max=1000))
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 2, 3)).eval()
    link = _DelayedTransport(shared_server)
    sess = RemoteSession(link, mode="auto", timeout_s=10.0, local_fallback=True)
    link.delay_s = 0.05
    outs, refs = [], []
    for _ in range(8):
        x = torch.rand(1, 3, 12, 12)
        with sess:
            outs.append(net(x).cpu())
        refs.append(net(x))
    assert all(torch.equal(a, b) for a, b in zip(outs, refs))
    phases = [i.phase for i in sess.stats.inferences]
    assert phases[-3:] == ["robot"] * 3, phases
    trips = sess.stats.round_trips
    with sess:
        net(torch.rand(1, 3, 12, 12)).cpu()
    assert sess.stats.round_trips == trips and sess.stats.inferences[-1].phase == "robot"


def _robot_serving_session(shared_server, monkeypatch):
    """An auto session behind a link 50 ms slower a call, whose choosers never probe the
    server again once the robot measured faster."""
    from robot_offload.transparent.session import RemoteSession
    monkeypatch.setattr(robot_choice, "RobotOrServer", lambda: RobotOrServer(probe_every_max=1000))
    link = _DelayedTransport(shared_server)
    link.delay_s = 0.05
    return RemoteSession(link, mode="auto", timeout_s=10.0, local_fallback=True)


def test_a_robot_inference_runs_its_module_calls_without_interception(shared_server, monkeypatch):
    """Once the robot computes an inference, the model's module calls after its first
    operator run as in a plain program (no per-operator interception); the program's
    operators after the model returns are intercepted again, also after a forward that
    raised."""
    from robot_offload.transparent.threads import _intercepted_by

    class Flaky(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 2, 3))
            self.fail = False

        def forward(self, x):
            y = self.body(x)
            if self.fail:
                raise ValueError("the program's own error")
            return y

    sess = _robot_serving_session(shared_server, monkeypatch)
    torch.manual_seed(0)
    net = Flaky().eval()
    seen = []
    net.body[2].register_forward_pre_hook(lambda m, a: seen.append(_intercepted_by(sess)))
    after = []
    for _ in range(8):
        x = torch.rand(1, 3, 12, 12)
        with sess:
            y = net(x)
            after.append(_intercepted_by(sess))
            out = (y * 2).cpu()
        assert torch.equal(out, net(x) * 2)
        seen.pop()                    # (the plain run's call)
    phases = [i.phase for i in sess.stats.inferences]
    assert phases[-3:] == ["robot"] * 3, phases
    assert seen[:3] == [True] * 3 and seen[-3:] == [False] * 3, seen
    assert all(after), after
    net.fail = True
    with sess:
        with pytest.raises(ValueError):
            net(torch.rand(1, 3, 12, 12))
        assert _intercepted_by(sess) and not proxy.interception_suspended()
    assert sess.stats.inferences[-1].phase == "robot"


def test_a_loop_inside_a_module_chooses_for_every_inference(shared_server, monkeypatch):
    """A program whose frame loop runs inside a module call: each inference of the model
    it calls begins a new choice (the robot computes each one, timed on its own)."""
    sess = _robot_serving_session(shared_server, monkeypatch)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 2, 3)).eval()

    class App(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = net

        def forward(self, frames):
            return [self.net(x).cpu() for x in frames]

    frames = [torch.rand(1, 3, 12, 12) for _ in range(10)]
    with sess:
        outs = App()(frames)
    assert all(torch.equal(o, net(x)) for o, x in zip(outs, frames))
    assert sess.stats.robot_inferences >= 4 and sess.stats.inferences_total == 10, (
        [i.phase for i in sess.stats.inferences])
    assert [i.phase for i in sess.stats.inferences][-3:] == ["robot"] * 3


class _Scripted:
    """A chooser that alternates: two inferences on the server, two on the robot."""

    def __init__(self):
        self.n, self.last = 0, {}

    def choose(self):
        self.n += 1
        where = SERVER if self.n % 4 in (1, 2) else ROBOT
        self.last = {"choice": where, "reason": "scripted"}
        return where

    def observe(self, where, seconds):
        pass


def test_a_forward_that_writes_its_weights_stays_intercepted(shared_server, monkeypatch):
    """A forward that writes into a weight in place, in inference mode (the weight has no
    version counter): the upload cache must see every such write, so this program's robot
    inferences stay intercepted, and every output, computed on the robot or on the server
    after the robot's writes, equals the plain run's."""
    from robot_offload.transparent.session import RemoteSession
    from robot_offload.transparent.threads import _intercepted_by

    class Drifting(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)
            self.gain = nn.Parameter(torch.ones(1))
            self.act = nn.ReLU()

        def forward(self, x):
            y = self.conv(x)
            self.gain.mul_(1.5)
            return self.act(y * self.gain)

    monkeypatch.setattr(robot_choice, "RobotOrServer", _Scripted)
    sess = RemoteSession(_DelayedTransport(shared_server), mode="auto", timeout_s=10.0, local_fallback=True)
    torch.manual_seed(0)
    with torch.inference_mode():
        net, plain = Drifting().eval(), Drifting().eval()
        plain.load_state_dict(net.state_dict())
        seen = []
        net.act.register_forward_pre_hook(lambda m, a: seen.append(_intercepted_by(sess)))
        for _ in range(16):
            x = torch.rand(1, 3, 10, 10)
            with sess:
                out = net(x).cpu()
            assert torch.equal(out, plain(x))
    phases = [i.phase for i in sess.stats.inferences]
    assert phases.count("robot") >= 2, phases
    assert sess.weights_written_in_forward
    assert all(seen), seen


@pytest.mark.robot_side
def test_a_long_run_keeps_a_bounded_record_of_its_inferences():
    from robot_offload.transparent.stats import SessionStats
    stats = SessionStats()
    for k in range(5 * SessionStats.KEEP_INFERENCES):
        stats.begin("robot" if k % 2 else "replaying")
    assert stats.inferences_total == 5 * SessionStats.KEEP_INFERENCES
    assert len(stats.inferences) <= 2 * SessionStats.KEEP_INFERENCES
    before = stats.inferences_total
    stats.begin("robot")
    stats.begin("robot")
    assert [i.phase for i in stats.since(before)] == ["robot", "robot"] and stats.since(stats.inferences_total) == []
    assert len(stats.summary()["inferences"]) == SessionStats.KEEP_INFERENCES


class _WatchingSession:
    """What the interceptor and the forward watch call on a session, and no more: each
    operator runs here as it is; the first one of an inference starts a suspended watch,
    as a robot inference of ``auto`` does."""

    def __init__(self):
        self.ops, self.regions_s, self.started, self.watch_next = [], [], 0, True

    def dispatch(self, func, args, kwargs):
        self.ops.append(str(func))
        if self.watch_next:
            self.watch_next = False
            assert proxy.watch_forward(self, suspend=True)
        return func(*args, **kwargs)

    def _forward_region_started(self):
        self.started += 1

    def _forward_region_ended(self, elapsed_s):
        self.regions_s.append(elapsed_s)


class _Raises(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.act = nn.Linear(4, 4), nn.ReLU()

    def forward(self, x):
        self.act(self.lin(x))
        raise RuntimeError("the program's forward failed")


@pytest.mark.robot_side
def test_the_interceptor_leaves_the_dispatch_stack_for_the_rest_of_the_forward_and_returns():
    """The mechanism under a robot inference, with no server (so that it also runs under the
    robot's torch 2.1): after the module call of the first operator, the thread's operators
    are not intercepted until the outermost module call returns or raises."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode
    proxy._install_hooks()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).eval()
    x = torch.randn(3, 4)
    plain = net(x)
    sess = _WatchingSession()
    mode = proxy.Interceptor(sess)
    with torch.no_grad(), mode:
        out = net(x)
        in_forward = list(sess.ops)
        assert _get_current_dispatch_mode() is mode and not proxy.interception_suspended()
        out.add(1.0)
    assert in_forward and not any("relu" in op for op in in_forward), in_forward   # only the first Linear's
    assert sess.ops[len(in_forward):] == ["aten.add.Tensor"], sess.ops
    assert sess.started == 1 and len(sess.regions_s) == 1 and sess.regions_s[0] > 0
    torch.testing.assert_close(out, plain.detach(), rtol=0, atol=0)

    raises = nn.Sequential(_Raises())
    sess = _WatchingSession()
    mode = proxy.Interceptor(sess)
    with torch.no_grad(), mode:
        with pytest.raises(RuntimeError, match="forward failed"):
            raises(x)
        assert _get_current_dispatch_mode() is mode and not proxy.interception_suspended()
        x.mul(2.0)
    assert sess.ops[-1] == "aten.mul.Tensor" and len(sess.regions_s) == 1, sess.ops
    assert _get_current_dispatch_mode() is None
