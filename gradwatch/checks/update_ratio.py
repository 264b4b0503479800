"""``update_ratio``: a layer whose measured update-to-weight ratio stays far outside the usual band.

The ratio ``||p_after - p_before|| / ||p_before||`` is measured by :mod:`gradwatch.observe.magnitude` every
``update_ratio_every`` checked steps, from the update the optimizer actually applied (so it is right for
Adam, momentum and weight decay). Around 1e-3 is usual. A layer whose ratio stays above the band's high
end (default 0.1) for :data:`PATIENCE` measurements in a row is changing too fast to learn; below the low
end (default 1e-6) it barely moves, unless the run has converged (its loss, or else its gradient norm,
100x below its early level): tiny updates at the minimum are expected. Exactly zero updates (frozen by
``lr=0``, or skipped) are ignored.
"""

from __future__ import annotations

from collections import deque

from gradwatch.core.config import Config
from gradwatch.core.findings import Explanation, Finding, names_text
from gradwatch.core.history import History
from gradwatch.core.stats import StepStats
from gradwatch.core.trend import converged, newly_sustained

#: Runs only on steps where one of these facts holds (see :data:`gradwatch.checks.FACTS`).
WHEN = ('update_measured',)

#: Measurements in a row a ratio must stay outside the band.
PATIENCE = 5

_KEY = "update_ratio"


def _ratios(stats: StepStats) -> dict[str, float]:
    r = stats.extra.get("update_ratio")
    if not isinstance(r, dict) or stats.is_nonfinite:
        return {}
    return {k: v for k, v in r.items() if v > 0}


def check(stats: StepStats, history: History, config: Config) -> list[Finding]:
    ratios = _ratios(stats)
    if not ratios:
        return []
    low, high = config.update_ratio_band
    past = history.memory.get(_KEY, {}).get(stats.optimizer_index, {})
    too_high = [k for k, v in ratios.items() if newly_sustained(past.get(k, ()), v > high, lambda x: x > high, PATIENCE)]
    too_low = [k for k, v in ratios.items() if newly_sustained(past.get(k, ()), v < low, lambda x: x < low, PATIENCE)]
    if too_low and converged(history, stats.optimizer_index):
        too_low = []  # tiny updates at the minimum (or at the end of a schedule to 0) are convergence
    span = f"{PATIENCE} measurements in a row (one every {config.update_ratio_every} checked steps)"
    return [
        _finding(stats, kind, layers, ratios, (low, high), span)
        for kind, layers in (("update_ratio_high", too_high), ("update_ratio_low", too_low))
        if layers
    ]


#: The words of each kind: what the updates were, why it matters, the fix.
_WORDS = {
    "update_ratio_high": (
        "Updates too large at step {step} in {count} layer(s): {names}. Each optimizer step changed their weights "
        "by {span} of their norm",
        "weights that change by a large fraction every step jump around instead "
        "of converging; the loss gets noisy or diverges.",
        "lower the learning rate (for these layers: a parameter group with a smaller lr), "
        "add warm-up, or clip gradients; check that weight decay is not huge.",
    ),
    "update_ratio_low": (
        "Updates too small at step {step} in {count} layer(s): {names}. Each optimizer step changed their weights "
        "by only {span} of their norm",
        "these layers effectively do not train.",
        "raise the learning rate (check the scheduler did not drive it to ~0 and that the "
        "parameter group's lr is what you meant); for layers with very large weights, check the "
        "init; if they should not train, freeze them with requires_grad_(False).",
    ),
}


def _finding(
    stats: StepStats, kind: str, layers: list[str], ratios: dict[str, float], band: tuple[float, float],
    span: str,
) -> Finding:
    what, why, fix = _WORDS[kind]
    low, high = band
    head = what.format(step=stats.step, count=len(layers), names=names_text(layers), span=_span(ratios, layers))
    return Finding(
        kind=kind,
        step=stats.step,
        severity="warning",
        explanation=Explanation(
            what=f"{head} for {span}; the usual is around 1e-3 and the band is {low:g} to {high:g}.",
            why=why,
            fix=fix,
        ),
        module=layers[0],
        data={"layers": layers, "ratios": {k: ratios[k] for k in layers}, "band": [low, high],
              "optimizer": stats.optimizer_index},
    )


def remember(stats: StepStats, history: History) -> None:
    ratios = _ratios(stats)
    if not ratios:
        return
    past = history.memory.setdefault(_KEY, {}).setdefault(stats.optimizer_index, {})
    for k in list(past):
        if k not in ratios:
            del past[k]
    for k, v in ratios.items():
        past.setdefault(k, deque(maxlen=PATIENCE)).append(v)


def _span(ratios: dict[str, float], layers: list[str]) -> str:
    lo = min(ratios[k] for k in layers)
    hi = max(ratios[k] for k in layers)
    return f"{lo:.2g}" if lo == hi else f"{lo:.2g} to {hi:.2g}"
