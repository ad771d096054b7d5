"""Where the unit tests' in-process servers compute, and what "the same as local" means there.

CI has no GPU, so by default every in-process server runs on the CPU and a lossless
distributed result must equal the robot's local one within each test's own (mostly zero)
tolerance. On a machine with a GPU,

    ROBOT_OFFLOAD_TEST_DEVICE=cuda python -m pytest test/unit

runs the same tests with every in-process server on CUDA: the check of the server side on
the device it is built for. CUDA's float32 kernels sum in another order than the CPU's, so
outputs differ by rounding (TF32 stays off: ``ServerConfig.allow_tf32``), and a decision
taken on a value at a threshold (an argmax, a detection score) can flip on a few elements.
:func:`assert_same_as_local` then compares each float output to within
``CROSS_DEVICE_RTOL`` of its largest magnitude and lets at most ``CROSS_DEVICE_FLIPS`` of an
integer output's elements differ. Outputs chosen among near-ties of random weights (Faster
R-CNN's proposals, KAPAO's keypoint objects) are not comparable across devices at all:
those tests say so with :func:`skip_off_cpu`. ``ROBOT_OFFLOAD_TEST_ERRORS=<file>`` appends every
comparison's observed error there (JSON lines), for the README's figures.
"""

import json
import os

import pytest
import torch

from robot_offload import structure

SERVER_DEVICE = os.environ.get("ROBOT_OFFLOAD_TEST_DEVICE", "cpu")
ON_CPU = SERVER_DEVICE == "cpu"
#: Largest |remote - local| over max |local|, per float output, with the server on CUDA.
CROSS_DEVICE_RTOL = 1e-4
#: Largest share of an integer output's elements that may differ, with the server on CUDA.
CROSS_DEVICE_FLIPS = 0.005


def to_server(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the in-process server's device (for tests that call a server model directly)."""
    return t.to(SERVER_DEVICE)


def skip_off_cpu(why: str) -> None:
    """Skip (never pass) a comparison that only holds with the server on the CPU."""
    if not ON_CPU:
        pytest.skip(f"server on {SERVER_DEVICE}: {why}")


def assert_same_as_local(actual, expected, msg=None, **cpu_tolerance):
    """``torch.testing.assert_close(actual, expected, **cpu_tolerance)`` with the server on
    the CPU; with the server elsewhere, the cross-device comparison described above (never
    tighter than ``cpu_tolerance``)."""
    if ON_CPU:
        torch.testing.assert_close(actual, expected, msg=msg, **cpu_tolerance)
        return
    got, got_structure = structure.flatten(actual)
    want, want_structure = structure.flatten(expected)
    assert got_structure == want_structure, f"{msg or ''}: output structure differs"
    rtol = max(CROSS_DEVICE_RTOL, cpu_tolerance.get("rtol") or 0.0)
    atol = cpu_tolerance.get("atol") or 0.0
    for i, (a, b) in enumerate(zip(got, want)):
        a = a.detach().cpu()
        assert a.shape == b.shape and a.dtype == b.dtype, \
            f"{msg or ''}: output {i} is {a.dtype}{list(a.shape)}, local {b.dtype}{list(b.shape)}"
        if b.numel() == 0:
            continue
        if b.is_floating_point():
            scale = b.abs().max().item()
            err = (a - b).abs().max().item()
            _record("float", err / scale if scale else err)
            assert err <= rtol * scale + atol, (
                f"{msg or ''}: output {i} {err:.3g} from local, more than {rtol:g} of its "
                f"scale {scale:.3g} (+ atol {atol:g})")
        else:
            flips = (a != b).float().mean().item()
            _record("flips", flips)
            assert flips <= CROSS_DEVICE_FLIPS, \
                f"{msg or ''}: output {i}: {flips:.2%} of its elements differ from local"


def _record(kind, value):
    path = os.environ.get("ROBOT_OFFLOAD_TEST_ERRORS")
    if path:
        test = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]
        with open(path, "a") as f:
            f.write(json.dumps({"test": test, "kind": kind, "value": value}) + "\n")


def assert_same_up_to_summation_order(y, ref, what=""):
    """Lossless results computed in pieces (lop's row stripes, a partition's head and tail)
    equal local up to floating-point summation order: each floating output within 1e-5 of
    its own largest magnitude (random-weight ResNet-101 logits reach ~3e4, so an absolute
    tolerance alone would test nothing or everything), the others exact. With the server on
    another device, :func:`assert_same_as_local`'s cross-device comparison."""
    if not ON_CPU:
        assert_same_as_local(y, ref, msg=what)
        return
    ly, sy = structure.flatten(y)
    lr, sr = structure.flatten(ref)
    assert sy == sr, what
    for a, b in zip(ly, lr):
        if b.is_floating_point():
            scale = max(1.0, float(b.abs().max())) if b.numel() else 1.0
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * scale, msg=lambda m: f"{what}: {m}")
        else:
            assert torch.equal(a, b), what
