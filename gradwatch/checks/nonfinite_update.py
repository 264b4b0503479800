"""``nonfinite_update``: finite gradients, but the optimizer's update would be NaN/Inf (an eps that is 0 there).

Reads ``stats.extra["update_nonfinite"]`` from :class:`gradwatch.observe.half_update.HalfUpdateGuard`. Reported
once per optimizer; every such step is skipped under ``on_nonfinite="skip"`` (the engine's policy).
"""

from __future__ import annotations

from gradwatch.core.config import Config
from gradwatch.core.findings import Explanation, Finding, names_text
from gradwatch.core.history import History
from gradwatch.core.stats import StepStats

#: Runs only on steps where one of these facts holds (see :data:`gradwatch.checks.FACTS`).
WHEN = ('update_nonfinite',)


def check(stats: StepStats, history: History, config: Config) -> list[Finding]:
    if not stats.extra.get("update_nonfinite") or stats.is_nonfinite:
        return []
    i = stats.optimizer_index
    if history.reported.get(f"nonfinite_update/{i}"):
        return []
    eps = stats.extra.get("update_nonfinite_eps") or []
    params = tuple(stats.extra.get("update_nonfinite_params") or ())
    where = f" ({names_text(list(params))})" if params else ""
    eps_text = ", ".join(f"{e:g}" for e in eps) or "its eps"
    words = _words(eps)
    action = {
        "skip": "gradwatch skipped this update: parameters and optimizer state are unchanged (and will skip "
        "every such step; the run stops after max_skips of them).",
        "raise": "gradwatch raised instead of applying it.",
        "warn": "It was applied (on_nonfinite='warn'): the weights are now NaN/Inf.",
    }[config.on_nonfinite]
    return [
        Finding(
            kind="nonfinite_update",
            step=stats.step,
            severity="error",
            explanation=Explanation(
                what=f"optimizer {i}'s update at step {stats.step} would be NaN/Inf{where} although the loss and every "
                f"gradient are finite: " + words[0].format(eps=eps_text) + action,
                why="one such update turns weights into NaN/Inf for good; every later step is then "
                "non-finite.",
                fix=words[1],
            ),
            params=params,
            data={"optimizer": i, "eps": eps},
        )
    ]


#: (what, fix) for float16 parameters whose eps rounds to 0, and for an eps of 0 in any precision.
_HALF = (
    "its parameters are float16 and eps={eps} rounds to 0 in float16, so wherever the second moment (Adam's "
    "exp_avg_sq, RMSprop's square_avg) is 0 (a zero gradient element, or one whose square underflows float16) "
    "the step divides by 0. ",
    "keep float32 parameters and use mixed precision (torch.autocast, or Lightning's precision='16-mixed'/"
    "'bf16-mixed') instead of model.half() / precision='16-true'; or use bfloat16; or give the optimizer an eps "
    "that float16 holds (eps=1e-4).",
)
_ZERO_EPS = (
    "its eps is {eps}, so wherever the second moment (Adam's exp_avg_sq, RMSprop's square_avg) is "
    "0 (a parameter element whose gradient has been exactly 0 so far: an embedding row no batch used, a masked "
    "or dead unit) the step computes 0 / 0. ",
    "give the optimizer a positive eps (Adam's default eps=1e-8); eps exists to keep that division finite.",
)


def _words(eps: list[float]) -> tuple[str, str]:
    return _ZERO_EPS if eps and not any(eps) else _HALF  # eps=0: any precision; else float16's rounding


def update_fix(stats: StepStats) -> str:
    """The fix of this step's non-finite update (the finding's own; ``too_many_skips`` repeats it)."""
    return _words(list(stats.extra.get("update_nonfinite_eps") or []))[1]


def remember(stats: StepStats, history: History) -> None:
    if stats.extra.get("update_nonfinite"):
        history.reported[f"nonfinite_update/{stats.optimizer_index}"] = True
