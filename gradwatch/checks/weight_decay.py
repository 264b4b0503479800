"""``weight_decay_too_large``: a parameter group whose ``lr * weight_decay`` is 1 or more.

Weight decay multiplies the weights by ``1 - lr * weight_decay`` each step (SGD, AdamW, and optimizers with
``decoupled_weight_decay=True``; Adam's or Adagrad's coupled L2 is normalized with the gradient and is left
out): at 1 or more they flip sign and grow every step, so the run blows up within a few steps. It is almost
always a typo (``weight_decay=5e2`` for ``5e-4``). Looked at on the first check and again whenever a group's
``lr`` or ``weight_decay`` changed (a warm-up that writes ``param_group["lr"]`` crosses 1 at a later step),
until reported once per optimizer: a comparison of a few floats per step.
"""

from __future__ import annotations

import torch

from gradwatch.core.config import Config
from gradwatch.core.findings import Explanation, Finding
from gradwatch.core.history import History
from gradwatch.core.stats import StepStats

_KEY = "weight_decay_too_large/{}"
#: ``{optimizer index: every group's (lr, weight_decay)}`` at the last look.
_SEEN = "weight_decay_too_large/settings"


def _settings(groups: list[dict]) -> list[tuple[object, object]]:
    """Every group's ``(lr, weight_decay)``, compared from one step to the next."""
    return [(_plain(g.get("lr", 0.0)), _plain(g.get("weight_decay", 0.0))) for g in groups]


def _plain(v: object) -> object:
    """A value that compares without a sync: a CPU number as a float, a device tensor by its version."""
    if type(v) is float:  # the usual group
        return v
    if isinstance(v, torch.Tensor):
        return float(v) if v.device.type == "cpu" and v.numel() == 1 else (id(v), v._version)
    return v


def check(stats: StepStats, history: History, config: Config) -> list[Finding]:
    key = _KEY.format(stats.optimizer_index)
    if history.reported.get(key):
        return []
    optimizer = stats.extra.get("optimizer")
    groups = getattr(optimizer, "param_groups", None) or ()
    settings = stats.extra[_SEEN] = _settings(groups)
    if history.memory.get(_SEEN, {}).get(stats.optimizer_index) == settings:
        return []  # no group's lr or weight_decay changed since the last look
    multiplicative = isinstance(optimizer, (torch.optim.SGD, torch.optim.AdamW))
    for i, group in enumerate(groups):
        if not (multiplicative or group.get("decoupled_weight_decay")):
            continue  # coupled L2 in an adaptive optimizer (Adam, Adagrad) is normalized with the gradient
        try:
            lr, wd = float(group.get("lr", 0.0)), float(group.get("weight_decay", 0.0))
        except (TypeError, ValueError):  # a tensor learning rate of several elements, a custom group
            continue
        if wd > 0 and lr > 0 and lr * wd >= 1.0:
            stats.extra[key] = True
            factor = 1.0 - lr * wd
            return [
                Finding(
                    kind="weight_decay_too_large",
                    step=stats.step,
                    severity="warning",
                    explanation=Explanation(
                        what=f"Parameter group {i} of optimizer {stats.optimizer_index} ({type(optimizer).__name__}) has "
                        f"lr={lr:g} and weight_decay={wd:g}: lr * weight_decay = {lr * wd:.3g}, so each step "
                        f"multiplies its weights by about {factor:.3g}.",
                        why="with a factor at or below 0 the weights flip sign and grow every step; "
                        "the loss explodes within a few steps and no clipping stops it.",
                        fix=f"weight_decay is usually 1e-4 to 0.1 (is {wd:g} a typo, such as 5e2 for 5e-4?); "
                        "keep lr * weight_decay far below 1.",
                    ),
                    data={"optimizer": stats.optimizer_index, "group": i, "lr": lr, "weight_decay": wd},
                )
            ]
    return []


def remember(stats: StepStats, history: History) -> None:
    key = _KEY.format(stats.optimizer_index)
    if stats.extra.get(key):
        history.reported[key] = True
    if _SEEN in stats.extra:
        history.memory.setdefault(_SEEN, {})[stats.optimizer_index] = stats.extra[_SEEN]
