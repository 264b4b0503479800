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
    key = f"none_grad/{stats.optimizer_index}"
    if history.reported.get(key) == stats.none_grad:
        return []
    modules = sorted({n.rsplit(".", 1)[0] if "." in n else "<root>" for n in stats.none_grad})
    return [
        Finding(
            kind="none_grad",
            step=stats.step,
            severity="warning",
            message=(
                f"{len(stats.none_grad)} trainable parameter(s) in optimizer {stats.optimizer_index} got no "
                f"gradient at step {stats.step}: {names_text(stats.none_grad)}.\n"
                "Why it matters: the optimizer never updates them (their .grad is None), and under "
                "DistributedDataParallel they make backward fail or require find_unused_parameters=True.\n"
                "Fix: use them in forward on the path to the loss (check for a branch that is never taken "
                "or an output that is detached or dropped), or freeze them with requires_grad_(False), "
                "or leave them out of the optimizer."
            ),
            params=stats.none_grad,
            module=modules[0] if len(modules) == 1 else None,
            data={"modules": modules, "count": len(stats.none_grad), "optimizer": stats.optimizer_index},
        )
    ]


def remember(stats: StepStats, history: History) -> None:
    """Record the reported set so a persisting set is reported once (called by the engine)."""
    history.reported[f"none_grad/{stats.optimizer_index}"] = stats.none_grad
