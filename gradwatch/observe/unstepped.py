"""Observe, when the run ends: optimizers whose gradients backward passes filled, and that never stepped.

No per-step cost: the backward passes are those the zero-grad observer counts on each optimizer's
representative parameter (:mod:`gradwatch.observe.zero_grad`; its count restarts at each of that optimizer's
checks only, so with no step it holds every pass of the run), the steps are the engine's count for this run
(``Engine.run_step_counts``: a resumed run starts from 0 again). Nothing is said when an exception ended the
run (it stopped before it could step), when another optimizer took the gradients (``unwatched_optimizer``
and ``optimizer_recreated`` say so already), or when a GradScaler dropped the updates (``amp_overflow``).
The words are :mod:`gradwatch.checks.no_optimizer_step`'s.

While the run goes on (plain loops): until the first step of a watched optimizer, one parameter's
post-accumulate-grad hook (one Python call per backward) counts the backward passes whose gradient was
cleared before the next one (a new tensor after ``zero_grad()``, or one written in place since); gradient
accumulation adds into the same tensor and is not counted. After :data:`DURING_RUN` such passes with no step
at all the finding comes at once, so a run stopped by hand (its loss not going down) has it too. Loops that
compute gradients they do not apply for a while before training (adversarial attack steps, a Fisher
estimate) stay below that; once a step starts, the hook goes.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.nn.parameter import is_lazy

from gradwatch.core.failures import internal_warning
from gradwatch.observe.zero_grad import ZeroGradTracker

#: Cleared backward passes with no optimizer step at all after which a plain loop is told while it runs.
DURING_RUN = 64

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
        self.cleared = 0  # backward passes whose gradient was cleared before the next, with no step yet
        self.reported = False
        self._handles: list[Any] = []
        self._last: weakref.ref[torch.Tensor] | None = None  # the watched gradient after the latest pass
        self._version = 0  # and its version then

    def attach(self, engine: Any) -> None:
        self.engine = engine
        if self.integration != "plain":
            return
        ops = [op for op in engine.index.per_optimizer if op.optimizer is not None]
        watched = next((p for op in ops for p in op.params if p.requires_grad and p.is_leaf and not is_lazy(p)), None)
        if watched is None or not hasattr(watched, "register_post_accumulate_grad_hook"):
            return
        self._handles.append(watched.register_post_accumulate_grad_hook(self._on_grad))
        self._handles.extend(op.optimizer.register_step_pre_hook(self._on_step) for op in ops)

    def _on_step(self, *_: Any) -> None:
        self._remove()  # a step started: the checks see every update from now on

    def _on_grad(self, param: torch.Tensor) -> None:
        if self.reported:
            return  # (the hooks go at the next step or at close, not while backward runs them)
        try:
            g = param.grad
            if g is None:
                return
            # The previous pass's gradient is gone (set to None), another tensor, or written since: cleared
            # before this pass. Accumulation adds this pass into it: one version step.
            if self._last is not None and (g is not self._last() or g._version != self._version + 1):
                self.cleared += 1
            self._last, self._version = weakref.ref(g), g._version
            if self.cleared >= DURING_RUN:
                self._report_now()
        except Exception as exc:  # noqa: BLE001 - never break the user's backward
            internal_warning("UnsteppedOptimizers (backward hook)", exc, owner=self.engine)

    def _report_now(self) -> None:
        """No watched optimizer has stepped after DURING_RUN cleared passes: said now, for the optimizer
        whose parameter is watched (the first), unless the cause is known already."""
        from gradwatch.checks.no_optimizer_step import never_stepped
        from gradwatch.observe.amp import scaler_of_training_thread

        self.reported = True
        engine = self.engine
        if any(engine.kind_counts[k] for k in _EXPLAINED_BY) or scaler_of_training_thread() is not None:
            return  # another optimizer takes the gradients, or a GradScaler drops every update
        i = next(op.index for op in engine.index.per_optimizer if op.optimizer is not None)
        op = engine.index.per_optimizer[i]
        for f in never_stepped(engine.step_counts[i], i, self.cleared + 1, tuple(op.names), "plain", so_far=True):
            engine.add_finding(f)

    def _remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def close(self) -> None:
        self._remove()
        engine = self.engine
        tracker = engine.extension(ZeroGradTracker)
        if engine.interrupted or tracker is None or any(engine.kind_counts[k] for k in _EXPLAINED_BY):
            return
        from gradwatch.checks.no_optimizer_step import never_stepped

        told = {f.data.get("optimizer") for f in engine.findings if f.kind == "no_optimizer_step"}  # while it ran
        passes = {t.index: t.accumulations for t in tracker.trackers if t.index < len(engine.run_step_counts)}
        for i, n in unstepped(engine.run_step_counts, {i: n for i, n in passes.items() if i not in told}):
            op = engine.index.per_optimizer[i]
            for f in never_stepped(engine.step_counts[i], i, n, tuple(op.names), self._integration()):
                engine.add_finding(f)

    def _integration(self) -> str:
        """Where the fix is: a plain loop, Lightning manual optimization, or Lightning automatic optimization."""
        if self.integration == "lightning" and getattr(self.engine.model, "automatic_optimization", True):
            return "lightning_automatic"
        return self.integration
