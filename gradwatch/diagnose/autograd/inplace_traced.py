"""``inplace_error`` at backward on the output of an op: traced, a traced view, an in-place writer, or untraced.

:class:`gradwatch.observe.tracing.ForwardTracer` records on the first watched step and while escalated: the
exact module and source line of the op, and the in-place op that changed its output. The causes here come
after those of :mod:`gradwatch.diagnose.autograd.inplace` (parameters, buffers, locals), in the order of
:data:`TRACED_CAUSES`; :func:`explain_untraced` speaks when none of them does, with the nearest module.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from gradwatch.core.findings import Finding, names_text
from gradwatch.diagnose.autograd.context import (
    OP_MODULES,
    Context,
    children,
    modules_of_type,
    own_param,
    saved_error,
    upstream_param,
    user_frames_innermost,
    with_line,
)
from gradwatch.diagnose.autograd.inplace_common import (
    VIEW_OPS,
    InplaceError,
    foreign_modules,
    inplace_finding,
    modified_by_line,
    saver_op,
)
from gradwatch.diagnose.autograd.inplace_source import SourceWrite, local_writer
from gradwatch.observe.tracing import InplaceRecord, OpRecord, func_name, node_op


# -- the output of a traced op -----------------------------------------------------------------------
def traced_record(ctx: Context, err: InplaceError, producer: Any) -> OpRecord | None:
    """The tracer's record of the op PyTorch names: by its node, or the one traced op of that kind, shape
    and version."""
    tracer = ctx.tracer
    if tracer is None:
        return None
    record = tracer.record_for(producer) if producer is not None else None
    if record is None and err.op is not None and tracer.traced_step:
        matches = tracer.find(err.op, err.shape, err.now)
        if len(matches) == 1:
            record = matches[0]
    return record


def written_after_forward(ctx: Context, tensor: torch.Tensor) -> SourceWrite | None:
    """The user's local bound to ``tensor`` (or a view of it) and its in-place write in the source."""
    return local_writer(user_frames_innermost(ctx), lambda t: t is tensor or t._base is tensor)


def _traced_op_cause(ctx: Context, err: InplaceError, graph: Any, data: dict[str, Any]) -> Finding | None:
    record = traced_record(ctx, err, graph.producer)
    if record is None:
        return None
    tracer = ctx.tracer
    assert tracer is not None
    op = err.op or record.op
    earlier = tracer.before_inplace(record)
    if earlier is not None:
        # PyTorch names the in-place op's own node (the tensor's grad_fn now); autograd saved the value
        # that op overwrote, i.e. the output of the op before it.
        record = earlier[0]
        op = node_op(record.node) if record.node is not None else record.op
        data["error_names"] = data.get("node")
    mods: list[InplaceRecord] = tracer.modifications_of(record)
    if earlier is not None and not mods:
        mods = [earlier[1]]
    return _traced_finding(ctx, record, mods, op, err, data)


def _traced_finding(
    ctx: Context, record: OpRecord, mods: list[InplaceRecord], op: str, err: InplaceError, data: dict[str, Any]
) -> Finding:
    module = ctx.display_module(record.module)
    source = with_line(record.source)
    lines = [
        (
            f"backward() failed at step {ctx.step}: the output of {op} (shape {list(err.shape)}) was modified by an "
            f"in-place operation after autograd saved it ({err.versions})."
        ),
        f"Where: {op} ran in module {module or '<outside the model>'}" + (f" at {source}" if source else "") + ".",
    ]
    culprit = mods[0] if mods else None
    if culprit is not None:
        lines.append(modified_by_line(ctx, mods))
    data.update(
        module_exact=True,
        source=source,
        modified_by=None if culprit is None else culprit.op,
        modified_in=None if culprit is None else ctx.display_module(culprit.module),
        modified_at=None if culprit is None else with_line(culprit.source),
    )
    tensor = record.tensor()
    written = written_after_forward(ctx, tensor) if culprit is None and tensor is not None else None
    if written is None:
        return inplace_finding(ctx, lines, module, op, data)
    # Not traced: the write ran in the training code after the forward (`probs.clamp_(min=1e-6)`).
    lines.append(f"Modified by: {written.spelled} at {written.source} (in the training code, after the forward).")
    data.update(modified_by=written.op, modified_at=written.source)
    name = written.name
    out_of_place = f"{name} = {name}.{written.op[:-1]}(...)" if written.op.endswith("_") else f"{name} = {name}.clone()"
    fix = (
        f"write it out of place, {out_of_place} instead of {written.spelled}: a new tensor, and the "
        f"output of {op} that autograd saved stays as it was."
    )
    return inplace_finding(ctx, lines, module, op, data, fix=fix)


# -- a traced view of a tensor written in place ------------------------------------------------------
#: The in-place write into the view's base -> its fix (else the usual culprits).
VIEW_WRITE_FIXES: dict[str, str] = {
    func_name(torch.Tensor.__setitem__): (
        "do not fill a preallocated tensor that later steps read from (an RNN's `hs[:, t + 1] = "
        "f(hs[:, t])`): collect the results in a list and stack them (`outs.append(h)`, then "
        "`torch.stack(outs, dim=1)`), or read a copy (`hs[:, t].clone()`)."
    ),
}


def traced_view(ctx: Context, consumer: Any, err: InplaceError) -> tuple[OpRecord, list[InplaceRecord]] | None:
    """The traced view ``consumer`` saved (``hs[:, t]``: PyTorch names it AsStrided once its base was written)
    and the traced in-place writes into its base after it was taken (``hs[:, t + 1] = ...``)."""
    tracer = ctx.tracer
    assert tracer is not None
    for child in children(consumer):
        rec = tracer.record_for(child)
        t = rec.tensor() if rec is not None else None
        if rec is None or t is None or rec.shape != err.shape or t._base is None or t._version != err.now:
            continue
        base = t._base
        writes = [
            e for e in tracer.inplace
            if e.version_before >= err.expected
            and (e.tensor() is base or e.tensor() is t or (e.base is not None and e.base() is base))
        ]
        return rec, writes
    return None


def _traced_view_cause(ctx: Context, err: InplaceError, graph: Any, data: dict[str, Any]) -> Finding | None:
    if graph.consumer is None or err.op not in VIEW_OPS or ctx.tracer is None or not ctx.tracer.traced_step:
        return None
    view = traced_view(ctx, graph.consumer, err)
    if view is None:
        return None
    record, writes = view
    module = ctx.display_module(record.module)
    source = with_line(record.source)
    taken = "indexing, x[idx]" if record.op == "__getitem__" else record.op
    lines = [
        (
            f"backward() failed at step {ctx.step}: {data['consumer']} saved a view (shape {list(err.shape)}, "
            f"taken by {taken}) of a tensor that was then written in place ({err.versions}); PyTorch "
            f"calls it the output of {err.op}."
        ),
        f"Where: the view was taken in module {module or '<outside the model>'}" + (f" at {source}" if source else "") + ".",
    ]
    writer = writes[0] if writes else None
    if writer is not None:
        lines.append(modified_by_line(ctx, writes))
    data.update(
        module_exact=True,
        source=source,
        view_of_written_tensor=True,
        modified_by=None if writer is None else writer.op,
        modified_in=None if writer is None else ctx.display_module(writer.module),
        modified_at=None if writer is None else with_line(writer.source),
    )
    fix = VIEW_WRITE_FIXES.get(writer.op) if writer is not None else None
    return inplace_finding(ctx, lines, module, saver_op(data, err.op), data, fix=fix)


# -- the in-place op that wrote a saved input --------------------------------------------------------
#: In-place spelling of the ops PyTorch names when they wrote a saved tensor (``x += y`` -> AddBackward0).
INPLACE_SPELLING = {"Add": "`+=` / add_()", "Sub": "`-=` / sub_()", "Mul": "`*=` / mul_()", "Div": "`/=` / div_()"}


@dataclass(frozen=True)
class WriterFacts:
    """``op`` wrote in place a tensor the consumer had saved: which modules can run it in place."""

    op: str
    classes: tuple[str, ...]  # module classes that run ``op``
    inplace_in_model: list[tuple[str, Any]]  # (name, module) of the model's modules that run it in place
    foreign: list[str]  # such modules outside the watched model
    traced: bool  # this step's forward was traced

    @property
    def place(self) -> str:
        """Where it ran (a key of :data:`WRITER_PLACES`)."""
        if len(self.inplace_in_model) == 1 and not self.traced:
            return "only_inplace_module"
        if self.foreign:
            return "foreign_module"
        if self.traced or (self.classes and not self.inplace_in_model):
            return "not_in_model"
        return "unknown"

    @property
    def fn(self) -> str:
        return re.sub(r"(?<!^)(?=[A-Z])", "_", self.op).lower()  # LeakyRelu -> leaky_relu


def _not_in_model(f: WriterFacts) -> str:
    why = "no op of the model's forward, traced on this step, wrote it" if f.traced else (
        f"none of the model's {'/'.join(f.classes)} modules has inplace=True"
    )
    return f"Where: not in a module of the watched model ({why}): probably the loss code or training_step" + (
        f", or a module outside the model (e.g. a loss's feature extractor) that runs {f.op} in place."
        if f.classes else "."
    )


#: Where the in-place op ran -> the "Where" line (none for "unknown").
WRITER_PLACES: dict[str, Callable[[WriterFacts, Context], str]] = {
    "only_inplace_module": lambda f, ctx: (
        f"Where (approximate: this step was not traced): probably module "
        f"{ctx.display_module(f.inplace_in_model[0][0])} "
        f"(the only {type(f.inplace_in_model[0][1]).__name__}(inplace=True) in the model)."
    ),
    "foreign_module": lambda f, ctx: (
        f"Where: {f.op} ran in place outside the watched model, probably in {names_text(f.foreign)} "
        "(a module of the loss code or training_step, e.g. a frozen feature extractor of a perceptual loss)."
    ),
    "not_in_model": lambda f, ctx: _not_in_model(f),
}


def writer_fix(f: WriterFacts) -> str:
    if f.classes:
        return (
            f"run it out of place: nn.{f.classes[0]}(inplace=False) (in a pretrained feature extractor such as "
            f"torchvision's VGG `features`, set `m.inplace = False` on its {f.classes[0]} modules), F.{f.fn}(x) "
            f"instead of F.{f.fn}(x, inplace=True) or x.{f.fn}_()."
        )
    spelled_out = "`x = x + y`" if f.op in INPLACE_SPELLING else "the op without `_`"
    return f"write it out of place ({spelled_out}), or apply it to a copy (`x.clone()`)."


def foreign_inplace_modules(ctx: Context, classes: tuple[str, ...], limit: int = 4) -> list[str]:
    """Modules of class ``classes`` with ``inplace=True`` outside the watched model (see ``foreign_modules``)."""
    out: list[str] = []
    for label, mod in foreign_modules(ctx):
        for name, sub in mod.named_modules():
            if type(sub).__name__ in classes and getattr(sub, "inplace", False) is True and ctx.module_name(sub) is None:
                out.append(f"{label}.{name}" if name else label)
                if len(out) >= limit:
                    return out
    return out


def writer_facts(ctx: Context, op: str) -> WriterFacts:
    classes = OP_MODULES.get(op, ())
    return WriterFacts(
        op=op,
        classes=classes,
        inplace_in_model=[(n, m) for n, m in modules_of_type(ctx, op) if getattr(m, "inplace", False) is True],
        foreign=foreign_inplace_modules(ctx, classes) if classes else [],
        traced=ctx.tracer is not None and ctx.tracer.traced_step,
    )


def _writer_cause(ctx: Context, err: InplaceError, graph: Any, data: dict[str, Any]) -> Finding | None:
    """The consumer saved one of its inputs, and PyTorch names that tensor's grad_fn as it is now: not an op
    the consumer took it from (none of its inputs), but the in-place op that last wrote it. A module of the
    model is named only if it can run the op in place (``inplace=True``): an out-of-place nn.ReLU of the same
    class is not the culprit, and saying so would send the user to the wrong code."""
    consumer, op = graph.consumer, err.op
    if graph.producer is not None or consumer is None or op is None or op in (*VIEW_OPS, "CopySlices"):
        return None
    if f"of {err.raw_op}," not in (saved_error(consumer) or ""):
        return None
    f = writer_facts(ctx, op)
    saver = ctx.tracer.record_for(consumer) if f.traced and ctx.tracer is not None else None
    spelled = INPLACE_SPELLING.get(op, f"x.{f.fn}_()")
    if f.classes:
        spelled = f"nn.{f.classes[0]}(inplace=True), F.{f.fn}(x, inplace=True) or {spelled}"
    lines = [
        (
            f"backward() failed at step {ctx.step}: a tensor (shape {list(err.shape)}) that {node_op(consumer)} saved"
            + (f" in module {ctx.display_module(saver.module) or '<outside the model>'}" if saver is not None else "")
            + f" was then overwritten in place by {op} ({spelled}) ({err.versions})."
        )
    ]
    place = f.place
    if place in WRITER_PLACES:
        lines.append(WRITER_PLACES[place](f, ctx))
    module = ctx.display_module(f.inplace_in_model[0][0]) if place == "only_inplace_module" else None
    data.update(
        module_exact=False,
        modified_by=op,
        modified_in=module,
        outside_model=module is None and place != "unknown",
        foreign_modules=f.foreign,
    )
    return inplace_finding(ctx, lines, module, op, data, fix=writer_fix(f))


#: The causes of this module, asked in this order after those of the parameters, buffers and locals.
TRACED_CAUSES = (_traced_op_cause, _traced_view_cause, _writer_cause)


# -- untraced: the nearest module, approximately -----------------------------------------------------
@dataclass(frozen=True)
class UntracedFacts:
    op: str | None
    before: tuple[str, str] | None  # (parameters, module) nearest upstream of the op
    feeds: tuple[str, str] | None  # (parameter, module) the consumer uses directly
    by_type: list[tuple[str, Any]]  # the model's modules whose class runs ``op``
    #: "outside" (traced, and no module runs it: after the forward), "custom" (a custom autograd.Function),
    #: "traced_step" (traced, not an op output) or "untraced_step".
    place: str


def untraced_facts(ctx: Context, op: str | None, producer: Any, consumer: Any) -> UntracedFacts:
    start = producer if producer is not None else consumer
    by_type = modules_of_type(ctx, op) if op else []
    # A custom autograd.Function's output is traced only as a module's output (apply() bypasses
    # __torch_function__): one called inside a forward is no evidence of code after the forward.
    custom = isinstance(producer, torch.autograd.function.BackwardCFunction)
    traced = ctx.tracer is not None and ctx.tracer.traced_step
    place = "custom" if custom else "untraced_step" if not traced else "traced_step" if by_type else "outside"
    return UntracedFacts(
        op=op,
        before=upstream_param(ctx, start) if start is not None else None,
        feeds=own_param(ctx, consumer) if consumer is not None and consumer is not producer else None,
        by_type=by_type,
        place=place,
    )


#: Place -> (why the "Where" is approximate, what to do next).
UNTRACED_WORDS: dict[str, tuple[Callable[[UntracedFacts], str], Callable[[UntracedFacts], str]]] = {
    "outside": (
        lambda f: "no op of the model's forward, traced on this step, produced it: it probably ran after the forward",
        lambda f: (
            "Probably in the loss code (or training_step): look between the model's forward and backward() for "
            f"an in-place write to the output of {f.op or 'that op'}: an indexed assignment (`p[:, 0] = 1.0`), an "
            "op ending in `_` (`p.clamp_(...)`), or `+=`/`*=`. Write it out of place: `p = p.clone()` before the "
            "assignment, or `torch.where`/`torch.cat` to build the new tensor."
        ),
    ),
    "custom": (
        lambda f: f"{f.op} is a custom autograd.Function, not traced inside a forward",
        lambda f: (
            f"gradwatch names the exact module of a custom autograd.Function when its output is a module's output "
            f"(a module whose forward returns {f.op}.apply(x)); for an exact trace now, run one step under "
            "torch.autograd.set_detect_anomaly(True)."
        ),
    ),
    "traced_step": (
        lambda f: "the saved tensor is not an op output gradwatch traced",
        lambda f: _RUN_TRACED,
    ),
    "untraced_step": (
        lambda f: "this step was not traced",
        lambda f: _RUN_TRACED,
    ),
}
_RUN_TRACED = (
    "gradwatch names the exact module and the in-place op on the first watched step and while escalated; "
    "for an exact trace now, run one step under torch.autograd.set_detect_anomaly(True)."
)


def _untraced_where(ctx: Context, f: UntracedFacts) -> tuple[list[str], str | None]:
    """The approximate places, and the module to name."""
    module = None
    where: list[str] = []
    if len(f.by_type) == 1:
        module = ctx.display_module(f.by_type[0][0])
        where.append(f"probably module {module} (the only {type(f.by_type[0][1]).__name__} in the model)")
    if f.before is not None:
        where.append(
            f"{f.op or 'the op'} follows module {ctx.display_module(f.before[1])} (nearest parameters: {f.before[0]})"
        )
        if module is None:
            module = ctx.display_module(f.before[1])
    if f.feeds is not None:
        where.append(f"its output feeds module {ctx.display_module(f.feeds[1])}")
    # Outside: not inside any module, the loss code (or training_step) after the model's output.
    return where, None if f.place == "outside" else module


def explain_untraced(ctx: Context, err: InplaceError, producer: Any, consumer: Any, data: dict[str, Any]) -> Finding:
    f = untraced_facts(ctx, err.op, producer, consumer)
    reason, hint = UNTRACED_WORDS[f.place]
    what = f"the output of {f.op}" if f.op else "a saved tensor"
    lines = [
        (
            f"backward() failed at step {ctx.step}: {what} (shape {list(err.shape)}) was modified by an in-place "
            f"operation after autograd saved it ({err.versions})."
        )
    ]
    where, module = _untraced_where(ctx, f)
    if where:
        lines.append(f"Where (approximate: {reason(f)}): " + "; ".join(where) + ".")
    lines.append(hint(f))
    data.update(
        module_exact=False,
        follows=None if f.before is None else ctx.display_module(f.before[1]),
        feeds=None if f.feeds is None else ctx.display_module(f.feeds[1]),
        same_type_modules=[name for name, _m in f.by_type],
    )
    return inplace_finding(ctx, lines, module, err.op, data)
