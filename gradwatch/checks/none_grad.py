"""``none_grad``: trainable parameters in the optimizer that received no gradient."""

from __future__ import annotations

from gradwatch.config import Config
from gradwatch.findings import Finding, names_text
from gradwatch.history import History
from gradwatch.stats import StepStats


_EMPTY: frozenset[str] = frozenset()


def _never(stats: StepStats, history: History) -> frozenset[str]:
    """Parameters of this optimizer that have had no gradient on any checked step so far."""
    previous = history.reported.get(f"none_grad_never/{stats.optimizer_index}")
    now = frozenset(stats.none_grad)
    if previous is None or stats.params_changed:
        return now
    return previous & now


def check(stats: StepStats, history: History, config: Config) -> list[Finding]:
    # With no gradient at all, ``no_grads`` speaks instead.
    if not stats.none_grad or not stats.names:
        return []
    # Report parameters that never had a gradient, once. One that had gradients before and misses one now
    # is used on some steps only (mixture-of-experts routing, LayerDrop, one head per task): not a bug.
    seen = history.reported.get(f"none_grad/{stats.optimizer_index}", frozenset())
    never = _never(stats, history)
    fresh = tuple(n for n in stats.none_grad if n in never and n not in seen)
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
                + "(Parameters that get a gradient on some steps only, as with mixture-of-experts routing, "
                "LayerDrop or one head per task, are not reported.)\n"
                "Fix: use them in forward on the path to the loss (check for a branch that is never taken "
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
    """Record every parameter reported so far, so each is reported once, and which parameters never had a
    gradient (called by the engine; O(1) on a step where every parameter has one)."""
    never_key = f"none_grad_never/{stats.optimizer_index}"
    if not stats.none_grad:
        if stats.names and history.reported.get(never_key) is not _EMPTY:
            history.reported[never_key] = _EMPTY  # every parameter has had a gradient now
        return
    if not stats.names:
        return
    history.reported[never_key] = _never(stats, history)
    key = f"none_grad/{stats.optimizer_index}"
    seen = history.reported.get(key, frozenset())
    if any(n not in seen for n in stats.none_grad):
        history.reported[key] = frozenset(seen) | frozenset(stats.none_grad)
