"""Print, as JSON, the names each standard-library module that gradwatch or its examples import defines.

Run it with the oldest Python gradwatch supports; ``tests/test_oldest_python.py`` checks gradwatch's code against
what it prints:

    python3.10 tools/stdlib_names.py > tests/python310_stdlib.json
"""

from __future__ import annotations

import ast
import importlib
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCES = ("gradwatch", "examples")


def imported_stdlib_modules() -> list[str]:
    found: set[str] = set()
    for folder in SOURCES:
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    found.update(a.name for a in node.names)
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    found.add(node.module)
    return sorted(m for m in found if m.split(".")[0] in sys.stdlib_module_names and m != "__future__")


def main() -> None:
    modules = imported_stdlib_modules()
    for name in modules:
        importlib.import_module(name)  # submodules first, so that ``importlib.util`` is an attribute of importlib
    names = {name: sorted(dir(sys.modules[name])) for name in modules}
    out = {"python": ".".join(map(str, sys.version_info[:3])), "modules": names}
    json.dump(out, sys.stdout, indent=0, sort_keys=True)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
