"""A GradScaler's gradients stepped by ``optimizer.step()`` directly: every update ``scale`` times too large.

``scaler.scale(loss).backward()`` leaves every gradient multiplied by the scale (65536 at first). Only
``scaler.step(optimizer)`` divides it out (unscaling first, and dropping the update when the gradients
overflowed), and only ``scaler.update()`` moves the scale. A plain loop that scales its loss but then calls
``optimizer.step()`` itself applies the scaled gradients as they are.

:class:`ScalerBypass` (plain loops only: Lightning's precision plugin drives the scaler itself) tells it from
the scaler's own bookkeeping at the optimizer's step pre-hook, with no sync (:func:`stepped_directly`):

- the scaler is enabled and has scaled a loss (its ``_scale`` is set: ``scale()`` makes it on first use, so a
  scaler created and never used, or disabled, has none);
- it has never stepped anything and never updated: no optimizer's stage is past ``READY`` (``unscale_`` and
  ``scaler.step`` move it), and its scale tensor was never written (``update()`` writes it in place, which
  moves the tensor's version counter);
- this step does not run inside ``scaler.step()`` (no ``found_inf`` handed to a fused optimizer, no
  GradScaler ``step`` on the call stack), nor inside a closure (LBFGS: ``scaler.step`` refuses closures);
- with several watched optimizers, every one of them was seen stepping that way: one optimizer stepped
  directly on an unscaled loss beside another the scaler steps is not this.

A scaler handed to ``watch`` (or found by the AmpMonitor) is asked at every check, from the step's first one; a
scaler only the loop holds is looked for on a step whose gradients are non-finite (see :class:`ScalerBypass`).

The facts go to ``stats.extra["scaler_bypassed"]`` (the scale read with the step's statistics), where
:mod:`gradwatch.checks.scaler_step_bypassed` words them, and the non-finite findings and ``too_many_skips``
of such a step take its fix. :func:`explain_no_inf_checks` explains the error ``scaler.update()`` raises in
the same loop ("No inf checks were recorded prior to update.").
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from gradwatch.core.failures import internal_warning
from gradwatch.core.findings import Finding
from gradwatch.observe.amp import AmpMonitor
from gradwatch.observe.tracing import traceback_entries

#: How many frames up from gradwatch's check the loop's ``scaler`` variable (or a GradScaler's ``step``) is looked for.
STACK_DEPTH = 48

NO_INF_CHECKS = "No inf checks were recorded prior to update"

#: Non-finite checks on which a scaler no one handed over is looked for in the loop's variables.
MAX_SCANS = 4


def _is_scaler(obj: Any) -> bool:
    cls = getattr(getattr(torch, "amp", None), "GradScaler", None)
    return cls is not None and isinstance(obj, cls)


def _stage(state: Any) -> str:
    stage = state.get("stage") if isinstance(state, dict) else None
    return str(getattr(stage, "name", "READY"))


def scaler_only_scaled(scaler: Any) -> bool:
    """The scaler is enabled, has scaled a loss, and has neither unscaled, stepped nor updated anything since."""
    scale = getattr(scaler, "_scale", None)
    if not isinstance(scale, torch.Tensor) or not scaler.is_enabled() or scale._version != 0:
        return False
    states = getattr(scaler, "_per_optimizer_states", {})
    return all(_stage(s) == "READY" for s in list(states.values()))


def stepped_directly(scaler: Any, opt: Any) -> bool:
    """``opt.step()`` is running outside ``scaler.step()`` while the scaler only ever scaled (see the module)."""
    if opt is None or hasattr(opt, "found_inf") or not scaler_only_scaled(scaler):
        return False
    return _scaler_step_on_stack() is None  # the stack walk last: only a loop that looks like one gets here


def held_scaler(depth: int = STACK_DEPTH) -> Any:
    """The one GradScaler that has scaled a loss held by the calling frames: a variable of theirs (a script's
    module-level ``scaler`` is its frame's local) or a ``self.scaler``; None when there is none, or several.
    A frame's ``f_locals`` is a snapshot the frame keeps (before Python 3.13): the rare path only."""
    cls = getattr(getattr(torch, "amp", None), "GradScaler", None)
    if cls is None:
        return None
    found: list[Any] = []
    frame: Any = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            break
        local = frame.f_locals
        owned = getattr(local.get("self"), "__dict__", None)
        candidates = [*local.values(), owned.get("scaler")] if isinstance(owned, dict) else local.values()
        for v in candidates:
            if isinstance(v, cls) and getattr(v, "_scale", None) is not None and v not in found:
                found.append(v)
        frame = frame.f_back
    return found[0] if len(found) == 1 else None


def _scaler_step_on_stack() -> Any:
    """A GradScaler whose ``step()`` (or ``_maybe_opt_step``) is on the call stack, or None."""
    frame: Any = sys._getframe(1)
    for _ in range(STACK_DEPTH):
        if frame is None:
            return None
        if frame.f_code.co_name in ("step", "_maybe_opt_step"):
            owner = frame.f_locals.get("self")
            if _is_scaler(owner):
                return owner
        frame = frame.f_back
    return None


class ScalerBypass:
    """Engine extension (plain loops): optimizer steps that bypass the GradScaler that scaled their loss.

    Args:
        scaler: The ``torch.amp.GradScaler`` handed to ``watch(..., scaler=...)``, if any. Otherwise the one
            the :class:`~gradwatch.observe.amp.AmpMonitor` found (a ``scaler.step`` calling the optimizer), or
            else the loop's own ``scaler`` variable, looked for only on the first :data:`MAX_SCANS` checks whose
            gradients are non-finite: reading a running loop's variables keeps its tensors (the batch, the
            output) alive until they are read again, a cost a healthy step must not pay.
    """

    def __init__(self, scaler: Any = None) -> None:
        self.scaler = scaler if _is_scaler(scaler) else None
        self._engine: Any = None
        self._scans = 0
        self._direct: set[int] = set()  # watched optimizers seen stepping directly while the scaler only scaled
        self.last_step: int | None = None  # the last step reported as stepped directly

    def attach(self, engine: Any) -> None:
        self._engine = engine

    def _known_scaler(self) -> Any:
        if self.scaler is not None:
            return self.scaler
        amp = self._engine.extension(AmpMonitor)
        return amp.scaler if amp is not None else None

    def before_sync(self, ctx: Any) -> None:
        try:
            scaler = self._known_scaler()
            if scaler is not None and self._bypassed(ctx.stats, scaler):
                ctx.slots["scaler_bypass_scale"] = ctx.batch.add(scaler._scale)
        except Exception as exc:  # noqa: BLE001 - never break the user's step
            internal_warning("ScalerBypass", exc, owner=self._engine)

    def after_sync(self, ctx: Any) -> None:
        stats = ctx.stats
        facts = stats.extra.get("scaler_bypassed")
        slot = ctx.slots.get("scaler_bypass_scale", -1)
        if slot >= 0 and isinstance(facts, dict):
            facts["scale"] = ctx.batch.resolve()[slot][0]
            return
        if not (stats.nonfinite or stats.overflow_norm) or self._known_scaler() is not None or self._scans >= MAX_SCANS:
            return
        try:  # a non-finite step, and no scaler known: the loop's own, if it scaled this backward
            self._scans += 1
            self.scaler = held_scaler()
            if self.scaler is not None and self._bypassed(stats, self.scaler):
                stats.extra["scaler_bypassed"]["scale"] = float(self.scaler._scale.float().item())  # rare path
        except Exception as exc:  # noqa: BLE001
            internal_warning("ScalerBypass", exc, owner=self._engine)

    def _bypassed(self, stats: Any, scaler: Any) -> bool:
        """Whether this step's optimizer steps around ``scaler`` (and every watched one was seen doing so); the
        facts go to ``stats.extra["scaler_bypassed"]``."""
        opts = self._engine.optimizers
        index = stats.optimizer_index
        if stats.extra.get("closure_step") or index >= len(opts):
            return False
        if not stepped_directly(scaler, opts[index]):
            self._direct.discard(index)
            return False
        self._direct.add(index)
        if len(self._direct) < len(opts):
            return False  # another watched optimizer may be the one the scaler steps
        self.last_step = stats.step
        stats.extra["scaler_bypassed"] = {
            "optimizer": index,
            "optimizer_class": type(opts[index]).__name__,
            "optimizers": len(opts),
        }
        return True

    @property
    def seen(self) -> bool:
        """Every watched optimizer was last seen stepping directly while the scaler only scaled."""
        return bool(self._direct) and len(self._direct) == len(self._engine.optimizers if self._engine else ())

    def close(self) -> None:
        self._engine = None


def explain_no_inf_checks(exc: BaseException, engine: Any) -> Finding | None:
    """``scaler.update()`` raised "No inf checks were recorded prior to update.": no optimizer went through
    ``scaler.step()`` (nor ``scaler.unscale_()``) since the last update. Explained when :class:`ScalerBypass`
    saw the loop step its optimizer directly on scaled gradients, or the watched optimizer stepped before this
    scaler ever updated (not an update without any step, such as one every micro-batch of an accumulation).
    Exception path only."""
    from gradwatch.checks.scaler_step_bypassed import no_inf_checks_finding

    scaler = next(
        (frame.f_locals.get("self") for frame, _line in traceback_entries(exc)
         if frame.f_code.co_name == "update" and _is_scaler(frame.f_locals.get("self"))),
        None,
    )
    if scaler is None or getattr(scaler, "_scale", None) is None:
        return None
    bypass = engine.extension(ScalerBypass) if hasattr(engine, "extension") else None
    stepped = list(getattr(engine, "step_counts", []) or [])
    if bypass is not None and bypass.seen and bypass.last_step is not None:
        step = bypass.last_step  # the step that went around the scaler (its update() raises after it)
    elif scaler._scale._version == 0 and len(stepped) == 1 and stepped[0] > 0:
        step = stepped[0] - 1  # the optimizer stepped before the scaler ever stepped or updated: around it
    else:
        return None  # (an update with no step since the last one: not this)
    opts = list(getattr(engine, "optimizers", []) or [])
    return no_inf_checks_finding(
        step=step,
        scale=float(scaler._scale.float().item()),
        optimizer_class=type(opts[0]).__name__ if len(opts) == 1 else "",
    )
