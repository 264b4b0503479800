"""``no_optimizer_step``: backward passes filled an optimizer's gradients, and the run ended without that
optimizer ever stepping on them: the weights are still where they started.

Decided once, when the run ends normally (not on an exception), by :mod:`gradwatch.observe.unstepped` from
the backward passes the zero-grad observer counted on each optimizer and the optimizer's steps in this run
(a resumed run counts from its resume). Usual causes: ``optimizer.step()`` forgotten; accumulation
whose ``if (i + 1) % k == 0:`` never holds because the loader has fewer than ``k`` batches (``i`` restarts
every epoch); Lightning manual optimization without ``opt.step()``; an ``optimizer_step`` override that runs
the closure but never steps. One backward pass alone (a sanity check before training) is not reported.

No ``check(stats, history, config)`` here: there is no step to check; the observer calls
:func:`never_stepped` when the run closes.
"""

from __future__ import annotations

from gradwatch.core.findings import Explanation, Finding, names_text

#: Fewer backward passes than this are not a training run (a sanity check, a gradient printed once).
MIN_PASSES = 2

_FIXES = {
    "plain": "call optimizer.step() after loss.backward() (then optimizer.zero_grad()). With gradient "
    "accumulation, a step condition such as `if (i + 1) % k == 0:` never holds when the loader has fewer "
    "than k batches (i restarts every epoch): also step on the epoch's last batch "
    "(`or i + 1 == len(loader)`), or lower k.",
    "lightning": "in manual optimization call opt.step() (and opt.zero_grad()) in training_step, with "
    "opt = self.optimizers(). When accumulating over k batches, `(batch_idx + 1) % k == 0` never holds if an "
    "epoch has fewer than k batches: also step on the epoch's last batch "
    "(`or batch_idx + 1 == self.trainer.num_training_batches`), or lower k.",
    "lightning_automatic": "an optimizer_step override must call optimizer.step(closure=optimizer_closure); "
    "running the closure alone computes the gradients and throws them away.",
}


def never_stepped(
    step: int, i: int, passes: int, params: tuple[str, ...], integration: str, *, so_far: bool = False
) -> list[Finding]:
    """The finding for optimizer ``i``, which took no step after ``passes`` backward passes reached it (``so_far``:
    said while the run goes on, the passes cleared one after another)."""
    if passes < MIN_PASSES:
        return []
    state = (
        f"so far its parameters ({names_text(params)}) are as they were before the first backward pass, each "
        "pass's gradients cleared before the next"
        if so_far
        else f"the run ended with its parameters ({names_text(params)}) as they were before the first backward pass"
    )
    return [
        Finding(
            kind="no_optimizer_step",
            step=step,
            severity="error",
            explanation=Explanation(
                what=f"{passes} backward passes put gradients into optimizer {i}'s parameters, but optimizer "
                f"{i} never stepped on them: {state}.",
                why="the model did not train: every gradient was computed and thrown away.",
                fix=_FIXES.get(integration, _FIXES["plain"]),
            ),
            params=params,
            data={"optimizer": i, "backward_passes": passes, "count": len(params)},
        )
    ]
