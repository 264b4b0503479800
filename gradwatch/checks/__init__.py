"""Check: pure functions that turn a step's statistics into findings.

Every module in this package defines ``check(stats, history, config) -> list[Finding]``; they are found
and run in name order. Adding a check is adding one module (and one test file): nothing else changes.
A check must not mutate ``stats`` or ``history`` (the engine records history after all checks ran), with
one exception: it may leave a note for its own ``remember`` in ``stats.extra`` under a key of its own
(what it reported, so ``remember``, which gets no config, need not decide again).
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from typing import Protocol

from gradwatch.core.config import Config
from gradwatch.core.findings import Finding
from gradwatch.core.history import History
from gradwatch.core.stats import StepStats


class Check(Protocol):
    def __call__(self, stats: StepStats, history: History, config: Config) -> list[Finding]: ...


CheckFn = Callable[[StepStats, History, Config], list[Finding]]
RememberFn = Callable[[StepStats, History], None]


def discover() -> list[tuple[str, CheckFn, RememberFn | None]]:
    """All checks in this package, in module-name order: ``(name, check, remember)``.

    ``remember(stats, history)``, when a module defines it, runs after every check of the step has run,
    so a check can note what it reported (e.g. to report a persisting condition once).
    """
    found: list[tuple[str, CheckFn, RememberFn | None]] = []
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        fn = getattr(module, "check", None)
        if callable(fn):
            found.append((info.name, fn, getattr(module, "remember", None)))
    return found
