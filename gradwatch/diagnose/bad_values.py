"""Where a step's NaN/Inf already sits, outside any op: tensors the training loop holds (:func:`loop_tensors`),
the weights or buffers (:func:`poisoned`, :func:`embedding_rows`), the model's outputs (:func:`bad_outputs`),
the output gradients (:func:`output_nan`). Facts only, read on the incident (or error) path: a sync or a few.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from types import FrameType
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from gradwatch.core.stats import SyncBatch, queue_grad_norms, read_grad_norms
from gradwatch.diagnose.capture import Call, bad_data, call_tensors, named_tensors
from gradwatch.diagnose.op_fixes import absorbs_mask
from gradwatch.observe.tracing import library_frame

if TYPE_CHECKING:
    from gradwatch.diagnose.replay import ReplayResult

#: Top-level packages besides torch whose frames stand between the training loop and an optimizer's step
#: (the loop's frame is the first outside them): Lightning Fabric's optimizer steps through its strategy and
#: precision plugins (``lightning.fabric``, ``lightning_fabric``), Lightning's own loop or a LightningOptimizer
#: through ``lightning.pytorch``/``pytorch_lightning``. Not in ``library_frame`` itself: the autograd explanations
#: tell Lightning's own ``backward()`` from the user's by those frames.
_WRAPPERS = ("accelerate", "contextlib", "lightning", "lightning_fabric", "pytorch_lightning")
#: Frames walked up at most to find the training loop's.
_MAX_FRAMES = 64
#: A list, tuple or dict of the loop longer than this is not looked into (a dataset, not a batch).
_MAX_CONTAINER = 16


def loop_frame(frame: FrameType | None) -> FrameType | None:
    """The first frame from ``frame`` outwards outside gradwatch, torch and the wrappers: the training loop's."""
    for _ in range(_MAX_FRAMES):
        if frame is None or not library_frame(frame, _WRAPPERS):
            return frame
        frame = frame.f_back
    return None


def _loop_values(frame: FrameType) -> Iterable[tuple[str, Any]]:
    for name, value in list(frame.f_locals.items()):
        if name.startswith("__") or not isinstance(value, (torch.Tensor, list, tuple, dict)):
            continue
        if isinstance(value, (list, tuple, dict)) and len(value) > _MAX_CONTAINER:
            continue
        yield name, value


def _batch_like(t: torch.Tensor, skip: set[int], sizes: set[int]) -> bool:
    """A tensor of this batch the loss may read: not the model's nor an input, no grad, the batch's size."""
    return not (
        id(t) in skip or t.requires_grad or t.dim() == 0
        or t.shape[0] not in sizes or not (t.is_floating_point() or t.is_complex())
    )


def loop_tensors(calls: Sequence[Call], model: nn.Module | None, frame: FrameType | None) -> list[tuple[str, int, int]]:
    """Tensors of this batch held by the training loop (the first frame outside gradwatch and torch from
    ``frame``: ``y`` in ``loss = loss_fn(model(x), y)``) that hold NaN/Inf: a target, a per-sample weight or
    mask the loss reads. Only those whose first dimension is the batch's (the dataset or a class-weight
    vector is not blamed), not requiring grad, not the model's own tensors. Incident path only."""
    sizes = {t.shape[0] for t in call_tensors(calls) if t.dim() > 0}
    frame = loop_frame(frame)
    if frame is None or not sizes:
        return []
    skip = {id(t) for t in call_tensors(calls)}
    if model is not None:
        skip |= {id(t) for t in model.parameters()} | {id(t) for t in model.buffers()}
    named = [(n, t) for name, v in _loop_values(frame) for n, t in named_tensors(name, v) if _batch_like(t, skip, sizes)]
    where = f"{frame.f_code.co_name}() at {frame.f_code.co_filename}:{frame.f_lineno}"
    return [(f"{n} (in {where})", nan, inf) for n, nan, inf in bad_data(named)]


def poisoned(named: Sequence[tuple[str, torch.Tensor]]) -> list[str]:
    """Names of the tensors (parameters or buffers) that hold NaN/Inf themselves (one sync, incident path only)."""
    params = [(n, p) for n, p in named if p.is_floating_point() and not p.is_meta and p.numel() > 0]
    if not params:
        return []
    batch = SyncBatch()
    slots = queue_grad_norms(batch, [p.detach() for _n, p in params])
    norms = read_grad_norms(batch.resolve(), slots, len(params))
    suspects = [i for i, v in enumerate(norms) if not math.isfinite(v)]
    if not suspects:
        return []
    with torch.no_grad():
        flags = [bool((~torch.isfinite(params[i][1])).any()) for i in suspects]
    return [params[i][0] for i, f in zip(suspects, flags) if f]


def embedding_rows(
    model: nn.Module, params: Sequence[tuple[str, torch.Tensor]], names: list[str]
) -> dict[str, tuple[list[int], int]]:
    """For poisoned embedding tables among ``names``, the rows holding NaN/Inf and the number of rows.

    A table with a few bad rows (new rows of a resized vocabulary left uninitialized) is non-finite only on
    the batches that look those ids up: saying "every step" would contradict the run's finite steps."""
    tables = {id(m.weight): m for m in model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))}
    out: dict[str, tuple[list[int], int]] = {}
    for name, p in params:
        if name in names and id(p) in tables and p.dim() == 2:
            with torch.no_grad():
                bad = (~torch.isfinite(p)).any(dim=1).nonzero().flatten().tolist()
            if bad and len(bad) < p.shape[0]:
                out[name] = (bad, p.shape[0])
    return out


def bad_outputs(call: Call) -> list[tuple[str, int, int]]:
    """The outputs of ``call``'s forward that are still alive and hold NaN/Inf (exception path only)."""
    refs = call.outputs
    live = [(("output" if len(refs) == 1 else f"output {i}"), r()) for i, r in enumerate(refs)]
    return bad_data([(n, t) for n, t in live if t is not None and (t.is_floating_point() or t.is_complex())])


def output_nan(calls: Sequence[Call]) -> bool:
    """Whether a held output gradient of ``calls`` holds NaN: the loss (or the loss code) was NaN. A
    gradient scaler multiplies a finite output gradient, which may overflow to Inf but never turns NaN.
    A read per output gradient, exception path only."""
    grads = [g.detach() for c in calls for g in c.grads.values() if isinstance(g, torch.Tensor)]
    with torch.no_grad():
        return any(bool(torch.isnan(torch.view_as_real(g) if g.is_complex() else g).any()) for g in grads)


def minus_inf_suspected(result: ReplayResult) -> bool:
    """Whether a -inf input may be what went wrong, given where the replay says the NaN/Inf was born: not when
    a NaN was born from finite values, nor for an op that absorbs a mask's -inf (a softmax over a fully
    masked row is the mask's own trap)."""
    origin = result.loc.origin
    if origin is None:
        return True
    if origin.phase != "forward" or not origin.incoming.get("inf"):
        return False
    return not any(absorbs_mask(name) for name in (origin.op, origin.forward_op) if name)
