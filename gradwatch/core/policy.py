"""Act: what the engine does with a checked step, decided by a pure function.

:func:`decide` looks at the step's statistics, the configuration and how many steps in a row were skipped,
and returns a :class:`Verdict`; the engine only carries it out (``Engine._act``). :func:`needs_incident`
says whether a step is localized before its update (the incident path of the extensions).

Example:
    >>> from gradwatch.core.config import Config
    >>> from gradwatch.core.stats import StepStats
    >>> decide(StepStats(step=3, loss=float("nan"), loss_nonfinite=True), Config(on_nonfinite="skip"), 0)
    Verdict(action='skip', reason="on_nonfinite='skip'", blocked=True, consecutive_skips=1)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from gradwatch.checks.exploding import APPLIED, after_explosion
from gradwatch.checks.nonfinite_update import update_fix
from gradwatch.checks.scaler_step_bypassed import FIX as BYPASS_FIX
from gradwatch.core.config import Config
from gradwatch.core.findings import Explanation, Finding
from gradwatch.core.history import History
from gradwatch.core.stats import StepStats

#: ``continue``: apply the update; ``skip``: suppress it; ``raise``: stop training (``on_nonfinite="raise"``);
#: ``escalate``: the skips went on too long (``max_skips``): a ``too_many_skips`` error stops training.
Action = Literal["continue", "skip", "raise", "escalate"]


@dataclass(frozen=True)
class Verdict:
    """What to do with a checked step, and why.

    Attributes:
        action: See :data:`Action`.
        reason: Why, in the words of the setting that decided it (``"on_nonfinite='raise'"``,
            ``"max_skips=3"``); ``"finite"`` for a step that blocks nothing.
        blocked: The update would be non-finite (or overflow): it must not be applied as it is.
        consecutive_skips: Steps skipped in a row, this one included.
    """

    action: Action
    reason: str
    blocked: bool
    consecutive_skips: int


def is_blocked(stats: StepStats) -> bool:
    """The update must not go through as it is: a NaN/Inf gradient or loss (on this rank or another one), a
    gradient whose norm overflows float32 (an element above ~1.8e19: the update it makes turns the next
    forward pass non-finite), or an update that rounds to NaN/Inf in half precision."""
    extra = stats.extra
    return (
        stats.is_nonfinite
        or bool(stats.overflow_norm)
        or bool(extra.get("any_rank_nonfinite"))
        or bool(extra.get("update_nonfinite"))
    )


def needs_incident(stats: StepStats) -> bool:
    """The step is non-finite here or on another rank: the extensions localize it before the update."""
    return stats.is_nonfinite or bool(stats.extra.get("any_rank_nonfinite"))


#: The verdict of a step that blocks nothing (the usual one): immutable, so one instance serves every step.
FINITE = Verdict("continue", "finite", False, 0)


def decide(stats: StepStats, config: Config, consecutive_skips: int) -> Verdict:
    """The policy: ``on_nonfinite`` and ``max_skips`` applied to one checked step (pure)."""
    if not is_blocked(stats):
        return FINITE
    policy = config.on_nonfinite
    if policy == "raise":
        return Verdict("raise", "on_nonfinite='raise'", True, consecutive_skips)
    if policy != "skip":
        return Verdict("continue", f"on_nonfinite={policy!r}", True, 0)
    skips = consecutive_skips + 1
    if config.max_skips is not None and skips > config.max_skips:
        return Verdict("escalate", f"max_skips={config.max_skips}", True, skips)
    return Verdict("skip", "on_nonfinite='skip'", True, skips)


#: The findings whose facts, on the step that ran out of skips, say why every step of the run is skipped, and
#: their fix: ``(kind, holds(stats), fix(stats))``, the first that holds names the cause.
SKIP_CAUSES: tuple[tuple[str, Callable[[StepStats], bool], Callable[[StepStats], str]], ...] = (
    ("scaler_step_bypassed", lambda s: "scaler_bypassed" in s.extra, lambda s: BYPASS_FIX),
    ("nonfinite_update", lambda s: bool(s.extra.get("update_nonfinite")) and not s.is_nonfinite, update_fix),
)


def skip_cause(stats: StepStats) -> tuple[str, str] | None:
    """``(kind, fix)`` of the finding that explains why this step, like the skipped ones before it, is blocked."""
    return next(((kind, fix(stats)) for kind, holds, fix in SKIP_CAUSES if holds(stats)), None)


def too_many_skips(stats: StepStats, history: History, config: Config, skips: int) -> Finding:
    """The ``too_many_skips`` error of an ``escalate`` verdict."""
    cause = after_explosion(stats, history)  # the exploding update that threw the weights out of range, if any
    known = skip_cause(stats)
    if known is not None:
        persistent = f"the cause is persistent (see the {known[0]} finding): {known[1]} "
    else:
        persistent = _OVERFLOW_FIX if stats.overflow_norm and not stats.nonfinite else _PERSISTENT_FIX
    data = {"consecutive_skips": skips, "after_exploding": (history.memory.get(APPLIED) or {}).get("step")}
    if known is not None:
        data["cause"] = known[0]
    return Finding(
        kind="too_many_skips",
        step=stats.step,
        severity="error",
        explanation=Explanation(
            what=f"{skips} optimizer steps in a row were non-finite (max_skips={config.max_skips}); skipping "
            "further would only stall the run." + (f"\n{cause}" if cause else ""),
            fix=persistent + "Raise max_skips (or set it to None) to keep skipping.",
        ),
        data=data,
    )


_OVERFLOW_FIX = (
    "the cause is persistent: the gradients are finite but their norm overflows float32, so the weights or the "
    "loss have blown up (see the first exploding_grad and loss_diverging findings of this run): lower the "
    "learning rate (10x at a time), check weight_decay, add a warm-up, and clip gradients. "
)
_PERSISTENT_FIX = (
    "the cause is persistent, not a rare bad batch: see the first nonfinite finding of this run for the op and "
    "module, lower the learning rate, or check the data. "
)


def error_text(stats: StepStats | None, findings: list[Finding], why: str) -> str:
    """The message of the :class:`~gradwatch.core.findings.GradWatchError` that stops training."""
    step = stats.step if stats is not None else findings[0].step
    lines = [f"gradwatch stopped training at step {step} ({why}):"]
    for f in findings:
        if f.severity == "error":
            lines.append(f"  {f.title}")
            lines.extend("    " + line for line in f.message.splitlines())
    return "\n".join(lines)
