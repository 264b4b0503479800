"""The shape of gradwatch/ read with ``ast``: sizes, imports between its modules, parameter annotations.

Usage: ``python tools/shape_metrics.py [PACKAGE_DIR]`` (default: the ``gradwatch/`` next to this folder) prints
the numbers of the closing note of a redesign: modules, lines, the largest module, class and function, mean
cyclomatic complexity and E/F functions (when ``radon`` is importable), the share of parameters annotated
``Any``, private names imported across modules, import cycles. ``tests/test_architecture.py`` uses the same
functions for its rules.
"""

from __future__ import annotations

import ast
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "gradwatch")


@dataclass
class Module:
    name: str  # dotted: gradwatch.core.engine
    path: str
    tree: ast.Module
    lines: int
    #: (target module, names imported from it, line, at module level) for each import of a package module
    imports: list[tuple[str, tuple[str, ...], int, bool]] = field(default_factory=list)


def module_name(path: str, package_dir: str) -> str:
    rel = os.path.relpath(path, os.path.dirname(package_dir))[: -len(".py")].split(os.sep)
    return ".".join(rel[:-1] if rel[-1] == "__init__" else rel)


def read_package(package_dir: str = PACKAGE) -> dict[str, Module]:
    """Every module of the package, parsed, with its imports of other modules of the package."""
    mods: dict[str, Module] = {}
    for folder, _, files in os.walk(package_dir):
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                with open(path, encoding="utf-8") as fh:
                    text = fh.read()
                name = module_name(path, package_dir)
                mods[name] = Module(name, path, ast.parse(text, path), len(text.splitlines()))
    for m in mods.values():
        m.imports = list(_imports(m, mods))
    return mods


def _imports(m: Module, mods: dict[str, Module]) -> Iterator[tuple[str, tuple[str, ...], int, bool]]:
    top = m.name.split(".")[0]
    for node, at_top in _walk_imports(m.tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == top and a.name in mods:
                    yield a.name, (), node.lineno, at_top
            continue
        base = _absolute(m, node)
        if base.split(".")[0] != top:
            continue
        plain = tuple(a.name for a in node.names if f"{base}.{a.name}" not in mods)
        if plain and base in mods:
            yield base, plain, node.lineno, at_top
        for a in node.names:
            if f"{base}.{a.name}" in mods:  # a submodule: ``from gradwatch.core import findings``
                yield f"{base}.{a.name}", (), node.lineno, at_top


def _absolute(m: Module, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    parts = m.name.split(".")
    is_package = m.path.endswith("__init__.py")
    base = parts[: len(parts) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def _walk_imports(tree: ast.AST, at_top: bool = True) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Imports with whether they run at import time (module or class body; not ``if TYPE_CHECKING:``)."""
    for child in ast.iter_child_nodes(tree):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child, at_top
        elif isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
            continue
        else:
            inner = at_top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            yield from _walk_imports(child, inner)


# -- imports between modules -----------------------------------------------------------------------------
def import_graph(mods: dict[str, Module], *, module_level_only: bool) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {name: set() for name in mods}
    for m in mods.values():
        for target, _, _, at_top in m.imports:
            if target != m.name and (at_top or not module_level_only):
                graph[m.name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[tuple[str, ...]]:
    """The strongly connected groups of more than one module (Tarjan), each sorted, sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[tuple[str, ...]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(tuple(sorted(group)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def mutual_imports(mods: dict[str, Module]) -> list[tuple[str, str]]:
    """Pairs of modules that import each other, at least one of them inside a function."""
    full = import_graph(mods, module_level_only=False)
    top = import_graph(mods, module_level_only=True)
    pairs = {tuple(sorted((a, b))) for a, bs in full.items() for b in bs if a in full.get(b, ())}
    return sorted((a, b) for a, b in pairs if not (b in top[a] and a in top[b]))


def function_level_imports(mods: dict[str, Module]) -> list[tuple[str, str, int]]:
    """(module, imported module, line) of each import of a package module inside a function."""
    return sorted((m.name, t, line) for m in mods.values() for t, _, line, at_top in m.imports if not at_top)


def private_imports(mods: dict[str, Module]) -> list[tuple[str, str]]:
    """(importing module, ``module.name``) for each ``_name`` of one package module used by another one:
    imported by name, or read as an attribute of an imported module."""
    out = set()
    for m in mods.values():
        aliases: dict[str, str] = {}
        for target, names, _, _ in m.imports:
            out |= {(m.name, f"{target}.{n}") for n in names if _private(n)}
        for node, _ in _walk_imports(m.tree):
            for a in node.names:
                dotted = a.name if isinstance(node, ast.Import) else f"{_absolute(m, node)}.{a.name}"
                if dotted in mods and (a.asname or isinstance(node, ast.ImportFrom)):
                    aliases[a.asname or a.name] = dotted
        for node in ast.walk(m.tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and _private(node.attr):
                target = aliases.get(node.value.id)
                if target and target != m.name:
                    out.add((m.name, f"{target}.{node.attr}"))
    return sorted(out)


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


# -- extensions finding each other ---------------------------------------------------------------------------
def extension_sniffing(mods: dict[str, Module]) -> list[tuple[str, str]]:
    """(module, attribute) of each ``hasattr(e, "attribute")`` where ``e`` runs over ``<...>.extensions``."""
    out = set()
    for m in mods.values():
        for node in ast.walk(m.tree):
            for var in _extension_variables(node):
                for call in ast.walk(node):
                    attr = _hasattr_on(call, var)
                    if attr is not None:
                        out.add((m.name, attr))
    return sorted(out)


def _extension_variables(node: ast.AST) -> list[str]:
    if isinstance(node, (ast.For, ast.comprehension)):
        loops = [(node.target, node.iter)]
    elif isinstance(node, (ast.GeneratorExp, ast.ListComp, ast.SetComp)):
        loops = [(g.target, g.iter) for g in node.generators]
    else:
        return []
    return [
        t.id
        for t, it in loops
        if isinstance(t, ast.Name) and isinstance(it, ast.Attribute) and it.attr == "extensions"
    ]


def _hasattr_on(node: ast.AST, var: str) -> str | None:
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "hasattr"):
        return None
    obj, attr = (node.args + [None, None])[:2]
    if isinstance(obj, ast.Name) and obj.id == var and isinstance(attr, ast.Constant):
        return str(attr.value)
    return None


# -- sizes and annotations -------------------------------------------------------------------------------
def functions(mods: dict[str, Module]) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """(``module:Qualified.name``, node) of every function and method, nested ones too."""
    for m in mods.values():
        yield from _functions(m.tree, m.name + ":")


def _functions(node: ast.AST, prefix: str) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + child.name, child
            yield from _functions(child, prefix + child.name + ".")
        elif isinstance(child, ast.ClassDef):
            yield from _functions(child, prefix + child.name + ".")
        else:
            yield from _functions(child, prefix)


def span(node: ast.AST) -> int:
    return int(node.end_lineno or node.lineno) - node.lineno + 1  # type: ignore[attr-defined]


def classes(mods: dict[str, Module]) -> Iterator[tuple[str, ast.ClassDef]]:
    for m in mods.values():
        for node in ast.walk(m.tree):
            if isinstance(node, ast.ClassDef):
                yield f"{m.name}:{node.name}", node


def parameter_annotations(mods: dict[str, Module]) -> tuple[int, int, int]:
    """(parameters, annotated, annotated exactly ``Any``); ``self``/``cls`` of methods are left out."""
    total = annotated = any_ = 0
    for _, fn in functions(mods):
        a = fn.args
        params = a.posonlyargs + a.args + a.kwonlyargs + [p for p in (a.vararg, a.kwarg) if p]
        for p in params:
            if p.arg in ("self", "cls") and p.annotation is None:
                continue
            total += 1
            if p.annotation is not None:
                annotated += 1
                any_ += ast.unparse(p.annotation).strip("'\"") in ("Any", "typing.Any")
    return total, annotated, any_


def complexity(mods: dict[str, Module]) -> tuple[float, list[tuple[str, int]]] | None:
    """Mean cyclomatic complexity over radon's blocks (functions, methods, classes: as ``radon cc -a``) and
    the functions and methods over 30 (grades E/F), if radon is importable."""
    try:
        from radon.complexity import cc_visit
    except ImportError:
        return None
    blocks = []
    for m in mods.values():
        with open(m.path, encoding="utf-8") as fh:
            blocks += [(m.name, b) for b in cc_visit(fh.read())]
    mean = sum(b.complexity for _, b in blocks) / max(1, len(blocks))
    worst = [(f"{name}:{_block_name(b)}", b.complexity) for name, b in blocks if type(b).__name__ == "Function"]
    return mean, sorted((n, c) for n, c in worst if c > 30)


def _block_name(block: object) -> str:
    owner = getattr(block, "classname", None)
    return f"{owner}.{block.name}" if owner else str(block.name)  # type: ignore[attr-defined]


# -- the report ------------------------------------------------------------------------------------------
def report(package_dir: str = PACKAGE) -> list[str]:
    mods = read_package(package_dir)
    fns = sorted(((span(n), q) for q, n in functions(mods)), reverse=True)
    cls = sorted(((span(n), q) for q, n in classes(mods)), reverse=True)
    biggest = max(mods.values(), key=lambda m: m.lines)
    total, annotated, any_ = parameter_annotations(mods)
    lines = [
        f"modules: {len(mods)}",
        f"lines: {sum(m.lines for m in mods.values())}",
        f"largest module: {biggest.name} ({biggest.lines} lines)",
        f"largest class: {cls[0][1]} ({cls[0][0]} lines)" if cls else "largest class: -",
        f"largest function: {fns[0][1]} ({fns[0][0]} lines)",
        f"modules over 900 lines: {sum(m.lines > 900 for m in mods.values())}",
        f"functions over 120 lines: {sum(n > 120 for n, _ in fns)}; over 50: {sum(n > 50 for n, _ in fns)}",
    ]
    cc = complexity(mods)
    if cc is None:
        lines.append("complexity: radon is not importable")
    else:
        lines.append(f"mean cyclomatic complexity (radon cc -a): {cc[0]:.2f}; E/F functions (CC > 30): {len(cc[1])}")
        lines += [f"  {name} CC {c}" for name, c in cc[1]]
    lines.append(
        f"parameters: {total}, annotated {annotated}, annotated Any {any_} "
        f"({100 * any_ / max(1, total):.1f}% of all, {100 * any_ / max(1, annotated):.1f}% of annotated)"
    )
    private = private_imports(mods)
    lines.append(f"private names imported across modules: {len(private)}")
    lines += [f"  {m} <- {name}" for m, name in private]
    top = cycles(import_graph(mods, module_level_only=True))
    lines.append(f"module-level import cycles: {len(top)}")
    lines += ["  " + " <-> ".join(c) for c in top]
    mutual = mutual_imports(mods)
    lines.append(f"modules importing each other (one side inside a function): {len(mutual)}")
    lines += [f"  {a} <-> {b}" for a, b in mutual]
    lines.append(f"imports inside functions: {len(function_level_imports(mods))}")
    full = cycles(import_graph(mods, module_level_only=False))
    lines.append(f"import cycles counting imports inside functions: {len(full)} (modules: {sum(map(len, full))})")
    sniff = extension_sniffing(mods)
    lines.append(f"extensions found by hasattr: {len(sniff)}")
    lines += [f"  {m}: hasattr(e, {a!r})" for m, a in sniff]
    return lines


if __name__ == "__main__":
    print("\n".join(report(sys.argv[1] if len(sys.argv) > 1 else PACKAGE)))
