"""Mixed precision: a gradient scaler's overflow steps are normal, not NaN incidents.

``torch.amp.GradScaler`` multiplies the loss by a large scale so fp16 gradients do not underflow. When
the scaled gradients overflow it drops that update and halves the scale (``scaler.update()``); early in
fp16 training that happens a few times and is expected. :class:`AmpMonitor` (attached for both ways in)
makes gradwatch agree with the scaler:

- Overflow steps are reported as ``amp_overflow`` (severity info, with the new scale), never as
  ``nonfinite_grad`` or ``exploding_grad``, and never skipped or raised by the ``on_nonfinite`` policy:
  the scaler already drops the update.
- ``amp_overflow_persistent`` (warning) when overflow persists: the scale falls below 1, or, after the
  scale has settled (once an update went through), ``PERSISTENT_STEPS`` overflow steps come in a row.
- Gradient norms are of unscaled gradients. Where the gradients are still scaled when gradwatch looks
  (optimizers that unscale inside their own fused step, ``_step_supports_amp_scaling``), the norms are
  divided by the scale.

How each case is seen, without extra device-to-host syncs (the scaler's tensors are read with the
step's statistics):

- Plain loop: ``scaler.step(opt)`` calls ``opt.step()`` only when the gradients are finite, so
  gradwatch's step hook never runs on an overflow step, and the gradients it sees are unscaled. The
  overflow steps in between are counted from the scale: each one multiplies it by the backoff factor
  (the growth tracker says whether the last update grew it first). A NaN/Inf loss observed on such a
  step is a real incident, reported at that step (``nonfinite_loss``, localized), and never held
  against the healthy step that follows. With several optimizers sharing the scaler (a GAN), a check
  takes as its own only as many of the last observed losses as that optimizer's checks observe when
  nothing was dropped (none for G when only D's loss is observed), and the dropped step is named as the
  optimizer usually checked before it.
  The scaler is the one handed to ``watch(..., scaler=scaler)``, or else the one whose ``step()`` is
  found calling the optimizer, or, while no update has gone through (no check can have run), the loop's
  ``scaler`` variable, looked for from backward. Those steps count as optimizer steps (as in Lightning's
  ``global_step``), so step numbers match the loop's iterations. Fused optimizers are stepped on every
  iteration with ``found_inf`` attached, which gradwatch reads.
- Lightning (``precision="16-mixed"`` with a scaler): ``on_before_optimizer_step`` runs after the
  unscale and after ``found_inf`` is known, on overflow steps too; for fused optimizers the gradients
  are still scaled there and an overflow shows as non-finite scaled gradients.

``precision="bf16-mixed"`` (and ``"16-mixed"`` on CPU, which Lightning turns into bf16) has no scaler:
bf16 has fp32's range, nothing overflows, and every NaN/Inf is a real incident handled as usual.
"""

from __future__ import annotations

import math
import sys
import threading
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.parameter import is_lazy

from gradwatch.core.failures import internal_warning
from gradwatch.core.findings import Explanation, Finding, names_text
from gradwatch.core.stats import StepStats, layer_norms, total_norm
from gradwatch.observe.amp_origin import OverflowOrigin
from gradwatch.observe.tracing import library_frame, traceback_entries

#: After the scale has settled, this many overflow steps in a row is a persistent overflow.
PERSISTENT_STEPS = 8
#: A loss scale below this means gradients overflow fp16 even unscaled: a persistent overflow.
SCALE_FLOOR = 1.0
#: Before any update has gone through, this many overflow steps in a row is a persistent overflow too: finding
#: the scale from the default init_scale (2**16) takes a few halvings, and 32 would take it below SCALE_FLOOR,
#: so only a far too high init_scale (or an overflow that never ends) gets here.
UNSETTLED_STEPS = 32


class AmpMonitor:
    """Engine extension: counts a ``GradScaler``'s overflow steps and keeps them out of the NaN policy.

    Args:
        scaler: The ``torch.amp.GradScaler`` in use, if known (``watch(..., scaler=...)``, or the
            Trainer's precision plugin). In a plain loop without it, the scaler is found the first time
            its ``step()`` calls the optimizer.
        integration: ``"plain"`` or ``"lightning"``.
    """

    def __init__(self, scaler: Any = None, integration: str = "plain") -> None:
        self.scaler = scaler if _is_scaler(scaler) else None
        self.integration = integration
        self.overflow_steps = 0
        self._engine: Any = None
        self._slots: dict[str, int] = {}
        self._last_scale: float | None = None
        self._last_tracker = 0.0
        self._last_was_overflow = False
        self._consecutive = 0
        self._settled = False
        self._persistent_reported = False
        # The scale fell below SCALE_FLOOR and that was reported: until it climbs back, further overflow
        # streaks are that same persistent overflow (one warning, not one per streak).
        self._floor_reported = False
        self._streak: dict[str, Any] | None = None
        self._hook: Any = None
        self._origin = OverflowOrigin()  # where a persistent overflow no check localizes is born
        self._scans = 0
        self._grad_ref: Any = None
        self._steps_at_last_cycle = -1
        self._version_at_step = 0
        self._cleared_since_step = False
        self._unstepped = 0
        self._passes_unstepped = 0  # backward passes before any optimizer step, while the scaler is unknown
        self._next_scan = PERSISTENT_STEPS
        # Per optimizer: how many losses its last check observed when the scaler dropped no step before it,
        # i.e. how many of the losses observed since the previous check are its step's own.
        self._own_losses: dict[int, int] = {}
        # Which optimizer was checked right before each one when nothing was dropped in between: with several
        # optimizers, a step dropped since the last check is that optimizer's (a GAN's D, before G).
        self._checked_before: dict[int, int] = {}
        self._last_checked: int | None = None

    def attach(self, engine: Any) -> None:
        self._engine = engine
        if self.integration == "plain":
            self._watch_unstepped_cycles(engine)

    # -- no optimizer step at all ------------------------------------------------------------------
    def _watch_unstepped_cycles(self, engine: Any) -> None:
        """Notice a scaler that never lets a step through: then no step hook of gradwatch ever runs.

        One parameter gets a post-accumulate-grad hook (one Python call per backward). Each
        ``scaler.update()`` writes the scale in place, so the scale tensor's version counter says how
        many updates ran since the last optimizer step, with no sync; each of them dropped its step.
        Whether the parameter's gradient was ever a new tensor in between tells a forgotten
        ``zero_grad`` (the first overflow's Inf stays in ``.grad`` and every later step overflows too).
        A scaler not handed to ``watch`` is looked for (:meth:`_adopt_scaler`) while no update has gone
        through: only then can no check of gradwatch's have found it.
        """
        sentinel = next(
            (p for op in engine.index.per_optimizer for p in op.params if p.requires_grad and p.is_leaf
             and not is_lazy(p)),  # a lazy module's parameter takes no hook before its first forward
            None,
        )
        if sentinel is None or not hasattr(sentinel, "register_post_accumulate_grad_hook"):
            return
        self._hook = sentinel.register_post_accumulate_grad_hook(self._on_grad)

    def _on_grad(self, param: torch.Tensor) -> None:
        engine = self._engine
        if engine is None or engine.closed:
            return
        if self.scaler is None and not self._adopt_scaler(engine):
            return
        scale = getattr(self.scaler, "_scale", None)
        if not isinstance(scale, torch.Tensor):
            return
        try:
            grad = param.grad
            steps = sum(engine.step_counts)
            if steps != self._steps_at_last_cycle:  # an optimizer step ran: start counting afresh
                self._steps_at_last_cycle = steps
                self._version_at_step = scale._version
                self._cleared_since_step = False
            elif grad is not None and (self._grad_ref is None or grad is not self._grad_ref()):
                self._cleared_since_step = True
            if grad is not None:
                self._grad_ref = weakref.ref(grad)
            self._unstepped = scale._version - self._version_at_step  # scaler.update() calls since
            if self._unstepped >= PERSISTENT_STEPS and not self._persistent_reported:  # (see _report for when)
                self._check_unstepped(engine, never_cleared=not self._cleared_since_step)
        except Exception as exc:  # noqa: BLE001 - never break the user's backward
            internal_warning("AmpMonitor (unstepped iterations)", exc, owner=engine)

    def _adopt_scaler(self, engine: Any) -> bool:
        """A plain loop whose scaler was not handed over and no update has gone through yet: no check ran, so
        none found the scaler. After PERSISTENT_STEPS backward passes without an optimizer step (then after
        twice as many, and so on: a few stack walks of ~20 us in a run that accumulates), the loop's
        ``scaler`` variable is looked for; found, its updates since it was made are counted from its
        scale's version counter (0 when made: ``scaler.update()`` writes it in place once per call)."""
        try:
            if any(engine.step_counts):
                return False  # an update went through: the checks look for the scaler (before_sync)
            self._passes_unstepped += 1
            if self._passes_unstepped < self._next_scan:
                return False
            self._next_scan *= 2
            scaler = scaler_of_training_thread()
            if scaler is None or not isinstance(getattr(scaler, "_scale", None), torch.Tensor):
                return False
            self.scaler = scaler
            self._steps_at_last_cycle = 0
            self._version_at_step = 0  # every update since the scale was made dropped its step
            return True
        except Exception as exc:  # noqa: BLE001 - never break the user's backward
            internal_warning("AmpMonitor (looking for the scaler)", exc, owner=engine)
            return False

    def _check_unstepped(self, engine: Any, never_cleared: bool = False) -> None:
        scaler = self.scaler
        if scaler is None or getattr(scaler, "_scale", None) is None:
            return
        scale = float(scaler._scale.item())  # a degenerate run only: no update for many iterations
        stats = StepStats(step=engine.step_counts[0] + self._unstepped - 1)  # the last dropped step
        # A look at the streak so far: close() counts these steps again from the scale, as if not looked at.
        consecutive, self._consecutive = self._consecutive, self._unstepped
        streak, self._streak = (
            self._streak,
            {
                "first_step": engine.step_counts[0],
                "n": self._unstepped,
                "scale": scale / scaler_backoff(scaler) ** self._unstepped,
                "new_scale": scale,
                "loss_nonfinite": False,
            },
        )
        try:
            self._report(stats, done=None, no_update_yet=not self._settled, grads_never_cleared=never_cleared)
        finally:
            self._streak, self._consecutive = streak, consecutive
        from gradwatch.checks import amp_overflow

        for f in amp_overflow.check(stats, engine.history, engine.config):
            engine.add_finding(f)
            if f.kind == "amp_overflow_persistent":
                self._origin.schedule(engine, f)

    # -- before the sync ---------------------------------------------------------------------------
    def before_sync(self, ctx: Any) -> None:
        self._slots = {}
        if self.integration == "plain":
            if self.scaler is None:
                self._look_for_scaler()
            if (self.scaler is None) == (self._hook is not None):
                self._rehook()
        scaler = self.scaler
        if scaler is None or not scaler.is_enabled() or getattr(scaler, "_scale", None) is None:
            return
        batch = ctx.batch
        self._slots["scale"] = batch.add(scaler._scale)
        tracker = getattr(scaler, "_growth_tracker", None)
        if tracker is not None:
            self._slots["tracker"] = batch.add(tracker)
        opt = self._optimizer(ctx.stats.optimizer_index)
        if opt is None:
            return
        grad_scale, found_inf, scaled_unknown = _scaling_state(scaler, opt, self.integration)
        if isinstance(grad_scale, torch.Tensor):
            self._slots["grad_scale"] = batch.add(grad_scale)
        if isinstance(found_inf, torch.Tensor):
            self._slots["found_inf"] = batch.add(found_inf)
            ctx.slots["amp_scaler_skips"] = self._slots["found_inf"]
        elif scaled_unknown and ctx.norm_slots:
            # The scaler will find an overflow exactly when a scaled gradient is non-finite.
            norms = torch.cat([batch.part(slot) for slot, _ in ctx.norm_slots])
            self._slots["found_inf"] = batch.add((~torch.isfinite(norms)).any().float())
            ctx.slots["amp_scaler_skips"] = self._slots["found_inf"]

    def _rehook(self) -> None:
        """At a check (never inside backward): the backward hook is kept while it has a use, counting the
        found scaler's dropped updates. Without a scaler it goes: a check ran, so none is looked for from
        backward any more (see :meth:`_adopt_scaler`); the checks look for it, and hook again when found."""
        if self.scaler is None:
            self._hook.remove()
            self._hook = None
        else:
            self._watch_unstepped_cycles(self._engine)

    def _look_for_scaler(self) -> None:
        """Looked for on the first checks, then every SCAN_EVERY-th (a stack walk costs ~20 us): a scaler
        created mid-run is found within that many steps. Its overflow steps never reach the optimizer's
        hooks, so until then only the scale's accounting waits, no check."""
        self._scans += 1
        if self._scans <= SCAN_FIRST or self._scans % SCAN_EVERY == 0:
            self.scaler = _scaler_in_stack()

    def _optimizer(self, index: int) -> Any:
        opts = self._engine.optimizers
        return opts[index] if index < len(opts) else None

    # -- after the sync ----------------------------------------------------------------------------
    def after_sync(self, ctx: Any) -> None:
        if "scale" not in self._slots:
            return
        values = ctx.batch.resolve()
        stats: StepStats = ctx.stats
        scale = values[self._slots["scale"]][0]
        tracker = values[self._slots["tracker"]][0] if "tracker" in self._slots else 0.0
        if "grad_scale" in self._slots:
            grad_scale = values[self._slots["grad_scale"]][0]
            _unscale_norms(stats, grad_scale, self._engine.config.per_layer)
            if grad_scale != 1.0:  # a fused optimizer unscales inside its step: what a clip before it saw
                stats.extra["unscaled_by"] = grad_scale
        overflow_here = "found_inf" in self._slots and values[self._slots["found_inf"]][0] > 0
        hidden = self._hidden_overflows(scale, tracker) if self.integration == "plain" else 0
        self._last_scale, self._last_tracker, self._last_was_overflow = scale, tracker, overflow_here
        backoff = scaler_backoff(self.scaler)
        index, last, self._last_checked = stats.optimizer_index, self._last_checked, stats.optimizer_index
        if not hidden:
            slot = ctx.slots.get("loss", -1)
            self._own_losses[index] = len(values[slot]) if slot >= 0 else 0
            if last is not None:
                self._checked_before[index] = last
        if hidden:
            self._account_dropped(ctx, values, hidden, scale / backoff**hidden, scale, last)
        if overflow_here:
            loss_nonfinite, loss = stats.loss_nonfinite, stats.loss
            _blank(stats)
            self._grow_streak(stats.step, 1, before=scale, after=scale * backoff, loss_nonfinite=loss_nonfinite)
            self._report(stats, done=None)
            if loss_nonfinite:  # Lightning (the scaler's inf check before the step): this step's own loss
                self._report_dropped_loss(stats, stats.step, loss if loss is not None else math.nan)
        else:
            done, self._streak = self._streak, None
            self._report(stats, done=done)
            self._consecutive = 0
            self._settled = True
            self._persistent_reported = False
            self._floor_reported = self._floor_reported and scale < SCALE_FLOOR
        scalars = stats.extra.setdefault("scalars", {})
        scalars["gradwatch/amp/scale"] = scale
        scalars["gradwatch/amp/overflow_steps"] = float(self.overflow_steps)

    def _account_dropped(self, ctx: Any, values: Any, hidden: int, before: float, after: float, last: int | None) -> None:
        """The scaler dropped ``hidden`` steps since the last check (plain loop): count them as steps, add them
        to the streak, and report a non-finite loss (or batch) of theirs at its own step."""
        stats: StepStats = ctx.stats
        index, first = stats.optimizer_index, stats.step
        if len(self._engine.optimizers) == 1:
            # The scaler's skipped steps are optimizer steps too (as in Lightning's global_step).
            self._engine.step_counts[index] += hidden
            stats.step += hidden
        stats.extra["scaler_dropped"] = (first, hidden)  # the steps the scaler dropped since the last check
        dropped_loss = self._loss_of_dropped_steps(ctx, values, first, hidden)
        self._grow_streak(first, hidden, before=before, after=after, loss_nonfinite=dropped_loss is not None)
        usual = self._checked_before.get(index, last)
        owner = usual if hidden == 1 and usual is not None and usual != last else index
        if dropped_loss is not None:
            self._report_dropped_loss(stats, *dropped_loss, optimizer=owner)
        elif self._dropped_batch_nonfinite():
            # No loss observed, but a dropped step's batch held NaN/Inf: no overflow of scaling either.
            self._report_dropped_loss(stats, first, math.nan, batch_only=True, optimizer=owner)

    def _loss_of_dropped_steps(self, ctx: Any, values: Any, first: int, hidden: int) -> tuple[int, float] | None:
        """``(step, loss)`` when a non-finite loss observed since the last check belongs to the steps the
        scaler dropped, not to this one: this step's gradients and its own losses are finite. Its flag is
        taken off this step, whose update is healthy and must go through.

        This step's own losses are the last ones observed: one with a single optimizer; with several, as
        many as this optimizer's last check saw when nothing was dropped before it. A GAN that observes
        only D's loss observes none for G: a NaN D loss on D's dropped step is never G's."""
        stats: StepStats = ctx.stats
        slot = ctx.slots.get("loss", -1)
        current = values[slot] if slot >= 0 else []
        stale = list(stats.extra.get("stale_losses") or ())  # losses of backward passes whose gradients were cleared
        own = 1 if len(self._engine.optimizers) == 1 else self._own_losses.get(stats.optimizer_index, 1)
        split = len(current) - min(own, len(current))
        mine, dropped = current[split:], stale + current[:split]
        bad = next((i for i, v in enumerate(dropped) if not math.isfinite(v)), None)
        if bad is None or stats.nonfinite or not all(math.isfinite(v) for v in mine):
            return None
        # One observed loss per dropped step maps each to its step; otherwise the first dropped step.
        step = first + bad if len(dropped) == hidden else first
        stats.extra.pop("stale_losses", None)  # reported here, with its step
        if current:
            stats.loss_nonfinite = False
            stats.loss = sum(mine) / len(mine) if mine else None
        return step, dropped[bad]

    def _dropped_batch_nonfinite(self) -> bool:
        """Whether a batch held since the last check (the scaler's dropped steps included) holds NaN/Inf.
        Asked on overflow steps only, when no loss was observed."""
        from gradwatch.diagnose.escalation import Escalation

        esc = self._engine.extension(Escalation)
        try:
            return bool(esc is not None and esc.active and esc.nonfinite_inputs())
        except Exception as exc:  # noqa: BLE001
            internal_warning("AmpMonitor (dropped batch)", exc, owner=self._engine)
            return False

    def _report_dropped_loss(self, stats: StepStats, step: int, loss: float, engine: Any = None,
                             localize: bool = True, batch_only: bool = False, optimizer: int | None = None) -> None:
        """A NaN/Inf loss (or batch) on a step the scaler dropped: a real incident (scaling never makes the
        unscaled loss non-finite), reported at its own step (of ``optimizer``, the dropped step's when
        known) and localized like any other."""
        engine = engine or self._engine
        optimizer = stats.optimizer_index if optimizer is None else optimizer
        at = StepStats(step=step, optimizer_index=optimizer, loss=loss, loss_nonfinite=True)
        what = (
            f"The gradients of step {step} were non-finite and its batch holds NaN/Inf (the loss was not "
            "observed)"
            if batch_only
            else f"The loss is {loss} at step {step}. Its gradients were non-finite too"
        )
        finding = Finding(
            kind="nonfinite_grad" if batch_only else "nonfinite_loss",
            step=step,
            severity="error",
            explanation=Explanation(
                what=f"{what}, so the gradient scaler dropped that update (the weights are unchanged) and lowered "
                "the loss scale; but loss scaling never makes the unscaled loss or the data NaN/Inf, so this is not "
                "a normal overflow: a bad batch or an op in the forward pass produced it.",
                fix="look for log/sqrt/division of zero or negative values in the loss, add an epsilon (e.g. "
                "torch.log(x + 1e-8)), clamp logits, or check the batch for NaN/Inf.",
            ),
            data={"loss": loss, "optimizer": optimizer, "dropped_by_scaler": True},
        )
        more = engine.incident(at, [finding]) if localize else []
        for f in [finding, *more]:
            engine.add_finding(f)

    # -- an exception on an overflow step ----------------------------------------------------------
    def raised_on_overflow(
        self,
        exc: BaseException,
        step: int,
        bad_params: list[str],
        counts: tuple[dict[str, int], dict[str, int]],
        total_params: int,
        loss_observed: bool,
    ) -> Finding | None:
        """The training code raised on non-finite gradients before any step (``clip_grad_norm_(...,
        error_if_nonfinite=True)``, Fabric's ``clip_gradients`` by default) and they are a gradient
        scaler's overflow: the backward was scaled (not unscaled yet, or ``unscale_`` found Inf), the loss
        (when observed), the batch and the model's output gradient are finite. ``scaler.step()`` would have
        dropped the update; the raise ended the run instead. None when that is not sure: a NaN/Inf loss or
        batch is a real incident, explained as one. Exception path only (a few syncs)."""
        engine = self._engine
        if engine is None or not bad_params:
            return None
        scaler = self.scaler or _scaler_on_traceback(exc, engine.optimizers)
        if scaler is None or not scaler.is_enabled() or getattr(scaler, "_scale", None) is None:
            return None
        unscaled = False
        for op in engine.index.per_optimizer:
            stage = _overflow_stage(scaler, op, bad_params)
            if stage == "UNSCALED":
                unscaled = True
            elif stage != "READY":
                return None
        from gradwatch.diagnose.escalation import Escalation

        esc = engine.extension(Escalation)
        inputs_seen = esc is not None and esc.active
        if inputs_seen and (esc.nonfinite_inputs() or esc.output_nan()):
            return None  # NaN/Inf data, or a NaN loss: scaling never makes those
        nan, inf = counts
        facts = RaisedOnOverflow(
            step=step,
            raised=type(exc).__name__,
            first_line=_first_sentence(exc),
            scale=float(scaler._scale.float().item()),
            bad=len(bad_params),
            total=total_params,
            nan=sum(nan.values()),
            inf=sum(inf.values()),
            names=names_text(bad_params),
            unscaled=unscaled,
            seen=tuple(w for w, known in (("loss", loss_observed), ("batch", inputs_seen)) if known),
            clipper=_clipper_on_traceback(exc),
        )
        return Finding(
            kind="amp_overflow",
            step=step,
            severity="error",
            explanation=raised_on_overflow_explanation(facts),
            params=tuple(bad_params),
            data={
                "raised": facts.raised,
                "scale": facts.scale,
                "unscaled": unscaled,
                "loss_observed": loss_observed,
                "inputs_checked": inputs_seen,
                "nan_counts": dict(nan),
                "inf_counts": dict(inf),
            },
        )

    def _grow_streak(self, first: int, n: int, *, before: float, after: float, loss_nonfinite: bool = False) -> None:
        """Consecutive overflow steps are reported together, once the streak ends (or persists)."""
        self.overflow_steps += n
        self._consecutive += n
        if self._streak is None:
            self._streak = {"first_step": first, "n": 0, "scale": before, "loss_nonfinite": False}
        self._streak["n"] += n
        self._streak["new_scale"] = after
        self._streak["loss_nonfinite"] = self._streak["loss_nonfinite"] or loss_nonfinite

    def _report(self, stats: StepStats, *, done: dict[str, Any] | None, **more: Any) -> None:
        streak = done or self._streak
        if streak is None:
            return
        persistent = False
        if not self._persistent_reported and not self._floor_reported and (
            streak["new_scale"] < SCALE_FLOOR
            or self._consecutive >= (PERSISTENT_STEPS if self._settled else UNSETTLED_STEPS)
            or more.get("grads_never_cleared")  # the overflow can never end: conclusive at once
        ):
            persistent = self._persistent_reported = True
            self._floor_reported = streak["new_scale"] < SCALE_FLOOR
        if done is None and not persistent:
            return
        if done is not None and not persistent and _same_persistent_overflow(done, self._floor_reported):
            return
        stats.extra["amp"] = {
            "overflow_steps": done["n"] if done else 0,
            "first_step": streak["first_step"],
            "scale": streak["scale"],
            "new_scale": streak["new_scale"],
            "consecutive": self._consecutive,
            "total": self.overflow_steps,
            "persistent": persistent,
            "loss_nonfinite": streak["loss_nonfinite"],
            "optimizer": stats.optimizer_index,
            "run_steps": stats.step + 1,  # the steps so far, dropped ones included
            **more,
        }

    def _hidden_overflows(self, scale: float, tracker: float) -> int:
        """Overflow steps since the last check that never reached the optimizer (plain loop)."""
        scaler = self.scaler
        backoff = scaler_backoff(scaler)
        if not 0.0 < backoff < 1.0 or not scale > 0:
            return 0
        if self._last_scale is None:
            # First look: overflows before the first update that went through start from init_scale.
            init = float(getattr(scaler, "_init_scale", scale) or scale)
            if tracker != 0 or any(self._engine.step_counts) or scale >= init:
                return 0
            return _steps_between(init, scale, backoff, [1.0])
        if self._last_was_overflow:
            factors = [backoff]
        else:
            # The update after the last check went through; it grew the scale exactly when it completed
            # a growth interval. Knowing which, an overflow right after a growth (x2 then x0.5: the
            # scale looks unchanged) is counted too.
            growth = float(getattr(scaler, "_growth_factor", 2.0))
            interval = int(getattr(scaler, "_growth_interval", 2000) or 2000)
            grew = self._last_tracker + 1 >= interval
            factors = [growth, 1.0] if grew else [1.0, growth]
        return _steps_between(self._last_scale, scale, backoff, factors)

    def before_close(self) -> None:
        """The run ended before another forward: the persistent overflow is localized now, while the dropped
        steps' calls are still held."""
        if self._engine is not None:
            self._origin.localize(self._engine)

    def close(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self._origin.remove()
        engine, self._engine = self._engine, None
        if engine is None:
            return
        try:
            if self.integration == "plain":
                if self.scaler is None and not any(engine.step_counts):
                    # No update ever reached the optimizer, so no check found the scaler: the loop's own.
                    self.scaler = _scaler_in_callers(depth=8)
                self._count_trailing_overflows(engine)
            else:
                self._report_open_streak(engine)
        except Exception as exc:  # noqa: BLE001
            internal_warning("AmpMonitor.close", exc, owner=engine)

    def _report_open_streak(self, engine: Any) -> None:
        """The run ended inside a streak of dropped updates: reported at close, as it would be at its end."""
        done, self._streak = self._streak, None
        if done is None:
            return
        stats = StepStats(step=done["first_step"] + done["n"] - 1)
        self._report(stats, done=done, open_at_end=True)
        from gradwatch.checks import amp_overflow

        for f in amp_overflow.check(stats, engine.history, engine.config):
            engine.add_finding(f)

    def _count_trailing_overflows(self, engine: Any) -> None:
        """Overflow steps after the last checked one (read once, at the end of the run)."""
        scaler = self.scaler
        if scaler is None or getattr(scaler, "_scale", None) is None or len(engine.optimizers) != 1:
            return
        scale = float(scaler._scale.item())
        tracker = float(scaler._growth_tracker.item()) if getattr(scaler, "_growth_tracker", None) is not None else 0.0
        self._engine = engine
        try:
            hidden = self._hidden_overflows(scale, tracker)
        finally:
            self._engine = None
        first = engine.step_counts[0]
        if hidden:
            engine.step_counts[0] += hidden
            # Losses observed after the last checked step belong to these dropped steps (one read, at close).
            losses = [float(l.detach().float().mean()) for l in engine.ledger.losses]
            bad = next((i for i, v in enumerate(losses) if not math.isfinite(v)), None)
            self._grow_streak(first, hidden, before=scale / scaler_backoff(scaler) ** hidden, after=scale,
                              loss_nonfinite=bad is not None)
            if bad is not None:
                step = first + bad if len(losses) == hidden else first
                self._report_dropped_loss(StepStats(step=step), step, losses[bad], engine=engine, localize=False)
        done, self._streak = self._streak, None
        if done is None:
            return
        stats = StepStats(step=engine.step_counts[0] - 1)
        self._report(stats, done=done, open_at_end=True)
        from gradwatch.checks import amp_overflow

        for f in amp_overflow.check(stats, engine.history, engine.config):
            engine.add_finding(f)
            if f.kind == "amp_overflow_persistent":
                self._origin.schedule(engine, f, hook=False)
        self._origin.localize(engine)  # found persistent only now, at the end of the run


def _same_persistent_overflow(done: dict[str, Any], floor_reported: bool) -> bool:
    """A short streak that ended while the scale stays below SCALE_FLOOR after that was reported: part of the
    persistent overflow already warned about, not a scaler finding its scale (no info finding of its own; a
    streak long enough to drop most of the run is still reported)."""
    from gradwatch.checks.amp_overflow import MANY

    return floor_reported and done["new_scale"] < SCALE_FLOOR and done["n"] < MANY


def _scaling_state(scaler: Any, opt: Any, integration: str) -> tuple[Any, Any, bool]:
    """``(grad_scale, found_inf, scaled_unknown)`` of ``opt`` at the check: the scale its gradients still
    carry (a tensor, or None when unscaled), the scaler's overflow flag when known yet (a tensor), and whether
    the gradients are scaled with the flag still to come (Lightning, fused optimizers)."""
    if hasattr(opt, "found_inf"):
        # Inside scaler.step() of an optimizer that unscales in its own (fused) step: the gradients
        # are still scaled by ``grad_scale`` (None when the user unscaled them), and the optimizer
        # drops the update itself when ``found_inf`` is set.
        return getattr(opt, "grad_scale", None), opt.found_inf, False
    state = scaler._per_optimizer_states.get(id(opt))
    stage = getattr(state.get("stage") if state else None, "name", None)
    if stage == "UNSCALED" and state["found_inf_per_device"]:
        return None, torch.stack([t.reshape(()).float() for t in state["found_inf_per_device"].values()]).sum(), False
    if integration == "lightning" and getattr(opt, "_step_supports_amp_scaling", False):
        return scaler._scale, None, True  # not unscaled yet: scaler.step() checks for inf itself
    return None, None, False


def _overflow_stage(scaler: Any, op: Any, bad_params: list[str]) -> str:
    """The scaler's stage for the optimizer of ``op`` if it holds one of ``bad_params``: ``"READY"`` (still
    scaled, or not concerned), ``"UNSCALED"`` (unscaled, and ``unscale_`` found Inf), ``"FINITE"`` (unscaled
    and finite: made non-finite after, not by the scaling), or the stage's own name. Exception path only."""
    if op.optimizer is None or not any(n in bad_params for n in op.names):
        return "READY"
    state = scaler._per_optimizer_states.get(id(op.optimizer))
    stage = getattr(state.get("stage") if state else None, "name", "READY")
    if stage != "UNSCALED":
        return str(stage)
    found = state["found_inf_per_device"]
    return "UNSCALED" if found and sum(float(t.sum()) for t in found.values()) else "FINITE"


def _first_sentence(exc: BaseException) -> str:
    """The first sentence of an exception's text (at most 160 characters), without its final period."""
    text = str(exc).strip()
    return text.splitlines()[0].split(". ")[0].rstrip(".")[:160] if text else ""


def _clipper_on_traceback(exc: BaseException) -> str:
    """Which clipping raised: ``"fabric"`` (Fabric's ``clip_gradients``), ``"torch"`` (``clip_grad_norm_``
    with ``error_if_nonfinite``) or ``""`` (other training code)."""
    if _on_traceback(exc, "clip_gradients", "lightning"):
        return "fabric"
    if "error_if_nonfinite" in str(exc) or _on_traceback(exc, "clip_grad_norm_", "torch"):
        return "torch"
    return ""


@dataclass(frozen=True)
class RaisedOnOverflow:
    """Facts of a raise on a gradient scaler's overflow step (see :meth:`AmpMonitor.raised_on_overflow`)."""

    step: int
    raised: str  # the exception's type name
    first_line: str  # the first sentence of its text
    scale: float
    bad: int  # non-finite gradients
    total: int  # gradients of the scaled backward
    nan: int
    inf: int
    names: str  # the non-finite gradients' names, as rendered
    unscaled: bool  # ``unscale_`` ran (and found Inf) before the raise
    seen: tuple[str, ...]  # what was checked finite: "loss", "batch"
    clipper: str  # "fabric", "torch" or "" (see _clipper_on_traceback)


#: How to keep running through an overflow step, by what raised on it.
_RAISED_FIX = {
    "fabric": "fabric.clip_gradients(model, optimizer, max_norm=..., error_if_nonfinite=False): it unscales "
    "first, and the optimizer step skips an overflow step by itself.",
    "torch": "scaler.unscale_(optimizer), then torch.nn.utils.clip_grad_norm_(..., error_if_nonfinite=False), "
    "then scaler.step(optimizer): it skips the step when the gradients are non-finite.",
    "": "do not stop on non-finite gradients under a GradScaler: scaler.step(optimizer) skips those steps.",
}


def raised_on_overflow_explanation(f: RaisedOnOverflow) -> Explanation:
    """The words of a raise on an overflow step."""
    seen = f.seen
    finite = f"; the {' and the '.join(seen)} {'were' if len(seen) > 1 else 'was'} finite" if seen else ""
    fix = _RAISED_FIX[f.clipper]
    if f.clipper == "torch" and not f.unscaled:
        fix += " The gradients were still scaled when clipped: unscale_ before clipping, or max_norm "
        fix += f"applies to gradients {f.scale:g} times too large."
    return Explanation(
        what=f"At step {f.step} the training code stopped with {f.raised} (\"{f.first_line}\") on the "
        "gradient scaler's overflow, a normal event, not a NaN incident: "
        f"{f.bad} of {f.total} gradients of the scaled backward (loss scale {f.scale:g}) held "
        f"{f.nan} NaN, {f.inf} Inf ({f.names}){finite}.",
        why="at the start of fp16 training the scaler overflows a few times while it finds "
        "its scale, and scaler.step() drops such an update and lowers the scale; raising on it ends a "
        "healthy run.",
        fix=fix,
    )


def scaler_backoff(scaler: Any) -> float:
    return float(getattr(scaler, "_backoff_factor", 0.5))


def _steps_between(before: float, after: float, backoff: float, factors: list[float]) -> int:
    """k such that ``after == before * factor * backoff**k`` for one of ``factors``; 0 if none fits."""
    for factor in factors:
        start = before * factor
        if start <= 0:
            continue
        k = math.log(after / start) / math.log(backoff)
        if k > -1e-6 and abs(k - round(k)) < 1e-3:
            return round(k)
    return 0


def _unscale_norms(stats: StepStats, scale: float, per_layer: bool) -> None:
    if not scale or not math.isfinite(scale) or scale == 1.0:
        return
    stats.extra["grad_scale"] = scale
    stats.norms = [v / scale for v in stats.norms]
    stats.total_norm = total_norm(stats.norms)
    if per_layer and stats.layer_norms:
        stats.layer_norms = layer_norms(stats.modules, stats.norms)


def _blank(stats: StepStats) -> None:
    """An overflow step's gradients are garbage the scaler throws away: nothing in them to check."""
    stats.names = []
    stats.modules = []
    stats.norms = []
    stats.total_norm = 0.0
    stats.layer_norms = {}
    stats.none_grad = ()
    stats.nonfinite = ()
    stats.nan_counts = {}
    stats.inf_counts = {}
    stats.overflow_norm = ()
    stats.loss_nonfinite = False
    stats.extra["amp_overflow_step"] = True


def _is_scaler(obj: Any) -> bool:
    cls = getattr(getattr(torch, "amp", None), "GradScaler", None)
    return cls is not None and isinstance(obj, cls)


#: Checks on which a plain loop's call stack is searched for a GradScaler: the first SCAN_FIRST, then every
#: SCAN_EVERY-th.
SCAN_FIRST = 16
SCAN_EVERY = 32

#: Code objects named like GradScaler's stepping methods, and whether their ``self`` was a GradScaler when
#: first seen: a training loop's own ``step()`` is looked at once, not every step (``f_locals`` builds a dict).
_STEP_CODES: dict[Any, bool] = {}


def _scaler_on_traceback(exc: BaseException, optimizers: list[Any], depth: int = 64) -> Any:
    """A GradScaler held by a frame of ``exc``'s traceback (exception path only): a variable of the user's
    code (the loop's ``scaler``, local or global), or the ``scaler`` of a frame's ``self`` or of its
    precision plugin (Fabric, its strategy, Lightning's plugin). One that unscaled a watched optimizer
    first."""
    found = _scalers_held(frame for frame, _line in traceback_entries(exc, depth))
    ids = {id(o) for o in optimizers}
    return next((s for s in found if ids & set(s._per_optimizer_states)), found[0] if found else None)


def _on_traceback(exc: BaseException, function: str, package: str) -> bool:
    """Whether ``package``'s ``function`` is on ``exc``'s traceback."""
    return any(
        frame.f_code.co_name == function and str(frame.f_globals.get("__name__", "")).startswith(package)
        for frame, _line in traceback_entries(exc)
    )


def _scaler_in_callers(depth: int) -> Any:
    """The one GradScaler that scaled a loss held by a local or global variable of the calling frames (at
    close: the training loop's ``scaler``), or None."""
    return _one_scaler(_callers(sys._getframe(1), depth))


def _one_scaler(frames: Iterable[Any]) -> Any:
    found = [s for s in _scalers_held(frames) if getattr(s, "_scale", None) is not None]
    return found[0] if len(found) == 1 else None


def scaler_of_training_thread(depth: int = 32) -> Any:
    """From a backward hook: the one GradScaler the loop that called ``backward()`` holds. On the CPU the hook
    runs on that thread, below the loop's frames; a GPU's backward runs on autograd's own thread, so the
    main thread's frames (the loop, waiting in ``backward()``) are looked at then."""
    found = _one_scaler(_callers(sys._getframe(1), depth))
    if found is None and threading.current_thread() is not threading.main_thread():
        frame = sys._current_frames().get(threading.main_thread().ident or -1)
        found = _one_scaler(_callers(frame, depth)) if frame is not None else None
    return found


def _callers(frame: Any, depth: int) -> Iterator[Any]:
    """``frame`` and up to ``depth - 1`` of its callers."""
    for _ in range(depth):
        if frame is None:
            return
        yield frame
        frame = frame.f_back


def _scalers_held(frames: Iterable[Any]) -> list[Any]:
    """The GradScalers these frames hold, each once: a variable of the user's code (local, or a script's
    module-level one used in a function), or the ``scaler`` of a frame's ``self`` or of its precision plugin
    (Fabric, its strategy, Lightning's plugin)."""
    found: list[Any] = []
    for frame in frames:
        values = list(frame.f_locals.values())
        if not library_frame(frame):
            values += list(frame.f_globals.values())
        owner = frame.f_locals.get("self")
        try:
            for holder in (owner, getattr(owner, "precision", None), getattr(owner, "_precision", None)):
                values.append(getattr(holder, "scaler", None))
        except Exception:  # noqa: BLE001, S110 - a property that fails: no scaler there
            pass
        for v in values:  # a script's module-level frame holds its variables twice (locals are its globals)
            if _is_scaler(v) and all(v is not s for s in found):
                found.append(v)
    return found


def _scaler_in_stack(depth: int = 32) -> Any:
    """The GradScaler whose ``step()`` is calling the optimizer right now, if any."""
    frame: Any = sys._getframe(2)
    codes = _STEP_CODES
    for _ in range(depth):
        if frame is None:
            return None
        code = frame.f_code
        if code.co_name in ("step", "_maybe_opt_step"):
            known = codes.get(code)
            if known is not False:
                owner = frame.f_locals.get("self")
                if _is_scaler(owner):
                    codes[code] = True
                    return owner
                if known is None:
                    if len(codes) >= 256:
                        codes.clear()
                    codes[code] = False
        frame = frame.f_back
    return None
