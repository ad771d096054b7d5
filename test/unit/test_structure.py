"""Flattening nested outputs and refusing malformed descriptions."""

import json

import pytest
import torch

from robot_offload import structure
from robot_offload.errors import CodecError

pytestmark = pytest.mark.robot_side


def test_round_trip_of_detection_style_output():
    out = [{"boxes": torch.zeros(0, 4), "labels": torch.zeros(0, dtype=torch.int64),
            "scores": torch.zeros(0)}, ({"x": torch.ones(2)}, 3, None, "s", 1.5, True)]
    leaves, spec = structure.flatten(out)
    back = structure.unflatten(leaves, spec)
    assert isinstance(back, list) and isinstance(back[1], tuple)
    assert list(back[0]) == ["boxes", "labels", "scores"]
    assert back[1][1:] == (3, None, "s", 1.5, True)
    torch.testing.assert_close(back[1][0]["x"], torch.ones(2))


def test_plain_tensor():
    leaves, spec = structure.flatten(torch.ones(3))
    assert len(leaves) == 1
    assert torch.equal(structure.unflatten(leaves, spec), torch.ones(3))


@pytest.mark.parametrize("spec", ['{"t": 5}', '{"t": "0"}', "not json", '{"z": 1}', '[]',
                                  '{"l": [{"t": 0}, {"t": 0}]}', '{"d": [[1, {"t": 0}]]}',
                                  '{"v": {"a": 1}}', '{"l": []}'])
def test_malformed_structures_are_refused(spec):
    with pytest.raises(CodecError):
        structure.unflatten([torch.ones(1)], spec)


def test_deep_nesting_refused():
    spec = {"t": 0}
    for _ in range(100):
        spec = {"l": [spec]}
    with pytest.raises(CodecError):
        structure.unflatten([torch.ones(1)], json.dumps(spec))


def test_unsupported_objects_refused():
    with pytest.raises(CodecError):
        structure.flatten({"a": object()})
    with pytest.raises(CodecError):
        structure.flatten({1: torch.ones(1)})
