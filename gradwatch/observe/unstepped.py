"""Observe (plain loops): backward passes whose gradients are thrown away before any optimizer step.

gradwatch checks each update inside the watched optimizer's ``step()``. A loop that never calls it (the
classic forgotten ``optimizer.step()``: ``zero_grad(); loss.backward()`` and nothing else, or a scheduler's
``step()`` in its place) trains nothing, and there is no step to check: the run looks quiet. Until the first
step of a watched optimizer, one parameter's post-accumulate-grad hook (one Python call per backward) counts
the backward passes whose gradient was cleared before the next one (a new tensor after
``zero_grad(set_to_none=True)``, or one written in place since: ``zero_grad(set_to_none=False)``); gradient
accumulation keeps adding into the same tensor and is not counted. Once a step starts, the hooks go.

``no_optimizer_step`` (warning) after :data:`DURING_RUN` such passes (a loop that computes gradients it
does not apply for a while before training, such as the attack steps of adversarial training or a Fisher
estimate, stays below it), or at close after :data:`AT_CLOSE` (a run that ended without one update). A loop
whose GradScaler dropped every update is the scaler's case (``amp_overflow_persistent``), not this one.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch

from gradwatch.core.failures import internal_warning
from gradwatch.core.findings import Explanation, Finding

#: Cleared backward passes with no optimizer step, while the run goes on / when it ends.
DURING_RUN = 64
AT_CLOSE = 8


@dataclass
class Unstepped:
    """What the hook saw before the first optimizer step."""

    passes: int = 0  # backward passes that reached the watched parameter
    cleared: int = 0  # of those, the passes whose gradient was gone before the next one
    reported: bool = False


def due(seen: Unstepped, *, closing: bool) -> bool:
    """Whether ``no_optimizer_step`` is reported now."""
    return not seen.reported and seen.cleared >= (AT_CLOSE if closing else DURING_RUN)


class StepWatch:
    """Engine extension for plain loops: see the module docstring."""

    def __init__(self) -> None:
        self.seen = Unstepped()
        self._engine: Any = None
        self._handles: list[Any] = []
        self._last: weakref.ref[torch.Tensor] | None = None  # the gradient after the latest pass
        self._version = 0  # and its version then

    def attach(self, engine: Any) -> None:
        self._engine = engine
        ops = [op for op in engine.index.per_optimizer if op.optimizer is not None]
        sentinel = next((p for op in ops for p in op.params if p.requires_grad and p.is_leaf), None)
        if sentinel is None or not hasattr(sentinel, "register_post_accumulate_grad_hook"):
            return
        self._handles.append(sentinel.register_post_accumulate_grad_hook(self._on_grad))
        for op in ops:
            self._handles.append(op.optimizer.register_step_pre_hook(self._on_step))

    def _on_step(self, *_: Any) -> None:
        self._remove()  # a step started: from now on the checks see every update

    def _on_grad(self, param: torch.Tensor) -> None:
        if self.seen.reported:
            return  # (the hooks go at the next step or at close: not while backward runs them)
        try:
            g = param.grad
            if g is None:
                return
            # The previous pass's gradient is gone (set to None, freed), another tensor, or written since it: it
            # was cleared before this pass. Accumulation adds this pass into it: one version step.
            if self._last is not None and (g is not self._last() or g._version != self._version + 1):
                self.seen.cleared += 1
            self.seen.passes += 1
            self._last, self._version = weakref.ref(g), g._version
            if due(self.seen, closing=False):
                self._report()
        except Exception as exc:  # noqa: BLE001 - never break the user's backward
            internal_warning("StepWatch (backward hook)", exc, owner=self._engine)

    def _report(self) -> None:
        from gradwatch.observe.amp import scaler_of_training_thread

        self.seen.reported = True
        if scaler_of_training_thread() is not None:
            return  # a GradScaler dropping every update: the AMP monitor reports that
        engine = self._engine
        opt = next((op.optimizer for op in engine.index.per_optimizer if op.optimizer is not None), None)
        engine.add_finding(no_step_finding(self.seen, type(opt).__name__))

    def close(self) -> None:
        try:
            if self._engine is not None and self._handles and due(self.seen, closing=True):
                self._report()
        except Exception as exc:  # noqa: BLE001
            internal_warning("StepWatch.close", exc, owner=self._engine)
        self._remove()
        self._engine = None

    def _remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def no_step_finding(seen: Unstepped, optimizer_class: str) -> Finding:
    return Finding(
        kind="no_optimizer_step",
        step=0,
        severity="warning",
        explanation=Explanation(
            what=f"{seen.passes} backward passes ran and the gradients of {seen.cleared} of them were cleared "
            f"before the next one, but the watched optimizer ({optimizer_class}) has not stepped once: no update "
            "has been applied, the weights have not changed since watch().",
            why="the loss cannot go down and every backward pass is wasted; gradwatch checks each update inside "
            "optimizer.step(), so it has had nothing to check either.",
            fix="call optimizer.step() after loss.backward() and before optimizer.zero_grad() (with a GradScaler: "
            "scaler.step(optimizer); scaler.update()); if another optimizer applies the updates, watch that one: "
            "gradwatch.watch(model, that_optimizer). (Gradients computed on purpose without an update, such as "
            "saliency maps or a Fisher estimate, need no fix.)",
        ),
        data={"backward_passes": seen.passes, "cleared": seen.cleared, "optimizer_class": optimizer_class},
    )
