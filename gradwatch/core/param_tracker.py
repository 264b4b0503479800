"""Keeping the parameter index current, and finding the trainable tensors it does not hold.

The index (:class:`gradwatch.core.params.ParamIndex`) is rebuilt only when the parameter set changes: a
module or parameter registered on the watched model (process-wide registration hooks tell us, without a
per-step scan), an optimizer's param groups grown or shrunk, a trainable flag turned. Next to it, the
tracker finds what the index cannot hold: tensors trained without being registered, layers built inside
``forward()``, and gradients the training code dropped on purpose.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from gradwatch.core.failures import internal_warning
from gradwatch.core.grad_gates import FunctionGates, Gate
from gradwatch.core.params import OptimizerParams, ParamIndex
from gradwatch.core.stats import StepStats
from gradwatch.core.weak import weak_method
from gradwatch.diagnose.escalation import Escalation

#: How the engine finds an attached extension by type (``Engine.extension``).
FindExtension = Callable[[type[Escalation]], "Escalation | None"]


def optimizer_signature(opt: torch.optim.Optimizer) -> tuple[int, ...]:
    """The sizes of an optimizer's param groups: a change means parameters were added or removed."""
    return tuple(len(g["params"]) for g in opt.param_groups)


class ParamTracker:
    """Watches the parameter set of one run's model and optimizers.

    Args:
        index: The run's parameter index, rebuilt in place.
        optimizers: The watched optimizers.
        owner: Whose internal failures these are (the engine): reported once per run.
    """

    def __init__(self, index: ParamIndex, optimizers: list[torch.optim.Optimizer], owner: Any) -> None:
        self.index = index
        self.optimizers = optimizers
        self.owner = owner
        self.dirty = False
        self.first_check = [True] * max(1, len(optimizers))
        self._group_signature = [optimizer_signature(o) for o in optimizers]
        # Unregistered trainable tensors found at a check: (name, tensor, how, its grad, grad version).
        self.unregistered_seen: list[tuple[str, torch.Tensor, str, torch.Tensor, int]] = []
        self.forward_scans = 0  # the first two checked steps look for layers built inside forward()
        self._reached: dict[int, bool] = {}  # id(param) -> the graph of the step it lacked a gradient reached it
        self.gates = FunctionGates()  # reached only through a custom Function: returned None, or dropped?
        self._forward_params: list[tuple[weakref.ref[torch.Tensor], tuple[int, ...]]] = []
        self.hooks: list[Any] = []

    def watch_registrations(self) -> None:
        """Process-wide hooks that mark the index dirty when the model registers a parameter or module.
        They hold the tracker weakly and go with it: a run never closed must not keep its model alive, nor
        slow down every later module registration."""
        reg = torch.nn.modules.module
        for register, method in (
            (reg.register_module_parameter_registration_hook, "_on_param_registered"),
            (reg.register_module_module_registration_hook, "_on_module_registered"),
        ):
            handle = register(weak_method(self, method))
            self.hooks.append(handle)
            weakref.finalize(self, handle.remove)

    def close(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks = []
        self.gates.close()

    def _on_param_registered(self, module: nn.Module, name: str, param: Any) -> None:
        if id(module) in self.index.module_name:
            self.dirty = True

    def _on_module_registered(self, module: nn.Module, name: str, submodule: Any) -> None:
        if id(module) in self.index.module_name:
            self.dirty = True

    def refresh(self) -> bool:
        """Rebuild the index if the parameter set changed since the previous check; whether it did."""
        changed = self.dirty or self.index.unheld_trainable_changed()
        for i, o in enumerate(self.optimizers):
            sig = optimizer_signature(o)
            if sig != self._group_signature[i]:
                self._group_signature[i] = sig
                changed = True
        if changed:
            self.dirty = False
            self.index.rebuild()
        return changed

    def describe(
        self, stats: StepStats, op: OptimizerParams, none: list[str], changed: bool, find: FindExtension
    ) -> None:
        """What the tracker knows of this step, into ``stats``: whether it is the optimizer's first check,
        trainable parameters no optimizer holds, unregistered ones, and gradients dropped on purpose."""
        i = stats.optimizer_index
        first = stats.first_check = self.first_check[i]
        self.first_check[i] = False
        if first or changed:
            stats.not_in_optimizer = self.unheld_with_grads()
        extra = stats.extra
        if first or changed or self.unregistered_seen:
            extra["unregistered"] = self.unregistered(first or changed, find)
        elif self.forward_scans < 2:
            extra["unregistered"] = self.built_in_forward(find)
        if self.gates.watching:
            self.gates.settle()  # the backward passes since the previous check have been seen
        if none:
            extra["member_of"] = self.index.member_of  # none_grad: experts, LayerDrop layers, task heads
            dropped = self.grads_dropped(op, none, find)
            if dropped:
                extra["grad_dropped"] = dropped
            blocked, pending = self.grads_blocked(op, none)
            if blocked:
                extra["grad_blocked"] = blocked
            if pending:
                extra["grad_blocked_pending"] = pending

    def unheld_with_grads(self) -> tuple[str, ...]:
        """Trainable model parameters no watched optimizer holds that the backward reached. Those it did not
        reach are no forgotten layer: an EMA/mean teacher left requires_grad=True, run under no_grad and
        updated by hand (had it been trained, they would have gradients now)."""
        names = self.index.not_in_optimizer
        if not names:
            return ()
        wanted = set(names)
        return tuple(n for n, p in self.index.model_params if n in wanted and p.grad is not None)

    def unregistered(self, scan: bool, find: FindExtension) -> list[tuple[str, str]]:
        """Trainable tensors the model uses but never registered (see ``ParamIndex.unregistered``) whose
        gradient moved since the previous check: the scan's candidates are confirmed one check later."""
        try:
            confirmed = [
                (n, how)
                for n, t, how, g, version in self.unregistered_seen
                if t.grad is not None and (t.grad is not g or t.grad._version != version)
            ]
            self.unregistered_seen = []
            if scan:
                self.unregistered_seen = [
                    (n, t, how, t.grad, t.grad._version) for n, t, how in self.index.unregistered()
                ]
            return confirmed + self.built_in_forward(find)
        except Exception as exc:  # noqa: BLE001 - a model with odd attributes must not stop the check
            internal_warning("unregistered-parameter scan", exc, owner=self.owner)
            self.unregistered_seen = []
            return []

    def built_in_forward(self, find: FindExtension) -> list[tuple[str, str]]:
        """Parameters a layer built inside forward() trains through: on each of the first two checked steps,
        the ``nn.Parameter`` leaves of the outputs' graph the model does not own; reported when the second
        step's are new tensors of the shapes the first step's had (created anew at every forward)."""
        if self.forward_scans >= 2:
            return []
        self.forward_scans += 1
        esc = find(Escalation)
        if esc is None:
            return []
        known = {id(p) for _, p in self.index.model_params} | self.index.held_ids
        found = esc.unowned_params(known)
        before, self._forward_params = self._forward_params, [(weakref.ref(p), tuple(p.shape)) for p in found]
        if self.forward_scans < 2 or not before:
            return []
        shapes = {shape for _ref, shape in before}
        fresh = [p for p in found if tuple(p.shape) in shapes and all(ref() is not p for ref, _s in before)]
        return [(f"<parameter {tuple(p.shape)} created in forward>", "forward") for p in fresh]

    def grads_dropped(self, op: OptimizerParams, none: list[str], find: FindExtension) -> frozenset[str]:
        """Of ``none`` (trainable, no gradient at the step), those the step's graph reached: backward gave them
        a gradient that the training code then set to None on purpose (DINO's cancel_gradients_last_layer
        in its first epoch). A walk of the step's graph for parameters not asked about before; cached.
        Those it reaches only through a custom autograd Function go to ``gates``, which tells at the next
        backward whether the Function's backward returned None for them or the gradient was dropped."""
        known = self._reached
        by_name = dict(zip(op.names, op.params))
        ask = [by_name[n] for n in none if n in by_name and id(by_name[n]) not in known]
        if ask:
            esc = find(Escalation)
            leaves = esc.gated_leaves() if esc is not None else None
            if leaves is not None:
                gate_of: dict[int, Gate | None] = {id(v): gate for v, gate in leaves}
                for p in ask:
                    known[id(p)] = id(p) in gate_of
                    gate = gate_of.get(id(p))
                    if gate is not None:
                        self.gates.suspect(p, gate)
        return frozenset(
            n for n in none if n in by_name and known.get(id(by_name[n])) and not self.gates.holds(id(by_name[n]))
        )

    def grads_blocked(self, op: OptimizerParams, none: list[str]) -> tuple[dict[str, Gate], frozenset[str]]:
        """Of ``none``: those a custom Function's backward returned None for (name -> its node), and those
        still watched until the next backward (see :class:`gradwatch.core.grad_gates.FunctionGates`)."""
        blocked: dict[str, Gate] = {}
        pending: list[str] = []
        if not self.gates.watching and not self.gates.blocked:
            return blocked, frozenset()
        by_name = dict(zip(op.names, op.params))
        for n in none:
            p = by_name.get(n)
            if p is None or not self.gates.holds(id(p)):
                continue
            gate = self.gates.blocked.get(id(p))
            if gate is None:
                pending.append(n)
            else:
                blocked[n] = gate
        return blocked, frozenset(pending)
