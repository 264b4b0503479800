"""Run one check over constructed statistics the way the engine does: ``check``, then ``remember``, then the
history records the step. Shared by the tests of the pure checks in this folder."""

from __future__ import annotations

from collections.abc import Iterable
from types import ModuleType

from gradwatch.core.config import Config
from gradwatch.core.findings import Finding
from gradwatch.core.history import History
from gradwatch.core.stats import StepStats


def run(
    module: ModuleType, steps: Iterable[StepStats], config: Config | None = None, history: History | None = None
) -> list[Finding]:
    """Every finding ``module.check`` makes over ``steps``, in order."""
    config = config or Config()
    history = history if history is not None else History(window=config.window)
    found: list[Finding] = []
    remember = getattr(module, "remember", None)
    for stats in steps:
        found += module.check(stats, history, config)
        if remember is not None:
            remember(stats, history)
        history.record(stats, skipped=stats.is_nonfinite)
    return found


def kinds(findings: Iterable[Finding]) -> list[str]:
    return [f.kind for f in findings]
