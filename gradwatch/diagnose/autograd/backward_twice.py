"""``backward_twice``: backward() reached a part of a graph an earlier backward() already freed.

:func:`twice_facts` finds the edges from this step's graph into nodes built before it (autograd numbers its
nodes in creation order; the forward tracer keeps the number at each step's start) and what carries them:
the loss's own arithmetic (a running total), the model's forward (a carried state), an attribute of a
module, another optimizer's step in between (a GAN). :func:`twice_cause` names the cause, and
:data:`TWICE_CAUSES` words it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from gradwatch.core.findings import Explanation, Finding, names_text
from gradwatch.diagnose.autograd.context import Context, children, local_name, upstream_param, walk
from gradwatch.observe.tracing import library_frame, node_op

#: Arithmetic a loss is combined with (sums of losses, scaling by 1/k).
LOSS_ARITHMETIC = frozenset({"Add", "Sub", "Rsub", "Mul", "Div", "Neg"})
#: Edges into an earlier graph collected at most.
MAX_OLD_EDGES = 16


@dataclass(frozen=True)
class TwiceFacts:
    """Where this backward met a freed graph, and what kept that graph around."""

    step: int
    cause: str  # a key of TWICE_CAUSES
    earlier_step_nodes: int = 0  # edges from this step's graph into older nodes
    enters_at: str | None = None  # the node of this step's graph that uses the older graph
    module: str | None = None  # the module the older graph comes from (or that holds the state)
    older_module: str | None = None  # the module the older graph comes from
    states: list[str] = field(default_factory=list)  # module attributes that carry a graph across steps
    total: str | None = None  # the user's local holding the running total


@dataclass(frozen=True)
class TwiceWords:
    """How a cause is worded: its ``data["cause"]``, the cause sentence and the fix."""

    data_cause: str
    cause: Callable[[TwiceFacts], str]
    fix: Callable[[TwiceFacts], str]
    #: Say where the older graph enters, and that retain_graph=True is no fix.
    across_steps: bool = False


def seq(node: Any) -> int | None:
    """The creation number of an autograd node (None for AccumulateGrad and nodes without one)."""
    fn = getattr(node, "_sequence_nr", None)
    if fn is None or hasattr(node, "variable"):
        return None
    try:
        return int(fn())
    except Exception:  # noqa: BLE001
        return None


def old_edges(roots: list[torch.Tensor], step_seq: int) -> list[tuple[Any, Any, int]]:
    """(newer consumer, older node, depth of consumer): edges from nodes built in this step into older ones."""
    found: list[tuple[Any, Any, int]] = []
    for node, depth in walk(roots):
        own = seq(node)
        if own is None or own < step_seq:
            continue
        for child in children(node):
            s = seq(child)
            if s is not None and s < step_seq:
                found.append((node, child, depth))
        if len(found) >= MAX_OLD_EDGES:
            break
    return found


def loss_spine(roots: list[torch.Tensor], limit: int = 1000) -> list[Any]:
    """The nodes of the arithmetic the loss ends with (``((acc + l1 / k) + l2 / k) + ...``), from the roots
    down to the first op that is not +, -, * or / (a loss function, the model's output)."""
    out: list[Any] = []
    stack = [r.grad_fn for r in roots if r.grad_fn is not None]
    while stack and len(out) < limit:
        node = stack.pop()
        if node_op(node) not in LOSS_ARITHMETIC or any(node is n for n in out):
            continue
        out.append(node)
        stack.extend(children(node))
    return out


def graph_state_attrs(ctx: Context, limit: int = 8) -> list[str]:
    """Plain tensor attributes of the model's modules (not parameters or buffers) that carry a graph
    (``self.mem`` of a spiking neuron kept across iterations)."""
    model = ctx.model
    if model is None:
        return []
    out: list[str] = []
    for raw, m in model.named_modules():
        name = ctx.user_name(raw, m)  # the path as the user wrote it (no DDP `module.`)
        for attr, v in vars(m).items():
            if attr.startswith("_") or not isinstance(v, torch.Tensor) or v.grad_fn is None:
                continue
            out.append(f"{name}.{attr}" if name else attr)
            if len(out) >= limit:
                return out
    return out


def lightning_backward(ctx: Context) -> bool:
    """The failing backward() is Lightning's own (automatic optimization), not one in the user's code.

    In manual optimization every backward is the user's (``self.manual_backward``, whose frames are
    Lightning's): Lightning runs none of its own."""
    if ctx.tracer is None or ctx.tracer.integration != "lightning":
        return False
    if not getattr(ctx.engine.model, "automatic_optimization", True):
        return False
    for frame in reversed(ctx.frames):  # innermost first: the frame that called backward()
        if library_frame(frame):
            continue
        return str(frame.f_globals.get("__name__", "")).startswith(("lightning.", "pytorch_lightning."))
    return False


def _module_of(ctx: Context, node: Any) -> str | None:
    found = upstream_param(ctx, node)
    return ctx.display_module(found[1]) if found else None


def _in_this_iteration(ctx: Context, edges: list[tuple[Any, Any, int]]) -> bool:
    """Every older node was built after the check before the last one: in this iteration, before another
    optimizer's step (only told apart with several optimizers)."""
    prev = ctx.tracer.prev_step_seq if ctx.tracer is not None else None
    several = len(getattr(ctx.engine, "optimizers", ()) or ()) > 1
    return several and all((seq(o) or -1) >= (prev or 0) for _c, o, _d in edges)


def _across_steps(ctx: Context, roots: list[torch.Tensor], edges: list[tuple[Any, Any, int]]) -> TwiceFacts:
    consumer, old, depth = edges[0]
    module = _module_of(ctx, old)
    # The old graph enters through the loss's own arithmetic (`acc = acc + loss / k`, k adds deep when
    # one backward runs every k batches), not through an op of the forward: a running total.
    if depth <= 1 or any(consumer is n for n in loss_spine(roots)):
        return TwiceFacts(ctx.step, "running_total", len(edges), consumer.name(), module, module,
                          total=local_name(ctx, roots[0]))
    states = graph_state_attrs(ctx)
    if states:
        owner = ctx.display_module(states[0].rpartition(".")[0])
        return TwiceFacts(ctx.step, "state_attribute", len(edges), consumer.name(), owner, module, states)
    return TwiceFacts(ctx.step, "carried_state", len(edges), consumer.name(), module, module)


def twice_facts(ctx: Context) -> TwiceFacts:
    roots = ctx.roots()
    step_seq = ctx.tracer.step_seq if ctx.tracer is not None else None
    edges = old_edges(roots, step_seq) if roots and step_seq is not None else []
    if edges and _in_this_iteration(ctx, edges):
        consumer, old, _depth = edges[0]
        module = _module_of(ctx, old)
        return TwiceFacts(ctx.step, "freed_by_other_optimizer", len(edges), consumer.name(), module, module)
    if edges:
        return _across_steps(ctx, roots, edges)
    cause = "backward_in_training_step" if lightning_backward(ctx) else "same_step"
    return TwiceFacts(ctx.step, cause, len(edges))


def _gan_cause(f: TwiceFacts) -> str:
    through = f" (from module {f.module})" if f.module else ""
    return (
        f"this backward() reached a part of the graph{through} that an earlier backward() of this "
        "same iteration, before another optimizer's step(), already went through and freed. With several "
        "optimizers this is typically a GAN whose discriminator loss uses the generator's output without "
        ".detach(): lossD.backward() backpropagates into the generator and frees its graph, then the "
        f"generator's loss needs that graph again (it enters at {f.enters_at})."
    )


def _running_total_fix(f: TwiceFacts) -> str:
    total = f.total or "acc_loss"
    return (
        f"start the total afresh after each backward() (`{total} = 0` right after "
        f"`{total}.backward()`, when micro-batch losses are summed for one backward per window); if "
        "the total is only for logging, call backward() on this step's loss and accumulate it without "
        "its graph: `total += loss.item()` (or `loss.detach()`)."
    )


def _state_attribute_fix(f: TwiceFacts) -> str:
    attr = f.states[0].rpartition(".")[2]
    return (
        f"reset that state at the start of every iteration (or batch), or cut its graph: "
        f"`self.{attr} = self.{attr}.detach()` after the step (for snnTorch neurons: "
        "snntorch.utils.reset(net), or mem = lif.init_leaky() at the start of forward)."
    )


#: Cause -> its words.
TWICE_CAUSES: dict[str, TwiceWords] = {
    "freed_by_other_optimizer": TwiceWords(
        "freed_by_other_optimizer",
        _gan_cause,
        lambda f: (
            "build the discriminator's loss on the detached sample, `D(fake.detach())`, and keep `D(fake)` "
            "for the generator's loss: lossD.backward() then stops at the sample and no longer writes gradients "
            "into the generator either. If both losses must go through that part, call the first backward() "
            "with retain_graph=True."
        ),
    ),
    "running_total": TwiceWords(
        "running_total",
        lambda f: (
            "the loss itself is built from a tensor kept from an earlier step — typically a running total "
            "(`total_loss = total_loss + loss`, then `total_loss.backward()`, or logging `total += loss` "
            "without .item())"
        ),
        _running_total_fix,
        across_steps=True,
    ),
    "carried_state": TwiceWords(
        "carried_state",
        lambda f: (
            "a tensor produced at an earlier step is fed into this step's forward with its graph attached — "
            "typically an RNN hidden state (or a cached/memory tensor) carried across steps without .detach(), "
            "or a tensor computed once from parameters before the loop (`w = F.normalize(self.protos)` "
            "outside the loop)"
        ),
        lambda f: (
            "cut the graph between steps: `hidden = hidden.detach()` (for an LSTM "
            "`h, c = h.detach(), c.detach()`) before feeding it to the next step (truncated "
            "backpropagation through time). A tensor derived from parameters that must keep training "
            "(computed once before the loop) must not be detached: recompute it inside the loop, every step."
        ),
        across_steps=True,
    ),
    "state_attribute": TwiceWords(
        "carried_state",
        lambda f: (
            f"modules keep a tensor from an earlier step with its graph attached as an attribute: "
            f"{names_text(f.states)} (a recurrent or spiking neuron's state carried across iterations)"
        ),
        _state_attribute_fix,
        across_steps=True,
    ),
    "same_step": TwiceWords(
        "same_step",
        lambda f: (
            "backward() ran twice through the same graph within this step — e.g. calling loss.backward() "
            "twice, or backward on two losses that share part of the model (both go through the shared layers)."
        ),
        lambda f: (
            "add the losses and call backward() once (`(loss_a + loss_b).backward()`), or pass "
            "retain_graph=True to every backward() but the last one that goes through the shared part. Also "
            "check for tensors kept across steps without .detach() (RNN hidden state, running totals)."
        ),
    ),
    "backward_in_training_step": TwiceWords(
        "backward_in_training_step",
        lambda f: (
            "Lightning's automatic optimization ran backward() on the loss training_step returned, "
            "after training_step had already called loss.backward() on it."
        ),
        lambda f: (
            "remove loss.backward() from training_step: Lightning backpropagates the loss it returns "
            "(retain_graph=True would silence the error and double every gradient). To run backward "
            "yourself, set self.automatic_optimization = False and call self.manual_backward(loss) and "
            "the optimizer's step in training_step."
        ),
    ),
}

_RETAIN_GRAPH_NOTE = (
    " retain_graph=True on the earlier backward() would silence the error, but it keeps every earlier "
    "step's graph in memory and backpropagates through all of them again: almost never what you want."
)


def twice_words(f: TwiceFacts) -> Explanation:
    words = TWICE_CAUSES[f.cause]
    cause, fix = words.cause(f), words.fix(f)
    if words.across_steps:
        source = f"; the earlier graph comes from module {f.older_module}" if f.older_module else ""
        cause = f"{cause}. It enters this step's graph at {f.enters_at}{source}."
        fix += _RETAIN_GRAPH_NOTE
    return Explanation(
        what=(
            f"backward() failed at step {f.step}: it reached part of an autograd graph whose saved tensors were "
            "already freed by an earlier backward()."
        ),
        why=(
            "backward() frees the intermediate values of the graph it went through (unless "
            "retain_graph=True), so a second backward through the same ops cannot compute their gradients."
        ),
        cause=cause,
        fix=fix,
    )


def twice_data(f: TwiceFacts) -> dict[str, Any]:
    data: dict[str, Any] = {"earlier_step_nodes": f.earlier_step_nodes, "cause": TWICE_CAUSES[f.cause].data_cause}
    if f.enters_at is not None:
        data["enters_at"] = f.enters_at
    if f.states:
        data["state_attributes"] = f.states
    if f.cause == "running_total":
        data["total"] = f.total
    return data


def explain_backward_twice(ctx: Context) -> Finding:
    f = twice_facts(ctx)
    return Finding(
        kind="backward_twice",
        step=ctx.step,
        severity="error",
        explanation=twice_words(f),
        module=f.module,
        data=twice_data(f),
    )
