"""``nonscalar_backward``: backward() on a tensor that is not a scalar, without a gradient argument.

:func:`nonscalar_facts` reads the tensor, the module and reduction it comes from and the line that called
backward(); :func:`origin_cause` names how it came to have more than one element, and :data:`ORIGINS`
words each such cause.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from gradwatch.core.findings import Explanation, Finding
from gradwatch.diagnose.autograd.context import Context, children, is_user_file, local_name, own_param, walk
from gradwatch.observe.tracing import library_frame, node_op

#: Ops that reduce a tensor (over some or all of its dimensions).
REDUCTIONS = frozenset({"Mean", "Sum", "Amax", "Amin", "Max", "Min", "Norm", "LinalgVectorNorm", "Prod", "Logsumexp"})


@dataclass(frozen=True)
class NonscalarFacts:
    """The tensor backward() was called on and where it comes from."""

    step: int
    shape: list[int] | None = None
    node: str | None = None  # its grad_fn's name
    op: str | None = None  # its grad_fn's op
    module: str | None = None  # the module whose output it comes from
    #: The module was found down a short chain of single-input ops (else by a walk of the graph).
    exact_chain: bool = False
    reduced: str | None = None  # a reduction met on the way (over some dimensions only)
    loss_op: str | None = None  # a loss function met on the way (called with reduction='none')
    name: str | None = None  # the user's local variable holding it
    source: str | None = None  # the user's line that called backward()


@dataclass
class _Origin:
    module: str | None = None
    reduced: str | None = None
    loss_op: str | None = None

    def meet(self, n: Any) -> None:
        """Note a reduction (the last one met wins) or a loss function (the first one wins) at node ``n``."""
        if node_op(n) in REDUCTIONS:
            self.reduced = node_op(n)
        if self.loss_op is None and "Loss" in node_op(n):
            self.loss_op = node_op(n)  # a loss function called with reduction='none'


def _chain_origin(ctx: Context, loss: torch.Tensor) -> _Origin:
    """Down a short chain of single-input ops (Lightning divides by accumulate_grad_batches, a loss may be
    scaled): is this the unreduced output of a module?"""
    origin = _Origin()
    n: Any = loss.grad_fn
    for _ in range(4):
        origin.meet(n)
        own = own_param(ctx, n)
        if own is not None:
            origin.module = ctx.display_module(own[1])
            break
        inner = [c for c in children(n) if not hasattr(c, "variable")]
        if len(inner) != 1 or children(n) != inner:
            break
        n = inner[0]
    return origin


def _walked_origin(ctx: Context, loss: torch.Tensor, origin: _Origin) -> None:
    """Not a short chain (a Dice loss's ratio of sums, a critic's D(fake) - D(real)): the nearest model
    parameters name the module it is computed from, and a reduction met on the way (breadth-first, before
    that module's op) is one over some dimensions only."""
    for n, _depth in walk([loss]):
        own = own_param(ctx, n)
        if own is not None:
            origin.module = ctx.display_module(own[1])
            return
        if origin.reduced is None and node_op(n) in REDUCTIONS:
            origin.reduced = node_op(n)
        if origin.loss_op is None and "Loss" in node_op(n):
            origin.loss_op = node_op(n)


def _backward_line(ctx: Context) -> str | None:
    """The line that called backward(), if the user's code called it (not Lightning's automatic optimization)."""
    caller = next((f for f in reversed(ctx.frames) if not library_frame(f)), None)
    return ctx.source_of(caller) if caller is not None and is_user_file(caller.f_code.co_filename) else None


def nonscalar_facts(ctx: Context) -> NonscalarFacts:
    roots = ctx.roots()
    loss = roots[0] if roots else None
    if loss is None:
        return NonscalarFacts(ctx.step, source=_backward_line(ctx))
    grad_fn = loss.grad_fn
    origin = _chain_origin(ctx, loss) if grad_fn is not None else _Origin()
    exact_chain = origin.module is not None
    if not exact_chain and grad_fn is not None:
        _walked_origin(ctx, loss, origin)
    return NonscalarFacts(
        step=ctx.step,
        shape=list(loss.shape),
        node=None if grad_fn is None else grad_fn.name(),
        op=None if grad_fn is None else node_op(grad_fn),
        module=origin.module,
        exact_chain=exact_chain,
        reduced=origin.reduced,
        loss_op=origin.loss_op,
        name=local_name(ctx, loss),
        source=_backward_line(ctx),
    )


def origin_cause(f: NonscalarFacts) -> str:
    """How the tensor came to have more than one element (a key of :data:`ORIGINS`)."""
    if f.module is None:
        return "op_output" if f.op is not None else "unknown"
    if not f.exact_chain:
        return "walked_reduced" if f.reduced else "walked_loss_none" if f.loss_op else "walked_unreduced"
    return "partial_reduction" if f.reduced else "loss_none" if f.loss_op else "module_output"


#: Cause -> the sentence on where the tensor comes from.
ORIGINS: dict[str, Callable[[NonscalarFacts], str]] = {
    "walked_reduced": lambda f: (
        f" It is computed (through {f.op}) from the output of module {f.module}, reduced ({f.reduced}) over some "
        "dimensions but not all of them (e.g. .sum(dim=1) per sample)."
    ),
    "walked_loss_none": lambda f: (
        f" It is computed (through {f.op}) from the output of module {f.module}, through {f.loss_op} called "
        "with reduction='none'."
    ),
    "walked_unreduced": lambda f: (
        f" It is computed (through {f.op}) from the output of module {f.module}, with no reduction to a single "
        "number."
    ),
    "partial_reduction": lambda f: (
        f" It comes from the output of module {f.module}, reduced ({f.reduced}) over some dimensions but not "
        "all of them (e.g. .mean(dim=1))."
    ),
    "loss_none": lambda f: (
        f" It is the per-element output of {f.loss_op} (a loss function called with reduction='none') on the "
        f"output of module {f.module}."
    ),
    "module_output": lambda f: f" It comes straight from the output of module {f.module}, with no reduction in between.",
    "op_output": lambda f: f" It is the output of {f.op}.",
    "unknown": lambda f: "",
}


def nonscalar_words(f: NonscalarFacts) -> Explanation:
    shape_text = f" of shape {f.shape}" if f.shape is not None else ""
    where = f"\nWhere: backward() on {'`' + f.name + '`' if f.name else 'it'} at {f.source}." if f.source else ""
    loss = f.name or "loss"
    return Explanation(
        what=(
            f"backward() failed at step {f.step}: it was called on a tensor{shape_text}, not a scalar, and without "
            "a gradient argument." + ORIGINS[origin_cause(f)](f) + where
        ),
        why=(
            "backward() without arguments needs one number to differentiate; for a tensor it would "
            "need the gradient of something with respect to each element."
        ),
        fix=(
            f"reduce it to the loss you mean — `{loss}.mean()` or `{loss}.sum()` (a loss function with "
            "reduction='none' returns one value per element) — or pass the gradient explicitly: "
            "`out.backward(gradient=torch.ones_like(out))`."
        ),
    )


def explain_nonscalar(ctx: Context) -> Finding:
    f = nonscalar_facts(ctx)
    return Finding(
        kind="nonscalar_backward",
        step=ctx.step,
        severity="error",
        explanation=nonscalar_words(f),
        module=f.module,
        op=f.op,
        data={"shape": f.shape, "node": f.node, "source": f.source, "module_exact": f.exact_chain},
    )
