"""``no_grad_graph``: backward() on a loss without an autograd graph (no grad_fn, requires_grad=False).

:func:`no_graph_facts` reads the model's frozen and trainable parameters, the grad mode of backward and of the
model's forward, and the user's tensors that still have a graph; :func:`no_graph_cause` picks the first cause
of :data:`NO_GRAPH_RULES` that fits, and :data:`NO_GRAPH_CAUSES` words it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from gradwatch.core.findings import Explanation, Finding, names_text
from gradwatch.diagnose.autograd.context import Context


@dataclass(frozen=True)
class NoGraphFacts:
    """What may have cut the graph."""

    step: int
    model_type: str | None = None  # the model's class, if the run has a model
    loss_shape: list[int] | None = None
    inference: bool = False  # the loss is an inference tensor
    grad_enabled: bool = True  # gradient tracking was on when backward() was called
    #: The model's last forward ran with grad disabled (False), enabled (True), or not traced (None).
    forward_grad: bool | None = None
    optimizer_type: str | None = None  # a custom optimizer whose step() runs the closure under no_grad
    trainable: int = 0
    frozen: list[str] = field(default_factory=list)  # the model's parameters with requires_grad=False
    connected: list[str] = field(default_factory=list)  # the user's locals (``x``) that still have a graph


#: The causes, first that fits wins: ``(cause, does it fit)``.
NO_GRAPH_RULES: tuple[tuple[str, Callable[[NoGraphFacts], bool]], ...] = (
    ("all_frozen", lambda f: f.model_type is not None and not f.trainable),
    ("inference_mode", lambda f: f.inference),
    ("no_grad_backward", lambda f: not f.grad_enabled),
    ("closure_under_no_grad", lambda f: f.forward_grad is False and f.optimizer_type is not None),
    ("forward_under_no_grad", lambda f: f.forward_grad is False),
    ("frozen_path", lambda f: bool(f.frozen) and not f.connected),
    ("frozen_or_detached", lambda f: bool(f.frozen)),
    ("detached", lambda f: True),
)


def no_graph_cause(f: NoGraphFacts) -> str:
    return next(cause for cause, fits in NO_GRAPH_RULES if fits(f))


def _has(names: list[str]) -> str:
    return "has" if len(names) == 1 else "have"


def _detached(f: NoGraphFacts) -> str:
    hint = ""
    if f.connected:
        it = "it" if len(f.connected) == 1 else "them"
        hint = (
            f" In your code, {names_text(f.connected)} still {_has(f.connected)} a graph, so the cut is between "
            f"{it} and the loss."
        )
    return (
        "the model's forward ran with gradients, so the graph was cut between the output and the loss: "
        "`.detach()`, `.item()`/`.tolist()`/`.numpy()` followed by torch.tensor(...), `.data`, a "
        "torch.no_grad() block around the loss computation, or an op without a gradient: argmax/argmin, "
        "a comparison (`==`, `!=`, `>`), round/floor, a cast to an integer or bool (`.long()`), "
        "a count such as `(pred == y).float().mean()`." + hint + " Compute the loss from the model output "
        "with differentiable torch ops (for accuracy-like objectives, a surrogate: cross_entropy on the "
        "logits, or softmax probabilities instead of argmax)."
    )


def _frozen_or_detached(f: NoGraphFacts) -> str:
    # Both fit: the loss took a frozen part's output (a probe's backbone features instead of the head's),
    # or the trainable output's graph was cut on the way to the loss.
    it = "it" if len(f.connected) == 1 else "them"
    return (
        f"the loss does not depend on {names_text(f.connected)}, which still {_has(f.connected)} a graph. Either "
        f"it was computed from the output of a frozen part of the model ({len(f.frozen)} of "
        f"{len(f.frozen) + f.trainable} parameters have requires_grad=False: {names_text(f.frozen)}), e.g. the "
        f"backbone's features instead of the trainable head's output: compute the loss from {it}; or the graph "
        f"was cut between {it} and the loss: `.detach()`, `.item()`/`.tolist()` followed by torch.tensor(...), "
        "`.data`, or a torch.no_grad() block around the loss computation."
    )


#: Cause -> the words for it.
NO_GRAPH_CAUSES: dict[str, Callable[[NoGraphFacts], str]] = {
    "all_frozen": lambda f: (
        f"every parameter of the model ({f.model_type}) has requires_grad=False, so nothing in "
        "the loss depends on a trainable tensor. Unfreeze the layers you mean to train "
        "(`module.requires_grad_(True)`), e.g. after loading a checkpoint or a frozen backbone."
    ),
    "inference_mode": lambda f: (
        "the loss is an inference tensor: it was computed under torch.inference_mode(). Compute the "
        "training forward and loss outside that block."
    ),
    "no_grad_backward": lambda f: (
        "backward() was called with gradient tracking disabled (inside torch.no_grad() or "
        "torch.set_grad_enabled(False)). Move the forward, loss and backward out of that block."
    ),
    "closure_under_no_grad": lambda f: (
        f"the closure ran inside {f.optimizer_type}.step(), which runs under torch.no_grad() "
        "(@torch.no_grad() on a custom optimizer's step), so the forward in the closure built no graph. "
        "Wrap the closure's body in `with torch.enable_grad():` (torch's LBFGS does that around its "
        "closure call: `with torch.enable_grad(): loss = closure()`), in the closure or in step()."
    ),
    "forward_under_no_grad": lambda f: (
        "the model's forward ran under torch.no_grad() (or with grad disabled), so its output has no graph. "
        "Run the training forward with gradients enabled (a no_grad block or @torch.no_grad meant for "
        "evaluation is around it)."
    ),
    # Nothing in the user's code has a graph and part of the model is frozen: the loss path runs through
    # frozen layers only (a detach would leave the model's output with a graph).
    "frozen_path": lambda f: (
        f"the layers the loss goes through are frozen: {len(f.frozen)} of {len(f.frozen) + f.trainable} "
        f"parameters have requires_grad=False ({names_text(f.frozen)}), and nothing in the forward has "
        "a graph. Unfreeze the layers you mean to train (`module.requires_grad_(True)`); if they are "
        "meant to stay frozen, the loss must depend on a trainable parameter. (If the loss path is "
        "trainable after all, the graph was cut between the output and the loss: `.detach()`, "
        "`.item()`, `.data`.)"
    ),
    "frozen_or_detached": _frozen_or_detached,
    "detached": _detached,
}


def _stepping_optimizer(ctx: Context) -> torch.optim.Optimizer | None:
    """The optimizer whose ``step()`` is on the traceback (the error was raised in its closure), if it is one
    that may run the closure under no_grad: torch's own optimizers call it under torch.enable_grad(), and so
    does Lightning's training loop."""
    if ctx.tracer is not None and ctx.tracer.integration == "lightning":
        return None
    for frame in ctx.frames:
        code = frame.f_code
        if code.co_name == "step" and code.co_argcount > 0:
            owner = frame.f_locals.get(code.co_varnames[0])  # self, whatever it is called
            if isinstance(owner, torch.optim.Optimizer) and not type(owner).__module__.startswith("torch."):
                return owner
    return None


def _graph_locals(ctx: Context, exclude: Any) -> list[str]:
    names: list[str] = []
    for frame in reversed(ctx.user_frames()):
        for k, v in frame.f_locals.items():
            if isinstance(v, torch.Tensor) and v is not exclude and v.grad_fn is not None and k not in names:
                names.append(f"`{k}`")
        if names:
            break
    return names


def no_graph_facts(ctx: Context) -> NoGraphFacts:
    roots = ctx.roots()
    model = ctx.model
    loss = roots[0] if roots else None
    named = list(model.named_parameters()) if model is not None else []
    forward_grad = ctx.tracer.last_forward_grad_enabled if ctx.tracer is not None else None
    opt = _stepping_optimizer(ctx) if forward_grad is False else None
    return NoGraphFacts(
        step=ctx.step,
        model_type=type(model).__name__ if model is not None else None,
        loss_shape=list(loss.shape) if loss is not None else None,
        inference=loss is not None and loss.is_inference(),
        grad_enabled=torch.is_grad_enabled(),
        forward_grad=forward_grad,
        optimizer_type=type(opt).__name__ if opt is not None else None,
        trainable=sum(1 for _n, p in named if p.requires_grad),
        frozen=[ctx.index.param_name.get(id(p), n) for n, p in named if not p.requires_grad],
        connected=_graph_locals(ctx, exclude=loss),
    )


def no_graph_words(f: NoGraphFacts, cause: str) -> Explanation:
    return Explanation(
        what=(
            f"backward() failed at step {f.step}: the loss has no autograd graph (requires_grad=False, no "
            "grad_fn), so there is nothing to differentiate."
        ),
        cause=NO_GRAPH_CAUSES[cause](f),
        why="no gradient can reach the parameters; nothing would be learned.",
        fix=NO_GRAPH_NOT_A_FIX,
    )


#: What every no_grad_graph finding says: the usual answer to this error turns it into a run that never trains.
NO_GRAPH_NOT_A_FIX = (
    "give the loss its graph back as the cause says. Do not make the loss require gradients by hand "
    "(`loss.requires_grad_()`, `torch.tensor(loss.item(), requires_grad=True)`, `Variable(loss, "
    "requires_grad=True)`): that only silences this error; backward() then reaches no parameter and nothing trains."
)


def explain_no_graph(ctx: Context) -> Finding:
    f = no_graph_facts(ctx)
    cause = no_graph_cause(f)
    # Rendered with its cause first, and as a message: the escalation window rewrites the cause line of it.
    return Finding(
        kind="no_grad_graph",
        step=ctx.step,
        severity="error",
        explanation=no_graph_words(f, cause),
        data={"cause": cause, "loss_shape": f.loss_shape, "trainable_params": f.trainable},
    )
