"""gradwatch runs on Python 3.10: every standard-library name its code and examples use exists there.

The names of 3.10's modules are in ``tests/python310_stdlib.json`` (``python3.10 tools/stdlib_names.py``), so
this runs on any Python. A name used through ``getattr(module, "name", fallback)`` is not an attribute read and
is not checked: that is how code uses a newer name with a fallback.
"""

from __future__ import annotations

import ast
import json
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SNAPSHOT = json.loads((ROOT / "tests" / "python310_stdlib.json").read_text())
KNOWN: dict[str, set[str]] = {m: set(names) for m, names in SNAPSHOT["modules"].items()}
SOURCES = sorted(p for folder in ("gradwatch", "examples") for p in (ROOT / folder).rglob("*.py"))


def _stdlib(module: str) -> bool:
    return module.split(".")[0] in sys.stdlib_module_names and module != "__future__"


def newer_names(source: str) -> list[str]:
    """``module.name`` for each standard-library name ``source`` imports or reads that Python 3.10 lacks."""
    tree = ast.parse(source)
    aliases: dict[str, str] = {}  # local name -> standard-library module
    missing: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if _stdlib(a.name):
                    aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
                    if a.name not in KNOWN and a.name.split(".")[0] not in KNOWN:
                        missing.append(a.name)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and _stdlib(node.module):
            names = KNOWN.get(node.module)
            for a in node.names:
                if names is None or (a.name not in names and f"{node.module}.{a.name}" not in KNOWN):
                    missing.append(f"{node.module}.{a.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            module = aliases[node.value.id]
            if module in KNOWN and node.attr not in KNOWN[module]:
                missing.append(f"{module}.{node.attr}")
    return missing


def test_the_snapshot_is_of_python_3_10_and_knows_every_module_gradwatch_imports() -> None:
    assert SNAPSHOT["python"].startswith("3.10.")
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and _stdlib(node.module):
                assert node.module in KNOWN, f"{path}: run `python3.10 tools/stdlib_names.py` again ({node.module})"


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_standard_library_name_newer_than_python_3_10(path: pathlib.Path) -> None:
    assert newer_names(path.read_text()) == []


def test_the_check_finds_names_python_3_10_lacks() -> None:
    code = (
        "import operator\nimport itertools as it\nfrom typing import Self\nfrom math import cbrt\n"
        "x = operator.call(f)\ny = it.batched([], 2)\nz = getattr(operator, 'call', None)\nw = operator.add\n"
    )
    assert newer_names(code) == ["typing.Self", "math.cbrt", "operator.call", "itertools.batched"]
