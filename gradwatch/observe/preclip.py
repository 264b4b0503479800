"""Observe: the gradient norms backward produced, before the loop clips them.

A plain loop is checked inside ``optimizer.step()``, after whatever the loop did to the gradients since
``backward()``: ``clip_grad_norm_``, ``clip_grad_value_``, ``scaler.unscale_``. Checked there, a loss weighted
1e4x by mistake shows as a gradient of norm ``max_norm``, and one NaN looks like every gradient being NaN
(``clip_grad_norm_`` spreads it). So the step's fused per-gradient norms are taken at the end of each
backward call instead (one ``_foreach_norm``, no sync; queued on the autograd engine from a post-accumulate
hook on one small parameter per optimizer) and read with the step's one sync. When the gradients are still
the ones backward left (same tensors, same version counters), nothing is computed at the step: the cost
moves, it does not double. When the loop changed them all in place since (clipping moves every version
counter; a GradScaler's ``unscale_`` moves none, so its stage is asked), the step's norms are still the
backward ones, and ``gradwatch/clip_ratio`` is the factor the loop scaled the watched parameter's gradient
by (the clip coefficient of ``clip_grad_norm_``; a GradScaler's unscaling is taken out). What the update
would apply still decides: that gradient cleared or non-finite now (``clip_grad_norm_`` spreads a NaN to
every gradient) has the step measured again as it is. A loop that wrote into some gradients only (a mask, a
NaN) or replaced them has its step measured as it is, as before.

In Lightning the check runs in ``on_before_optimizer_step``, before ``Trainer(gradient_clip_val=...)`` clips,
but after what the LightningModule's own code did since backward: ``self.clip_gradients`` in manual
optimization, ``clip_grad_norm_`` in ``on_after_backward``. The same norms from the end of backward serve there.

A loop that accumulates gradients over several backward passes without changing them before the step would
pay one fused norm per pass: the first such step turns the hooks off for the rest of the run. In a distributed
run (sharded gradients, communication hooks that rewrite them) the norms are measured at the step.

Facts written to ``stats.extra``: ``"clip_ratio"`` and ``"clipping"`` (``{"how": "loop"}``, read by the
magnitude checks' texts), and the ``gradwatch/clip_ratio`` scalar.
"""

from __future__ import annotations

import functools
import itertools
import math
import operator
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.parameter import is_lazy

from gradwatch.core.failures import internal_warning
from gradwatch.core.stats import SyncBatch, layer_norms, queue_all_norms, queue_grad_norms, total_norm

_VERSION = operator.attrgetter("_version")
_BEFORE, _NOW, _SCALE = "preclip/before", "preclip/now", "preclip/scale"

#: Relative change of the watched parameter's gradient norm below which the loop did not clip this step.
UNCHANGED = 1e-4


_GRAD = operator.attrgetter("grad")


@dataclass
class _Taken:
    """One optimizer's gradient norms at the end of the latest backward call."""

    batch: SyncBatch
    slots: list[tuple[int, list[int]]]
    present: tuple[int, ...] | None  # positions of the gradients present, when some were None
    grad: weakref.ref[torch.Tensor]  # the watched parameter's gradient then, and its version
    version: int
    ids: list[int]  # every gradient's id and the sum of their versions: did the loop touch any since?
    versions: int
    rep_norm: torch.Tensor
    passes: int


class BackwardNorms:
    """Engine extension (plain loops and Lightning): see the module docstring."""

    def __init__(self) -> None:
        self.engine: Any = None
        self._reps: dict[int, torch.Tensor] = {}
        self._handles: dict[int, Any] = {}
        self._taken: dict[int, _Taken] = {}
        self._pending: dict[str, Any] = {}

    def attach(self, engine: Any) -> None:
        self.engine = engine
        from gradwatch.observe.distributed import is_distributed

        if is_distributed():
            return  # sharded gradients (FSDP), comm hooks rewriting them: measured at the step, as before
        for op in engine.index.per_optimizer:
            leaves = [p for p in op.params if p.requires_grad and p.is_leaf and not is_lazy(p) and p.numel()]
            if not leaves or not hasattr(leaves[0], "register_post_accumulate_grad_hook"):
                continue
            rep = min(leaves, key=lambda p: p.numel())
            self._reps[op.index] = rep
            self._handles[op.index] = rep.register_post_accumulate_grad_hook(functools.partial(self._on_pass, op.index))

    # -- inside backward (must never raise) ----------------------------------------------------------
    def _on_pass(self, index: int, param: torch.Tensor) -> None:
        try:
            queue = torch.autograd.Variable._execution_engine.queue_callback
            # Queued from inside a callback: after every callback queued before (DDP's reducer writes the
            # averaged gradients in one).
            queue(lambda: queue(lambda: self._take(index)))
        except Exception as exc:  # noqa: BLE001 - never break the user's backward
            internal_warning("pre-clip norms (hook)", exc, owner=self.engine)

    def _take(self, index: int) -> None:
        try:
            engine, rep = self.engine, self._reps.get(index)
            if engine is None or engine.closed or rep is None or rep.grad is None:
                return
            op = engine.index.per_optimizer[index]
            grads = list(map(_GRAD, op.params))  # a C loop: this runs at the end of every backward
            present = None
            if not all(map(operator.is_not, grads, itertools.repeat(None))):  # a C loop, no Tensor.__eq__
                present = tuple(i for i, g in enumerate(grads) if g is not None)
                grads = [grads[i] for i in present]
            batch = SyncBatch()
            slots = queue_all_norms(batch, op, grads) if present is None else None
            if slots is None:
                slots = queue_grad_norms(batch, grads)
            before = self._taken.get(index)
            g = rep.grad
            self._taken[index] = _Taken(
                batch, slots, present, weakref.ref(g), g._version, list(map(id, grads)), sum(map(_VERSION, grads)),
                _norm(g), (before.passes if before else 0) + 1,
            )
        except Exception as exc:  # noqa: BLE001
            internal_warning("pre-clip norms (end of backward)", exc, owner=self.engine)

    # -- at the step ---------------------------------------------------------------------------------
    def backward_norms(self, index: int, batch: SyncBatch, grads: list[torch.Tensor], full: bool) -> Any:
        """Norm slots in ``batch`` for the step's ``grads`` from the end of the latest backward call, or None
        (no backward call since the previous step, or another set of gradients now: measured at the step)."""
        self._pending = {}
        taken = self._taken.pop(index, None)
        rep = self._reps.get(index)
        if taken is None or rep is None or rep.grad is None:
            return None
        if full != (taken.present is None) or (not full and taken.present != self._present(index)):
            return None
        if list(map(id, grads)) != taken.ids:
            return None
        touched = sum(map(_VERSION, grads)) != taken.versions
        if touched and rep.grad._version == taken.version:
            return None  # the loop wrote into some gradients, not all (a mask, a NaN): measure what it left
        slots = [(batch.add(taken.batch.part(slot)), idx) for slot, idx in taken.slots]
        self._pending = {"taken": taken, "index": index, "touched": touched}
        return slots

    def before_sync(self, ctx: Any) -> None:
        """After AmpMonitor's (it finds the loop's GradScaler, whose unscale_ moves no version counter)."""
        pending, self._pending = self._pending, {}
        if not pending:
            return
        taken, index = pending["taken"], pending["index"]
        g = self._reps[index].grad
        scale = self._unscaled_by(index)
        if scale is None and not pending["touched"]:
            if taken.passes > 1:  # accumulation, left as backward made it: measure at the step from now on
                self._off(index)
            return
        batch, slots = ctx.batch, ctx.slots  # per step: after_sync reads them even a step late (deferred)
        if scale is not None:
            slots[_SCALE] = batch.add(scale)
        if pending["touched"]:  # written since backward (clipped): how much, and is it still finite
            slots[_BEFORE] = batch.add(taken.rep_norm)
            slots[_NOW] = batch.add(_norm(g))

    def _present(self, index: int) -> tuple[int, ...]:
        op = self.engine.index.per_optimizer[index]
        return tuple(i for i, p in enumerate(op.params) if p.grad is not None)

    def _unscaled_by(self, index: int) -> torch.Tensor | None:
        """The GradScaler's scale when it unscaled this optimizer's gradients since backward (the backward
        norms are of the scaled gradients then)."""
        from gradwatch.observe.amp import AmpMonitor

        amp = self.engine.extension(AmpMonitor)
        scaler = getattr(amp, "scaler", None)
        opt = self.engine.optimizers[index] if index < len(self.engine.optimizers) else None
        if scaler is None or opt is None or getattr(scaler, "_scale", None) is None:
            return None
        state = scaler._per_optimizer_states.get(id(opt))
        stage = getattr(state.get("stage") if state else None, "name", None)
        return scaler._scale if stage == "UNSCALED" else None

    def _off(self, index: int) -> None:
        self._reps.pop(index, None)
        handle = self._handles.pop(index, None)
        if handle is not None:
            handle.remove()

    def after_sync(self, ctx: Any) -> None:
        slots = ctx.slots
        if not (_BEFORE in slots or _SCALE in slots) or ctx.stats.extra.get("amp_overflow_step"):
            return
        values = ctx.batch.resolve()
        stats = ctx.stats
        scale = values[slots[_SCALE]][0] if _SCALE in slots else 1.0
        if not (scale and math.isfinite(scale)):
            scale = 1.0
        if scale != 1.0:  # the backward norms are of the scaled gradients
            _rescale(stats, 1.0 / scale, self.engine.config.per_layer)
            stats.extra["unscaled_by"] = scale
        if _BEFORE not in slots:
            return
        before, now = values[slots[_BEFORE]][0] / scale, values[slots[_NOW]][0]
        if math.isfinite(stats.total_norm) and before > 0 and not (now != 0.0 and math.isfinite(now)):
            # Finite after backward, cleared (zero_grad(set_to_none=False)) or made non-finite since: what
            # the update would apply is what counts, measured again (a second read, on such a step only).
            self._measure_now(ctx)
            return
        stats.overflow_norm = ()  # what overflowed before clipping is finite now (clip_grad_norm_ zeroes it)
        if not (before > 0 and math.isfinite(before) and math.isfinite(now)):
            return
        ratio = now / before
        ratio = 1.0 if abs(ratio - 1.0) < UNCHANGED else ratio
        suffix = f"_opt{stats.optimizer_index}" if len(self.engine.optimizers) > 1 else ""
        stats.extra["clip_ratio"] = ratio
        stats.extra["clipping"] = {"lightning": False, "how": "loop", "clip_val": None}
        stats.extra.setdefault("scalars", {})[f"gradwatch/clip_ratio{suffix}"] = ratio

    def _measure_now(self, ctx: Any) -> None:
        """The step's gradients as they are now: norms, and NaN/Inf named from them."""
        grads = ctx.grads  # none in deferred mode (read a step late): the backward norms stand
        if not grads:
            return
        batch = SyncBatch()
        self.engine.fill(ctx.stats, batch, queue_grad_norms(batch, grads), -1, grads)

    def close(self) -> None:
        for h in self._handles.values():
            h.remove()
        self._handles = {}
        self._reps = {}
        self._taken = {}


def _rescale(stats: Any, factor: float, per_layer: bool) -> None:
    stats.norms = [v * factor for v in stats.norms]
    stats.total_norm = total_norm(stats.norms)
    if per_layer and stats.layer_norms:
        stats.layer_norms = layer_norms(stats.modules, stats.norms)


def _norm(g: torch.Tensor) -> torch.Tensor:
    """One gradient's L2 norm as a 1-element float32 device tensor (a sparse one's from its values)."""
    values = g.detach().coalesce().values() if g.is_sparse else g.detach()
    return torch.linalg.vector_norm(values.float()).reshape(1)
