"""``zero_grad_missing``, ``grads_cleared_before_step`` and ``zero_grad_in_accumulation``: gradients not
cleared, cleared too early, or cleared inside an accumulation loop.

Reads the facts :class:`gradwatch.observe.zero_grad.ZeroGradTracker` (and the engine's count of backward passes)
put into ``stats.extra``. Each kind is reported once per optimizer (the first step it happens); a
persisting bug is not repeated every step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gradwatch.core.config import Config
from gradwatch.core.findings import Explanation, Finding, names_text
from gradwatch.core.history import History
from gradwatch.core.stats import StepStats, ZeroGradFacts


def _noted(extra: dict) -> bool:
    """The tracker noted something about this step's clearing (else the step is the usual one)."""
    passes = extra.get("backward_passes")
    return bool(
        extra.get("zero_grad_missing")
        or extra.get("grads_cleared_before_step")
        or (isinstance(passes, tuple) and passes[1] > 0 and passes[0] >= IN_LOOP_MIN_PASSES)  # _in_loop_passes
    )


def check(stats: StepStats, history: History, config: Config) -> list[Finding]:
    extra = stats.extra
    if not (_noted(extra) or "spans_other_step" in (extra.get("zero_grad") or ())):
        return []  # the usual step: nothing to report
    return _findings(stats, history)


def _findings(stats: StepStats, history: History) -> list[Finding]:
    """The check's findings once the step is not the usual one (each kind once per optimizer)."""
    extra = stats.extra
    found: list[Finding] = []
    i = stats.optimizer_index
    if extra.get("zero_grad_missing") and not history.reported.get(f"zero_grad_missing/{i}"):
        found.append(_missing(stats))
    if extra.get("grads_cleared_before_step") and not history.reported.get(f"grads_cleared_before_step/{i}"):
        found.append(_cleared(stats))
    if _cleared_in_loop(stats) and _repeated(stats, history) and not history.reported.get(f"{_IN_LOOP}/{i}"):
        found.append(_in_loop(stats))
    facts: ZeroGradFacts = extra.get("zero_grad") or {}
    if (
        facts.get("spans_other_step")
        and not extra.get("zero_grad_missing")
        and not found
        and not history.reported.get(f"{_SPANS}/{i}")
    ):
        extra[_SPANS] = True
        found.append(_spans(stats, facts))
    return found


def remember(stats: StepStats, history: History) -> None:
    i = stats.optimizer_index
    extra = stats.extra
    if not (_noted(extra) or _SPANS in extra):
        history.memory[f"{_IN_LOOP}/{i}"] = False  # the usual step: nothing reported, no micro-batches cleared
        return
    _remember_findings(stats, history)


def _remember_findings(stats: StepStats, history: History) -> None:
    """What :func:`remember` keeps of a step that is not the usual one: the kinds reported, the cleared loop."""
    i = stats.optimizer_index
    extra = stats.extra
    if extra.get(_SPANS):
        history.reported[f"{_SPANS}/{i}"] = True
    for kind in ("zero_grad_missing", "grads_cleared_before_step"):
        if extra.get(kind):
            history.reported[f"{kind}/{i}"] = True
    in_loop = _cleared_in_loop(stats)
    if in_loop and _repeated(stats, history):
        history.reported[f"{_IN_LOOP}/{i}"] = True
    history.memory[f"{_IN_LOOP}/{i}"] = in_loop


_IN_LOOP = "zero_grad_in_accumulation"
_SPANS = "grads_span_other_step"


def _repeated(stats: StepStats, history: History) -> bool:
    """The cleared micro-batches are the loop's pattern, not a one-off run of passes between two steps (a
    Fisher estimate): the previous checked step had them too, or this is the optimizer's first checked step
    (no earlier step for a one-off to fall between: the loop itself ran them), unless a GradScaler dropped
    steps before it (each of their passes was cleared by the next iteration's zero_grad(), with no step)."""
    i = stats.optimizer_index
    first = history.previous(i) is None and not stats.extra.get("scaler_dropped")
    return bool(history.memory.get(f"{_IN_LOOP}/{i}")) or first


def _spans(stats: StepStats, facts: dict[str, object]) -> Finding:
    i = stats.optimizer_index
    passes = int(facts.get("kept_passes", 0))
    return Finding(
        kind=_SPANS,
        step=stats.step,
        severity="warning",
        explanation=Explanation(
            what=f"optimizer {i}'s update at step {stats.step} applies a gradient of {passes} backward passes, and "
            "the first of them ran before another optimizer's step: that optimizer's loss went through these "
            "parameters too (a GAN's generator loss through the discriminator, an actor's loss through the "
            "critic) and nothing cleared their gradients before this optimizer's own backward.",
            why="this update also follows the other loss (for a GAN, the discriminator partly "
            "learns to help the generator), so it trains towards the wrong objective.",
            fix=f"clear this optimizer's gradients right before its own backward (optimizer {i}.zero_grad() "
            "before its loss.backward()); in Lightning manual optimization wrap each phase in "
            "self.toggle_optimizer(opt) / self.untoggle_optimizer(opt); or detach what the other loss must "
            "not reach (D(fake.detach()) for the discriminator's loss).",
        ),
        params=(str(facts.get("param")),) if facts.get("param") else (),
        data={"optimizer": i, "backward_passes": passes},
    )
#: Backward passes per step, each after the first finding the gradients cleared, before it is reported.
#: Two are common on purpose (SAM's two passes, an adversarial example's pass, Lightning stepping every
#: other batch); the pattern must also repeat on the next checked step (per-sample Fisher or saliency
#: passes between two steps happen once).
IN_LOOP_MIN_PASSES = 3


def _in_loop_passes(passes: object) -> bool:
    """Enough backward passes in the step, some finding the gradients cleared (``extra["backward_passes"]``)."""
    return isinstance(passes, tuple) and passes[0] >= IN_LOOP_MIN_PASSES and passes[1] > 0


def _cleared_in_loop(stats: StepStats) -> bool:
    """Micro-batches cleared before the last one: the step's gradient holds its last backward pass only.
    Either each pass cleared the one before (zero_grad() in every micro-batch), or the passes accumulated
    and were cleared once, right before the last (zero_grad() at the top of ``with
    accelerator.accumulate(model):``, which Accelerate runs on the syncing micro-batch only). As many
    forward calls (or Lightning batches) as backward passes, all of one batch size, none with an input
    that requires grad.

    Not: one forward with a backward per loss term (logging each term's gradient, PCGrad), the attack
    iterations of adversarial training (the input requires grad), per-sample passes next to the batch's
    own (Fisher estimates: other sizes), or gradients the code assembled itself (DP-SGD by hand).
    """
    passes = stats.extra.get("backward_passes")
    if not _in_loop_passes(passes):
        return False
    facts: ZeroGradFacts = stats.extra.get("zero_grad") or {}
    inputs = stats.extra.get("step_inputs")
    return (
        facts.get("kept_passes") == 1
        and bool(facts.get("last_backward_grad"))
        and bool(stats.names)
        and isinstance(inputs, tuple)
        # Cleared once before the last pass: also a batch skipped by the code (`if not isfinite(loss):
        # zero_grad(); continue`) in a window, which ran a forward with no backward pass. So all forwards
        # had one.
        and (inputs[0] >= passes[0] if passes[1] == passes[0] - 1 else inputs[0] == passes[0])
        and not inputs[1]
        and len(inputs[2]) == 1
    )


@dataclass(frozen=True)
class MissingFacts:
    """What ``zero_grad_missing`` says about one step: who stepped, on which parameters, and why."""

    optimizer: int
    step: int
    passes: int
    previous: int
    params: tuple[str, ...]
    with_optimizer: bool
    #: ``loss_side`` (parameters of the loss model.zero_grad() never clears), ``partial`` (zero_grad() on a
    #: submodule), ``lightning`` or ``plain``: picks the fix.
    cause: str
    kept: tuple[str, ...] = ()
    cleared: tuple[str, ...] = ()
    lightning_automatic: bool = False
    evidence: object = None


def missing_facts(stats: StepStats) -> MissingFacts:
    """The facts of a ``zero_grad_missing`` step, from the tracker's notes in ``stats.extra``."""
    facts: ZeroGradFacts = stats.extra.get("zero_grad") or {}
    # The evidence is a parameter model.zero_grad() never clears, while the model's own were cleared.
    foreign = set(stats.foreign)
    loss_side = facts.get("param") in foreign and bool(facts.get("model_grad_replaced"))
    # Named by the tracker when a parameter far from the evidence one was cleared: zero_grad() on a
    # submodule (enc.zero_grad() while one optimizer trains enc and dec).
    kept, gone = tuple(facts.get("kept_params") or ()), tuple(facts.get("cleared_params") or ())
    cause = missing_cause(loss_side, bool(kept) and bool(gone), bool(facts.get("lightning")))
    params = {
        "loss_side": tuple(n for n in stats.names if n in foreign),
        "partial": kept,
    }.get(cause, tuple(stats.names))
    previous = facts.get("previous_step")
    return MissingFacts(
        optimizer=stats.optimizer_index,
        step=stats.step,
        passes=int(facts.get("backward_passes", 0)),
        previous=previous if isinstance(previous, int) else stats.step - 1,
        params=params,
        with_optimizer=bool(facts.get("has_optimizer", True)),
        cause=cause,
        kept=kept,
        cleared=gone,
        lightning_automatic=bool(facts.get("lightning_automatic")),
        evidence=facts.get("param"),
    )


def missing_cause(loss_side: bool, partial: bool, lightning: bool) -> str:
    """Which fix a ``zero_grad_missing`` needs (the first that applies)."""
    if loss_side:
        return "loss_side"
    if partial:
        return "partial"
    return "lightning" if lightning else "plain"


def _plain_fix(f: MissingFacts) -> str:
    clear = "optimizer.zero_grad() (or model.zero_grad())" if f.with_optimizer else "model.zero_grad()"
    wrong = f"called on another optimizer than optimizer {f.optimizer}; " if f.with_optimizer else ""
    after = "each optimizer.step()" if f.with_optimizer else "each update"
    return (
        f"call {clear} once per step before loss.backward(). Usual causes: zero_grad never called; {wrong}or "
        f"called before a backward() that belongs to the previous step. To accumulate over several micro-batches "
        f"on purpose, call zero_grad() right after {after}."
    )


#: The fix of ``zero_grad_missing``, by cause.
_MISSING_FIX: dict[str, Callable[[MissingFacts], str]] = {
    "loss_side": lambda f: (
        "these parameters belong to the optimizer but not to the model (a loss's centers, a learned "
        "temperature), so model.zero_grad() never clears them: call optimizer.zero_grad() instead."
    ),
    "partial": lambda f: _partial_fix(f.kept, f.cleared, f.optimizer, f.with_optimizer),
    "lightning": lambda f: _lightning_fix(f.lightning_automatic, f.optimizer),
    "plain": _plain_fix,
}


def missing_explanation(f: MissingFacts) -> Explanation:
    who = f"optimizer {f.optimizer} stepped" if f.with_optimizer else "the update was checked"
    what = (
        f"{who} at step {f.step} with gradients accumulated on top of the previous step's: they were "
        f"not cleared after the update of step {f.previous} "
        f"({f.passes} backward pass{'es' if f.passes != 1 else ''} since then added to them). "
        f"Parameters: {names_text(f.params)}."
    )
    if f.cause == "partial":
        what += "\n" + _partial_text(f.kept, f.cleared, f.optimizer, f.with_optimizer)
    return Explanation(
        what=what,
        why="each update applies the sum of all past gradients instead of this step's, so the "
        "effective step size grows with every step and points in stale directions; the loss stalls or diverges.",
        fix=_MISSING_FIX[f.cause](f),
    )


def _missing(stats: StepStats) -> Finding:
    f = missing_facts(stats)
    return Finding(
        kind="zero_grad_missing",
        step=f.step,
        severity="error",
        explanation=missing_explanation(f),
        params=f.params,
        data={
            "optimizer": f.optimizer,
            "backward_passes": f.passes,
            "previous_step": f.previous,
            "evidence_param": f.evidence,
            "count": len(f.params),
            **({"cleared_params": list(f.cleared)} if f.cause == "partial" else {}),
        },
    )


def closure_missing(step: int, i: int, optimizer: str, params: tuple[str, ...], evidence: str) -> Finding:
    """``zero_grad_missing`` inside a closure that ``optimizer.step(closure)`` evaluates several times."""
    return Finding(
        kind="zero_grad_missing",
        step=step,
        severity="error",
        explanation=Explanation(
            what=f"optimizer {i} ({optimizer}) evaluated its closure a second time at step {step}, and that "
            "evaluation's backward pass added its gradients onto the first evaluation's: the closure does not "
            f"clear them. Parameters: {names_text(params)}.",
            why=f"{optimizer} reads the gradient after every evaluation of the closure (its "
            "iterations and line search); each one sees the sum of all evaluations so far, so the search "
            "directions and step sizes are wrong from the first step on.",
            fix="call optimizer.zero_grad() at the top of the closure, before loss.backward() "
            "(def closure(): optimizer.zero_grad(); loss = ...; loss.backward(); return loss).",
        ),
        params=params,
        data={"optimizer": i, "closure": True, "evidence_param": evidence, "count": len(params)},
    )


def _lightning_fix(automatic: bool, i: int) -> str:
    """The fix in Lightning's terms: the user never calls zero_grad() in automatic optimization, and calls
    it on the LightningOptimizer from self.optimizers() in manual optimization."""
    if automatic:
        # Automatic optimization calls the module's optimizer_zero_grad hook before every step's
        # training_step (outside an accumulate_grad_batches window): only an override of it that does not
        # clear every time leaves the gradients in place.
        return (
            "in automatic optimization Lightning clears the gradients before each step through the "
            "LightningModule's optimizer_zero_grad hook; an override of it that does not call "
            "optimizer.zero_grad() every time (a pass, or a condition on batch_idx) keeps them. Remove the "
            "override, or make it call optimizer.zero_grad(set_to_none=True) unconditionally. To accumulate "
            "over k batches on purpose, use Trainer(accumulate_grad_batches=k) instead."
        )
    opt = "self.optimizers()" + (f"[{i}]" if i else "")
    return (
        f"in manual optimization clear the gradients yourself: in training_step, with opt = {opt}, "
        "call opt.zero_grad() right after opt.step() (or before self.manual_backward(loss)). To accumulate "
        "over k batches on purpose, call opt.step() and then opt.zero_grad() every k-th batch only."
    )


def _module_of(names: tuple[str, ...], others: tuple[str, ...]) -> str | None:
    """The shortest module path holding all of ``names`` and none of ``others`` (None if there is none)."""
    parts = names[0].split(".")
    for k in range(1, len(parts)):
        prefix = ".".join(parts[:k]) + "."
        if all(n.startswith(prefix) for n in names) and not any(n.startswith(prefix) for n in others):
            return prefix[:-1]
    return None


def _partial_text(kept: tuple[str, ...], gone: tuple[str, ...], i: int, with_optimizer: bool) -> str:
    part = _module_of(gone, kept)
    where = f"those under {part}: " if part else ""
    whose = f"optimizer {i} updates" if with_optimizer else "the update changes"
    return (
        f"The other parameters {whose} ({where}{names_text(gone)}) were cleared: zero_grad() was called "
        f"on part of the model only{f' ({part}.zero_grad())' if part else ''}, not on every parameter."
    )


def _partial_fix(kept: tuple[str, ...], gone: tuple[str, ...], i: int, with_optimizer: bool) -> str:
    part, rest = _module_of(gone, kept), _module_of(kept, gone)
    instead = f" instead of {part}.zero_grad()" if part else " instead of zero_grad() on one submodule"
    also = f" (or call {rest}.zero_grad() too)" if rest else ""
    if with_optimizer:
        return f"call optimizer.zero_grad(), which clears every parameter optimizer {i} updates,{instead}{also}."
    return f"call zero_grad() on the whole model{instead}{also}."


#: Words of ``grads_cleared_before_step`` with an optimizer (True) and with ``gw.check()`` and no optimizer.
_STEP_WORDS = {
    True: {
        "who": "optimizer {i}.step()",
        "step": "optimizer.step()",
        "short": "step()",
        "why": "the step applies no gradient (only weight decay and momentum move the weights)",
        "fix": "order each iteration as optimizer.zero_grad(); loss.backward(); optimizer.step() (or clear "
        "the gradients right after step()).",
    },
    False: {
        "who": "gw.check()",
        "step": "the update",
        "short": "update",
        "why": "the update applies no gradient",
        "fix": "order each iteration as model.zero_grad(); loss.backward(); gw.check(); the update (or clear "
        "the gradients right after the update).",
    },
}


#: The fix of ``grads_cleared_before_step`` in Lightning's automatic optimization, which clears by itself.
_LIGHTNING_CLEARS = (
    "delete that zero_grad() call (from on_after_backward, on_before_optimizer_step or the "
    "training_step after manual_backward): in automatic optimization Lightning clears the gradients "
    "itself, after each optimizer step."
)


def _cleared(stats: StepStats) -> Finding:
    i = stats.optimizer_index
    facts: ZeroGradFacts = stats.extra.get("zero_grad") or {}
    with_optimizer = bool(facts.get("has_optimizer", True))
    passes = int(facts.get("backward_passes", 0))
    params = tuple(stats.names) if stats.names else tuple(stats.none_grad)
    what = "all zero" if stats.names else "None"
    words = _STEP_WORDS[with_optimizer]
    fix = _LIGHTNING_CLEARS if facts.get("lightning_automatic") else words["fix"]
    return Finding(
        kind="grads_cleared_before_step",
        step=stats.step,
        severity="error",
        explanation=Explanation(
            what=f"{words['who'].format(i=i)} at step {stats.step} found every gradient {what}, although "
            f"{passes} backward pass{'es' if passes != 1 else ''} produced gradients since the previous step: "
            f"zero_grad() was called between loss.backward() and {words['step']}, or {words['step']} comes "
            f"before loss.backward() in the loop (zero_grad(); {words['short']}; backward()).",
            why=f"{words['why']}; the model does not learn from the data.",
            fix=fix,
        ),
        params=params,
        data={"optimizer": i, "backward_passes": passes, "grads": what, "count": len(params)},
    )


def _in_loop_lightning(n: int, since: str) -> tuple[str, str]:
    # Lightning steps and clears on its own schedule (accumulate_grad_batches): the user never calls
    # step(), so "after optimizer.step()" has no place to go; the call itself is the bug.
    what = (
        f"zero_grad() cleared what the earlier batches had accumulated{since}. Lightning accumulates the "
        f"gradients of {n} batches here (accumulate_grad_batches) and clears them itself: a zero_grad() of "
        "the module's own, in training_step or a hook that runs per batch, throws the earlier ones away."
    )
    fix = (
        "delete that zero_grad() call (e.g. self.optimizers().zero_grad() in training_step): in "
        "automatic optimization Lightning clears the gradients itself, once per accumulation window, "
        "right after its optimizer step."
    )
    return what, fix


def _in_loop_each_pass(n: int, since: str) -> tuple[str, str]:
    what = (
        f"before each of the other {n - 1}, zero_grad() cleared what the previous pass had accumulated{since}. "
        "zero_grad() is called inside the gradient-accumulation loop."
    )
    fix = (
        "call optimizer.zero_grad() once per accumulation window, right after optimizer.step(), not "
        "in every micro-batch iteration."
    )
    return what, fix


def _in_loop_before_last(n: int, since: str) -> tuple[str, str]:
    # The passes accumulated, then one zero_grad() right before the last pass threw them away: the
    # clearing runs at the start of the micro-batch that steps (Accelerate's prepared optimizer
    # clears only on the syncing micro-batch, so zero_grad() at the top of accumulate() does this).
    what = (
        f"right before it, zero_grad() cleared the gradients the {n - 1} passes before it had accumulated{since}. "
        "zero_grad() runs at the start of the micro-batch that steps, before its backward pass: e.g. at the "
        "top of `with accelerator.accumulate(model):`, where the prepared optimizer's zero_grad() acts on "
        "the syncing micro-batch only."
    )
    fix = (
        "call optimizer.zero_grad() after optimizer.step() (at the end of the accumulation block, as "
        "Accelerate's examples do), not before the backward pass."
    )
    return what, fix


#: What ``zero_grad_in_accumulation`` says happened, and its fix, by where the clearing ran.
_IN_LOOP_WORDS: dict[str, Callable[[int, str], tuple[str, str]]] = {
    "lightning": _in_loop_lightning,
    "each_pass": _in_loop_each_pass,
    "before_last": _in_loop_before_last,
}


def in_loop_cause(lightning_automatic: bool, passes: int, clears: int) -> str:
    """Where the clearing inside an accumulation loop ran: Lightning's own schedule, every pass, or once
    right before the last pass."""
    if lightning_automatic:
        return "lightning"
    return "each_pass" if clears == passes - 1 else "before_last"


def _in_loop(stats: StepStats) -> Finding:
    i = stats.optimizer_index
    n, clears = int(stats.extra["backward_passes"][0]), int(stats.extra["backward_passes"][1])
    facts: ZeroGradFacts = stats.extra.get("zero_grad") or {}
    previous = facts.get("previous_step")
    since = f"; the same happened at step {previous}" if isinstance(previous, int) else ""
    what, fix = _IN_LOOP_WORDS[in_loop_cause(bool(facts.get("lightning_automatic")), n, clears)](n, since)
    return Finding(
        kind=_IN_LOOP,
        step=stats.step,
        severity="warning",
        explanation=Explanation(
            what=f"optimizer {i}.step() at step {stats.step} applied the gradient of the last of its {n} backward "
            f"passes only: {what}",
            why=f"accumulation does nothing: each update sees one micro-batch instead of {n} (and "
            f"with the loss divided by {n} for accumulation, the update is also {n}x too small); {n - 1} of "
            f"every {n} micro-batches are computed and thrown away.",
            fix=f"{fix} (Backward passes kept apart on purpose, e.g. per-sample gradients, can ignore this.)",
        ),
        params=tuple(stats.names),
        data={"optimizer": i, "backward_passes": n, "clears": clears, "count": len(stats.names)},
    )
