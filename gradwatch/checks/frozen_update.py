"""``frozen_param_updated``: parameters frozen with ``requires_grad_(False)`` that the optimizer still moves.

Freezing a layer mid-run with ``requires_grad_(False)`` stops new gradients, but ``zero_grad(set_to_none=
False)`` leaves a zero gradient tensor in place, and an optimizer steps every parameter that has one:
Adam and SGD with momentum keep moving it with their running averages, weight decay shrinks it. The
"frozen" layer drifts. Healthy steps cost one C-level pass over the ``requires_grad`` flags, made when the
gradients are gathered (``params_trainable``), before the norms stream every gradient through the cache; reported once
per set of such parameters.
"""

from __future__ import annotations

import operator
from typing import Any

from gradwatch.core.config import Config
from gradwatch.core.findings import Explanation, Finding, names_text
from gradwatch.core.history import History
from gradwatch.core.stats import StepStats
from gradwatch.core.trend import once_per_check

_KEY = "frozen_param_updated"
_NOTE = "frozen_param_updated/moved"
_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_MOVING_STATE = ("momentum_buffer", "exp_avg", "square_avg", "acc_delta", "exp_inf", "ax", "mu_product")


def _moved(stats: StepStats, history: History) -> tuple[list[str], list[str]]:
    """Frozen parameters the step will still move, and why (momentum / weight decay)."""
    extra = stats.extra
    params = extra.get("params")
    if not isinstance(params, list) or len(params) != len(stats.names):
        return [], []
    if extra.get("params_trainable") or ("params_trainable" not in extra and all(map(_REQUIRES_GRAD, params))):
        return [], []  # the usual step: nothing frozen holds a gradient (the flags read with the gradients)
    return _frozen_moved(stats, history)


@once_per_check
def _frozen_moved(stats: StepStats, history: History) -> tuple[list[str], list[str]]:
    """:func:`_moved` for a step on which a parameter without ``requires_grad`` holds a gradient."""
    params: list[Any] = stats.extra["params"]
    opt: Any = stats.extra.get("optimizer")
    if opt is None:
        return [], []
    decay = {id(p) for g in opt.param_groups if g.get("weight_decay", 0) for p in g["params"]}
    names: list[str] = []
    why: set[str] = set()
    for n, p in zip(stats.names, params):
        if p.requires_grad:
            continue
        state = opt.state.get(p) or {}
        momentum = any(k in state for k in _MOVING_STATE)
        if momentum or id(p) in decay:
            names.append(n)
            why.update(["momentum"] if momentum else [])
            why.update(["weight decay"] if id(p) in decay else [])
    return names, sorted(why)


def check(stats: StepStats, history: History, config: Config) -> list[Finding]:
    names, why = _moved(stats, history)
    if not names:
        return []
    stats.extra[_NOTE] = tuple(names)  # for remember: the flags are read once per step (a property per parameter)
    if history.reported.get(_KEY) == tuple(names):
        return []
    opt = stats.extra.get("optimizer")
    kind = type(opt).__name__
    return [
        Finding(
            kind=_KEY,
            step=stats.step,
            severity="warning",
            explanation=Explanation(
                what=f"{len(names)} parameter(s) have requires_grad=False but still hold a gradient at step "
                f"{stats.step} (a zero tensor that zero_grad(set_to_none=False) keeps), so {kind} keeps "
                f"updating them with its {' and '.join(why)}: {names_text(names)}.",
                why="the layers you froze keep drifting; fine-tuning or a frozen teacher silently changes.",
                fix="when freezing, also drop their gradients (p.grad = None, or zero_grad(set_to_none=True), "
                "the default), or remove them from the optimizer; a param group with lr=0 still applies weight "
                "decay in AdamW.",
            ),
            params=tuple(names),
            data={"optimizer": stats.optimizer_index, "causes": why, "count": len(names)},
        )
    ]


def remember(stats: StepStats, history: History) -> None:
    names = stats.extra.get(_NOTE)
    if names:
        history.reported[_KEY] = names
