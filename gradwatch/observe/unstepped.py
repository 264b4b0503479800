"""Observe, when the run ends: optimizers whose gradients backward passes filled, and that never stepped.

No per-step cost: the backward passes are those the zero-grad observer counts on each optimizer's
representative parameter (:mod:`gradwatch.observe.zero_grad`; its count restarts at each of that optimizer's
checks only, so with no step it holds every pass of the run), the steps are the engine's count for this run
(``Engine.run_step_counts``: a resumed run starts from 0 again). Nothing is said when an exception ended the
run (it stopped before it could step), when another optimizer took the gradients (``unwatched_optimizer``
and ``optimizer_recreated`` say so already), or when a GradScaler dropped the updates (``amp_overflow``).
The words are :mod:`gradwatch.checks.no_optimizer_step`'s.
"""

from __future__ import annotations

from typing import Any

from gradwatch.observe.zero_grad import ZeroGradTracker

#: Findings that already explain a watched optimizer that does not step (``amp_overflow``: a GradScaler
#: dropped the updates, which ``scaler.step()`` then never hands to the optimizer).
_EXPLAINED_BY = ("unwatched_optimizer", "optimizer_recreated", "amp_overflow")


def unstepped(run_step_counts: list[int], passes: dict[int, int]) -> list[tuple[int, int]]:
    """``(optimizer, backward passes)`` of each optimizer that took no step while passes reached it."""
    return [(i, n) for i, n in sorted(passes.items()) if n > 0 and run_step_counts[i] == 0]


class UnsteppedOptimizers:
    """Engine extension: see the module docstring."""

    def __init__(self, integration: str = "plain") -> None:
        self.engine: Any = None
        self.integration = integration

    def attach(self, engine: Any) -> None:
        self.engine = engine

    def close(self) -> None:
        engine = self.engine
        tracker = engine.extension(ZeroGradTracker)
        if engine.interrupted or tracker is None or any(engine.kind_counts[k] for k in _EXPLAINED_BY):
            return
        from gradwatch.checks.no_optimizer_step import never_stepped

        passes = {t.index: t.accumulations for t in tracker.trackers if t.index < len(engine.run_step_counts)}
        for i, n in unstepped(engine.run_step_counts, passes):
            op = engine.index.per_optimizer[i]
            for f in never_stepped(engine.step_counts[i], i, n, tuple(op.names), self._integration()):
                engine.add_finding(f)

    def _integration(self) -> str:
        """Where the fix is: a plain loop, Lightning manual optimization, or Lightning automatic optimization."""
        if self.integration == "lightning" and getattr(self.engine.model, "automatic_optimization", True):
            return "lightning_automatic"
        return self.integration
