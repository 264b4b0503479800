"""``clip_before_unscale``: gradients clipped while a GradScaler still had them scaled (fp16 AMP).

``scaler.scale(loss).backward()`` leaves the gradients multiplied by the scale (65536 at first).
``clip_grad_norm_`` called before ``scaler.unscale_(optimizer)`` measures those scaled gradients: it clips
every step, to ``max_norm`` in scaled units, and ``scaler.step`` then divides by the scale. Each update's
gradient norm ends up ``max_norm / scale``: training barely moves, with no error and no NaN.

Told from the step's own numbers (:mod:`gradwatch.observe.preclip` measures the clip, the unscaling scale is
known, from the scaler's unscale stage or, for a fused optimizer that unscales inside its step, from the scale
the scaler hands it): the gradient that reaches the update has a norm below :data:`TINY` while that norm times the scale is
a usual ``max_norm`` (:data:`MAX_NORM_RANGE`). Clipping after unscaling leaves a norm of ``max_norm`` itself,
thousands of times larger. Reported once per run.

In Lightning the same happens when the LightningModule's own code clips before the GradScaler unscales
(inside the optimizer step): ``self.clip_gradients`` in manual optimization's ``training_step``, the documented
recipe (Lightning issue #18089), or ``clip_grad_norm_`` in ``on_after_backward``. The fix then names the hook
that runs after unscaling.
"""

from __future__ import annotations

from typing import NamedTuple

from gradwatch.core.config import Config
from gradwatch.core.findings import Explanation, Finding
from gradwatch.core.history import History
from gradwatch.core.stats import StepStats

#: A clip coefficient below this is a real clip (not rounding).
CLIPPED = 0.5
#: The update's gradient norm below which clipping to a usual ``max_norm`` cannot explain it.
TINY = 1e-3
#: ``max_norm`` values people clip to: 0.01 to 100.
MAX_NORM_RANGE = (1e-2, 1e2)
#: A scale from which the scaled and the unscaled reading are told apart with room to spare.
MIN_SCALE = 256.0

_KEY = "clip_before_unscale"


class ScaledClip(NamedTuple):
    """One step's clip in scaled units."""

    scale: float  # what the scaler divided the clipped gradients by
    ratio: float  # the clip coefficient
    norm: float  # the gradient norm after clipping and unscaling: what the update applies
    max_norm: float  # the max_norm the loop asked for, in scaled units


def scaled_clip(stats: StepStats) -> ScaledClip | None:
    """The step's clip, when it was applied to scaled gradients (None otherwise)."""
    extra = stats.extra
    ratio, scale = extra.get("clip_ratio"), extra.get("unscaled_by")
    if not isinstance(ratio, float) or not isinstance(scale, float) or not (ratio < CLIPPED and scale >= MIN_SCALE):
        return None
    norm = ratio * stats.total_norm
    lo, hi = MAX_NORM_RANGE
    if not (0.0 < norm < TINY and lo <= norm * scale <= hi):
        return None
    return ScaledClip(scale, ratio, norm, norm * scale)


def check(stats: StepStats, history: History, config: Config) -> list[Finding]:
    if "unscaled_by" not in stats.extra or history.reported.get(_KEY):
        return []  # (the usual step: no scaler unscaled, or reported already)
    clip = scaled_clip(stats)
    if clip is None:
        return []
    stats.extra[_KEY] = True  # a note for remember: reported (the facts are not worked out twice)
    return [
        Finding(
            kind=_KEY,
            step=stats.step,
            severity="warning",
            explanation=clip_explanation(stats.step, clip, loop_of(stats)),
            data={"scale": clip.scale, "clip_ratio": clip.ratio, "update_grad_norm": clip.norm,
                  "max_norm": clip.max_norm, "optimizer": stats.optimizer_index},
        )
    ]


def loop_of(stats: StepStats) -> str:
    """Whose code clipped: a plain loop, or a LightningModule's in manual or automatic optimization
    (``stats.extra["clipping"]``, see ``gradwatch.lightning.ClipRatio``)."""
    facts = stats.extra.get("clipping")
    if not isinstance(facts, dict) or not facts.get("lightning"):
        return "plain"
    return "lightning_manual" if facts.get("manual") else "lightning_automatic"


#: Loop -> (what clipped, the fix). Lightning unscales inside the optimizer step, right before the
#: ``on_before_optimizer_step`` hooks: a clip in ``training_step`` or ``on_after_backward`` comes before it
#: (in manual optimization even the documented ``self.clip_gradients`` does, Lightning issue #18089).
_WORDS: dict[str, tuple[str, str]] = {
    "plain": (
        "clip_grad_norm_",
        "unscale before clipping: scaler.scale(loss).backward(); scaler.unscale_(optimizer); "
        "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm); scaler.step(optimizer); scaler.update().",
    ),
    "lightning_manual": (
        "the LightningModule's clip (self.clip_gradients or clip_grad_norm_ before opt.step())",
        "clip where Lightning has unscaled: in manual optimization the GradScaler unscales inside opt.step(), "
        "right before the on_before_optimizer_step hook, so move the clipping out of training_step into "
        "def on_before_optimizer_step(self, optimizer): self.clip_gradients(optimizer, gradient_clip_val=..., "
        "gradient_clip_algorithm='norm').",
    ),
    "lightning_automatic": (
        "the LightningModule's clip (clip_grad_norm_ in on_after_backward or training_step)",
        "let Lightning clip after it unscales: Trainer(gradient_clip_val=..., gradient_clip_algorithm='norm'), "
        "or clip in the LightningModule's on_before_optimizer_step or configure_gradient_clipping, which run "
        "after the GradScaler unscaled; not in on_after_backward or training_step.",
    ),
}


def clip_explanation(step: int, clip: ScaledClip, loop: str = "plain") -> Explanation:
    clipper, fix = _WORDS[loop]
    return Explanation(
        what=f"At step {step} the gradients were clipped while the GradScaler still had them multiplied by its "
        f"scale ({clip.scale:g}): {clipper} cut them {1 / clip.ratio:.3g}x to a norm of about "
        f"{clip.max_norm:.3g} in scaled units, so the update applies a gradient of norm {clip.norm:.3g}, "
        f"{clip.scale:g}x smaller than the max_norm you set.",
        why="every step is clipped and shrunk by the scale: the weights barely move and training stalls, with no "
        "error and no NaN to show it.",
        fix=fix,
    )


def remember(stats: StepStats, history: History) -> None:
    if stats.extra.get(_KEY):
        history.reported[_KEY] = True
