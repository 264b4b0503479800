"""Guard rails on the shape of gradwatch/, read with ``ast`` (see docs/architecture.md).

Each rule lists what breaks it today in ``KNOWN``, with the reason it is still there. A new break fails the
test; so does an entry of ``KNOWN`` that no longer occurs (delete it): the list only shrinks.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable
from typing import Any

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_MODULE_LINES = 900
MAX_FUNCTION_LINES = 120


def _load_metrics() -> Any:
    path = os.path.join(ROOT, "tools", "shape_metrics.py")
    spec = importlib.util.spec_from_file_location("gradwatch_shape_metrics", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


shape = _load_metrics()

#: Today's breaks, each with why it is still there. Remove an entry when its break is gone.
KNOWN: dict[str, str] = {}


# -- what breaks each rule -------------------------------------------------------------------------------
def module_cycles(mods: dict[str, Any]) -> set[str]:
    graph = shape.import_graph(mods, module_level_only=True)
    return {"cycle: " + " <-> ".join(group) for group in shape.cycles(graph)}


def function_level_cycles(mods: dict[str, Any]) -> set[str]:
    return {f"mutual import: {a} <-> {b}" for a, b in shape.mutual_imports(mods)}


def private_imports(mods: dict[str, Any]) -> set[str]:
    return {f"private: {importer} <- {name}" for importer, name in shape.private_imports(mods)}


def extension_sniffing(mods: dict[str, Any]) -> set[str]:
    return {f"hasattr: {m}: hasattr(e, {attr!r})" for m, attr in shape.extension_sniffing(mods)}


def long_modules(mods: dict[str, Any]) -> set[str]:
    return {f"module lines: {m.name}" for m in mods.values() if m.lines > MAX_MODULE_LINES}


def long_functions(mods: dict[str, Any]) -> set[str]:
    return {f"function lines: {q}" for q, node in shape.functions(mods) if shape.span(node) > MAX_FUNCTION_LINES}


def report_imports_from_observe_and_checks(mods: dict[str, Any]) -> set[str]:
    return {
        f"layering: {m.name} imports {target}"
        for m in mods.values()
        if m.name.split(".")[1:2] in (["observe"], ["checks"])
        for target, _, _, _ in m.imports
        if target.split(".")[1:2] == ["report"]
    }


RULES: dict[str, Callable[[dict[str, Any]], set[str]]] = {
    "module-level import cycle": module_cycles,
    "two modules importing each other (one inside a function)": function_level_cycles,
    "private name imported from another gradwatch module": private_imports,
    "hasattr on an extension to find another extension": extension_sniffing,
    f"module over {MAX_MODULE_LINES} lines": long_modules,
    f"function over {MAX_FUNCTION_LINES} lines": long_functions,
    "observe/ or checks/ importing report/": report_imports_from_observe_and_checks,
}


@pytest.fixture(scope="module")
def mods() -> dict[str, Any]:
    return shape.read_package(os.path.join(ROOT, "gradwatch"))


@pytest.mark.parametrize("rule", list(RULES))
def test_no_new_break_of(rule: str, mods: dict[str, Any]) -> None:
    new = sorted(RULES[rule](mods) - set(KNOWN))
    assert not new, f"{rule}: fix these (or, with a reason, add them to KNOWN):\n" + "\n".join(new)


def test_every_known_break_still_occurs(mods: dict[str, Any]) -> None:
    found = set().union(*(rule(mods) for rule in RULES.values()))
    gone = sorted(set(KNOWN) - found)
    assert not gone, "no longer broken: delete from KNOWN in tests/test_architecture.py:\n" + "\n".join(gone)


# -- the rules catch what they are meant to ----------------------------------------------------------------
def _package(tmp_path: Any, files: dict[str, str]) -> dict[str, Any]:
    for rel, text in {"pkg/__init__.py": "", **files}.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return shape.read_package(str(tmp_path / "pkg"))


def test_rules_catch_a_planted_break_of_each(tmp_path: Any) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    mods = _package(
        tmp_path,
        {
            "pkg/a.py": "from pkg.b import B\nfrom pkg.core import _secret\n",
            "pkg/b.py": "import pkg.a as a\nB = 1\n",
            "pkg/core.py": "_secret = 1\n" + "\n" * MAX_MODULE_LINES,
            "pkg/report/__init__.py": "",
            "pkg/report/one.py": "def f():\n    from pkg.report import two\n",
            "pkg/report/two.py": "from pkg.report import one\n",
            "pkg/observe/__init__.py": "",
            "pkg/observe/x.py": (
                "from pkg.report.one import f\n"
                "def find(engine):\n"
                "    return next(e for e in engine.extensions if hasattr(e, '_flag'))\n"
                f"def long():\n{body}\n"
            ),
        },
    )
    assert module_cycles(mods) == {"cycle: pkg.a <-> pkg.b"}
    assert function_level_cycles(mods) == {"mutual import: pkg.report.one <-> pkg.report.two"}
    assert private_imports(mods) == {"private: pkg.a <- pkg.core._secret"}
    assert extension_sniffing(mods) == {"hasattr: pkg.observe.x: hasattr(e, '_flag')"}
    assert long_modules(mods) == {"module lines: pkg.core"}
    assert long_functions(mods) == {"function lines: pkg.observe.x:long"}
    assert report_imports_from_observe_and_checks(mods) == {"layering: pkg.observe.x imports pkg.report.one"}


def test_imports_inside_functions_and_type_checking_blocks_are_no_module_cycle(tmp_path: Any) -> None:
    mods = _package(
        tmp_path,
        {
            "pkg/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import B\n",
            "pkg/b.py": "from pkg.a import *\nB = 1\n",
            "pkg/c.py": "def f():\n    from pkg.d import D\n",
            "pkg/d.py": "D = 1\n",
        },
    )
    assert module_cycles(mods) == set() and function_level_cycles(mods) == set()
    assert shape.function_level_imports(mods) == [("pkg.c", "pkg.d", 2)]
