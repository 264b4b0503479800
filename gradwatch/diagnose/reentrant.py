"""The reentrant-checkpoint cut: trainable parameters inside ``torch.utils.checkpoint(..., use_reentrant=True)``
segments whose inputs do not require grad get no gradient, although they are not frozen.

Facts (:func:`record_reentrant_cut`: which segments, which parameters, by replaying the step's forward with the
checkpoint calls recorded), then words (:func:`reentrant_words`, :func:`reentrant_explanation`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from gradwatch.core.findings import Explanation, Finding, names_text
from gradwatch.diagnose.capture import Call
from gradwatch.diagnose.replay import (
    CollectiveInReplay,
    apply_replaced,
    autocast,
    no_collectives,
    preserved,
    replay_input,
    set_rng_state,
)

#: ``no_grad_graph`` causes a reentrant checkpoint fed an input without grad can stand behind.
CUT_CAUSES = ("frozen_path", "frozen_or_detached", "detached")
#: Why a graph-less loss matters (the words of ``no_grad_graph``'s "Why it matters").
_NO_GRAPH_WHY = "no gradient can reach the parameters; nothing would be learned."


def reentrant_no_grad_warned() -> bool:
    """Whether torch's reentrant checkpoint has warned "None of the inputs have requires_grad=True" in this
    process (its module's warning registry): a ``none_grad`` report replays the step's forward to look for such
    segments only then. A replay on a healthy run moves Python-side state of the model (an attribute a forward
    sets) once more: no replay for the usual unused head."""
    cp = sys.modules.get("torch.utils.checkpoint")
    registry = getattr(cp, "__warningregistry__", None)
    if not isinstance(registry, dict):
        return False
    return any(
        isinstance(k, tuple) and k and isinstance(k[0], str) and k[0].startswith("None of the inputs have requires_grad")
        for k in registry
    )


def _segment_module(fn: Any) -> nn.Module | None:
    """The module a checkpointed function runs: the module itself, its bound ``forward``/``__call__``,
    a ``functools.partial`` of those (HF's ``_gradient_checkpointing_func(layer.__call__, ...)``) or a
    closure over it (older HF's ``create_custom_forward(module)``)."""
    for _ in range(4):
        if isinstance(fn, functools.partial):
            fn = fn.func
        else:
            break
    if isinstance(fn, nn.Module):
        return fn
    owner = getattr(fn, "__self__", None)
    if isinstance(owner, nn.Module):
        return owner
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:
            continue
        if isinstance(value, nn.Module):
            return value
    return None


@contextlib.contextmanager
def _recording_cuts(cls: Any, seen: list[Any]) -> Iterator[None]:
    """``CheckpointFunction.apply`` records, into ``seen``, the functions it runs on inputs none of which
    requires grad (with grad enabled); the original is put back afterwards."""
    original = cls.apply

    def apply(function: Any, preserve_rng_state: bool, *args: Any) -> Any:
        if torch.is_grad_enabled() and not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            seen.append(function)
        return original(function, preserve_rng_state, *args)

    with apply_replaced(cls, apply):
        yield


def _cut_segments(seen: list[Any], index: Any) -> dict[str, list[str]]:
    """Module name -> its trainable parameters, for each recorded segment function that runs a module of the
    model (``index``: the engine's parameter index)."""
    names = index.module_name
    out: dict[str, list[str]] = {}
    for fn in seen:
        module = _segment_module(fn)
        if module is None or id(module) not in names:
            continue  # a function of no module of the model: which parameters it trains is not known
        # A frozen segment (no trainable parameter inside) checkpointed this way loses nothing.
        inside = [n for p in module.parameters() if p.requires_grad and (n := index.name_of(p))]
        if inside:
            out[names[id(module)] or "<root>"] = inside
    return out


def record_reentrant_cut(model: nn.Module, call: Call, index: Any, owner: Any) -> dict[str, list[str]]:
    """The ``torch.utils.checkpoint(..., use_reentrant=True)`` segments of ``call``'s forward, replayed on
    ``model``, whose tensor inputs all had requires_grad=False (module name), each with the trainable
    parameters inside it (``owner.collective``: see :func:`~gradwatch.diagnose.replay.no_collectives`)."""
    cp = sys.modules.get("torch.utils.checkpoint")
    cls = getattr(cp, "CheckpointFunction", None)
    if cls is None:
        return {}
    seen: list[Any] = []
    try:
        with _recording_cuts(cls, seen), preserved(model), warnings.catch_warnings(), torch.enable_grad(), autocast(
            call.autocast
        ):
            warnings.simplefilter("ignore")  # torch's own "Gradients will be None", once more
            args, kwargs = tree_map(replay_input, (call.args, call.kwargs))
            set_rng_state(call.rng)
            with no_collectives(owner):
                model(*args, **kwargs)
    except CollectiveInReplay:
        pass  # the segments seen before the collective are reported
    return _cut_segments(seen, index)


def reentrant_words(cut: dict[str, list[str]]) -> tuple[str, str]:
    """The cause and the fix for trainable parameters inside reentrant checkpoint segments fed inputs without
    grad (``cut``: module name -> its trainable parameters, see :func:`record_reentrant_cut`)."""
    segments = list(cut)
    params = [n for names in cut.values() for n in names]
    where = names_text([f"`{s}`" for s in segments])
    one = len(segments) == 1
    inside = f" ({names_text(params)})" if params else ""
    cause = (
        f"torch.utils.checkpoint(..., use_reentrant=True) ran {where} on "
        f"{'an input that does' if one else 'inputs that do'} not require grad (what runs before "
        f"{'it' if one else 'the first'} is frozen, e.g. the embedding of a LoRA/adapter fine-tune): a reentrant "
        "checkpoint then returns an output without a graph (torch's warning: \"None of the inputs have "
        f"requires_grad=True. Gradients will be None\"), so the trainable parameters inside {'it' if one else 'them'}"
        f"{inside} get no gradient. They are not frozen."
    )
    fix = (
        "checkpoint with use_reentrant=False "
        "(`checkpoint(fn, x, use_reentrant=False)`; Hugging Face: "
        "`model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={\"use_reentrant\": False})`), or "
        "call `model.enable_input_require_grads()` (Hugging Face/PEFT), or make the checkpoint's input require "
        "grad (`x.requires_grad_(True)` on the frozen part's output)."
    )
    return cause, fix


def reentrant_cause(cut: dict[str, list[str]]) -> str:
    """The cause and fix of :func:`reentrant_words` as one sentence ("... They are not frozen. Fix: ...")."""
    cause, fix = reentrant_words(cut)
    return f"{cause} Fix: {fix}"


def reentrant_explanation(finding: Finding, cut: dict[str, list[str]]) -> Explanation:
    """The explanation of a ``no_grad_graph`` finding whose cut is a reentrant checkpoint: its own ``what``
    (its first paragraph when it was built from a message) and why, the checkpoint as cause, and its fix."""
    cause, fix = reentrant_words(cut)
    base = finding.explanation or Explanation(what=finding.headline, why=_NO_GRAPH_WHY)
    return dataclasses.replace(base, cause=cause, fix=fix)


def explain_cut(finding: Finding, cut: dict[str, list[str]]) -> Finding:
    """``finding`` (``no_grad_graph``) restated with the reentrant checkpoint ``cut`` as its cause."""
    data = {**finding.data, "cause": "reentrant_checkpoint", "reentrant_checkpoint": cut}
    return dataclasses.replace(
        finding, message="", explanation=reentrant_explanation(finding, cut), module=next(iter(cut)), data=data
    )
