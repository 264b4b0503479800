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
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

from gradwatch.config import Config
from gradwatch.findings import Finding
from gradwatch.history import History
from gradwatch.magnitude import EARLY_LOSS, once_per_check, quantile, robust_spread

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
    m, spread = robust_spread(history.losses)
    if not math.isfinite(m):
        return None
    # Losses near their floor are heavy-tailed (most batches ~0, a few 10x that): the upper tail of the
    # recent losses is part of their normal range, so the spread is at least 90th percentile - median.
    tail = quantile(history.losses, 0.9) - m
    # A run that converged by orders of magnitude: wiggles far below its early losses are not spikes.
    start = history.memory.get(_START)
    floor = START_FRACTION * abs(start) if isinstance(start, float) else 0.0
    spread = max(spread, tail, MIN_RELATIVE_SPREAD * abs(m), floor, 1e-12)
    return loss, m, spread, len(history.losses)


def _spiking(facts: tuple[float, float, float, int], config: Config) -> bool:
    loss, m, spread, _ = facts
    return loss > m + config.spike_factor * spread


def check(stats: Any, history: History, config: Config) -> list[Finding]:
    facts = _facts(stats, history)
    if facts is None or not _spiking(facts, config):
        return []
    if any(_spiking(f, config) for f in history.memory.get(_KEY, ())):
        return []
    loss, m, spread, n = facts
    # Spikes of the same size recurring (a DQN's target-network sync): reported once; a later one only
    # when it rises RECORD_FACTOR x higher above the median than every spike reported before.
    size = loss - m  # in loss units: as the run settles its spread shrinks, a recurring jump does not
    record = history.memory.get(_RECORD)
    if isinstance(record, float) and size <= RECORD_FACTOR * record:
        return []
    stats.extra[_RECORD] = size
    return [
        Finding(
            kind="loss_spike",
            step=stats.step,
            severity="warning",
            message=(
                f"Loss spike at step {stats.step}: the loss is {loss:.4g}, {(loss - m) / spread:.3g} robust spreads "
                f"above its median of {m:.4g} over the last {n} checked steps (spread {spread:.3g}).\n"
                "Why it matters: a spike often precedes divergence, and even when the loss recovers the "
                "weights were pushed away from where training was (progress lost, Adam's moments polluted).\n"
                "Fix: lower the learning rate or lengthen warm-up, clip gradients "
                "(torch.nn.utils.clip_grad_norm_), and check this step's batch for bad samples or labels; "
                "with mixed precision, check for overflow in the loss. (If the objective or the data changed "
                "at this step on purpose, e.g. a loss term switched on or a harder curriculum stage, a jump is "
                "expected.)"
            ),
            data={"loss": loss, "median": m, "spread": spread, "optimizer": stats.optimizer_index},
        )
    ]


def remember(stats: Any, history: History) -> None:
    size = stats.extra.get(_RECORD)
    if isinstance(size, float):
        record = history.memory.get(_RECORD)
        history.memory[_RECORD] = max(size, record) if isinstance(record, float) else size
    facts = _facts(stats, history)
    if stats.loss is None:
        return
    recent = history.memory.setdefault(_KEY, deque(maxlen=REARM))
    if facts is not None:
        recent.append(facts)
        if _EARLY not in history.memory:
            history.memory[_EARLY] = float(facts[1])
        if _START not in history.memory:
            history.memory[_START] = float(quantile(history.losses, 0.9))
