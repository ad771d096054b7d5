"""The ``ops`` entry's protections, each against a real in-process server: sessions owned
by the identity that opened them, bytes (in-place growth and data-dependent outputs
included) and FLOPs charged before they are spent, unwritten memory never handed out,
the server's weights read-only to clients, replays costed like single operators."""

import json
import logging

import pytest
import torch

from robot_offload import codec
from robot_offload.protocol import ComputeRequest, LoadModelRequest, StatusCode
from robot_offload.server import OffloadServer, ServerConfig
from robot_offload.server.executors.ops import calls
from robot_offload.transparent import allowlist, wire

from devices import SERVER_DEVICE


def _server(**kw):
    return OffloadServer(ServerConfig(ops_sandbox=False, device=SERVER_DEVICE, **kw))


class Client:
    """One client of the ops entry: opens a session on its first request."""

    def __init__(self, server, client_id="robot1"):
        self.server, self.client_id, self.session = server, client_id, ""

    def send(self, args, tensors=()):
        req = ComputeRequest(client_id=self.client_id, model="", entry="ops", session=self.session,
                             tensors=list(tensors), args_json=json.dumps(args))
        resp = self.server.handle("compute", req)
        if resp.status == StatusCode.OK and not self.session:
            self.session = json.loads(resp.result_json)["session"]
        return resp

    def ok(self, args, tensors=()):
        resp = self.send(args, tensors)
        assert resp.status == StatusCode.OK, resp.status_text
        return json.loads(resp.result_json), resp

    def op(self, name, *args, **kwargs):
        """Run one operator; returns the handle of its (first) tensor result."""
        res, _ = self.ok({"ops": [{"op": name, "a": {"l": list(args)}, "k": kwargs}]})
        ret = res["ops"][0]
        return ret["t"].get("h", ret["t"]) if "t" in ret else ret

    def fetch(self, h):
        _, resp = self.ok({"fetch": [h]})
        return codec.decode(resp.tensors[0])


def h(handle):
    return {"t": {"h": handle}}


@pytest.fixture
def admit(monkeypatch):
    """Put operators the allow-list keeps off (resize_, empty*) on it for one test: the
    protections behind the allow-list must hold on their own."""
    def admit_(*names):
        for name in names:
            assert not allowlist.is_allowed(name)
        monkeypatch.setattr(allowlist, "ALLOWED_OPS", allowlist.ALLOWED_OPS | set(names))
        monkeypatch.setattr(wire, "_OP_CACHE", {})
    return admit_


# -- sessions belong to their client ------------------------------------------------------------
def test_session_ids_are_issued_and_bound_to_the_client(caplog):
    server = _server()
    a, b = Client(server, "robot_a"), Client(server, "robot_b")
    ha = a.op("aten::ones", {"l": [3]})
    assert len(a.session) == 32 and a.session != "s1"
    b.session = a.session                       # b read a's session id somewhere
    with caplog.at_level(logging.WARNING):
        resp = b.send({"fetch": [ha]})
    assert resp.status == StatusCode.UNAUTHORIZED, resp.status_text
    assert "another client" in caplog.text and a.session not in caplog.text   # the id is not logged
    resp = b.send({"release": [ha], "ops": []})
    assert resp.status == StatusCode.UNAUTHORIZED
    torch.testing.assert_close(a.fetch(ha), torch.ones(3))  # a's tensor is untouched
    c = Client(server, "robot_a")
    c.session = "0" * 32                          # a guessed id
    assert c.send({"fetch": [ha]}).status == StatusCode.STALE_HANDLE


def test_a_client_cannot_evict_another_clients_sessions():
    server = _server(max_sessions=3, max_sessions_per_client=2)
    victim = Client(server, "victim")
    hv = victim.op("aten::ones", {"l": [2]})
    hog = [Client(server, "hog") for _ in range(4)]
    for c in hog[:2]:
        c.op("aten::ones", {"l": [1]})
    # the hog's third and fourth sessions drop its own oldest, never the victim's
    for c in hog[2:]:
        c.op("aten::ones", {"l": [1]})
    torch.testing.assert_close(victim.fetch(hv), torch.ones(2))
    assert hog[0].send({"ops": []}).status == StatusCode.STALE_HANDLE
    # a third client finds the server full: BUSY, and nobody is dropped for it
    assert Client(server, "late").send({"ops": []}).status == StatusCode.BUSY
    torch.testing.assert_close(victim.fetch(hv), torch.ones(2))


# -- bytes -------------------------------------------------------------------------------------
def test_in_place_resize_is_charged_before_it_grows(monkeypatch, admit):
    server = _server(max_session_mib=1)
    c = Client(server)
    x = c.op("aten::zeros", {"l": [4]})
    resp = c.send({"ops": [{"op": "aten::resize_", "a": {"l": [h(x), {"l": [8]}]}, "k": {}}]})
    assert resp.status == StatusCode.BAD_REQUEST and "allow-list" in resp.status_text   # the first line
    admit("aten::resize_.default")
    resp = c.send({"ops": [{"op": "aten::resize_", "a": {"l": [h(x), {"l": [1 << 20]}]}, "k": {}}]})
    assert resp.status == StatusCode.TOO_LARGE, resp.status_text
    sess = next(iter(server.executors["ops"].store.sessions.values()))
    assert sess.bytes == 16 and sess.handles[x].shape == (4,)   # refused before it ran
    # a resize within the budget is counted: the session then holds its 256 KiB
    c.op("aten::resize_", h(x), {"l": [1 << 16]})
    assert sess.bytes == 4 * (1 << 16)
    # without the charge the oversized resize would go through
    monkeypatch.setattr(calls, "estimate", lambda *a: (0, 0, True))
    assert c.send({"ops": [{"op": "aten::resize_", "a": {"l": [h(x), {"l": [1 << 20]}]}, "k": {}}]}).status \
        == StatusCode.OK


def test_data_dependent_outputs_are_charged_an_upper_bound():
    server = _server(max_session_mib=1)
    c = Client(server)
    mask = c.op("aten::ones", {"l": [64, 64]}, dtype={"dtype": "bool"})
    # nonzero of 4096 true elements: up to 64 KiB of indices, under the 1 MiB budget
    nz = c.op("aten::nonzero", h(mask))
    assert c.fetch(nz).shape == (4096, 2)
    # 64 KiB of mask in: up to 4 MiB of indices, charged before it runs -- even though this
    # all-false mask would select nothing
    big = c.op("aten::zeros", {"l": [256, 256]}, dtype={"dtype": "bool"})
    resp = c.send({"ops": [{"op": "aten::nonzero", "a": {"l": [h(big)]}, "k": {}}]})
    assert resp.status == StatusCode.TOO_LARGE, resp.status_text


def test_unwritten_memory_is_zeroed(admit):
    admit("aten::empty.memory_format", "aten::empty_strided.default", "aten::new_empty.default",
          "aten::resize_.default")
    server = _server()
    c = Client(server)
    for _ in range(20):                          # leave freed, non-zero chunks in the allocator
        junk = c.op("aten::full", {"l": [1024]}, 7.0)
        c.ok({"release": [junk], "ops": []})
    for name, args in [("aten::empty.memory_format", [{"l": [1024]}]),
                       ("aten::empty_strided", [{"l": [32, 32]}, {"l": [32, 1]}])]:
        e = c.op(name, *args)
        assert torch.count_nonzero(c.fetch(e)) == 0, name
    like = c.op("aten::new_empty", h(c.op("aten::ones", {"l": [2]})), {"l": [1024]})
    assert torch.count_nonzero(c.fetch(like)) == 0
    x = c.op("aten::full", {"l": [1]}, 5.0)
    c.op("aten::resize_", h(x), {"l": [4096]})
    grown = c.fetch(x)
    assert grown[0] == 5.0 and torch.count_nonzero(grown[1:]) == 0


def test_no_allowed_operator_returns_unwritten_memory_unzeroed():
    """Every allowed operator that allocates without writing (an ``empty`` or ``resize``
    in its name) is one the server zeroes."""
    for name in allowlist.ALLOWED_OPS:
        base = name.split("::")[1].split(".")[0]
        if "empty" in base or base.startswith("resize"):
            assert base in calls.UNINITIALISED, name


# -- work ---------------------------------------------------------------------------------------
def test_compute_is_bounded_per_request_and_per_client():
    server = _server(max_request_gflop=10.0, client_gflop_per_s=1.0)
    c = Client(server)
    a = c.op("aten::zeros", {"l": [2048, 2048]})
    # 2048^3 * 2 = 17 GFLOP: refused before it runs
    resp = c.send({"ops": [{"op": "aten::mm", "a": {"l": [h(a), h(a)]}, "k": {}}]})
    assert resp.status == StatusCode.TOO_LARGE and "max_request_gflop" in resp.status_text
    b = c.op("aten::zeros", {"l": [1024, 1024]})
    c.op("aten::mm", h(b), h(b))                  # 2.1 GFLOP: allowed, from a 10 GFLOP bucket
    for _ in range(3):
        c.op("aten::mm", h(b), h(b))
    resp = c.send({"ops": [{"op": "aten::mm", "a": {"l": [h(b), h(b)]}, "k": {}}]})
    assert resp.status == StatusCode.BUSY and "client_gflop_per_s" in resp.status_text
    other = Client(server, "robot2")              # another client has its own budget
    o = other.op("aten::zeros", {"l": [1024, 1024]})
    other.op("aten::mm", h(o), h(o))


# -- the server's weights ---------------------------------------------------------------------
def test_registry_weights_named_by_digest_are_read_only():
    server = _server()
    assert server.handle("load_model", LoadModelRequest("robot1", "resnet18")).status == StatusCode.OK
    model = server._models["resnet18"].module
    w = model.conv1.weight
    before = w.detach().clone()
    c = Client(server)
    res, _ = c.ok({"uploads": [{"sha": wire.content_digest(w.detach().cpu())}], "ops": []})
    hw = res["uploaded"][0]
    for op in ({"op": "aten::add_.Tensor", "a": {"l": [h(hw), h(hw)]}, "k": {}},
               {"op": "aten::fill_.Scalar", "a": {"l": [h(hw), 0.0]}, "k": {}}):
        resp = c.send({"ops": [op]})
        assert resp.status == StatusCode.UNAUTHORIZED, resp.status_text
    v = c.op("aten::view", h(hw), {"l": [-1]})      # a view shares the weight's storage
    assert c.send({"ops": [{"op": "aten::zero_", "a": {"l": [h(v)]}, "k": {}}]}).status == StatusCode.UNAUTHORIZED
    torch.testing.assert_close(w.detach(), before, rtol=0, atol=0)
    sess = next(iter(server.executors["ops"].store.sessions.values()))
    assert sess.bytes == 0                          # not charged to the client either
    # reading it is fine
    y = c.op("aten::mul.Scalar", h(hw), 2.0)
    torch.testing.assert_close(c.fetch(y), (before * 2).cpu())


# -- replays ----------------------------------------------------------------------------------
def test_a_replay_is_costed_before_it_runs():
    server = _server(max_session_mib=1)
    c = Client(server)
    x = c.op("aten::ones", {"l": [4]})
    seq = [{"op": "aten::expand", "a": {"l": [{"t": {"i": 0}}, {"l": [1024, 4]}]}},
           {"op": "aten::clone", "a": {"l": [{"t": {"o": [0, 0]}}]}},
           {"op": "aten::mul.Scalar", "a": {"l": [{"t": {"o": [1, 0]}}, 2.0]}}]
    res, resp = c.ok({"define": {"id": "s", "n_inputs": 1, "ops": seq},
                      "replay": {"id": "s", "n": 3, "inputs": [[0, {"h": x}]], "fetch": [[2, 0]]}})
    torch.testing.assert_close(codec.decode(resp.tensors[0]), torch.full((1024, 4), 2.0))
    y = c.op("aten::ones", {"l": [64]})            # the same sequence on a 64x larger input
    seq_big = [dict(seq[0], a={"l": [{"t": {"i": 0}}, {"l": [8192, 64]}]})] + seq[1:]
    resp = c.send({"define": {"id": "b", "n_inputs": 1, "ops": seq_big},
                   "replay": {"id": "b", "n": 3, "inputs": [[0, {"h": y}]], "fetch": [[2, 0]]}})
    assert resp.status == StatusCode.TOO_LARGE, resp.status_text


def test_a_replay_cannot_write_the_servers_weights():
    server = _server()
    assert server.handle("load_model", LoadModelRequest("robot1", "resnet18")).status == StatusCode.OK
    w = server._models["resnet18"].module.fc.bias
    before = w.detach().clone()
    c = Client(server)
    res, _ = c.ok({"uploads": [{"sha": wire.content_digest(w.detach().cpu())}], "ops": []})
    resp = c.send({"define": {"id": "s", "n_inputs": 0,
                              "ops": [{"op": "aten::mul_.Scalar", "a": {"l": [{"t": {"c": res["uploaded"][0]}}, 0.0]}}]},
                   "replay": {"id": "s", "n": 1}})
    assert resp.status == StatusCode.UNAUTHORIZED, resp.status_text
    torch.testing.assert_close(w.detach(), before, rtol=0, atol=0)


# -- regressions from fuzzing (robot_offload.server.fuzz): once INTERNAL ----------------
def _request(args, tensors=(), session="", client_id="t"):
    return ComputeRequest(client_id=client_id, model="", entry="ops", session=session, tensors=list(tensors),
                          args_json=json.dumps(args))


@pytest.fixture
def session():
    server = OffloadServer(ServerConfig(ops_sandbox=False, device=SERVER_DEVICE, max_session_mib=64))
    resp = server.handle("compute", _request({"ops": []}))
    assert resp.status == StatusCode.OK, resp.status_text
    sid = json.loads(resp.result_json)["session"]

    def call(args, tensors=()):
        return server.handle("compute", _request(args, tensors, session=sid))
    yield call
    server.close()


def _still_usable(call):
    resp = call({"ops": [{"op": "aten::ones.default", "a": {"l": [{"l": [2]}]}, "k": {}}]})
    assert resp.status == StatusCode.OK, resp.status_text


@pytest.mark.parametrize("view", [
    [[4, 3], [3, 2 ** 64], 0],          # a stride past int64: torch raises TypeError, not RuntimeError
    [[2 ** 63 - 1, 1], [1, 0], 0],
    [[2], [1], 10 ** 30],               # an offset past int64: ValueError
    [[2], [1], True],
])
def test_a_view_upload_with_integers_past_int64_is_a_bad_request(session, view):
    t = codec.encode(torch.zeros(4, 3), name="x")
    resp = session({"uploads": [{"n": 0}, {"of": {"u": 0}, "view": view}]}, [t])
    assert resp.status == StatusCode.BAD_REQUEST, (resp.status, resp.status_text)
    _still_usable(session)


@pytest.mark.parametrize("define", [
    {"id": "s", "n_inputs": 0, "ops": [{"a": {"l": []}}]},                    # no operator name: was KeyError
    {"id": "s", "n_inputs": 2 ** 40, "ops": [{"op": "aten::relu.default", "a": {"l": [{"t": {"i": 0}}]}}]},
    {"id": "s", "n_inputs": -1, "ops": [{"op": "aten::relu.default", "a": {"l": [{"t": {"c": 1}}]}}]},
    {"id": "s", "n_inputs": True, "ops": [{"op": "aten::relu.default", "a": {"l": [{"t": {"i": 0}}]}}]},
])
def test_a_define_without_an_operator_name_or_with_absurd_inputs_is_a_bad_request(session, define):
    """A huge n_inputs made the replay allocate a slot list of that length (MemoryError);
    a negative one shifted the constants' slots onto the inputs'."""
    resp = session({"uploads": [{"n": 0}], "define": define,
                    "replay": {"id": "s", "n": 1, "inputs": [[0, {"u": 0}]]}},
                   [codec.encode(torch.ones(2), name="x")])
    assert resp.status == StatusCode.BAD_REQUEST, (resp.status, resp.status_text)
    _still_usable(session)


def test_an_integer_argument_past_int64_is_a_bad_request(session):
    """arange(2**64, 3.0, 3): torch raises OverflowError, which the operator errors once
    left out (INTERNAL)."""
    resp = session({"ops": [{"op": "aten::arange.start_step", "a": {"l": [2 ** 64, 3.0, 3]},
                             "k": {"dtype": {"dtype": "bool"}, "pin_memory": None}}]})
    assert resp.status == StatusCode.BAD_REQUEST, (resp.status, resp.status_text)
    _still_usable(session)


def test_a_single_element_slice_of_a_column_is_fetched():
    """One element of a column has a stride that is not 1; serialising it by viewing its
    flattened bytes raised (INTERNAL) until every byte view went through ``codec.byte_view``."""
    c = Client(_server())
    x = c.op("aten::arange.start", 0.0, 12.0)
    grid = c.op("aten::reshape", h(x), {"l": [3, 4]})
    column = c.op("aten::select.int", h(grid), 1, -1)
    one = c.op("aten::slice.Tensor", h(column), 0, 1, 2)
    torch.testing.assert_close(c.fetch(one), torch.tensor([7.0]), rtol=0, atol=0)
    assert wire.content_digest(torch.arange(12.0).reshape(3, 4)[1:2, -1]) == wire.content_digest(torch.tensor([7.0]))


@pytest.mark.parametrize("op,args", [
    # work hidden behind small tensors: a pooling window, composites of matrix products
    ("aten::max_pool2d", lambda x: [h(x), {"l": [384, 384]}, {"l": [1, 1]}]),
    ("aten::matmul", lambda x: [h(x), h(x)]),
    ("aten::einsum", lambda x: ["bij,bjk->bik", {"l": [h(x), h(x)]}]),
])
def test_work_is_priced_by_what_the_operator_does_not_by_its_size(op, args):
    server = _server(max_request_gflop=0.5)     # each of these is about 0.9 GFLOP or more
    c = Client(server)
    x = c.op("aten::zeros", {"l": [1, 768, 768]})
    resp = c.send({"ops": [{"op": op, "a": {"l": args(x)}, "k": {}}]})
    assert resp.status == StatusCode.TOO_LARGE and "max_request_gflop" in resp.status_text, resp.status_text
