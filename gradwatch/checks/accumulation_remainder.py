"""``accumulation_remainder``: the micro-batches left over at the end of an epoch go into the next epoch's
first update.

A loop that steps when ``(i + 1) % accum == 0`` over a loader whose length is not a multiple of ``accum``
never steps nor clears the epoch's last ``len % accum`` micro-batches: their gradients are summed into the
next epoch's first update (timoschick/pet#36). Seen from the updates: every one sums ``k`` backward passes,
except one per epoch that sums ``k + r`` (``0 < r < k``), at a fixed period counted from the run's first
update. Reported at the second such update, when the period is confirmed (once per optimizer).

Not: accumulation whose count varies (token budgets, a schedule that changes ``k``: any other count ends the
watch for the run), a loop that steps the remainder (fewer passes, never more), an extra backward pass on a
batch's own forward (regularizers, per-term passes: as many forwards as passes are required), or a run
attached mid-epoch (the period is then not the first update's).
"""

from __future__ import annotations

from typing import Any

from gradwatch.core.config import Config
from gradwatch.core.findings import Explanation, Finding
from gradwatch.core.history import History
from gradwatch.core.stats import StepStats, ZeroGradFacts

_KEY = "accumulation_remainder"
_OFF = "off"


def _passes(stats: StepStats) -> int | None:
    """The backward passes this update sums, when each came from a forward of its own and nothing cleared
    the gradients in between; None otherwise."""
    facts = facts_of(stats)
    kept = facts.get("kept_passes")
    passes = stats.extra.get("backward_passes")
    if (
        not isinstance(kept, int)
        or not isinstance(passes, tuple)
        or passes[0] != kept
        or passes[1]
        or stats.extra.get("zero_grad_missing")
        or facts.get("spans_other_step")
    ):
        return None
    inputs = stats.extra.get("step_inputs")  # present for 3+ passes, when escalation is on
    if isinstance(inputs, tuple) and (inputs[0] != kept or inputs[1]):
        return None
    return kept


def _next(state: Any, stats: StepStats) -> tuple[Any, tuple[int, int, int, int] | None]:
    """The state after this update and, when the pattern is confirmed, (first, second, k, n)."""
    if state == _OFF:
        return state, None
    n = _passes(stats)
    if state is None and stats.extra.get("scaler_dropped"):
        return state, None  # after a GradScaler's dropped steps the first update may be any window (a flush)
    if state is None:  # the run's first checked update sets k and the start of the period
        return ((stats.step, n, None) if n is not None and n >= 2 else _OFF), None
    start, k, odd = state
    if n == k:
        return state, None
    if n is None or not k < n < 2 * k:
        return _OFF, None
    if odd is None:
        return (start, k, (stats.step, n)), None
    first, n1 = odd
    if n == n1 and stats.step - first == first - start > 0:
        return _OFF, (first, stats.step, k, n)
    return _OFF, None


def facts_of(stats: StepStats) -> ZeroGradFacts:
    """The zero-grad observer's facts of this step (empty when it wrote none)."""
    return stats.extra.get("zero_grad") or {}


def _fix(k: int, r: int, lightning: bool) -> str:
    """Step on the epoch's last batch too, in the loop's own terms (Lightning's manual optimization: its
    training_step's batch_idx and the Trainer's batch count; its epoch hook)."""
    index, last, clear = (
        ("batch_idx", "batch_idx + 1 == self.trainer.num_training_batches",
         "self.optimizers().zero_grad() in on_train_epoch_start")
        if lightning
        else ("i", "i + 1 == len(loader)", "optimizer.zero_grad() at the start of each epoch")
    )
    return (
        f"also step on the epoch's last batch: `if ({index} + 1) % {k} == 0 or {last}:` (its loss divided by {r}, "
        f"not {k}); or call {clear} to drop the remainder; or DataLoader(drop_last=True) with a batch count "
        f"divisible by {k}."
    )


def check(stats: StepStats, history: History, config: Config) -> list[Finding]:
    if len(stats.names) == 0 or stats.extra.get("several_optimizers"):
        return []
    i = stats.optimizer_index
    state, found = _next(history.memory.get(_KEY, {}).get(i), stats)
    stats.extra[_KEY] = state  # a note for remember
    if found is None:
        return []
    first, second, k, n = found
    r, period = n - k, second - first
    # Under DDP the step condition usually also decides which backward runs outside model.no_sync(): changing one
    # without the other steps on gradients that were never all-reduced, and the replicas drift apart.
    ddp = (
        " Under DDP, the same condition must leave that last backward outside model.no_sync() (so it all-reduces "
        "the accumulated gradients), or each rank steps on its own gradients and the replicas diverge."
        if stats.extra.get("ddp")
        else ""
    )
    others = "the run's first update" if period == 1 else "every other update"
    return [
        Finding(
            kind=_KEY,
            step=first,
            severity="warning",
            explanation=Explanation(
                what=f"optimizer {i}'s updates at steps {first} and {second} each summed the gradients of {n} "
                f"micro-batches where {others} summed {k}: every {period} update{'s' if period > 1 else ''}, {r} "
                f"micro-batches are carried into the next one. Most likely the end of an epoch: the loop steps when "
                f"(i + 1) % {k} == 0, so the last {r} batches of a loader whose length is not a multiple of {k} "
                "are never stepped nor cleared, and their gradients go into the next epoch's first update.",
                why=f"that update is {n / k:.2f}x the size of the others (with the loss divided by "
                f"{k}) and mixes two epochs' batches; the remainder never gets an update of its own.",
                fix=_fix(k, r, bool(facts_of(stats).get("lightning"))) + ddp,
            ),
            data={"optimizer": i, "micro_batches": n, "usual": k, "period": period, "steps": [first, second]},
        )
    ]


def remember(stats: StepStats, history: History) -> None:
    if _KEY in stats.extra:
        history.memory.setdefault(_KEY, {})[stats.optimizer_index] = stats.extra[_KEY]
