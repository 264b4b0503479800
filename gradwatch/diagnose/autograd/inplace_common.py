"""What the explainers of ``inplace_error`` at backward share: the error's facts and the words every one ends with."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from gradwatch.core.findings import Explanation, Finding
from gradwatch.diagnose.autograd.context import Context, node_op_name, versions_text, with_line
from gradwatch.observe.tracing import InplaceRecord

WHY_INPLACE = (
    "autograd saved that tensor during forward to compute a gradient; once it is changed in "
    "place the gradient would be wrong, so PyTorch refuses. Nothing was updated by this backward."
)

CULPRITS = (
    "Usual culprits: nn.ReLU(inplace=True) or F.relu(x, inplace=True) (use inplace=False); `x += y`, `x *= y` "
    "(write `x = x + y`); `x[idx] = v` on a tensor autograd saved (build a new tensor: torch.where, "
    "torch.cat, x.clone() first); torch.sigmoid_(x) / x.sigmoid_() and other ops ending in `_` (use the "
    "out-of-place op)."
)

#: Ops whose output is a view of their input: a saved view of a parameter or buffer is that tensor.
VIEW_OPS = ("AsStrided", "T", "Transpose", "View", "Permute", "Expand")


@dataclass(frozen=True)
class InplaceError:
    """What PyTorch's message says: the saved tensor's type and shape, the op it names, the versions."""

    tensor_type: str
    shape: tuple[int, ...]
    shape_text: str  # "[8, 4]", as in the message
    now: int
    expected: int
    raw_op: str | None = None  # "SigmoidBackward0", if the message names one
    op: str | None = None  # "Sigmoid"

    @property
    def versions(self) -> str:
        return versions_text(self.now, self.expected)

    @property
    def of_a_leaf_or_view(self) -> bool:
        """The message names no op, or a view op: the tensor may be a leaf (a parameter, a buffer) or a view of one."""
        return self.raw_op is None or self.op in VIEW_OPS


def parse_inplace_error(m: re.Match[str]) -> InplaceError:
    raw_op = m.group("op")
    return InplaceError(
        tensor_type=m.group("type"),
        shape=tuple(int(s) for s in m.group("shape").replace(" ", "").split(",") if s),
        shape_text="[" + m.group("shape") + "]",
        now=int(m.group("now")),
        expected=int(m.group("expected")),
        raw_op=raw_op,
        op=node_op_name(raw_op) if raw_op else None,
    )


def traced_writes(ctx: Context, tensor: torch.Tensor) -> list[InplaceRecord]:
    """Traced in-place ops of this step's forward on ``tensor`` (itself or a view of it)."""
    tracer = ctx.tracer
    if tracer is None or not tracer.traced_step:
        return []
    return [r for r in tracer.inplace if r.tensor() is tensor or (r.base is not None and r.base() is tensor)]


def modified_by_line(ctx: Context, writes: list[InplaceRecord]) -> str:
    """The "Modified by" line for the first of the traced in-place ``writes``."""
    first = writes[0]
    source = with_line(first.source)
    return (
        f"Modified by: {first.op} in module {ctx.display_module(first.module) or '<outside the model>'}"
        + (f" at {source}" if source else "")
        + (f" (and {len(writes) - 1} more in-place op(s))" if len(writes) > 1 else "")
        + "."
    )


def saver_op(data: dict[str, Any], fallback: str | None = None) -> str | None:
    """A finding's ``op`` when its words name the backward node that saved the changed tensor (``data["consumer"]``,
    e.g. ``"AddmmBackward0"``): that node, not the view PyTorch's message names (``AsStrided``, ``T``), so ``op``
    and the message agree; ``fallback`` when the node was not found."""
    return data.get("consumer") or fallback


def inplace_finding(
    ctx: Context, lines: list[str], module: str | None, op: str | None, data: dict[str, Any], fix: str | None = None,
    params: tuple[str, ...] = (),
) -> Finding:
    """The ``inplace_error`` finding: the what-lines given, then why it matters and the fix (the usual
    culprits when none is given)."""
    return Finding(
        kind="inplace_error",
        step=ctx.step,
        severity="error",
        explanation=Explanation("\n".join(lines), why=WHY_INPLACE, fix=fix or "make the op that changes it out of place. " + CULPRITS),
        params=params,
        module=module,
        op=op,
        data=data,
    )


def foreign_modules(ctx: Context) -> Iterator[tuple[str, torch.nn.Module]]:
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
