"""The pieces of one checked step that hold no state: gather, read, check, fold.

The engine composes them (``Engine._observe_and_check``): the gradients of the optimizer are gathered
(:func:`gather`), their norms and the losses are queued into one :class:`SyncBatch` and read back with the
step's one device-to-host sync (:func:`fill`), the pure checks run (:func:`run_checks`), and a non-finite
step's incident findings take the place of those they restate (:func:`fold_restated`).
"""

from __future__ import annotations

import itertools
import math
import operator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from gradwatch.core.config import Config
from gradwatch.core.failures import call_each, internal_warning
from gradwatch.core.findings import Finding
from gradwatch.core.history import History
from gradwatch.core.params import OptimizerParams
from gradwatch.core.stats import StepStats, SyncBatch, count_nonfinite, layer_norms, read_grad_norms, total_norm

if TYPE_CHECKING:
    from gradwatch.checks import CheckTable
    from gradwatch.core.engine import Engine

_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_GRAD = operator.attrgetter("grad")


@dataclass
class StepContext:
    """What extensions see of a step while it is being checked."""

    stats: StepStats
    batch: SyncBatch
    grads: list[torch.Tensor]
    params: list[torch.Tensor]
    engine: Engine
    slots: dict[str, int] = field(default_factory=dict)
    #: ``(batch slot, gradient indices)`` of the queued per-gradient norms (see ``queue_grad_norms``).
    norm_slots: list[tuple[int, list[int]]] = field(default_factory=list)


@dataclass
class Gathered:
    """The parameters of one optimizer that hold a gradient at this step (aligned lists), and the others."""

    grads: list[torch.Tensor]
    params: list[torch.Tensor]
    names: list[str]
    modules: list[str | None]
    #: Trainable parameters without a gradient (an empty local shard of FSDP1 has nothing to get: left out).
    none: list[str]
    #: Every parameter holds a gradient (the usual step: the index's own lists, which are never mutated).
    full: bool
    #: Every parameter in ``params`` requires grad: read here, while the parameters are in the cache, not after
    #: the norms have streamed every gradient through it (a pass over them then costs twice as much).
    trainable: bool = True


def gather(op: OptimizerParams) -> Gathered:
    """The gradients of optimizer ``op``'s parameters; no per-parameter branching on the usual step."""
    every_grad = list(map(_GRAD, op.params))
    # Not ``None in`` (that calls Tensor.__eq__) nor a generator (a Python frame per parameter): a C loop.
    if all(map(operator.is_not, every_grad, itertools.repeat(None))):
        return Gathered(every_grad, op.params, op.names, op.modules, [], True, all(map(_REQUIRES_GRAD, op.params)))
    out = Gathered([], [], [], [], [], False)
    for p, n, m, g in zip(op.params, op.names, op.modules, every_grad):
        if g is None:
            if p.requires_grad and p.numel():
                out.none.append(n)
        else:
            out.grads.append(g)
            out.params.append(p)
            out.names.append(n)
            out.modules.append(m)
            out.trainable = out.trainable and p.requires_grad
    return out


def fill(
    stats: StepStats,
    batch: SyncBatch,
    norm_slots: list[tuple[int, list[int]]],
    loss_slot: int,
    grads: list[torch.Tensor],
    per_layer: bool,
) -> None:
    """Read ``batch`` back (the step's one device-to-host sync) into ``stats``: norms, non-finite
    gradients (counted element-wise only when some norm is not finite) and the loss."""
    values = batch.resolve()
    norms = read_grad_norms(values, norm_slots, len(stats.names))
    stats.norms = norms
    total = stats.total_norm = total_norm(norms)
    # The total is finite exactly when every norm is (float64 sums of float32 norms cannot overflow).
    finite = math.isfinite(total)
    if per_layer:
        stats.layer_norms = layer_norms(stats.modules, norms, finite=finite)
    if not finite:
        _fill_nonfinite(stats, norms, grads)
    if loss_slot >= 0:
        lv = values[loss_slot]
        finite = [v for v in lv if math.isfinite(v)]
        stats.loss_nonfinite = len(finite) != len(lv)
        stats.loss = (sum(lv) / len(lv)) if lv else None


def _fill_nonfinite(stats: StepStats, norms: list[float], grads: list[torch.Tensor]) -> None:
    suspects = [i for i, v in enumerate(norms) if not math.isfinite(v)]
    if not suspects:
        return
    if not grads:  # read one step late: the gradients are gone, every suspect counts
        stats.nonfinite = tuple(stats.names[i] for i in suspects)
        return
    nan, inf = count_nonfinite(stats.names, grads, suspects)
    stats.nan_counts, stats.inf_counts = nan, inf
    bad = set(nan) | set(inf)
    stats.nonfinite = tuple(stats.names[i] for i in suspects if stats.names[i] in bad)
    stats.overflow_norm = tuple(stats.names[i] for i in suspects if stats.names[i] not in bad)


def run_checks(checks: CheckTable, stats: StepStats, history: History, config: Config, owner: Any) -> list[Finding]:
    """The step's checks (see :meth:`CheckTable.plan`), then their ``remember``; a check that fails is reported once."""
    plan = checks.plan(stats)

    def check_failed(i: int, exc: Exception) -> None:
        internal_warning(f"check {plan.check_names[i]}", exc, owner=owner)

    def remember_failed(i: int, exc: Exception) -> None:
        name = plan.remember_names[i]
        internal_warning(f"check {name}.remember", exc, owner=owner, key=f"check {name}")

    found = call_each(plan.checks, (stats, history, config), check_failed)
    call_each(plan.remembers, (stats, history), remember_failed)
    return list(itertools.chain.from_iterable(filter(None, found)))  # C loops: this runs every step


def fold_restated(findings: list[Finding], extra: list[Finding]) -> list[Finding]:
    """An incident finding with ``data["restates"]`` (a kind) takes the place, in ``findings``, of the step's
    finding of that kind; the other incident findings are returned."""
    for new in [f for f in extra if "restates" in f.data]:
        extra.remove(new)
        kind = new.data.pop("restates")
        at = next((i for i, f in enumerate(findings) if f.kind == kind and f.step == new.step), None)
        if at is not None:
            findings[at] = new
    return extra
