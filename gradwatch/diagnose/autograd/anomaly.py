"""Anomaly mode stopped backward at the first node that returned NaN (``nan_origin``, raised).

Anomaly mode (``torch.autograd.set_detect_anomaly``, Lightning's ``detect_anomaly=True``) checks for NaN
only: an Inf born earlier (sqrt or log at 0) turns into NaN at a later, harmless-looking op (a matmul
multiplying Inf by 0). :func:`anomaly_facts` reads what happened; :data:`ANOMALY_FIXES` words the fix by cause.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from gradwatch.core.findings import Explanation, Finding
from gradwatch.diagnose.autograd.context import Context
from gradwatch.diagnose.op_fixes import GENERIC_FIX, fix_for


@dataclass(frozen=True)
class AnomalyFacts:
    """The backward op anomaly mode stopped at, the gradient output that was NaN, and the cause."""

    step: int
    op: str
    index: int
    #: ``"loss_nonfinite"`` (the NaN was there before backward), ``"carried_inf"`` (no rule for the op:
    #: an Inf reached it) or ``"op_rule"`` (the op's own fix rule applies).
    cause: str
    op_fix: str
    loss: float | None = None


def anomaly_cause(loss: float | None, op_fix: str, generic_fix: str) -> str:
    """Which fix speaks: a non-finite loss first, then an op without a rule of its own."""
    if loss is not None:
        return "loss_nonfinite"
    return "carried_inf" if op_fix is generic_fix else "op_rule"


#: Cause -> the fix.
ANOMALY_FIXES: dict[str, Callable[[AnomalyFacts], str]] = {
    # The NaN was there before backward: no backward op made it, this one only carries it.
    "loss_nonfinite": lambda f: (
        f"the NaN/Inf was born in the forward pass or in the loss, before backward; {f.op} only carries it. "
        "Look at sqrt, log, pow and divisions of zero or negative values in the forward pass and the loss "
        "(clamp their inputs, add an epsilon), and check the batch for NaN/Inf; without detect_anomaly, "
        "gradwatch names the forward op and line where it was born."
    ),
    "carried_inf": lambda f: (
        f"{f.op} rarely makes a NaN from finite values: an Inf reached it from an earlier backward op. Look "
        "at sqrt, log, pow and divisions on the forward line anomaly mode printed and before it, or "
        "turn detect_anomaly off and let gradwatch's escalation name the op where the Inf was born "
        "(it checks for Inf too)."
    ),
    "op_rule": lambda f: f.op_fix,
}


def anomaly_facts(ctx: Context, op: str, index: int) -> AnomalyFacts:
    losses = [t for t in ctx.roots() if t.numel() == 1]
    loss: float | None = None
    if losses and not bool(torch.isfinite(losses[0].detach()).all()):  # the error path: one read
        loss = float(losses[0].detach().reshape(()))
    op_fix = fix_for(op)
    return AnomalyFacts(ctx.step, op, index, anomaly_cause(loss, op_fix, GENERIC_FIX), op_fix, loss)


def anomaly_words(f: AnomalyFacts) -> Explanation:
    loss_note = f" The loss itself was {f.loss:g} already." if f.loss is not None else ""
    return Explanation(
        what=(
            f"Anomaly mode stopped backward at step {f.step}: op {f.op} is the first backward op that returned "
            f"NaN (in its gradient output {f.index}).{loss_note} Anomaly mode printed the forward line that "
            "created this op above, under 'Traceback of forward call that caused the error'; it checks for NaN "
            "only, so an Inf born in an earlier op shows up here. Training stopped with PyTorch's error."
        ),
        fix=ANOMALY_FIXES[f.cause](f),
    )


def explain_anomaly_nan(ctx: Context, op: str, index: int) -> Finding:
    """Anomaly mode's NaN error as a ``nan_origin`` finding."""
    f = anomaly_facts(ctx, op, index)
    loss_data = {"loss_nonfinite": True, "loss": f.loss} if f.loss is not None else {}
    return Finding(
        kind="nan_origin",
        step=ctx.step,
        severity="error",
        explanation=anomaly_words(f),
        op=op,
        data={"phase": "backward", "op": op, "output": index, "anomaly_error": str(ctx.exc), "raised": True,
              **loss_data},
    )
