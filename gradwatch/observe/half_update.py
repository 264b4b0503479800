"""Observe: would this step's optimizer update be non-finite although the gradients are finite?

With ``float16`` parameters (``model.half()``, Lightning's ``precision="16-true"``) an adaptive optimizer
keeps its state in float16 too, and adds ``eps`` to a float16 denominator. Adam's default ``eps=1e-8`` is
below float16's smallest subnormal (6e-8): it rounds to 0. Wherever the new second moment is 0 (a gradient
element that is exactly 0, or whose square underflows: ``|g| < ~8e-3`` in Adam's first step) the update is
``0 / 0`` or ``m / 0``: NaN or Inf weights, from finite gradients and a finite loss.

The same holds in any precision for ``eps=0`` (float32 included): a parameter element whose gradient has
been exactly 0 so far (an embedding row no batch used, a masked weight) gets ``0 / 0``.

Only for that configuration (parameters in a param group whose ``eps`` rounds to 0 in their dtype, with
a second-moment state: Adam, AdamW, NAdam, RAdam, RMSprop, Adagrad), each checked step queues one device
flag into the step's sync: "some element's next second moment is 0". When it is set, the update is
treated as non-finite (``stats.extra["update_nonfinite"]``): skipped under ``on_nonfinite="skip"``,
reported as ``nonfinite_update``. Any other run pays one attribute lookup per check.
"""

from __future__ import annotations

import struct
from typing import Any

import torch

#: State entries holding a running sum of squared gradients, and how the next one is formed from it:
#: ``(state key, group key of the decay, index into it or None, whether the decay is applied)``.
_SECOND_MOMENT = (
    ("exp_avg_sq", "betas", 1),  # Adam, AdamW, NAdam, RAdam: v = b2 * v + (1 - b2) * g^2
    ("square_avg", "alpha", None),  # RMSprop: v = a * v + (1 - a) * g^2
    ("sum", None, None),  # Adagrad: v = v + g^2
)
_SLOT = "half_update/zero_denominator"
#: Optimizers whose second moment is one of the above from their first step on (before it, their state is
#: empty). Adamax keeps a running max instead: not predicted before it has state of these names.
_KNOWN = frozenset({"Adam", "AdamW", "NAdam", "RAdam", "RMSprop"})


def _eps_underflows(group: dict[str, Any], dtype: torch.dtype = torch.float16) -> bool:
    """Whether the group's ``eps`` is 0 once rounded to ``dtype`` (float16: Adam's default 1e-8; any dtype: 0)."""
    eps = group.get("eps")
    if not isinstance(eps, (int, float)) or isinstance(eps, bool):
        return False
    if dtype is not torch.float16:
        info = torch.finfo(dtype)
        return abs(float(eps)) <= info.tiny * info.eps / 2  # at most half the smallest subnormal: rounds to 0
    try:
        return struct.unpack("e", struct.pack("e", float(eps)))[0] == 0.0  # no tensor: no device read
    except OverflowError:
        return False


def _decay(group: dict[str, Any], key: str | None, index: int | None) -> float | None:
    if key is None:
        return 1.0
    value = group.get(key)
    if index is not None:
        if not isinstance(value, (tuple, list)) or len(value) <= index:
            return None
        value = value[index]
    return float(value) if isinstance(value, (int, float)) else None


def _zero_eps(group: dict[str, Any], dtype: torch.dtype) -> bool:
    """The group divides by ``sqrt(v) + eps`` with an ``eps`` that is 0 where it computes (fused kernels compute
    in float32)."""
    if not dtype.is_floating_point:
        return False
    return _eps_underflows(group, torch.float32 if group.get("fused") else dtype)


def _zero_second_moment(
    p: torch.Tensor, g: torch.Tensor, group: dict[str, Any], state: dict[str, Any], known: bool
) -> torch.Tensor | None:
    """A device flag: some element of ``p``'s next second moment is 0 (None: no such state, or one kept wider,
    where eps holds). Computed with the optimizer's own ops on a copy, so the rounding is the one it will do."""
    for key, decay_key, index in _SECOND_MOMENT:
        decay = _decay(group, decay_key, index)
        fresh = decay_key is not None and decay_key in group and known
        if decay is None or not (key in state or fresh):
            continue  # (before its first step the state is empty: known optimizers only)
        v = state.get(key)
        if isinstance(v, torch.Tensor) and v.dtype is not p.dtype and not _eps_underflows(group, v.dtype):
            return None  # its state is kept wider (float32): eps holds there
        nxt = v.clone() if isinstance(v, torch.Tensor) and v.shape == g.shape else torch.zeros_like(p)
        if decay != 1.0:
            nxt.mul_(decay)
        nxt.addcmul_(g, g, value=1.0 - decay if decay != 1.0 else 1.0)
        return (nxt == 0).any()
    return None


class HalfUpdateGuard:
    """Engine extension: see the module docstring."""

    def __init__(self) -> None:
        self.engine: Any = None
        self._plans: dict[int, tuple[Any, list[tuple[torch.Tensor, dict[str, Any]]]]] = {}
        self._flagged: list[str] = []  # the parameters whose flag the latest before_sync queued, in order

    def attach(self, engine: Any) -> None:
        self.engine = engine

    def _plan(self, i: int) -> list[tuple[torch.Tensor, dict[str, Any]]]:
        op = self.engine.index.per_optimizer[i]
        cached = self._plans.get(i)
        if cached is not None and cached[0] is op.params:
            return cached[1]
        plan: list[tuple[torch.Tensor, dict[str, Any]]] = []
        opt = op.optimizer
        if opt is not None:
            for group in getattr(opt, "param_groups", ()):
                zero = {dtype: _zero_eps(group, dtype) for dtype in {p.dtype for p in group["params"]}}
                plan += [(p, group) for p in group["params"] if p.requires_grad and zero[p.dtype]]
        self._plans[i] = (op.params, plan)
        return plan

    def before_sync(self, ctx: Any) -> None:
        i = ctx.stats.optimizer_index
        plan = self._plan(i)
        if not plan:
            return
        opt = self.engine.index.per_optimizer[i].optimizer
        known = type(opt).__name__ in _KNOWN
        flags = []
        names = self.engine.index.per_optimizer[i].names
        name_of = dict(zip(map(id, self.engine.index.per_optimizer[i].params), names))
        self._flagged = []
        with torch.no_grad():
            for p, group in plan:
                g = p.grad
                if g is None or g.is_sparse:
                    continue
                flag = _zero_second_moment(p, g, group, opt.state.get(p, {}), known)
                if flag is not None:
                    flags.append(flag)
                    self._flagged.append(name_of.get(id(p), "?"))
        if flags:
            ctx.slots[_SLOT] = ctx.batch.add(torch.stack(flags))

    def after_sync(self, ctx: Any) -> None:
        slot = ctx.slots.get(_SLOT, -1)
        if slot < 0:
            return
        values = ctx.batch.resolve()[slot]
        if any(values):
            ctx.stats.extra["update_nonfinite"] = True
            ctx.stats.extra["update_nonfinite_params"] = [n for n, v in zip(self._flagged, values) if v]
            eps = sorted({float(g.get("eps", 0.0)) for _p, g in self._plan(ctx.stats.optimizer_index)})
            ctx.stats.extra["update_nonfinite_eps"] = eps

    def close(self) -> None:
        self._plans.clear()
