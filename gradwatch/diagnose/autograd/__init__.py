"""Explain autograd errors: in-place modification, backward twice, no grad_fn, non-scalar backward (and two
errors of the training loop's set-up PyTorch raises alike: DDP's unfinished reduction, a GradScaler updated with
no inf checks recorded).

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

One module per family of errors, each computing a small facts object and wording it from a table keyed by
cause: :mod:`~gradwatch.diagnose.autograd.inplace` (and ``inplace_traced``, ``inplace_forward``),
:mod:`~gradwatch.diagnose.autograd.backward_twice`, :mod:`~gradwatch.diagnose.autograd.no_grad_fn`,
:mod:`~gradwatch.diagnose.autograd.nonscalar`, :mod:`~gradwatch.diagnose.autograd.anomaly`; what they share
(the exception's frames, the graph walks) is in :mod:`~gradwatch.diagnose.autograd.context`.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from gradwatch.core.findings import Finding
from gradwatch.diagnose.autograd.anomaly import explain_anomaly_nan
from gradwatch.diagnose.autograd.backward_twice import explain_backward_twice
from gradwatch.diagnose.autograd.context import MAX_NODES, Context, node_op_name
from gradwatch.diagnose.autograd.inplace import explain_inplace_backward
from gradwatch.diagnose.autograd.inplace_forward import explain_inplace_forward
from gradwatch.diagnose.autograd.no_grad_fn import explain_no_graph
from gradwatch.diagnose.autograd.nonscalar import explain_nonscalar
from gradwatch.observe.ddp_reduction import ERROR_TEXT, raised_facts, unused_finding
from gradwatch.observe.scaler_bypass import NO_INF_CHECKS, explain_no_inf_checks
from gradwatch.observe.tracing import ForwardTracer

__all__ = ["ERRORS", "MAX_NODES", "explain", "node_op_name"]

_INPLACE_BACKWARD = re.compile(
    r"modified by an inplace operation: \[(?P<type>[^\s\]]+) \[(?P<shape>[\d, ]*)\]\]"
    r"(?:, which is output (?P<index>\d+) of (?P<op>[\w:]+),)? is at version (?P<now>\d+); "
    r"expected version (?P<expected>\d+) instead"
)
_VIEW_INPLACE = re.compile(r"Output (?P<index>\d+) of (?P<op>[\w:]+) is a view and is being modified inplace")
_FORWARD_INPLACE = re.compile(
    "|".join(
        re.escape(s)
        for s in (
            "a leaf Variable that requires grad is being used in an in-place operation",
            "A view was created in no_grad mode and is being modified inplace",
            "is a view of a leaf Variable that requires grad and is being used in an in-place operation",
            "a view of a leaf Variable that requires grad is being used in an in-place operation",
        )
    )
)
_ANOMALY_NAN = re.compile(r"Function '(?P<op>\w+)' returned nan values in its (?P<index>\d+)\w* output")

#: PyTorch's error messages -> their explainer, the first that matches speaks.
ERRORS: tuple[tuple[re.Pattern[str], Callable[[Context, re.Match[str]], Finding | None]], ...] = (
    (_INPLACE_BACKWARD, explain_inplace_backward),
    (_VIEW_INPLACE, lambda ctx, m: explain_inplace_forward(ctx, m.group("op"), int(m.group("index")))),
    (_FORWARD_INPLACE, lambda ctx, m: explain_inplace_forward(ctx, None, None)),
    (re.compile(re.escape("Trying to backward through the graph a second time")),
     lambda ctx, m: explain_backward_twice(ctx)),
    (re.compile(re.escape("does not require grad and does not have a grad_fn")), lambda ctx, m: explain_no_graph(ctx)),
    (re.compile(re.escape("grad can be implicitly created only for")), lambda ctx, m: explain_nonscalar(ctx)),
    (_ANOMALY_NAN, lambda ctx, m: explain_anomaly_nan(ctx, m.group("op"), int(m.group("index")))),
    (re.compile(re.escape(ERROR_TEXT)), lambda ctx, m: _ddp_unused(ctx)),
    (re.compile(re.escape(NO_INF_CHECKS)), lambda ctx, m: explain_no_inf_checks(ctx.exc, ctx.engine)),
)


def _ddp_unused(ctx: Context) -> Finding | None:
    facts = raised_facts(ctx.exc, ctx.step)
    return unused_finding(facts) if facts is not None else None


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
    if not isinstance(exc, (RuntimeError, AssertionError)):  # GradScaler.update() asserts
        return None
    tracer = engine.extension(ForwardTracer) if hasattr(engine, "extension") else None
    if tracer is not None:
        tracer.end_trace()  # an exception unwound past a traced forward
    ctx = Context(exc, engine, step, tracer)
    text = str(exc)
    for pattern, explainer in ERRORS:
        m = pattern.search(text)
        if m:
            return explainer(ctx, m)
    return None
