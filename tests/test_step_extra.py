"""Every ``stats.extra`` key used in gradwatch is declared in ``StepExtra`` (core/stats.py).

The source is scanned with ``ast``: subscripts, ``.get``/``.setdefault``/``.pop`` and ``in`` tests on an
``.extra`` attribute (or a local name bound to one). A key is a string, a module constant, a local bound to
one (``key = _KEY.format(i)``) or a loop variable over string constants; keys made per optimizer index
(``template.format(i)``) must be listed in ``STEP_EXTRA_TEMPLATES``.
"""

from __future__ import annotations

import ast
import importlib
import pathlib
from typing import Any

from gradwatch.core.stats import STEP_EXTRA_TEMPLATES, StepExtra

ROOT = pathlib.Path(__file__).resolve().parent.parent / "gradwatch"
DECLARED = set(StepExtra.__annotations__)


class _Unresolved(Exception):
    pass


def _parents(tree: ast.AST) -> dict[ast.AST, ast.AST]:
    return {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}


def _function_of(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> ast.AST | None:
    while node in parents:
        node = parents[node]
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return node
    return None


def _local_values(name: str, scope: ast.AST | None) -> list[ast.expr] | None:
    """What a local ``name`` is bound to in ``scope``: assignments, or the constants a loop runs over."""
    if scope is None:
        return None
    found: list[ast.expr] = []
    for node in ast.walk(scope):
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            found.append(node.value)
        elif isinstance(node, ast.For) and isinstance(node.target, ast.Name) and node.target.id == name:
            if not isinstance(node.iter, (ast.Tuple, ast.List)):
                raise _Unresolved(ast.unparse(node.iter))
            found.extend(node.iter.elts)
    return found or None


def _keys(expr: ast.expr, module: Any, scope: ast.AST | None) -> list[tuple[str, bool]]:
    """``(key, is_template)`` pairs ``expr`` can stand for."""
    if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
        return [(expr.value, False)]
    if isinstance(expr, ast.Name):
        local = _local_values(expr.id, scope)
        if local is not None:
            return [k for value in local for k in _keys(value, module, scope)]
        value = getattr(module, expr.id, None)
        if isinstance(value, str):
            return [(value, "{}" in value)]
    if (
        isinstance(expr, ast.Call)
        and isinstance(expr.func, ast.Attribute)
        and expr.func.attr == "format"
    ):
        return [(key, True) for key, _template in _keys(expr.func.value, module, scope)]
    raise _Unresolved(ast.unparse(expr))


def extra_keys(source: str, module: Any) -> list[tuple[int, str, bool]]:
    """``(line, key, is_template)`` of every ``.extra`` key used in ``source``; raises on one it cannot read."""
    tree = ast.parse(source)
    parents = _parents(tree)
    aliases = {
        t.id
        for n in ast.walk(tree)
        if isinstance(n, ast.Assign) and isinstance(n.value, ast.Attribute) and n.value.attr == "extra"
        for t in n.targets
        if isinstance(t, ast.Name)
    }

    def is_extra(node: ast.AST) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == "extra") or (
            isinstance(node, ast.Name) and node.id in aliases
        )

    out: list[tuple[int, str, bool]] = []
    for n in ast.walk(tree):
        key: ast.expr | None = None
        if isinstance(n, ast.Subscript) and is_extra(n.value):
            key = n.slice
        elif (
            isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute)
            and n.func.attr in ("get", "setdefault", "pop")
            and is_extra(n.func.value)
            and n.args
        ):
            key = n.args[0]
        elif isinstance(n, ast.Compare) and isinstance(n.ops[0], (ast.In, ast.NotIn)) and is_extra(n.comparators[0]):
            key = n.left
        if key is not None:
            try:
                out.extend((n.lineno, k, t) for k, t in _keys(key, module, _function_of(n, parents)))
            except _Unresolved as exc:
                raise AssertionError(f"line {n.lineno}: cannot tell which stats.extra key {exc} is") from None
    return out


def _source_keys() -> list[tuple[str, str, bool]]:
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        if path.name == "__main__.py":
            continue  # runs the command line when imported; it uses no stats.extra
        rel = path.relative_to(ROOT.parent)
        module = importlib.import_module(".".join(rel.with_suffix("").parts).removesuffix(".__init__"))
        try:
            keys = extra_keys(path.read_text(), module)
        except AssertionError as exc:
            raise AssertionError(f"{rel}: {exc}") from None
        found.extend((f"{rel}:{line}", key, template) for line, key, template in keys)
    return found


def test_every_extra_key_used_in_gradwatch_is_declared_in_step_extra() -> None:
    keys = _source_keys()
    assert len(keys) > 100  # the scan finds the sites (about 150 today)
    undeclared = [f"{where}: {key!r}" for where, key, template in keys if not template and key not in DECLARED]
    untemplated = [
        f"{where}: {key!r}" for where, key, template in keys if template and key not in STEP_EXTRA_TEMPLATES
    ]
    assert not undeclared, "stats.extra keys missing from StepExtra (core/stats.py):\n" + "\n".join(undeclared)
    assert not untemplated, "per-optimizer keys missing from STEP_EXTRA_TEMPLATES:\n" + "\n".join(untemplated)


def test_every_key_step_extra_declares_is_used() -> None:
    used = {key for _where, key, _template in _source_keys()}
    assert not DECLARED - used, f"declared in StepExtra but used nowhere: {sorted(DECLARED - used)}"
    assert not set(STEP_EXTRA_TEMPLATES) - used


def test_the_scan_reports_an_undeclared_key_and_resolves_constants_locals_and_loops() -> None:
    source = (
        "_NOTE = 'loss_spike/record'\n"
        "_PER = 'weight_decay_too_large/{}'\n"
        "def check(stats, i):\n"
        "    extra = stats.extra\n"
        "    key = _PER.format(i)\n"
        "    stats.extra['not_a_declared_key'] = 1\n"
        "    extra[_NOTE] = 2.0\n"
        "    for kind in ('zero_grad_missing', 'ddp'):\n"
        "        stats.extra.get(kind)\n"
        "    return key in stats.extra\n"
    )
    module = type("M", (), {"_NOTE": "loss_spike/record", "_PER": "weight_decay_too_large/{}"})
    keys = extra_keys(source, module)
    assert sorted(keys) == [
        (6, "not_a_declared_key", False),
        (7, "loss_spike/record", False),
        (9, "ddp", False),
        (9, "zero_grad_missing", False),
        (10, "weight_decay_too_large/{}", True),
    ]
    assert [k for _line, k, t in keys if not t and k not in DECLARED] == ["not_a_declared_key"]


def test_a_key_the_scan_cannot_read_fails_it() -> None:
    try:
        extra_keys("def f(stats, name):\n    return stats.extra[name + '/x']\n", object())
    except AssertionError as exc:
        assert "name + '/x'" in str(exc)
    else:
        raise AssertionError("an unreadable key went through")
