"""``zero_grad_missing`` and ``grads_cleared_before_step``: gradients not cleared, or cleared too early.

Reads the facts :class:`gradwatch.zero_grad.ZeroGradTracker` puts into ``stats.extra``. Each kind is
reported once per optimizer (the first step it happens); a persisting bug is not repeated every step.
"""

from __future__ import annotations

from gradwatch.config import Config
from gradwatch.findings import Finding, names_text
from gradwatch.history import History
from gradwatch.stats import StepStats


def check(stats: StepStats, history: History, config: Config) -> list[Finding]:
    found: list[Finding] = []
    i = stats.optimizer_index
    if stats.extra.get("zero_grad_missing") and not history.reported.get(f"zero_grad_missing/{i}"):
        found.append(_missing(stats))
    if stats.extra.get("grads_cleared_before_step") and not history.reported.get(f"grads_cleared_before_step/{i}"):
        found.append(_cleared(stats))
    return found


def remember(stats: StepStats, history: History) -> None:
    i = stats.optimizer_index
    for kind in ("zero_grad_missing", "grads_cleared_before_step"):
        if stats.extra.get(kind):
            history.reported[f"{kind}/{i}"] = True


def _missing(stats: StepStats) -> Finding:
    i = stats.optimizer_index
    facts = stats.extra.get("zero_grad") or {}
    passes = int(facts.get("backward_passes", 0))
    params = tuple(stats.names)
    foreign = set(stats.foreign)
    # The evidence is a parameter model.zero_grad() never clears, while the model's own were cleared.
    loss_side = facts.get("param") in foreign and bool(facts.get("model_grad_replaced"))
    if loss_side:
        params = tuple(n for n in stats.names if n in foreign)
    previous = facts.get("previous_step")
    previous = stats.step - 1 if not isinstance(previous, int) else previous
    with_optimizer = facts.get("has_optimizer", True)
    who = f"optimizer {i} stepped" if with_optimizer else "the update was checked"
    clear = "optimizer.zero_grad() (or model.zero_grad())" if with_optimizer else "model.zero_grad()"
    wrong = f"called on another optimizer than optimizer {i}; " if with_optimizer else ""
    after = "each optimizer.step()" if with_optimizer else "each update"
    return Finding(
        kind="zero_grad_missing",
        step=stats.step,
        severity="error",
        message=(
            f"{who} at step {stats.step} with gradients accumulated on top of the previous step's: they were "
            f"not cleared after the update of step {previous} "
            f"({passes} backward pass{'es' if passes != 1 else ''} since then added to them). "
            f"Parameters: {names_text(params)}.\n"
            "Why it matters: each update applies the sum of all past gradients instead of this step's, so the "
            "effective step size grows with every step and points in stale directions; the loss stalls or "
            "diverges.\n"
            + (
                "Fix: these parameters belong to the optimizer but not to the model (a loss's centers, a learned "
                "temperature), so model.zero_grad() never clears them: call optimizer.zero_grad() instead."
                if loss_side
                else f"Fix: call {clear} once per step before loss.backward(). "
                f"Usual causes: zero_grad never called; {wrong}or called "
                "before a backward() that belongs to the previous step. To accumulate over several "
                f"micro-batches on purpose, call zero_grad() right after {after}."
            )
        ),
        params=params,
        data={
            "optimizer": i,
            "backward_passes": passes,
            "previous_step": previous,
            "evidence_param": facts.get("param"),
            "count": len(params),
        },
    )


def _cleared(stats: StepStats) -> Finding:
    i = stats.optimizer_index
    facts = stats.extra.get("zero_grad") or {}
    passes = int(facts.get("backward_passes", 0))
    params = tuple(stats.names) if stats.names else tuple(stats.none_grad)
    what = "all zero" if stats.names else "None"
    return Finding(
        kind="grads_cleared_before_step",
        step=stats.step,
        severity="error",
        message=(
            f"optimizer {i}.step() at step {stats.step} found every gradient {what}, although "
            f"{passes} backward pass{'es' if passes != 1 else ''} produced gradients since the previous step: "
            "zero_grad() was called between loss.backward() and optimizer.step().\n"
            "Why it matters: the step applies no gradient (only weight decay and momentum move the weights); "
            "the model does not learn from the data.\n"
            "Fix: order each iteration as optimizer.zero_grad(); loss.backward(); optimizer.step() (or clear "
            "the gradients right after step())."
        ),
        params=params,
        data={"optimizer": i, "backward_passes": passes, "grads": what, "count": len(params)},
    )
