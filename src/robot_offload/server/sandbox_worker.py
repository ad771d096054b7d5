"""Entry point of an ops sandbox process (``python -m robot_offload.server.sandbox_worker FD``):
see :mod:`robot_offload.server.sandbox`. A module of its own so that the package that
imports the sandbox is not also run as ``__main__``."""

import sys

from robot_offload.server.sandbox import main

if __name__ == "__main__":
    sys.exit(main())
