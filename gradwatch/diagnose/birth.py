"""Where a non-finite value was born: pure decisions over the values the :class:`~gradwatch.diagnose.localize.Localizer`
read back (one summary row per op or module: ``[has_nan, has_inf, min_abs, max_abs, min, max]``).

Nothing here touches a tensor or a hook; every function is tested alone (tests/test_localize.py).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gradwatch.diagnose.localize import Site

def is_bad(v: list[float]) -> bool:
    return bool(v[0] or v[1])


def magnitudes(v: list[float] | None) -> dict[str, float]:
    if v is None:
        return {}
    out = {"min_abs": v[2], "max_abs": v[3], "min": v[4], "max": v[5]}
    if v[1]:
        out["inf"] = True  # only for a NaN made from Inf (e.g. softmax over a fully masked row)
    return out


def output_flags(v: list[float]) -> dict[str, Any]:
    return {"nan": bool(v[0]), "inf": bool(v[1]), "max_abs": v[3]}


#: Functions that put an explicit float('-inf') somewhere on purpose (a mask); an explicit Inf given to
#: anything else (``out * float("inf")``) is a value, and the Inf it makes is what a later op turns into NaN.
_MASKING = ("masked_fill", "where", "fill", "full", "setitem", "index_put", "masked_scatter", "index_fill")


def _fresh(before: list[float] | None, after: list[float] | None) -> bool:
    """A non-finite output from finite inputs: where a non-finite value is born."""
    return after is not None and is_bad(after) and (before is None or not is_bad(before))


def _nan_made(before: list[float] | None, after: list[float] | None) -> bool:
    """A NaN output from inputs without NaN (they may hold Inf)."""
    return after is not None and bool(after[0]) and (before is None or not before[0])


def first_birth(
    ops: list[tuple[bool, list[float] | None, list[float] | None]], names: list[str] | None = None
) -> int | None:
    """Index of the op where a non-finite value was born, from ``(intended, inputs, outputs)`` summaries
    (``names``: the ops' function names, to tell masks from other explicit Inf arguments)."""
    for rule in (_born_unintended, _nan_from_inf, _sentinel_reached_end):
        found = rule(ops, names)
        if found is not None:
            return found
    return None


def _born_unintended(
    ops: list[tuple[bool, list[float] | None, list[float] | None]], names: list[str] | None
) -> int | None:
    """A value going non-finite from finite inputs; explicit float('inf') arguments (masks) are intended."""
    return next((i for i, (intended, before, after) in enumerate(ops) if not intended and _fresh(before, after)), None)


def _nan_from_inf(ops: list[tuple[bool, list[float] | None, list[float] | None]], names: list[str] | None) -> int | None:
    """A NaN made from Inf (e.g. softmax over a fully masked row), unless the Inf came from an explicit
    float('inf') given to an op that is no mask: then that op made it."""
    for i, (_intended, before, after) in enumerate(ops):
        if _nan_made(before, after):
            maker = _explicit_value_before(ops, names, i)
            return i if maker is None else maker
    return None


def _explicit_value_before(
    ops: list[tuple[bool, list[float] | None, list[float] | None]], names: list[str] | None, end: int
) -> int | None:
    """The first op before ``end`` that made a non-finite value from an explicit float('inf') given to an op
    that is no mask (``out * float("inf")``); None without ``names``."""
    if names is None:
        return None
    for j in range(end):
        intended, before, after = ops[j]
        name = (names[j] if j < len(names) else "") or ""
        if intended and _fresh(before, after) and not any(m in name.lower() for m in _MASKING):
            return j
    return None


def _sentinel_reached_end(
    ops: list[tuple[bool, list[float] | None, list[float] | None]], names: list[str] | None
) -> int | None:
    """An explicit float('inf')/nan argument after all, when its value reached the end of the forward pass
    (the loss): a sentinel that was never masked out, e.g. ``loss * float("inf")``."""
    last = ops[-1][2] if ops else None
    if last is None or not is_bad(last):
        return None
    return next((i for i, (intended, before, after) in enumerate(ops) if intended and _fresh(before, after)), None)


def forward_finite(outputs: list[list[float] | None]) -> bool:
    """Whether the forward pass counts as finite: every op output finite, or only -inf that was absorbed
    before the output (an additive attention mask or bias passed in, then softmaxed), as far as a NaN born
    later is concerned."""
    if all(a is None or not is_bad(a) for a in outputs):
        return True
    return last_finite(outputs) is True and all(a is None or (not a[0] and a[5] < math.inf) for a in outputs)


def last_finite(outputs: list[list[float] | None]) -> bool | None:
    """Whether the forward pass's last op output was finite; None when unknown (no ops, or not summarized)."""
    last = outputs[-1] if outputs else None
    return None if last is None else not is_bad(last)


def absorbed(outgoing: dict[str, Any], ends_finite: bool | None) -> bool:
    """An Inf-only forward birth whose value the forward absorbed (log of a 0/1 mask added before a softmax
    or logsumexp: the pass ends finite) happens on healthy steps too; a backward birth is the cause."""
    return not outgoing.get("nan") and ends_finite is True


def inf_reached(incoming: dict[str, float]) -> bool:
    """A backward birth whose op saw Inf among its forward inputs (``forward_max_abs`` of its origin): its NaN
    is 0 * inf, the zero gradient of positions the forward masked out times the Inf they held."""
    return incoming.get("forward_max_abs") == math.inf


def first_seen(ops: list[tuple[Site, list[float] | None]]) -> Site | None:
    """With no birth found: the site of the first op whose inputs already held NaN/Inf."""
    return next((site for site, before in ops if before is not None and is_bad(before)), None)


def first_bad_module(
    modules: list[tuple[str, list[float] | None, list[float] | None]],
) -> tuple[str | None, dict[str, float]]:
    """The first module (in completion order) whose output was non-finite, and its inputs' magnitudes."""
    for label, ins, outs in modules:
        if outs is not None and is_bad(outs):
            return label, magnitudes(ins)
    return None, {}


def carried_in(ins: list[float] | None, outs: list[float] | None) -> str | None:
    """``"NaN"`` / ``"Inf"`` when a module's inputs already held what its output holds (it passed the value on:
    it was made before the module ran), else None. An Inf input that came out NaN (a softmax over a fully masked
    row) was made NaN by the module itself."""
    if ins is None or outs is None:
        return None
    if outs[0]:
        return "NaN" if ins[0] else None
    return "Inf" if outs[1] and ins[1] else None


def passed_on(
    modules: list[tuple[str, list[float] | None, list[float] | None]],
) -> tuple[str | None, str | None]:
    """For the first module with a non-finite output (see :func:`first_bad_module`): what its inputs already
    held (:func:`carried_in`), and the last module completed before it whose output was finite (the code
    between that one and it made the value); ``(None, None)`` when the module made it itself."""
    for i, (label, ins, outs) in enumerate(modules):
        if outs is None or not is_bad(outs):
            continue
        carried = carried_in(ins, outs)
        if carried is None:
            return None, None
        before = (
            lab for lab, _i, o in reversed(modules[:i]) if o is not None and not is_bad(o) and not lab.startswith(label + ".")
        )
        return carried, next(before, None)
    return None, None
