"""``lr_too_high``: one of the first updates moved the whole model by many times its own weights.

:mod:`gradwatch.observe.magnitude` measures the whole model's update-to-weight ratio
``||weights after - weights before|| / ||weights before||`` on each of the first ``EARLY_UPDATES`` checked
steps. Around 1e-3 is usual, and even the large early updates of a healthy run (no warm-up, Adam at 1e-2,
SGD with momentum at 0.1) stay well below 1. An update :data:`RATIO` times the size of the weights (judged
against a default init's size when the weights are smaller: a small init grows into it) with a learning rate
outside the usual range, or :data:`RATIO_ALONE` times with any, comes from a learning rate orders of
magnitude too large (a typo, a scheduler's peak, a unit mix-up), whatever the gradients: it is seen without any observed loss, when the loop clips (Adam's step is about ``lr`` per
element whatever the gradient's size, and clipping bounds the gradient, not ``lr`` times it), and when the
gradients stop at 0 right after (a saturated GAN discriminator). Reported once per optimizer.
"""

from __future__ import annotations

from gradwatch.checks.exploding import huge_lr, init_scale
from gradwatch.core.config import Config
from gradwatch.core.findings import Explanation, Finding
from gradwatch.core.history import History
from gradwatch.core.measured import EARLY_UPDATES, UPDATE_TOTAL, UPDATE_WEIGHTS
from gradwatch.core.stats import StepStats

#: Runs only on steps where one of these facts holds (see :data:`gradwatch.checks.FACTS`).
WHEN = ('update_measured',)

#: A whole-model update this many times the weights' norm (or a default init's, if larger), in one step, with
#: a learning rate outside the usual range (``exploding.huge_lr``); RATIO_ALONE times whatever the rate.
RATIO = 3.0
RATIO_ALONE = 100.0
#: Optimizers whose step is many iterations (a line search): one step legitimately moves the weights far.
_SECOND_ORDER = ("LBFGS",)
#: The usual update-to-weight ratio, for the factor the learning rate is off by.
USUAL = 1e-3

_KEY = "lr_too_high/{}"
_SEEN = "lr_too_high/measured"


def _judged(stats: StepStats) -> float | None:
    """The whole-model update over the larger of the weights' norm and a default init's: weights drawn
    small (N(0, 0.01), zeros) grow into their scale in the first updates, legitimately many times their size."""
    ratio, weights = stats.extra.get(UPDATE_TOTAL), stats.extra.get(UPDATE_WEIGHTS)
    if not isinstance(ratio, float) or not isinstance(weights, float) or stats.is_nonfinite:
        return None
    params = stats.extra.get("params")
    scale = init_scale(params) if isinstance(params, list) else 0.0
    return ratio * weights / max(weights, scale)


def _facts(stats: StepStats, history: History) -> dict[str, object] | None:
    if history.reported.get(_KEY.format(stats.optimizer_index)):
        return None
    if history.memory.get(_SEEN, {}).get(stats.optimizer_index, 0) > EARLY_UPDATES:
        return None
    ratio = _judged(stats)
    optimizer = stats.extra.get("optimizer")
    if ratio is None or ratio < RATIO or type(optimizer).__name__ in _SECOND_ORDER:
        return None
    if ratio < RATIO_ALONE and huge_lr(stats) is None:
        return None  # a regression onto large targets moves small weights far at first, at a usual lr
    lrs = []
    for group in getattr(optimizer, "param_groups", None) or ():
        try:
            lrs.append(float(group.get("lr", 0.0)))
        except (TypeError, ValueError, RuntimeError):
            continue
    return {"ratio": ratio, "lrs": lrs, "optimizer_class": type(optimizer).__name__ if optimizer else None}


def check(stats: StepStats, history: History, config: Config) -> list[Finding]:
    facts = _facts(stats, history)
    if facts is None:
        return []
    stats.extra[_KEY.format(stats.optimizer_index)] = True
    ratio, lrs, cls = facts["ratio"], facts["lrs"], facts["optimizer_class"]
    lr_text = f"lr={max(lrs):g}" if lrs else "the learning rate"  # type: ignore[type-var]
    of = f" ({cls}, optimizer {stats.optimizer_index})" if cls else f" (optimizer {stats.optimizer_index})"
    return [
        Finding(
            kind="lr_too_high",
            step=stats.step,
            severity="warning",
            explanation=Explanation(
                what=f"Learning rate far too high at step {stats.step}: the update before this step moved the "
                f"model's weights by {ratio:.3g}x their own norm in a single step, with {lr_text}{of}. "
                f"A usual update is about {USUAL:g} of the weights' norm, so the learning rate is about "
                f"{ratio / USUAL:.0e}x too large.",
                why="each update throws the weights far from where they were, so the model "
                "cannot learn: the loss jumps and diverges, or the network saturates and its gradients go to "
                "0. Clipping gradients does not help: it bounds the gradient, not the learning rate times it "
                "(Adam's step is about lr per weight whatever the gradient).",
                fix=f"lower the learning rate ({lr_text} looks like a typo or a unit mix-up: SGD usually uses "
                "1e-3 to 1e-1, Adam 1e-5 to 1e-3); check a scheduler's peak (max_lr of OneCycleLR, the end of "
                "a warm-up) and that the value reaches the optimizer as meant.",
            ),
            data={"ratio": ratio, "lr": lrs, "optimizer": stats.optimizer_index, "threshold": RATIO},
        )
    ]


def remember(stats: StepStats, history: History) -> None:
    key = _KEY.format(stats.optimizer_index)
    if stats.extra.get(key):
        history.reported[key] = True
    if isinstance(stats.extra.get(UPDATE_TOTAL), float):
        seen = history.memory.setdefault(_SEEN, {})
        seen[stats.optimizer_index] = seen.get(stats.optimizer_index, 0) + 1
