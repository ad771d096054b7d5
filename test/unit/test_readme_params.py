"""README.md against the code: the parameter tables name exactly the ``~parameters`` each
node reads, with the defaults it launches with, and every relative link resolves.

The code side is found, not listed: each executable in ``nodes/`` imports its node module
from ``robot_offload.ros``; that module's ``rospy.get_param("~name", default)`` calls, the
fields of the dataclasses it passes to ``load_params`` and the ``~`` reads of the helpers it
calls in ``ros/params.py`` are its parameters. The YAML file in ``config/`` that a node's
launch file loads supplies the launched default where it has the key.
"""

import ast
import dataclasses
import importlib
import math
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
ROS_DIR = ROOT / "src" / "robot_offload" / "ros"

#: the parameter file each launch file loads into a node (node executable -> config file)
NODE_YAML = {
    "offload_client": "client.yaml",
    "offload_server": "server.yaml",
    "bandwidth_monitor": "bandwidth_monitor.yaml",
    "power_logger": "power_logger.yaml",
    "camera_node": "camera.yaml",
    "lidar_node": "lidar.yaml",
}

_UNKNOWN = object()


# -- the README side -------------------------------------------------------------------------
def _cells(line):
    return [c.strip() for c in line.strip().strip("|").split("|")]


def readme_tables(text):
    """``{node: {"~name": default text or None}}`` from the ``### `node` `` tables of the
    README's "## Parameters" section. A row may name several parameters (`` `~a`, `~b` ``)
    with as many code spans in its default cell."""
    section = re.search(r"^## Parameters\n(.*?)(?=^## )", text, re.M | re.S)
    assert section, "README.md has no '## Parameters' section"
    tables, node = {}, None
    for line in section.group(1).splitlines():
        heading = re.match(r"^### `([^`]+)`", line)
        if heading:
            node = heading.group(1)
            assert node not in tables, f"two tables for {node}"
            tables[node] = {}
            continue
        if node is None or not line.startswith("|"):
            continue
        cells = _cells(line)
        if cells[0] in ("parameter", "") or set(cells[0]) <= set("-: "):
            continue
        names = re.findall(r"`(~[^`]+)`", cells[0])
        assert names, f"{node}: a row without a `~parameter`: {line!r}"
        defaults = re.findall(r"`([^`]*)`", cells[1]) if len(cells) > 1 else []
        if not defaults:                                 # e.g. "(required)"
            defaults = [None] * len(names)
        assert len(defaults) == len(names), f"{node}: {names} need one default each: {line!r}"
        for name, default in zip(names, defaults):
            assert name not in tables[node], f"{node}: {name} documented twice"
            tables[node][name] = default
    return tables


# -- the code side ---------------------------------------------------------------------------
def _literal(node):
    try:
        return ast.literal_eval(node)
    except ValueError:
        pass
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Mult, ast.Add)):
        left, right = _literal(node.left), _literal(node.right)
        if isinstance(left, (int, float)) and isinstance(right, (int, float)):
            return left * right if isinstance(node.op, ast.Mult) else left + right
    return _UNKNOWN


def _param_reads(tree):
    """``{"~name": default}`` of every ``get_param("~name"[, default])`` in ``tree``."""
    reads = {}
    for call in ast.walk(tree):
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                and call.func.attr == "get_param" and call.args):
            continue
        first = call.args[0]
        if isinstance(first, ast.Constant) and isinstance(first.value, str) and first.value.startswith("~"):
            default = _literal(call.args[1]) if len(call.args) > 1 else _UNKNOWN
            reads.setdefault(first.value, default)
    return reads


def _called_names(tree):
    return {c.func.id for c in ast.walk(tree) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)}


def _helper_reads():
    """``{function name: {"~name": default}}`` for ``ros/params.py``, its calls followed."""
    tree = ast.parse((ROS_DIR / "params.py").read_text())
    funcs = {f.name: f for f in tree.body if isinstance(f, ast.FunctionDef)}
    reads = {name: _param_reads(f) for name, f in funcs.items()}
    for _ in funcs:                                     # transitive closure, small
        for name, f in funcs.items():
            for callee in _called_names(f) & set(funcs):
                for k, v in reads[callee].items():
                    reads[name].setdefault(k, v)
    return reads


def _imports(tree):
    """``{local name: module}`` of the ``from X import Y`` statements of ``tree``."""
    out = {}
    for stmt in ast.walk(tree):
        if isinstance(stmt, ast.ImportFrom) and stmt.module:
            for alias in stmt.names:
                out[alias.asname or alias.name] = stmt.module
    return out


def config_types(tree):
    """The dataclasses that the module ``tree`` passes to ``load_params``."""
    imports, out = _imports(tree), []
    for call in ast.walk(tree):
        if (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)
                and call.func.id == "load_params" and call.args and isinstance(call.args[0], ast.Name)):
            out.append(getattr(importlib.import_module(imports[call.args[0].id]), call.args[0].id))
    return out


def node_modules():
    """``{node executable: its module's source path}`` from ``nodes/*``."""
    out = {}
    for script in sorted((ROOT / "nodes").iterdir()):
        m = re.search(r"^from robot_offload\.ros\.(\w+) import", script.read_text(), re.M)
        if m:
            out[script.name] = ROS_DIR / f"{m.group(1)}.py"
    return out


def code_params():
    """``{node: {"~name": launched default or _UNKNOWN}}`` for every node reading parameters."""
    helpers = _helper_reads()
    result = {}
    for node, path in node_modules().items():
        tree = ast.parse(path.read_text())
        params = _param_reads(tree)
        for cls in config_types(tree):
            for f in dataclasses.fields(cls):
                default = f.default if f.default is not dataclasses.MISSING else _UNKNOWN
                if params.get("~" + f.name, _UNKNOWN) is _UNKNOWN:   # a run-time re-read's default
                    params["~" + f.name] = default
        for name in _called_names(tree) & set(helpers):
            for k, v in helpers[name].items():
                params.setdefault(k, v)
        if node in NODE_YAML:
            values = yaml.safe_load((ROOT / "config" / NODE_YAML[node]).read_text()) or {}
            for key, value in values.items():
                assert "~" + key in params, f"config/{NODE_YAML[node]}: {key} is not read by {node}"
                params["~" + key] = value
        if params:
            result[node] = params
    return result


def _same(documented, actual):
    if actual is _UNKNOWN or documented is None:
        return True
    try:
        doc = yaml.safe_load(documented)
    except yaml.YAMLError:
        return False
    if isinstance(actual, tuple):
        actual = list(actual)
    if isinstance(actual, list) and isinstance(doc, list):
        return len(doc) == len(actual) and all(_same(yaml.safe_dump(d), a) for d, a in zip(doc, actual))
    if isinstance(actual, bool) or isinstance(doc, bool):
        return doc is actual
    if isinstance(actual, (int, float)) and isinstance(doc, (int, float)):
        return math.isclose(float(doc), float(actual), rel_tol=1e-9, abs_tol=1e-12)
    if doc is None and actual == "":
        return True
    return doc == actual


# -- the tests -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tables():
    return readme_tables(README.read_text())


@pytest.fixture(scope="module")
def code():
    return code_params()


def test_every_config_file_belongs_to_a_node():
    assert sorted(p.name for p in (ROOT / "config").glob("*.yaml")) == sorted(NODE_YAML.values())
    assert set(NODE_YAML) <= set(node_modules())


def test_every_node_that_reads_parameters_has_a_table(tables, code):
    assert set(code) == set(tables), (
        f"nodes without a README table: {sorted(set(code) - set(tables))}; "
        f"README tables of no node: {sorted(set(tables) - set(code))}")


@pytest.mark.parametrize("node", sorted(node_modules()))
def test_table_names_exactly_the_parameters_read(node, tables, code):
    documented, read = set(tables.get(node, {})), set(code.get(node, {}))
    assert documented == read, (
        f"{node}: missing from README.md: {sorted(read - documented)}; "
        f"in README.md but not read by the code: {sorted(documented - read)}")


@pytest.mark.parametrize("node", sorted(node_modules()))
def test_documented_defaults_are_the_launched_ones(node, tables, code):
    wrong = {name: (doc, code[node][name]) for name, doc in tables.get(node, {}).items()
             if name in code.get(node, {}) and not _same(doc, code[node][name])}
    assert not wrong, f"{node}: README default vs code/config: {wrong}"


def test_every_relative_link_in_the_readme_resolves():
    text = README.read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert links
    anchors = {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
               for h in re.findall(r"^#+ (.+)$", text, re.M)}
    broken = []
    for link in links:
        if re.match(r"^[a-z]+:", link):
            continue
        path, _, anchor = link.partition("#")
        if path:
            if not (ROOT / path).exists():
                broken.append(link)
        elif anchor not in anchors:
            broken.append(link)
    assert not broken, f"README.md links that do not resolve: {broken}"


def test_a_removed_row_is_caught(tables, code):
    """The check itself: dropping one row of the README makes a table disagree."""
    text = README.read_text()
    row = next(line for line in text.splitlines() if line.startswith("| `~max_request_gflop`"))
    trimmed = readme_tables(text.replace(row + "\n", ""))
    assert set(trimmed["offload_server"]) != set(code["offload_server"])
