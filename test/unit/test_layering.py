"""The house rules on imports, read from the source (AST): nothing outside ``ros/``
imports rospy (or another ROS client module); robot-side packages never import the
server; every package under ``src/`` is installed by setup.py; no import cycles between
the package's modules."""

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PKG = ROOT / "src" / "robot_offload"
ROS_ONLY = {"rospy", "rosgraph", "roslib", "rosservice", "rostopic", "roslaunch", "rosbag", "genpy",
            "cv_bridge", "message_filters", "diagnostic_updater", "tf2_ros", "tf2_geometry_msgs"}
#: robot-side code: runs on the robot, so it must work without the server's code
ROBOT_SIDE = ("backends", "transparent", "client.py", "camera.py", "bandwidth.py", "power.py", "link.py",
              "transport", "apps", "health.py", "compat.py")


def _module(path: pathlib.Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(source: str, module: str = "", top_level: bool = False) -> set:
    """Absolute names of every module ``source`` imports (relative imports resolved
    against ``module``; function-level imports too unless ``top_level``)."""
    out = set()
    tree = ast.parse(source)
    for node in (tree.body if top_level else ast.walk(tree)):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = module.split(".")[: len(module.split(".")) - node.level]
                base = ".".join(pkg + ([base] if base else []))
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
    return out


def _files():
    return sorted(p for p in PKG.rglob("*.py"))


def test_detector_sees_planted_imports():
    planted = "import rospy\nfrom robot_offload.server import core\ndef f():\n    from ..server import x\n"
    found = imports_of(planted, "robot_offload.backends.local")
    assert "rospy" in found and "robot_offload.server" in found and "robot_offload.server.x" in found


@pytest.mark.parametrize("path", _files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_rospy_only_under_ros(path):
    rel = path.relative_to(PKG)
    if rel.parts[0] == "ros":
        return
    bad = {m for m in imports_of(path.read_text(), _module(path)) if m.split(".")[0] in ROS_ONLY}
    assert not bad, f"{rel} imports {sorted(bad)}: ROS client code belongs under src/robot_offload/ros/"


@pytest.mark.parametrize("path", [p for p in _files() if p.relative_to(PKG).parts[0] in ROBOT_SIDE],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_robot_side_never_imports_the_server(path):
    found = imports_of(path.read_text(), _module(path))
    bad = sorted(m for m in found if m == "robot_offload.server" or m.startswith("robot_offload.server."))
    # The launcher's --inproc (a server in the program's own process, for trying a program
    # without a GPU PC) is the one exception: imported inside a function, where marked.
    marked = "# in-process server (test and local use only)" in path.read_text()
    assert not bad or marked, f"{path.relative_to(ROOT)} imports {bad}: robot-side code must not need the server"


def test_setup_py_installs_every_package():
    listed = set(re.findall(r'"(robot_offload(?:\.[a-z0-9_]+)*)"', (ROOT / "setup.py").read_text()))
    packages = {_module(p) for p in PKG.rglob("__init__.py")}
    missing = sorted(packages - listed)
    assert not missing, f"setup.py does not install {missing}: a catkin install space would fail to import them"


def test_no_import_cycles():
    """Between module-level imports (a registry importing its entries inside a function,
    after it is complete, is fine)."""
    graph = {}
    for path in _files():
        mod = _module(path)
        deps = {m for m in imports_of(path.read_text(), mod, top_level=True) if m.startswith("robot_offload")}
        # a name imported from a package is that package or its submodule
        graph[mod] = {d for d in deps if d != mod}
    known = set(graph)

    def resolve(name):
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name

    edges = {m: {resolve(d) for d in ds} - {m, ""} for m, ds in graph.items()}
    # package __init__ files re-export their children: an edge parent -> child is not a cycle
    state, stack, cycles = {}, [], []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for d in sorted(edges.get(m, ())):
            if d.startswith(m + "."):
                continue
            if state.get(d) == 1:
                cyc = stack[stack.index(d):] + [d]
                if not all(b.startswith(a + ".") or a.startswith(b + ".") for a, b in zip(cyc, cyc[1:])):
                    cycles.append(cyc)
            elif d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m)
    assert not cycles, f"import cycles: {cycles[:3]}"
