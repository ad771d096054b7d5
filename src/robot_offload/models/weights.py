"""Loading a user's weights file from the local disk (``~weights`` parameter).

Never used on data received over the network: both sides read their own copy of the same
file and compare hashes. ``.safetensors`` files are read with the safetensors package when
it is installed; ``.pt``/``.pth`` state dicts with ``weights_only=True``, which refuses
anything but tensors and plain containers.
"""

import os

import torch

from robot_offload.errors import ConfigError


def load_state_dict_file(path: str) -> dict:
    if not os.path.isfile(path):
        raise ConfigError(f"weights file {path!r} does not exist")
    if path.endswith(".safetensors"):
        try:
            from safetensors.torch import load_file
        except ImportError as e:
            raise ConfigError("reading .safetensors needs `pip install safetensors`") from e
        return load_file(path)
    state = torch.load(path, map_location="cpu", weights_only=True)  # local file, not network data
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    if not isinstance(state, dict):
        raise ConfigError(f"{path!r} does not hold a state dict")
    return state
