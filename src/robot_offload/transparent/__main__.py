"""``python -m robot_offload.transparent [options] -- python app.py [args]`` (see launcher)."""
import sys

from robot_offload.transparent.launcher import main

sys.exit(main())
