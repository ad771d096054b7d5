"""Shared pytest fixtures: an in-process client/server pair for the unit tests.

Tests marked ``robot_side`` (pytest.ini) exercise only the code that runs on the robot;
scripts/test_robot_torch21.sh runs them again under the robot's older torch, where the
server's code is not importable. So nothing here imports the server until a test asks
for it; a ``-m robot_side`` run does not even collect the modules without that marker
(they may import the server at the top), and fails if any test imported the server.
"""

import sys

import pytest

from devices import SERVER_DEVICE


@pytest.fixture(scope="session")
def shared_server():
    """One in-process server for the whole session: models are built once."""
    from robot_offload.server import OffloadServer, ServerConfig
    return OffloadServer(ServerConfig(ops_sandbox=False, device=SERVER_DEVICE))


def _robot_side_run(config) -> bool:
    return config.getoption("markexpr", "") == "robot_side"


def pytest_ignore_collect(collection_path, config):
    if (_robot_side_run(config) and collection_path.suffix == ".py"
            and collection_path.name.startswith("test_")
            and "mark.robot_side" not in collection_path.read_text()):
        return True
    return None


def pytest_sessionfinish(session, exitstatus):
    if (_robot_side_run(session.config)
            and "robot_offload.server" in sys.modules and exitstatus == 0):
        print("\nrobot_side tests imported robot_offload.server: they are not robot-side", file=sys.stderr)
        session.exitstatus = 1
