"""``lr_collapsed``: every param group's learning rate fell to nothing while the run goes on.

A scheduler meant per epoch and stepped per batch (``StepLR(step_size=30, gamma=0.1)`` called every
iteration: 1e-10 of the learning rate after 300 batches), or a decay schedule far shorter than the run, leaves
every later update at zero in all but name: the loss stops moving, with no error, no NaN and healthy gradients.
Reported once, when every group's learning rate has stayed below :data:`COLLAPSE` of the largest it had for
:data:`STEPS` checked steps in a row (looked at every :data:`EVERY`-th checked step: a learning rate moves
slowly, and the other steps cost one modulo). A schedule that ends at 0 (cosine or linear decay over the run) gets there
only in its last few steps; a group kept at ``lr=0`` on purpose has no largest value and is left out, and so is
an optimizer with such groups only.
"""

from __future__ import annotations

from typing import Any

from gradwatch.core.config import Config
from gradwatch.core.findings import Explanation, Finding
from gradwatch.core.history import History
from gradwatch.core.stats import StepStats

#: A learning rate below this fraction of its group's largest so far has collapsed.
COLLAPSE = 1e-10
#: Checked steps in a row every group must stay collapsed.
STEPS = 100
#: The learning rates are read on every EVERY-th step only (STEPS // EVERY looks in a row).
EVERY = 10

_KEY = "lr_collapsed"


def lrs(stats: StepStats) -> list[float] | None:
    """The step's learning rate per param group (None when one is not a plain number)."""
    groups = getattr(stats.extra.get("optimizer"), "param_groups", None)
    if not groups:
        return None
    try:
        return [float(g["lr"]) for g in groups]
    except (KeyError, TypeError, ValueError, RuntimeError):
        return None  # a group without lr, a tensor lr of several elements


def collapsed(now: list[float], peaks: list[float]) -> bool:
    """Every group that ever had a positive learning rate is below COLLAPSE of it (and there is one)."""
    live = [(lr, peak) for lr, peak in zip(now, peaks) if peak > 0]
    return bool(live) and all(lr < COLLAPSE * peak for lr, peak in live)


def check(stats: StepStats, history: History, config: Config) -> list[Finding]:
    if stats.step % EVERY:
        return []
    state = history.memory.get(_KEY, {}).get(stats.optimizer_index)
    if state is None or state["run"] < STEPS // EVERY - 1 or state["reported"]:
        return []  # (no collapse under way)
    now = lrs(stats)
    if now is None or len(now) != len(state["peaks"]) or not collapsed(now, state["peaks"]):
        return []
    stats.extra[_KEY] = True  # a note for remember: reported
    return [_finding(stats, now, state["peaks"], state["since"])]


def remember(stats: StepStats, history: History) -> None:
    if stats.step % EVERY:
        return
    now = lrs(stats)
    if now is None:
        return
    states = history.memory.setdefault(_KEY, {})
    state: dict[str, Any] | None = states.get(stats.optimizer_index)
    if state is None or len(state["peaks"]) != len(now):  # a new optimizer, or a param group added
        state = states[stats.optimizer_index] = {"peaks": list(now), "run": 0, "since": None, "reported": False}
    else:
        state["peaks"] = list(map(max, state["peaks"], now))
    if collapsed(now, state["peaks"]):
        state["run"] += 1
        state["since"] = stats.step if state["since"] is None else state["since"]
    else:
        state["run"], state["since"] = 0, None
    if stats.extra.get(_KEY):
        state["reported"] = True


def _finding(stats: StepStats, now: list[float], peaks: list[float], since: int | None) -> Finding:
    i = max(range(len(peaks)), key=peaks.__getitem__)  # the group that had the largest learning rate
    return Finding(
        kind="lr_collapsed",
        step=stats.step,
        severity="warning",
        explanation=Explanation(
            what=f"The learning rate of every parameter group has stayed below {COLLAPSE:g} of its largest value "
            f"since step {since} (group {i}: {now[i]:.3g}, down from {peaks[i]:.3g}): the updates are nothing, "
            "and training has stopped while the run goes on.",
            why="the loss no longer moves, with healthy gradients and no error; every step from here is wasted. "
            "Usually a scheduler meant per epoch is stepped per batch (StepLR, MultiStepLR, ExponentialLR: "
            "gamma is applied at every call), or a decay schedule is far shorter than the run.",
            fix="call an epoch-based scheduler's step() once per epoch, or give its step_size / milestones / "
            "T_max / total_iters in batches when stepping per batch; make a decay schedule as long as the run "
            "(in Lightning, the lr_scheduler config's 'interval': 'epoch' or 'step' must match how the scheduler "
            "was sized).",
        ),
        data={"optimizer": stats.optimizer_index, "lr": now, "peak_lr": peaks, "since": since},
    )
