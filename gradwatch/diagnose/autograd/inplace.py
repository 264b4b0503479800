"""``inplace_error`` at backward: a tensor autograd saved was changed in place before backward() read it.

:func:`explain_inplace_backward` parses PyTorch's message (:class:`InplaceError`), finds the node whose saved
tensor raises the same error (the consumer) and the node PyTorch names (the producer), then asks the causes of
:data:`INPLACE_CAUSES` in order; the first that recognises its facts speaks:

- a parameter of the model changed (usually by ``optimizer.step()`` between forward and backward, or in the
  forward itself, :data:`PARAM_WRITE_FIXES`);
- a leaf outside the model changed (an EMA teacher's weight);
- a local tensor of the training code or a buffer of the model written in place (:data:`SAVED_TENSOR_CAUSES`);
- the output of a traced op, a traced view of a written tensor, an in-place op that wrote a saved input
  (:mod:`gradwatch.diagnose.autograd.inplace_traced`);

and when none does, the nearest module and parameters are named, approximately.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from gradwatch.core.findings import Explanation, Finding, names_text
from gradwatch.core.open_watchers import open_watchers
from gradwatch.diagnose.autograd.context import (
    Context,
    children,
    saved_error,
    user_frames_innermost,
    walk,
    with_line,
)
from gradwatch.diagnose.autograd.inplace_common import (
    WHY_INPLACE,
    InplaceError,
    foreign_modules,
    inplace_finding,
    parse_inplace_error,
    saver_op,
    traced_writes,
)
from gradwatch.diagnose.autograd.inplace_source import SourceWrite, local_writer
from gradwatch.diagnose.autograd.inplace_traced import TRACED_CAUSES, explain_untraced
from gradwatch.observe.tracing import InplaceRecord, node_op


@dataclass(frozen=True)
class SavedGraph:
    """Where the error sits in the autograd graph."""

    consumer: Any = None  # the node whose saved tensor raises the error
    producer: Any = None  # the node PyTorch names (the consumer or one of its inputs)
    #: (name, module, shape) of the model parameter the consumer saved that changed, if any.
    param: tuple[str, str, tuple[int, ...]] | None = None


def find_consumer(roots: list[torch.Tensor], err: InplaceError) -> Any:
    """The node, walking from the loss, whose saved tensor raises this very error."""
    for node, _ in walk(roots):
        text = saved_error(node)
        if (
            text
            and "modified by an inplace operation" in text
            and err.shape_text in text
            and f"is at version {err.now};" in text
        ):
            return node
    return None


def find_producer(consumer: Any, op: str | None) -> Any:
    """The node PyTorch names: the consumer itself or one of its inputs, with op ``op``."""
    if consumer is None or op is None:
        return None
    return next((cand for cand in [consumer, *children(consumer)] if node_op(cand) == op), None)


def changed_leaves(consumer: Any, shape: tuple[int, ...], now: int) -> Iterator[tuple[Any, torch.Tensor]]:
    """``(AccumulateGrad node, leaf)`` within three steps of ``consumer`` whose leaf is at version ``now``
    with the saved tensor's shape (or its transpose): the tensor changed in place."""
    frontier = [consumer]
    for _ in range(3):
        nxt = []
        for n in frontier:
            for child in children(n):
                var = getattr(child, "variable", None)
                if var is None:
                    nxt.append(child)
                elif var._version == now and tuple(var.shape) in (shape, tuple(reversed(shape))):
                    yield child, var
        frontier = nxt


def modified_param(ctx: Context, consumer: Any, err: InplaceError) -> tuple[str, str, tuple[int, ...]] | None:
    for node, var in changed_leaves(consumer, err.shape, err.now):
        found = ctx.param_of(node)
        if found is not None:
            return found[0], found[1], tuple(var.shape)
    return None


def saved_graph(ctx: Context, err: InplaceError) -> SavedGraph:
    roots = ctx.roots()
    consumer = find_consumer(roots, err) if roots else None
    if consumer is None:
        return SavedGraph()
    return SavedGraph(consumer, find_producer(consumer, err.op), modified_param(ctx, consumer, err))


def watched_elsewhere(ctx: Context, consumer: Any, err: InplaceError) -> bool:
    """The changed tensor is a parameter of another open watcher's model (as ``modified_param`` finds it)."""
    # Open watchers, and closed ones that explained this very exception (an inner `with` block exits first).
    others = [
        w.engine.index.param_name
        for w in open_watchers()
        if w.engine is not ctx.engine
        and (not w.closed or w.engine.has_explained(ctx.exc))
    ]
    return bool(others) and any(
        any(id(var) in names for names in others) for _node, var in changed_leaves(consumer, err.shape, err.now)
    )


# -- a parameter of the model ------------------------------------------------------------------------
#: What wrote a parameter autograd had saved -> the fix.
PARAM_WRITE_FIXES: dict[str, Callable[[str], str]] = {
    # Not traced in the forward: between the forward and backward.
    "optimizer_step": lambda pname: (
        "the usual cause is optimizer.step() (an in-place update) between a forward and the "
        "backward of a loss built from it, e.g. stepping the discriminator before the generator's "
        "loss.backward() in a GAN, or two losses sharing the model with a step in between. Call "
        "backward() for every loss built from a forward before stepping, or redo the forward after "
        "step(). An RNN hidden state carried into the next step without .detach() (then "
        "backward(retain_graph=True) to get past 'backward through the graph a second time') does it too: "
        "detach the state each step (`h = h.detach()`) and drop retain_graph. Other in-place updates of "
        "weights (`w.data.mul_()`, `with torch.no_grad(): w += ...`, weight clipping) between forward "
        "and backward do the same."
    ),
    # F.embedding writes its weight only with max_norm (renorm).
    "embedding_max_norm": lambda pname: (
        "nn.Embedding(max_norm=...) renormalizes its weight in place when it is called; every "
        f"other use of {pname} in the same forward (a tied output layer, weight @ x) must come after "
        f"that call or use a copy ({pname.rsplit('.', 1)[-1]}.clone()), or drop max_norm and "
        "normalize the looked-up vectors instead."
    ),
    "forward_write": lambda pname: (
        "do not write a parameter in place during the forward (use an out-of-place op on a "
        "copy), or make every use of it that autograd saves come after the write."
    ),
}


def param_writer_cause(writer: InplaceRecord | None) -> str:
    if writer is None:
        return "optimizer_step"
    return "embedding_max_norm" if "embedding" in writer.op else "forward_write"


def _param_cause(ctx: Context, err: InplaceError, graph: SavedGraph, data: dict[str, Any]) -> Finding | None:
    """A parameter autograd saved was changed in place before this backward: by the forward itself
    (traced: ``nn.Embedding(max_norm=...)``), or else, usually, by ``optimizer.step()``."""
    if graph.param is None or not err.of_a_leaf_or_view:
        return None
    pname, pmodule, pshape = graph.param
    data.update(param=pname, module_exact=True)
    tensor = next((p for n, p in ctx.index.model_params if n == pname), None)
    writes = traced_writes(ctx, tensor) if tensor is not None else []
    writer = writes[0] if writes else None
    if writer is None:
        when = f"after the forward pass that used it and before this backward ({err.versions})"
        where = f"Where: module {ctx.display_module(pmodule)}; the op that saved it is {data['consumer']}."
    else:
        source = with_line(writer.source)
        when = f"during this step's forward, after an op had saved it ({err.versions})"
        where = (
            f"Modified by: {writer.op} in module {ctx.display_module(writer.module) or '<outside the model>'}"
            + (f" at {source}" if source else "")
            + f"; the op that saved it earlier is {data.get('consumer')}."
        )
        data.update(modified_by=writer.op, modified_in=ctx.display_module(writer.module), modified_at=source)
    lines = [
        f"backward() failed at step {ctx.step}: parameter {pname} (shape {list(pshape)}) was changed in place {when}.",
        where,
    ]
    fix = PARAM_WRITE_FIXES[param_writer_cause(writer)](pname)
    return inplace_finding(
        ctx, lines, ctx.display_module(pmodule), saver_op(data, err.op), data, fix=fix, params=(pname,)
    )


# -- a leaf outside the model ------------------------------------------------------------------------
def modified_foreign_leaf(
    ctx: Context, consumer: Any, err: InplaceError
) -> tuple[str | None, str | None, torch.Tensor] | None:
    """A leaf that requires grad, not the watched model's, that the consumer saved and that was changed in place
    (an EMA teacher's weight updated before backward): its name among the user's modules, if found."""
    for node, var in changed_leaves(consumer, err.shape, err.now):
        if ctx.param_of(node) is not None:
            continue
        for label, mod in foreign_modules(ctx):
            name = next((n for n, p in mod.named_parameters() if p is var), None)
            if name is not None:
                return f"{label}.{name}", label, var
        return None, None, var
    return None


def _foreign_leaf_cause(ctx: Context, err: InplaceError, graph: SavedGraph, data: dict[str, Any]) -> Finding | None:
    """A tensor outside the watched model that requires grad (a parameter of a teacher or target network the
    loss uses) was updated in place between the forward that used it and backward: by an EMA update, a
    copy of weights, or another optimizer's step. Not the loss code's indexed assignment."""
    if graph.consumer is None or not err.of_a_leaf_or_view:
        return None
    found = modified_foreign_leaf(ctx, graph.consumer, err)
    if found is None:
        return None
    name, owner, var = found
    what = f"parameter {name} (shape {list(var.shape)}), which the watched model does not own," if name else (
        f"a tensor (shape {list(var.shape)}) that requires grad and is not a parameter of the watched model"
    )
    via = f", through a view of shape {list(err.shape)}" if tuple(var.shape) != err.shape else ""
    data.update(param=name, module_exact=False, outside_model=True)
    words = Explanation(
        what=(
            f"backward() failed at step {ctx.step}: {what} was changed in place after the forward pass used it "
            f"and before this backward ({err.versions}); autograd saved it for {data['consumer']}{via}."
        ),
        cause=(
            "typically an EMA / mean-teacher or target-network update (`with torch.no_grad(): "
            "t.mul_(0.99).add_(s, alpha=0.01)`), a weight copy or clipping, or another optimizer's step(), run "
            "between that forward and backward()."
        ),
        why=WHY_INPLACE,
        fix=(
            "do that update after backward() (after optimizer.step()); or, if no gradient must flow into "
            + (f"{owner}" if owner else "it")
            + " (an EMA teacher, a target network), run its forward under torch.no_grad() or freeze it ("
            + (f"{owner}.requires_grad_(False)" if owner else "requires_grad_(False)")
            + " after deepcopy), so autograd saves nothing of it."
        ),
    )
    return Finding(
        kind="inplace_error",
        step=ctx.step,
        severity="error",
        explanation=words,
        op=saver_op(data, err.op),
        data=data,
    )


# -- a saved tensor without a grad_fn: a local of the training code, a buffer ------------------------
def modified_local(ctx: Context, err: InplaceError) -> SourceWrite | None:
    """A local tensor of the user's code (a loss's target), not the model's, at the version PyTorch reports
    and written in place in the source (``label.fill_(0)``): decided by the version counter and the write,
    not by a shape that a buffer may share (a BatchNorm's running_mean when the batch size equals its
    channel count)."""
    numel = _numel(err.shape)
    model = ctx.model
    owned = {id(t) for t in (*model.parameters(), *model.buffers())} if model is not None else set()

    def is_it(t: torch.Tensor) -> bool:
        base = t._base if t._base is not None else t
        return t._version == err.now and t.numel() == numel and id(base) not in owned and not t.requires_grad

    return local_writer(user_frames_innermost(ctx), is_it)


def _numel(shape: tuple[int, ...]) -> int:
    numel = 1
    for d in shape:
        numel *= d
    return numel


def local_finding(ctx: Context, write: SourceWrite, err: InplaceError, data: dict[str, Any]) -> Finding:
    saver = data.get("consumer") or "a backward node"
    lines = [
        (
            f"backward() failed at step {ctx.step}: tensor {write.name} (shape {list(err.shape)}) was modified in "
            f"place after {saver} saved it ({err.versions}); autograd needs the value it saved (for a "
            "loss, its target) to compute the gradient."
        ),
        f"Modified by: {write.spelled} at {write.source}.",
    ]
    data.update(tensor=write.name, module_exact=False, outside_model=True, modified_by=write.op,
                modified_at=write.source)
    fix = (
        f"give the later use its own tensor instead of writing into {write.name}: "
        + (
            f"{write.name} = torch.full_like({write.name}, value) instead of {write.spelled}"
            if write.op == "fill_"
            else f"{write.name} = {write.name}.clone() before {write.spelled}, or its out-of-place form"
        )
        + f" (or call backward() on the first loss before {write.name} changes)."
    )
    return inplace_finding(ctx, lines, None, saver_op(data), data, fix=fix)


def modified_buffer(ctx: Context, err: InplaceError) -> tuple[str, torch.Tensor, list[str]] | None:
    """A buffer of the model (a queue, a memory bank, running statistics) that autograd saved (itself or
    a view: views share its version counter) and that was then written in place; with the names of the
    other buffers that match as well (same size and version: which one cannot be told)."""
    model = ctx.model
    if model is None:
        return None
    numel = _numel(err.shape)
    found = [
        (f"{owner}.{name}" if owner else name, buf)
        for mname, m in model.named_modules()
        for owner in (ctx.user_name(mname, m),)
        for name, buf in m.named_buffers(recurse=False)
        if buf._version == err.now and buf.numel() == numel and buf.is_floating_point()
    ]
    if not found:
        return None
    return found[0][0], found[0][1], [n for n, _b in found[1:]]


def buffer_finding(
    ctx: Context, buffer: tuple[str, torch.Tensor, list[str]], err: InplaceError, data: dict[str, Any]
) -> Finding:
    name, buf, alike = buffer
    owner, _, attr = name.rpartition(".")
    module = ctx.display_module(owner) if owner else ctx.display_module("")
    mods = traced_writes(ctx, buf)
    which = f"buffer {name}" if not alike else f"buffer {name} (or {names_text(alike)}: same size and version)"
    lines = [
        (
            f"backward() failed at step {ctx.step}: {which} (shape {list(buf.shape)}) of module {module} "
            f"was modified in place after the forward pass used it ({err.versions}); autograd "
            f"saved it (shape {list(err.shape)}) for {data.get('consumer') or 'a backward node'} to compute a gradient."
        )
    ]
    graph = (
        f" Write values without their graph into it, too: self.{attr}[idx] = feats.detach() (a buffer that "
        "carries a graph makes the next step's backward go through this one)."
        if buf.grad_fn is not None
        else ""
    )
    source = with_line(mods[0].source) if mods else None
    if mods:
        lines.append(
            f"Modified by: {mods[0].op} in module {ctx.display_module(mods[0].module) or '<outside the model>'}"
            + (f" at {source}" if source else "") + "."
        )
    data.update(buffer=name, buffers_alike=alike, module_exact=True, modified_by=mods[0].op if mods else None,
                modified_at=source)
    fix = (
        f"update self.{attr} after backward() (e.g. in a method called after optimizer.step()), or let "
        f"the forward use a copy: self.{attr}.clone() (a queue or memory bank, as in MoCo, is enqueued "
        "after the loss was computed from a copy)." + graph
    )
    return inplace_finding(ctx, lines, module, saver_op(data, mods[0].op if mods else None), data, fix=fix)


#: Causes of a saved tensor with no grad_fn (or a view of one) changed in place: ``(facts, finding)``, the
#: first whose facts are found speaks.
SAVED_TENSOR_CAUSES: tuple[tuple[Callable[..., Any], Callable[..., Finding]], ...] = (
    (modified_local, local_finding),
    (modified_buffer, buffer_finding),
)


def _saved_tensor_cause(ctx: Context, err: InplaceError, graph: SavedGraph, data: dict[str, Any]) -> Finding | None:
    if not err.of_a_leaf_or_view:
        return None
    for facts, finding in SAVED_TENSOR_CAUSES:
        found = facts(ctx, err)
        if found is not None:
            return finding(ctx, found, err, data)
    return None


#: The causes, asked in order: the first that recognises its facts returns the finding.
INPLACE_CAUSES: tuple[Callable[[Context, InplaceError, SavedGraph, dict[str, Any]], Finding | None], ...] = (
    _param_cause,
    _foreign_leaf_cause,
    _saved_tensor_cause,
    *TRACED_CAUSES,
)


def explain_inplace_backward(ctx: Context, m: re.Match[str]) -> Finding | None:
    """The ``inplace_error`` finding for PyTorch's "modified by an inplace operation" error (None when another
    watcher's model owns the changed parameter: that watcher explains it)."""
    err = parse_inplace_error(m)
    graph = saved_graph(ctx, err)
    data: dict[str, Any] = {
        "shape": list(err.shape),
        "version": err.now,
        "expected_version": err.expected,
        "tensor_type": err.tensor_type,
        "node": None if graph.producer is None else graph.producer.name(),
        "consumer": None if graph.consumer is None else graph.consumer.name(),
    }
    if graph.param is None and graph.consumer is not None and watched_elsewhere(ctx, graph.consumer, err):
        return None  # another watcher's model owns the parameter (a GAN watched per network): it explains
    for cause in INPLACE_CAUSES:
        finding = cause(ctx, err, graph, data)
        if finding is not None:
            return finding
    return explain_untraced(ctx, err, graph.producer, graph.consumer, data)
