"""mode_control: which of the client node's interfaces (the ~mode parameter, the set_mode
service) may switch its mode after start."""

import logging

import pytest

from robot_offload.client import ClientConfig
from robot_offload.errors import ConfigError
from robot_offload.mode_control import MODE_CONTROLS, ModeControl

pytestmark = pytest.mark.robot_side


def test_open_follows_the_parameter_and_the_service():
    mc = ModeControl("open", "local")
    assert mc.service_refusal("full_offload") is None
    assert mc.mode_from_param("full_offload", "local") == "full_offload"
    assert mc.mode_from_param("local", "local") is None


def test_service_ignores_the_parameter_and_logs_once(caplog):
    mc = ModeControl("service", "local")
    assert mc.service_refusal("full_offload") is None
    with caplog.at_level(logging.WARNING, logger="robot_offload.mode_control"):
        for wanted in ("full_offload", "full_offload", "lop", "teleport"):
            assert mc.mode_from_param(wanted, "local") is None
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "ignored" in lines[0] and "'service'" in lines[0], lines
    # after a set_mode the node writes the new mode into the parameter: nothing to do
    assert mc.mode_from_param("full_offload", "full_offload") is None


def test_locked_refuses_the_service_and_ignores_the_parameter(caplog):
    mc = ModeControl("locked", "full_offload")
    for requested in ("local", "full_offload", "teleport"):
        text = mc.service_refusal(requested)
        assert text and "locked" in text and "'full_offload'" in text
    with caplog.at_level(logging.WARNING, logger="robot_offload.mode_control"):
        assert mc.mode_from_param("local", "full_offload") is None
        assert mc.mode_from_param("local", "full_offload") is None
    assert len(caplog.records) == 1 and "fixed at 'full_offload'" in caplog.records[0].getMessage()


def test_mode_control_is_validated():
    assert ClientConfig().mode_control == "open"
    for policy in MODE_CONTROLS:
        assert ClientConfig(mode_control=policy).validate().mode_control == policy
    with pytest.raises(ConfigError, match="mode_control"):
        ClientConfig(mode_control="closed").validate()
    with pytest.raises(ValueError):
        ModeControl("closed", "local")
