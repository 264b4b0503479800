"""``nonfinite_loss`` and ``nonfinite_grad``: NaN or Inf about to reach the weights."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

from gradwatch.checks.exploding import after_explosion
from gradwatch.checks.scaler_step_bypassed import with_bypass_cause
from gradwatch.core.config import Config
from gradwatch.core.findings import Explanation, Finding, names_text
from gradwatch.core.history import History
from gradwatch.core.stats import StepStats

#: Runs only on steps where one of these facts holds (see :data:`gradwatch.checks.FACTS`).
WHEN = ('nonfinite',)

_ACTION = {
    "skip": "gradwatch skipped this update: parameters and optimizer state are unchanged.",
    "warn": "on_nonfinite='warn': the update was applied, so the weights are now poisoned.",
    "raise": "on_nonfinite='raise': training stops before the update.",
}


def action_key(stats: StepStats, config: Config) -> str:
    """What gradwatch does about a non-finite step: ``skip`` (``skip_optimizer`` when only this optimizer's
    update is skipped), ``warn`` or ``raise``."""
    if config.on_nonfinite == "skip" and stats.extra.get("several_optimizers"):
        return "skip_optimizer"
    return config.on_nonfinite


def action_words(key: str, optimizer: int) -> str:
    if key == "skip_optimizer":
        return (
            f"gradwatch skipped optimizer {optimizer}'s update: its parameters and state are "
            "unchanged (each optimizer's step is checked on its own)."
        )
    return _ACTION[key]


#: The cause of a non-finite loss with finite gradients, until an op is named (see ``defer_to_origin``).
_LOSS_ONLY = (
    "NaN/Inf is in the loss value only, in a part whose gradient does not carry it. Usual causes: a mean over "
    "zero elements (every target equal to ignore_index, an empty mask or selection: 0/0), 0 * log(0) in an "
    "entropy or KL term written by hand (p * p.log() with a zero probability: 0 * -inf), or a NaN/Inf constant "
    "added to the loss."
)
#: The same for an Inf loss: 0/0 and 0 * log(0) make NaN, never Inf, so they cannot be its cause.
_LOSS_ONLY_INF = (
    "Inf is in the loss value only, in a part whose gradient does not carry it. Usual causes: "
    "cross_entropy with label_smoothing over logits masked with -inf (the smoothing term averages the "
    "log-probabilities of every class, -inf for a masked one, while the gradient of a masked logit is 0), "
    "a log(0) or a division by zero in a term whose gradient is masked or detached, or an Inf constant "
    "added to the loss."
)


def defer_to_origin(finding: Finding, op: str, module: str | None, fix: str) -> Finding | None:
    """``finding`` (a ``nonfinite_loss`` with finite gradients) restated once the step's ``nan_origin`` named
    the op: its list of usual causes would contradict it. None for any other finding (left as it is)."""
    if finding.kind != "nonfinite_loss" or finding.data.get("cause") not in ("loss_only", "loss_only_inf"):
        return None
    where = f"op {op}" + (f" in module {module}" if module else "")
    action = action_words(finding.data["action"], finding.data["optimizer"])
    what = (
        f"{_finite_grads_head(finding.data['loss'], finding.step)}NaN/Inf was born at {where} (the nan_origin "
        "finding of this step), and its gradient was stopped on the way back to the weights (a ReLU at 0, a mask "
        f"or a detached branch zeroes it), so it shows in the loss value only. {action}"
    )
    data = {**finding.data, "cause": "origin", "restates": "nonfinite_loss", "origin_op": op, "origin_module": module}
    return dataclasses.replace(finding, explanation=Explanation(what=what, fix=fix), data=data)


def holding_module(stats: StepStats) -> str | None:
    """The innermost module (below the root) that holds every non-finite gradient, so that findings can be
    filtered by module: ``enc`` for ``enc.0.weight`` and ``enc.2.bias``; None when they span the model."""
    bad = set(stats.nonfinite)
    modules = [m for n, m in zip(stats.names, stats.modules) if n in bad]
    if not modules or any(m is None for m in modules):  # a parameter the model does not own
        return None
    paths = [m.split(".") for m in set(modules) if m is not None]
    common = []
    for parts in zip(*paths):
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    return ".".join(common) or None


@dataclass(frozen=True)
class LossFacts:
    """A step whose loss is NaN/Inf: what the gradients and the loss's dtype say about where it came from."""

    step: int
    loss: float | None
    grads_finite: bool
    #: Computed in float16 and Inf (not NaN): an overflow of float16's range.
    float16_overflow: bool
    #: The sentence naming an exploding update applied before as the likely cause ("" if none).
    after: str
    action: str


def loss_facts(stats: StepStats, after: str, action: str) -> LossFacts:
    half = stats.extra.get("loss_dtype") == "float16"
    return LossFacts(
        step=stats.step,
        loss=stats.loss,
        grads_finite=bool(stats.names) and not stats.nonfinite and not stats.overflow_norm,
        float16_overflow=half and not (stats.loss is not None and math.isnan(stats.loss)),
        after=after,
        action=action,
    )


def loss_cause(f: LossFacts) -> str:
    """Which words explain a non-finite loss: ``float16`` (it overflowed float16's range), ``loss_only_inf`` /
    ``loss_only`` (an Inf / a NaN in a part of the loss whose gradient does not carry it) or ``nonfinite``."""
    if f.float16_overflow:
        return "float16"
    if f.grads_finite:
        return "loss_only_inf" if f.loss is not None and math.isinf(f.loss) else "loss_only"
    return "nonfinite"


def _finite_grads_head(loss: float | None, step: int) -> str:
    return f"The loss is {_fmt(loss)} at step {step}, but every gradient is finite: the "


def _float16_words(f: LossFacts, action: str) -> Explanation:
    # Computed in float16, whose largest value is 65504: a squared error above 256 (mse_loss on targets
    # in natural units), a sum over a large batch or an exp above 11 overflows to Inf.
    return Explanation(
        what=f"The loss is {_fmt(f.loss)} at step {f.step} and was computed in float16 "
        "(model.half(), precision=\"16-true\"), whose largest value is 65504: it overflowed "
        "float16 (a squared error above 256, a sum over many elements such as cross_entropy's label_smoothing "
        "term, which adds up the log-probabilities of every class: over 65504 with a few thousand classes, "
        "exp above 11)"
        + (", although every gradient is finite" if f.grads_finite else "")
        + f". {action}",
        fix="compute the loss in float32 (`loss_fn(out.float(), y)`, and y.float() for targets that are values, "
        "not class indices), or train "
        "with float32 weights under torch.autocast (with a GradScaler) instead of model.half(); "
        "normalizing the targets (and inputs) keeps the values in range too.",
    )


def _loss_only_inf_words(f: LossFacts, action: str) -> Explanation:
    return Explanation(
        what=f"{_finite_grads_head(f.loss, f.step)}{_LOSS_ONLY_INF} {action}",
        fix="with label_smoothing, leave the masked classes out of the logits "
        "(cross_entropy(logits[:, allowed], target)) or mask with a large finite value such as -1e4 "
        "instead of -inf (the loss then holds a constant, its gradient is the same); add an epsilon to the log or "
        "division of the term whose gradient is masked; check the terms added to the loss for Inf.",
    )


def _loss_only_words(f: LossFacts, action: str) -> Explanation:
    return Explanation(
        what=f"{_finite_grads_head(f.loss, f.step)}{_LOSS_ONLY} {action}",
        fix="average with loss.sum() / count.clamp_min(1) (or skip batches with nothing "
        "to learn from); for nn.CrossEntropyLoss / F.cross_entropy with ignore_index, that is "
        "reduction='sum' divided by (target != ignore_index).sum().clamp_min(1); write p * log(p) as "
        "torch.xlogy(p, p) (0 where p = 0), or use F.kl_div on log-probabilities; check the terms added to the "
        "loss for NaN/Inf.",
    )


def _nonfinite_words(f: LossFacts, action: str) -> Explanation:
    return Explanation(
        what=f"The loss is {_fmt(f.loss)} at step {f.step}. A non-finite loss makes the "
        "gradients of this step NaN/Inf and, once applied, poisons the weights and the optimizer's state "
        f"(momentum, Adam's moments). {action}" + (f"\n{f.after}" if f.after else ""),
        fix="look for log/sqrt/division of zero or negative values in the loss, "
        "add an epsilon (e.g. torch.log(x + 1e-8), x / (n + 1e-8)), clamp logits, lower the "
        "learning rate, or check the batch for NaN/Inf.",
    )


#: The words of a non-finite loss, by cause (see ``loss_cause``).
_LOSS_WORDS: dict[str, Callable[[LossFacts, str], Explanation]] = {
    "float16": _float16_words,
    "loss_only_inf": _loss_only_inf_words,
    "loss_only": _loss_only_words,
    "nonfinite": _nonfinite_words,
}


def _stale_loss(stats: StepStats) -> Finding | None:
    """A NaN/Inf loss of a batch before this step that no update used (the training code skipped it)."""
    values = list(stats.extra.get("stale_losses") or ())
    stale = [v for v in values if not math.isfinite(v)]
    # When the step itself is non-finite, the errors below cover it (SAM's first pass, whose gradients
    # were cleared before the second, is part of the same step).
    if not stale or stats.nonfinite:
        return None
    # The last ``stale_unused`` values are losses no backward pass ran through (a NaN guard's continue).
    first_bad = next(i for i, v in enumerate(values) if not math.isfinite(v))
    unused = first_bad >= len(values) - int(stats.extra.get("stale_unused") or 0)
    return Finding(
        kind="nonfinite_loss",
        step=stats.step,
        severity="warning",
        explanation=Explanation(
            what=f"The loss was {stale[0]} {_STALE_WHERE['unused' if unused else 'cleared'](stats.step)}, so no "
            f"update used it; step {stats.step}'s own loss and gradients are checked as usual.",
            why="the NaN/Inf came from the data or the forward pass and will come back with similar batches.",
            fix="check that batch for NaN/Inf, and look for log/sqrt/division of zero or "
            "negative values in the loss (add an epsilon, clamp logits).",
        ),
        data={"loss": stale[0], "count": len(stale), "optimizer": stats.optimizer_index, "no_update": True},
    )


#: Where a skipped batch's NaN/Inf loss was seen: no backward ran through it, or its gradients were cleared.
_STALE_WHERE: dict[str, Callable[[int], str]] = {
    "unused": lambda step: f"on a batch before step {step} that the training code did not backpropagate (a batch "
    "it skipped)",
    "cleared": lambda step: f"on a backward pass before step {step} whose gradients were cleared without an "
    "optimizer step (a batch the training code skipped)",
}


def _loss_finding(stats: StepStats, f: LossFacts) -> Finding:
    cause = loss_cause(f)
    return Finding(
        kind="nonfinite_loss",
        step=stats.step,
        severity="error",
        explanation=_LOSS_WORDS[cause](f, action_words(f.action, stats.optimizer_index)),
        module=holding_module(stats),
        data={"loss": stats.loss, "optimizer": stats.optimizer_index, "grads_finite": f.grads_finite,
              "after_exploding": bool(f.after), "float16_overflow": f.float16_overflow, "cause": cause,
              "action": f.action},
    )


def _grad_finding(stats: StepStats, after: str, action: str) -> Finding:
    rows = [
        {"param": n, "nan": stats.nan_counts.get(n, 0), "inf": stats.inf_counts.get(n, 0)} for n in stats.nonfinite
    ]
    modules = sorted({m for n, m in zip(stats.names, stats.modules) if n in stats.nonfinite and m is not None})
    return Finding(
        kind="nonfinite_grad",
        step=stats.step,
        severity="error",
        explanation=Explanation(
            what=f"{len(stats.nonfinite)} of {len(stats.names)} gradients hold non-finite values at step "
            f"{stats.step} ({_counts(stats)}): {names_text(stats.nonfinite)}. {action}",
            why="one NaN gradient poisons the weights and the optimizer's moments for good, and clip_grad_norm_ "
            "spreads it to every parameter." + (f"\n{after}" if after else ""),
            fix="find the op that produced it (gradwatch names it when escalation is on); common "
            "causes are log/sqrt/pow at 0 or below, division by a zero norm, exp overflow, or too "
            "high a learning rate.",
        ),
        params=stats.nonfinite,
        module=holding_module(stats),
        data={
            "nan_counts": dict(stats.nan_counts),
            "inf_counts": dict(stats.inf_counts),
            "modules": modules,
            "optimizer": stats.optimizer_index,
            "after_exploding": bool(after),
            "table": rows,
        },
    )


def _counts(stats: StepStats) -> str:
    if not (stats.nan_counts or stats.inf_counts):
        return (
            "element counts are not read in deferred mode; a finite gradient whose norm overflows float32 "
            "reads as Inf here too"
        )
    shards = " in this rank's shards" if stats.extra.get("sharded") else ""  # FSDP: local counts
    return f"{sum(stats.nan_counts.values())} NaN, {sum(stats.inf_counts.values())} Inf{shards}"


def check(stats: StepStats, history: History, config: Config) -> list[Finding]:
    out: list[Finding] = []
    stale = _stale_loss(stats)
    if stale is not None:
        out.append(stale)
    after = after_explosion(stats, history) if stats.loss_nonfinite or stats.nonfinite else ""
    action = action_key(stats, config)
    own: list[Finding] = []
    if stats.loss_nonfinite:
        own.append(_loss_finding(stats, loss_facts(stats, after, action)))
    if stats.nonfinite:
        own.append(_grad_finding(stats, after, action_words(action, stats.optimizer_index)))
    return out + [with_bypass_cause(f, stats) for f in own]


#: What gradwatch did about a non-finite closure re-evaluation, per policy.
_REEVAL_ACTION = {
    "skip": (
        "gradwatch hid these gradients from the optimizer{returned}, so nothing non-finite is applied: "
        "the weights stay finite, at the point this evaluation was made (earlier iterations of this step "
        "had already moved them). Later evaluations like this one are handled the same way without another "
        "report."
    ),
    "warn": "on_nonfinite='warn': the optimizer uses them, so expect NaN weights from here on.",
    "raise": (
        "on_nonfinite='raise': training stops inside this step; the weights are finite, at the point this "
        "evaluation was made."
    ),
}


def reevaluation(
    step: int,
    optimizer_index: int,
    optimizer_name: str,
    evaluation: int,
    loss: float | None,
    bad_params: list[str],
    counts: tuple[dict[str, int], dict[str, int]],
    total_params: int,
    policy: str,
    returned_large_loss: bool,
) -> Finding:
    """A closure optimizer (LBFGS) evaluated the closure again within a checked step and this
    evaluation's loss or gradients are NaN/Inf, although the first evaluation's were finite."""
    nan, inf = counts
    loss_bad = loss is not None and not math.isfinite(loss)
    what = _what(loss if loss_bad else None, bad_params, counts, total_params, "is", "hold")
    returned = (
        " and gave it a very large finite loss for this evaluation (a failed trial: a line search backs off)"
        if returned_large_loss
        else ""
    )
    action = _REEVAL_ACTION[policy].format(returned=returned)
    return Finding(
        kind="nonfinite_loss" if loss_bad else "nonfinite_grad",
        step=step,
        severity="error",
        explanation=Explanation(
            what=f"In step {step}, {optimizer_name} evaluated the closure again (evaluation {evaluation}; the "
            f"first was finite and checked) and {' and '.join(what)}. {action}",
            why=f"{optimizer_name} would turn these gradients into a NaN search direction and write "
            "NaN into every weight and into its curvature history.",
            fix="the iterations of one step reach weights where the loss is not finite: use "
            "line_search_fn='strong_wolfe', lower lr or max_iter, or guard the loss (log/sqrt/division of "
            "zero or negative values, exp overflow).",
        ),
        params=tuple(bad_params),
        data={
            "optimizer": optimizer_index,
            "closure_evaluation": evaluation,
            "loss": loss,
            "nan_counts": dict(nan),
            "inf_counts": dict(inf),
            "policy": policy,
        },
    )


def raised_before_check(
    step: int,
    exc: BaseException,
    loss: float | None,
    bad_params: list[str],
    counts: tuple[dict[str, int], dict[str, int]],
    total_params: int,
) -> Finding:
    """The training code raised before the optimizer step that gradwatch checks, on a non-finite loss or
    non-finite gradients (``clip_grad_norm_(..., error_if_nonfinite=True)``, a user's NaN assert)."""
    nan, inf = counts
    what = _what(loss, bad_params, counts, total_params, "was", "held")
    first = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else ""
    return Finding(
        kind="nonfinite_grad" if bad_params else "nonfinite_loss",
        step=step,
        severity="error",
        explanation=Explanation(
            what=f"At step {step} {' and '.join(what)} when the training code stopped with "
            f"{type(exc).__name__}: {first} (before the optimizer step, so nothing was applied).",
            why="the NaN/Inf was born in this step's forward or backward; raising stops the run "
            "where skipping the step would have kept it going.",
            fix="find where it was born: without error_if_nonfinite (or your own NaN check) gradwatch skips "
            "such a step and names the op and module; common causes are log/sqrt/division of zero, exp "
            "overflow, or NaN in the batch.",
        ),
        params=tuple(bad_params),
        data={"loss": loss, "nan_counts": dict(nan), "inf_counts": dict(inf), "raised": type(exc).__name__},
    )


def _what(
    loss: float | None,
    bad_params: list[str],
    counts: tuple[dict[str, int], dict[str, int]],
    total_params: int,
    is_: str,
    hold: str,
) -> list[str]:
    """"the loss is nan", "3 of 4 gradients hold non-finite values (...): names" (tense given)."""
    nan, inf = counts
    what = [f"the loss {is_} {loss}"] if loss is not None else []
    if bad_params:
        what.append(
            f"{len(bad_params)} of {total_params} gradients {hold} non-finite values "
            f"({sum(nan.values())} NaN, {sum(inf.values())} Inf): {names_text(bad_params)}"
        )
    return what


def _fmt(v: float | None) -> str:
    return "non-finite" if v is None else str(v)
