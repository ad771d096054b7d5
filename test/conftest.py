"""Shared pytest fixtures: an in-process client/server pair for the unit tests."""

import pytest

from robot_offload.server import OffloadServer, ServerConfig

from devices import SERVER_DEVICE


@pytest.fixture(scope="session")
def shared_server():
    """One in-process server for the whole session: models are built once."""
    return OffloadServer(ServerConfig(ops_sandbox=False, device=SERVER_DEVICE))
