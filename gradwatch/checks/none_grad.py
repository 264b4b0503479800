"""``none_grad``: trainable parameters in the optimizer that received no gradient."""

from __future__ import annotations

from gradwatch.config import Config
from gradwatch.findings import Finding, names_text
from gradwatch.history import History
from gradwatch.stats import StepStats


def check(stats: StepStats, history: History, config: Config) -> list[Finding]:
    # With no gradient at all, ``no_grads`` speaks instead.
    if not stats.none_grad or not stats.names:
        return []
    # Report parameters the first time they miss a gradient: a branch used every other step, or experts
    # of a mixture that take turns, are named once, not at every change of the set.
    seen = history.reported.get(f"none_grad/{stats.optimizer_index}", frozenset())
    fresh = tuple(n for n in stats.none_grad if n not in seen)
    if not fresh:
        return []
    modules = sorted({n.rsplit(".", 1)[0] if "." in n else "<root>" for n in fresh})
    cleared = bool(stats.extra.get("cleared_between_backwards"))
    cause = (
        "Likely cause here: zero_grad() ran between this step's backward passes and wiped what the earlier "
        "loss's backward gave them (two losses with retain_graph=True, zero_grad() in between). Call "
        "zero_grad() once per step, before the first backward(); or, if that clearing is meant (SAM, "
        "adversarial examples), use them in the last loss too.\n"
        if cleared
        else ""
    )
    return [
        Finding(
            kind="none_grad",
            step=stats.step,
            severity="warning",
            message=(
                f"{len(fresh)} trainable parameter(s) in optimizer {stats.optimizer_index} got no "
                f"gradient at step {stats.step}: {names_text(fresh)}.\n"
                "Why it matters: the optimizer never updates them (their .grad is None), and under "
                "DistributedDataParallel they make backward fail or require find_unused_parameters=True.\n"
                + cause
                + "Fix: use them in forward on the path to the loss (check for a branch that is never taken "
                "or an output that is detached or dropped), or freeze them with requires_grad_(False), "
                "or leave them out of the optimizer."
            ),
            params=fresh,
            module=modules[0] if len(modules) == 1 else None,
            data={
                "modules": modules,
                "count": len(fresh),
                "none_grad_now": len(stats.none_grad),
                "optimizer": stats.optimizer_index,
                "cleared_between_backwards": cleared,
            },
        )
    ]


def remember(stats: StepStats, history: History) -> None:
    """Record every parameter reported so far, so each is reported once (called by the engine)."""
    if not stats.none_grad or not stats.names:
        return
    key = f"none_grad/{stats.optimizer_index}"
    seen = history.reported.get(key, frozenset())
    if any(n not in seen for n in stats.none_grad):
        history.reported[key] = frozenset(seen) | frozenset(stats.none_grad)
