"""The losses of the step being built, and the backward passes that reached its gradients.

The integrations tell the engine of every observed loss, backward pass, ``zero_grad`` and dropped AMP step;
the ledger keeps them until the step is checked, then queues the losses into the step's one read
(:meth:`LossLedger.queue`) and hands over the backward-pass counts (:meth:`LossLedger.take_backward_passes`).
Losses whose gradients no update took (a skipped batch, a batch never backpropagated) are read with the next
step as *stale* losses, never held against its update.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any

import torch

from gradwatch.core.stats import StepStats, SyncBatch

#: Stale losses kept at most (the latest ones).
STALE_KEPT = 64


class LossLedger:
    """Losses observed since the previous check, and the backward passes since then.

    Args:
        observers: Called with every loss tensor given to :meth:`observe`, before it is detached (the
            engine's ``loss_observers``, shared, so observers added later are seen).
    """

    def __init__(self, observers: list[Callable[[torch.Tensor], Any]]) -> None:
        self.observers = observers
        self.losses: list[torch.Tensor] = []
        # Aligned with ``losses``: for a loss with a graph, a one-element list that a hook on its grad_fn sets
        # once a backward pass runs through it; None when gradwatch cannot tell (no graph).
        self.reached: list[list[bool] | None] = []
        # Losses of earlier backward passes whose gradients were cleared without an optimizer step (a
        # skipped batch), or of batches never backpropagated: read with the next step, never held against
        # its update. ``stale_unused`` counts those of the second kind (they come last).
        self.stale: list[torch.Tensor] = []
        self.stale_unused = 0
        self.mark = 0  # len(self.losses) when the latest backward pass reached the gradients
        #: Gradients were cleared between two backward passes since the previous check (single optimizer).
        self.cleared_between_backwards = False
        self.backwards = 0  # backward passes since the previous check
        self.cleared_backwards = 0  # backward passes since then that found the gradients cleared

    # -- what the integrations report ----------------------------------------------------------------
    def observe(self, loss: torch.Tensor) -> None:
        """Remember a loss of the current step (no sync: read with the step's statistics)."""
        if isinstance(loss, torch.Tensor):
            if loss.numel() == 0 or loss.is_meta:
                return  # no value to read: an empty batch, or a model on the meta device
            self.losses.append(loss.detach())
            self.reached.append(_reach_flag(loss))
            for observe in self.observers:
                observe(loss)
        elif isinstance(loss, numbers.Real) and not isinstance(loss, bool):
            self.losses.append(torch.tensor(float(loss)))
            self.reached.append(None)
        else:
            raise TypeError(
                f"observe_loss() takes the loss as a tensor or a number, got {type(loss).__name__}: {loss!r:.80}"
            )

    def backward_reached(self) -> None:
        """A backward pass reached the gradients: the losses observed so far are its (or earlier) ones."""
        self.mark = len(self.losses)
        self.backwards += 1

    def gradients_cleared(self) -> None:
        """The gradients were cleared since the latest backward pass and no optimizer step took them."""
        if self.backwards:
            self.cleared_between_backwards = True  # not the usual zero_grad() before a step's first backward
            self.cleared_backwards += 1
        mark, self.mark = self.mark, 0
        if mark:
            self.stale = (self.stale + self.losses[:mark])[-STALE_KEPT:]
            del self.losses[:mark]
            del self.reached[:mark]

    def step_taken(self) -> None:
        """An optimizer step (or a step a GradScaler dropped) took the gradients: the backward passes
        counted so far were that step's, and a zero_grad() after it is the usual one before a step."""
        self.backwards = 0
        self.cleared_backwards = 0
        self.cleared_between_backwards = False

    def drop(self) -> None:
        """Forget the observed losses (a step not checked, or one whose check failed)."""
        self.losses.clear()
        self.reached.clear()
        self.stale = []
        self.stale_unused = 0
        self.mark = 0

    # -- what the check takes --------------------------------------------------------------------------
    def take_backward_passes(self, stats: StepStats) -> None:
        """Put the backward-pass facts of this step into ``stats.extra`` and start counting anew."""
        if self.cleared_between_backwards:
            stats.extra["cleared_between_backwards"] = True
        # (backward passes of this step, how many of them found the gradients cleared by an earlier one's
        # zero_grad): every pass but the first cleared is zero_grad() inside an accumulation loop.
        stats.extra["backward_passes"] = (self.backwards, self.cleared_backwards)
        self.step_taken()

    def queue(self, batch: SyncBatch, grads: list[torch.Tensor], stats: StepStats) -> tuple[int, int]:
        """Queue this step's losses and the stale ones into ``batch``: ``(loss slot, stale slot)``, -1 for
        none. The ledger is empty afterwards."""
        if not self.losses and not self.stale:  # no loss observed (a loop without observe_loss): nothing to read
            self.reached = []
            self.mark = 0
            return -1, -1
        self._set_aside_unused()
        self.reached = []
        loss_slot = -1
        if self.losses:
            loss_slot = _queue_losses(batch, self.losses, grads)
            self.losses = []
        self.mark = 0
        stale_slot = -1
        if self.stale:
            device = grads[0].device if grads else self.stale[0].device
            stale = [l.float().mean().reshape(1).to(device, non_blocking=True) for l in self.stale]
            stale_slot = batch.add(torch.cat(stale))
            if self.stale_unused:
                stats.extra["stale_unused"] = self.stale_unused  # the last ones never reached a backward
            self.stale = []
            self.stale_unused = 0
        return loss_slot, stale_slot

    def _set_aside_unused(self) -> None:
        """The losses of this step that no backward pass ran through, while others were: batches the
        training code left out (``if torch.isnan(loss): continue`` before ``backward()``). Their NaN/Inf is
        no reason to skip the update made of the other batches. When no observed loss was reached (observed
        after its backward, or under a closure) nothing is moved: gradwatch cannot tell."""
        reached = self.reached
        if len(reached) != len(self.losses) or not any(r is not None and r[0] for r in reached):
            return
        unused = [l for l, r in zip(self.losses, reached) if r is not None and not r[0]]
        if unused:
            self.losses = [l for l, r in zip(self.losses, reached) if r is None or r[0]]
            self.stale = (self.stale + unused)[-STALE_KEPT:]
            self.stale_unused = min(len(unused), len(self.stale))


def _queue_losses(batch: SyncBatch, losses: list[torch.Tensor], grads: list[torch.Tensor]) -> int:
    first = losses[0]
    if len(losses) == 1 and first.dtype is torch.float32 and first.dim() == 0:
        return batch.add(first.reshape(1))  # the usual step: one scalar loss
    device = grads[0].device if grads else first.device
    means = [l.float().mean() for l in losses]
    means = [l if l.device == device else l.to(device, non_blocking=True) for l in means]
    return batch.add(torch.stack(means))


def _reach_flag(loss: torch.Tensor) -> list[bool] | None:
    """A flag a hook on ``loss.grad_fn`` sets when a backward pass runs through it (O(1): one hook on the
    loss's own node, none on the model). None for a loss with no graph, or when the hook cannot be placed."""
    node = loss.grad_fn
    if node is None:
        return None
    flag = [False]

    def reached(grad_outputs: Any) -> None:
        flag[0] = True

    try:
        node.register_prehook(reached)
    except Exception:  # noqa: BLE001 - a node that takes no hook: the loss counts as this step's
        return None
    return flag
