"""Joules per frame: the state model over a frame's intervals (hand-computed), and the
measured path when sensor samples cover the frame."""

import time

import pytest
import torch

from robot_offload.client import ClientConfig, OffloadClient
from robot_offload.energy import modelled_energy_j
from robot_offload.power import EnergyMeter

pytestmark = pytest.mark.robot_side


def test_modelled_energy_by_hand():
    # compute [0, 1], transmit [0.5, 2], idle to 3 s (Intra-DP Table 3 watts):
    # 13.35 * 0.5 + (13.35 + 4.25 - 4.04) * 0.5 + 4.25 * 1 + 4.04 * 1
    expected = 6.675 + 6.78 + 4.25 + 4.04
    got = modelled_energy_j([("compute", 0.0, 1.0), ("transmit", 0.5, 2.0)], 0.0, 3.0)
    assert got == pytest.approx(expected)
    # intervals are clipped to the frame; touching intervals are fine
    assert modelled_energy_j([("compute", -1.0, 1.0), ("compute", 1.0, 2.0)], 0.0, 2.0) == pytest.approx(26.7)
    assert modelled_energy_j([], 0.0, 2.0) == pytest.approx(8.08)


def test_energy_meter_push_and_hold_last():
    m = EnergyMeter(None)
    m.add(0.0, 10.0)
    m.add(1.0, 20.0)
    assert m.energy_between(0.5, 1.0) == pytest.approx(8.75)
    with pytest.raises(ValueError):
        m.energy_between(0.5, 2.0)
    assert m.energy_between(0.5, 2.0, hold_last=True) == pytest.approx(28.75)
    with pytest.raises(ValueError):
        m.add(0.5, 1.0)


def test_client_energy_modelled_then_measured():
    c = OffloadClient(ClientConfig(model="resnet18", mode="local", input_size=(32, 32)), None)
    x = torch.randn(1, 3, 32, 32)
    _, stats = c.infer(x)
    assert stats.energy_modelled
    # a local frame computes, then idles for the bookkeeping until the frame ends
    assert stats.robot_compute_s <= stats.processing_s
    idle_s = stats.processing_s - stats.robot_compute_s
    assert stats.energy_j == pytest.approx(13.35 * stats.robot_compute_s + 4.04 * idle_s, rel=1e-6)
    now = time.time()
    c.measured_power.add(now - 5.0, 7.0)
    c.measured_power.add(now - 4.0, 7.0)
    _, stats = c.infer(x)
    assert not stats.energy_modelled
    assert stats.energy_j == pytest.approx(7.0 * stats.processing_s, rel=1e-4)  # epoch-sized floats
    c.close()
