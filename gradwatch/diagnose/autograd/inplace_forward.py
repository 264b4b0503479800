"""``inplace_error`` raised during forward: PyTorch refused an in-place op as it ran.

Four cases, each a row of :data:`FORWARD_CASES`: an output of a multi-output view op (split, chunk, unbind)
written in place; a tensor the user created with requires_grad=True written in place; a parameter (or
another leaf that requires grad) written in place with gradient tracking on, whose fix depends on what the
write was for (:data:`LEAF_FIXES`); any other in-place write autograd cannot track.
"""

from __future__ import annotations

import linecache
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from gradwatch.core.findings import Explanation, Finding
from gradwatch.diagnose.autograd.context import Context, node_op_name
from gradwatch.observe.tracing import library_frame

#: Multi-output view ops -> how the user calls them.
MULTI_OUTPUT_CALLS = {
    "Split": "split()/chunk()",
    "SplitWithSizes": "split()",
    "Unbind": "unbind() (or iterating over a tensor)",
}
_LEAF = "leaf Variable that requires grad"


@dataclass(frozen=True)
class ForwardInplaceFacts:
    """Where the in-place write was refused, and what it wrote."""

    step: int
    case: str  # a key of FORWARD_CASES
    text: str  # the first line of PyTorch's message
    module: str | None = None  # the watched module whose forward raised (as shown to the user)
    source: str | None = None  # the user's line that raised
    op: str | None = None  # the multi-output view op
    index: int | None = None  # which of its outputs was written
    made: str | None = None  # the user's leaf tensor created with requires_grad=True
    param: str | None = None  # the parameter written
    leaf_fix: str = "no_grad"  # a key of LEAF_FIXES


@dataclass(frozen=True)
class ForwardWords:
    what: Callable[[ForwardInplaceFacts], str]
    why: Callable[[ForwardInplaceFacts], str]
    fix: Callable[[ForwardInplaceFacts], str]
    #: "Where:" names the module with "the forward of module X" or "outside the model" (else "<outside the model>").
    outside_words: bool = False


def _where(f: ForwardInplaceFacts, outside_words: bool) -> str:
    if outside_words:
        place = "the forward of module " + f.module if f.module else "outside the model"
    else:
        place = f"the forward of module {f.module or '<outside the model>'}"
    return f"Where: {place}" + (f", at {f.source}" if f.source else "") + "."


def _multi(f: ForwardInplaceFacts) -> str:
    return MULTI_OUTPUT_CALLS.get(f.op or "", f"{f.op}()")


#: Why a parameter was written in place -> the fix.
LEAF_FIXES: dict[str, str] = {
    "no_grad": (
        "run it under `with torch.no_grad():` (e.g. `with torch.no_grad(): p -= lr * p.grad`), or "
        "use the in-place init functions of torch.nn.init, which do that for you."
    ),
    # Zeroing the padding row by hand in every forward: padding_idx does it, and keeps it from training.
    "embedding_padding": (
        "to keep a padding row at zero, create the layer with nn.Embedding(..., padding_idx=PAD): "
        "that row starts at zero and gets no gradient, so it stays zero; to write it once instead, do it "
        "under `with torch.no_grad():` at initialization, not in forward."
    ),
    "weight_clipping": (
        "clip the weights under torch.no_grad() (WGAN weight clipping: `with torch.no_grad(): for p "
        "in critic.parameters(): p.clamp_(-c, c)`), after optimizer.step()."
    ),
}


def leaf_fix(owner: Any, source: str | None) -> str:
    """Which fix of :data:`LEAF_FIXES` suits a write into a parameter of ``owner`` at ``source``."""
    if isinstance(owner, torch.nn.Embedding) and owner.padding_idx is None:
        return "embedding_padding"
    return "weight_clipping" if "clamp_" in (source or "") else "no_grad"


#: Case -> its words.
FORWARD_CASES: dict[str, ForwardWords] = {
    "multi_output_view": ForwardWords(
        what=lambda f: (
            f"forward failed at step {f.step}: output {f.index} of {f.op} — one of several views returned by "
            f"{_multi(f)} — was modified in place."
        ),
        why=lambda f: (
            "the views share memory with each other and with their base, so autograd cannot "
            "keep the gradient of the other outputs correct; PyTorch refuses rather than compute a wrong one."
        ),
        fix=lambda f: (
            f"use the out-of-place op on the view (e.g. `a = a.sigmoid()` instead of `a.sigmoid_()`, "
            f"`a = a * 2` instead of `a *= 2`), or take a copy first (`a = a.clone()`), or apply the op to the "
            f"whole tensor before {_multi(f)}."
        ),
    ),
    "created_leaf": ForwardWords(
        what=lambda f: (
            f"an in-place write into `{f.made}`, a tensor created with requires_grad=True (not a parameter), "
            f"failed at step {f.step}: {f.text}"
        ),
        why=lambda f: (
            f"`{f.made}` is a leaf of the graph, so autograd cannot record writes into it; "
            "PyTorch refuses. Wrapping the write in torch.no_grad() would cut everything written into it "
            "out of the graph (the layers before it would get no gradient)."
        ),
        fix=lambda f: (
            f"create `{f.made}` without requires_grad (e.g. torch.zeros(...)): it joins the graph through "
            f"what is written into it; or build it out of place (`{f.made} = {f.made} + h` instead of "
            f"`{f.made} += h`), or collect the pieces in a list and torch.stack / torch.cat them."
        ),
        outside_words=True,
    ),
    "leaf_param": ForwardWords(
        what=lambda f: (
            f"an in-place change of {'parameter ' + f.param if f.param else 'a leaf tensor that requires grad (a parameter)'} "
            f"failed at step {f.step}: {f.text}"
        ),
        why=lambda f: (
            "with gradient tracking on, an in-place write to a parameter would become part of "
            "the graph; PyTorch refuses. A hand-written update (`p -= lr * p.grad`) or a weight "
            "initialization must not be recorded."
        ),
        fix=lambda f: LEAF_FIXES[f.leaf_fix],
        outside_words=True,
    ),
    "other": ForwardWords(
        what=lambda f: f"forward failed at step {f.step}: {f.text}",
        why=lambda f: (
            "autograd cannot track an in-place change of a tensor that requires grad here; "
            "PyTorch refuses rather than compute a wrong gradient."
        ),
        fix=lambda f: (
            "use the out-of-place op (`x = x + y` instead of `x += y`), clone first (`x = x.clone()`), or "
            "make the change under `with torch.no_grad():` if it must not be differentiated (e.g. initializing "
            "weights)."
        ),
    ),
}


def raising_module(ctx: Context) -> tuple[str | None, str | None]:
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


def written_param(ctx: Context) -> tuple[str, Any] | None:
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
        obj, owner = _follow(local[head], attrs)
        name = ctx.index.param_name.get(id(obj)) if isinstance(obj, torch.Tensor) else None
        if name is not None:
            if not isinstance(owner, torch.nn.Module) and ctx.model is not None:
                owner = next((m for m in ctx.model.modules() if any(p is obj for p in m.parameters(recurse=False))), None)
            return name, owner
    return None


def _follow(obj: Any, attrs: list[str]) -> tuple[Any, Any]:
    """(object, its owner) at the end of an attribute path through modules; a view resolves to its base."""
    owner = None
    for a in attrs:
        if isinstance(obj, torch.Tensor):
            break
        owner, obj = obj, getattr(obj, a, None) if isinstance(obj, torch.nn.Module) else None
    if isinstance(obj, torch.Tensor) and obj._base is not None:
        obj = obj._base  # a row or slice of the parameter
    return obj, owner


def made_leaf(ctx: Context) -> str | None:
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


def forward_facts(ctx: Context, node_name: str | None, index: int | None) -> ForwardInplaceFacts:
    module, source = raising_module(ctx)
    base = ForwardInplaceFacts(ctx.step, "other", str(ctx.exc).split("\n")[0], ctx.display_module(module), source)
    if node_name is not None:
        return replace(base, case="multi_output_view", op=node_op_name(node_name), index=index)
    if _LEAF not in base.text:
        return base
    made = made_leaf(ctx)
    if made is not None:
        return replace(base, case="created_leaf", made=made)
    written = written_param(ctx)
    pname, owner = written if written is not None else (None, None)
    return replace(base, case="leaf_param", param=pname, leaf_fix=leaf_fix(owner, source))


def forward_words(f: ForwardInplaceFacts) -> Explanation:
    words = FORWARD_CASES[f.case]
    return Explanation(
        what=words.what(f) + "\n" + _where(f, words.outside_words), why=words.why(f), fix=words.fix(f)
    )


def explain_inplace_forward(ctx: Context, node_name: str | None, index: int | None) -> Finding:
    f = forward_facts(ctx, node_name, index)
    return Finding(
        kind="inplace_error",
        step=ctx.step,
        severity="error",
        explanation=forward_words(f),
        params=(f.param,) if f.param is not None else (),
        module=f.module,
        op=f.op,
        data={"phase": "forward", "source": f.source, "module_exact": f.module is not None},
    )
