"""Clipping in words: what the run's gradient clipping (``StepStats.extra["clipping"]``) means for a finding.

Gradient-magnitude checks measure before any clipping. These helpers say, in the terms of the loop at hand,
whether something clips after the measurement and how to clip when it does not.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def _by_norm(clip: Any, ratio: float | None, this_step: bool) -> str | None:
    if not this_step:
        return f"Lightning's gradient clipping (gradient_clip_val={clip:g}) bounds the norm of every update"
    if ratio is not None and ratio < 1.0:
        return (
            f"Lightning's gradient clipping (gradient_clip_val={clip:g}) scaled this step's gradient down "
            f"{1 / ratio:.3g}x, to norm {clip:g}, before the update (gradwatch measures before clipping)"
        )
    return None


def _by_value(clip: Any, ratio: float | None, this_step: bool) -> str | None:
    return (
        f"Lightning's gradient clipping clamps every gradient element to +-{clip:g} "
        "(gradient_clip_algorithm='value') before the update (gradwatch measures before clipping)"
    )


def _by_the_loop(clip: Any, ratio: float | None, this_step: bool) -> str | None:
    # a plain loop that changed the gradients between backward() and step() (see gradwatch.observe.preclip)
    if not this_step:
        return "the training loop clips the gradients between backward() and optimizer.step()"
    if ratio is not None and ratio < 1.0:
        return (
            f"the training loop scaled this step's gradient down {1 / ratio:.3g}x between backward() and "
            "optimizer.step() (clipping; gradwatch measures before clipping)"
        )
    return None


def _by_the_module_code(clip: Any, ratio: float | None, this_step: bool) -> str | None:
    # a LightningModule whose own code clipped before gradwatch's check (self.clip_gradients in manual
    # optimization, clip_grad_norm_ in on_after_backward), measured before it by gradwatch.observe.preclip
    if not this_step:
        return "the LightningModule's own code clips the gradients between backward and the optimizer step"
    if ratio is not None and ratio < 1.0:
        return (
            f"the LightningModule's own code (self.clip_gradients, or clip_grad_norm_ in training_step or "
            f"on_after_backward) scaled this step's gradient down {1 / ratio:.3g}x between backward and the "
            "optimizer step (gradwatch measures before clipping)"
        )
    return None


def _by_the_module(clip: Any, ratio: float | None, this_step: bool) -> str | None:
    return (
        "the LightningModule's configure_gradient_clipping clips the gradients after gradwatch's check "
        "(gradwatch measures before clipping; it may not clip every step)"
    )


def _after_the_check(clip: Any, ratio: float | None, this_step: bool) -> str | None:
    # Lightning: the gradients were scaled down after the callbacks' on_before_optimizer_step (gradwatch's
    # check) and before the optimizer step, measured then (see gradwatch.core.held): this step's ratio.
    if ratio is None or ratio >= 1.0:
        return None
    return (
        f"this step's gradient was scaled down {1 / ratio:.3g}x after gradwatch's check and before the optimizer "
        "step (clipping in the LightningModule's own on_before_optimizer_step, or in a callback's, which Lightning "
        "runs after gradwatch's; gradwatch measures before clipping)"
    )


#: How the run clips (``stats.extra["clipping"]["how"]``) -> the clause that says so: ``(clip_val, the step's
#: clip ratio or None, whether the finding is about this step's gradient) -> clause or None``.
_IN_PLACE: dict[str, Callable[[Any, float | None, bool], str | None]] = {
    "norm": _by_norm,
    "value": _by_value,
    "loop": _by_the_loop,
    "module": _by_the_module,
    "module_code": _by_the_module_code,
    "after_check": _after_the_check,
}


def note_clipped_after_check(stats: Any, ratio: float) -> None:
    """Record on a Lightning step that its gradients were scaled by ``ratio`` after the check and before the
    update (measured at the optimizer step, see ``gradwatch.core.held``)."""
    found = stats.extra.get("clipping")
    manual = bool(found.get("manual")) if isinstance(found, dict) else False
    stats.extra["clipping"] = {"lightning": True, "how": "after_check", "clip_val": None, "manual": manual}
    stats.extra["clip_ratio"] = ratio


def clipping_in_place(stats: Any, this_step: bool = True) -> str | None:
    """When the gradients are clipped after gradwatch's measurement (Lightning's ``gradient_clip_val``, the
    module's ``configure_gradient_clipping``, see ``lightning.ClipRatio``; a plain loop's own clipping, see
    ``gradwatch.observe.preclip``), one clause saying so, with the
    factor when known (``this_step``: the finding is about this step's gradient). None when nothing is known
    to clip, or when Lightning's norm clipping did not bite (the norm was below ``gradient_clip_val``)."""
    facts = stats.extra.get("clipping")
    words = _IN_PLACE.get(facts.get("how")) if isinstance(facts, dict) else None
    if words is None:
        return None
    ratio = stats.extra.get("clip_ratio")
    return words(facts.get("clip_val"), ratio if isinstance(ratio, float) else None, this_step)


def clip_advice(stats: Any) -> str:
    """How to clip gradients, in the terms of the loop at hand: a plain loop, Lightning's automatic
    optimization (``gradient_clip_val`` when it does not clip yet, a lower one when it did not bite) or its
    manual optimization (``self.clip_gradients``)."""
    facts = stats.extra.get("clipping")
    if not isinstance(facts, dict) or not facts.get("lightning"):
        return "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0) between backward() and optimizer.step()"
    if facts.get("manual"):
        return (
            "self.clip_gradients(opt, gradient_clip_val=1.0, gradient_clip_algorithm='norm') between "
            "self.manual_backward(loss) and opt.step()"
        )
    if facts.get("how") == "norm":
        return (
            f"lower Trainer(gradient_clip_val={facts['clip_val']:g}): this step's gradient norm was below it, so it "
            "did not bite; a few times the usual gradient norm bounds such steps"
        )
    return "Trainer(gradient_clip_val=1.0), which Lightning applies between backward and the optimizer step"
