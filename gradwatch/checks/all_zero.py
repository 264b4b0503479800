"""``grads_all_zero``: every gradient of an optimizer's parameters is exactly 0 for ``DEAD`` checked steps in a row.

``dead_layer`` names a layer whose gradient is 0 while the layers around it learn; when the whole model's
gradient is 0 there is nothing to compare with, and the run has stopped learning: updates throw the weights
so far that every unit saturates (a learning rate far too high: a sigmoid discriminator that answers exactly 0
or 1, every ReLU dead), or the loss does not depend on the parameters any more (an output detached, read
through ``.item()`` or ``.data``, or a loss whose gradient is 0 by construction: argmax, rounding, a clamp).
With an observed loss, when that loss is not exactly 0 (a margin loss at 0 has nothing left to learn from);
without one, after ``lr_too_high`` for the same optimizer (the first updates threw the weights). Not on steps
a GradScaler dropped (their gradients are not looked at), nor when the gradients were cleared between
backward and the step (``zero_grad``'s own finding), nor after ``loss_diverging`` said the model died.
Reported when it starts, and again after it recovered.
"""

from __future__ import annotations

from gradwatch.core.config import Config
from gradwatch.core.findings import Explanation, Finding
from gradwatch.core.history import History
from gradwatch.core.stats import StepStats
from gradwatch.core.trend import newly_sustained

#: Runs only on steps where one of these facts holds (see :data:`gradwatch.checks.FACTS`).
WHEN = ('zero_total',)

#: Checked steps in a row with every gradient exactly 0.
DEAD = 5


def _all_zero(stats: StepStats, history: History) -> bool:
    if not stats.names or stats.total_norm != 0.0 or history.reported.get("loss_diverging"):
        return False
    if stats.extra.get("grads_cleared_before_step") or stats.extra.get("amp_overflow_step"):
        return False
    if stats.loss is not None:
        if stats.loss == 0.0:
            return False  # every margin holds (a triplet or hinge loss at 0): nothing left to learn from
    elif not history.reported.get(f"lr_too_high/{stats.optimizer_index}"):
        return False  # no loss to tell a stuck model from one at its minimum, and no blow-up before it
    past = history.total_norms.get(stats.optimizer_index, ())
    return newly_sustained(past, True, lambda v: v == 0.0, DEAD)


#: The first fix, by the likely cause: updates known to be far too large (lr_too_high reported), or a jump
#: in the loss that may have saturated the network.
_FIRST_FIX = {
    "lr_too_high": "the first updates of this run were far too large (see lr_too_high): restart with a lower "
    "learning rate. ",
    "saturation": "if the loss jumped before this, the updates threw the weights into saturation (every "
    "sigmoid at exactly 0 or 1, every ReLU dead): restart with a lower learning rate (10x at a "
    "time) and check for a typo in it. ",
}


def check(stats: StepStats, history: History, config: Config) -> list[Finding]:
    if not _all_zero(stats, history):
        return []
    optimizer = stats.extra.get("optimizer")
    lrs = []
    for group in getattr(optimizer, "param_groups", None) or ():
        try:
            lrs.append(f"{float(group.get('lr', 0.0)):g}")
        except (TypeError, ValueError, RuntimeError):
            continue
    lr_text = f" (learning rate {', '.join(lrs[:4])})" if lrs else ""
    early = history.reported.get(f"lr_too_high/{stats.optimizer_index}")
    return [
        Finding(
            kind="grads_all_zero",
            step=stats.step,
            severity="warning",
            explanation=Explanation(
                what=f"Every gradient of optimizer {stats.optimizer_index} ({type(optimizer).__name__}{lr_text}) has been "
                f"exactly 0 for the last {DEAD} checked steps, up to step {stats.step}: all {len(stats.names)} "
                "parameters with a gradient.",
                why="nothing is learning any more; an optimizer with momentum or Adam keeps moving "
                "the weights by its stale moments, in no useful direction, and the run will not recover by itself.",
                fix=_FIRST_FIX["lr_too_high" if early else "saturation"]
                + "Otherwise check that the loss still depends on the parameters: no .detach(), .item() or .data "
                "on the model's output inside the loss, no argmax or rounding in it.",
            ),
            data={"optimizer": stats.optimizer_index, "dead_steps": DEAD, "params": len(stats.names)},
        )
    ]
