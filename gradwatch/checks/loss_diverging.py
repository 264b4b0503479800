"""``loss_diverging``: the loss climbed far above where the run started, and stays there.

A learning rate far too high (an ``lr`` typo, Adam without warm-up on a Transformer) can throw the loss up
in the first steps and keep it there with finite gradients: the rolling windows of ``loss_spike`` and
``exploding_grad`` then take the diverged level for normal. This check compares with the run's start: the
lowest of its first ``START`` observed losses. Reported once, when the last ``RECENT`` checked losses are
all above ``FLOOR`` times that start and their median above ``FACTOR`` times it, within the first ``EARLY``
checked steps. Positive losses only (a
loss that can be negative has no such scale), a start of at least ``MIN_START`` (a loss that starts at almost
zero, an actor's loss from a critic near 0 or a zero-initialized output, has no scale to be 10x of either),
and not with several optimizers (GAN losses rise by design).
"""

from __future__ import annotations

from typing import Any

from gradwatch.config import Config
from gradwatch.findings import Finding
from gradwatch.history import History
from gradwatch.magnitude import median
from gradwatch.stats import StepStats

START = 3
RECENT = 10
#: Only within the run's first checked steps with a loss: a learning rate far too high throws the loss up
#: at once. Later, a loss can grow by design (a REINFORCE loss summed over longer episodes, a target scale
#: a curriculum raises); later instabilities are ``loss_spike``'s and ``exploding_grad``'s.
EARLY = 50
JUMP = 3.0
_COUNT = "loss_diverging/checks"
FACTOR = 10.0
FLOOR = 3.0
MIN_START = 1e-3
_FIRST = "loss_diverging/first"
_KEY = "loss_diverging"


def _recent(stats: StepStats, history: History) -> list[float]:
    losses = list(history.losses)[-(RECENT - 1) :]
    return [*losses, stats.loss] if stats.loss is not None else losses


def _facts(stats: StepStats, history: History) -> tuple[float, float, int] | None:
    """``(start, median of the recent losses, how many)`` when the loss has diverged; else None."""
    first = history.memory.get(_FIRST)
    if not isinstance(first, list) or len(first) < START or history.reported.get(_KEY):
        return None
    if history.memory.get(_COUNT, 0) >= EARLY:
        return None
    if stats.loss is None or stats.loss_nonfinite or stats.extra.get("several_optimizers"):
        return None
    start = min(first)
    if start < MIN_START:
        return None
    recent = _recent(stats, history)
    if len(recent) < RECENT or min(recent) <= FLOOR * start:
        return None
    level = median(recent)
    if not level > FACTOR * start:
        return None
    # Thrown up, not grown: some checked step jumped JUMP x over the one before (a loss whose scale grows
    # with a curriculum or a target amplitude climbs smoothly).
    seq = [*history.losses, stats.loss]
    if not any(b > JUMP * a for a, b in zip(seq, seq[1:]) if a > 0):
        return None
    return start, level, len(recent)


def check(stats: StepStats, history: History, config: Config) -> list[Finding]:
    facts = _facts(stats, history)
    if facts is None:
        return []
    start, level, n = facts
    lrs = _learning_rates(stats.extra.get("optimizer"))
    lr_text = f" (learning rate now {lrs})" if lrs else ""
    why = (
        "the gradient norm already overflows float32, so gradwatch skips these updates and the run has "
        "stalled; lowering the learning rate is the way out"
        if stats.overflow_norm and config.on_nonfinite == "skip"
        else "the gradients are finite, so nothing else stops the run, but it is moving away from a solution; "
        "the longer it runs, the less of the start is left to recover"
    )
    return [
        Finding(
            kind=_KEY,
            step=stats.step,
            severity="warning",
            message=(
                f"The loss is diverging: its median over the last {n} checked steps is {level:.4g}, "
                f"{level / start:.3g}x the {start:.4g} it started at (lowest of the first {START} checked steps), "
                f"and none of those steps came back below {FLOOR:g}x the start{lr_text}.\n"
                f"Why it matters: {why}.\n"
                "Fix: lower the learning rate (10x at a time; check for a typo such as lr=1 instead of 1e-3), "
                "add a warm-up for Adam on Transformers, clip gradients "
                "(torch.nn.utils.clip_grad_norm_), and check that the loss is minimized (not maximized) "
                "with targets on the scale the model can reach."
            ),
            data={"start": start, "median": level, "ratio": level / start, "steps": n},
        )
    ]


def _learning_rates(optimizer: Any) -> str:
    groups = getattr(optimizer, "param_groups", None)
    if not groups:
        return ""
    lrs = sorted({float(g["lr"]) for g in groups if isinstance(g.get("lr"), (int, float))})
    return ", ".join(f"{lr:g}" for lr in lrs[:4])


def remember(stats: StepStats, history: History) -> None:
    if _facts(stats, history) is not None:
        history.reported[_KEY] = True
    if stats.loss is None or stats.loss_nonfinite:
        return
    history.memory[_COUNT] = history.memory.get(_COUNT, 0) + 1
    first = history.memory.setdefault(_FIRST, [])
    if len(first) < START:
        first.append(float(stats.loss))
