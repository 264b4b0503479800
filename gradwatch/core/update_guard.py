"""Skipping an update exactly: gradients set aside before ``optimizer.step()`` and put back after it.

``grad.zero_()`` would not do: momentum and weight decay still move the weights. Every parameter's ``.grad``
is set to None instead, and the optimizer state entries are snapshotted (shallow) so that closure optimizers
such as LBFGS, which write their state even for a step without gradients, leave no trace either.
"""

from __future__ import annotations

from typing import Any

import torch

from gradwatch.core.params import ParamIndex


class UpdateGuard:
    """Suppresses the next update of an optimizer and restores its gradients and state afterwards."""

    def __init__(self, index: ParamIndex) -> None:
        self.index = index
        self._suppressed: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        self._suppressed_state: list[tuple[torch.optim.Optimizer, dict[Any, Any]]] = []

    def snapshot_state(self, opt_index: int) -> dict[Any, Any]:
        """Shallow copy of the optimizer state entries of ``opt_index`` (for an exact skip)."""
        op = self.index.per_optimizer[opt_index]
        if op.optimizer is None:
            return {}
        state = op.optimizer.state
        return {p: dict(state[p]) for p in op.params if p in state}

    def suppress(self, opt_index: int, state_snapshot: dict[Any, Any] | None = None) -> None:
        """Make the next ``optimizer.step()`` a no-op: every parameter's ``.grad`` is set to None."""
        op = self.index.per_optimizer[opt_index]
        for p in op.params:
            self._suppressed.append((p, p.grad))
            p.grad = None
        opt = op.optimizer
        if opt is None:
            return
        snap = state_snapshot if state_snapshot is not None else self.snapshot_state(opt_index)
        self._suppressed_state.append((opt, {"known": snap, "params": list(op.params)}))

    def restore(self) -> None:
        """Undo :meth:`suppress` after the (no-op) step."""
        for p, g in self._suppressed:
            p.grad = g
        self._suppressed = []
        for opt, snap in self._suppressed_state:
            known = snap["known"]
            for p in snap["params"]:
                if p in known:
                    opt.state[p] = known[p]
                elif p in opt.state:
                    del opt.state[p]
        self._suppressed_state = []
