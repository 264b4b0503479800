"""``loss_diverging``: the loss climbed far above where the run started, and stays there.

A learning rate far too high (an ``lr`` typo, Adam without warm-up on a Transformer) can throw the loss up
in the first steps and keep it there with finite gradients: the rolling windows of ``loss_spike`` and
``exploding_grad`` then take the diverged level for normal. This check compares with the run's start, robustly: one batch of a small-batch run can be 100x below the
level (a batch-size-1 squared error is 100x below its median one time in twenty), so a single lucky batch is
no reference. Reported once, within the first ``EARLY`` checked steps, when the last ``RECENT`` checked losses
are all above ``FLOOR`` times the start and their median is above the start by a margin that grows with the
noise the run shows, for one of two references (``REFERENCES``):

- ``median``: the median of the first ``START`` checked losses; the margin is ``FACTOR`` times
  ``exp(NOISE x`` the median step-to-step change of log-loss in the recent window``)``: a loss that moves 3x
  from batch to batch needs to climb 10 x 9 = 90x before it counts.
- ``lowest``: the lowest of the first ``FAST`` checked losses, for a loss thrown up at once (at step 1, before
  any median can form); this one value may be a lucky batch, so the recent window must lie far above it
  compared with its own spread: median over start at least (median over lowest recent) ** ``DEPTH``. A loss
  thrown 15x and staying within 1.3x of its level passes; a noisy loss never does.

Positive losses only (a loss that can be negative has no such scale), a start of at least ``MIN_START`` (a
loss that starts at almost zero, an actor's loss from a critic near 0 or a zero-initialized output, has no
scale to be 10x of either), and not with several optimizers (GAN losses rise by design).

Also reported: a loss thrown ``PEAK`` x above that start that then falls back because the model died (every
gradient exactly zero for ``DEAD`` checked steps in a row: exploded weights saturate the units, or x ** 2 in
a norm overflows and rsqrt(inf) = 0 zeroes the activations). Its loss looks calm, but the run has stopped.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Any

from gradwatch.core.config import Config
from gradwatch.core.findings import Explanation, Finding
from gradwatch.core.history import History
from gradwatch.core.stats import StepStats
from gradwatch.core.trend import median

#: Runs only on steps where one of these facts holds (see :data:`gradwatch.checks.FACTS`).
WHEN = ('loss',)

START = 5
FAST = 3
RECENT = 10
#: Only within the run's first checked steps with a loss: a learning rate far too high throws the loss up
#: at once. Later, a loss can grow by design (a REINFORCE loss summed over longer episodes, a target scale
#: a curriculum raises); later instabilities are ``loss_spike``'s and ``exploding_grad``'s.
EARLY = 50
JUMP = 3.0
_COUNT = "loss_diverging/checks"
FACTOR = 10.0
FLOOR = 3.0
#: ``median`` reference: the margin over FACTOR, per unit of the recent window's median |log(loss / previous)|.
NOISE = 2.0
#: ``lowest`` reference: the start must lie below the recent median by this power of the window's own spread.
DEPTH = 8.0
MIN_START = 1e-3
_FIRST = "loss_diverging/first"
#: ``(step, loss)`` of the first EARLY checked losses: the step where the loss left its range is named from
#: them (the recent window is losses alone; the jump may lie before the RECENT steps the check reads).
_STEPS = "loss_diverging/steps"
_KEY = "loss_diverging"
#: A loss thrown this many times above the start, and then every gradient exactly zero for DEAD checked steps
#: in a row: the run diverged and died (saturated or dead units pass no gradient back), so the loss falls back
#: to a constant and the "stays up" test above never fires. A healthy run never has both.
PEAK = 100.0
DEAD = 3


def _recent(stats: StepStats, history: History) -> list[float]:
    losses = list(history.losses)[-(RECENT - 1) :]
    return [*losses, stats.loss] if stats.loss is not None else losses


def _step_noise(recent: list[float]) -> float:
    """Median |log(loss / previous loss)| over the window: how far the loss moves from batch to batch."""
    return median(abs(math.log(b / a)) for a, b in itertools.pairwise(recent))


def _median_margin(first: list[float], recent: list[float], level: float) -> tuple[float, float]:
    return median(first[:START]), FACTOR * math.exp(NOISE * _step_noise(recent))


def _lowest_margin(first: list[float], recent: list[float], level: float) -> tuple[float, float]:
    return min(first[:FAST]), max(FACTOR, (level / min(recent)) ** DEPTH)


Margin = Callable[[list[float], list[float], float], tuple[float, float]]
#: reference name -> (how the start is told in the message, ``(first, recent, level) -> (start, margin)``).
REFERENCES: dict[str, tuple[str, Margin]] = {
    "median": (f"median of the first {START} checked steps", _median_margin),
    "lowest": (
        f"lowest of the first {FAST} checked steps; the recent steps stay close to their own median",
        _lowest_margin,
    ),
}


def _facts(stats: StepStats, history: History) -> tuple[float, float, int, str] | None:
    """``(start, median of the recent losses, how many, reference)`` when the loss has diverged; else None."""
    first = history.memory.get(_FIRST)
    if not isinstance(first, list) or len(first) < START or history.reported.get(_KEY):
        return None
    if history.memory.get(_COUNT, 0) >= EARLY:
        return None
    if stats.loss is None or stats.loss_nonfinite or stats.extra.get("several_optimizers"):
        return None
    recent = _recent(stats, history)
    if len(recent) < RECENT or min(recent) <= 0:
        return None
    # Thrown up, not grown: some checked step jumped JUMP x over the one before (a loss whose scale grows
    # with a curriculum or a target amplitude climbs smoothly).
    seq = [*history.losses, stats.loss]
    if not any(b > JUMP * a for a, b in itertools.pairwise(seq) if a > 0):
        return None
    level = median(recent)
    for name, (_, margin) in REFERENCES.items():
        start, needed = margin(first, recent, level)
        if start >= MIN_START and min(recent) > FLOOR * start and level > needed * start:
            return start, level, len(recent), name
    return None


def _died(stats: StepStats, history: History) -> tuple[float, float] | None:
    """``(start, peak)`` when the loss was thrown PEAK x above its start and the whole model's gradient has
    been exactly zero since (DEAD checked steps); else None."""
    first = history.memory.get(_FIRST)
    if not isinstance(first, list) or len(first) < START or history.reported.get(_KEY):
        return None
    if history.memory.get(_COUNT, 0) >= EARLY or not stats.names or stats.total_norm != 0.0:
        return None
    if stats.loss is None or stats.loss_nonfinite or stats.extra.get("several_optimizers"):
        return None
    norms = list(history.total_norms.get(stats.optimizer_index, ()))[-(DEAD - 1) :]
    if len(norms) < DEAD - 1 or any(v != 0.0 for v in norms):
        return None
    start = min(first[:FAST])
    if start < MIN_START:
        return None
    seq = [*history.losses, stats.loss]
    peak = max(seq)
    at = seq.index(peak)
    if not peak > PEAK * start or not any(b > JUMP * a for a, b in itertools.pairwise(seq[: at + 1]) if a > 0):
        return None
    return start, peak


def check(stats: StepStats, history: History, config: Config) -> list[Finding]:
    died = _died(stats, history)
    if died is not None:
        return [_died_finding(stats, *died)]
    facts = _facts(stats, history)
    if facts is None:
        return []
    start, level, n, reference = facts
    lrs = _learning_rates(stats.extra.get("optimizer"))
    lr_text = f" (learning rate now {lrs})" if lrs else ""
    why = _WHY["stalled" if stats.overflow_norm and config.on_nonfinite == "skip" else "moving_away"]
    since = _left_range(stats, history, start)
    return [
        Finding(
            kind=_KEY,
            step=stats.step,
            severity="warning",
            explanation=Explanation(
                what=f"The loss is diverging{_SINCE[since is not None](since)}: its median over the last {n} "
                f"checked steps is {level:.4g}, {level / start:.3g}x the {start:.4g} it started at "
                f"({REFERENCES[reference][0]}), and none of those steps came back below {FLOOR:g}x the "
                f"start{lr_text}.",
                why=f"{why}.",
                fix="lower the learning rate (10x at a time; check for a typo such as lr=1 instead of 1e-3), "
                "add a warm-up for Adam on Transformers, clip gradients "
                "(torch.nn.utils.clip_grad_norm_), and check that the loss is minimized (not maximized) "
                "with targets on the scale the model can reach.",
            ),
            data={
                "start": start, "median": level, "ratio": level / start, "steps": n, "reference": reference,
                **({"since": since} if since is not None else {}),
            },
        )
    ]


def _left_range(stats: StepStats, history: History, start: float) -> int | None:
    """The first checked step of the run of losses above FLOOR x the start that goes on to this step: where
    the loss left its range (it may lie before the RECENT steps the check reads). None when the steps of
    the losses are not known (a run resumed from a checkpoint)."""
    pairs = history.memory.get(_STEPS)
    if not pairs:
        return None
    since = stats.step
    for step, loss in reversed(pairs):
        if loss <= FLOOR * start:
            return since
        since = step
    return since


#: When the step the loss left its range is known, the finding's first words name it.
_SINCE: dict[bool, Callable[[int | None], str]] = {
    True: lambda since: f" since step {since}, where it left its range",
    False: lambda since: "",
}


#: Why a diverging loss matters, by where the run is: its updates skipped for an overflowing gradient norm
#: (stalled), or still applied (moving away from a solution).
_WHY = {
    "stalled": "the gradient norm already overflows float32, so gradwatch skips these updates and the run has "
    "stalled; lowering the learning rate is the way out",
    "moving_away": "the gradients are finite, so nothing else stops the run, but it is moving away from a solution; "
    "the longer it runs, the less of the start is left to recover",
}


def _died_finding(stats: StepStats, start: float, peak: float) -> Finding:
    lrs = _learning_rates(stats.extra.get("optimizer"))
    lr_text = f" (learning rate now {lrs})" if lrs else ""
    return Finding(
        kind=_KEY,
        step=stats.step,
        severity="warning",
        explanation=Explanation(
            what=f"The loss diverged and the model died: it rose from {start:.4g} (lowest of the first {FAST} checked "
            f"steps) to {peak:.4g}, {peak / start:.3g}x, and for the last {DEAD} checked steps every gradient has "
            f"been exactly zero, the loss stuck at {stats.loss:.4g}{lr_text}.",
            why="the updates threw the weights so far that no gradient flows back any more "
            "(saturated or dead units); the loss looks calm, but the run has stopped learning and will not "
            "recover by itself.",
            fix="restart from the initial weights (or a checkpoint from before the jump) with a lower learning "
            "rate (10x at a time; check for a typo, and that a warm-up schedule starts low: a LambdaLR factor "
            "above 1 at step 0 multiplies the peak learning rate), and clip gradients "
            "(torch.nn.utils.clip_grad_norm_).",
        ),
        data={"start": start, "peak": peak, "ratio": peak / start, "dead_steps": DEAD, "died": True},
    )


def _learning_rates(optimizer: Any) -> str:
    groups = getattr(optimizer, "param_groups", None)
    if not groups:
        return ""
    lrs = sorted({float(g["lr"]) for g in groups if isinstance(g.get("lr"), (int, float))})
    return ", ".join(f"{lr:g}" for lr in lrs[:4])


def remember(stats: StepStats, history: History) -> None:
    if _died(stats, history) is not None or _facts(stats, history) is not None:
        history.reported[_KEY] = True
        history.memory.pop(_STEPS, None)
    if stats.loss is None or stats.loss_nonfinite:
        return
    history.memory[_COUNT] = count = history.memory.get(_COUNT, 0) + 1
    if count <= EARLY and not history.reported.get(_KEY):  # at most EARLY pairs: the check stops there
        history.memory.setdefault(_STEPS, []).append((stats.step, float(stats.loss)))
    first = history.memory.setdefault(_FIRST, [])
    if len(first) < START:  # FAST <= START: both references read this list
        first.append(float(stats.loss))
