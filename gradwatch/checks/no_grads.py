"""``no_grads``: an optimizer step with no gradient at all."""

from __future__ import annotations

from gradwatch.checks.not_in_optimizer import built_for_another_model
from gradwatch.core.config import Config
from gradwatch.core.findings import Explanation, Finding
from gradwatch.core.history import History
from gradwatch.core.stats import StepStats


def check(stats: StepStats, history: History, config: Config) -> list[Finding]:
    if stats.names or not stats.none_grad:
        return []
    if stats.extra.get("grads_cleared_before_step"):
        return []  # the zero_grad check explains this case precisely
    if built_for_another_model(stats):
        return []  # foreign_params explains it: the optimizer holds another model's parameters
    key = f"no_grads/{stats.optimizer_index}"
    if history.reported.get(key):
        return []
    return [
        Finding(
            kind="no_grads",
            step=stats.step,
            severity="error",
            explanation=Explanation(
                what=f"optimizer {stats.optimizer_index}.step() was called at step {stats.step} while none of its "
                f"{len(stats.none_grad)} trainable parameters has a gradient, so nothing is updated.",
                why="training makes no progress at all.",
                fix="call loss.backward() before optimizer.step(), make sure the loss depends on the "
                "model's parameters (not computed under torch.no_grad() or from detached outputs, nor rebuilt "
                "from a number: `torch.tensor(loss.item(), requires_grad=True)` is a new tensor that backward() "
                "cannot trace to the model), and call optimizer.zero_grad() before backward, not between backward "
                "and step.",
            ),
            params=stats.none_grad,
            data={"optimizer": stats.optimizer_index, "count": len(stats.none_grad)},
        )
    ]


def remember(stats: StepStats, history: History) -> None:
    history.reported[f"no_grads/{stats.optimizer_index}"] = not stats.names and bool(stats.none_grad)
