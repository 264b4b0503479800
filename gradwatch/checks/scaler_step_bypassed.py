"""``scaler_step_bypassed``: gradients a GradScaler scaled, applied by ``optimizer.step()`` directly (fp16 AMP).

``scaler.scale(loss).backward()`` leaves every gradient multiplied by the scale (65536 at first). A loop that
then calls ``optimizer.step()`` instead of ``scaler.step(optimizer); scaler.update()`` applies them as they
are: every update is ``scale`` times too large, and an overflow the scaler would have dropped reaches the
optimizer as Inf. Reads ``stats.extra["scaler_bypassed"]`` from :class:`gradwatch.observe.scaler_bypass.ScalerBypass`;
reported once per run, at the first such step. The non-finite findings of such a step and ``too_many_skips``
take its cause and fix (:func:`bypass_cause`), and so does the error ``scaler.update()`` raises in that loop
("No inf checks were recorded prior to update.", :func:`no_inf_checks_finding`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from gradwatch.core.config import Config
from gradwatch.core.findings import Explanation, Finding
from gradwatch.core.history import History
from gradwatch.core.stats import StepStats

#: Runs only on steps where one of these facts holds (see :data:`gradwatch.checks.FACTS`).
WHEN = ("scaler_bypassed",)

_KEY = "scaler_step_bypassed"

FIX = (
    "step through the scaler: scaler.scale(loss).backward(); scaler.step(optimizer); scaler.update() "
    "(scaler.step unscales the gradients and drops an update whose gradients overflowed; to clip, call "
    "scaler.unscale_(optimizer) before clip_grad_norm_). Without a GradScaler, call loss.backward(); "
    "optimizer.step() (bfloat16 autocast needs none)."
)

#: What the scaled gradients did to this step, by whether they stayed finite.
_EFFECT = {
    "finite": "the update it applied, and every one after it, is {scale} times too large",
    "overflow": "they overflowed float16 (Inf), an overflow scaler.step() would have dropped while it lowered "
    "the scale; applied as they are, every update is {scale} times too large",
}

_WHY = (
    "only scaler.step(optimizer) divides the scale out of the gradients (and drops the updates whose gradients "
    "overflowed), and only scaler.update() moves the scale; stepped directly, the weights jump by the scale times "
    "the intended update, the loss diverges and the gradients turn NaN/Inf."
)


def _scale(facts: dict[str, Any]) -> str:
    scale = facts.get("scale")
    return f"{scale:g}" if isinstance(scale, float) else "scale"


def _stepped(facts: dict[str, Any]) -> str:
    if facts.get("optimizers", 1) > 1:
        return f"each of the {facts['optimizers']} optimizers' step()"
    return f"{facts.get('optimizer_class') or 'optimizer'}.step()"


def bypass_explanation(step: int, facts: dict[str, Any], overflow: bool) -> Explanation:
    effect = _EFFECT["overflow" if overflow else "finite"].format(scale=_scale(facts))
    return Explanation(
        what=f"At step {step} {_stepped(facts)} ran directly on gradients the GradScaler still had multiplied by "
        f"its scale ({_scale(facts)}): the loop calls scaler.scale(loss).backward() but not scaler.step(optimizer) "
        f"and scaler.update() (the scaler has unscaled, stepped and updated nothing), so {effect}.",
        why=_WHY,
        fix=FIX,
    )


def bypass_cause(stats: StepStats) -> tuple[str, str] | None:
    """``(cause, fix)`` for the other findings of a step whose optimizer bypassed the scaler (None otherwise)."""
    facts = stats.extra.get("scaler_bypassed")
    if not isinstance(facts, dict):
        return None
    return (
        f"the gradients are still multiplied by the GradScaler's scale ({_scale(facts)}): {_stepped(facts)} is "
        "called directly instead of scaler.step(optimizer); scaler.update() (see the scaler_step_bypassed finding).",
        FIX,
    )


def with_bypass_cause(finding: Finding, stats: StepStats) -> Finding:
    """``finding`` (non-finite or exploding gradients) with the bypass as its cause and the scaler's fix, on a step
    whose optimizer bypassed the scaler; its usual causes (an op, the learning rate) would mislead."""
    known = bypass_cause(stats)
    if known is None or finding.explanation is None:
        return finding
    cause, fix = known
    words = dataclasses.replace(finding.explanation, cause=cause, fix=fix)
    return dataclasses.replace(finding, explanation=words, data={**finding.data, "known_cause": _KEY})


def check(stats: StepStats, history: History, config: Config) -> list[Finding]:
    facts = stats.extra.get("scaler_bypassed")
    if not isinstance(facts, dict) or history.reported.get(_KEY):
        return []
    stats.extra[_KEY] = True  # a note for remember: reported
    overflow = bool(stats.nonfinite or stats.overflow_norm)
    return [
        Finding(
            kind=_KEY,
            step=stats.step,
            severity="error",
            explanation=bypass_explanation(stats.step, facts, overflow),
            data={"scale": facts.get("scale"), "optimizer": facts.get("optimizer"), "overflow": overflow},
        )
    ]


def remember(stats: StepStats, history: History) -> None:
    if stats.extra.get(_KEY):
        history.reported[_KEY] = True


def no_inf_checks_finding(step: int, scale: float, optimizer_class: str) -> Finding:
    """The explanation of GradScaler's "No inf checks were recorded prior to update." in a loop whose optimizer
    stepped directly (seen at its step)."""
    stepped = f"{optimizer_class or 'optimizer'}.step()"
    return Finding(
        kind=_KEY,
        step=step,
        severity="error",
        explanation=Explanation(
            what=f"At step {step} scaler.update() raised \"No inf checks were recorded prior to update\": the loop "
            f"calls {stepped} directly instead of scaler.step(optimizer), so the scaler recorded nothing to update "
            f"from, and the gradients that step was given were still multiplied by the scale ({scale:g}).",
            why=_WHY,
            fix=FIX,
        ),
        data={"raised": "AssertionError", "scale": scale},
    )
