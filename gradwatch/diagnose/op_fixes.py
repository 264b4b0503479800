"""Op advice: what to change when an op makes NaN/Inf, as a table keyed by op (:data:`OP_FIXES`), and one keyed
by the op and the op that produced its input (:data:`INPUT_FIXES`: ``log(sigmoid(z))`` is ``F.logsigmoid(z)``).

:func:`fix_for` looks an op up (``"SqrtBackward0"``, ``"torch.sqrt"``; with :func:`input_op`'s answer, the
input's op first); :data:`GENERIC_FIX` is the answer for an op the tables do not know. :func:`can_turn_nonfinite` and :func:`absorbs_mask` are facts about an op read from
the same table.
"""

from __future__ import annotations

import re
from typing import Any


def can_turn_nonfinite(node: Any) -> bool:
    """Whether a backward node's op can make NaN/Inf from finite inputs (the ops ``fix_for`` knows, softmax
    aside: it needs an Inf input; custom autograd Functions, whose backward is the user's)."""
    name = node.name()
    if re.fullmatch(r"[A-Za-z_]\w*Backward", name):
        return True  # a custom autograd.Function (no digit suffix): its backward may divide by anything
    base = re.sub(r"Backward\d*$", "", name.rsplit("::", 1)[-1])
    if not any(base in names for names, _fix in OP_FIXES if "Softmax" not in names):
        return False
    if base == "Pow":
        try:
            exponent = node._saved_exponent  # a number for x ** p; still readable after the backward
        except Exception:  # noqa: BLE001 - a tensor exponent, released
            return True
        if isinstance(exponent, (int, float)) and float(exponent).is_integer() and exponent >= 0:
            return False  # x ** 2: finite wherever x is
    if base in ("NllLoss", "NllLoss2d"):
        # Asked only when the gradient reaching the model was non-finite. Every target ignored makes the loss
        # 0/0 = NaN but its gradient zero, so without class weights nll_loss cannot have made it; a weight
        # (NaN/Inf from 1/count) can. The weight reads as None after the backward when none was passed.
        try:
            return node._saved_weight is not None
        except Exception:  # noqa: BLE001 - a weight tensor, released by the backward
            return True
    return True


def absorbs_mask(op: str) -> bool:
    """Whether ``op`` is where an additive attention mask's -inf is meant to go (a NaN there is a fully
    masked row, not bad data): softmax, log-softmax, logsumexp, scaled_dot_product_attention."""
    base = op_base(op).lower()
    return any(k in base for k in ("softmax", "logsumexp", "scaled_dot_product", "scaleddotproduct", "attention"))


#: The two ways softmax / log_softmax go NaN on finite-or-infinite logits: which one a forward-phase origin
#: is, its inputs' range tells (see ``origin.softmax_inf_fix``); without them (the loss code's backward) both are given.
MASKED_ROW = (
    "a fully masked row (every logit -inf) makes softmax NaN: keep one position unmasked, or mask with "
    "torch.finfo(x.dtype).min instead of -inf."
)
PLUS_INF_LOGIT = (
    "a logit of +inf makes softmax NaN too (inf - inf): logits divided by a temperature or scale of 0 "
    "(clamp it: tau.clamp_min(1e-2)), or a logit that overflowed (compute it in float32, lower the "
    "learning rate)."
)

OP_FIXES: list[tuple[tuple[str, ...], str]] = [
    (
        ("Log", "Log2", "Log10", "Log1p", "Xlogy", "Lgamma", "Digamma"),
        "log of 0 or of a negative number: clamp the input (torch.log(x.clamp_min(1e-8))), add an epsilon, or "
        "stay in log space (log_softmax, logsumexp, cross_entropy on logits).",
    ),
    (
        ("Sqrt",),
        "the derivative of sqrt is infinite at 0 (and sqrt of a negative number is NaN): use "
        "torch.sqrt(x + 1e-8) or x.clamp_min(1e-8).sqrt(); for a norm, torch.linalg.vector_norm has a "
        "defined gradient at 0.",
    ),
    (
        # rsqrt is Inf at 0 in the forward pass already (not only its derivative): a hand-written RMSNorm
        # with eps=0 on an all-zero vector (a padding or masked position) gives 0 * inf = NaN.
        ("Rsqrt",),
        "rsqrt(0) = 1/sqrt(0) is Inf (and rsqrt of a negative number is NaN): put an epsilon inside, "
        "torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) with eps > 0 (an RMSNorm with eps=0 divides by "
        "zero on an all-zero vector: a padding or masked position), or x.clamp_min(1e-8).rsqrt().",
    ),
    (
        ("Div", "Reciprocal", "Remainder", "Fmod"),
        "division by zero (a zero norm, count or std): divide by d.clamp_min(1e-8) or (d + 1e-8), or use "
        "F.normalize(x, eps=1e-8). A learned scale or a temperature that reached 0 (the sigma of "
        "torch.distributions.Normal, whose log_prob divides by sigma ** 2; the tau of F.gumbel_softmax) needs a "
        "floor: sigma = F.softplus(raw) + 1e-3 (or log_sigma.clamp(min=-7).exp()), tau.clamp_min(1e-2).",
    ),
    (
        ("Pow",),
        "pow of a negative base with a fractional exponent is NaN, and x ** p with p < 1 has an infinite "
        "derivative at 0: clamp the base (x.clamp_min(1e-8) ** p) or use torch.sign(x) * x.abs().clamp_min(1e-8) ** p.",
    ),
    (
        ("Exp", "Exp2", "Expm1", "Sinh", "Cosh"),
        "exp overflow (float32 overflows above exp(88), float16 above exp(11)): clamp the input "
        "(x.clamp(max=80)), subtract the maximum first (logsumexp, softmax), or lower the learning rate.",
    ),
    (
        ("Acos", "Asin", "Atanh", "Erfinv", "Acosh"),
        "the derivative is infinite at the edge of the domain: clamp the input, e.g. x.clamp(-1 + 1e-6, 1 - 1e-6).",
    ),
    (
        ("Softmax", "LogSoftmax"),
        MASKED_ROW + " " + PLUS_INF_LOGIT[:1].upper() + PLUS_INF_LOGIT[1:],
    ),
    (
        ("Std", "Var", "StdMean", "VarMean"),
        "std/var of a single element (a batch of 1, a dimension of size 1) divides by n - 1 = 0, and a "
        "near-constant input makes the gradient of std (1/std) explode: use drop_last=True in the "
        "DataLoader or correction=0 (unbiased=False), and add an epsilon: (x.var(...) + 1e-5).sqrt().",
    ),
    (
        ("Logsumexp",),
        "logsumexp over a row where every value is -inf (a fully masked row) is -inf and its gradient NaN: "
        "keep one position unmasked, or mask with torch.finfo(x.dtype).min instead of -inf.",
    ),
    (
        ("NllLoss", "NllLoss2d", "nll_loss_forward", "nll_loss2d_forward", "CrossEntropyLoss"),
        "every target of this batch is ignore_index (or has weight 0), so the mean is 0/0: skip such "
        "batches, or use reduction='sum' and divide by the number of counted targets clamped to at least 1. "
        "If you pass class weights (weight=), check them for NaN/Inf: 1/count with a class absent from the "
        "counts is Inf (clamp the counts: 1 / counts.clamp_min(1)).",
    ),
    (
        ("CtcLoss", "ctc_loss", "CTCLoss"),
        "CTC loss is inf for a sample whose input is too short for its target: it needs at least as many "
        "frames as target labels, plus one between each pair of repeated labels. Check input_lengths against "
        "target_lengths (and the blank index), or use nn.CTCLoss(zero_infinity=True) to drop such samples' "
        "loss and gradient.",
    ),
    (
        ("LinalgEigh", "LinalgEig", "LinalgSvd", "Svd", "Symeig", "Eig", "LinalgEigvals", "LinalgLstsq"),
        "eigenvector and singular-vector gradients divide by the gaps between eigenvalues (lambda_i - lambda_j): "
        "repeated or near-equal eigenvalues (duplicate samples, a rank-deficient or symmetric input) make "
        "them Inf/NaN. Use torch.linalg.eigvalsh / svdvals when only the values are needed, add a small "
        "jitter to the diagonal (A + 1e-5 * torch.eye(n)), compute in float64, or avoid duplicate samples.",
    ),
    (
        ("LinalgCholesky", "Cholesky", "LinalgCholeskyEx", "CholeskySolve", "LinalgInv", "LinalgInvEx",
         "LinalgSolve", "LinalgDet", "Logdet", "LinalgSlogdet"),
        "the matrix is singular or nearly so (not positive definite for Cholesky): its inverse, and the "
        "gradient through it, blows up. Add a jitter to the diagonal (A + 1e-5 * torch.eye(n)), compute in "
        "float64, or check what makes it rank-deficient (duplicate samples, a batch smaller than the dimension).",
    ),
    (
        ("Cdist", "Pdist", "Dist"),
        "the gradient of a Euclidean distance or norm divides by its value: at zero distance (identical "
        "points, a zero vector) it is NaN. Add an epsilon inside the square root "
        "(((a - b) ** 2).sum(-1) + 1e-8).sqrt().",
    ),
    (
        ("BinaryCrossEntropy",),
        "binary_cross_entropy on probabilities of exactly 0 or 1 (a saturated sigmoid) takes log(0): use "
        "F.binary_cross_entropy_with_logits on the logits (or nn.BCEWithLogitsLoss), which stays finite.",
    ),
    (
        ("Softplus",),
        "softplus of a very large input overflows when its threshold is raised: keep the default threshold "
        "(20), or clamp the input.",
    ),
    (
        ("Tan", "Atan2"),
        "the op is singular here: keep its input away from the singular points (clamp, add an epsilon).",
    ),
    (
        ("NativeLayerNorm", "NativeGroupNorm", "NativeBatchNorm", "CudnnBatchNorm", "RmsNorm", "FusedRmsNorm",
         "layer_norm", "group_norm", "batch_norm", "instance_norm", "rms_norm"),
        "normalizing a constant row or channel (zero variance) divides by sqrt(var + eps): with eps=0 that is "
        "0/0. Keep eps > 0 (nn.LayerNorm/nn.GroupNorm/nn.BatchNorm default to 1e-5), and check for constant "
        "inputs (an all-padding sample, a dead channel).",
    ),
]
#: Fixes keyed by the op and the op that produced its input (see :func:`input_op`): asked before
#: :data:`OP_FIXES`, whose advice for the op alone would point elsewhere (log_softmax for a log of a sigmoid).
INPUT_FIXES: list[tuple[tuple[str, ...], tuple[str, ...], str]] = [
    (
        ("Log", "Log2", "Log10"),
        ("Sigmoid",),
        "log of a sigmoid that saturated: in float32 sigmoid(z) rounds to 0 below z = -88 and to 1 above "
        "z = 17 (so 1 - sigmoid(z) is 0; float16: -11 and 8), and log(0) is -inf with an infinite gradient. Stay "
        "in log space: F.logsigmoid(z) instead of torch.log(torch.sigmoid(z)), F.logsigmoid(-z) instead of "
        "torch.log(1 - torch.sigmoid(z)); for a binary cross-entropy written by hand, use nn.BCEWithLogitsLoss "
        "(F.binary_cross_entropy_with_logits) on the logits z.",
    ),
    (
        ("Log", "Log2", "Log10"),
        ("Softmax",),
        "log of a softmax that underflowed: a probability rounds to 0 once its logit is about 88 below the "
        "largest (about 11 in float16), and log(0) is -inf with an infinite gradient. Stay in log space: "
        "F.log_softmax(x, dim) instead of torch.log(torch.softmax(x, dim)), or F.cross_entropy / "
        "nn.CrossEntropyLoss (nn.NLLLoss after log_softmax) on the logits.",
    ),
]
#: Ops :func:`input_op` looks through to the op before them: ``log(1 - sigmoid(z))`` is a log of a sigmoid.
_LOOK_THROUGH = ("Rsub",)


def input_op(node: Any) -> str | None:
    """The op (``"Sigmoid"``) that produced the first input of the backward node ``node`` (``LogBackward0``),
    looking through ``1 - x``; None for a leaf, a missing node or a node that cannot be read."""
    try:
        for _ in range(1 + len(_LOOK_THROUGH)):
            node = next((n for n, _i in node.next_functions if n is not None), None)
            if node is None or type(node).__name__ == "AccumulateGrad":
                return None
            base = op_base(node.name())
            if base not in _LOOK_THROUGH:
                return base
    except Exception:  # noqa: BLE001 - not an autograd node
        return None
    return None


GENERIC_FIX = (
    "the values grew out of range: lower the learning rate, add normalization before this op, clip "
    "gradients, or compute this part in float32; if the op has a restricted domain, clamp its input."
)


def op_base(name: str) -> str:
    """``"SubBackward0"`` -> ``"Sub"``, ``"torch.nn.functional.layer_norm"`` -> ``"Layer_norm"``."""
    base = re.sub(r"Backward\d*$", "", name.rsplit(".", 1)[-1]).lstrip("_")
    return re.sub(r"_$", "", base[:1].upper() + base[1:])


def custom_function(op: str | None) -> str | None:
    """The name of the custom autograd.Function whose backward node ``op`` is (``"CubeBackward"`` -> ``"Cube"``;
    torch's own nodes end in a digit), else None."""
    return op[: -len("Backward")] if op and re.fullmatch(r"[A-Za-z_]\w*Backward", op) else None


def fix_for(op: str | None, forward_op: str | None = None, input_from: str | None = None) -> str:
    """What to change for a non-finite value born in ``op`` (e.g. ``"SqrtBackward0"``); ``input_from``: the op
    that produced its input (``"Sigmoid"``, see :func:`input_op`), asked first in :data:`INPUT_FIXES`."""
    name = custom_function(op)
    if name is not None:
        return (
            f"{op} is the backward of the custom autograd.Function {name}: its backward() returned NaN/Inf "
            f"from a finite incoming gradient. Check {name}.backward's formula (divisions by saved values, "
            "log or sqrt of them) for the inputs its forward accepts; gradwatch.gradcheck(model, batch) (or "
            "gw.gradcheck() after the step) compares every custom Function's backward with finite differences "
            "of its forward on the inputs it received."
        )
    if input_from:
        bases = {op_base(name) for name in (op, forward_op) if name}
        for names, inputs, fix in INPUT_FIXES:
            if bases & set(names) and op_base(input_from) in inputs:
                return fix
    for name in (op, forward_op):
        if not name:
            continue
        base = op_base(name)
        for names, fix in OP_FIXES:
            if base in names or base.lower() in {n.lower() for n in names}:
                return fix
    return GENERIC_FIX
