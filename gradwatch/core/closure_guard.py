"""Closure optimizers (LBFGS): each re-evaluation of the closure within a checked step is guarded.

The engine checks a step once, before ``optimizer.step()``; an optimizer driven by a closure evaluates it
again inside that step (a line search), and a NaN met there would reach the weights unchecked. The guard
reads each further evaluation's loss and gradients (one read, next to the optimizer's own ``float(loss)``)
and, when they are not finite, applies ``on_nonfinite`` to them.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from gradwatch.core.failures import internal_warning
from gradwatch.core.findings import Finding, GradWatchError
from gradwatch.core.params import ParamIndex
from gradwatch.core.policy import error_text
from gradwatch.core.stats import SyncBatch, count_nonfinite, queue_grad_norms, read_grad_norms

if TYPE_CHECKING:
    from gradwatch.core.engine import Engine

#: ``(first non-finite loss value, names of non-finite gradients, (NaN counts, Inf counts), gradients read)``
NonfiniteNow = tuple[float | None, list[str], tuple[dict[str, int], dict[str, int]], int]


def failed_trial_loss(loss: Any) -> Any:
    """What a guarded closure hands back for a non-finite re-evaluation (see
    :meth:`Engine.guard_reevaluation`): a finite loss far above any real one, shaped like ``loss``, which
    a line search reads as a failed trial and backs off from; float32 so it cannot overflow."""
    if isinstance(loss, torch.Tensor):
        return torch.full(loss.shape, 1e30, dtype=torch.float32, device=loss.device)
    return 1e30


def nonfinite_now(index: ParamIndex, opt_indices: list[int], losses: list[Any]) -> NonfiniteNow:
    """Off the hot path (a guarded re-evaluation, an exception): the first non-finite loss value among
    ``losses``, the names of the gradients of ``opt_indices`` that hold NaN/Inf with their counts, and
    how many gradients there are. One read, plus one for the counts when some are non-finite."""
    names, grads = _present_grads(index, opt_indices)
    batch = SyncBatch()
    slots = queue_grad_norms(batch, grads)
    loss_slot = _queue_live_losses(batch, losses)
    values = batch.resolve() if slots or loss_slot >= 0 else []
    norms = read_grad_norms(values, slots, len(grads)) if slots else []
    suspects = [i for i, v in enumerate(norms) if not math.isfinite(v)]
    counts = count_nonfinite(names, grads, suspects)
    bad = [names[i] for i in suspects if names[i] in counts[0] or names[i] in counts[1]]
    bad_loss = next((v for v in values[loss_slot] if not math.isfinite(v)), None) if loss_slot >= 0 else None
    return bad_loss, bad, counts, len(names)


def _queue_live_losses(batch: SyncBatch, losses: list[Any]) -> int:
    """The mean of each loss tensor that holds values, queued into ``batch``: its slot, or -1 for none."""
    live = [l for l in losses if isinstance(l, torch.Tensor) and l.numel() > 0 and not l.is_meta]
    return batch.add(torch.stack([l.detach().float().mean() for l in live])) if live else -1


def _present_grads(index: ParamIndex, opt_indices: list[int]) -> tuple[list[str], list[torch.Tensor]]:
    names: list[str] = []
    grads: list[torch.Tensor] = []
    for i in opt_indices:
        op = index.per_optimizer[i]
        for p, n in zip(op.params, op.names):
            if p.grad is not None:
                names.append(n)
                grads.append(p.grad)
    return names, grads


class ClosureGuard:
    """Guards the re-evaluations of a closure optimizer's step for one engine."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._reported: set[int] = set()  # optimizers whose non-finite re-evaluation was reported

    def guard(self, opt_index: int, loss: Any, evaluation: int, step: int | None, large_loss: bool) -> bool:
        """See :meth:`Engine.guard_reevaluation`."""
        engine = self.engine
        if evaluation == 2:
            try:
                self._closure_kept_gradients(opt_index, step)
            except Exception as exc:  # noqa: BLE001 - never make training worse
                internal_warning("closure zero_grad", exc, owner=engine)
        try:
            finding = self._reevaluation_finding(opt_index, loss, evaluation, step, large_loss)
        except Exception as exc:  # noqa: BLE001 - never make training worse
            internal_warning("guard_reevaluation", exc, owner=engine)
            return True
        if finding is None:
            return True
        policy = engine.config.on_nonfinite
        if policy != "warn":
            for p in engine.index.per_optimizer[opt_index].params:
                p.grad = None
        if opt_index not in self._reported:  # once per run: a line search may meet it every step
            self._reported.add(opt_index)
            engine.add_finding(finding)
        if policy == "raise":
            raise GradWatchError(error_text(None, [finding], "on_nonfinite='raise'"), [finding])
        return False

    def _closure_kept_gradients(self, opt_index: int, step: int | None) -> None:
        """The closure's second evaluation added its gradient onto the first one's: the closure does not
        clear them. Reported at this step, once (the next step's check would see the same)."""
        from gradwatch.observe.zero_grad import ZeroGradTracker

        engine = self.engine
        tracker, key = engine.extension(ZeroGradTracker), f"zero_grad_missing/{opt_index}"
        if tracker is None or engine.history.reported.get(key):
            return
        finding = tracker.closure_finding(opt_index, engine.step_counts[opt_index] if step is None else step)
        if finding is not None:
            engine.history.reported[key] = True
            engine.add_finding(finding)

    def _reevaluation_finding(self, opt_index: int, loss: Any, evaluation: int, step: int | None,
                              large_loss: bool) -> Finding | None:
        from gradwatch.checks import nonfinite

        engine = self.engine
        bad_loss, bad, counts, total = nonfinite_now(engine.index, [opt_index], [loss] if loss is not None else [])
        if not bad and bad_loss is None:
            return None
        opt = engine.index.per_optimizer[opt_index].optimizer
        return nonfinite.reevaluation(
            step=engine.step_counts[opt_index] if step is None else step,
            optimizer_index=opt_index,
            optimizer_name=type(opt).__name__ if opt is not None else "the optimizer",
            evaluation=evaluation,
            loss=bad_loss,
            bad_params=bad,
            counts=counts,
            total_params=total,
            policy=engine.config.on_nonfinite,
            returned_large_loss=large_loss and engine.config.on_nonfinite == "skip",
        )
