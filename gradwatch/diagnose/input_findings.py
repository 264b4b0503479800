"""Findings about the step's data and the model's state rather than an op: ``nonfinite_input`` (the batch, a
tensor the loop holds, the model's output when the step raised) and the ``nan_origin`` findings with no op to
name (weights or buffers already non-finite, the watched model's forward not run).

Each is built from its facts as an :class:`~gradwatch.core.findings.Explanation`; where one finding has several
causes, its words come from a table keyed by the cause (:data:`WEIGHTS_WHY`, :data:`WEIGHTS_FIX`,
:data:`NO_FORWARD_WORDS`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch import nn

from gradwatch.core.findings import Explanation, Finding, names_text

if TYPE_CHECKING:
    from gradwatch.diagnose.replay import ReplayResult

Bad = list[tuple[str, int, int]]

_DATA_FIX = (
    "find where the batch is built (missing values in the dataset, a normalization by "
    "a zero std, a broken augmentation); filter or impute bad samples, and assert "
    "torch.isfinite(x).all() in the data pipeline while debugging."
)


def _listed(bad: Bad, limit: int) -> str:
    parts = [f"{name} ({nan} NaN, {inf} Inf)" for name, nan, inf in bad]
    return f"{', '.join(parts[:limit])}{' and more' if len(parts) > limit else ''}"


def _minus_inf_site(through: ReplayResult) -> str | None:
    """Where an unabsorbed -inf input first made a non-finite value: the first module, else the op."""
    site = through.loc.first_module  # the first module whose output it made non-finite
    origin = through.loc.origin
    if site is None and origin is not None:
        return f"op {origin.op}" + (f" in module {origin.module}" if origin.module else "")
    return f"module {site}" if site is not None else None


def _minus_inf_note(through: ReplayResult | None) -> str:
    if through is None:
        return ""
    site = _minus_inf_site(through)
    return (
        " It holds -inf and no NaN or +Inf, which would pass for an additive attention mask, but the forward "
        "does not absorb it as a mask is (softmax, masked_fill): it reaches the model's output as NaN/Inf"
        + (f" (first through {site})" if site else "")
        + ". A -inf feature is usually log of 0: log of a zero count, price or probability (use "
        "torch.log1p(x), or x.clamp_min(1e-8).log())."
    )


def _stale_buffers_note(buffers: list[str] | None) -> str:
    if not buffers:
        return ""
    return (
        f"\nIts forward pass also wrote NaN/Inf into buffers that later forwards read: {names_text(buffers)} "
        "(skipping the update does not undo that): reset them (BatchNorm: module.reset_running_stats()) "
        "or reload a checkpoint, or every later step is non-finite."
    )


def _input_explanation(step: int, bad: Bad, buffers: list[str] | None, through: ReplayResult | None) -> Explanation:
    what = (
        f"The inputs of step {step} already hold non-finite values before the model ran: "
        f"{_listed(bad, 8)}. The data, not the model, is the cause." + _minus_inf_note(through)
    )
    return Explanation(what=what, fix=_DATA_FIX + _stale_buffers_note(buffers))


def input_finding(step: int, bad: Bad, buffers: list[str] | None = None, through: ReplayResult | None = None) -> Finding:
    """``nonfinite_input``: the step's inputs hold NaN/Inf (``through``: a -inf input the forward did not
    absorb, as the replay found it; ``buffers``: buffers its forward also wrote non-finite)."""
    return Finding(
        kind="nonfinite_input",
        step=step,
        severity="error",
        explanation=_input_explanation(step, bad, buffers, through),
        data={
            "poisoned_buffers": list(buffers or []),
            "inputs": [{"input": n, "nan": a, "inf": b} for n, a, b in bad],
            "table": [{"input": n, "nan": a, "inf": b} for n, a, b in bad],
        },
    )


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"


_MODEL_OUTPUT_FIX = (
    "look at this run's earlier findings (nonfinite_grad, nan_origin, exploding_grad) for how the "
    "weights went non-finite; if there are none, run this step with torch.autograd.set_detect_anomaly("
    "True) to find the forward op, and check for in-place writes to the weights."
)


def forward_error_finding(step: int, exc: BaseException, inputs: Bad, outputs: Bad) -> Finding:
    """``nonfinite_input`` for a step that raised before its backward: the facts of :func:`input_finding`, with
    the exception they explain (or, the inputs being finite, the model's non-finite output)."""
    error = _error_text(exc)
    raised = {"raised": type(exc).__name__, "error": str(exc)}
    if inputs:
        base = _input_explanation(step, inputs, None, None)
        what = (
            f"Training stopped at step {step} with {error}, raised before any backward pass. {base.what} "
            "The NaN/Inf went through the model into the code that raised."
        )
        data = {**input_finding(step, inputs).data, "outputs": [], **raised}
        explanation = dataclasses.replace(base, what=what)
        return Finding(kind="nonfinite_input", step=step, severity="error", explanation=explanation, data=data)
    parts = [f"{name} ({nan} NaN, {inf} Inf)" for name, nan, inf in outputs]
    what = (
        f"Training stopped at step {step} with {error}, raised before any backward pass, and the model's "
        f"output holds non-finite values: {', '.join(parts[:8])}. The step's inputs were finite: the model "
        "made them (weights or buffers already NaN/Inf, or an op out of range in the forward), and the "
        "code that raised received them."
    )
    return Finding(
        kind="nonfinite_input",
        step=step,
        severity="error",
        explanation=Explanation(what=what, fix=_MODEL_OUTPUT_FIX),
        data={"inputs": [], "outputs": [{"output": n, "nan": a, "inf": b} for n, a, b in outputs],
              "table": [{"input": n, "nan": a, "inf": b} for n, a, b in outputs], **raised},
    )


_LOOP_DATA_FIX = (
    "find where the targets are built (missing values in the dataset, a label normalized by a "
    "zero std, a broken transform); filter or impute bad samples (e.g. mask = torch.isfinite(y); "
    "loss = loss_fn(out[mask], y[mask])), and assert torch.isfinite(y).all() in the data pipeline "
    "while debugging."
)


def loop_input_finding(step: int, bad: Bad) -> Finding:
    """``nonfinite_input`` (a warning): a tensor of the batch the loop holds outside the model's inputs."""
    what = (
        f"The batch of step {step} holds non-finite values outside the model's inputs: {_listed(bad, 6)}. "
        "The model's forward pass was finite and the NaN/Inf was "
        "born in the loss code: if the loss reads this tensor (a NaN target, a per-sample weight), the "
        "data, not the model, is the cause; if it is masked out by design (NaN padding removed with "
        "torch.where), see the nan_origin finding of this step instead."
    )
    return Finding(
        kind="nonfinite_input",
        step=step,
        severity="warning",
        explanation=Explanation(what=what, fix=_LOOP_DATA_FIX),
        data={
            "inputs": [{"input": n, "nan": a, "inf": b} for n, a, b in bad],
            "table": [{"input": n, "nan": a, "inf": b} for n, a, b in bad],
            "source": "loop",
        },
    )


# -- weights or buffers already non-finite ----------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class PoisonFacts:
    """Why parameters (or buffers) hold NaN/Inf before the step's forward ran.

    Attributes:
        step: The step; names: the parameters (or buffers) holding NaN/Inf.
        buffers: They are buffers (BatchNorm running statistics), not weights.
        policy: ``on_nonfinite``; every: the check interval.
        earlier: A ``nan_origin`` was reported earlier in the run.
        rows: For embedding tables with a few bad rows: the rows and the number of rows.
    """

    step: int
    names: list[str]
    buffers: bool
    policy: str = "skip"
    every: int = 1
    earlier: bool = True
    rows: dict[str, tuple[list[int], int]] | None = None


def weights_cause(facts: PoisonFacts) -> str:
    """The key of :data:`WEIGHTS_WHY` for non-finite weights: how they most likely got there."""
    if facts.policy == "warn":
        return "applied"
    if facts.every > 1:
        return "unchecked"
    if facts.rows and not facts.earlier:
        return "rows"
    return "before"


def weights_fix_key(facts: PoisonFacts) -> str:
    """The key of :data:`WEIGHTS_FIX` for non-finite weights."""
    if facts.earlier:
        return "earlier"
    return "rows" if facts.rows else "reload"


def _rows_text(rows: dict[str, tuple[list[int], int]]) -> str:
    return "; ".join(
        f"{n}: row{'s' if len(r) > 1 else ''} {', '.join(map(str, r[:8]))}{' and more' if len(r) > 8 else ''}"
        f" ({len(r)} of {total})"
        for n, (r, total) in rows.items()
    )


#: Why non-finite weights make the step non-finite, by cause (see :func:`weights_cause`).
WEIGHTS_WHY: dict[str, Callable[[PoisonFacts], str]] = {
    "applied": lambda f: (
        "An earlier non-finite update was applied (on_nonfinite='warn'), so every later step is non-finite too."
    ),
    "unchecked": lambda f: (
        f"gradwatch checks one step in {f.every} (every={f.every}), so a non-finite update on a step in "
        "between was applied unchecked (or they were loaded from a checkpoint or written outside the "
        "optimizer); every step is non-finite from then on."
    ),
    "rows": lambda f: (
        f"Only some rows of the embedding table hold them ({_rows_text(f.rows or {})}): only batches that look "
        "up those ids are non-finite, this one among them. They were non-finite before this step (rows added "
        "to the vocabulary and left uninitialized, e.g. filled from torch.empty, a bad checkpoint "
        "merge, or a write outside the optimizer)."
    ),
    "before": lambda f: (
        "They became non-finite before this step (loaded from a checkpoint, written outside the "
        "optimizer, or updated by an optimizer gradwatch does not watch), so every step that reads "
        "them is non-finite."
    ),
}

#: What to change about non-finite weights, by :func:`weights_fix_key`.
WEIGHTS_FIX: dict[str, Callable[[PoisonFacts], str]] = {
    "earlier": lambda f: (
        "see the first nan_origin finding of the run for the op and module where it began; use "
        "on_nonfinite='skip' to keep the weights clean while you fix it, and reload a checkpoint."
    ),
    "rows": lambda f: (
        "re-initialize those rows (with torch.no_grad(): emb.weight[rows] = "
        "emb.weight[ok_rows].mean(0), or normal_ with the table's std), or reload a checkpoint; check "
        "what wrote them (resize_token_embeddings, a checkpoint merge)."
    ),
    "reload": lambda f: (
        "reload a checkpoint from before it"
        + (", and watch every step (every=1) so the next non-finite update is skipped and localized "
           "at the step it happens" if f.every > 1 else ", and check what wrote the weights")
        + "."
    ),
}

_BUFFERS_WHY = (
    "A forward pass on non-finite activations wrote them (BatchNorm running statistics are updated "
    "even on a skipped step), and every forward that reads them (eval mode) is non-finite."
)
_BUFFERS_FIX = (
    "find the first nan_origin or nonfinite_input finding of the run; reset the buffers "
    "(e.g. module.reset_running_stats()) or reload a checkpoint."
)


def poisoned_explanation(facts: PoisonFacts) -> Explanation:
    """What happened (with why, in the same paragraph) and the fix, for non-finite weights or buffers."""
    if facts.buffers:
        head = f"Buffers of the model hold NaN/Inf at step {facts.step}: {names_text(facts.names)}"
        why, fix = _BUFFERS_WHY, _BUFFERS_FIX
    else:
        head = f"The weights themselves hold NaN/Inf at step {facts.step}: {names_text(facts.names)}"
        why = WEIGHTS_WHY[weights_cause(facts)](facts)
        fix = WEIGHTS_FIX[weights_fix_key(facts)](facts)
    tail = "" if facts.rows else " The origin cannot be localized from this step."
    return Explanation(what=f"{head}. {why}{tail}", fix=fix)


def poisoned_finding(facts: PoisonFacts, layers: list[dict[str, Any]]) -> Finding:
    """``nan_origin`` with phase ``"weights"`` or ``"buffers"``: nothing to localize, they were already bad."""
    return Finding(
        kind="nan_origin",
        step=facts.step,
        severity="error",
        explanation=poisoned_explanation(facts),
        params=tuple(facts.names),
        data={"phase": "buffers" if facts.buffers else "weights", "params": facts.names, "table": layers},
    )


# -- the watched model's forward did not run ----------------------------------------------------------
#: How the loop went around the watched model's forward, and what to change, by whether the model is a
#: LightningModule run by a loop of one's own (Lightning Fabric: ``fabric_model.training_step(batch, i)``).
NO_FORWARD_WORDS: dict[str, tuple[str, str]] = {
    "training_step": (
        "Its training_step calls the submodules directly (`self.net(x)`), around the model's own forward.",
        "in training_step call the model itself, `self(x)`, with the composition in its forward",
    ),
    "loop": (
        "The training loop calls its submodules directly (`model.head(model.encoder(x))`), or another "
        "module than the watched one.",
        "call the watched model itself (put the composition in its forward: `model(x)`), or watch the "
        "module the loop calls",
    ),
}


def no_forward_finding(step: int, model: nn.Module | None) -> Finding:
    """``nan_origin`` (a warning): the watched model's own forward did not run, so nothing could be localized."""
    name = type(model).__name__ if model is not None else "model"
    # A LightningModule run by a loop of one's own: the loop is right, training_step goes around the forward.
    cause, fix = NO_FORWARD_WORDS["training_step" if callable(getattr(model, "training_step", None)) else "loop"]
    what = (
        f"gradwatch could not look for where the NaN/Inf of step {step} was born: the watched model's own "
        f"forward ({name}.__call__) did not run this step, so neither its inputs nor its outputs were "
        f"seen. {cause}"
    )
    explanation = Explanation(
        what=what, fix=fix + "; then a NaN batch is named as bad input and a NaN born in an op is named with its line."
    )
    return Finding(kind="nan_origin", step=step, severity="warning", explanation=explanation,
                   data={"phase": None, "no_forward": True})
