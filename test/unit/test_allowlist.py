"""The offload server's allow-list of operators and its argument checks
(:mod:`robot_offload.transparent.allowlist`), on the server's request paths and on the
robot, which runs an operator the server would refuse itself.

Requests that would crash a server without the checks (a sparse tensor's indices written
out of range, a box numbering an image that is not there) are only ever sent to a server
with them: each is refused before any kernel runs. That a refusal comes from the checks is
shown with a harmless operator (``aten::_print``) that a server without them runs.
"""

import json
import logging
import warnings

import pytest
import torch
from torch import nn

from robot_offload.client import ClientConfig, OffloadClient
from robot_offload.codec import encode as codec_encode
from robot_offload.models import get_spec, names
from robot_offload.protocol import ComputeRequest, StatusCode
from robot_offload.server import OffloadServer, ServerConfig
from robot_offload.transparent import allowlist, wire
from robot_offload.transparent.session import RemoteSession
from robot_offload.transport.inproc import InProcessTransport

from devices import SERVER_DEVICE
from test_transparent import _Net, assert_same_as_local

#: The request that wrote outside a tensor's memory: a sparse view of an upload, its index
#: tensor, that index overwritten with a huge value, and the dense tensor rebuilt from it.
CRASH_OPS = [
    ("aten::_to_sparse.sparse_dim", lambda t: {"l": [t(0), 1]}),
    ("aten::_indices", lambda t: {"l": [t(1)]}),
    ("aten::fill_.Scalar", lambda t: {"l": [t(2), 1e9]}),
    ("aten::_to_dense", lambda t: {"l": [t(1)]}),
]


def _request(args, tensors=(), session="s1"):
    return ComputeRequest(client_id="t", model="", entry="ops", session=session,
                          tensors=[codec_encode(t, name=f"u{i}") for i, t in enumerate(tensors)],
                          args_json=json.dumps(args))


class _OneSession:
    """A server whose requests naming session "s1" use the one session it opened (the
    server issues session ids)."""

    def __init__(self, server):
        self.server, self.sid = server, ""

    def handle(self, method, req):
        if req.session == "s1":
            if not self.sid:
                opened = self.server.handle("compute", _request({"ops": []}, session=""))
                self.sid = json.loads(opened.result_json)["session"]
            req.session = self.sid
        return self.server.handle(method, req)

    def __getattr__(self, name):
        return getattr(self.server, name)


def _server():
    return _OneSession(OffloadServer(ServerConfig(ops_sandbox=False, device=SERVER_DEVICE, max_session_mib=64)))


def _still_answers(server, session="s1"):
    ok = server.handle("compute", _request({"ops": [{"op": "aten::ones", "a": {"l": [{"l": [2]}]}, "k": {}}]},
                                           session=session))
    assert ok.status == StatusCode.OK, ok.status_text
    assert json.loads(ok.result_json)["ops"][0]["t"]["s"] == [2]


# -- the server ------------------------------------------------------------------------------

def test_the_crash_request_as_ops_is_refused_at_its_first_operator():
    server = _server()
    # handles: 1 is the upload, 2.. the outputs of the operators in order
    ops = [{"op": name, "a": args(lambda i: {"t": {"u": 0}} if i == 0 else {"t": {"h": i + 1}}), "k": {}}
           for name, args in CRASH_OPS]
    resp = server.handle("compute", _request({"uploads": [{"n": 0}], "ops": ops}, [torch.ones(4, 4)]))
    assert resp.status == StatusCode.BAD_REQUEST, resp.status_text
    assert "aten::_to_sparse.sparse_dim" in resp.status_text and "allow-list" in resp.status_text
    _still_answers(server)


def test_the_crash_request_as_define_and_replay_is_refused_at_its_first_operator():
    server = _server()
    ops = [{"op": name, "a": args(lambda i: {"t": {"i": 0}} if i == 0 else {"t": {"o": [i - 1, 0]}}), "k": {}}
           for name, args in CRASH_OPS]
    body = {"uploads": [{"n": 0}], "define": {"id": "crash", "n_inputs": 1, "ops": ops},
            "replay": {"id": "crash", "n": 4, "inputs": [[0, {"u": 0}]], "fetch": [[3, 0]]}}
    resp = server.handle("compute", _request(body, [torch.ones(4, 4)]))
    assert resp.status == StatusCode.BAD_REQUEST, resp.status_text
    assert "aten::_to_sparse.sparse_dim" in resp.status_text
    # nothing was defined: a replay alone finds no sequence
    resp = server.handle("compute", _request({"replay": {"id": "crash", "n": 4}}))
    assert resp.status == StatusCode.STALE_HANDLE, resp.status_text
    _still_answers(server)


PRINT = {"op": "aten::_print", "a": {"l": ["text an attacker wants in the server's log"]}, "k": {}}


@pytest.mark.parametrize("form", ["ops", "define"])
def test_print_is_refused(form, capfd):
    server = _server()
    body = {"ops": [PRINT]} if form == "ops" else {"define": {"id": "p", "n_inputs": 0, "ops": [PRINT]}}
    resp = server.handle("compute", _request(body))
    assert resp.status == StatusCode.BAD_REQUEST, resp.status_text
    assert "aten::_print.default" in resp.status_text
    assert "an attacker wants" not in capfd.readouterr().out
    _still_answers(server)


def test_without_the_allow_list_check_print_would_run(monkeypatch, capfd):
    """The refusals above come from the allow-list: with its check taken away, the server
    runs ``aten::_print`` (harmless, unlike the crash request) and answers OK."""
    monkeypatch.setattr(allowlist, "check_op", lambda name: None)
    monkeypatch.setattr(wire, "_OP_CACHE", {})          # resolved ops stay out of the real cache
    resp = _server().handle("compute", _request({"ops": [PRINT]}))
    assert resp.status == StatusCode.OK, resp.status_text
    assert "an attacker wants" in capfd.readouterr().out


def test_every_operator_of_a_sequence_is_checked_not_only_the_first():
    ops = [{"op": "aten::relu", "a": {"l": [{"t": {"i": 0}}]}, "k": {}},
           {"op": "aten::int_repr", "a": {"l": [{"t": {"o": [0, 0]}}]}, "k": {}}]
    resp = _server().handle("compute", _request({"define": {"id": "q", "n_inputs": 1, "ops": ops}}))
    assert resp.status == StatusCode.BAD_REQUEST and "aten::int_repr.default" in resp.status_text


@pytest.mark.parametrize("name", ["aten::_to_sparse", "aten::_indices", "aten::_values", "aten::to_sparse_csr",
                                  "aten::quantize_per_tensor", "aten::int_repr", "aten::dequantize.self",
                                  "aten::set_.source_Storage", "aten::from_file", "aten::_print",
                                  "aten::record_stream", "aten::_pin_memory", "aten::empty.memory_format",
                                  "aten::empty_like", "aten::resize_", "aten::_nested_tensor_from_mask",
                                  "aten::view_as_complex", "aten::_local_scalar_densex"])
def test_check_op_refuses_and_names_the_operator(name):
    with pytest.raises(wire.WireError, match="allow-list") as e:
        wire.resolve_op(name)
    assert name.split(".")[0] in str(e.value)


def test_the_list_holds_no_excluded_family_and_resolves():
    assert len(allowlist.ALLOWED_OPS) > 200
    assert not [n for n in allowlist.ALLOWED_OPS if allowlist.is_excluded(n)]
    for name in sorted(allowlist.ALLOWED_OPS):
        assert wire.op_name(wire.resolve_op(name)) == name
    for name in ("aten::convolution.default", "aten::_local_scalar_dense.default", "torchvision::nms.default",
                 "torchvision::roi_align.default", "aten::native_batch_norm.default"):
        assert allowlist.is_allowed(name)
    assert set(allowlist.CALL_CHECKS) <= allowlist.ALLOWED_OPS


# -- argument checks ---------------------------------------------------------------------------

_BAD_VALUES = {
    "sparse": lambda d: d.to_sparse(),
    "csr": lambda d: d.to_sparse_csr(),
    "quantized": lambda d: torch.quantize_per_tensor(d, 0.1, 0, torch.quint8),
    "nested": lambda d: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
    "complex tensor": lambda d: d.to(torch.complex64),
    "complex dtype": lambda d: torch.complex64,
    "sparse layout": lambda d: torch.sparse_coo,
    "storage": lambda d: d.untyped_storage(),
    "generator": lambda d: torch.Generator(),
    "object": lambda d: object(),
    "nested in a list": lambda d: [d, [d.to_sparse()]],
}


@pytest.mark.parametrize("what", sorted(_BAD_VALUES))
def test_check_arguments_refuses_values_outside_the_dense_world(what):
    with warnings.catch_warnings():          # beta/deprecated constructors say so
        warnings.simplefilter("ignore")
        value = _BAD_VALUES[what](torch.arange(6.0).reshape(2, 3))
    func = torch.ops.aten.add.Tensor
    with pytest.raises(wire.WireError, match="aten::add.Tensor"):
        allowlist.check_arguments(func, [torch.ones(2), value], {})
    with pytest.raises(wire.WireError):
        allowlist.check_arguments(func, [torch.ones(2)], {"other": value})


def test_check_arguments_accepts_what_the_wire_decodes():
    allowlist.check_arguments(torch.ops.aten._to_copy.default, [torch.ones(2, 2).t()],
                              {"dtype": torch.float16, "layout": torch.strided, "device": torch.device("cpu"),
                               "memory_format": torch.channels_last, "non_blocking": False, "pin_memory": None})
    allowlist.check_arguments(torch.ops.aten.cat.default, [[torch.ones(2), torch.zeros(2, dtype=torch.int64)], 0], {})
    allowlist.check_arguments(torch.ops.aten.ones.default, [[2, 3]], {"dtype": torch.bool, "pin_memory": False})
    allowlist.check_arguments(torch.ops.aten.gelu.default, [torch.ones(2, device="meta")], {"approximate": "tanh"})
    with pytest.raises(wire.WireError, match="pin_memory"):
        allowlist.check_arguments(torch.ops.aten.ones.default, [[2, 3]], {"pin_memory": True})


def test_call_checks_refuse_sizes_and_values_a_kernel_trusts():
    x = torch.ones(1, 3, 4, 4)
    bn = torch.ops.aten.native_batch_norm.default
    good = [x, torch.ones(3), torch.zeros(3), torch.zeros(3), torch.ones(3), False, 0.1, 1e-5]
    allowlist.check_arguments(bn, good, {})
    for i in range(1, 5):
        bad = list(good)
        bad[i] = torch.ones(1)
        with pytest.raises(wire.WireError, match="native_batch_norm"):
            allowlist.check_arguments(bn, bad, {})
    # evaluation without running statistics: the kernel dereferences them (a segfault)
    no_stats = [x, torch.ones(3), None, None, None, False, 0.1, 1e-5]
    with pytest.raises(wire.WireError, match="running_mean and running_var"):
        allowlist.check_arguments(bn, no_stats, {})
    with pytest.raises(wire.WireError, match="running_mean and running_var"):
        allowlist.check_arguments(bn, no_stats[:5], {"training": False, "momentum": 0.1, "eps": 1e-5})
    allowlist.check_arguments(bn, no_stats[:5] + [True, 0.1, 1e-5], {})      # training: batch statistics
    import torchvision  # noqa: F401  (registers torchvision::roi_align)
    roi_align = torch.ops.torchvision.roi_align.default
    allowlist.check_arguments(roi_align, [x, torch.tensor([[0.0, 0, 0, 2, 2]]), 1.0, 2, 2, 2, False], {})
    allowlist.check_arguments(roi_align, [x, torch.zeros(0, 5), 1.0, 2, 2, 2, False], {})
    for rois in ([[1.0, 0, 0, 2, 2]], [[-1.0, 0, 0, 2, 2]], [[5e6, 0, 0, 2, 2]], [[float("nan"), 0, 0, 2, 2]],
                 [[0.0, float("nan"), 0, 2, 2]], [[0.0, 0, 0, 1e9, 2]]):
        with pytest.raises(wire.WireError, match="roi_align"):
            allowlist.check_arguments(roi_align, [x, torch.tensor(rois), 1.0, 2, 2, 2, False], {})
    with pytest.raises(wire.WireError, match="roi_pool"):
        allowlist.check_arguments(torch.ops.torchvision.roi_pool.default,
                                  [x, torch.tensor([[3.0, 0, 0, 2, 2]]), 1.0, 2, 2], {})
    grid = torch.zeros(1, 2, 2, 2)
    allowlist.check_arguments(torch.ops.aten.grid_sampler_2d.default, [x, grid, 2, 1, False], {})
    with pytest.raises(wire.WireError, match="interpolation_mode"):
        allowlist.check_arguments(torch.ops.aten.grid_sampler_2d.default, [x, grid, 7, 0, False], {})


def _server_tensors(server):
    return [t for sess in server.executors["ops"].store.sessions.values() for t in sess.handles.values()]


def test_arguments_are_checked_on_the_ops_path_and_at_define():
    server = _server()
    x = torch.ones(1, 3, 4, 4)
    to_complex = {"op": "aten::_to_copy", "a": {"l": [{"t": {"u": 0}}]}, "k": {"dtype": {"dtype": "complex64"}}}
    resp = server.handle("compute", _request({"uploads": [{"n": 0}], "ops": [to_complex]}, [x]))
    assert resp.status == StatusCode.BAD_REQUEST and "complex64" in resp.status_text, resp.status_text
    to_complex["a"] = {"l": [{"t": {"i": 0}}]}
    resp = server.handle("compute", _request({"define": {"id": "c", "n_inputs": 1, "ops": [to_complex]}}))
    assert resp.status == StatusCode.BAD_REQUEST and "complex64" in resp.status_text, resp.status_text
    pinned = {"op": "aten::ones", "a": {"l": [{"l": [2]}]}, "k": {"pin_memory": True}}
    resp = server.handle("compute", _request({"ops": [pinned]}))
    assert resp.status == StatusCode.BAD_REQUEST and "pin_memory" in resp.status_text, resp.status_text
    # a box numbering an image the batch does not have: refused before roi_align runs
    bad_box = {"op": "torchvision::roi_align", "a": {"l": [{"t": {"u": 0}}, {"t": {"u": 1}}, 1.0, 2, 2, 2, False]},
               "k": {}}
    resp = server.handle("compute", _request({"uploads": [{"n": 0}, {"n": 1}], "ops": [bad_box]},
                                             [x, torch.tensor([[5e6, 0, 0, 2, 2]])]))
    assert resp.status == StatusCode.BAD_REQUEST and "batch index" in resp.status_text, resp.status_text
    _still_answers(server)
    assert all(allowlist.check_tensor(t) is None for t in _server_tensors(server))


def test_a_replay_checks_the_calls_whose_kernels_trust_their_arguments():
    """A sequence's tensors are only known at replay: the operators with call checks are
    checked there, on every replay, and a refused replay leaves the session usable."""
    server = _server()
    x = torch.rand(1, 3, 8, 8)
    ops = [{"op": "torchvision::roi_align", "a": {"l": [{"t": {"i": 0}}, {"t": {"i": 1}}, 1.0, 2, 2, 2, False]},
            "k": {}},
           {"op": "aten::relu", "a": {"l": [{"t": {"o": [0, 0]}}]}, "k": {}}]
    define = {"id": "r", "n_inputs": 2, "ops": ops}

    def replay(rois, with_define=False):
        body = {"uploads": [{"n": 0}, {"n": 1}],
                "replay": {"id": "r", "n": 2, "inputs": [[0, {"u": 0}], [1, {"u": 1}]], "fetch": [[1, 0]]}}
        if with_define:
            body["define"] = define
        return server.handle("compute", _request(body, [x, torch.tensor(rois)]))

    good = replay([[0.0, 1, 1, 6, 6]], with_define=True)
    assert good.status == StatusCode.OK, good.status_text
    bad = replay([[1.0, 1, 1, 6, 6]])
    assert bad.status == StatusCode.BAD_REQUEST and "batch index" in bad.status_text, bad.status_text
    again = replay([[0.0, 1, 1, 6, 6]])
    assert again.status == StatusCode.OK, again.status_text
    from robot_offload.codec import decode
    torch.testing.assert_close(decode(again.tensors[0]), decode(good.tensors[0]))
    # everything the session holds -- uploads and the outputs of allowed operators -- is
    # dense, strided and real, which is what the sequence's unchecked tensor slots rely on
    tensors = _server_tensors(server)
    assert tensors and all(allowlist.check_tensor(t) is None for t in tensors)


# -- coverage: what real programs run is on the list ------------------------------------------

def test_the_derivation_finds_nothing_missing_from_the_list():
    """Everything the test programs and the user-code habits reach is on the list, except
    the excluded families; of those, the programs reach only ``aten::empty`` and
    ``aten::empty_like`` (``randn_like`` and friends: the robot runs them, reading only the
    shape) and ``out=`` variants into their own tensors (the robot runs them); the program
    corpus test shows their outputs equal. The registry models are covered
    through the interceptor below, which fails on any operator missing from the list."""
    seen = allowlist.derive(verbose=False, sources=("programs", "habits"))
    assert seen["programs"] and seen["habits"] and not seen["registry"]
    union = seen["programs"] | seen["habits"]
    missing = sorted(n for n in union - allowlist.ALLOWED_OPS if not allowlist.is_excluded(n))
    assert not missing, f"derived but not on the allow-list: {missing}"
    off_list = seen["programs"] - allowlist.ALLOWED_OPS
    assert {n for n in off_list if not n.endswith(".out")} <= {"aten::empty.memory_format",
                                                               "aten::empty_like.default"}


@pytest.fixture(scope="module")
def model_server():
    return OffloadServer(ServerConfig(ops_sandbox=False, device=SERVER_DEVICE))


@pytest.mark.parametrize("model", names())
def test_registry_models_need_no_robot_fallback(model_server, model):
    """Each registry model through the interceptor (transparent mode, the server holding
    its weights): no operator is kept on the robot by the allow-list, and the output is
    local's."""
    spec = get_spec(model)
    size = spec.test_input_size
    cfg = ClientConfig(model=model, mode="transparent", input_size=size, load_timeout_s=120, timeout_s=120)
    client = OffloadClient(cfg, InProcessTransport(model_server))
    assert client.connect(), client.link.last_error
    try:
        x = spec.example_input(size, seed=1)
        y, stats = client.infer(x)
        assert stats.executed_mode == "transparent", stats.fallback_reason
        session = client._backends["transparent"].session
        assert session.stats.ops_remote > 20
        assert session.stats.ops_not_allowed == 0, session.stats
        client.set_mode("local")
        ref, _ = client.infer(x)
        assert_same_as_local(y, ref, rtol=1e-5, atol=1e-5)
    finally:
        client.close()


# -- the robot ----------------------------------------------------------------------------------



@pytest.mark.parametrize("mode", ["transparent", "record_replay"])
def test_an_operator_off_the_list_runs_on_the_robot(monkeypatch, caplog, mode):
    """With relu taken off the list, the robot runs it itself (counted, logged once) and
    the program's outputs stay local's in both modes, frame after frame."""
    monkeypatch.setattr(allowlist, "ALLOWED_OPS", allowlist.ALLOWED_OPS - {"aten::relu.default"})
    transport = InProcessTransport(_server())
    sess = RemoteSession(lambda r, t: transport.call("compute", r, t), mode=mode)
    torch.manual_seed(0)
    net = _Net().eval()
    caplog.set_level(logging.INFO, logger="robot_offload.transparent.session")
    frames = 6
    with torch.inference_mode():
        for i in range(frames):
            x = torch.randn(1, 3, 8, 8)
            ref = net(x)
            with sess:
                y = sess.materialize_tree(net(x))
            torch.testing.assert_close(y, ref)
    assert sess.stats.ops_not_allowed == frames, sess.stats
    assert sess.stats.ops_local >= frames and sess.stats.ops_remote > 0
    warnings = [r.getMessage() for r in caplog.records if "allow-list" in r.getMessage()]
    assert warnings == ["aten::relu.default is not on the server's allow-list: it runs on the robot"]


def test_the_robot_sends_allowed_operators():
    """The same program with the full list sends relu too: nothing is kept on the robot."""
    transport = InProcessTransport(_server())
    sess = RemoteSession(lambda r, t: transport.call("compute", r, t), mode="transparent")
    net = _Net().eval()
    x = torch.randn(1, 3, 8, 8)
    with torch.inference_mode():
        ref = net(x)
        with sess:
            y = sess.materialize(net(x))
    torch.testing.assert_close(y, ref)
    assert sess.stats.ops_not_allowed == 0 and sess.stats.ops_remote >= 4


def test_a_complex_dtype_argument_keeps_the_operator_on_the_robot():
    """The server refuses complex dtypes; the robot does not send them and gets local's
    result (the later operators on the complex tensor run on the robot too)."""
    transport = InProcessTransport(_server())
    sess = RemoteSession(lambda r, t: transport.call("compute", r, t), mode="transparent")
    conv = nn.Conv2d(3, 2, 3).eval()
    x = torch.randn(1, 3, 6, 6)
    with torch.inference_mode():
        ref = conv(x).to(torch.complex64).mul(1j).real
        with sess:
            y = sess.materialize_tree(conv(x).to(torch.complex64).mul(1j).real)
    torch.testing.assert_close(y, ref)
    assert sess.stats.ops_remote >= 1 and sess.stats.ops_local >= 1 and sess.stats.ops_not_allowed == 0
