"""``amp_overflow`` and ``amp_overflow_persistent``: a gradient scaler dropped updates (fp16 AMP).

Reads ``stats.extra["amp"]``, filled by :class:`gradwatch.observe.amp.AmpMonitor`. An overflow step is the
scaler working as designed (info); an overflow that persists is worth a warning, and so is a streak of
:data:`MANY` or more dropped updates that leaves :data:`MOST` of the run's steps so far dropped (reported when
it ends, or at close when the run ends inside it).
"""

from __future__ import annotations

from typing import Any

from gradwatch.core.config import Config
from gradwatch.core.findings import Explanation, Finding
from gradwatch.core.history import History
from gradwatch.core.stats import StepStats

#: Runs only on steps where one of these facts holds (see :data:`gradwatch.checks.FACTS`).
WHEN = ('amp',)

#: What a scaler's overflow step means, by its cause: the loss itself was non-finite, or the scale was
#: too high (dynamic loss scaling finding its scale).
_OVERFLOW_CAUSE = {
    "loss": "The loss itself was NaN/Inf on that step, which scaling never causes: see the nonfinite_loss finding.",
    "scaling": "This is how dynamic loss scaling finds its scale; a few such steps, mostly early in training, are "
    "normal and need no action.",
}


def check(stats: StepStats, history: History, config: Config) -> list[Finding]:
    amp = stats.extra.get("amp")
    if not isinstance(amp, dict):
        return []
    n = int(amp.get("overflow_steps") or 0)
    first = int(amp.get("first_step", stats.step))
    data: dict[str, Any] = {
        "overflow_steps": n,
        "steps": list(range(first, first + n)),
        "scale": amp.get("scale"),
        "new_scale": amp.get("new_scale"),
        "consecutive": amp.get("consecutive"),
        "total": amp.get("total"),
        "optimizer": amp.get("optimizer", stats.optimizer_index),
    }
    out: list[Finding] = []
    if n and _most_dropped(amp, n):
        out.append(_most_dropped_finding(amp, n, first, data))
    elif n:
        out.append(_overflow_finding(amp, n, first, data))
    if amp.get("persistent") and amp.get("grads_never_cleared"):
        out.append(_never_cleared_finding(stats, amp, first, data))
    elif amp.get("persistent"):
        out.append(_persistent_finding(stats, amp, data))
    return out


def _overflow_finding(amp: dict[str, Any], n: int, first: int, data: dict[str, Any]) -> Finding:
    steps = f"step {first}" if n == 1 else f"steps {first}-{first + n - 1}"
    return Finding(
        kind="amp_overflow",
        step=first,
        severity="info",
        explanation=Explanation(
            what=f"The gradient scaler skipped {'this update' if n == 1 else f'{n} updates'} ({steps}): "
            f"the scaled fp16 gradients overflowed, so it dropped the update and lowered the loss scale to "
            f"{_fmt(amp.get('new_scale'))}. " + _OVERFLOW_CAUSE["loss" if amp.get("loss_nonfinite") else "scaling"],
        ),
        data=data,
    )


def _never_cleared_finding(stats: StepStats, amp: dict[str, Any], first: int, data: dict[str, Any]) -> Finding:
    return Finding(
        kind="zero_grad_missing",
        step=stats.step,
        severity="error",
        explanation=Explanation(
            what=f"The gradient scaler dropped the update of each of the last {amp.get('consecutive')} steps "
            f"(steps {first}-{stats.step}; loss scale now {_fmt(amp.get('new_scale'))}), and the gradients were "
            "never cleared in between: zero_grad() is missing, so the Inf of the first overflow stays in .grad and "
            "every later step overflows too, whatever the scale.",
            why="no update ever goes through again; the model stops training.",
            fix="call optimizer.zero_grad() once per iteration, before scaler.scale(loss).backward() "
            "(with gradient accumulation, right after scaler.step(optimizer); scaler.update()).",
        ),
        data={**data, "amp": True},
    )


def _persistent_finding(stats: StepStats, amp: dict[str, Any], data: dict[str, Any]) -> Finding:
    loss_hint = " The loss itself was non-finite on that step." if amp.get("loss_nonfinite") else ""
    none_yet = " No update has gone through yet." if amp.get("no_update_yet") else ""
    return Finding(
        kind="amp_overflow_persistent",
        step=stats.step,
        severity="warning",
        explanation=Explanation(
            what=_PERSISTENT_WHAT[_persistent_cause(amp)].format(
                n=amp.get("consecutive"), total=amp.get("total"), step=stats.step, scale=_fmt(amp.get("new_scale"))
            )
            + f"{none_yet}{loss_hint}",
            why="every skipped step is a lost update; when the scale keeps falling the "
            "gradients overflow fp16 even unscaled, or are NaN/Inf for another reason, and the model "
            "stops training.",
            fix=_start_lower(amp) + "check the loss and the inputs for NaN/Inf (run a few steps without "
            "autocast: gradwatch then names the op), keep overflow-prone ops (softmax, norms, large "
            "reductions, exp) in float32, lower the learning rate, or train in bf16 "
            "(precision='bf16-mixed', torch.autocast(dtype=torch.bfloat16)), which needs no scaler.",
        ),
        data=data,
    )


#: What a persistent overflow looks like, by what showed it: the scale fell below 1 (the gradients overflow
#: float16 even unscaled), or a long streak of overflows in a row.
_PERSISTENT_WHAT = {
    "floor": "The gradient scaler's loss scale fell below 1 at step {step} (now {scale}, after {total} overflow "
    "steps so far): the gradients overflow float16 even unscaled, so lowering the scale further cannot help.",
    "streak": "The gradient scaler keeps skipping updates: {n} overflow steps in a row up to step {step}, loss "
    "scale now {scale}.",
}


#: Overflow steps in a row that are a streak whatever the scale (the monitor's PERSISTENT_STEPS).
_LONG_STREAK = 8


def _persistent_cause(amp: dict[str, Any]) -> str:
    scale = amp.get("new_scale")
    return "floor" if isinstance(scale, (int, float)) and scale < 1.0 and (amp.get("consecutive") or 0) < _LONG_STREAK else "streak"


def _start_lower(amp: dict[str, Any]) -> str:
    """No update yet and the scale still far above 1 after all these halvings: it started far too high."""
    scale = amp.get("new_scale")
    if not (amp.get("no_update_yet") and isinstance(scale, (int, float)) and scale >= 1.0):
        return ""
    return (
        "start from the default init_scale (65536) or lower (GradScaler(init_scale=...)): each dropped step "
        f"only halves the scale, and it is still {_fmt(scale)}; if it then keeps falling, "
    )


def _most_dropped(amp: dict[str, Any], n: int) -> bool:
    """A streak of at least MANY dropped updates, and at least MOST of the run's steps so far dropped."""
    run, total = amp.get("run_steps"), amp.get("total")
    return n >= MANY and isinstance(run, int) and run > 0 and isinstance(total, int) and total >= MOST * run


def _most_dropped_finding(amp: dict[str, Any], n: int, first: int, data: dict[str, Any]) -> Finding:
    run, total = amp["run_steps"], amp["total"]
    ended = (
        " The run ended inside this streak: "
        + ("no update went through at all." if total >= run else f"no update went through after step {first - 1}.")
        if amp.get("open_at_end")
        else ""
    )
    return Finding(
        kind="amp_overflow",
        step=first + n - 1 if amp.get("open_at_end") else first,
        severity="warning",
        explanation=Explanation(
            what=f"The gradient scaler dropped {n} updates in a row (steps {first}-{first + n - 1}), {total} of the "
            f"{run} steps so far: most of this training did not happen.{ended} The loss scale went from "
            f"{_fmt(amp.get('scale'))} to {_fmt(amp.get('new_scale'))}.",
            why="a dropped update is a lost step. Dynamic loss scaling finds its scale within a "
            "few steps; this many in a row means the scale started far too high (each dropped step halves it), "
            "or the gradients overflow float16 even unscaled, or are NaN/Inf for another reason.",
            fix="start from the default init_scale (65536) or lower (GradScaler(init_scale=...)); if the scale "
            "kept falling, check the loss and inputs for NaN/Inf, keep overflow-prone ops (softmax, norms, "
            "large reductions, exp) in float32, or train in bf16 (torch.autocast(dtype=torch.bfloat16), "
            "precision='bf16-mixed'), which needs no scaler.",
        ),
        data={**data, "run_steps": run, "open_at_end": bool(amp.get("open_at_end"))},
    )


#: Dropped updates in a row that are more than finding the scale: with at least MOST of the run's steps dropped.
MANY = 16
MOST = 2 / 3


def _fmt(v: Any) -> str:
    if isinstance(v, (int, float)):
        return f"{v:g}"
    return "unknown"
