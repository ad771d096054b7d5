"""The package as users deploy it: ``catkin_make install`` into a prefix, then the demo run
from that install space alone.

A fresh catkin workspace in a temporary folder (its ``src/robot_offload`` links to the
repository's entries, as scripts/setup.sh does), built with the environment a user has
(ROS and the venv, no devel space of this checkout). The workspace's src/, build/ and
devel/ are deleted before anything runs, so every node, launch file, config file,
message and Python module must come from the install prefix. The demo then starts a real
master and every node of demo.launch through roslaunch and must report frames in both
modes.
"""

import os
import re
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PKG_SRC = os.path.join(ROOT, "src", "robot_offload")
#: Variables of the calling shell that point into this checkout's devel space.
WORKSPACE_VARS = ("CMAKE_PREFIX_PATH", "ROS_PACKAGE_PATH", "PYTHONPATH", "LD_LIBRARY_PATH",
                  "PKG_CONFIG_PATH", "ROS_MASTER_URI", "ROS_IP", "ROS_HOSTNAME")
ROS_SETUP = "[ -f /opt/ros/noetic/setup.bash ] && source /opt/ros/noetic/setup.bash\n"

IMPORT_ALL = """
import importlib, pkgutil, sys
import robot_offload
failed = []
n = 0
for m in pkgutil.walk_packages(robot_offload.__path__, "robot_offload."):
    if m.name.rsplit(".", 1)[-1] == "__main__":
        continue
    try:
        importlib.import_module(m.name)
        n += 1
    except Exception as e:
        failed.append(f"{m.name}: {e!r}")
print("package", robot_offload.__file__)
print("imported", n)
print("failed", failed)
"""


def _clean_env(tmp):
    env = {k: v for k, v in os.environ.items() if k not in WORKSPACE_VARS}
    # the venv's python first on PATH, as `source .venv/bin/activate` puts it
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env["ROS_HOME"] = str(tmp / "ros_home")
    env["ROS_LOG_DIR"] = str(tmp / "ros_home" / "log")
    return env


def _bash(script, env, timeout_s, log):
    proc = subprocess.run(["bash", "-c", "set -eo pipefail\n" + script], env=env, cwd=str(log.parent),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout_s)
    log.write_text(proc.stdout)
    assert proc.returncode == 0, f"exit {proc.returncode}; last output:\n{proc.stdout[-4000:]}"
    return proc.stdout


def _relative_files(top, keep=lambda name: True):
    out = set()
    for d, dirs, files in os.walk(top):
        dirs[:] = [x for x in dirs if x != "__pycache__"]
        out.update(os.path.relpath(os.path.join(d, f), top) for f in files if keep(f))
    return out


def test_install_space_runs_the_demo(tmp_path):
    ws, prefix = tmp_path / "ws", tmp_path / "install"
    pkg = ws / "src" / "robot_offload"
    pkg.mkdir(parents=True)
    for entry in os.listdir(ROOT):
        if not entry.startswith("."):
            os.symlink(os.path.join(ROOT, entry), pkg / entry)
    env = _clean_env(tmp_path)
    _bash(ROS_SETUP + f"cd {ws}\ncatkin_make install -DCMAKE_INSTALL_PREFIX={prefix} "
          f"-DPYTHON_EXECUTABLE={sys.executable}\n", env, 400, tmp_path / "catkin_make.log")
    for built in ("src", "build", "devel"):
        shutil.rmtree(ws / built)

    # Everything the package ships is there: each module of each package (setup.py's list),
    # each node (executable), launch and config file, message and service.
    dist = prefix / "lib" / "python3" / "dist-packages" / "robot_offload"
    share = prefix / "share" / "robot_offload"
    py = _relative_files(PKG_SRC, lambda f: f.endswith(".py"))
    missing = sorted(py - _relative_files(dist))
    assert not missing, f"not installed (setup.py's package list?): {missing}"
    for sub in ("msg", "srv"):
        assert (dist / sub / "__init__.py").is_file(), f"generated {sub} module not installed"
    for node in os.listdir(os.path.join(ROOT, "nodes")):
        path = prefix / "lib" / "robot_offload" / node
        assert path.is_file() and os.access(path, os.X_OK), f"node {node} not installed"
    for sub in ("launch", "config", "msg", "srv"):
        missing = sorted(_relative_files(os.path.join(ROOT, sub)) - _relative_files(share / sub))
        assert not missing, f"{sub}/ not installed: {missing}"

    out = _bash(ROS_SETUP + f"source {prefix}/setup.bash\n"
                "echo \"found $(rospack find robot_offload)\"\n"
                f"python - <<'EOF'\n{IMPORT_ALL}EOF\n"
                "rosrun robot_offload demo --duration 16 --rate-hz 5 --input-size '[64,64]'\n",
                env, 300, tmp_path / "demo.log")
    assert f"found {share}\n" in out
    assert f"package {dist}/__init__.py\n" in out
    imported = int(re.search(r"^imported (\d+)$", out, re.M).group(1))
    # every source module, and the generated msg/srv modules (walk_packages skips none)
    assert imported >= len([f for f in py if not f.endswith("__main__.py")]), out[-3000:]
    assert "failed []\n" in out, out[-3000:]

    rows = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0] in ("local", "full_offload"):
            rows[cells[0]] = cells
    header = next(line for line in out.splitlines() if line.startswith("| mode |"))
    cols = [c.strip() for c in header.strip().strip("|").split("|")]
    assert set(rows) == {"local", "full_offload"}, out[-3000:]
    table = {mode: dict(zip(cols, cells)) for mode, cells in rows.items()}
    assert int(table["local"]["frames"]) >= 3
    offloaded = int(table["full_offload"]["frames"]) - int(table["full_offload"]["fallbacks"])
    assert offloaded >= 3, table["full_offload"]
    assert float(table["full_offload"]["server_ms"]) > 0 and float(table["full_offload"]["kb_up"]) > 0
