"""The extension bus: how the engine calls its extensions, and how they find each other.

Extensions (zero-grad tracking, escalation, AMP, distributed agreement) define any of the optional methods
of :class:`Extension`; the bus calls those that exist, in the order the extensions were added. A failing
extension is reported once and the step goes on without it; a :class:`GradWatchError` goes through.
"""

from __future__ import annotations

import functools
from typing import Any, Protocol, TypeVar

from gradwatch.core.failures import call_each, internal_warning
from gradwatch.core.findings import Finding, GradWatchError
from gradwatch.core.stats import StepStats

_E = TypeVar("_E")
_PASSES = (GradWatchError,)  # an extension's GradWatchError stops the step, as the engine's own does


class Extension(Protocol):
    """Optional methods an extension may define; the engine calls those that exist.

    - ``attach(engine)``: once, when added.
    - ``before_sync(ctx)``: queue device values into ``ctx.batch`` (no sync allowed).
    - ``after_sync(ctx)``: read them back (``ctx.batch.resolve()``) and fill ``ctx.stats.extra``.
    - ``on_incident(stats, findings) -> list[Finding]``: the step is non-finite; localize it before the
      update (may replay the step) and return extra findings. A returned finding with ``data["restates"]``
      (a kind) takes the place of the step's finding of that kind: its cause restated in the light of the
      origin found (``nonfinite_loss`` deferring to ``nan_origin``).
    - ``after_step(stats, decision)``: the decision is taken.
    - ``close()``: detach everything.
    """


class ExtensionBus:
    """The extensions of one engine.

    Args:
        owner: The engine: what ``attach`` receives, and whose internal failures these are.
    """

    def __init__(self, owner: Any) -> None:
        self.owner = owner
        self.items: list[Any] = []
        # Per method name: ``(extension, bound method)`` of the extensions that define it, in order. Resolved
        # once, not with a ``getattr`` per extension per call (three calls a step): resolved again when
        # ``items`` changes length (``add``, a failed attach, or the engine's ``extensions`` edited in place).
        self._methods: dict[str, list[tuple[Any, Any]]] = {}
        # Per method name: the bound methods alone (what ``call`` calls), and what reports one that fails.
        self._fns: dict[str, tuple[list[Any], Any]] = {}
        self._found: dict[type, Any] = {}  # find()'s answers, by class
        self._resolved_for = 0

    def add(self, ext: Any) -> Any:
        """Attach ``ext``; one that cannot attach is reported, closed and left out."""
        self.items.append(ext)
        self._resolved_for = -1
        attach = getattr(ext, "attach", None)
        if attach is None:
            return ext
        try:
            attach(self.owner)
        except GradWatchError:
            raise
        except Exception as exc:  # noqa: BLE001 - an extension that cannot attach is left out
            self.items.remove(ext)
            self._resolved_for = -1
            internal_warning(f"{type(ext).__name__}.attach", exc, owner=self.owner, key=type(ext).__name__)
            close = getattr(ext, "close", None)
            if close is not None:
                try:
                    close()  # remove whatever it attached before failing
                except Exception:  # noqa: BLE001, S110
                    pass
        return ext

    def find(self, cls: type[_E]) -> _E | None:
        """The attached extension of type ``cls`` (or a subclass), or None."""
        if self._resolved_for != len(self.items):
            self._forget()
        try:
            return self._found[cls]
        except KeyError:
            found = self._found[cls] = next((e for e in self.items if isinstance(e, cls)), None)
            return found

    def _forget(self) -> None:
        """The extensions changed since they were resolved: resolve them again."""
        self._methods = {}
        self._fns = {}
        self._found = {}
        self._resolved_for = len(self.items)

    def methods(self, method: str) -> list[tuple[Any, Any]]:
        """``(extension, bound method)`` of every extension that defines ``method``, in the order added."""
        if self._resolved_for != len(self.items):
            self._forget()
        found = self._methods.get(method)
        if found is None:
            found = self._methods[method] = [
                (ext, fn) for ext in self.items if (fn := getattr(ext, method, None)) is not None
            ]
        return found

    def call(self, method: str, *args: Any) -> None:
        """``method(*args)`` on every extension that defines it."""
        if self._resolved_for != len(self.items):
            self._forget()
        found = self._fns.get(method)
        if found is None:
            fns = [fn for _ext, fn in self.methods(method)]
            found = self._fns[method] = (fns, functools.partial(self._failed, method))
        if found[0]:
            call_each(found[0], args, found[1], _PASSES)

    def _failed(self, method: str, i: int, exc: Exception) -> None:
        ext = self._methods[method][i][0]
        internal_warning(f"{type(ext).__name__}.{method}", exc, owner=self.owner, key=type(ext).__name__)

    def on_incident(self, stats: StepStats, findings: list[Finding]) -> list[Finding]:
        """Every extension's ``on_incident`` findings, each seeing those found before it."""
        extra: list[Finding] = []
        for ext, fn in self.methods("on_incident"):
            try:
                extra.extend(fn(stats, findings + extra) or [])
            except GradWatchError:
                raise
            except Exception as exc:  # noqa: BLE001
                internal_warning(f"{type(ext).__name__}.on_incident", exc, owner=self.owner, key=type(ext).__name__)
        return extra
