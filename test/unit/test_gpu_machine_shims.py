"""The stand-ins scripts/gpu_machine carries to the GPU machine, where the Debian builds
(compiled for Python 3.11) cannot load: rosgraph needs netifaces to list the machine's
addresses, and the offload_client node decodes camera images with cv_bridge."""

import importlib.util
import os
import socket

import numpy as np
import pytest

SHIMS = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "gpu_machine", "shims")


def _load(name, rel):
    spec = importlib.util.spec_from_file_location(f"gpu_shim_{name}", os.path.join(SHIMS, rel))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_netifaces_lists_loopback_with_its_address():
    ni = _load("netifaces", "netifaces.py")
    assert "lo" in ni.interfaces()
    addrs = ni.ifaddresses("lo")
    assert {"addr": "127.0.0.1"} in addrs[socket.AF_INET]
    assert ni.ifaddresses("no-such-interface-x") == {}


class _Image:
    def __init__(self, data, height, width, step, encoding):
        self.data, self.height, self.width, self.step, self.encoding = data, height, width, step, encoding


@pytest.mark.parametrize("padding", [0, 3])
def test_cv_bridge_decodes_8_bit_images_row_padding_included(padding):
    cvb = _load("cv_bridge", os.path.join("cv_bridge", "__init__.py"))
    rgb = np.random.default_rng(0).integers(0, 256, (4, 5, 3), dtype=np.uint8)
    rows = np.concatenate([rgb.reshape(4, 15), np.zeros((4, padding), np.uint8)], axis=1)
    msg = _Image(rows.tobytes(), 4, 5, 15 + padding, "rgb8")
    bridge = cvb.CvBridge()
    np.testing.assert_array_equal(bridge.imgmsg_to_cv2(msg, desired_encoding="rgb8"), rgb)
    np.testing.assert_array_equal(bridge.imgmsg_to_cv2(msg, desired_encoding="bgr8"), rgb[..., ::-1])
    mono = _Image(rgb[..., 0].tobytes(), 4, 5, 5, "mono8")
    np.testing.assert_array_equal(bridge.imgmsg_to_cv2(mono), rgb[..., 0])
    with pytest.raises(cvb.CvBridgeError):
        bridge.imgmsg_to_cv2(_Image(b"", 0, 0, 0, "16UC1"))
    with pytest.raises(cvb.CvBridgeError):
        bridge.imgmsg_to_cv2(mono, desired_encoding="rgb8")


def test_distutils_spawn_finds_executables():
    spawn = _load("distutils_spawn", os.path.join("distutils", "spawn.py"))
    assert spawn.find_executable("sh")
    assert spawn.find_executable("no-such-program-x") is None
