"""Observe: parameter norms and measured update-to-weight ratios, every N checked steps, in the step's one sync.

Gradient norms alone cannot say whether a gradient is large or small *for its layer*: that needs the scale
of the layer's weights. And what the optimizer does with a gradient (Adam rescales it, momentum smooths
it) only shows in the update it applies. This extension measures both, cheaply:

- every ``update_ratio_every`` checked steps it queues ``||p||`` per parameter (one fused
  ``_foreach_norm``) into the step's :class:`~gradwatch.core.stats.SyncBatch`, and keeps a fixed random sample
  of at most :data:`UPDATE_SAMPLE` elements of each parameter (``p_before``; small tensors whole);
- at the next checked step it queues ``||p_now - p_before||`` over the same elements (in place in the
  sample) and drops the sample. The ratio ``||p_after - p_before|| / ||p_before||`` per layer is the
  update-to-weight ratio, right for any optimizer (Adam, momentum, weight decay included); for tensors
  larger than the sample it is an estimate within a few percent.

Nothing is read back outside the step's single ``SyncBatch.resolve()``. No parameter is copied: the
samples cost O(number of parameter tensors) memory, for one step in every N.

What it adds to ``StepStats.extra`` (read by ``checks/exploding.py``, ``checks/vanishing.py`` and
``checks/update_ratio.py``):

- ``param_norms``: ``{layer: ||params of the layer||}`` on measuring steps;
- ``update_ratio``: ``{layer: ratio}`` on the step after a measuring step (divided by the number of
  optimizer steps in between when ``every > 1``);
- ``update_ratio_total``: the whole model's ratio, also measured on each of the first :data:`EARLY_UPDATES`
  checked steps (those early measurements give no per-layer ratios: layers are judged on the cadence);
- ``scalars``: ``gradwatch/update_ratio/<layer>`` for TensorBoard.

The names of those keys, and the helpers the magnitude checks share, live in :mod:`gradwatch.core.measured`
and :mod:`gradwatch.core.trend`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from gradwatch.core.measured import (
    EARLY_UPDATES,
    PARAM_NORMS,
    UPDATE_RATIO,
    UPDATE_TOTAL,
    UPDATE_WEIGHTS,
    WANT_PARAM_NORMS,
)
from gradwatch.core.stats import layer_norms, local_shards, queue_grad_norms, read_grad_norms

#: Elements of each parameter tensor kept to measure its update (fewer: all of them). The update-to-weight
#: ratio of a larger tensor is estimated from this fixed random sample of its elements: within a few
#: percent, for a check whose band spans five orders of magnitude, at O(1) memory per tensor.
UPDATE_SAMPLE = 4096

#: Consecutive elements per sampled run.
_RUN = 64

#: Sample positions per (numel, device), drawn once from a private generator (the user's RNG is untouched).
_SAMPLE_INDEX: dict[tuple[int, str], torch.Tensor] = {}


def _sample_index(numel: int, device: torch.device) -> torch.Tensor:
    key = (numel, str(device))
    idx = _SAMPLE_INDEX.get(key)
    if idx is None:
        # Random aligned runs of _RUN elements: spread over the whole tensor, yet few cache lines to touch.
        gen = torch.Generator().manual_seed(numel)
        starts = torch.randperm(numel // _RUN, generator=gen)[: UPDATE_SAMPLE // _RUN].sort().values * _RUN
        idx = (starts[:, None] + torch.arange(_RUN)[None, :]).reshape(-1).to(device)
        if len(_SAMPLE_INDEX) >= 256:
            _SAMPLE_INDEX.pop(next(iter(_SAMPLE_INDEX)))
        _SAMPLE_INDEX[key] = idx
    return idx


def sample_elements(p: torch.Tensor) -> torch.Tensor:
    """A flat copy of at most :data:`UPDATE_SAMPLE` elements of ``p`` (always the same ones for its size)."""
    t = _local(p.detach())
    if t.numel() <= UPDATE_SAMPLE:
        return t.reshape(-1).clone()
    return torch.take(t, _sample_index(t.numel(), t.device))  # no full copy, any memory layout


def _local(t: torch.Tensor) -> torch.Tensor:
    """This process's shard of a sharded (DTensor) parameter; any other tensor as it is."""
    return local_shards([t])[0]


def _scale(p: torch.Tensor, sample: torch.Tensor) -> float:
    """sqrt(elements / sampled elements): turns the norm of ``p``'s sample into an estimate of its norm."""
    return math.sqrt(_local(p).numel() / max(1, sample.numel()))


@dataclass
class _Snapshot:
    params: list[torch.Tensor]
    before: list[torch.Tensor]  # sampled elements (see sample_elements)
    modules: list[str | None]
    step: int
    #: sqrt(numel / sampled) per tensor: scales a sample's norm to an estimate of the whole tensor's.
    scales: list[float]
    early: bool = False


@dataclass
class _Inflight:
    param_slots: list[tuple[int, list[int]]] | None
    param_modules: list[str | None]
    update_slots: list[tuple[int, list[int]]] | None
    before_slots: list[tuple[int, list[int]]] | None
    update_modules: list[str | None]
    update_steps: int
    update_scales: list[float] = field(default_factory=list)
    early: bool = False  # measured on one of the first EARLY_UPDATES checks only (not the regular cadence)


@dataclass(frozen=True, slots=True)
class MeasurementPlan:
    """What one checked step measures of the weights (see :func:`plan_measurement`)."""

    norms: bool  # queue the per-layer norms of the weights
    sample: bool  # keep a sample of the weights, to measure their update at the next checked step
    early: bool  # a sample off the cadence (one of the first EARLY_UPDATES checks): whole-model ratio only
    takes_wish: bool  # the norms answer a check's request (WANT_PARAM_NORMS)


def plan_measurement(count: int, every: int, asked: bool) -> MeasurementPlan:
    """The measurement of the ``count``-th checked step (from 0) with cadence ``every``; ``asked``: a check
    wants this step's weight norms. The cadence samples and measures norms; each of the first
    :data:`EARLY_UPDATES` checks samples for the whole-model ratio; a request off the cadence gets norms only."""
    on_cadence = count % every == 0
    wish = asked and not on_cadence
    return MeasurementPlan(
        norms=on_cadence or wish, sample=on_cadence or count < EARLY_UPDATES, early=not on_cadence, takes_wish=wish
    )


def measures_nothing(count: int, every: int, asked: bool) -> bool:
    """``plan_measurement(count, every, asked)`` measures neither norms nor a sample (told without making it)."""
    return not asked and count % every != 0 and count >= EARLY_UPDATES


def whole_model_ratio(before: dict[str, float], update: dict[str, float], steps: int) -> tuple[float, float] | None:
    """``(ratio, weights)``: the whole model's update-to-weight ratio per optimizer step and the norm of the
    weights, from per-layer norms of the weights before and of the update; None when not measurable."""
    total_w = math.sqrt(sum(v * v for v in before.values()))
    total_u = math.sqrt(sum(v * v for v in update.values()))
    if total_w > 0 and math.isfinite(total_w) and math.isfinite(total_u):
        return total_u / total_w / max(1, steps), total_w
    return None


def layer_ratios(before: dict[str, float], update: dict[str, float], steps: int) -> dict[str, float]:
    """Per-layer update-to-weight ratios per optimizer step, for the layers with finite, positive weights."""
    ratios: dict[str, float] = {}
    for layer, u in update.items():
        w = before.get(layer, 0.0)
        if w > 0 and math.isfinite(u) and math.isfinite(w):
            ratios[layer] = u / w / max(1, steps)
    return ratios


def _measurable(params: list[torch.Tensor], modules: list[str | None]) -> tuple[list[torch.Tensor], list[str | None]]:
    """The floating-point, materialized parameters and their modules."""
    keep = [(p, m) for p, m in zip(params, modules) if p.is_floating_point() and not p.is_meta]
    return [p for p, _ in keep], [m for _, m in keep]


def _queue_update(ctx: Any, snap: _Snapshot, info: _Inflight) -> None:
    """Queue the norms of the sampled weights before the update and of the update since ``snap``."""
    steps = ctx.stats.step - snap.step
    pairs = [
        (p, b, m, c)
        for p, b, m, c in zip(snap.params, snap.before, snap.modules, snap.scales)
        if p.dtype == b.dtype and min(_local(p).numel(), UPDATE_SAMPLE) == b.numel()
    ]
    if steps < 1 or not pairs:
        return
    before = [b for _, b, _, _ in pairs]
    info.before_slots = queue_grad_norms(ctx.batch, before)
    # In place in our own sample: before <- before - now; its norm is the update's norm.
    with torch.no_grad():
        torch._foreach_sub_(before, [sample_elements(p) for p, _, _, _ in pairs])
    info.update_slots = queue_grad_norms(ctx.batch, before)
    info.update_modules = [m for _, _, m, _ in pairs]
    info.update_scales = [c for _, _, _, c in pairs]
    info.update_steps = steps
    info.early = snap.early


def _read_update(values: Any, info: _Inflight) -> tuple[dict[str, float], dict[str, float]]:
    """Per-layer norms of the weights before and of their update, scaled from the samples to whole tensors."""
    n = len(info.update_modules)
    scales = info.update_scales
    assert info.before_slots is not None and info.update_slots is not None
    before_norms = [v * c for v, c in zip(read_grad_norms(values, info.before_slots, n), scales)]
    update_norms = [v * c for v, c in zip(read_grad_norms(values, info.update_slots, n), scales)]
    return layer_norms(info.update_modules, before_norms), layer_norms(info.update_modules, update_norms)


class MagnitudeExtension:
    """Measures per-layer parameter norms and update-to-weight ratios every ``update_ratio_every`` checks.

    Attached by :func:`gradwatch.core.extensions.default_extensions` for both integrations. With
    ``update_ratio_every=0`` it does nothing.

    Logged scalars:
        ``gradwatch/update_ratio/<layer>``: ``||p_after - p_before|| / ||p_before||`` of the layer's
        parameters over one optimizer step.
    """

    def __init__(self) -> None:
        self.every = 0
        self._counts: dict[int, int] = {}
        self._snapshots: dict[int, _Snapshot] = {}
        self._inflight: dict[int, _Inflight] = {}

    def attach(self, engine: Any) -> None:
        self.every = int(getattr(engine.config, "update_ratio_every", 0) or 0)

    def before_sync(self, ctx: Any) -> None:
        if self.every <= 0:
            return
        i = ctx.stats.optimizer_index
        count = self._counts.get(i, 0)
        self._counts[i] = count + 1
        snap = self._snapshots.pop(i, None)
        wanted = ctx.engine.history.memory.get(WANT_PARAM_NORMS)
        asked = bool(wanted) and i in wanted
        if snap is None and measures_nothing(count, self.every, asked):
            return  # the usual step: no update to measure, no weights to measure
        info = _Inflight(None, [], None, None, [], 0)
        if snap is not None:
            _queue_update(ctx, snap, info)
        self._measure_weights(ctx, plan_measurement(count, self.every, asked=asked), wanted, info)
        if info.param_slots is not None or info.update_slots is not None:
            self._inflight[id(ctx)] = info

    def _measure_weights(self, ctx: Any, plan: MeasurementPlan, wanted: Any, info: _Inflight) -> None:
        if ctx.params and (plan.norms or plan.sample):
            if plan.takes_wish:
                wanted.discard(ctx.stats.optimizer_index)  # a check asked for this step's weights (WANT_PARAM_NORMS)
            self._queue_weights(ctx, plan, info)

    def _queue_weights(self, ctx: Any, plan: MeasurementPlan, info: _Inflight) -> None:
        """Queue the weights' norms and/or keep a sample of them for the next step's update."""
        params, modules = _measurable(ctx.params, ctx.stats.modules)
        if not params:
            return
        if plan.norms:
            info.param_slots = queue_grad_norms(ctx.batch, [p.detach() for p in params])
            info.param_modules = modules
        if plan.sample:
            with torch.no_grad():
                before = [sample_elements(p) for p in params]
            scales = [_scale(p, b) for p, b in zip(params, before)]
            self._snapshots[ctx.stats.optimizer_index] = _Snapshot(
                params, before, modules, ctx.stats.step, scales, early=plan.early
            )

    def after_sync(self, ctx: Any) -> None:
        info = self._inflight.pop(id(ctx), None)
        if info is None:
            return
        values = ctx.batch.resolve()
        extra = ctx.stats.extra
        if info.param_slots is not None:
            norms = read_grad_norms(values, info.param_slots, len(info.param_modules))
            extra[PARAM_NORMS] = layer_norms(info.param_modules, norms)
        if info.update_slots is None or info.before_slots is None:
            return
        before, update = _read_update(values, info)
        whole = whole_model_ratio(before, update, info.update_steps)
        if whole is not None:
            # The whole model's update-to-weight ratio, on every measurement (the first ones included).
            extra[UPDATE_TOTAL], extra[UPDATE_WEIGHTS] = whole
        if info.early:
            return  # the early measurements feed the whole-model ratio only (checks/early_update.py)
        ratios = layer_ratios(before, update, info.update_steps)
        if ratios and any(r > 0 for r in ratios.values()):  # all zero: no update happened (skipped)
            extra[UPDATE_RATIO] = ratios
            scalars = extra.setdefault("scalars", {})
            for layer, r in ratios.items():
                scalars[f"gradwatch/update_ratio/{layer}"] = r

    def after_step(self, stats: Any, decision: str) -> None:
        if decision == "skip":
            # The update of this step is suppressed: there is nothing to measure.
            snap = self._snapshots.get(stats.optimizer_index)
            if snap is not None and snap.step == stats.step:
                del self._snapshots[stats.optimizer_index]

    def close(self) -> None:
        self._snapshots.clear()
        self._inflight.clear()
