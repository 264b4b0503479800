"""The shared engine: observe -> check -> act -> report, once per optimizer step.

Both ways in (``gradwatch.watch`` for plain loops, ``GradWatchCallback`` for Lightning) are thin shells
that call :meth:`Engine.check_step` right before an optimizer update and :meth:`Engine.step_done` after it.

The engine is the one object the integrations and extensions talk to; it composes the parts that do the
work: the reporters (:mod:`gradwatch.report.build`, :mod:`gradwatch.report.scalars`), the extension bus
(:mod:`gradwatch.core.extension_bus`), the parameter tracker (:mod:`gradwatch.core.param_tracker`), the loss
ledger (:mod:`gradwatch.core.loss_ledger`), the step pipeline (:mod:`gradwatch.core.step_pipeline`), the
policy (:mod:`gradwatch.core.policy`), the update guard (:mod:`gradwatch.core.update_guard`), the closure
guard (:mod:`gradwatch.core.closure_guard`) and the exception explainer (:mod:`gradwatch.core.explain`).
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import replace
from typing import Any, Literal, TypeVar

import torch
from torch import nn

from gradwatch import checks as _checks
from gradwatch.core.closure_guard import ClosureGuard
from gradwatch.core.config import Config
from gradwatch.core.explain import exception_findings
from gradwatch.core.extension_bus import ExtensionBus
from gradwatch.core.failures import internal_warning
from gradwatch.core.findings import Finding, GradWatchError
from gradwatch.core.held import HeldFindings
from gradwatch.core.history import History
from gradwatch.core.loss_ledger import LossLedger
from gradwatch.core.param_tracker import ParamTracker
from gradwatch.core.params import OptimizerParams, ParamIndex
from gradwatch.core.policy import Verdict, decide, error_text, needs_incident, too_many_skips
from gradwatch.core.run_state import load_state, state_of, summary_of
from gradwatch.core.stats import StepStats, SyncBatch, queue_all_norms, queue_grad_norms
from gradwatch.core.step_pipeline import Gathered, StepContext, fill, fold_restated, gather, run_checks
from gradwatch.core.update_guard import UpdateGuard
from gradwatch.observe.preclip import BackwardNorms
from gradwatch.report.build import build_reporters
from gradwatch.report.jsonl import new_run_id
from gradwatch.report.scalars import NormSample, StepScalars
from gradwatch.report.summary import RunSummary

__all__ = ["NONFINITE_KINDS", "Decision", "Engine"]

_E = TypeVar("_E")

Decision = Literal["ok", "skip"]

#: Kinds that the ``on_nonfinite`` policy acts on.
NONFINITE_KINDS = ("nonfinite_grad", "nonfinite_loss")


class Engine:
    """One run's gradwatch state: parameter index, history, findings, counters, reporters.

    Args:
        model: The model whose parameters are watched (may be None for optimizer-only use).
        optimizers: The watched optimizers.
        config: Validated configuration.
        tb_writer: An existing SummaryWriter to write into (Lightning's logger); else ``config.log_dir``.
        records_dir: Where ``gradwatch.jsonl`` and incident reports go when there is neither ``tb_writer`` nor
            ``config.log_dir`` (the directory of a Lightning run's other logger).
        rank_zero: Whether this process reports (console/TensorBoard/JSON lines).
    """

    def __init__(
        self,
        model: nn.Module | None,
        optimizers: list[torch.optim.Optimizer],
        config: Config,
        *,
        tb_writer: Any = None,
        rank_zero: bool = True,
        tb_log_dir: str | None = None,
        run_id: str | None = None,
        records_dir: str | None = None,
    ) -> None:
        self.config = config
        self.model = model
        self.optimizers = list(optimizers)
        #: The "run" of gradwatch.jsonl records (a Lightning callback's across the fits of one Trainer); kept
        #: in checkpoints, so a resumed run continues its own records.
        self.run_id = run_id or new_run_id()
        self.rank_zero = rank_zero
        self.index = ParamIndex(model, self.optimizers)
        self.history = History(window=config.window)
        self.findings: list[Finding] = []
        self.kind_counts: Counter[str] = Counter()
        self.steps_checked = 0
        self.steps_skipped = 0
        self.consecutive_skips = 0
        self.step_counts = [0] * max(1, len(self.optimizers))
        #: Steps per optimizer since this engine was built (``step_counts`` goes on from a checkpoint's).
        self.run_step_counts = [0] * len(self.step_counts)
        #: The optimizer steps taken when the latest checked step was found non-finite: an exception on those
        #: same gradients before the update (a clipping hook that raises after the check) is reported already.
        self.blocked_at = -1
        self._explained: tuple[tuple[int, str], Finding | None] | None = None  # the last explained exception
        #: Added to every finding's ``data`` (e.g. ``{"rank": 1}`` in a distributed run).
        self.finding_tags: dict[str, Any] = {}
        #: Called with every loss tensor given to :meth:`observe_loss`, before it is detached (O(1) each).
        self.loss_observers: list[Any] = []
        self.ledger = LossLedger(self.loss_observers)
        self.bus = ExtensionBus(self)
        self.extensions: list[Any] = self.bus.items
        self.param_tracker = ParamTracker(self.index, self.optimizers, owner=self)
        self.update_guard = UpdateGuard(self.index)
        self.closure_guard = ClosureGuard(self)
        self._check_modules = _checks.discover()
        #: Set by an integration whose check runs before code that may clip (Lightning): findings worded by
        #: whether the update is clipped wait for the step's final gradients (see gradwatch.core.held).
        self.hold_clipped_words = False
        self._held = HeldFindings(self._check_modules.rewords)
        self._pending: tuple[StepContext, list[tuple[int, list[int]]], int] | None = None
        self._scalars = StepScalars(config.layer_every, several_optimizers=len(self.optimizers) > 1)
        self._norm_sample = NormSample()
        self._closed = False
        #: Set when an exception ends the run (close() then reports nothing about what the run did not reach).
        self.interrupted = False
        self.started = time.time()
        self.reporters, self.log_dir = build_reporters(
            config, rank_zero=rank_zero, run_id=self.run_id, tb_writer=tb_writer, tb_log_dir=tb_log_dir,
            records_dir=records_dir,
        )
        if model is not None:
            self.param_tracker.watch_registrations()

    # -- extensions --------------------------------------------------------------------------------
    def add_extension(self, ext: Any) -> Any:
        """Attach an extension (see :class:`Extension`); one that cannot attach is reported and left out."""
        return self.bus.add(ext)

    def extension(self, cls: type[_E]) -> _E | None:
        """The attached extension of type ``cls`` (or a subclass), or None: extensions find each other here."""
        return self.bus.find(cls)

    # -- losses and backward passes (see LossLedger) -------------------------------------------------
    def observe_loss(self, loss: torch.Tensor) -> None:
        """Remember a loss of the current step (no sync: read with the step's statistics)."""
        self.ledger.observe(loss)

    def backward_reached(self) -> None:
        """A backward pass reached the gradients: the losses observed so far are its (or earlier) ones."""
        self.ledger.backward_reached()

    def gradients_cleared(self) -> None:
        """The gradients were cleared (``zero_grad``) since the latest backward pass and no optimizer step
        took them: the losses observed up to that backward went with gradients nobody used."""
        self.ledger.gradients_cleared()

    def step_dropped(self) -> None:
        """A GradScaler dropped a step since the latest backward pass (no optimizer step ran): the passes
        counted so far were that step's, and a zero_grad() after it is the usual one before a step."""
        self.ledger.step_taken()

    def drop_losses(self) -> None:
        """Forget the observed losses (a step not checked, or one whose check failed)."""
        self.ledger.drop()

    @property
    def cleared_between_backwards(self) -> bool:
        """Gradients were cleared between two backward passes since the previous check (single optimizer)."""
        return self.ledger.cleared_between_backwards

    @cleared_between_backwards.setter
    def cleared_between_backwards(self, value: bool) -> None:
        self.ledger.cleared_between_backwards = value

    # -- the step ----------------------------------------------------------------------------------
    def should_check(self, opt_index: int, step: int | None = None) -> bool:
        s = self.step_counts[opt_index] if step is None else step
        return not self._closed and s % self.config.every == 0

    def check_step(
        self, opt_index: int = 0, step: int | None = None, *, due: bool | None = None, closure: bool = False
    ) -> Decision:
        """Run the pipeline for optimizer ``opt_index`` before its update.

        ``step`` labels the findings (default: this optimizer's step count); ``due`` says whether the
        ``every`` cadence selects this step (default: ``step % every == 0``). Integrations whose step
        label counts several optimizers' steps (Lightning's ``global_step``) pass
        ``due=engine.should_check(opt_index)`` so each optimizer keeps its own cadence. ``closure``: the check
        runs inside the closure a ``step(closure)`` evaluates (LBFGS).

        Returns ``"skip"`` when the update must not be applied (the caller suppresses it, e.g. with
        :meth:`suppress_update`). Raises :class:`GradWatchError` under ``on_nonfinite="raise"`` or after
        ``max_skips`` consecutive skips. Any other failure inside gradwatch is reported once and the step
        proceeds as if gradwatch were not there.
        """
        if self._closed:
            return "ok"
        if self._held.holding:
            self.release_held(measure=False)  # not released at its update: the gradients now are another step's
        s = self.step_counts[opt_index] if step is None else step
        if not (s % self.config.every == 0 if due is None else due):
            self.drop_losses()
            return "ok"
        try:
            stats, findings = self._observe_and_check(opt_index, s, closure)
        except GradWatchError:
            raise
        except Exception as exc:  # noqa: BLE001 - never make training worse
            internal_warning("check_step", exc, owner=self)
            self.drop_losses()
            return "ok"
        if stats is None:
            return "ok"
        return self._act(stats, findings)

    def _observe_and_check(
        self, opt_index: int, step: int, closure: bool = False
    ) -> tuple[StepStats | None, list[Finding]]:
        """Observe (statistics queued, one read), check (pure checks, the incident path) one step."""
        changed = self.param_tracker.refresh()
        op = self.index.per_optimizer[opt_index]
        got = gather(op)
        stats = self._new_stats(op, got, opt_index, step, changed)
        if closure:
            stats.extra["closure_step"] = True
        ctx, norm_slots, loss_slot = self._queue(stats, op, got, opt_index)
        self.bus.call("before_sync", ctx)
        if self.config.deferred:
            previous = self._pending
            ctx.batch.start_read()
            ctx.grads = []  # read one step late: hold no gradient past the user's zero_grad
            self._pending = (ctx, norm_slots, loss_slot)
            if previous is None:
                return None, []
            ctx, norm_slots, loss_slot = previous  # the previous step's gradients are gone: no element counts
        return self._read_and_check(ctx, norm_slots, loss_slot)

    def _new_stats(self, op: OptimizerParams, got: Gathered, opt_index: int, step: int, changed: bool) -> StepStats:
        """The step's statistics before the read: who holds a gradient, and what the parameter tracker and
        the loss ledger know (``stats.extra``)."""
        stats = StepStats(
            step=step,
            optimizer_index=opt_index,
            names=got.names,
            modules=got.modules,
            none_grad=tuple(got.none),
            params_changed=changed,
            foreign=tuple(op.foreign) if self.index.model_trainable else (),
        )
        self.param_tracker.describe(stats, op, got.none, changed, self.extension)
        extra = stats.extra
        extra["params"] = got.params  # aligned with names; checks that need a parameter's flags read it
        extra["params_trainable"] = got.trainable
        extra["lookup_layers"] = self.index.lookup_layers
        extra["optimizer"] = op.optimizer
        if len(self.optimizers) > 1:
            extra["several_optimizers"] = True
        self.ledger.take_backward_passes(stats)
        return stats

    def _queue(
        self, stats: StepStats, op: OptimizerParams, got: Gathered, opt_index: int
    ) -> tuple[StepContext, list[tuple[int, list[int]]], int]:
        """Queue the step's device values (no sync): gradient norms, then the losses."""
        batch = SyncBatch()
        source = self.extension(BackwardNorms)
        # Plain loops: the norms backward produced, before the loop clipped them (see gradwatch.observe.preclip).
        norm_slots = source.backward_norms(opt_index, batch, got.grads, got.full) if source is not None else None
        if norm_slots is None and got.full:
            norm_slots = queue_all_norms(batch, op, got.grads)
        if norm_slots is None:
            norm_slots = queue_grad_norms(batch, got.grads)
        loss_slot, stale_slot = self.ledger.queue(batch, got.grads, stats)
        ctx = StepContext(
            stats, batch, got.grads, got.params, self, {"loss": loss_slot, "stale_loss": stale_slot}, norm_slots
        )
        return ctx, norm_slots, loss_slot

    def _read_and_check(
        self, ctx: StepContext, norm_slots: list[tuple[int, list[int]]], loss_slot: int
    ) -> tuple[StepStats, list[Finding]]:
        stats, batch = ctx.stats, ctx.batch
        fill(stats, batch, norm_slots, loss_slot, ctx.grads, self.config.per_layer)
        if ctx.slots.get("stale_loss", -1) >= 0:
            stats.extra["stale_losses"] = batch.resolve()[ctx.slots["stale_loss"]]  # already read: no sync
        self.bus.call("after_sync", ctx)
        findings = self._run_checks(stats)
        if needs_incident(stats):
            findings.extend(self.incident(stats, findings))
        return stats, findings

    def fill(
        self,
        stats: StepStats,
        batch: SyncBatch,
        norm_slots: list[tuple[int, list[int]]],
        loss_slot: int,
        grads: list[torch.Tensor],
    ) -> None:
        """Read ``batch`` into ``stats`` (the step's one device-to-host sync; see ``step_pipeline.fill``).
        Called by the engine's own check and by the pre-clip observer's."""
        fill(stats, batch, norm_slots, loss_slot, grads, self.config.per_layer)

    def _run_checks(self, stats: StepStats) -> list[Finding]:
        return run_checks(self._check_modules, stats, self.history, self.config, owner=self)

    def incident(self, stats: StepStats, findings: list[Finding]) -> list[Finding]:
        """A non-finite step, localized by the extensions before the update: their extra findings (those
        that restate one of ``findings`` take its place there)."""
        return fold_restated(findings, self.bus.on_incident(stats, findings))

    def _act(self, stats: StepStats, findings: list[Finding]) -> Decision:
        """Carry out the policy's verdict on a checked step, then record and report it."""
        verdict = decide(stats, self.config, self.consecutive_skips)
        self.consecutive_skips = verdict.consecutive_skips
        error = self._error(verdict, stats, findings)
        decision: Decision = "skip" if verdict.action == "skip" else "ok"
        if decision == "skip":
            self.steps_skipped += 1
        self.steps_checked += 1
        if verdict.blocked:
            self.blocked_at = sum(self.step_counts)
        self._record(stats, findings, skipped=decision == "skip")
        self.bus.call("after_step", stats, decision)
        if error is not None:
            self.release_held(measure=False)
            raise error
        return decision

    def _error(self, verdict: Verdict, stats: StepStats, findings: list[Finding]) -> GradWatchError | None:
        """The error that stops training on a ``raise`` or ``escalate`` verdict (a finding added for the latter)."""
        if verdict.action == "escalate":
            findings.append(too_many_skips(stats, self.history, self.config, verdict.consecutive_skips))
        elif verdict.action != "raise":
            return None
        return GradWatchError(error_text(stats, findings, verdict.reason), findings)

    def _record(self, stats: StepStats, findings: list[Finding], *, skipped: bool) -> None:
        try:
            self.history.record(stats, skipped=skipped)
            if stats.names and math.isfinite(stats.total_norm) and not skipped:
                self._norm_sample.add(stats.total_norm)
            for f in findings:
                self._keep(f)
            if findings and self.hold_clipped_words and not self.config.deferred and self._held.wants(stats, findings):
                self._held.hold(stats, findings)  # reported by release_held, at the update
            elif findings:
                self.reporters.findings(findings)
            scalars = self._scalars.of(stats, self.steps_skipped, self.kind_counts, every_value=bool(findings))
            self.reporters.call("scalars", stats.step, scalars)
        except Exception as exc:  # noqa: BLE001
            internal_warning("report", exc, owner=self)

    def release_held(self, measure: bool = True) -> None:
        """Report the findings held for the step's final gradients (see :mod:`gradwatch.core.held`), worded
        again when the gradients were clipped since the check. Called by the integration at the update
        (``measure``: the gradients now are that step's final ones)."""
        if not self._held.holding:
            return
        pairs = self._held.release(self.history, measure=measure, owner=self)
        reworded = {id(held): now for held, now in pairs if now is not held}
        if reworded:
            self.findings[:] = [reworded.get(id(f), f) for f in self.findings]
        try:
            self.reporters.findings([now for _, now in pairs])
        except Exception as exc:  # noqa: BLE001
            internal_warning("report", exc, owner=self)

    def add_finding(self, f: Finding) -> None:
        """Record and report a finding (also used by extensions and the integrations)."""
        self._keep(f)
        self.reporters.call("finding", f)

    def _keep(self, f: Finding) -> None:
        if self.finding_tags:
            f.data.update({k: v for k, v in self.finding_tags.items() if k not in f.data})
        self.findings.append(f)
        self.kind_counts[f.kind] += 1

    def step_done(self, opt_index: int = 0) -> None:
        """Count one optimizer step (applied, skipped, or skipped by an AMP scaler)."""
        self.step_counts[opt_index] += 1
        self.run_step_counts[opt_index] += 1
        self.ledger.step_taken()  # the next zero_grad() is the usual one before a step

    # -- skipping an update (see UpdateGuard) --------------------------------------------------------
    def suppress_update(self, opt_index: int, state_snapshot: dict[Any, Any] | None = None) -> None:
        """Make the next ``optimizer.step()`` a no-op: every parameter's ``.grad`` is set to None.

        ``grad.zero_()`` would not do: momentum and weight decay still move the weights. Optimizer state
        entries are snapshotted (shallow) so closure optimizers such as LBFGS leave no trace either.
        :meth:`restore_grads` puts the gradients back after the step.
        """
        self.update_guard.suppress(opt_index, state_snapshot)

    def snapshot_state(self, opt_index: int) -> dict[Any, Any]:
        """Shallow copy of the optimizer state entries of ``opt_index`` (for an exact skip)."""
        return self.update_guard.snapshot_state(opt_index)

    def restore_grads(self) -> None:
        """Undo :meth:`suppress_update` after the (no-op) step."""
        self.update_guard.restore()

    def guard_reevaluation(self, opt_index: int, loss: Any, evaluation: int, step: int | None = None,
                           *, large_loss: bool = False) -> bool:
        """A closure optimizer (LBFGS) evaluated the closure again within a checked step: are this
        evaluation's loss and gradients finite? Returns True when they are (or when gradwatch cannot tell).

        When they are not: a finding at this step (the first time in the run), and under
        ``on_nonfinite="skip"`` every gradient of the optimizer is set to None (LBFGS reads that as a zero
        gradient and ends its iterations, or its line search backs off when ``large_loss``, the caller's
        promise to hand back a large finite loss); ``"raise"`` raises :class:`GradWatchError`. One read per
        evaluation, next to the optimizer's own ``float(loss)`` of it.
        """
        if self._closed or self.config.deferred:
            return True
        return self.closure_guard.guard(opt_index, loss, evaluation, step, large_loss)

    # -- exceptions --------------------------------------------------------------------------------
    def explain_exception(self, exc: BaseException, step: int | None = None) -> Finding | None:
        """Diagnose an exception raised by the training code (autograd errors); never raises."""
        if isinstance(exc, GradWatchError):
            return None
        key = (id(exc), str(exc))
        if self._explained is not None and self._explained[0] == key:
            return self._explained[1]  # explained already (gw.explain(e), then re-raised out of the with block)
        try:
            s = self.step_counts[0] if step is None and self.step_counts else (step or 0)
            found = exception_findings(self, exc, s, self._forward_born)
        except Exception as e:  # noqa: BLE001
            internal_warning("explain_exception", e, owner=self)
            return None
        for f in found:
            self.add_finding(f)
        finding = found[0] if found else None
        self._explained = (key, finding)
        return finding

    def has_explained(self, exc: BaseException) -> bool:
        """Whether :meth:`explain_exception` explained this very exception last (an inner ``with`` block that
        exits first explains it before an outer one sees it)."""
        return self._explained is not None and self._explained[0] == (id(exc), str(exc))

    def _forward_born(self, exc: BaseException, step: int, anomaly: Finding) -> list[Finding]:
        """Anomaly mode stopped backward on a loss that was NaN/Inf already: the NaN was born in the forward
        pass, and the backward op anomaly mode names only carries it. Localized like a checked step's
        incident (the batch named as nonfinite_input, or the forward op as nan_origin, by a replay); the
        anomaly finding stays when that names nothing."""
        loss = anomaly.data.get("loss")
        stats = StepStats(step=step, loss=loss if isinstance(loss, float) else math.nan, loss_nonfinite=True)
        stats.extra["raised"] = type(exc).__name__
        stats.extra["anomaly_nan"] = True  # a numerical error, raised with the Trainer intact: replayable
        self.drop_losses()
        found = [f for f in self.incident(stats, [anomaly]) if f.kind in ("nan_origin", "nonfinite_input")]
        if not any(f.kind == "nonfinite_input" or f.data.get("op") or f.data.get("source") for f in found):
            return [anomaly, *found]
        note = (
            f"Anomaly mode stopped backward at {anomaly.op}, the first backward op that returned NaN: it only "
            "carried the NaN of the loss (anomaly mode checks backward outputs only). Training stopped with "
            "PyTorch's error."
        )
        out = []
        for f in found:
            f.data.update(raised=True, anomaly_error=str(exc), anomaly_op=anomaly.op)
            told = f.explanation if f.kind == "nan_origin" else None
            out.append(replace(f, explanation=replace(told, what=f"{told.what}\n{note}")) if told and told.fix else f)
        return out

    # -- end ---------------------------------------------------------------------------------------
    def summary(self) -> RunSummary:
        """The run's summary so far (what the console prints at close)."""
        return summary_of(self, self._norm_sample.values)

    def close(self) -> None:
        """Flush pending statistics, remove hooks, print the summary, close writers. Idempotent."""
        if self._closed:
            return
        self.release_held(measure=False)
        self.bus.call("before_close")
        if self._pending is not None:
            try:
                ctx, norm_slots, loss_slot = self._pending
                self._pending = None
                self.fill(ctx.stats, ctx.batch, norm_slots, loss_slot, [])
                self.bus.call("after_sync", ctx)
                self._record(ctx.stats, self._run_checks(ctx.stats), skipped=False)
            except Exception as exc:  # noqa: BLE001
                internal_warning("close (deferred step)", exc, owner=self)
        self._closed = True
        self.param_tracker.close()
        self.bus.call("close")
        summary = None
        try:
            summary = self.summary()
        except Exception as exc:  # noqa: BLE001
            internal_warning("summary", exc, owner=self)
        self.reporters.call("close", summary)

    @property
    def closed(self) -> bool:
        return self._closed

    def state_dict(self) -> dict[str, Any]:
        """Counters, findings, history and run id (kept in a Lightning checkpoint)."""
        return state_of(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`: counting goes on, and the records under the checkpoint's run id."""
        load_state(self, state)
