"""The table of finding kinds: every kind the code can emit is a row, every row is emitted and documented."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from gradwatch.core.kinds import BY_NAME, KINDS

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "gradwatch"


def _module_constants(tree: ast.Module) -> dict[str, str]:
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            out.update({t.id: node.value.value for t in node.targets if isinstance(t, ast.Name)})
    return out


def _strings(node: ast.AST, constants: dict[str, str]) -> set[str]:
    """The string values an expression can take: literals, branches of ``a if c else b``, module constants."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, ast.IfExp):
        return _strings(node.body, constants) | _strings(node.orelse, constants)
    if isinstance(node, ast.Name) and node.id in constants:
        return {constants[node.id]}
    return set()


def emitted_kinds() -> set[str]:
    """Every ``kind=`` a ``Finding`` is built with in gradwatch/, and the kinds handed to finding builders."""
    found: set[str] = set()
    for path in SOURCE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        constants = _module_constants(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.keyword) and node.arg == "kind":
                found |= _strings(node.value, constants)
            elif isinstance(node, ast.Call) and getattr(node.func, "id", "").endswith("_finding") and node.args:
                found |= {s for s in _strings(node.args[0], constants) if re.fullmatch(r"[a-z]+(_[a-z]+)+", s)}
    return found


def documented_kinds() -> set[str]:
    text = (ROOT / "docs" / "findings.md").read_text().split("## Every kind\n", 1)[1]
    table = next(chunk for chunk in text.split("\n\n") if chunk.strip().startswith("|"))
    cells = "\n".join(row.split(" | ")[0] for row in table.strip().split("\n")[2:])
    cells = cells.replace("`update_ratio_high`/`_low`", "`update_ratio_high`, `update_ratio_low`")
    return set(re.findall(r"`([a-z]+(?:_[a-z]+)+)`", cells))


def test_every_kind_the_code_emits_is_in_the_table() -> None:
    emitted = emitted_kinds()
    assert len(emitted) > 25  # the scan itself works
    assert emitted - set(BY_NAME) == set()


def test_every_kind_in_the_table_is_written_somewhere_in_the_code() -> None:
    code = "\n".join(p.read_text() for p in SOURCE.rglob("*.py") if p.name != "kinds.py")
    assert [k.name for k in KINDS if f'"{k.name}' not in code] == []


def test_the_findings_page_documents_exactly_the_table() -> None:
    assert documented_kinds() == set(BY_NAME)


def test_each_row_has_a_known_severity_and_a_one_line_summary() -> None:
    assert len(BY_NAME) == len(KINDS)
    for k in KINDS:
        assert k.severity in ("info", "warning", "error"), k
        assert k.summary and "\n" not in k.summary and len(k.summary) <= 100, k
