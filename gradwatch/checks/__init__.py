"""Check: pure functions that turn a step's statistics into findings.

Every module in this package defines ``check(stats, history, config) -> list[Finding]``; they are found
and run in name order. Adding a check is adding one module (and one test file): nothing else changes.
A check must not mutate ``stats`` or ``history`` (the engine records history after all checks ran), with
one exception: it may leave a note for its own ``remember`` in ``stats.extra`` under a key of its own
(what it reported, so ``remember``, which gets no config, need not decide again).

A module whose findings are worded by whether the update is clipped may define ``CLIPPED_AFTER_CHECK``: kind ->
``(finding, stats, history) -> finding`` worded again when Lightning clipped after the check (see
:mod:`gradwatch.core.held`).

A module may also name, in ``WHEN``, the step facts of :data:`FACTS` without which neither its check nor its
``remember`` has anything to do (a check of the update ratio, on a step where it was not measured): the
engine then runs it only on steps where one of them holds. A module without ``WHEN`` runs on every step.
"""

from __future__ import annotations

import importlib
import itertools
import pkgutil
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple, Protocol

from gradwatch.core.compat import call
from gradwatch.core.config import Config
from gradwatch.core.findings import Finding
from gradwatch.core.history import History
from gradwatch.core.stats import StepStats


class Check(Protocol):
    def __call__(self, stats: StepStats, history: History, config: Config) -> list[Finding]: ...


CheckFn = Callable[[StepStats, History, Config], list[Finding]]
RememberFn = Callable[[StepStats, History], None]


#: The step facts a check module's ``WHEN`` can name: ``(name, holds(stats))``, each a few attribute reads,
#: computed once per checked step.
FACTS: tuple[tuple[str, Callable[[StepStats], bool]], ...] = (
    ("loss", lambda s: s.loss is not None),
    ("nonfinite", lambda s: bool(s.loss_nonfinite or s.nonfinite or s.extra.get("stale_losses"))),
    ("zero_total", lambda s: bool(s.names) and s.total_norm == 0.0),
    ("params_changed", lambda s: bool(s.first_check or s.params_changed or s.extra.get("unregistered"))),
    ("amp", lambda s: isinstance(s.extra.get("amp"), dict)),
    ("update_measured", lambda s: "update_ratio_total" in s.extra or "update_ratio" in s.extra),
    ("update_nonfinite", lambda s: bool(s.extra.get("update_nonfinite"))),
    ("scaler_bypassed", lambda s: "scaler_bypassed" in s.extra),
)
_FACT_INDEX = {name: i for i, (name, _) in enumerate(FACTS)}
_HOLDS = tuple(holds for _, holds in FACTS)


class CheckModule(NamedTuple):
    """One check module: its name, ``check``, ``remember`` (or None) and ``WHEN`` (empty: every step)."""

    name: str
    check: CheckFn
    remember: RememberFn | None = None
    when: tuple[str, ...] = ()
    #: ``CLIPPED_AFTER_CHECK``: per kind it reports, how to word a finding again once the step's gradients are
    #: known to have been clipped after the check (see :mod:`gradwatch.core.held`); None: no such kind.
    clipped_after_check: dict[str, Any] | None = None


class Plan(NamedTuple):
    """The checks a step runs, in order, and the ``remember`` of those that have one (names aligned)."""

    check_names: list[str]
    checks: list[CheckFn]
    remember_names: list[str]
    remembers: list[RememberFn]


class CheckTable:
    """The checks of an engine, in order, and which of them a step runs (see ``WHEN``).

    The checks to run depend only on which facts hold, so they are worked out once per combination of facts:
    a healthy step pays for the facts (a few attribute reads) and for the checks that can find something.
    """

    def __init__(self, modules: Iterable[Any]) -> None:
        self.modules: list[CheckModule] = []
        self._plans: dict[tuple[bool, ...], Plan] = {}
        for m in modules:
            self.append(m)

    def append(self, module: Any) -> None:
        """Add a check: a :class:`CheckModule` or a ``(name, check, remember)`` tuple (runs on every step)."""
        m = module if isinstance(module, CheckModule) else CheckModule(*module)
        unknown = [f for f in m.when if f not in _FACT_INDEX]
        if unknown:
            raise ValueError(f"check {m.name}: unknown step facts in WHEN: {unknown} (known: {sorted(_FACT_INDEX)})")
        self.modules.append(m)
        self._plans.clear()

    def __iter__(self) -> Any:
        return iter(self.modules)

    @property
    def rewords(self) -> dict[str, Any]:
        """Every module's ``CLIPPED_AFTER_CHECK``, merged: kind -> reword."""
        return {kind: fn for m in self.modules for kind, fn in (m.clipped_after_check or {}).items()}

    def __len__(self) -> int:
        return len(self.modules)

    def plan(self, stats: StepStats) -> Plan:
        """The checks to run on this step, and their ``remember``."""
        facts = tuple(map(call, _HOLDS, itertools.repeat(stats)))  # C loops
        plan = self._plans.get(facts)
        if plan is None:
            run = [m for m in self.modules if not m.when or any(facts[_FACT_INDEX[f]] for f in m.when)]
            keep = [m for m in run if m.remember is not None]
            plan = self._plans[facts] = Plan(
                [m.name for m in run], [m.check for m in run], [m.name for m in keep], [m.remember for m in keep]
            )
        return plan


def discover() -> CheckTable:
    """All checks in this package, in module-name order (see :class:`CheckModule`).

    ``remember(stats, history)``, when a module defines it, runs after every check of the step has run,
    so a check can note what it reported (e.g. to report a persisting condition once).
    """
    found: list[CheckModule] = []
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        fn = getattr(module, "check", None)
        if callable(fn):
            found.append(CheckModule(
                info.name, fn, getattr(module, "remember", None), tuple(getattr(module, "WHEN", ())),
                getattr(module, "CLIPPED_AFTER_CHECK", None),
            ))
    return CheckTable(found)
