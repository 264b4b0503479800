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

Also small robust-statistics helpers (median, MAD) the magnitude checks share.
"""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from gradwatch.core.stats import SyncBatch, layer_norms, local_shards, queue_grad_norms, read_grad_norms

#: Scale factor that turns a median absolute deviation into a standard deviation for normal data.
MAD_TO_STD = 1.4826


def median(values: Iterable[float]) -> float:
    """Median of finite values (``nan`` for none)."""
    v = sorted(filter(math.isfinite, values))  # C loops: this runs on every checked step
    if not v:
        return math.nan
    n = len(v)
    return v[n // 2] if n % 2 else 0.5 * (v[n // 2 - 1] + v[n // 2])


def robust_spread(values: Iterable[float]) -> tuple[float, float]:
    """``(median, spread)`` where spread is the MAD scaled to a standard deviation."""
    v = list(filter(math.isfinite, values))
    m = median(v)
    if not v:
        return math.nan, math.nan
    return m, MAD_TO_STD * median([abs(x - m) for x in v])


def quantile(values: Iterable[float], q: float) -> float:
    """Nearest-rank quantile of finite values (``nan`` for none)."""
    v = sorted(filter(math.isfinite, values))
    if not v:
        return math.nan
    return v[min(len(v) - 1, max(0, round(q * (len(v) - 1))))]


_T = TypeVar("_T")


def once_per_check(fn: Callable[[Any, Any], _T]) -> Callable[[Any, Any], _T]:
    """Compute ``fn(stats, history)`` once per checked step: a check and its ``remember`` share it.

    The engine runs every check and then every ``remember`` on the same statistics before it records
    them in the history, so what ``fn`` reads does not change in between. The result is reused only for
    the same statistics object, the same history, and the same last recorded step of that history.
    """
    cell: list[tuple[Any, ...]] = [()]

    @functools.wraps(fn)
    def wrapper(stats: Any, history: Any) -> _T:
        last = history.last.get(stats.optimizer_index)
        memo = cell[0]  # one read: another thread may replace it, never half of it
        if memo and memo[0]() is stats and memo[1]() is history and (memo[2]() if memo[2] else None) is last:
            return memo[3]  # type: ignore[no-any-return]
        value = fn(stats, history)
        # Everything weakly but the value: this cell outlives the run, which must not stay alive through it.
        cell[0] = (weakref.ref(stats), weakref.ref(history), weakref.ref(last) if last is not None else None, value)
        return value

    return wrapper


def param_norms_of(stats: Any, history: Any) -> dict[str, float]:
    """Per-layer parameter norms: this step's measurement, else the latest remembered one."""
    now = stats.extra.get("param_norms")
    if isinstance(now, dict):
        return now
    return history.memory.get("param_norms", {}).get(stats.optimizer_index, {})


_WEIGHTS: list[Any] = [None, {}, None]


def weight_summary(params: dict[str, float]) -> tuple[dict[str, float], float | None]:
    """``(usable, total)`` of per-layer weight norms: the positive finite ones, and the norm of all the
    weights. Computed once per measurement (every ``update_ratio_every`` steps), not on every step."""
    memo = _WEIGHTS
    if memo[0] is not params:
        usable = {k: w for k, w in params.items() if 0.0 < w < math.inf}
        total = math.sqrt(sum(v * v for v in params.values())) if params else None
        memo[0], memo[1], memo[2] = params, usable, total
    return memo[1], memo[2]


def remember_param_norms(stats: Any, history: Any, now: Any = None) -> None:
    """Keep the latest per-layer parameter norms (parameters change slowly between measurements): this
    step's measurement, or ``now``, norms a check measured on a suspicious step."""
    if now is None:
        now = stats.extra.get("param_norms")
    if isinstance(now, dict):
        history.memory.setdefault("param_norms", {})[stats.optimizer_index] = now


#: Optimizer indices whose parameter norms a check wants measured at their next checked step (in deferred
#: mode, where a suspicious step's weights cannot be read on the spot: they have moved on, and no sync is
#: allowed). The measurement rides in that step's one sync.
WANT_PARAM_NORMS = "param_norms/wanted"


def measure_param_norms(params: list[torch.Tensor], modules: list[str | None]) -> dict[str, float]:
    """Per-layer norms of ``params`` as they are now, read back with one sync: only for a suspicious step."""
    keep = [(p.detach(), m) for p, m in zip(params, modules) if p.is_floating_point() and not p.is_meta]
    if not keep:
        return {}
    batch = SyncBatch()
    slots = queue_grad_norms(batch, [p for p, _ in keep])
    return layer_norms([m for _, m in keep], read_grad_norms(batch.resolve(), slots, len(keep)))


#: Where the checks keep a run's early levels (set once, after their first 20 checked steps).
EARLY_LOSS = "loss_early"
EARLY_NORM = "exploding_early"
#: A loss (or total gradient norm) this many times below its early level: the run is at its minimum.
CONVERGED = 100.0


def converged(history: Any, optimizer_index: int) -> str | None:
    """``"loss"`` when the recent median loss is 100x below the run's early one, ``"norm"`` when the total
    gradient norm's is (no loss observed), else None. Only asked when a finding is about to fire."""
    loss_early = history.memory.get(EARLY_LOSS)
    if isinstance(loss_early, float) and loss_early > 0 and history.losses:
        return "loss" if median(history.losses) < loss_early / CONVERGED else None
    norm_early = history.memory.get(EARLY_NORM, {}).get(optimizer_index)
    recent = history.total_norms.get(optimizer_index, ())
    if norm_early and recent and median(recent) < norm_early / CONVERGED:
        return "norm"
    return None


def clipping_in_place(stats: Any, this_step: bool = True) -> str | None:
    """When the gradients are clipped after gradwatch's measurement (Lightning's ``gradient_clip_val``, the
    module's ``configure_gradient_clipping``, see ``lightning.ClipRatio``; a plain loop's own clipping, see
    ``gradwatch.observe.preclip``), one clause saying so, with the
    factor when known (``this_step``: the finding is about this step's gradient). None when nothing is known
    to clip, or when Lightning's norm clipping did not bite (the norm was below ``gradient_clip_val``)."""
    facts = stats.extra.get("clipping")
    how = facts.get("how") if isinstance(facts, dict) else None
    clip = facts.get("clip_val") if isinstance(facts, dict) else None
    if how == "norm":
        ratio = stats.extra.get("clip_ratio")
        if not this_step:
            return f"Lightning's gradient clipping (gradient_clip_val={clip:g}) bounds the norm of every update"
        if isinstance(ratio, float) and ratio < 1.0:
            return (
                f"Lightning's gradient clipping (gradient_clip_val={clip:g}) scaled this step's gradient down "
                f"{1 / ratio:.3g}x, to norm {clip:g}, before the update (gradwatch measures before clipping)"
            )
        return None
    if how == "value":
        return (
            f"Lightning's gradient clipping clamps every gradient element to +-{clip:g} "
            "(gradient_clip_algorithm='value') before the update (gradwatch measures before clipping)"
        )
    if how == "loop":  # a plain loop that changed the gradients between backward() and step() (preclip)
        ratio = stats.extra.get("clip_ratio")
        if not this_step:
            return "the training loop clips the gradients between backward() and optimizer.step()"
        if isinstance(ratio, float) and ratio < 1.0:
            return (
                f"the training loop scaled this step's gradient down {1 / ratio:.3g}x between backward() and "
                "optimizer.step() (clipping; gradwatch measures before clipping)"
            )
        return None
    if how == "module":
        return (
            "the LightningModule's configure_gradient_clipping clips the gradients after gradwatch's check "
            "(gradwatch measures before clipping; it may not clip every step)"
        )
    return None


def clip_advice(stats: Any) -> str:
    """How to clip gradients, in the terms of the loop at hand: a plain loop, Lightning's automatic
    optimization (``gradient_clip_val`` when it does not clip yet, a lower one when it did not bite) or its
    manual optimization (``self.clip_gradients``)."""
    facts = stats.extra.get("clipping")
    if not isinstance(facts, dict) or not facts.get("lightning"):
        return "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0) between backward() and optimizer.step()"
    if facts.get("manual"):
        return (
            "self.clip_gradients(opt, gradient_clip_val=1.0, gradient_clip_algorithm='norm') between "
            "self.manual_backward(loss) and opt.step()"
        )
    if facts.get("how") == "norm":
        return (
            f"lower Trainer(gradient_clip_val={facts['clip_val']:g}): this step's gradient norm was below it, so it "
            "did not bite; a few times the usual gradient norm bounds such steps"
        )
    return "Trainer(gradient_clip_val=1.0), which Lightning applies between backward and the optimizer step"


def newly_sustained(previous: Any, current: bool, held: Any, n: int) -> bool:
    """True when a condition has just held for ``n`` observations in a row (not already before).

    ``previous`` holds the earlier observations (newest last, at least ``n`` kept); ``held(value)`` says
    whether the condition held for one of them; ``current`` says whether it holds now. Firing only at the
    crossing reports a persisting condition once, and again after it recovered and came back.
    """
    if not current:
        return False
    prev = list(previous)
    k = n - 1
    if len(prev) < k or not all(held(v) for v in (prev[len(prev) - k :] if k > 0 else [])):
        return False
    return not (len(prev) >= n and all(held(v) for v in prev[len(prev) - n :]))


#: Checked steps, from the first, whose update is measured (whatever ``update_ratio_every``): a learning
#: rate far too large throws the weights in the first updates, and is seen in the whole-model ratio.
EARLY_UPDATES = 10
#: ``StepStats.extra`` key of the whole model's measured update-to-weight ratio.
UPDATE_TOTAL = "update_ratio_total"
#: ... and of the norm of the weights it was measured against.
UPDATE_WEIGHTS = "update_ratio_total/weights"

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
        info = _Inflight(None, [], None, None, [], 0)
        snap = self._snapshots.pop(i, None)
        if snap is not None:
            steps = ctx.stats.step - snap.step
            pairs = [
                (p, b, m, c)
                for p, b, m, c in zip(snap.params, snap.before, snap.modules, snap.scales)
                if p.dtype == b.dtype and min(_local(p).numel(), UPDATE_SAMPLE) == b.numel()
            ]
            if steps >= 1 and pairs:
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
        wanted = ctx.engine.history.memory.get(WANT_PARAM_NORMS)
        if wanted and i in wanted and count % self.every != 0 and ctx.params:
            # A check asked for this step's weights (see WANT_PARAM_NORMS): their norms only, no update sample.
            wanted.discard(i)
            params = [p for p in ctx.params if p.is_floating_point() and not p.is_meta]
            if params:
                info.param_slots = queue_grad_norms(ctx.batch, [p.detach() for p in params])
                info.param_modules = [
                    m for p, m in zip(ctx.params, ctx.stats.modules) if p.is_floating_point() and not p.is_meta
                ]
        if (count % self.every == 0 or count < EARLY_UPDATES) and ctx.params:
            params = [p for p in ctx.params if p.is_floating_point() and not p.is_meta]
            modules = [m for p, m in zip(ctx.params, ctx.stats.modules) if p.is_floating_point() and not p.is_meta]
            early = count % self.every != 0
            if params:
                if not early:  # an early measurement samples the weights for their update only
                    info.param_slots = queue_grad_norms(ctx.batch, [p.detach() for p in params])
                    info.param_modules = modules
                with torch.no_grad():
                    before = [sample_elements(p) for p in params]
                scales = [_scale(p, b) for p, b in zip(params, before)]
                self._snapshots[i] = _Snapshot(params, before, modules, ctx.stats.step, scales, early=early)
        if info.param_slots is not None or info.update_slots is not None:
            self._inflight[id(ctx)] = info

    def after_sync(self, ctx: Any) -> None:
        info = self._inflight.pop(id(ctx), None)
        if info is None:
            return
        values = ctx.batch.resolve()
        extra = ctx.stats.extra
        if info.param_slots is not None:
            norms = read_grad_norms(values, info.param_slots, len(info.param_modules))
            extra["param_norms"] = layer_norms(info.param_modules, norms)
        if info.update_slots is not None and info.before_slots is not None:
            n = len(info.update_modules)
            scales = info.update_scales
            before_norms = [v * c for v, c in zip(read_grad_norms(values, info.before_slots, n), scales)]
            update_norms = [v * c for v, c in zip(read_grad_norms(values, info.update_slots, n), scales)]
            before = layer_norms(info.update_modules, before_norms)
            update = layer_norms(info.update_modules, update_norms)
            total_w = math.sqrt(sum(v * v for v in before.values()))
            total_u = math.sqrt(sum(v * v for v in update.values()))
            if total_w > 0 and math.isfinite(total_w) and math.isfinite(total_u):
                # The whole model's update-to-weight ratio, on every measurement (the first ones included).
                extra[UPDATE_TOTAL] = total_u / total_w / max(1, info.update_steps)
                extra[UPDATE_WEIGHTS] = total_w
            if info.early:
                return  # the early measurements feed the whole-model ratio only (checks/early_update.py)
            ratios: dict[str, float] = {}
            for layer, u in update.items():
                w = before.get(layer, 0.0)
                if w > 0 and math.isfinite(u) and math.isfinite(w):
                    ratios[layer] = u / w / max(1, info.update_steps)
            if ratios and any(r > 0 for r in ratios.values()):  # all zero: no update happened (skipped)
                extra["update_ratio"] = ratios
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
