"""Where a NaN/Inf was born: the facts of a localized origin (:class:`OriginFacts`), its fix rules
(:data:`_FIX_RULES`) and its words, and the ``nan_origin`` findings built from them.

The op's own fix comes from the op advice table (:func:`~gradwatch.diagnose.op_fixes.fix_for`); each row of
``_FIX_RULES`` whose predicate holds for the facts rewrites it. What happened is worded by the phase the
value was born in (``_WHAT_BY_PHASE``). Nothing here reads tensors: the facts are read by the localizer.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from gradwatch.core.findings import Explanation, Finding
from gradwatch.diagnose.op_fixes import (
    GENERIC_FIX,
    MASKED_ROW,
    PLUS_INF_LOGIT,
    custom_function,
    fix_for,
    op_base,
)

if TYPE_CHECKING:
    from gradwatch.diagnose.replay import ReplayResult

#: ``nan_origin`` data for a NaN born in a custom Function's backward: the tool that checks that backward.
_CHECK_CUSTOM_BACKWARD = "gradwatch.gradcheck"

def _fmt(v: Any) -> str:
    if isinstance(v, float):
        if math.isnan(v) or math.isinf(v):
            return str(v)
        if v not in (1.0, -1.0) and abs(abs(v) - 1.0) < 5e-3:
            return f"{v:.9g}"  # acos/asin at 1.0000001: "1" would hide that the input left the domain
        return f"{v:.3g}"
    return str(v)


def _range(m: dict[str, float]) -> str:
    text = f"|x| from {_fmt(m['min_abs'])} to {_fmt(m['max_abs'])}"
    if "min" in m and m["min"] < 0:
        text = f"values from {_fmt(m['min'])} to {_fmt(m['max'])}, " + text
    return text


def _backward_context(inc: dict[str, Any]) -> tuple[str, str]:
    """For a backward/loss-phase origin: the gradient it received, and its forward inputs' range."""
    received = f"a finite gradient (|g| up to {_fmt(inc['max_abs'])})" if "max_abs" in inc else "a finite gradient"
    fwd = ""
    if "forward_min_abs" in inc:
        fwd = (
            " Its forward inputs: "
            + _range({k[len("forward_") :]: v for k, v in inc.items() if k.startswith("forward_")})
            + "."
        )
    return received, fwd


@dataclasses.dataclass(frozen=True)
class OriginFacts:
    """What the words of a ``nan_origin`` finding need about the op where a NaN/Inf was born.

    Attributes:
        step: The step the finding concerns.
        phase: ``"forward"``, ``"backward"`` or ``"loss"`` (see ``Origin.phase``).
        op: The autograd node (or forward function) that produced it, e.g. ``"SqrtBackward0"``.
        forward_op: The torch function that ran in the forward pass, if known.
        module: The innermost module that ran it (None outside any module).
        lightning: Found by the Lightning callback (code outside any module is ``training_step``).
        source: ``"file:line in function"`` of the user's code that called it; code: that line.
        incoming: The range of what went in (see ``Origin.incoming``); outgoing: ``nan``/``inf`` of what came out.
        forward_birth: A loss-code op's forward result was already non-finite.
        explicit_operand: The op was given an explicit non-finite Python number.
        masked: A forward NaN the rest of the forward masked out (the where-NaN trap).
        loss_before_model: The loss was non-finite in the forward pass while the model's forward was finite.
        surrogate: Replayed with a gradient of ones at the model output.
        half: Ran under autocast in float16; half_weights: the model's weights are float16.
        first_module: The first module whose output was non-finite, and the range of its inputs.
        first_module_carried: ``"NaN"``/``"Inf"`` when that module's inputs already held it (it passed it on),
            and last_finite_module: the last module before it whose output was finite; root_class: the class
            of the root module (``"<root>"``).
        inf_op: For a backward birth whose forward inputs held Inf: the forward op that made that Inf, which
            the forward then masked out (``torch.where(x > 0, w * x.log(), 0)``); inf_forward_op, inf_source,
            inf_code: its torch function, ``"file:line in function"`` and line.
        input_op: The op that produced the op's input (``"Sigmoid"``), which some fixes are keyed on.
    """

    step: int
    phase: str
    op: str | None
    forward_op: str | None
    module: str | None
    lightning: bool
    source: str | None
    code: str | None
    incoming: dict[str, Any]
    outgoing: dict[str, Any]
    forward_birth: bool
    explicit_operand: bool
    masked: bool
    loss_before_model: bool
    surrogate: bool
    half: bool
    half_weights: bool
    first_module: str | None
    first_module_inputs: dict[str, Any]
    inf_op: str | None = None
    inf_forward_op: str | None = None
    inf_source: str | None = None
    inf_code: str | None = None
    input_op: str | None = None
    first_module_carried: str | None = None
    last_finite_module: str | None = None
    root_class: str | None = None

    @property
    def op_base(self) -> str:
        return op_base(self.op or "")


def _origin_facts(step: int, result: ReplayResult) -> OriginFacts:
    """The facts of ``result``'s origin (it has one)."""
    loc = result.loc
    origin = loc.origin
    assert origin is not None
    inf = origin.masked_inf
    return OriginFacts(
        step=step,
        phase=origin.phase,
        op=origin.op,
        forward_op=origin.forward_op,
        module=origin.module,
        lightning=result.lightning,
        source=origin.source,
        code=origin.code,
        incoming=origin.incoming,
        outgoing=origin.outgoing,
        forward_birth=origin.forward_birth,
        explicit_operand=origin.explicit_operand,
        masked=origin.masked,
        loss_before_model=bool(result.loss_nonfinite and loc.forward_finite),
        surrogate=result.surrogate,
        half=result.half,
        half_weights=result.half_weights,
        first_module=loc.first_module,
        first_module_inputs=loc.first_module_inputs,
        inf_op=inf.op if inf is not None else None,
        inf_forward_op=inf.forward_op if inf is not None else None,
        inf_source=inf.source if inf is not None else None,
        inf_code=inf.code if inf is not None else None,
        input_op=origin.input_op,
        first_module_carried=loc.first_module_carried,
        last_finite_module=loc.last_finite_module,
        root_class=loc.root_class,
    )


def _inf_only(values: dict[str, Any]) -> bool:
    return bool(values.get("inf")) and not values.get("nan")


_LOSS_BEFORE_MODEL_FIX = (
    "the model's output (and so its inputs or weights) reached values the loss cannot hold: check this "
    "batch for unscaled features (normalize the inputs and targets), lower the learning rate if the "
    "weights grew, clip gradients, and compute the loss in float32."
)
_INF_MINUS_INF_FIX = (
    "Inf - Inf is NaN: a row where every value is -inf (a fully masked row of a hand-written masked "
    "softmax, `scores - scores.max(-1, keepdim=True).values`): mask with torch.finfo(x.dtype).min "
    "instead of -inf, keep one position unmasked, or use torch.softmax / "
    "F.scaled_dot_product_attention, which handle the max themselves."
)
_WHERE_NAN_FIX = (
    " Here its NaN never reached the model's output (masked out, e.g. torch.where(mask, x.sqrt(), 0)), "
    "but the gradient of the masked positions is 0 times the op's NaN/infinite derivative: NaN. Apply "
    "the op to a safe input instead: x_safe = torch.where(mask, x, 1.0), then "
    "torch.where(mask, x_safe.sqrt(), 0)."
)
_MASKED_INF_FIX = (
    " Here the Inf it made was masked out of the forward pass (torch.where(mask, w * x.log(), 0), or a "
    "multiplication by a 0/1 mask), but the backward multiplies the masked positions' zero gradient by it: "
    "0 * inf = NaN. Apply the op to a safe input instead: x_safe = torch.where(mask, x, 1.0), then "
    "torch.where(mask, w * x_safe.log(), 0)."
)
_AUTOCAST_HALF_FIX = (
    "this op ran under autocast in float16, whose largest finite value is 65504: the Inf is an "
    "overflow of half precision, not of the values themselves (clipping gradients cannot help). Keep "
    "this op in float32 (wrap it in torch.autocast(device_type, enabled=False) and call .float() on "
    "its inputs), scale its input down (normalize the batch), or use bfloat16 (float32's range). "
    "Otherwise: "
)
_HALF_WEIGHTS_FIX = (
    "the model's weights are float16 (model.half()), so this op most likely ran in float16, whose "
    "largest finite value is 65504: the Inf is an overflow of half precision (an attention score q.k "
    "or an activation above 65504), not of float32 values. Train with float32 weights under "
    "torch.autocast (bfloat16, or float16 with a GradScaler), compute this op in float32 (.float() on "
    "its inputs), or scale its input down (normalize the batch). Otherwise: "
)
_EXPLICIT_OPERAND_FIX = (
    "the float('inf')/float('nan') written in this line reaches the loss: if it is a mask or "
    "sentinel, mask it out before the loss (torch.where, or masked_fill with a finite value such as "
    "torch.finfo(x.dtype).min); otherwise replace it by a finite number."
)


def inf_multiplied(facts: OriginFacts) -> bool:
    """A backward NaN that is 0 * an Inf the forward masked out: the op that produced it has no domain edge of
    its own (a multiplication, a matmul: the op table has no fix for it), and its forward inputs held an Inf
    made by an earlier forward op. A logsumexp over that -inf is its own cause (a fully masked row)."""
    return facts.phase == "backward" and facts.inf_op is not None and fix_for(facts.op, facts.forward_op) is GENERIC_FIX


def _masked_inf_fix(facts: OriginFacts, fix: str) -> str:
    # The backward op (a Mul) only multiplied: the fix belongs to the op that made the Inf it multiplied by 0.
    return fix_for(facts.inf_op, facts.inf_forward_op) + _MASKED_INF_FIX


def _loss_before_model_fix(facts: OriginFacts, fix: str) -> str:
    return _LOSS_BEFORE_MODEL_FIX + ("" if fix is GENERIC_FIX else " " + fix[:1].upper() + fix[1:])


def softmax_inf_fix(facts: OriginFacts, fix: str) -> str:
    # Its inputs' range tells a +inf logit (a temperature of 0) from a fully masked row (-inf only).
    return PLUS_INF_LOGIT if facts.incoming.get("max") == math.inf else MASKED_ROW


def _half_weights_overflow(facts: OriginFacts) -> bool:
    return (
        facts.half_weights
        and facts.phase == "forward"
        and _inf_only(facts.outgoing)
        and not facts.incoming.get("inf")
        and facts.incoming.get("max_abs", math.inf) <= 65504.0
    )


#: How the op's own fix (``fix_for``) becomes the fix of one origin: every row whose predicate holds for the
#: facts rewrites the fix so far, in this order (so the last matching replacement wins).
_FIX_RULES: tuple[tuple[Callable[[OriginFacts], bool], Callable[[OriginFacts, str], str]], ...] = (
    (lambda f: f.phase == "backward" and f.loss_before_model, _loss_before_model_fix),
    (inf_multiplied, _masked_inf_fix),
    (
        lambda f: f.phase == "forward" and f.op_base in ("Softmax", "LogSoftmax") and bool(f.incoming.get("inf")),
        softmax_inf_fix,
    ),
    (
        lambda f: f.phase == "forward" and f.op_base in ("Sub", "Rsub", "Add") and _inf_only(f.incoming),
        lambda f, fix: _INF_MINUS_INF_FIX,
    ),
    (lambda f: f.phase == "forward" and f.masked, lambda f, fix: fix + _WHERE_NAN_FIX),
    (lambda f: f.half and _inf_only(f.outgoing), lambda f, fix: _AUTOCAST_HALF_FIX + fix),
    (_half_weights_overflow, lambda f, fix: _HALF_WEIGHTS_FIX + fix),
    (lambda f: f.explicit_operand, lambda f, fix: _EXPLICIT_OPERAND_FIX),
)


def origin_fix(facts: OriginFacts) -> str:
    """What to change for the origin ``facts`` describe: the op's own fix, rewritten by ``_FIX_RULES``."""
    fix = fix_for(facts.op, facts.forward_op, facts.input_op)
    for applies, rewrite in _FIX_RULES:
        if applies(facts):
            fix = rewrite(facts, fix)
    return fix


def _produced(facts: OriginFacts) -> str:
    produced = " and ".join(label for key, label in (("nan", "NaN"), ("inf", "Inf")) if facts.outgoing.get(key))
    return produced or "non-finite values"


def _source_lines(facts: OriginFacts) -> str:
    if not facts.source:
        return ""
    return f"\n    {facts.source}" + (f"\n      {facts.code}" if facts.code else "")


def _op_label(facts: OriginFacts) -> str:
    """``"SubBackward0 (torch.sub)"``: the node, and the forward function when it has another name."""
    differs = facts.forward_op and facts.forward_op != facts.op
    return f"{facts.op}" + (f" ({facts.forward_op})" if differs else "")


def _where_in(facts: OriginFacts) -> str:
    # "in module training_step" would name a function as a module.
    if facts.module is not None:
        return f"in module {facts.module}"
    return "in training_step" if facts.lightning else "outside any module"


def _loss_phase_what(facts: OriginFacts) -> str:
    received, fwd = _backward_context(facts.incoming)
    produced = _produced(facts)
    how_born = (
        f"Its forward result holds {produced} although its inputs were finite."
        if facts.forward_birth  # read from what its backward node saved
        else f"It received {received} and produced {produced}."
    )
    where = facts.module if facts.module is not None else "the loss code"
    return (
        f"Born in the loss computation of step {facts.step}, outside the model (its forward pass was finite): "
        f"op {_op_label(facts)} in {where}{_source_lines(facts)}\n{how_born}{fwd}"
    )


def _forward_inputs(facts: OriginFacts) -> str:
    inc = facts.incoming
    inputs = "It had no tensor inputs"
    if inc.get("inf"):
        inputs = f"Its inputs held Inf but no NaN ({_range(inc)})"
    elif "min_abs" in inc:
        inputs = f"Its inputs were finite ({_range(inc)})"
    if facts.explicit_operand:
        inputs += "; it was given an explicit non-finite Python number (float('inf') or float('nan'))"
    return inputs


def _made_first_note(facts: OriginFacts) -> str:
    ranged = f" (inputs {_range(facts.first_module_inputs)})" if facts.first_module_inputs else ""
    return f" First module with a non-finite output: {facts.first_module}{ranged}."


def _made_by(facts: OriginFacts) -> str:
    """Whose code made the value: ``"the forward code of <root> (Net) itself"``, ``"training_step"``..."""
    if facts.module is None:
        return "training_step" if facts.lightning else "code outside the model"
    label = f"{facts.module} ({facts.root_class})" if facts.module.startswith("<root") and facts.root_class else facts.module
    return f"the forward code of {label} itself"


def _passed_on_note(facts: OriginFacts) -> str:
    # The first module with a non-finite output only passed on what it was given: naming it alone would send
    # the user to a module that did nothing wrong. The value was made by the code that ran before it.
    after = f"after {facts.last_finite_module} (the last module whose output was finite) and " if facts.last_finite_module else ""
    return (
        f" The first module with a non-finite output, {facts.first_module}, was given {facts.first_module_carried} "
        f"and only passed it on: it was made by {_made_by(facts)}, {after}before {facts.first_module}: the op above."
    )


def _first_module_note(facts: OriginFacts) -> str:
    """Which module first output the non-finite value, or that it was given it (see ``first_module_carried``)."""
    if facts.first_module is None:
        return ""
    return (_passed_on_note if facts.first_module_carried else _made_first_note)(facts)


def _forward_what(facts: OriginFacts) -> str:
    return (
        f"Born in the forward pass of step {facts.step}: op {_op_label(facts)} {_where_in(facts)}"
        f"{_source_lines(facts)}\n{_forward_inputs(facts)}; its output holds {_produced(facts)}."
        + _first_module_note(facts)
    )


def _masked_inf_note(facts: OriginFacts) -> str:
    """Where the Inf among a backward op's forward inputs came from ("" when not known)."""
    if not inf_multiplied(facts):
        return ""
    differs = facts.inf_forward_op and facts.inf_forward_op != facts.inf_op
    label = facts.inf_op + (f" ({facts.inf_forward_op})" if differs else "")
    where = f" at {facts.inf_source}" + (f": {facts.inf_code}" if facts.inf_code else "") if facts.inf_source else ""
    return (
        f" The Inf among its forward inputs was made by op {label}{where}; the forward pass masked it out, so "
        "the loss stayed finite."
    )


def _backward_what(facts: OriginFacts) -> str:
    received, fwd = _backward_context(facts.incoming)
    site = f"{_op_label(facts)} {_where_in(facts)}{_source_lines(facts)}\n"
    if facts.loss_before_model:
        what = (
            f"The loss of step {facts.step} was already non-finite in the forward pass, although the model's "
            "output was finite: the loss computation made it first (squaring or exponentiating a finite but "
            "huge output overflows: float32 ends at 3.4e38, so x ** 2 at |x| > 1.8e19). In the backward pass "
            f"the first op to go non-finite was {site}"
        )
    else:
        what = f"Born in the backward pass of step {facts.step} (the forward pass was finite): op {site}"
    what += f"It received {received} and produced {_produced(facts)}.{fwd}" + _masked_inf_note(facts)
    if facts.surrogate and facts.phase == "backward":
        what += " (Replayed with a gradient of ones at the model output; the real one was not available.)"
    return what


#: What happened, by the phase the NaN/Inf was born in (any other phase reads as the backward pass).
_WHAT_BY_PHASE: dict[str, Callable[[OriginFacts], str]] = {"loss": _loss_phase_what, "forward": _forward_what}


def origin_explanation(facts: OriginFacts) -> Explanation:
    """The explanation of a ``nan_origin`` finding with a located op: what happened, and the fix."""
    what = _WHAT_BY_PHASE.get(facts.phase, _backward_what)(facts)
    return Explanation(what=what, fix=origin_fix(facts))


def origin_message(facts: OriginFacts) -> str:
    """The message of a ``nan_origin`` finding with a located op: what happened, then the fix."""
    return origin_explanation(facts).render()


def _located_data(facts: OriginFacts, result: ReplayResult) -> dict[str, Any]:
    """The ``nan_origin`` data of a located op."""
    origin = result.loc.origin
    assert origin is not None
    function = custom_function(facts.op)
    return {
        "phase": facts.phase,
        "op": facts.op,
        "forward_op": facts.forward_op,
        "input_op": facts.input_op,
        "module": facts.module,
        "source": facts.source,
        "code": facts.code,
        "incoming": dict(facts.incoming),
        "outgoing": dict(facts.outgoing),
        "forward_traceback": origin.traceback or result.anomaly_traceback,
        "explicit_operand": facts.explicit_operand,
        "loss_nonfinite_first": bool(facts.phase == "backward" and facts.loss_before_model),
        "custom_function": function,
        "check_with": _CHECK_CUSTOM_BACKWARD if function else None,
        "masked_inf": (
            {"op": facts.inf_op, "forward_op": facts.inf_forward_op, "source": facts.inf_source, "code": facts.inf_code}
            if inf_multiplied(facts)
            else None
        ),
    }


#: Why the suspect that did it is not named, by whether the step was replayed (else it ran escalated, with
#: the loss code's backward watched).
_UNNAMED_SUSPECT = {
    True: (
        " Which of them did cannot be told after the backward (it frees the values they saw); if it recurs in "
        "the next (escalated) steps, the op is named with its line."
    ),
    False: (
        " This step ran escalated with the loss code's backward watched: the ops whose gradient went "
        "non-finite there already had NaN/Inf among their forward inputs, so one of these ops made it in the "
        "loss code's forward pass, and the rest masked it out (torch.where(mask, x.log(), 0) still sends "
        "0 * NaN = NaN back) or passed it on. "
        "Compute such an op on a safe input: x_safe = torch.where(mask, x, 1.0), then "
        "torch.where(mask, x_safe.log(), 0)."
    ),
}


def _loss_suspects(loss_ops: list[str], replayed: bool = True) -> str:
    """The loss code's ops that can turn finite values into NaN/Inf, as a sentence ("" for none)."""
    if not loss_ops:
        return ""
    counts = {name: loss_ops.count(name) for name in dict.fromkeys(loss_ops)}
    listed = ", ".join(f"{n} ({c} calls)" if c > 1 else n for n, c in counts.items())
    return (
        f" The loss code between the model's output and the loss runs {listed}: ops that turn finite "
        "values into NaN/Inf at the edge of their domain." + _UNNAMED_SUSPECT[replayed]
    )


_LOSS_CODE_FIX = (
    "look at the loss function: log of a 0 probability (use log_softmax / cross_entropy on logits, "
    "or clamp the probability), division by a zero count or norm, sqrt at 0, or a NaN/Inf target."
)
#: An nll_loss is listed among the loss code's suspects only when it has class weights (see ``_loss_ops``).
_CLASS_WEIGHT_FIX = (
    "a NaN/Inf class weight (weight=) makes the gradient non-finite: 1/count with a class absent "
    "from the counts is Inf (clamp the counts: 1 / counts.clamp_min(1))."
)


def _suspect_fix(name: str, input_from: str | None) -> str:
    return _CLASS_WEIGHT_FIX if op_base(name) in ("NllLoss", "NllLoss2d") else fix_for(name, None, input_from)


def _loss_code_fix(loss_ops: list[str], inputs: dict[str, str] | None = None) -> str:
    """One kind of suspect: its own fix; several: each one's; none known: the loss function's usual faults.
    ``inputs``: the op a suspect took its input from (``{"LogBackward0": "Sigmoid"}``), where one."""
    inputs = inputs or {}
    fixes = {name: _suspect_fix(name, inputs.get(name)) for name in dict.fromkeys(loss_ops)}
    known = {name: f for name, f in fixes.items() if f is not GENERIC_FIX}
    if len(set(known.values())) == 1:
        return next(iter(known.values()))
    if known:
        return "for each suspect: " + " ".join(f"{op_base(n)}: {f}" for n, f in known.items())
    return _LOSS_CODE_FIX


def _loss_code_finding(step: int, result: ReplayResult, how: str, data: dict[str, Any]) -> Finding:
    """The model's forward was finite but the gradient from the loss was not, and no loss op was located."""
    data.update(phase="loss", op=None, module=None, loss_ops=list(result.loss_ops))
    what = (
        f"The model's forward pass was finite at step {step}, but the gradient arriving at its output "
        "from the loss was already non-finite: the NaN/Inf was born in the loss computation, outside "
        "the model (seen in " + how + ")." + _loss_suspects(result.loss_ops, result.replayed)
    )
    explanation = Explanation(what=what, fix=_loss_code_fix(result.loss_ops, result.loss_inputs))
    return Finding(kind="nan_origin", step=step, severity="error", explanation=explanation, data=data)


def _first_seen_finding(step: int, result: ReplayResult, how: str, data: dict[str, Any]) -> Finding:
    """No op made the NaN/Inf, but a traced op's input already held it."""
    seen = result.loc.first_seen
    assert seen is not None
    where = seen.module if seen.module is not None else ("training_step" if result.lightning else "the loss code")
    line = f"\n    {seen.source}" + (f"\n      {seen.code}" if seen.code else "") if seen.source else ""
    data.update(phase="forward", op=None, module=seen.module, first_seen=seen.func, source=seen.source,
                code=seen.code)
    what = (
        f"At step {step} ({how}) the forward pass already held NaN/Inf that no traced op produced: it was "
        f"first seen as an input of {seen.func} in {where}{line}\n"
        "It was written in place (x[i] = float('nan'), masked_fill_ with NaN), read from a buffer or a "
        "tensor the model keeps, or made by code gradwatch does not trace."
    )
    fix = (
        "look at what that line's inputs hold and where they were last written; guard the write "
        "(torch.nan_to_num, a finite fill value such as torch.finfo(x.dtype).min)."
    )
    explanation = Explanation(what=what, fix=fix)
    return Finding(
        kind="nan_origin", step=step, severity="error", explanation=explanation, module=seen.module, data=data
    )


def _unreproduced_finding(step: int, result: ReplayResult, how: str, data: dict[str, Any]) -> Finding:
    """Every recorded op and node was finite."""
    loc = result.loc
    data.update(phase=None, op=None, module=loc.first_module)
    what = (
        f"gradwatch could not reproduce where the non-finite value of step {step} was born ({how}: "
        f"{loc.ops_recorded} forward ops and {loc.nodes_recorded} backward nodes were all finite"
        + (
            ", replayed with a gradient of ones because the real upstream gradient was not available"
            if result.surrogate
            else ""
        )
        + "). It may come from outside the watched model, from randomness in the step (dropout), or "
        "from a custom autograd Function."
    )
    explanation = Explanation(what=what, fix="see the per-layer table; the next steps run with anomaly mode on.")
    return Finding(
        kind="nan_origin", step=step, severity="warning", explanation=explanation, module=loc.first_module, data=data
    )


def origin_finding(step: int, result: ReplayResult, layers: list[dict[str, Any]]) -> Finding:
    """The ``nan_origin`` finding of one localized step: the op where the NaN/Inf was born, or why none was."""
    loc = result.loc
    data: dict[str, Any] = {
        "replayed": result.replayed,
        "surrogate_grad": result.surrogate,
        "first_nonfinite_module": loc.first_module,
        "first_nonfinite_module_inputs": dict(loc.first_module_inputs),
        "first_nonfinite_module_given": loc.first_module_carried,
        "last_finite_module": loc.last_finite_module,
        "anomaly_error": result.anomaly_error,
        "table": layers,
    }
    if result.named:
        facts = _origin_facts(step, result)
        data.update(_located_data(facts, result))
        return Finding(
            kind="nan_origin", step=step, severity="error", explanation=origin_explanation(facts),
            module=facts.module, op=facts.op, data=data,
        )
    how = "a replay of the step" if result.replayed else "the escalated step itself"
    if result.loss_born:
        return _loss_code_finding(step, result, how, data)
    if loc.first_seen is not None:
        return _first_seen_finding(step, result, how, data)
    return _unreproduced_finding(step, result, how, data)
