"""Where a persistent fp16 overflow is born, when no check can say: the scaler drops every update.

A forward pass that overflows float16 on every step (``torch.exp(x * 20)`` under fp16 autocast) makes the
GradScaler drop every update, so no optimizer step runs, no check runs and no incident is localized:
``amp_overflow_persistent`` is found from backward (:meth:`gradwatch.observe.amp.AmpMonitor._check_unstepped`),
where no replay may run, or at close. The dropped steps' forward calls are still held (no optimizer step
released them): :class:`OverflowOrigin` replays them once per run, at the next forward's start (outside
backward) or at close, through the escalation's incident path, and keeps its findings only when an op is
named (``nan_origin`` with op, module, line and the autocast fix). Nothing is hooked on healthy runs.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from gradwatch.core.failures import internal_warning
from gradwatch.core.findings import Finding
from gradwatch.core.stats import StepStats
from gradwatch.observe.module_hooks import owned


class OverflowOrigin:
    """Localizes one persistent overflow per run (see the module's docstring)."""

    def __init__(self) -> None:
        self._pending: Finding | None = None
        self._engine: Any = None
        self._hook: Any = None
        self._done = False

    def schedule(self, engine: Any, finding: Finding, *, hook: bool = True) -> None:
        """``finding`` (``amp_overflow_persistent``) gets localized at the next forward's start (``hook``), or
        by the caller's :meth:`localize` (at close). Only while the escalation holds forward calls to replay."""
        if self._done or self._pending is not None:
            return
        from gradwatch.diagnose.escalation import Escalation

        esc = engine.extension(Escalation)
        model = getattr(esc, "model", None)
        if esc is None or not esc.active or model is None or not esc.capture.calls:
            return
        self._pending, self._engine = finding, engine
        if hook:
            self._hook = owned(model, model.register_forward_pre_hook(self._on_forward_start, prepend=True))

    def _on_forward_start(self, module: Any, args: Any) -> None:
        self.remove()
        engine = self._engine
        if engine is None or engine.closed or torch.compiler.is_compiling():
            self._pending = None
            return
        self.localize(engine)

    def localize(self, engine: Any) -> None:
        """Replay the held calls of the dropped steps as an incident of the persistent overflow's step: the op,
        module and line where the overflow is born, with its fix (keep it in float32, or bf16)."""
        finding, self._pending, self._engine = self._pending, None, None
        if finding is None:
            return
        self._done = True
        if sys.exc_info()[0] is not None:
            return  # closing on the training code's exception: its model is not replayed
        try:
            at = StepStats(step=finding.step, optimizer_index=0, loss_nonfinite=True)
            more = engine.incident(at, [finding])
            # Only an op named in the model or the loss code adds to the warning (a birth "in the loss" with no
            # op, or nothing reproduced, says less than its fix already does).
            if any(f.kind == "nan_origin" and f.data.get("op") for f in more):
                for f in more:
                    engine.add_finding(f)
        except Exception as exc:  # noqa: BLE001 - never break the user's forward
            internal_warning("AmpMonitor (where the overflow is born)", exc, owner=engine)

    def remove(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
