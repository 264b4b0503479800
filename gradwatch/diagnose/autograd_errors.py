"""Explain autograd errors: in-place modification, backward twice, no grad_fn, non-scalar backward.

:func:`explain` turns an exception raised by the training code into a :class:`~gradwatch.Finding` that
names the op, the module and the step, says why PyTorch refused, and what to change. It only reads: the
exception is never changed or swallowed (the integrations re-raise the original).

Where the facts come from:

- The message itself (op, shape, versions).
- The exception's traceback: the loss tensor (``self`` of ``Tensor.backward``, ``tensors`` of
  ``torch.autograd.backward``), and for errors raised during forward, the innermost frame whose ``self``
  is a module of the watched model.
- The autograd graph, walked from the loss: the node whose saved tensor raises the same error, its
  neighbours, and the parameters (``AccumulateGrad.variable``) around it.
- :class:`gradwatch.observe.tracing.ForwardTracer` records on the first watched step and while escalated: the
  exact module and source line of the op, and the in-place op that changed its output.
"""

from __future__ import annotations

import linecache
import os
import re
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from gradwatch.core.findings import Finding, names_text
from gradwatch.core.open_watchers import open_watchers
from gradwatch.core.params import user_module
from gradwatch.diagnose.inplace_source import SourceWrite, local_writer
from gradwatch.observe.tracing import (
    ForwardTracer,
    InplaceRecord,
    OpRecord,
    func_name,
    library_frame,
    node_op,
    traceback_entries,
)

#: Autograd nodes visited at most when walking a graph (the error path only).
MAX_NODES = 200_000

_INPLACE_BACKWARD = re.compile(
    r"modified by an inplace operation: \[(?P<type>[^\s\]]+) \[(?P<shape>[\d, ]*)\]\]"
    r"(?:, which is output (?P<index>\d+) of (?P<op>[\w:]+),)? is at version (?P<now>\d+); "
    r"expected version (?P<expected>\d+) instead"
)
_VIEW_INPLACE = re.compile(r"Output (?P<index>\d+) of (?P<op>[\w:]+) is a view and is being modified inplace")
_LEAF_INPLACE = ("a leaf Variable that requires grad is being used in an in-place operation",)
_OTHER_FORWARD_INPLACE = (
    "A view was created in no_grad mode and is being modified inplace",
    "is a view of a leaf Variable that requires grad and is being used in an in-place operation",
    "a view of a leaf Variable that requires grad is being used in an in-place operation",
)
_ANOMALY_NAN = re.compile(r"Function '(?P<op>\w+)' returned nan values in its (?P<index>\d+)\w* output")
_TWICE = "Trying to backward through the graph a second time"
_REDUCTIONS = frozenset({"Mean", "Sum", "Amax", "Amin", "Max", "Min", "Norm", "LinalgVectorNorm", "Prod", "Logsumexp"})
_NO_GRAD = "does not require grad and does not have a grad_fn"
_NONSCALAR = "grad can be implicitly created only for"

_TORCH_DIR = os.path.dirname(torch.__file__)
_OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the package root
_LIBRARY_MARKERS = (
    os.sep + "lightning" + os.sep,
    os.sep + "pytorch_lightning" + os.sep,
    os.sep + "lightning_fabric" + os.sep,
)

_CULPRITS = (
    "Usual culprits: nn.ReLU(inplace=True) or F.relu(x, inplace=True) (use inplace=False); `x += y`, `x *= y` "
    "(write `x = x + y`); `x[idx] = v` on a tensor autograd saved (build a new tensor: torch.where, "
    "torch.cat, x.clone() first); torch.sigmoid_(x) / x.sigmoid_() and other ops ending in `_` (use the "
    "out-of-place op)."
)

#: Forward ops (from node names) and the module classes that usually run them.
_OP_MODULES = {
    "Sigmoid": ("Sigmoid",),
    "Tanh": ("Tanh",),
    "Relu": ("ReLU",),
    "Threshold": ("ReLU", "Threshold"),
    "Gelu": ("GELU",),
    "Silu": ("SiLU",),
    "Elu": ("ELU",),
    "LeakyRelu": ("LeakyReLU",),
    "Hardtanh": ("Hardtanh", "ReLU6"),
    "Softmax": ("Softmax",),
    "LogSoftmax": ("LogSoftmax",),
    "Addmm": ("Linear",),
    "Mm": ("Linear",),
    "Convolution": ("Conv1d", "Conv2d", "Conv3d"),
    "NativeLayerNorm": ("LayerNorm",),
    "NativeBatchNorm": ("BatchNorm1d", "BatchNorm2d", "BatchNorm3d"),
    "Exp": (),
}


def explain(exc: BaseException, *, engine: Any, step: int) -> Finding | None:
    """A finding explaining ``exc`` if it is a known autograd error, else None.

    Args:
        exc: The exception raised by the training code (left untouched).
        engine: The run's :class:`~gradwatch.core.engine.Engine` (names, tracer records).
        step: Index of the optimizer step during which it was raised.

    Example:
        >>> import torch, gradwatch
        >>> model = torch.nn.Linear(4, 2)
        >>> gw = gradwatch.watch(model, console=False)
        >>> try:
        ...     model(torch.randn(3, 4)).backward()
        ... except RuntimeError as e:
        ...     gw.explain(e).kind
        'nonscalar_backward'
        >>> gw.close()
    """
    if not isinstance(exc, RuntimeError):
        return None
    tracer = engine.extension(ForwardTracer) if hasattr(engine, "extension") else None
    if tracer is not None:
        tracer.end_trace()  # an exception unwound past a traced forward
    ctx = _Context(exc, engine, step, tracer)
    text = str(exc)
    m = _INPLACE_BACKWARD.search(text)
    if m:
        return _inplace_backward(ctx, m)
    m = _VIEW_INPLACE.search(text)
    if m:
        return _inplace_forward(ctx, node_name=m.group("op"), index=int(m.group("index")))
    if any(s in text for s in _LEAF_INPLACE + _OTHER_FORWARD_INPLACE):
        return _inplace_forward(ctx, node_name=None, index=None)
    if _TWICE in text:
        return _backward_twice(ctx)
    if _NO_GRAD in text:
        return _no_grad_graph(ctx)
    if _NONSCALAR in text:
        return _nonscalar(ctx)
    m = _ANOMALY_NAN.search(text)
    if m:
        return _anomaly_nan(ctx, m.group("op"), int(m.group("index")))
    return None


def _anomaly_nan(ctx: _Context, op: str, index: int) -> Finding:
    """Anomaly mode (``torch.autograd.set_detect_anomaly``, Lightning's ``detect_anomaly=True``) stopped
    backward at the first node that returned NaN. It checks for NaN only: an Inf born earlier (sqrt or
    log at 0) turns into NaN at a later, harmless-looking op (a matmul multiplying Inf by 0)."""
    from gradwatch.diagnose.op_fixes import GENERIC_FIX as _GENERIC_FIX
    from gradwatch.diagnose.op_fixes import fix_for

    losses = [t for t in ctx.roots() if t.numel() == 1]
    loss_note = ""
    loss: float | None = None
    if losses and not bool(torch.isfinite(losses[0].detach()).all()):  # the error path: one read
        loss = float(losses[0].detach().reshape(()))
        loss_note = f" The loss itself was {loss:g} already."
    fix = fix_for(op)
    if loss is not None:
        # The NaN was there before backward: no backward op made it, this one only carries it.
        fix = (
            f"the NaN/Inf was born in the forward pass or in the loss, before backward; {op} only carries it. "
            "Look at sqrt, log, pow and divisions of zero or negative values in the forward pass and the loss "
            "(clamp their inputs, add an epsilon), and check the batch for NaN/Inf; without detect_anomaly, "
            "gradwatch names the forward op and line where it was born."
        )
    elif fix is _GENERIC_FIX:
        fix = (
            f"{op} rarely makes a NaN from finite values: an Inf reached it from an earlier backward op. Look "
            "at sqrt, log, pow and divisions on the forward line anomaly mode printed and before it, or "
            "turn detect_anomaly off and let gradwatch's escalation name the op where the Inf was born "
            "(it checks for Inf too)."
        )
    return Finding(
        kind="nan_origin",
        step=ctx.step,
        severity="error",
        message=(
            f"Anomaly mode stopped backward at step {ctx.step}: op {op} is the first backward op that returned "
            f"NaN (in its gradient output {index}).{loss_note} Anomaly mode printed the forward line that created "
            "this op above, under 'Traceback of forward call that caused the error'; it checks for NaN only, "
            "so an Inf born in an earlier op shows up here. Training stopped with PyTorch's error.\n"
            f"Fix: {fix}"
        ),
        op=op,
        data={"phase": "backward", "op": op, "output": index, "anomaly_error": str(ctx.exc), "raised": True,
              **({"loss_nonfinite": True, "loss": loss} if loss is not None else {})},
    )


# -- shared facts ----------------------------------------------------------------------------------
@dataclass
class _Context:
    exc: BaseException
    engine: Any
    step: int
    tracer: ForwardTracer | None
    frames: list[Any] = field(default_factory=list)
    #: The line each frame raised at (``frame.f_lineno`` moves on: a ``with`` block's frame is at the ``with``).
    lines: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for frame, line in traceback_entries(self.exc):
            self.frames.append(frame)
            self.lines[id(frame)] = line

    def source_of(self, frame: Any) -> str:
        """``file:line: code`` of a frame of the traceback, at the line it raised from."""
        fname = frame.f_code.co_filename
        lineno = self.lines.get(id(frame), frame.f_lineno)
        line = linecache.getline(fname, lineno).strip()
        return f"{fname}:{lineno}: {line}" if line else f"{fname}:{lineno}"

    @property
    def index(self) -> Any:
        return self.engine.index

    @property
    def model(self) -> Any:
        """The user's model: under Lightning Fabric the module ``fabric.setup`` wrapped, not its wrapper."""
        return user_module(self.engine.model)

    def roots(self) -> list[torch.Tensor]:
        """The tensors backward was called on, from the traceback frames (innermost first)."""
        found: list[torch.Tensor] = []
        for frame in reversed(self.frames):
            code = frame.f_code
            fname = code.co_filename
            if not fname.startswith(_TORCH_DIR):
                continue
            local = frame.f_locals
            if code.co_name == "backward" and fname.endswith(os.path.join("torch", "_tensor.py")):
                cands: Any = [local.get("self")]
            elif code.co_name in ("backward", "grad") and fname.endswith(os.path.join("autograd", "__init__.py")):
                cands = local.get("tensors", local.get("outputs"))
            elif code.co_name == "_engine_run_backward":
                cands = local.get("t_outputs")
            else:
                continue
            if isinstance(cands, torch.Tensor):
                cands = [cands]
            for t in cands or ():
                if isinstance(t, torch.Tensor) and not any(t is f for f in found):
                    found.append(t)
            if found:
                break
        return found

    def user_frames(self) -> list[Any]:
        """Frames of the user's code (not torch, gradwatch or Lightning), outermost first."""
        return [f for f in self.frames if _is_user_file(f.f_code.co_filename)]

    def module_name(self, module: Any) -> str | None:
        return self.index.module_name.get(id(module))

    def user_name(self, raw: str, module: Any) -> str:
        """A module's path as the user wrote it (without wrapper segments: DDP's ``module``, Fabric's
        ``_forward_module``); ``raw``, its path in the model walked, when the index does not know it."""
        name = self.module_name(module)
        return raw if name is None else name

    def display_module(self, name: str | None) -> str | None:
        if name is None:
            return None
        if name == "":
            model = self.model
            return f"<root {type(model).__name__}>" if model is not None else "<root>"
        return name

    def param_of(self, node: Any) -> tuple[str, str] | None:
        """(parameter name, module name) of an AccumulateGrad node's variable, if the model owns it."""
        var = getattr(node, "variable", None)
        if var is None:
            return None
        name = self.index.param_name.get(id(var))
        if name is None:
            return None
        return name, self.index.param_module.get(id(var), "")


def _is_user_file(fname: str) -> bool:
    if fname.startswith((_TORCH_DIR, _OWN_DIR)):
        return False
    if any(m in fname for m in _LIBRARY_MARKERS):
        return False
    return not fname.startswith("<frozen")


def _with_line(source: str | None) -> str | None:
    """``file:line`` -> ``file:line: <code>``."""
    if not source:
        return source
    fname, _, lineno = source.rpartition(":")
    line = linecache.getline(fname, int(lineno)).strip() if lineno.isdigit() else ""
    return f"{source}: {line}" if line else source


def _walk(roots: list[torch.Tensor]) -> Iterator[tuple[Any, int]]:
    """Breadth-first over the autograd graph from ``roots``: (node, depth)."""
    seen: set[int] = set()
    queue: deque[tuple[Any, int]] = deque()
    for r in roots:
        if r.grad_fn is not None:
            queue.append((r.grad_fn, 0))
    keep: list[Any] = []  # hold visited nodes so their ids stay unique during the walk
    while queue and len(keep) < MAX_NODES:
        node, depth = queue.popleft()
        if id(node) in seen:
            continue
        seen.add(id(node))
        keep.append(node)
        yield node, depth
        for child, _ in getattr(node, "next_functions", ()):
            if child is not None and id(child) not in seen:
                queue.append((child, depth + 1))


def _children(node: Any) -> list[Any]:
    return [c for c, _ in getattr(node, "next_functions", ()) if c is not None]


def _saved_error(node: Any) -> str | None:
    """The error raised when reading one of ``node``'s saved tensors, if any."""
    for attr in dir(node):
        # ``saved_tensors``: what a custom autograd.Function saved with ctx.save_for_backward
        if not attr.startswith("_saved_") and attr != "saved_tensors":
            continue
        try:
            getattr(node, attr)
        except RuntimeError as e:
            return str(e)
        except Exception:  # noqa: BLE001, S112 - an attribute that is not a tensor: nothing to learn
            continue
    return None


def _upstream_param(ctx: _Context, node: Any, limit: int = 2000) -> tuple[str, str] | None:
    """The nearest model parameter feeding ``node`` (breadth-first toward the inputs)."""
    seen: set[int] = set()
    queue: deque[Any] = deque(_children(node))
    keep: list[Any] = []
    while queue and len(keep) < limit:
        n = queue.popleft()
        if id(n) in seen:
            continue
        seen.add(id(n))
        keep.append(n)
        found = ctx.param_of(n)
        if found is not None:
            return found
        queue.extend(_children(n))
    return None


def _own_param(ctx: _Context, node: Any) -> tuple[str, str] | None:
    """A parameter ``node`` uses directly (through views such as ``TBackward0``): the module it runs in."""
    for child in _children(node):
        found = ctx.param_of(child)
        if found is not None:
            return found
        if node_op(child) in (
            "T",
            "Transpose",
            "View",
            "Reshape",
            "Expand",
            "Permute",
            "AsStrided",
            "Unsqueeze",
            "Squeeze",
        ):
            for grandchild in _children(child):
                found = ctx.param_of(grandchild)
                if found is not None:
                    return found
    return None


def _modules_of_type(ctx: _Context, op: str) -> list[tuple[str, Any]]:
    """(user path, module) of the model's modules whose class usually runs ``op``."""
    model = ctx.model
    classes = _OP_MODULES.get(op, (op,))
    if model is None or not classes:
        return []
    return [(ctx.user_name(name, m), m) for name, m in model.named_modules() if type(m).__name__ in classes]


# -- inplace_error ---------------------------------------------------------------------------------
_WHY_INPLACE = (
    "Why it matters: autograd saved that tensor during forward to compute a gradient; once it is changed in "
    "place the gradient would be wrong, so PyTorch refuses. Nothing was updated by this backward."
)


def _inplace_backward(ctx: _Context, m: re.Match[str]) -> Finding | None:
    shape = tuple(int(s) for s in m.group("shape").replace(" ", "").split(",") if s)
    now, expected = int(m.group("now")), int(m.group("expected"))
    raw_op = m.group("op")
    op = node_op_name(raw_op) if raw_op else None
    roots = ctx.roots()
    consumer = producer = None
    shape_text = "[" + m.group("shape") + "]"
    if roots:
        for node, _ in _walk(roots):
            err = _saved_error(node)
            if (
                err
                and "modified by an inplace operation" in err
                and shape_text in err
                and f"is at version {now};" in err
            ):
                consumer = node
                break
    if consumer is not None and op is not None:
        for cand in [consumer, *_children(consumer)]:
            if node_op(cand) == op:
                producer = cand
                break
    data: dict[str, Any] = {
        "shape": list(shape),
        "version": now,
        "expected_version": expected,
        "tensor_type": m.group("type"),
        "node": None if producer is None else producer.name(),
        "consumer": None if consumer is None else consumer.name(),
    }
    # A parameter (or a view of one) changed in place between forward and backward: optimizer.step().
    param = _modified_param(ctx, consumer, shape, now) if consumer is not None else None
    if param is None and consumer is not None and _watched_elsewhere(ctx, consumer, shape, now):
        return None  # another watcher's model owns the parameter (a GAN watched per network): it explains
    if param is not None and (raw_op is None or op in _VIEW_OPS):
        pname, pmodule, pshape = param
        data.update(param=pname, module_exact=True)
        tensor = next((p for n, p in ctx.index.model_params if n == pname), None)
        writes = _traced_writes(ctx, tensor) if tensor is not None else []
        return _param_finding(ctx, pname, pmodule, pshape, now, expected, data, op, writes[0] if writes else None)
    if consumer is not None and (raw_op is None or op in _VIEW_OPS):
        foreign = _modified_foreign_leaf(ctx, consumer, shape, now)
        if foreign is not None:
            return _foreign_leaf_finding(ctx, *foreign, shape, now, expected, data, op)
    if raw_op is None or op in _VIEW_OPS:
        for facts, finding in _SAVED_TENSOR_CAUSES:
            found = facts(ctx, shape, now)
            if found is not None:
                return finding(ctx, found, shape, now, expected, data)
    record = ctx.tracer.record_for(producer) if ctx.tracer is not None and producer is not None else None
    if record is None and ctx.tracer is not None and op is not None and ctx.tracer.traced_step:
        matches = ctx.tracer.find(op, shape, now)
        if len(matches) == 1:
            record = matches[0]
    if record is not None:
        return _inplace_traced(ctx, record, op or record.op, shape, now, expected, data)
    if consumer is not None and op in _VIEW_OPS and ctx.tracer is not None and ctx.tracer.traced_step:
        view = _traced_view(ctx, consumer, shape, now, expected)
        if view is not None:
            return _inplace_view_traced(ctx, consumer, view[0], view[1], op, shape, now, expected, data)
    if (
        producer is None
        and consumer is not None
        and op is not None
        and op not in (*_VIEW_OPS, "CopySlices")
        and f"of {raw_op}," in (_saved_error(consumer) or "")
    ):
        # The consumer saved one of its inputs, and PyTorch names that tensor's grad_fn as it is now: not an
        # op the consumer took it from (none of its inputs), but the in-place op that last wrote it.
        return _inplace_writer(ctx, consumer, op, shape, now, expected, data)
    return _inplace_untraced(ctx, producer, consumer, op, shape, now, expected, data)


def _traced_writes(ctx: _Context, tensor: torch.Tensor) -> list[InplaceRecord]:
    """Traced in-place ops of this step's forward on ``tensor`` (itself or a view of it)."""
    tracer = ctx.tracer
    if tracer is None or not tracer.traced_step:
        return []
    return [r for r in tracer.inplace if r.tensor() is tensor or (r.base is not None and r.base() is tensor)]


def _param_finding(
    ctx: _Context, pname: str, pmodule: str, pshape: tuple[int, ...], now: int, expected: int,
    data: dict[str, Any], op: str | None, writer: InplaceRecord | None,
) -> Finding:
    """A parameter autograd saved was changed in place before this backward: by the forward itself
    (``writer``, traced: ``nn.Embedding(max_norm=...)``), or else, usually, by ``optimizer.step()``."""
    if writer is None:
        when = f"after the forward pass that used it and before this backward ({_versions_text(now, expected)})"
        where = f"Where: module {ctx.display_module(pmodule)}; the op that saved it is {data['consumer']}."
        fix = (
            "Fix: the usual cause is optimizer.step() (an in-place update) between a forward and the "
            "backward of a loss built from it, e.g. stepping the discriminator before the generator's "
            "loss.backward() in a GAN, or two losses sharing the model with a step in between. Call "
            "backward() for every loss built from a forward before stepping, or redo the forward after "
            "step(). An RNN hidden state carried into the next step without .detach() (then "
            "backward(retain_graph=True) to get past 'backward through the graph a second time') does it too: "
            "detach the state each step (`h = h.detach()`) and drop retain_graph. Other in-place updates of "
            "weights (`w.data.mul_()`, `with torch.no_grad(): w += ...`, weight clipping) between forward "
            "and backward do the same."
        )
    else:
        source = _with_line(writer.source)
        when = f"during this step's forward, after an op had saved it ({_versions_text(now, expected)})"
        where = (
            f"Modified by: {writer.op} in module {ctx.display_module(writer.module) or '<outside the model>'}"
            + (f" at {source}" if source else "")
            + f"; the op that saved it earlier is {data.get('consumer')}."
        )
        if "embedding" in writer.op:  # F.embedding writes its weight only with max_norm (renorm)
            fix = (
                "Fix: nn.Embedding(max_norm=...) renormalizes its weight in place when it is called; every "
                f"other use of {pname} in the same forward (a tied output layer, weight @ x) must come after "
                f"that call or use a copy ({pname.rsplit('.', 1)[-1]}.clone()), or drop max_norm and "
                "normalize the looked-up vectors instead."
            )
        else:
            fix = (
                "Fix: do not write a parameter in place during the forward (use an out-of-place op on a "
                "copy), or make every use of it that autograd saves come after the write."
            )
        data.update(modified_by=writer.op, modified_in=ctx.display_module(writer.module), modified_at=source)
    return Finding(
        kind="inplace_error",
        step=ctx.step,
        severity="error",
        message=(
            f"backward() failed at step {ctx.step}: parameter {pname} (shape {list(pshape)}) was changed in "
            f"place {when}.\n{where}\n{_WHY_INPLACE}\n{fix}"
        ),
        params=(pname,),
        module=ctx.display_module(pmodule),
        op=op or data.get("consumer"),
        data=data,
    )


def node_op_name(raw: str) -> str:
    """``SigmoidBackward0`` or ``Sigmoid`` -> ``Sigmoid``."""
    raw = raw.rsplit("::", 1)[-1]
    i = raw.find("Backward")
    return raw[:i] if i > 0 else raw


def _changed_leaves(consumer: Any, shape: tuple[int, ...], now: int) -> Iterator[tuple[Any, torch.Tensor]]:
    """``(AccumulateGrad node, leaf)`` within three steps of ``consumer`` whose leaf is at version ``now``
    with the saved tensor's shape (or its transpose): the tensor changed in place."""
    frontier = [consumer]
    for _ in range(3):
        nxt = []
        for n in frontier:
            for child in _children(n):
                var = getattr(child, "variable", None)
                if var is None:
                    nxt.append(child)
                elif var._version == now and tuple(var.shape) in (shape, tuple(reversed(shape))):
                    yield child, var
        frontier = nxt


def _modified_param(
    ctx: _Context, consumer: Any, shape: tuple[int, ...], now: int
) -> tuple[str, str, tuple[int, ...]] | None:
    for node, var in _changed_leaves(consumer, shape, now):
        found = ctx.param_of(node)
        if found is not None:
            return found[0], found[1], tuple(var.shape)
    return None


def _modified_foreign_leaf(
    ctx: _Context, consumer: Any, shape: tuple[int, ...], now: int
) -> tuple[str | None, str | None, torch.Tensor] | None:
    """A leaf that requires grad, not the watched model's, that the consumer saved and that was changed in place
    (an EMA teacher's weight updated before backward): its name among the user's modules, if found."""
    for node, var in _changed_leaves(consumer, shape, now):
        if ctx.param_of(node) is not None:
            continue
        for label, mod in _foreign_modules(ctx):
            name = next((n for n, p in mod.named_parameters() if p is var), None)
            if name is not None:
                return f"{label}.{name}", label, var
        return None, None, var
    return None


def _foreign_leaf_finding(
    ctx: _Context, name: str | None, owner: str | None, var: torch.Tensor, shape: tuple[int, ...], now: int,
    expected: int, data: dict[str, Any], op: str | None,
) -> Finding:
    """A tensor outside the watched model that requires grad (a parameter of a teacher or target network the
    loss uses) was updated in place between the forward that used it and backward: by an EMA update, a
    copy of weights, or another optimizer's step. Not the loss code's indexed assignment."""
    what = f"parameter {name} (shape {list(var.shape)}), which the watched model does not own," if name else (
        f"a tensor (shape {list(var.shape)}) that requires grad and is not a parameter of the watched model"
    )
    via = f", through a view of shape {list(shape)}" if tuple(var.shape) != shape else ""
    data.update(param=name, module_exact=False, outside_model=True)
    lines = [
        (
            f"backward() failed at step {ctx.step}: {what} was changed in place after "
            f"the forward pass used it and before this backward ({_versions_text(now, expected)}); autograd saved "
            f"it for {data['consumer']}{via}."
        ),
        (
            "Cause: typically an EMA / mean-teacher or target-network update (`with torch.no_grad(): "
            "t.mul_(0.99).add_(s, alpha=0.01)`), a weight copy or clipping, or another optimizer's step(), run "
            "between that forward and backward()."
        ),
        _WHY_INPLACE,
        (
            "Fix: do that update after backward() (after optimizer.step()); or, if no gradient must flow into "
            + (f"{owner}" if owner else "it")
            + " (an EMA teacher, a target network), run its forward under torch.no_grad() or freeze it ("
            + (f"{owner}.requires_grad_(False)" if owner else "requires_grad_(False)")
            + " after deepcopy), so autograd saves nothing of it."
        ),
    ]
    return Finding(
        kind="inplace_error",
        step=ctx.step,
        severity="error",
        message="\n".join(lines),
        op=op or data.get("consumer"),
        data=data,
    )


def _watched_elsewhere(ctx: _Context, consumer: Any, shape: tuple[int, ...], now: int) -> bool:
    """The changed tensor is a parameter of another open watcher's model (as ``_modified_param`` finds it)."""
    key = (id(ctx.exc), str(ctx.exc))
    # Open watchers, and closed ones that explained this very exception (an inner `with` block exits first).
    others = [
        w.engine.index.param_name
        for w in open_watchers()
        if w.engine is not ctx.engine
        and (not w.closed or (w.engine._explained is not None and w.engine._explained[0] == key))
    ]
    return bool(others) and any(
        any(id(var) in names for names in others) for _node, var in _changed_leaves(consumer, shape, now)
    )


#: Ops whose output is a view of their input: a saved view of a parameter or buffer is that tensor.
_VIEW_OPS = ("AsStrided", "T", "Transpose", "View", "Permute", "Expand")


def _modified_buffer(
    ctx: _Context, shape: tuple[int, ...], now: int
) -> tuple[str, torch.Tensor, list[str]] | None:
    """A buffer of the model (a queue, a memory bank, running statistics) that autograd saved (itself or
    a view: views share its version counter) and that was then written in place; with the names of the
    other buffers that match as well (same size and version: which one cannot be told)."""
    model = ctx.model
    if model is None:
        return None
    numel = 1
    for d in shape:
        numel *= d
    found = [
        (f"{owner}.{name}" if owner else name, buf)
        for mname, m in model.named_modules()
        for owner in (ctx.user_name(mname, m),)
        for name, buf in m.named_buffers(recurse=False)
        if buf._version == now and buf.numel() == numel and buf.is_floating_point()
    ]
    if not found:
        return None
    return found[0][0], found[0][1], [n for n, _b in found[1:]]


def _buffer_finding(
    ctx: _Context, buffer: tuple[str, torch.Tensor], shape: tuple[int, ...], now: int, expected: int,
    data: dict[str, Any],
) -> Finding:
    name, buf, alike = buffer
    owner, _, attr = name.rpartition(".")
    module = ctx.display_module(owner) if owner else ctx.display_module("")
    mods = _traced_writes(ctx, buf)
    which = f"buffer {name}" if not alike else f"buffer {name} (or {names_text(alike)}: same size and version)"
    lines = [
        (
            f"backward() failed at step {ctx.step}: {which} (shape {list(buf.shape)}) of module {module} "
            f"was modified in place after the forward pass used it ({_versions_text(now, expected)}); autograd "
            f"saved it (shape {list(shape)}) to compute a gradient."
        )
    ]
    graph = (
        f" Write values without their graph into it, too: self.{attr}[idx] = feats.detach() (a buffer that "
        "carries a graph makes the next step's backward go through this one)."
        if buf.grad_fn is not None
        else ""
    )
    if mods:
        src = _with_line(mods[0].source)
        lines.append(
            f"Modified by: {mods[0].op} in module {ctx.display_module(mods[0].module) or '<outside the model>'}"
            + (f" at {src}" if src else "") + "."
        )
    data.update(buffer=name, buffers_alike=alike, module_exact=True, modified_by=mods[0].op if mods else None,
                modified_at=_with_line(mods[0].source) if mods else None)
    return Finding(
        kind="inplace_error",
        step=ctx.step,
        severity="error",
        message="\n".join(lines) + "\n" + _WHY_INPLACE + "\n" + (
            f"Fix: update self.{attr} after backward() (e.g. in a method called after optimizer.step()), or let "
            f"the forward use a copy: self.{attr}.clone() (a queue or memory bank, as in MoCo, is enqueued "
            "after the loss was computed from a copy)." + graph
        ),
        module=module,
        op=mods[0].op if mods else None,
        data=data,
    )


def _user_frames_innermost(ctx: _Context) -> list[tuple[Any, int]]:
    return [(f, ctx.lines.get(id(f), f.f_lineno)) for f in reversed(ctx.user_frames())]


def _modified_local(ctx: _Context, shape: tuple[int, ...], now: int) -> SourceWrite | None:
    """A local tensor of the user's code (a loss's target), not the model's, at the version PyTorch reports
    and written in place in the source (``label.fill_(0)``): decided by the version counter and the write,
    not by a shape that a buffer may share (a BatchNorm's running_mean when the batch size equals its
    channel count)."""
    numel = 1
    for d in shape:
        numel *= d
    model = ctx.model
    owned = {id(t) for t in (*model.parameters(), *model.buffers())} if model is not None else set()

    def is_it(t: torch.Tensor) -> bool:
        base = t._base if t._base is not None else t
        return t._version == now and t.numel() == numel and id(base) not in owned and not t.requires_grad

    return local_writer(_user_frames_innermost(ctx), is_it)


def _local_finding(
    ctx: _Context, write: SourceWrite, shape: tuple[int, ...], now: int, expected: int, data: dict[str, Any]
) -> Finding:
    saver = data.get("consumer") or "a backward node"
    lines = [
        (
            f"backward() failed at step {ctx.step}: tensor {write.name} (shape {list(shape)}) was modified in place "
            f"after {saver} saved it ({_versions_text(now, expected)}); autograd needs the value it saved (for a "
            "loss, its target) to compute the gradient."
        ),
        f"Modified by: {write.spelled} at {write.source}.",
    ]
    data.update(tensor=write.name, module_exact=False, outside_model=True, modified_by=write.op,
                modified_at=write.source)
    fix = (
        f"Fix: give the later use its own tensor instead of writing into {write.name}: "
        + (
            f"{write.name} = torch.full_like({write.name}, value) instead of {write.spelled}"
            if write.op == "fill_"
            else f"{write.name} = {write.name}.clone() before {write.spelled}, or its out-of-place form"
        )
        + f" (or call backward() on the first loss before {write.name} changes)."
    )
    return _inplace_finding(ctx, lines, None, None, data, fix=fix)


#: Causes of a saved tensor with no grad_fn (or a view of one) changed in place: ``(facts, finding)``, the
#: first whose facts are found speaks.
_SAVED_TENSOR_CAUSES: tuple[tuple[Any, Any], ...] = (
    (_modified_local, _local_finding),
    (_modified_buffer, _buffer_finding),
)


def _versions_text(now: int, expected: int) -> str:
    changes = now - expected
    return f"saved at version {expected}, now at version {now} ({changes} in-place change{'s' if changes != 1 else ''})"


def _inplace_traced(
    ctx: _Context, record: OpRecord, op: str, shape: tuple[int, ...], now: int, expected: int, data: dict[str, Any]
) -> Finding:
    earlier = ctx.tracer.before_inplace(record) if ctx.tracer is not None else None
    if earlier is not None:
        # PyTorch names the in-place op's own node (the tensor's grad_fn now); autograd saved the value
        # that op overwrote, i.e. the output of the op before it.
        record = earlier[0]
        op = node_op(record.node) if record.node is not None else record.op
        data["error_names"] = data.get("node")
    module = ctx.display_module(record.module)
    source = _with_line(record.source)
    mods: list[InplaceRecord] = ctx.tracer.modifications_of(record) if ctx.tracer is not None else []
    if earlier is not None and not mods:
        mods = [earlier[1]]
    lines = [
        (
            f"backward() failed at step {ctx.step}: the output of {op} (shape {list(shape)}) was modified by an "
            f"in-place operation after autograd saved it ({_versions_text(now, expected)})."
        ),
        f"Where: {op} ran in module {module or '<outside the model>'}" + (f" at {source}" if source else "") + ".",
    ]
    culprit = mods[0] if mods else None
    culprit_source = _modified_by(ctx, mods, lines)
    data.update(
        module_exact=True,
        source=source,
        modified_by=None if culprit is None else culprit.op,
        modified_in=None if culprit is None else ctx.display_module(culprit.module),
        modified_at=culprit_source,
    )
    tensor = record.tensor()
    written = _written_after_forward(ctx, tensor) if culprit is None and tensor is not None else None
    if written is not None:
        # Not traced: the write ran in the training code after the forward (`probs.clamp_(min=1e-6)`).
        lines.append(f"Modified by: {written.spelled} at {written.source} (in the training code, after the forward).")
        data.update(modified_by=written.op, modified_at=written.source)
        name = written.name
        out_of_place = f"{name} = {name}.{written.op[:-1]}(...)" if written.op.endswith("_") else f"{name} = {name}.clone()"
        return _inplace_finding(
            ctx, lines, module, op, data,
            fix=f"Fix: write it out of place, {out_of_place} instead of {written.spelled}: a new tensor, and the "
            f"output of {op} that autograd saved stays as it was.",
        )
    return _inplace_finding(ctx, lines, module, op, data)


def _written_after_forward(ctx: _Context, tensor: torch.Tensor) -> SourceWrite | None:
    """The user's local bound to ``tensor`` (or a view of it) and its in-place write in the source."""
    return local_writer(_user_frames_innermost(ctx), lambda t: t is tensor or t._base is tensor)


def _modified_by(ctx: _Context, writes: list[InplaceRecord], lines: list[str]) -> str | None:
    """Append the "Modified by" line for the first of the traced in-place ``writes`` (if any); its source."""
    if not writes:
        return None
    first = writes[0]
    source = _with_line(first.source)
    lines.append(
        f"Modified by: {first.op} in module {ctx.display_module(first.module) or '<outside the model>'}"
        + (f" at {source}" if source else "")
        + (f" (and {len(writes) - 1} more in-place op(s))" if len(writes) > 1 else "")
        + "."
    )
    return source


def _traced_view(
    ctx: _Context, consumer: Any, shape: tuple[int, ...], now: int, expected: int
) -> tuple[OpRecord, list[InplaceRecord]] | None:
    """The traced view ``consumer`` saved (``hs[:, t]``: PyTorch names it AsStrided once its base was written)
    and the traced in-place writes into its base after it was taken (``hs[:, t + 1] = ...``)."""
    tracer = ctx.tracer
    assert tracer is not None
    for child in _children(consumer):
        rec = tracer.record_for(child)
        t = rec.tensor() if rec is not None else None
        if rec is None or t is None or rec.shape != shape or t._base is None or t._version != now:
            continue
        base = t._base
        writes = [
            e for e in tracer.inplace
            if e.version_before >= expected
            and (e.tensor() is base or e.tensor() is t or (e.base is not None and e.base() is base))
        ]
        return rec, writes
    return None


def _inplace_view_traced(
    ctx: _Context, consumer: Any, record: OpRecord, writes: list[InplaceRecord], op: str | None,
    shape: tuple[int, ...], now: int, expected: int, data: dict[str, Any],
) -> Finding:
    module = ctx.display_module(record.module)
    source = _with_line(record.source)
    taken = "indexing, x[idx]" if record.op == "__getitem__" else record.op
    lines = [
        (
            f"backward() failed at step {ctx.step}: {node_op(consumer)} saved a view (shape {list(shape)}, taken by "
            f"{taken}) of a tensor that was then written in place ({_versions_text(now, expected)}); PyTorch "
            f"calls it the output of {op}."
        ),
        f"Where: the view was taken in module {module or '<outside the model>'}" + (f" at {source}" if source else "") + ".",
    ]
    writer = writes[0] if writes else None
    writer_source = _modified_by(ctx, writes, lines)
    data.update(
        module_exact=True,
        source=source,
        view_of_written_tensor=True,
        modified_by=None if writer is None else writer.op,
        modified_in=None if writer is None else ctx.display_module(writer.module),
        modified_at=writer_source,
    )
    fix = None
    if writer is not None and writer.op == func_name(torch.Tensor.__setitem__):
        fix = (
            "Fix: do not fill a preallocated tensor that later steps read from (an RNN's `hs[:, t + 1] = "
            "f(hs[:, t])`): collect the results in a list and stack them (`outs.append(h)`, then "
            "`torch.stack(outs, dim=1)`), or read a copy (`hs[:, t].clone()`)."
        )
    return _inplace_finding(ctx, lines, module, op, data, fix=fix)


def _inplace_untraced(
    ctx: _Context,
    producer: Any,
    consumer: Any,
    op: str | None,
    shape: tuple[int, ...],
    now: int,
    expected: int,
    data: dict[str, Any],
) -> Finding:
    start = producer if producer is not None else consumer
    before = _upstream_param(ctx, start) if start is not None else None
    feeds = _own_param(ctx, consumer) if consumer is not None and consumer is not producer else None
    by_type = _modules_of_type(ctx, op) if op else []
    what = f"the output of {op}" if op else "a saved tensor"
    lines = [
        (
            f"backward() failed at step {ctx.step}: {what} (shape {list(shape)}) was modified by an in-place "
            f"operation after autograd saved it ({_versions_text(now, expected)})."
        )
    ]
    module = None
    where: list[str] = []
    if len(by_type) == 1:
        module = ctx.display_module(by_type[0][0])
        where.append(f"probably module {module} (the only {type(by_type[0][1]).__name__} in the model)")
    if before is not None:
        where.append(
            f"{op or 'the op'} follows module {ctx.display_module(before[1])} (nearest parameters: {before[0]})"
        )
        if module is None:
            module = ctx.display_module(before[1])
    if feeds is not None:
        where.append(f"its output feeds module {ctx.display_module(feeds[1])}")
    # A custom autograd.Function's output is traced only as a module's output (apply() bypasses
    # __torch_function__): one called inside a forward is no evidence of code after the forward.
    custom = isinstance(producer, torch.autograd.function.BackwardCFunction)
    outside = ctx.tracer is not None and ctx.tracer.traced_step and not by_type and not custom
    if where:
        why = (
            "no op of the model's forward, traced on this step, produced it: it probably ran after the forward"
            if outside
            else f"{op} is a custom autograd.Function, not traced inside a forward"
            if custom
            else "the saved tensor is not an op output gradwatch traced"
            if ctx.tracer is not None and ctx.tracer.traced_step
            else "this step was not traced"
        )
        lines.append(f"Where (approximate: {why}): " + "; ".join(where) + ".")
    if outside:
        module = None  # not inside any module: the loss code (or training_step) after the model's output
        lines.append(
            "Probably in the loss code (or training_step): look between the model's forward and backward() for "
            f"an in-place write to the output of {op or 'that op'}: an indexed assignment (`p[:, 0] = 1.0`), an op ending in `_` "
            "(`p.clamp_(...)`), or `+=`/`*=`. Write it out of place: `p = p.clone()` before the assignment, or "
            "`torch.where`/`torch.cat` to build the new tensor."
        )
    elif custom:
        lines.append(
            f"gradwatch names the exact module of a custom autograd.Function when its output is a module's output "
            f"(a module whose forward returns {op}.apply(x)); for an exact trace now, run one step under "
            "torch.autograd.set_detect_anomaly(True)."
        )
    else:
        lines.append(
            "gradwatch names the exact module and the in-place op on the first watched step and while escalated; "
            "for an exact trace now, run one step under torch.autograd.set_detect_anomaly(True)."
        )
    data.update(
        module_exact=False,
        follows=None if before is None else ctx.display_module(before[1]),
        feeds=None if feeds is None else ctx.display_module(feeds[1]),
        same_type_modules=[name for name, _m in by_type],
    )
    return _inplace_finding(ctx, lines, module, op, data)


#: In-place spelling of the ops PyTorch names when they wrote a saved tensor (``x += y`` -> AddBackward0).
_INPLACE_SPELLING = {"Add": "`+=` / add_()", "Sub": "`-=` / sub_()", "Mul": "`*=` / mul_()", "Div": "`/=` / div_()"}


def _inplace_writer(
    ctx: _Context, consumer: Any, op: str, shape: tuple[int, ...], now: int, expected: int, data: dict[str, Any]
) -> Finding:
    """``op`` is the in-place op that wrote a tensor ``consumer`` had saved (its grad_fn now), not its producer.
    A module of the model is named only if it can run ``op`` in place (``inplace=True``): an out-of-place
    nn.ReLU of the same class is not the culprit, and saying so would send the user to the wrong code."""
    classes = _OP_MODULES.get(op, ())
    inplace_in_model = [(n, m) for n, m in _modules_of_type(ctx, op) if getattr(m, "inplace", False) is True]
    foreign = _foreign_inplace_modules(ctx, classes) if classes else []
    traced = ctx.tracer is not None and ctx.tracer.traced_step
    saved_by = node_op(consumer)
    saver = ctx.tracer.record_for(consumer) if traced else None
    fn = re.sub(r"(?<!^)(?=[A-Z])", "_", op).lower()  # LeakyRelu -> leaky_relu
    spelled = _INPLACE_SPELLING.get(op, f"x.{fn}_()")
    if classes:
        spelled = f"nn.{classes[0]}(inplace=True), F.{fn}(x, inplace=True) or {spelled}"
    lines = [
        (
            f"backward() failed at step {ctx.step}: a tensor (shape {list(shape)}) that {saved_by} saved"
            + (f" in module {ctx.display_module(saver.module) or '<outside the model>'}" if saver is not None else "")
            + f" was then overwritten in place by {op} ({spelled}) ({_versions_text(now, expected)})."
        )
    ]
    module = None
    if len(inplace_in_model) == 1 and not traced:
        module = ctx.display_module(inplace_in_model[0][0])
        lines.append(
            f"Where (approximate: this step was not traced): probably module {module} "
            f"(the only {type(inplace_in_model[0][1]).__name__}(inplace=True) in the model)."
        )
    elif foreign:
        lines.append(
            f"Where: {op} ran in place outside the watched model, probably in {names_text(foreign)} "
            "(a module of the loss code or training_step, e.g. a frozen feature extractor of a perceptual loss)."
        )
    elif traced or (classes and not inplace_in_model):
        why = "no op of the model's forward, traced on this step, wrote it" if traced else (
            f"none of the model's {'/'.join(classes)} modules has inplace=True"
        )
        lines.append(
            f"Where: not in a module of the watched model ({why}): probably the loss code or training_step"
            + (f", or a module outside the model (e.g. a loss's feature extractor) that runs {op} in place." if classes else ".")
        )
    data.update(
        module_exact=False,
        modified_by=op,
        modified_in=module,
        outside_model=module is None and (bool(foreign) or traced or bool(classes and not inplace_in_model)),
        foreign_modules=foreign,
    )
    if classes:
        fix = (
            f"Fix: run it out of place: nn.{classes[0]}(inplace=False) (in a pretrained feature extractor such as "
            f"torchvision's VGG `features`, set `m.inplace = False` on its {classes[0]} modules), F.{fn}(x) "
            f"instead of F.{fn}(x, inplace=True) or x.{fn}_()."
        )
    else:
        spelled_out = "`x = x + y`" if op in _INPLACE_SPELLING else "the op without `_`"
        fix = f"Fix: write it out of place ({spelled_out}), or apply it to a copy (`x.clone()`)."
    return _inplace_finding(ctx, lines, module, op, data, fix=fix)


def _foreign_modules(ctx: _Context) -> Iterator[tuple[str, torch.nn.Module]]:
    """(variable name, module) of the modules the watched model does not own among the user's local variables
    (a loss module ``crit``, an EMA ``teacher``) and the modules ``self`` holds, innermost frame first."""
    seen: set[int] = set()
    for frame in reversed(ctx.user_frames()):
        for var, value in list(frame.f_locals.items()):
            holders = [(var, value)]
            if var == "self" and not isinstance(value, torch.nn.Module):
                holders = [(f"self.{k}", v) for k, v in list(vars(value).items())] if hasattr(value, "__dict__") else []
            for label, mod in holders:
                if isinstance(mod, torch.nn.Module) and id(mod) not in seen and ctx.module_name(mod) is None:
                    seen.add(id(mod))
                    yield label, mod


def _foreign_inplace_modules(ctx: _Context, classes: tuple[str, ...], limit: int = 4) -> list[str]:
    """Modules of class ``classes`` with ``inplace=True`` outside the watched model (see ``_foreign_modules``)."""
    out: list[str] = []
    for label, mod in _foreign_modules(ctx):
        for name, sub in mod.named_modules():
            if type(sub).__name__ in classes and getattr(sub, "inplace", False) is True and ctx.module_name(sub) is None:
                out.append(f"{label}.{name}" if name else label)
                if len(out) >= limit:
                    return out
    return out


def _inplace_finding(
    ctx: _Context, lines: list[str], module: str | None, op: str | None, data: dict[str, Any], fix: str | None = None
) -> Finding:
    """The ``inplace_error`` finding: the where-lines given, then why it matters and the usual fixes."""
    lines = [*lines, _WHY_INPLACE, fix or "Fix: make the op that changes it out of place. " + _CULPRITS]
    return Finding(
        kind="inplace_error",
        step=ctx.step,
        severity="error",
        message="\n".join(lines),
        module=module,
        op=op,
        data=data,
    )


def _raising_module(ctx: _Context) -> tuple[str | None, str | None]:
    """(module qualname, user source line) of the innermost watched module whose forward raised."""
    module = None
    for frame in reversed(ctx.frames):
        owner = frame.f_locals.get("self")
        if isinstance(owner, torch.nn.Module):
            name = ctx.module_name(owner)
            if name is not None:
                module = name
                break
    users = ctx.user_frames()
    source = ctx.source_of(users[-1]) if users else None
    return module, source


def _inplace_forward(ctx: _Context, node_name: str | None, index: int | None) -> Finding:
    module, source = _raising_module(ctx)
    shown = ctx.display_module(module)
    text = str(ctx.exc).split("\n")[0]
    params: tuple[str, ...] = ()
    if node_name is not None:
        op = node_op_name(node_name)
        multi = {
            "Split": "split()/chunk()",
            "SplitWithSizes": "split()",
            "Unbind": "unbind() (or iterating over a tensor)",
        }.get(op, f"{op}()")
        lines = [
            (
                f"forward failed at step {ctx.step}: output {index} of {op} — one of several views returned by "
                f"{multi} — was modified in place."
            ),
            f"Where: the forward of module {shown or '<outside the model>'}"
            + (f", at {source}" if source else "")
            + ".",
            (
                "Why it matters: the views share memory with each other and with their base, so autograd cannot "
                "keep the gradient of the other outputs correct; PyTorch refuses rather than compute a wrong one."
            ),
            (
                f"Fix: use the out-of-place op on the view (e.g. `a = a.sigmoid()` instead of `a.sigmoid_()`, "
                f"`a = a * 2` instead of `a *= 2`), or take a copy first (`a = a.clone()`), or apply the op to the "
                f"whole tensor before {multi}."
            ),
        ]
    elif "leaf Variable that requires grad" in text and (made := _made_leaf(ctx)) is not None:
        op = None
        lines = [
            f"an in-place write into `{made}`, a tensor created with requires_grad=True (not a parameter), "
            f"failed at step {ctx.step}: {text}",
            f"Where: {'the forward of module ' + shown if shown else 'outside the model'}"
            + (f", at {source}" if source else "")
            + ".",
            (
                f"Why it matters: `{made}` is a leaf of the graph, so autograd cannot record writes into it; "
                "PyTorch refuses. Wrapping the write in torch.no_grad() would cut everything written into it "
                "out of the graph (the layers before it would get no gradient)."
            ),
            (
                f"Fix: create `{made}` without requires_grad (e.g. torch.zeros(...)): it joins the graph through "
                f"what is written into it; or build it out of place (`{made} = {made} + h` instead of "
                f"`{made} += h`), or collect the pieces in a list and torch.stack / torch.cat them."
            ),
        ]
    elif "leaf Variable that requires grad" in text:
        op = None
        written = _written_param(ctx)
        pname, owner = written if written is not None else (None, None)
        fix = (
            "Fix: run it under `with torch.no_grad():` (e.g. `with torch.no_grad(): p -= lr * p.grad`), or "
            "use the in-place init functions of torch.nn.init, which do that for you."
        )
        if isinstance(owner, torch.nn.Embedding) and owner.padding_idx is None:
            # Zeroing the padding row by hand in every forward: padding_idx does it, and keeps it from training.
            fix = (
                "Fix: to keep a padding row at zero, create the layer with nn.Embedding(..., padding_idx=PAD): "
                "that row starts at zero and gets no gradient, so it stays zero; to write it once instead, do it "
                "under `with torch.no_grad():` at initialization, not in forward."
            )
        elif "clamp_" in (source or ""):
            fix = (
                "Fix: clip the weights under torch.no_grad() (WGAN weight clipping: `with torch.no_grad(): for p "
                "in critic.parameters(): p.clamp_(-c, c)`), after optimizer.step()."
            )
        lines = [
            (
                f"an in-place change of {'parameter ' + pname if pname else 'a leaf tensor that requires grad (a parameter)'} "
                f"failed at step {ctx.step}: {text}"
            ),
            f"Where: {'the forward of module ' + shown if shown else 'outside the model'}"
            + (f", at {source}" if source else "")
            + ".",
            (
                "Why it matters: with gradient tracking on, an in-place write to a parameter would become part of "
                "the graph; PyTorch refuses. A hand-written update (`p -= lr * p.grad`) or a weight "
                "initialization must not be recorded."
            ),
            fix,
        ]
        if pname is not None:
            params = (pname,)
    else:
        op = None
        lines = [
            f"forward failed at step {ctx.step}: {text}",
            f"Where: the forward of module {shown or '<outside the model>'}"
            + (f", at {source}" if source else "")
            + ".",
            (
                "Why it matters: autograd cannot track an in-place change of a tensor that requires grad here; "
                "PyTorch refuses rather than compute a wrong gradient."
            ),
            (
                "Fix: use the out-of-place op (`x = x + y` instead of `x += y`), clone first (`x = x.clone()`), or "
                "make the change under `with torch.no_grad():` if it must not be differentiated (e.g. initializing "
                "weights)."
            ),
        ]
    return Finding(
        kind="inplace_error",
        step=ctx.step,
        severity="error",
        message="\n".join(lines),
        params=params,
        module=shown,
        op=op,
        data={"phase": "forward", "source": source, "module_exact": module is not None},
    )


def _written_param(ctx: _Context) -> tuple[str, Any] | None:
    """(name, owning module) of the model parameter the raising line writes: a local variable named on that
    line (``p.clamp_(...)`` in a loop over parameters), or an attribute path of one
    (``self.embedding.weight[0] = 0``), innermost frame of the user's code."""
    frame = next((f for f in reversed(ctx.frames) if not library_frame(f)), None)
    if frame is None:
        return None
    line = linecache.getline(frame.f_code.co_filename, ctx.lines.get(id(frame), frame.f_lineno))
    local = frame.f_locals
    for chain in re.findall(r"\b([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)", line):
        head, *attrs = chain.split(".")
        if head not in local:
            continue
        obj, owner = local[head], None
        for a in attrs:
            if isinstance(obj, torch.Tensor):
                break
            owner, obj = obj, getattr(obj, a, None) if isinstance(obj, torch.nn.Module) else None
        if isinstance(obj, torch.Tensor) and obj._base is not None:
            obj = obj._base  # a row or slice of the parameter
        name = ctx.index.param_name.get(id(obj)) if isinstance(obj, torch.Tensor) else None
        if name is not None:
            if not isinstance(owner, torch.nn.Module) and ctx.model is not None:
                owner = next((m for m in ctx.model.modules() if any(p is obj for p in m.parameters(recurse=False))), None)
            return name, owner
    return None


def _made_leaf(ctx: _Context) -> str | None:
    """The local variable of the raising line that is a leaf tensor with requires_grad=True but not an
    ``nn.Parameter`` (``pooled = torch.zeros(B, 8, requires_grad=True); pooled += h``), from the innermost
    frame of the user's code."""
    for frame in reversed(ctx.frames):
        if library_frame(frame):
            continue
        line = linecache.getline(frame.f_code.co_filename, ctx.lines.get(id(frame), frame.f_lineno))
        for name, v in list(frame.f_locals.items()):
            if (
                isinstance(v, torch.Tensor) and not isinstance(v, torch.nn.Parameter) and v.is_leaf
                and v.requires_grad and re.search(rf"\b{re.escape(name)}\b", line)
            ):
                return name
        return None
    return None


# -- backward_twice --------------------------------------------------------------------------------
def _backward_twice(ctx: _Context) -> Finding:
    roots = ctx.roots()
    seq = ctx.tracer.step_seq if ctx.tracer is not None else None
    old_edges: list[tuple[Any, Any, int]] = []  # (newer consumer, older node, depth of consumer)
    if roots and seq is not None:
        for node, depth in _walk(roots):
            own = _seq(node)
            if own is None or own < seq:
                continue
            for child in _children(node):
                s = _seq(child)
                if s is not None and s < seq:
                    old_edges.append((node, child, depth))
            if len(old_edges) >= 16:
                break
    data: dict[str, Any] = {"earlier_step_nodes": len(old_edges)}
    lines = [
        (
            f"backward() failed at step {ctx.step}: it reached part of an autograd graph whose saved tensors were "
            "already freed by an earlier backward()."
        ),
        (
            "Why it matters: backward() frees the intermediate values of the graph it went through (unless "
            "retain_graph=True), so a second backward through the same ops cannot compute their gradients."
        ),
    ]
    module = None
    prev = ctx.tracer.prev_step_seq if ctx.tracer is not None else None
    several = len(getattr(ctx.engine, "optimizers", ()) or ()) > 1
    if old_edges and several and all((_seq(o) or -1) >= (prev or 0) for _c, o, _d in old_edges):
        # Built after the check before the last one: in this iteration, before another optimizer's step.
        consumer, old, _depth = old_edges[0]
        old_module = _upstream_param(ctx, old)
        module = ctx.display_module(old_module[1]) if old_module else None
        through = f" (from module {module})" if module else ""
        lines.insert(
            1,
            f"Cause: this backward() reached a part of the graph{through} that an earlier backward() of this "
            "same iteration, before another optimizer's step(), already went through and freed. With several "
            "optimizers this is typically a GAN whose discriminator loss uses the generator's output without "
            ".detach(): lossD.backward() backpropagates into the generator and frees its graph, then the "
            f"generator's loss needs that graph again (it enters at {consumer.name()}).",
        )
        data.update(cause="freed_by_other_optimizer", enters_at=consumer.name())
        fix = (
            "Fix: build the discriminator's loss on the detached sample, `D(fake.detach())`, and keep `D(fake)` "
            "for the generator's loss: lossD.backward() then stops at the sample and no longer writes gradients "
            "into the generator either. If both losses must go through that part, call the first backward() "
            "with retain_graph=True."
        )
    elif old_edges:
        consumer, old, depth = old_edges[0]
        old_module = _upstream_param(ctx, old)
        # The old graph enters through the loss's own arithmetic (`acc = acc + loss / k`, k adds deep when
        # one backward runs every k batches), not through an op of the forward: a running total.
        at_loss = depth <= 1 or any(consumer is n for n in _loss_spine(roots))
        if at_loss:
            cause = (
                "the loss itself is built from a tensor kept from an earlier step — typically a running total "
                "(`total_loss = total_loss + loss`, then `total_loss.backward()`, or logging `total += loss` "
                "without .item())"
            )
        else:
            cause = (
                "a tensor produced at an earlier step is fed into this step's forward with its graph attached — "
                "typically an RNN hidden state (or a cached/memory tensor) carried across steps without .detach(), "
                "or a tensor computed once from parameters before the loop (`w = F.normalize(self.protos)` "
                "outside the loop)"
            )
        where = (
            f" It enters this step's graph at {consumer.name()}"
            + (f"; the earlier graph comes from module {ctx.display_module(old_module[1])}" if old_module else "")
            + "."
        )
        states = [] if at_loss else _graph_state_attrs(ctx)
        if states:
            cause = (
                f"modules keep a tensor from an earlier step with its graph attached as an attribute: "
                f"{names_text(states)} (a recurrent or spiking neuron's state carried across iterations)"
            )
        lines.insert(1, f"Cause: {cause}.{where}")
        module = ctx.display_module(old_module[1]) if old_module else None
        if states:
            module = ctx.display_module(states[0].rpartition(".")[0])
        data.update(cause="running_total" if at_loss else "carried_state", enters_at=consumer.name())
        if states:
            data.update(state_attributes=states)
        if at_loss:
            total = _local_name(ctx, roots[0]) or "acc_loss"
            data.update(total=_local_name(ctx, roots[0]))
            fix = (
                f"Fix: start the total afresh after each backward() (`{total} = 0` right after "
                f"`{total}.backward()`, when micro-batch losses are summed for one backward per window); if "
                "the total is only for logging, call backward() on this step's loss and accumulate it without "
                "its graph: `total += loss.item()` (or `loss.detach()`)."
            )
        elif states:
            attr = states[0].rpartition(".")[2]
            fix = (
                f"Fix: reset that state at the start of every iteration (or batch), or cut its graph: "
                f"`self.{attr} = self.{attr}.detach()` after the step (for snnTorch neurons: "
                "snntorch.utils.reset(net), or mem = lif.init_leaky() at the start of forward)."
            )
        else:
            fix = (
                "Fix: cut the graph between steps: `hidden = hidden.detach()` (for an LSTM "
                "`h, c = h.detach(), c.detach()`) before feeding it to the next step (truncated "
                "backpropagation through time). A tensor derived from parameters that must keep training "
                "(computed once before the loop) must not be detached: recompute it inside the loop, every step."
            )
        fix += (
            " retain_graph=True on the earlier backward() would silence the error, but it keeps every earlier "
            "step's graph in memory and backpropagates through all of them again: almost never what you want."
        )
    else:
        lines.insert(
            1,
            "Cause: backward() ran twice through the same graph within this step — e.g. calling loss.backward() "
            "twice, or backward on two losses that share part of the model (both go through the shared layers).",
        )
        data.update(cause="same_step")
        fix = (
            "Fix: add the losses and call backward() once (`(loss_a + loss_b).backward()`), or pass "
            "retain_graph=True to every backward() but the last one that goes through the shared part. Also "
            "check for tensors kept across steps without .detach() (RNN hidden state, running totals)."
        )
        if _lightning_backward(ctx):
            data.update(cause="backward_in_training_step")
            lines[1] = (
                "Cause: Lightning's automatic optimization ran backward() on the loss training_step returned, "
                "after training_step had already called loss.backward() on it."
            )
            fix = (
                "Fix: remove loss.backward() from training_step: Lightning backpropagates the loss it returns "
                "(retain_graph=True would silence the error and double every gradient). To run backward "
                "yourself, set self.automatic_optimization = False and call self.manual_backward(loss) and "
                "the optimizer's step in training_step."
            )
    lines.append(fix)
    return Finding(
        kind="backward_twice",
        step=ctx.step,
        severity="error",
        message="\n".join(lines),
        module=module,
        data=data,
    )


#: Arithmetic a loss is combined with (sums of losses, scaling by 1/k).
_LOSS_ARITHMETIC = frozenset({"Add", "Sub", "Rsub", "Mul", "Div", "Neg"})


def _loss_spine(roots: list[torch.Tensor], limit: int = 1000) -> list[Any]:
    """The nodes of the arithmetic the loss ends with (``((acc + l1 / k) + l2 / k) + ...``), from the roots
    down to the first op that is not +, -, * or / (a loss function, the model's output)."""
    out: list[Any] = []
    stack = [r.grad_fn for r in roots if r.grad_fn is not None]
    while stack and len(out) < limit:
        node = stack.pop()
        if node_op(node) not in _LOSS_ARITHMETIC or any(node is n for n in out):
            continue
        out.append(node)
        stack.extend(_children(node))
    return out


def _graph_state_attrs(ctx: _Context, limit: int = 8) -> list[str]:
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


def _lightning_backward(ctx: _Context) -> bool:
    """The failing backward() is Lightning's own (automatic optimization), not one in the user's code."""
    if ctx.tracer is None or ctx.tracer.integration != "lightning":
        return False
    for frame in reversed(ctx.frames):  # innermost first: the frame that called backward()
        if library_frame(frame):
            continue
        return str(frame.f_globals.get("__name__", "")).startswith(("lightning.", "pytorch_lightning."))
    return False


def _seq(node: Any) -> int | None:
    fn = getattr(node, "_sequence_nr", None)
    if fn is None or hasattr(node, "variable"):
        return None
    try:
        return int(fn())
    except Exception:  # noqa: BLE001
        return None


# -- no_grad_graph ---------------------------------------------------------------------------------
def _stepping_optimizer(ctx: _Context) -> torch.optim.Optimizer | None:
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


def _no_grad_graph(ctx: _Context) -> Finding:
    roots = ctx.roots()
    model = ctx.model
    trainable = [p for p in model.parameters() if p.requires_grad] if model is not None else []
    loss = roots[0] if roots else None
    causes: list[str] = []
    cause_key = "unknown"
    if model is not None and not trainable:
        cause_key = "all_frozen"
        causes.append(
            f"every parameter of the model ({type(model).__name__}) has requires_grad=False, so nothing in "
            "the loss depends on a trainable tensor. Unfreeze the layers you mean to train "
            "(`module.requires_grad_(True)`), e.g. after loading a checkpoint or a frozen backbone."
        )
    elif loss is not None and loss.is_inference():
        cause_key = "inference_mode"
        causes.append(
            "the loss is an inference tensor: it was computed under torch.inference_mode(). Compute the "
            "training forward and loss outside that block."
        )
    elif not torch.is_grad_enabled():
        cause_key = "no_grad_backward"
        causes.append(
            "backward() was called with gradient tracking disabled (inside torch.no_grad() or "
            "torch.set_grad_enabled(False)). Move the forward, loss and backward out of that block."
        )
    elif ctx.tracer is not None and ctx.tracer.last_forward_grad_enabled is False and _stepping_optimizer(ctx):
        cause_key = "closure_under_no_grad"
        opt = _stepping_optimizer(ctx)
        causes.append(
            f"the closure ran inside {type(opt).__name__}.step(), which runs under torch.no_grad() "
            "(@torch.no_grad() on a custom optimizer's step), so the forward in the closure built no graph. "
            "Wrap the closure's body in `with torch.enable_grad():` (torch's LBFGS does that around its "
            "closure call: `with torch.enable_grad(): loss = closure()`), in the closure or in step()."
        )
    elif ctx.tracer is not None and ctx.tracer.last_forward_grad_enabled is False:
        cause_key = "forward_under_no_grad"
        causes.append(
            "the model's forward ran under torch.no_grad() (or with grad disabled), so its output has no graph. "
            "Run the training forward with gradients enabled (a no_grad block or @torch.no_grad meant for "
            "evaluation is around it)."
        )
    else:
        connected = _graph_locals(ctx, exclude=loss)
        named = model.named_parameters() if model is not None else ()
        frozen = [ctx.index.param_name.get(id(p), n) for n, p in named if not p.requires_grad]
        if frozen and not connected:
            # Nothing in the user's code has a graph and part of the model is frozen: the loss path runs
            # through frozen layers only (a detach would leave the model's output with a graph).
            cause_key = "frozen_path"
            causes.append(
                f"the layers the loss goes through are frozen: {len(frozen)} of {len(frozen) + len(trainable)} "
                f"parameters have requires_grad=False ({names_text(frozen)}), and nothing in the forward has "
                "a graph. Unfreeze the layers you mean to train (`module.requires_grad_(True)`); if they are "
                "meant to stay frozen, the loss must depend on a trainable parameter. (If the loss path is "
                "trainable after all, the graph was cut between the output and the loss: `.detach()`, "
                "`.item()`, `.data`.)"
            )
        elif frozen and connected:
            # Both fit: the loss took a frozen part's output (a probe's backbone features instead of the
            # head's), or the trainable output's graph was cut on the way to the loss.
            cause_key = "frozen_or_detached"
            it = "it" if len(connected) == 1 else "them"
            causes.append(
                f"the loss does not depend on {names_text(connected)}, which still "
                f"{'has' if len(connected) == 1 else 'have'} a graph. Either it was computed from the output of "
                f"a frozen part of the model ({len(frozen)} of {len(frozen) + len(trainable)} parameters have "
                f"requires_grad=False: {names_text(frozen)}), e.g. the backbone's features instead of the "
                f"trainable head's output: compute the loss from {it}; or the graph was cut between {it} and "
                "the loss: `.detach()`, `.item()`/`.tolist()` followed by torch.tensor(...), `.data`, or a "
                "torch.no_grad() block around the loss computation."
            )
    if cause_key == "unknown":
        cause_key = "detached"
        hint = ""
        if connected:
            hint = (
                f" In your code, {names_text(connected)} still "
                f"{'has' if len(connected) == 1 else 'have'} a graph, so the cut is between "
                f"{'it' if len(connected) == 1 else 'them'} and the loss."
            )
        causes.append(
            "the model's forward ran with gradients, so the graph was cut between the output and the loss: "
            "`.detach()`, `.item()`/`.tolist()`/`.numpy()` followed by torch.tensor(...), `.data`, a "
            "torch.no_grad() block around the loss computation, or an op without a gradient: argmax/argmin, "
            "a comparison (`==`, `!=`, `>`), round/floor, a cast to an integer or bool (`.long()`), "
            "a count such as `(pred == y).float().mean()`." + hint + " Compute the loss from the model output "
            "with differentiable torch ops (for accuracy-like objectives, a surrogate: cross_entropy on the "
            "logits, or softmax probabilities instead of argmax)."
        )
    shape = list(loss.shape) if loss is not None else None
    lines = [
        (
            f"backward() failed at step {ctx.step}: the loss has no autograd graph (requires_grad=False, no "
            "grad_fn), so there is nothing to differentiate."
        ),
        "Cause: " + causes[0],
        "Why it matters: no gradient can reach the parameters; nothing would be learned.",
    ]
    return Finding(
        kind="no_grad_graph",
        step=ctx.step,
        severity="error",
        message="\n".join(lines),
        data={"cause": cause_key, "loss_shape": shape, "trainable_params": len(trainable)},
    )


def _local_name(ctx: _Context, tensor: torch.Tensor) -> str | None:
    """The name of a local variable of the user's code that holds ``tensor`` (innermost frame first)."""
    for frame in reversed(ctx.user_frames()):
        for k, v in list(frame.f_locals.items()):
            if v is tensor:
                return k
    return None


def _graph_locals(ctx: _Context, exclude: Any) -> list[str]:
    names: list[str] = []
    for frame in reversed(ctx.user_frames()):
        for k, v in frame.f_locals.items():
            if isinstance(v, torch.Tensor) and v is not exclude and v.grad_fn is not None and k not in names:
                names.append(f"`{k}`")
        if names:
            break
    return names


# -- nonscalar_backward ----------------------------------------------------------------------------
def _nonscalar(ctx: _Context) -> Finding:
    roots = ctx.roots()
    loss = roots[0] if roots else None
    shape = list(loss.shape) if loss is not None else None
    grad_fn = loss.grad_fn if loss is not None else None
    node = grad_fn.name() if grad_fn is not None else None
    module = None
    reduced = None
    loss_op = None
    if loss is not None and loss.grad_fn is not None:
        # Down a short chain of single-input ops (Lightning divides by accumulate_grad_batches, a loss
        # may be scaled): is this the unreduced output of a module?
        n: Any = loss.grad_fn
        for _ in range(4):
            if node_op(n) in _REDUCTIONS:
                reduced = node_op(n)
            if loss_op is None and "Loss" in node_op(n):
                loss_op = node_op(n)  # a loss function called with reduction='none'
            own = _own_param(ctx, n)
            if own is not None:
                module = ctx.display_module(own[1])
                break
            inner = [c for c in _children(n) if not hasattr(c, "variable")]
            if len(inner) != 1 or _children(n) != inner:
                break
            n = inner[0]
    exact_chain = module is not None
    if module is None and loss is not None and loss.grad_fn is not None:
        # Not a short chain (a Dice loss's ratio of sums, a critic's D(fake) - D(real)): the nearest model
        # parameters name the module it is computed from, and a reduction met on the way (breadth-first,
        # before that module's op) is one over some dimensions only.
        found = None
        for n, _depth in _walk([loss]):
            own = _own_param(ctx, n)
            if own is not None:
                found = own
                break
            if reduced is None and node_op(n) in _REDUCTIONS:
                reduced = node_op(n)
            if loss_op is None and "Loss" in node_op(n):
                loss_op = node_op(n)
        if found is not None:
            module = ctx.display_module(found[1])
    shape_text = f" of shape {shape}" if shape is not None else ""
    origin = ""
    if module is not None and not exact_chain:
        origin = f" It is computed (through {node_op(loss.grad_fn)}) from the output of module {module}" + (
            f", reduced ({reduced}) over some dimensions but not all of them (e.g. .sum(dim=1) per sample)."
            if reduced is not None
            else (f", through {loss_op} called with reduction='none'." if loss_op is not None else ", with no reduction to a single number.")
        )
    elif module is not None and reduced is not None:
        origin = (
            f" It comes from the output of module {module}, reduced ({reduced}) over some dimensions but not "
            "all of them (e.g. .mean(dim=1))."
        )
    elif module is not None and loss_op is not None:
        origin = (
            f" It is the per-element output of {loss_op} (a loss function called with reduction='none') on the "
            f"output of module {module}."
        )
    elif module is not None:
        origin = f" It comes straight from the output of module {module}, with no reduction in between."
    elif grad_fn is not None:
        origin = f" It is the output of {node_op(grad_fn)}."
    # The line that called backward(), if the user's code called it (not Lightning's automatic optimization).
    caller = next((f for f in reversed(ctx.frames) if not library_frame(f)), None)
    source = ctx.source_of(caller) if caller is not None and _is_user_file(caller.f_code.co_filename) else None
    name = _local_name(ctx, loss) if loss is not None else None
    lines = [
        f"backward() failed at step {ctx.step}: it was called on a tensor{shape_text}, not a scalar, and without "
        "a gradient argument." + origin,
        *(
            [f"Where: backward() on {'`' + name + '`' if name else 'it'} at {source}."]
            if source
            else []
        ),
        (
            "Why it matters: backward() without arguments needs one number to differentiate; for a tensor it would "
            "need the gradient of something with respect to each element."
        ),
        (
            f"Fix: reduce it to the loss you mean — `{name or 'loss'}.mean()` or `{name or 'loss'}.sum()` (a loss function with "
            "reduction='none' returns one value per element) — or pass the gradient explicitly: "
            "`out.backward(gradient=torch.ones_like(out))`."
        ),
    ]
    return Finding(
        kind="nonscalar_backward",
        step=ctx.step,
        severity="error",
        message="\n".join(lines),
        module=module,
        op=None if grad_fn is None else node_op(grad_fn),
        data={"shape": shape, "node": node, "source": source, "module_exact": exact_chain},
    )
