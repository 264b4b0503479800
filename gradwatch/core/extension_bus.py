"""The extension bus: how the engine calls its extensions, and how they find each other.

Extensions (zero-grad tracking, escalation, AMP, distributed agreement) define any of the optional methods
of :class:`Extension`; the bus calls those that exist, in the order the extensions were added. A failing
extension is reported once and the step goes on without it; a :class:`GradWatchError` goes through.
"""

from __future__ import annotations

from typing import Any, Protocol, TypeVar

from gradwatch.core.failures import Fanout, internal_warning
from gradwatch.core.findings import Finding, GradWatchError
from gradwatch.core.stats import StepStats

_E = TypeVar("_E")


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
    - ``before_close()``: the watcher is closing, the engine still checks (a step owed to the other ranks).
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
        # Per method name, the extensions that define it, resolved once (three calls a step), again when
        # ``items`` changes length (``add``, a failed attach, or the engine's ``extensions`` edited in place).
        self._fanout = Fanout(self.items, owner=owner, passes=(GradWatchError,))
        #: ``call(method, *args)``: ``method(*args)`` on every extension that defines it (the fan-out's own method:
        #: no frame of the bus's in between, three calls a step).
        self.call = self._fanout.call
        self._found: dict[type, Any] = {}  # find()'s answers, by class
        self._found_for = 0

    def add(self, ext: Any) -> Any:
        """Attach ``ext``; one that cannot attach is reported, closed and left out."""
        self.items.append(ext)
        attach = getattr(ext, "attach", None)
        if attach is None:
            return ext
        try:
            attach(self.owner)
        except GradWatchError:
            raise
        except Exception as exc:  # noqa: BLE001 - an extension that cannot attach is left out
            self.items.remove(ext)
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
        if self._found_for != len(self.items):
            self._found, self._found_for = {}, len(self.items)
        try:
            return self._found[cls]
        except KeyError:
            found = self._found[cls] = next((e for e in self.items if isinstance(e, cls)), None)
            return found

    def methods(self, method: str) -> list[tuple[Any, Any]]:
        """``(extension, bound method)`` of every extension that defines ``method``, in the order added."""
        return self._fanout.methods(method)

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
