"""``dead_layer``: a layer whose gradient is exactly zero for ``dead_steps`` checked steps in a row.

Only counted on steps where other layers do get a gradient (a whole model at zero is a different
problem). The classic cause is dead ReLUs: pre-activations pushed below zero for every input (a large
negative bias, a learning rate that was too high), so nothing flows back. Reported once per layer at the
step it reaches ``dead_steps``; again only after it came back to life and died again.
"""

from __future__ import annotations

import math

from gradwatch.config import Config
from gradwatch.findings import Finding, names_text
from gradwatch.history import History
from gradwatch.stats import StepStats, layer_key, layer_norms

_KEY = "dead_layer"


def _zero_layers(stats: StepStats) -> tuple[dict[str, float], list[str]] | None:
    if not stats.names or stats.is_nonfinite:
        return None
    if 0.0 not in stats.norms:  # a zero layer has zero norms: most steps end here
        return {}, []
    layers = stats.layer_norms or layer_norms(stats.modules, stats.norms)
    zero = [k for k, v in layers.items() if v == 0.0]
    frozen = _frozen_layers(stats) if zero else set()
    zero = [k for k in zero if k not in frozen]  # frozen on purpose (requires_grad=False): not dead
    if not zero or not any(v > 0 and math.isfinite(v) for v in layers.values()):
        return layers, []
    return layers, zero


def _frozen_layers(stats: StepStats) -> set[str]:
    """Layers whose every parameter has ``requires_grad=False`` (a stale zero gradient left by
    ``zero_grad(set_to_none=False)`` after the user froze them)."""
    params = stats.extra.get("params")
    if not isinstance(params, list) or len(params) != len(stats.modules):
        return set()
    trainable: dict[str, bool] = {}
    for p, m in zip(params, stats.modules):
        key = layer_key(m)
        trainable[key] = trainable.get(key, False) or bool(getattr(p, "requires_grad", True))
    return {k for k, t in trainable.items() if not t}


def check(stats: StepStats, history: History, config: Config) -> list[Finding]:
    found = _zero_layers(stats)
    if not found or not found[1]:
        return []
    layers, zero = found
    streaks = history.memory.get(_KEY, {}).get(stats.optimizer_index, {})
    new = [k for k in zero if streaks.get(k, 0) + 1 == config.dead_steps]
    if not new:
        return []
    params = tuple(n for n, m in zip(stats.names, stats.modules) if layer_key(m) in new)
    return [
        Finding(
            kind="dead_layer",
            step=stats.step,
            severity="warning",
            message=(
                f"Dead layer at step {stats.step}: the gradient of {names_text(new)} has been exactly zero for "
                f"the last {config.dead_steps} checked steps while the other layers' was not.\n"
                "Why it matters: the layer no longer learns and will not recover by itself; usually the "
                "ReLUs after it output zero for every input (dead ReLUs), so nothing flows back through them.\n"
                "Fix: use LeakyReLU or GELU instead of ReLU, lower the learning rate (a too-large step often "
                "kills the units), re-initialize the layer (kaiming init, biases at zero or slightly "
                "positive) or add normalization before the activation. If the layer is simply not used in "
                "forward, remove it (with zero_grad(set_to_none=False) an unused layer shows zero gradients)."
            ),
            params=params,
            module=new[0],
            data={"layers": new, "steps": config.dead_steps, "optimizer": stats.optimizer_index},
        )
    ]


def remember(stats: StepStats, history: History) -> None:
    found = _zero_layers(stats)
    if found is None:
        return
    layers, zero = found
    streaks = history.memory.setdefault(_KEY, {}).setdefault(stats.optimizer_index, {})
    if not zero and layers and not any(v > 0 for v in layers.values()):
        return  # every layer at zero: not counted either way
    for k in list(streaks):
        if k not in zero:
            del streaks[k]
    for k in zero:
        streaks[k] = streaks.get(k, 0) + 1
