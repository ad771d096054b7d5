"""``auto``: what it returns is what the candidate it ran returns -- local's outputs, for
every registry model, whichever candidate the predicted bandwidth makes it pick -- and a
switch to it, or a server lost under it, loses no frame."""

import dataclasses
import time

import numpy as np
import pytest
import torch

from robot_offload import structure
from robot_offload.backends.auto import IMAGE, LOCAL, LOP, LOP_PARTITION, LOP_SPATIAL, PredictionErrors, _Option
from robot_offload.client import ClientConfig, OffloadClient
from robot_offload.models import get_spec, names
from robot_offload.transport.inproc import InProcessTransport

from devices import ON_CPU, assert_same_as_local, assert_same_up_to_summation_order

#: predicted bandwidths the frames are run at: a dead link, 5 and 100 Mbit/s, a free one
BANDWIDTHS = (1e3, 5e6, 100e6, 1e12)


@pytest.fixture(scope="module")
def profile_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("profiles"))


def _client(server, model, profile_dir, transport=None, **kw):
    spec = get_spec(model)
    cfg = dict(model=model, mode="auto", input_size=spec.test_input_size, load_timeout_s=120,
               timeout_s=120, profile_dir=profile_dir, partition_codecs=("raw",))
    cfg.update(kw)
    client = OffloadClient(ClientConfig(**cfg), transport or InProcessTransport(server))
    assert client.connect(), client.link.last_error
    lop = client._get_backend("auto").lop
    lop.calibration_inputs, lop.profile_repeats = 1, 1
    return client


def _frame(spec, size, seed):
    rng = np.random.default_rng(seed)
    if spec.input_kind == "image":
        return rng.integers(0, 256, (size[0], size[1], 3), dtype=np.uint8)
    from robot_offload.models.agrnav import synthetic_scene
    return synthetic_scene(seed)


@pytest.mark.parametrize("model", names())
def test_auto_returns_what_local_returns(shared_server, profile_dir, model):
    client = _client(shared_server, model, profile_dir)
    try:
        ran = set()
        for k, bw in enumerate(BANDWIDTHS * 2):
            frame = _frame(client.spec, client.input_size, seed=k)
            client.predicted_bandwidth_bps = bw
            y, stats = client.process(frame)
            assert stats.executed_mode == "auto", stats.fallback_reason
            choice = stats.extra["auto"]
            assert stats.plan.startswith(f"auto:{choice['candidate']}") and choice["reason"]
            ran.add(choice["candidate"])
            with torch.inference_mode():
                ref = client.model(client.preprocess(frame))
            assert_same_up_to_summation_order(y, ref, f"{model} at {bw:g} bit/s: {stats.plan}")
        assert ran <= {"lop", "full_offload_image"}
    finally:
        client.close()


def test_a_dead_link_never_probes_the_image(shared_server, profile_dir):
    client = _client(shared_server, "resnet18", profile_dir)
    try:
        client.predicted_bandwidth_bps = 1e3     # 1 kbit/s: any upload takes minutes
        frame = _frame(client.spec, client.input_size, seed=1)
        for _ in range(8):
            _, stats = client.process(frame)
            assert stats.executed_mode == "auto"
            assert stats.extra["auto"]["candidate"] == "lop", stats.plan   # never a probe of the image
        predicted = stats.extra["auto"]["predicted"]
        assert predicted["full_offload_image"]["latency_ms"] > 5 * predicted["lop"]["latency_ms"]
    finally:
        client.close()


def test_the_energy_objective_runs_the_lowest_predicted_energy(shared_server, tmp_path):
    """Every frame runs the candidate of lowest predicted energy. At 20 Mbit/s, with the
    server predicted 100x the robot (nothing measured yet), that is the camera image (a
    quarter of the float input's bytes; the robot idles while the server computes): its
    outputs are local's, bit for bit on one device (one preprocessing function on both
    sides), and what it measured becomes the profile's server time for the next frames.
    Which frame first runs it depends on the load the solver measures, not on this test."""
    # its own profile directory: no server time saved by another test's run
    client = _client(shared_server, "resnet18", str(tmp_path), objective="energy", server_speedup=100.0,
                     probe_every=0)      # no measured choice: the prediction decides
    try:
        runs = []
        # the first frame (it profiles) at 1 kbit/s: lop runs it on the robot, so no server
        # time is measured before the 20 Mbit/s frame
        for k, bw in enumerate((1e3, 20e6) + BANDWIDTHS + (20e6,)):
            frame = _frame(client.spec, client.input_size, seed=k)
            client.predicted_bandwidth_bps = bw
            y, stats = client.process(frame)
            a = stats.extra["auto"]
            if k == 0:
                assert "predicted" not in a     # the first frame: lop measures the profile
                continue
            energy = {c: v["energy_mj"] for c, v in a["predicted"].items()}
            assert energy[a["candidate"]] <= min(energy.values()) + 0.01, a     # (rounded to 0.01 mJ)
            assert a["reason"] == "lowest predicted energy"
            runs.append(a["candidate"])
            if a["candidate"] == "full_offload_image":
                assert stats.plan.startswith("auto:full_offload_image input=frame uint8")
                assert stats.bytes_up == frame.nbytes and stats.round_trips == 1
                with torch.inference_mode():
                    ref = client.model(client.preprocess(frame))
                if ON_CPU:
                    assert all(torch.equal(a_, b_) for a_, b_ in zip(structure.flatten(y)[0],
                                                                      structure.flatten(ref)[0]))
                else:
                    assert_same_as_local(y, ref)
        # idle, the 20 Mbit/s frame right after profiling runs it; on a loaded machine the
        # solver measures the server slower than predicted and a later frame does
        assert "full_offload_image" in runs, runs
        assert runs[1] == "lop", runs     # 1 kbit/s
    finally:
        client.close()


class _SlowImages(InProcessTransport):
    """Every camera image's offload waits ``wait_s`` more on the link (the server's
    compute is not slowed, so its measured time keeps the image's prediction cheap)."""

    def __init__(self, server, wait_s):
        super().__init__(server)
        self.wait_s = wait_s

    def _call(self, method, request, timeout_s):
        if method == "compute" and request.entry == "forward_image":
            time.sleep(self.wait_s)
        return super()._call(method, request, timeout_s)


def test_the_energy_objective_serves_what_measured_the_fewest_joules(shared_server, tmp_path, monkeypatch):
    """With the energy objective the choice between candidates is measured too, in the
    frames' joules: the camera image's offload, predicted cheapest (1 mJ: a cost model
    that errs, as it does on a link it cannot see) but waiting 0.4 s on the link every
    time (1.6 J of an idle robot), is timed, and then a candidate that measured fewer
    joules serves. On the prediction alone the image would serve every frame."""
    client = _client(shared_server, "resnet18", str(tmp_path), objective="energy",
                     transport=_SlowImages(shared_server, 0.4), hedge=False)
    auto = client._get_backend("auto")
    image_option = auto._image_option
    monkeypatch.setattr(auto, "_image_option", lambda *a: dataclasses.replace(image_option(*a), energy_j=1e-3))
    try:
        client.predicted_bandwidth_bps = 1e3
        client.process(_frame(client.spec, client.input_size, seed=0))     # profiles, on the robot
        client.predicted_bandwidth_bps = 20e6
        ran = []
        for k in range(1, 13):
            frame = _frame(client.spec, client.input_size, seed=k)
            y, stats = client.process(frame)
            a = stats.extra["auto"]
            ran.append((a["candidate"], a["reason"], round(stats.energy_j, 2)))
            assert "medians_mj" in a and "medians_ms" not in a, a
            with torch.inference_mode():
                ref = client.model(client.preprocess(frame))
            assert_same_up_to_summation_order(y, ref, stats.plan)
        image = [e for c, _, e in ran if c == IMAGE]
        assert image and min(image) >= 4.04 * 0.4, ran       # the image was timed, and cost its wait
        served = [c for c, reason, _ in ran[-4:] if not reason.startswith("probe")]
        assert served and set(served) == {LOP}, ran          # the cheaper one serves since
        lop = [e for c, _, e in ran if c == LOP]
        assert max(lop[-3:]) < min(image), ran
    finally:
        client.close()


@pytest.mark.parametrize("deadline_s, serves", [(0.3, LOP), (5.0, IMAGE)])
def test_the_deadline_objective_serves_the_fewest_joules_that_meet_it(shared_server, tmp_path, monkeypatch,
                                                                      deadline_s, serves):
    """``objective: deadline``: the fewest joules of the candidates whose frames meet the
    deadline. Over a dead link lop runs the model on the robot (fast, at 13.35 W); the
    camera image's offload (predicted cheapest, as a cost model that cannot see the link
    errs) waits 0.4 s on the link at 0.01 W. With a 0.3 s deadline the image, timed, misses
    it, and lop serves; with 5 s the image meets it at fewer joules than lop is predicted
    to take, and serves. Same predictions, same frames: only the deadline differs."""
    client = _client(shared_server, "resnet18", str(tmp_path), objective="deadline", deadline_s=deadline_s,
                     idle_w=0.01, transmit_w=0.01, transport=_SlowImages(shared_server, 0.4), hedge=False)
    auto = client._get_backend("auto")
    image_option = auto._image_option
    monkeypatch.setattr(auto, "_image_option",
                        lambda *a: dataclasses.replace(image_option(*a), energy_j=1e-3, latency_s=0.01,
                                                       raw_latency_s=0.01))
    try:
        client.predicted_bandwidth_bps = 1e3     # lop's plans: all on the robot
        ran = []
        for k in range(12):
            frame = _frame(client.spec, client.input_size, seed=k)
            y, stats = client.process(frame)
            a = stats.extra["auto"]
            ran.append((a["candidate"], a["reason"], round(stats.processing_s, 3), round(stats.energy_j, 4)))
            with torch.inference_mode():
                ref = client.model(client.preprocess(frame))
            assert_same_up_to_summation_order(y, ref, stats.plan)
        assert "medians_mj" in a, a
        image = [(t, e) for c, _, t, e in ran if c == IMAGE]
        assert image and min(t for t, _ in image) >= 0.4, ran          # the image was timed
        served = [(c, t, e) for c, reason, t, e in ran[-4:] if not reason.startswith("probe")]
        assert served and {c for c, _, _ in served} == {serves}, ran
        assert all(t <= deadline_s for _, t, _ in served), ran         # what serves meets it
        if serves == IMAGE:     # fewer joules than lop, which meets it too, is predicted to take
            assert max(e for _, e in image) < a["predicted"][LOP]["energy_mj"] / 1e3, (ran, a)
    finally:
        client.close()


def test_switching_to_auto_and_losing_the_server_lose_no_frame(profile_dir):
    from robot_offload.server import OffloadServer, ServerConfig
    from devices import SERVER_DEVICE
    transport = InProcessTransport(OffloadServer(ServerConfig(ops_sandbox=False, device=SERVER_DEVICE)))
    client = _client(None, "resnet18", profile_dir, transport=transport, mode="full_offload",
                     timeout_s=5.0, retry_interval_s=0.1)
    try:
        frame = _frame(client.spec, client.input_size, seed=3)
        with torch.inference_mode():
            ref = client.model(client.preprocess(frame))
        modes = []
        for k in range(12):
            if k == 3:
                client.set_mode("auto")
            if k == 7:
                transport.server = None         # the server goes away mid-run
            client.predicted_bandwidth_bps = 100e6
            y, stats = client.process(frame)
            modes.append(stats.executed_mode)
            assert_same_up_to_summation_order(y, ref, f"frame {k}: {stats.plan}")
            if k >= 7:
                # computed on the robot: a fallback that says why, or auto's all-local plan
                assert stats.mode == "auto"
                assert ((stats.executed_mode == "local" and stats.fallback_reason)
                        or (stats.executed_mode == "auto" and stats.round_trips == 0)), stats
        assert modes[:3] == ["full_offload"] * 3 and modes[3:7] == ["auto"] * 4, modes
        assert client.fallbacks == modes.count("local")
    finally:
        client.close()


def test_a_candidate_never_measured_is_timed_unless_predicted_far_slower():
    """The cost model errs most on what no frame has timed: a candidate with fewer than
    min_samples measured frames (in any bucket) runs as a probe while predicted within
    first_probe_factor of the leader; then measured ratios correct its predictions."""
    from types import SimpleNamespace
    from robot_offload.backends.auto import AutoBackend
    from robot_offload.partition.choice import MeasuredChoice
    auto = SimpleNamespace(choice=MeasuredChoice(min_samples=2), first_probe_factor=3.0)
    lead, image = _Option("lop", 0.040, 1.0), _Option("full_offload_image", 0.100, 1.0)
    assert AutoBackend._first_probe(auto, [lead, image], 0) is image          # 2.5x: worth a frame
    auto.choice.observe(0, image, 0.030)
    assert AutoBackend._first_probe(auto, [lead, image], 0) is image          # one sample is not two
    auto.choice.observe(5, image, 0.031)                                    # another bucket counts
    assert AutoBackend._first_probe(auto, [lead, image], 0) is None
    far = _Option("full_offload_image", 0.130, 1.0)                         # 3.25x: not worth it
    assert AutoBackend._first_probe(SimpleNamespace(choice=MeasuredChoice(), first_probe_factor=3.0),
                                    [lead, far], 0) is None
    # the default factor: KAPAO-L at 20 Mbit/s, the image predicted 2.9x lop is not timed;
    # MobileNetV2's image predicted 1.7x lop (measured faster than predicted) is
    default = SimpleNamespace(choice=MeasuredChoice(), first_probe_factor=AutoBackend.first_probe_factor)
    assert AutoBackend._first_probe(default, [_Option("lop", 0.41, 1.0),
                                              _Option("full_offload_image", 1.19, 1.0)], 0) is None
    assert AutoBackend._first_probe(default, [_Option("lop", 0.030, 1.0),
                                              _Option("full_offload_image", 0.050, 1.0)], 0) is not None
    # KAPAO-L at 20 Mbit/s: the image's first probe took 1.51 s where lop's median was
    # 0.75 (more than (1 + margin) ** 2 times): not probed a second time in that bucket,
    # still in another
    kapao = SimpleNamespace(choice=MeasuredChoice(min_samples=2), first_probe_factor=2.0)
    lop, img = _Option("lop", 0.89, 1.0), _Option("full_offload_image", 1.45, 1.0)
    for _ in range(3):
        kapao.choice.observe(13, lop, 0.75)
    assert AutoBackend._first_probe(kapao, [lop, img], 13) is img
    kapao.choice.observe(13, img, 1.51)
    assert AutoBackend._first_probe(kapao, [lop, img], 13) is None
    assert AutoBackend._first_probe(kapao, [lop, img], 14) is img
    close = SimpleNamespace(choice=MeasuredChoice(min_samples=2), first_probe_factor=2.0)
    for _ in range(3):
        close.choice.observe(13, lop, 0.75)
    close.choice.observe(13, img, 1.0)           # within (1 + margin) ** 2: probed again
    assert AutoBackend._first_probe(close, [lop, img], 13) is img


def test_each_kind_of_prediction_is_corrected_by_its_own_errors():
    """lop's layer partitions and the image offload measured below their predictions; a
    spatial schedule no frame has run is taken as predicted, not corrected by the
    partitions' error: in a bucket nothing has timed, the image (corrected) ranks first."""
    errors = PredictionErrors(min_samples=2)
    image = _Option(IMAGE, 0.0417, 1.0, kind=IMAGE, raw_latency_s=0.0417)
    spatial = _Option(LOP, 0.038, 1.0, kind=LOP_SPATIAL, raw_latency_s=0.038)
    partition = _Option(LOP, 0.0316, 1.0, kind=LOP_PARTITION, raw_latency_s=0.0316)
    errors.observe(IMAGE, 0.0417, 0.035)
    assert errors.correct(image).latency_s == pytest.approx(0.0417)       # one sample is not two
    errors.observe(IMAGE, 0.0417, 0.035)
    for _ in range(2):
        errors.observe(LOP_PARTITION, 0.0316, 0.0275)
    assert errors.correct(image).latency_s == pytest.approx(0.035)
    assert errors.correct(partition).latency_s == pytest.approx(0.0275)
    assert errors.correct(spatial).latency_s == pytest.approx(0.038)
    assert errors.correct(errors.correct(image)).latency_s == pytest.approx(0.035)   # not twice
    ranked = sorted([errors.correct(spatial), errors.correct(image)], key=lambda o: o.latency_s)
    assert ranked[0].kind == IMAGE

def test_lop_frames_that_solved_or_profiled_are_no_sample(shared_server, tmp_path):
    """Over a dead link, auto's first frame of a shape is lop's first, which profiles the
    model and solves lop's schedules (seconds on a robot): lop says it was not timed, and
    auto keeps it out of its medians. Later lop frames are timed."""
    client = _client(shared_server, "resnet18", str(tmp_path))     # nothing cached
    try:
        auto = client._get_backend("auto")
        lop_option = _Option(LOP, 1.0, 1.0)
        frame = _frame(client.spec, client.input_size, seed=5)
        client.predicted_bandwidth_bps = 1e3      # lop every frame (the image is far slower)
        _, first = client.process(frame)          # lop's first frame of the shape: profiles, solves LOSS
        assert first.extra["auto"]["candidate"] == "lop" and first.extra["lop"]["timed"] is False
        assert auto.choice.error_samples(lop_option) == 0
        _, later = client.process(frame)
        assert later.extra["lop"]["timed"] is True and auto.choice.error_samples(lop_option) == 1
        # ... and its error is kept for what lop ran (a layer partition), not for lop as a whole
        assert later.extra["lop"]["spatial"] is False
        assert len(auto.errors._ratios[LOP_PARTITION]) == 1 and LOP_SPATIAL not in auto.errors._ratios
        assert later.extra["auto"]["predicted"][LOP]["of"] == LOP_PARTITION
    finally:
        client.close()


def test_frames_are_offloaded_while_the_plans_are_prepared_in_the_background(shared_server, tmp_path):
    """The first frames of a shape do not wait for its profile and schedules (seconds on
    an idle robot, minutes on a loaded one): those are prepared on a background thread
    while the camera image is offloaded, with local's outputs; then auto chooses as usual."""
    client = _client(shared_server, "resnet18", str(tmp_path))      # nothing cached
    auto = client._get_backend("auto")
    auto.lop.calibration_inputs, auto.lop.profile_repeats = 4, 3    # a preparation of seconds
    try:
        client.predicted_bandwidth_bps = 100e6
        frame = _frame(client.spec, client.input_size, seed=3)
        _, first = client.process(frame)
        preparing = auto._preparing[auto._shape()]
        assert preparing.is_alive(), "the first frame waited for the preparation"
        assert first.executed_mode == "auto" and first.extra["auto"]["candidate"] == "full_offload_image"
        assert "background" in first.extra["auto"]["reason"]
        frames = [_frame(client.spec, client.input_size, seed=10 + k) for k in range(3)]
        buffer = frames[0].copy()
        chosen, k = [], 0
        while len(chosen) < 2:
            assert k < 400, "auto never chose after the preparation"
            np.copyto(buffer, frames[k % 3])      # a camera loop that reuses its buffer
            y, stats = client.process(buffer)
            assert stats.executed_mode == "auto", stats.fallback_reason
            with torch.inference_mode():
                ref = client.model(client.preprocess(frames[k % 3]))
            assert_same_up_to_summation_order(y, ref, stats.plan)
            if "background" not in stats.extra["auto"]["reason"]:
                chosen.append(stats.extra["auto"]["candidate"])
            k += 1
        preparing.join(5)
        assert not preparing.is_alive() and auto._prepare_failed == set()
    finally:
        client.close()


def test_while_the_schedules_are_solved_the_profile_picks_local_or_the_image(shared_server, tmp_path):
    """Once the profile is there, a frame whose schedules are still being solved runs
    locally when the cost model predicts that cheaper than the image's offload (MobileNetV2
    at 5 Mbit/s on the testbed: 50 ms against 280 for the image), and offloads the image
    when that is predicted cheaper."""
    import threading
    client = _client(shared_server, "resnet18", str(tmp_path))
    auto = client._get_backend("auto")
    release = threading.Event()
    solve = auto.lop._solve

    def held_solve(*args, **kw):        # the schedules take as long as the test says
        assert release.wait(60)
        return solve(*args, **kw)
    auto.lop._solve = held_solve
    try:
        client.predicted_bandwidth_bps = 1e6     # the image: about 0.1 s of upload
        frame = _frame(client.spec, client.input_size, seed=4)
        _, first = client.process(frame)         # no profile yet: the image goes
        assert first.extra["auto"]["candidate"] == IMAGE, first.extra["auto"]
        shape = auto._shape()
        for _ in range(600):                     # the profile, then the held solve
            if shape in auto.lop._states:
                break
            threading.Event().wait(0.1)
        assert shape in auto.lop._states and shape not in auto.lop._lop
        with torch.inference_mode():
            ref = client.model(client.preprocess(frame))
        y, slow = client.process(frame)
        assert slow.executed_mode == "auto", slow.fallback_reason
        assert slow.extra["auto"]["candidate"] == LOCAL, slow.extra["auto"]
        assert slow.bytes_up == 0 and "background" in slow.extra["auto"]["reason"]
        predicted = slow.extra["auto"]["predicted"]
        assert predicted[LOCAL]["latency_ms"] < predicted[IMAGE]["latency_ms"]
        torch.testing.assert_close(y, ref, rtol=0, atol=0, msg="local while the schedules are solved")
        client.predicted_bandwidth_bps = 1e12    # the image costs the server's time only
        y, fast = client.process(frame)
        assert fast.extra["auto"]["candidate"] == IMAGE, fast.extra["auto"]
        assert fast.bytes_up > 0
        assert_same_up_to_summation_order(y, ref, "the image while the schedules are solved")
    finally:
        release.set()
        auto._preparing[auto._shape()].join(60)
        client.close()
    assert auto._prepare_failed == set()


def test_a_frame_waiting_for_the_preparation_leaves_the_foreground(shared_server, tmp_path):
    """Over a link too slow for the image, a frame of a shape being prepared waits for the
    preparation; meanwhile it computes nothing, so the preparation must not yield to it
    (:mod:`robot_offload.background`), or it would run at its background share while the
    frame waits for it."""
    import threading
    from robot_offload import background
    client = _client(shared_server, "resnet18", str(tmp_path))
    auto = client._get_backend("auto")
    release = threading.Event()
    build = auto.lop._build_state

    def held_build(*args, **kw):
        assert release.wait(60)
        return build(*args, **kw)
    auto.lop._build_state = held_build
    try:
        client.predicted_bandwidth_bps = 100e6
        frame = _frame(client.spec, client.input_size, seed=6)
        _, first = client.process(frame)                 # starts the preparation, offloads
        assert first.extra["auto"]["candidate"] == IMAGE
        client.predicted_bandwidth_bps = 1e3             # now the image cannot go
        done = []
        waiter = threading.Thread(target=lambda: done.append(client.process(frame)))
        waiter.start()
        left_foreground = False
        for _ in range(300):
            if waiter.is_alive() and background.GATE.computing == 0:
                left_foreground = True
                break
            threading.Event().wait(0.02)
        release.set()
        waiter.join(120)
        assert left_foreground, "the frame held the foreground while it waited for the preparation"
        (y, stats), = done
        assert stats.executed_mode == "auto" and stats.extra["auto"]["candidate"] == LOP, stats.extra
        with torch.inference_mode():
            ref = client.model(client.preprocess(frame))
        assert_same_up_to_summation_order(y, ref, stats.plan)
    finally:
        release.set()
        client.close()


def test_auto_runs_the_schedules_the_clients_lop_solved(shared_server, tmp_path):
    """``auto``'s own ``lop`` and the ``lop`` mode of one client share their schedules
    (solved, re-planned and calibrated once): after ``lop`` ran a shape, ``auto`` has
    nothing to prepare for it."""
    client = _client(shared_server, "resnet18", str(tmp_path))
    try:
        client.predicted_bandwidth_bps = 100e6
        frame = _frame(client.spec, client.input_size, seed=8)
        client.set_mode("lop")
        client.process(frame)                 # lop profiles and solves the shape
        client.set_mode("auto")
        y, stats = client.process(frame)
        auto = client._get_backend("auto")
        assert auto.lop._lop is client._get_backend("lop")._lop
        assert auto._preparing == {} and "background" not in stats.extra["auto"]["reason"]
        assert stats.executed_mode == "auto", stats.fallback_reason
        with torch.inference_mode():
            ref = client.model(client.preprocess(frame))
        assert_same_up_to_summation_order(y, ref, stats.plan)
    finally:
        client.close()


def test_with_jpeg_frames_the_image_is_costed_at_the_jpegs_bytes(shared_server, tmp_path):
    """input_jpeg_quality: before any image offload, auto costs the image's upload at its
    JPEG's bytes (encoded once to know), not at the frame's; the first offload's measured
    bytes then take over."""
    from robot_offload import frame_codec
    from robot_offload.camera import natural_image
    frame = natural_image(96, 96, seed=9)
    jpeg_bytes = frame_codec.encode(frame, "frame", 90).nbytes
    assert jpeg_bytes < frame.nbytes / 2
    lossy = _client(shared_server, "resnet18", str(tmp_path), input_jpeg_quality=90)
    lossless = _client(shared_server, "resnet18", str(tmp_path))
    try:
        assert lossy._get_backend("auto")._upload_bytes(frame) == pytest.approx(jpeg_bytes)
        assert lossless._get_backend("auto")._upload_bytes(frame) == frame.nbytes
        lossy.predicted_bandwidth_bps = 1e12
        auto = lossy._get_backend("auto")
        y, stats = lossy.process(frame)           # no profile yet: the image goes
        assert stats.extra["auto"]["candidate"] == IMAGE, stats.extra["auto"]
        assert stats.plan == "auto:full_offload_image input=frame jpeg q90", stats.plan
        assert stats.bytes_up == jpeg_bytes and stats.extra["lossy_input"]["quality"] == 90
        assert auto._upload_bytes(frame) == pytest.approx(jpeg_bytes)
    finally:
        for c in (lossy, lossless):
            backend = c._get_backend("auto")
            for t in list(backend._preparing.values()):
                t.join(120)
            c.close()
