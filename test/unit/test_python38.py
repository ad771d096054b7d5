"""Robot-side code runs on Python 3.8 (ROS Noetic on Ubuntu 20.04 and JetPack 5), checked
with vermin: ``src/robot_offload`` except the server package, and ``nodes/``.

vermin cannot tell evaluated from unevaluated annotations on its own, so the check shows it
only the code that Python 3.8 evaluates:

- in a module without ``from __future__ import annotations`` every function and
  module-level annotation is evaluated when its ``def`` or assignment runs: vermin gets the
  file as it is, with ``--eval-annotations`` (``list[int]`` needs 3.9) and the
  ``union-types`` feature (``int | None`` needs 3.10);
- in a module with that import no annotation is evaluated: vermin gets a copy with each
  annotation replaced by ``object`` (the same lines), so ``list[int]`` there is accepted,
  and anything outside annotations (``Boxes = list[int]``, ``isinstance(x, int | None)``)
  still fails.

The union-types feature is a heuristic: a bitwise or of two module constants looks like
``X | Y`` to it. Such a line carries vermin's documented ``# novm`` comment, with the
reason beside it.
"""

import ast
import pathlib
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PKG = ROOT / "src" / "robot_offload"
TARGET = "3.8"
VERMIN = "import sys; from vermin import main; sys.argv[0] = 'vermin'; sys.exit(main())"


def robot_side_files():
    files = [p for p in PKG.rglob("*.py") if p.relative_to(PKG).parts[0] != "server"]
    return sorted(files) + sorted(p for p in (ROOT / "nodes").iterdir() if p.is_file())


def has_future_annotations(tree):
    return any(isinstance(n, ast.ImportFrom) and n.module == "__future__"
               and any(a.name == "annotations" for a in n.names) for n in tree.body)


def without_annotations(source):
    """``source`` with every annotation replaced by ``object``, newlines kept (line
    numbers stay those of the file)."""
    tree = ast.parse(source)
    spans = []
    for node in ast.walk(tree):
        if isinstance(node, ast.arg) and node.annotation is not None:
            spans.append(node.annotation)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.returns is not None:
            spans.append(node.returns)
        elif isinstance(node, ast.AnnAssign):
            spans.append(node.annotation)
    lines = source.encode().splitlines(keepends=True)
    starts = [0]
    for line in lines:
        starts.append(starts[-1] + len(line))
    data = source.encode()
    # ast offsets are UTF-8 byte columns; replace from the end so earlier offsets hold
    for n in sorted(spans, key=lambda n: (n.lineno, n.col_offset), reverse=True):
        a = starts[n.lineno - 1] + n.col_offset
        b = starts[n.end_lineno - 1] + n.end_col_offset
        data = data[:a] + b"object" + b"\n" * data[a:b].count(b"\n") + data[b:]
    return data.decode()


def violations(files, tmp_path, root=ROOT):
    """vermin's violations of the 3.8 target as ``path:line: feature needs 3.x`` lines
    (paths relative to ``root``)."""
    shown = []
    for src in files:
        text = src.read_text()
        rel = src.relative_to(root)
        if has_future_annotations(ast.parse(text)):
            text = without_annotations(text)
        dst = tmp_path / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_text(text)
        shown.append(dst)
    proc = subprocess.run(
        [sys.executable, "-c", VERMIN, f"-t={TARGET}-", "--no-tips", "--violations",
         "--no-config-file", "--eval-annotations", "--feature", "union-types",
         "--format", "parsable", *map(str, shown)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    found = []
    for line in proc.stdout.splitlines():
        path, lineno, _col, _py2, py3, feature = (line.split(":", 5) + [""] * 6)[:6]
        if path and lineno:
            found.append(f"{pathlib.Path(path).relative_to(tmp_path)}:{lineno}: {feature} needs {py3}")
    # exit 1 with nothing parsed would be vermin failing, not a clean result
    assert proc.returncode == (1 if found else 0), proc.stdout[-3000:]
    return found


def test_robot_side_code_runs_on_python_38(tmp_path):
    files = robot_side_files()
    assert len(files) > 50 and any(f.parent.name == "nodes" for f in files)
    found = violations(files, tmp_path)
    assert not found, "robot-side code needs a newer Python than 3.8:\n" + "\n".join(found)


PLANTED = {
    # source, caught
    "removeprefix": ("x = 'ab'.removeprefix('a')\n", True),
    "generic_annotation": ("def f(x: list[int]) -> None:\n    pass\n", True),
    "union_annotation": ("def f(x: int | None) -> None:\n    pass\n", True),
    "match": ("def f(v):\n    match v:\n        case 1:\n            pass\n", True),
    "future_annotations": ("from __future__ import annotations\n"
                           "def f(x: list[int], y: 'int | None' = None) -> dict[str, int | None]:\n"
                           "    z: tuple[int, ...] = ()\n    return {}\n", False),
    "future_runtime_generic": ("from __future__ import annotations\n"
                               "Boxes = list[int]\ndef f(x: list[int]) -> None:\n    pass\n", True),
    "future_runtime_union": ("from __future__ import annotations\n"
                             "def f(x: int | None) -> bool:\n    return isinstance(x, int | None)\n", True),
    "flags_marked": ("import os\nflags = os.O_RDWR | os.O_NONBLOCK  # novm: flags, not a union type\n", False),
}


@pytest.mark.parametrize("name", sorted(PLANTED))
def test_the_check_catches_planted_code(tmp_path, name):
    """The same check on small planted files, one of them named like a node (no .py)."""
    source, caught = PLANTED[name]
    planted = tmp_path / "planted"
    planted.mkdir()
    path = planted / name
    path.write_text("#!/usr/bin/env python3\n" + textwrap.dedent(source))
    found = violations([path], tmp_path / "checked", root=planted)
    assert bool(found) == caught, found
    if caught:
        assert all(f.startswith(f"{name}:") for f in found), found


def test_annotations_are_replaced_on_their_own_lines():
    src = "from __future__ import annotations\ndef f(a: 'é',\n      b: dict[\n str, int]) -> list[int]:\n    c: int = 1\n"
    out = without_annotations(src)
    assert out.count("\n") == src.count("\n")
    assert out == ("from __future__ import annotations\ndef f(a: object,\n      b: object\n)"
                   " -> object:\n    c: object = 1\n")
