"""``loss_spike``: the loss jumps far above its recent robust range.

The loss comes from ``observe_loss`` (plain loop) or the training loss (Lightning). A spike is a loss more
than ``spike_factor`` robust spreads above its median over the last ``window`` checked steps. The spread
is the largest of: the MAD scaled to a standard deviation, the distance from the median to the 90th
percentile (losses close to zero are heavy-tailed: a few batches at 10x the median are normal), and a
quarter of the median's size (so a run whose loss has flattened does not flag ordinary batch noise), and
a twentieth of the run's starting loss (the 90th percentile of its first 20 losses: a run that converged
by orders of magnitude wiggles far below where it started, and a hard batch of an easy task is no spike;
a spike must climb back to half the starting loss). Waits for 20 losses of history; a
persisting spike is reported once, and again only after 10 checked steps without one. Decreases never
count.

A spike that rises no higher above the median than ``RANGE_FACTOR`` x the highest loss of the run's first
20 checked steps, of an earlier spike that fell back, or of the last ``window`` does is reported only if it
has not fallen back to half its height within ``SETTLE`` checked losses: a DQN's target-network sync throws the loss back to where the run
started, a sparse reward or a rare violated margin lifts a loss that is mostly exactly 0, a task sampled
now and then has a larger loss scale; each falls back at the next step. A spike beyond that range (a
corrupted batch, a divergence) is reported at its step.

A jump found at the first judged step that started earlier inside the 20 losses it is judged against (a
loss weighted 1000x from step 15) is reported at the same step, in words naming the step it started
(``data["since"]``) and the median of the losses before it.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import replace
from typing import Any

from gradwatch.core.clipping import clip_advice, clipping_in_place
from gradwatch.core.config import Config
from gradwatch.core.findings import Explanation, Finding
from gradwatch.core.history import History
from gradwatch.core.trend import EARLY_LOSS, jump_start, matching_steps, once_per_check, quantile, robust_spread

#: Runs only on steps where one of these facts holds (see :data:`gradwatch.checks.FACTS`).
WHEN = ('loss',)

#: Losses of history the test waits for.
MIN_HISTORY = 20
#: Smallest spread, as a fraction of the median's size.
MIN_RELATIVE_SPREAD = 0.25
#: Checked steps without a spike before a new one is reported.
REARM = 10

_KEY = "loss_spike"
_RECORD = "loss_spike/record"
#: How much larger than every spike reported before a later spike must be to be reported again.
RECORD_FACTOR = 2.0
#: Shared with the other checks: the median loss of the run's first ``MIN_HISTORY`` checked steps.
_EARLY = EARLY_LOSS
#: The run's starting loss (90th percentile of its first ``MIN_HISTORY`` checked losses: a loss that falls
#: within those steps is measured where it started), and the fraction of it below which a change is never a
#: spike.
_START = "loss_spike/start"
START_FRACTION = 5e-2
#: The highest of the run's first ``MIN_HISTORY`` checked losses, or of a later spike that fell back.
_PEAK = "loss_spike/peak"
#: A spike at most this many times as high above the median as the highest loss of the run's start or of
#: the recent window is within the range the run has shown: judged by whether it falls back.
RANGE_FACTOR = 2.0
#: Checked losses a spike within that range has to fall back below ``1 / FALL`` of its height above the
#: median; one that has not is reported then (a loss that stays up is no transient).
SETTLE = 3
FALL = 2.0
#: The spike within the run's range that is waiting to fall back.
_PENDING = "loss_spike/pending"
#: ``(step, loss)`` of the first ``MIN_HISTORY`` checked losses: a spike found at the first judged step
#: names the step its jump started when that lies inside them (see :func:`_started`).
_STEPS = "loss_spike/steps"
#: A note for remember: where the jump of a spike waiting to fall back started.
_STARTED = "loss_spike/started"


@once_per_check
def _facts(stats: Any, history: History) -> tuple[float, float, float, int] | None:
    loss = stats.loss
    if loss is None or stats.loss_nonfinite or not math.isfinite(loss) or len(history.losses) < MIN_HISTORY:
        return None
    passes = stats.extra.get("backward_passes")
    if isinstance(passes, tuple) and passes[1] > 0:
        # zero_grad() between this step's backward passes (per-sample gradients, DP-SGD by hand): the loss
        # left for the step is the last pass's only, one sample's, not the step's.
        return None
    # A run that converged by orders of magnitude: wiggles far below its early losses are not spikes.
    start = history.memory.get(_START)
    m, spread = _range(history.losses, START_FRACTION * abs(start) if isinstance(start, float) else 0.0)
    if not math.isfinite(m):
        return None
    return loss, m, spread, len(history.losses)


def _range(losses: Any, floor: float) -> tuple[float, float]:
    """``(median, spread)`` of these losses, the spread at least ``floor``."""
    m, spread = robust_spread(losses)
    # Losses near their floor are heavy-tailed (most batches ~0, a few 10x that): the upper tail of the
    # recent losses is part of their normal range, so the spread is at least 90th percentile - median.
    tail = quantile(losses, 0.9) - m
    return m, max(spread, tail, MIN_RELATIVE_SPREAD * abs(m), floor, 1e-12)


def _started(history: History, facts: tuple[float, float, float, int], config: Config) -> dict[str, Any] | None:
    """At the first judged step: where the jump started when it lies inside the losses judged against (the
    unbroken run of losses above the spike threshold of the losses before it that reaches this step), as
    the words of a spike that has not fallen back since; None when the jump is this step's loss alone."""
    loss, _, _, n = facts
    if n != MIN_HISTORY:
        return None
    pairs = matching_steps(history.memory.get(_STEPS), list(history.losses))
    if pairs is None:
        return None

    def threshold(values: list[float]) -> float:
        m, spread = _range(values, 0.0)
        return m + config.spike_factor * spread

    found = jump_start(pairs, loss, threshold)
    if found is None:
        return None
    step, before = found
    m, spread = _range(before, 0.0)
    first = pairs[len(before)][1]
    return {"step": step, "loss": first, "median": m, "spread": spread, "n": len(before), "height": first - m}


def _spiking(facts: tuple[float, float, float, int], config: Config) -> bool:
    loss, m, spread, _ = facts
    return loss > m + config.spike_factor * spread


def check(stats: Any, history: History, config: Config) -> list[Finding]:
    facts = _facts(stats, history)
    if facts is None:
        return []
    pending = history.memory.get(_PENDING)
    if isinstance(pending, dict):
        # A spike within the run's range: reported when it has not fallen back after SETTLE checked losses,
        # or at once when it rises RANGE_FACTOR x higher.
        height = facts[0] - pending["median"]
        if height > pending["height"] / FALL and (pending["left"] <= 1 or height > RANGE_FACTOR * pending["height"]):
            stats.extra[_RECORD] = pending["height"]
            stats.extra[_PENDING] = "reported"
            return [_finding(stats, facts, pending.get("started") or pending, this_step=False)]
    if not _spiking(facts, config):
        return []
    if any(_spiking(f, config) for f in history.memory.get(_KEY, ())):
        return []
    loss, m, _, _ = facts
    # Spikes of the same size recurring (a DQN's target-network sync): reported once; a later one only
    # when it rises RECORD_FACTOR x higher above the median than every spike reported before.
    size = loss - m  # in loss units: as the run settles its spread shrinks, a recurring jump does not
    record = history.memory.get(_RECORD)
    if isinstance(record, float) and size <= RECORD_FACTOR * record:
        return []
    started = _started(history, facts, config)
    if pending is None and _within_range(facts, history):
        stats.extra[_PENDING] = "new"  # a note for remember: wait for it to fall back
        stats.extra[_STARTED] = started
        return []
    stats.extra[_RECORD] = size
    return [_finding(stats, facts, started, this_step=True)]


def _within_range(facts: tuple[float, float, float, int], history: History) -> bool:
    """True for a loss at most RANGE_FACTOR x as high above the median as the highest loss of the run's
    start or of the recent window (only asked about a step that already clears the spike threshold)."""
    loss, m, _, _ = facts
    peak = history.memory.get(_PEAK)
    top = max(history.losses)
    if isinstance(peak, float):
        top = max(top, peak)
    return loss - m <= RANGE_FACTOR * (top - m)


def _finding(
    stats: Any, facts: tuple[float, float, float, int], since: dict[str, Any] | None, *, this_step: bool
) -> Finding:
    loss, m, spread, n = facts
    if since is None:
        what = (
            f"Loss spike at step {stats.step}: the loss is {loss:.4g}, {(loss - m) / spread:.3g} robust spreads "
            f"above its median of {m:.4g} over the last {n} checked steps (spread {spread:.3g})."
        )
    else:
        m, spread = since["median"], since["spread"]
        what = (
            f"Loss spike at step {since['step']}: the loss rose to {since['loss']:.4g}, "
            f"{since['height'] / spread:.3g} robust spreads above its median of {m:.4g} over the "
            f"{since['n']} checked steps before (spread {spread:.3g}), and has not fallen back since "
            f"({loss:.4g} at step {stats.step})."
        )
    return Finding(
        kind="loss_spike",
        step=stats.step,
        severity="warning",
        explanation=_explain(what, stats, this_step),
        data={
            "loss": loss,
            "median": m,
            "spread": spread,
            "optimizer": stats.optimizer_index,
            **({"since": since["step"]} if since is not None else {}),
        },
    )


#: Said after every fix: a jump planned by the training code is not a fault.
_EXPECTED = (
    " (If the objective or the data changed at this step on purpose, e.g. a loss term switched on or a harder "
    "curriculum stage, a jump is expected.)"
)


def _explain(what: str, stats: Any, this_step: bool) -> Explanation:
    """Lightning clips after gradwatch's check: a user who clips already is told so, not to add clipping."""
    clipped = clipping_in_place(stats, this_step)
    why, fix = _clipped_words(stats, clipped) if clipped is not None else _unclipped_words(stats)
    return Explanation(what=what, why=why, fix=fix + _EXPECTED)


def _clipped_words(stats: Any, clipped: str) -> tuple[str, str]:
    """Why and fix when the loop already clips: this update was bounded, the batch still needs a look."""
    unless = "if it clipped this step, " if stats.extra["clipping"]["how"] == "module" else ""
    why = (
        f"a spike often precedes divergence; {clipped}, so {unless}this update did not throw the weights far, "
        "but the batch or the training that produced the spike still needs a look."
    )
    fix = (
        "clipping is in place (keep it); lower the learning rate or lengthen warm-up, and check this "
        "step's batch for bad samples or labels; with mixed precision, check for overflow in the loss."
    )
    return why, fix


def _unclipped_words(stats: Any) -> tuple[str, str]:
    """Why and fix when nothing bounds the update: clip, and look at the batch."""
    why = (
        "a spike often precedes divergence, and even when the loss recovers the "
        "weights were pushed away from where training was (progress lost, Adam's moments polluted)."
    )
    fix = (
        f"lower the learning rate or lengthen warm-up, clip gradients ({clip_advice(stats)}), and check "
        "this step's batch for bad samples or labels; with mixed precision, check for overflow in the loss."
    )
    return why, fix


def _clipped_after_check(f: Finding, stats: Any, history: History) -> Finding:
    """The finding worded again once the step's gradients are known to have been clipped after the check
    (Lightning: the module's own on_before_optimizer_step; see gradwatch.core.held)."""
    if f.explanation is None:
        return f
    # A spike that waited to fall back is worded as of its own step; one found now, as of this step.
    this_step = stats.extra.get(_PENDING) != "reported"
    return replace(f, explanation=_explain(f.explanation.what, stats, this_step))


#: Kinds whose words depend on clipping measured after the check (see gradwatch.core.held).
CLIPPED_AFTER_CHECK = {"loss_spike": _clipped_after_check}


def remember(stats: Any, history: History) -> None:
    size = stats.extra.get(_RECORD)
    if isinstance(size, float):
        record = history.memory.get(_RECORD)
        history.memory[_RECORD] = max(size, record) if isinstance(record, float) else size
    facts = _facts(stats, history)
    if stats.loss is None:
        return
    if facts is None and len(history.losses) < MIN_HISTORY and not stats.loss_nonfinite and math.isfinite(stats.loss):
        history.memory.setdefault(_STEPS, []).append((stats.step, float(stats.loss)))
    recent = history.memory.setdefault(_KEY, deque(maxlen=REARM))
    if facts is not None:
        recent.append(facts)
        if _EARLY not in history.memory:
            history.memory[_EARLY] = float(facts[1])
        if _START not in history.memory:
            history.memory[_START] = float(quantile(history.losses, 0.9))
            history.memory[_PEAK] = float(max(history.losses))
        note = stats.extra.get(_PENDING)
        pending = history.memory.get(_PENDING)
        if note == "new":
            loss, m, spread, n = facts
            history.memory[_PENDING] = {
                "step": stats.step,
                "loss": loss,
                "median": m,
                "spread": spread,
                "n": n,
                "height": loss - m,
                "left": SETTLE,
                "started": stats.extra.get(_STARTED),
            }
        elif isinstance(pending, dict):
            if note == "reported" or facts[0] - pending["median"] <= pending["height"] / FALL:
                del history.memory[_PENDING]
                if note != "reported":  # fell back: a transient of a healthy run, now part of its range
                    peak = history.memory.get(_PEAK)
                    history.memory[_PEAK] = max(pending["loss"], peak) if isinstance(peak, float) else pending["loss"]
            else:
                pending["left"] -= 1
