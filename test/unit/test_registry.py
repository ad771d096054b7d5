"""The model registry: names, refusals, deterministic weights and hashes, preprocessing."""

import numpy as np
import pytest
import torch

from robot_offload.errors import ConfigError, UnknownModelError
from robot_offload.models import get_spec, names, weights_hash

pytestmark = pytest.mark.robot_side

PAPER_MODELS = {"resnet101", "vgg19", "convnext_tiny", "densenet121", "regnet_y_400mf",
                "mobilenet_v2", "fcn_resnet50", "deeplabv3_resnet50", "fasterrcnn_resnet50_fpn",
                "retinanet_resnet50_fpn", "kapao_l", "agrnav"}


def test_registry_has_the_papers_models():
    assert PAPER_MODELS <= set(names())


def test_unknown_model_lists_known_ones():
    with pytest.raises(UnknownModelError) as e:
        get_spec("resnet9000")
    assert "resnet101" in str(e.value) and "kapao_l" in str(e.value)


def test_weights_are_seeded_and_hash_is_stable():
    spec = get_spec("resnet18")
    a, b = spec.build(), spec.build()
    assert weights_hash(a) == weights_hash(b)
    other = get_spec("mobilenet_v2").build()
    assert weights_hash(other) != weights_hash(a)
    with torch.no_grad():
        next(b.parameters()).add_(1e-3)
    assert weights_hash(a) != weights_hash(b)


def test_weights_file_round_trip(tmp_path):
    spec = get_spec("resnet18")
    model = spec.build()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    path = tmp_path / "w.pt"
    torch.save(model.state_dict(), path)
    loaded = spec.build(str(path))
    assert weights_hash(loaded) == weights_hash(model) != weights_hash(spec.build())
    with pytest.raises(ConfigError):
        spec.build(str(tmp_path / "missing.pt"))


def test_image_preprocessing():
    spec = get_spec("resnet18")
    img = np.full((48, 64, 3), 255, dtype=np.uint8)
    x = spec.preprocess(img, (32, 32))
    assert x.shape == (1, 3, 32, 32) and x.dtype == torch.float32
    expected = (1.0 - np.array(spec.mean)) / np.array(spec.std)
    torch.testing.assert_close(x[0, :, 0, 0], torch.tensor(expected, dtype=torch.float32))
    assert spec.preprocess(np.zeros((10, 10), np.uint8), (8, 8)).shape == (1, 3, 8, 8)
    for bad in (np.zeros((4, 4, 3), np.float32), np.zeros((4, 4, 5), np.uint8), np.zeros((0, 4, 3), np.uint8)):
        with pytest.raises(ConfigError):
            spec.preprocess(bad, (8, 8))


def test_pointcloud_preprocessing_is_voxelisation():
    spec = get_spec("agrnav")
    points = np.array([[1.0, 0.0, 0.0, 0.5]], dtype=np.float32)
    x = spec.preprocess(points, spec.test_input_size)
    nx, ny, nz = spec.test_input_size
    assert x.shape == (1, 1, nx, nz, ny)
    assert float(x.sum()) == 1.0
    # the size a tensor was made at, for synthesising more of its kind
    assert spec.input_size_of(x) == spec.test_input_size
    image = get_spec("resnet18")
    assert image.input_size_of(image.example_input((48, 64))) == (48, 64)


def test_models_built_in_two_threads_at_once_get_the_seeded_weights():
    """Builds draw from torch's global generator: concurrent ones must not interleave."""
    import threading
    spec = get_spec("mobilenet_v2")
    alone = weights_hash(spec.build())
    hashes = []
    threads = [threading.Thread(target=lambda: hashes.append(weights_hash(spec.build()))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert hashes == [alone] * 3
