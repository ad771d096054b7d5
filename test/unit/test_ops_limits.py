"""Regressions from fuzzing the ``ops`` entry (robot_offload.server.fuzz_ops): requests
that once made the server answer INTERNAL (an exception no check caught) must be
refused with a status the client can act on, and leave the session usable."""

import json

import pytest
import torch

from robot_offload import codec
from robot_offload.protocol import ComputeRequest, StatusCode
from robot_offload.server import OffloadServer, ServerConfig

from devices import SERVER_DEVICE


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
