"""``dead_layer``: a layer whose gradient is exactly zero for ``dead_steps`` checked steps in a row.

Only counted on steps where other layers do get a gradient (a whole model at zero is a different
problem). The classic cause is dead ReLUs: pre-activations pushed below zero for every input (a large
negative bias, a learning rate that was too high), so nothing flows back. Reported once per layer at the
step it reaches ``dead_steps``; again only after it came back to life and died again.
"""

from __future__ import annotations

import math
import weakref
from typing import Any

from gradwatch.core.config import Config
from gradwatch.core.findings import Explanation, Finding, names_text
from gradwatch.core.history import History
from gradwatch.core.stats import StepStats, layer_key, layer_norms

_KEY = "dead_layer"
_VERSIONS = "dead_layer/grad_versions"


def _zero_layers(stats: StepStats, history: History) -> tuple[dict[str, float], list[str]] | None:
    if not stats.names or stats.is_nonfinite:
        return None
    if 0.0 not in stats.norms:  # a zero layer has zero norms: most steps end here
        return {}, []
    layers = stats.layer_norms or layer_norms(stats.modules, stats.norms)
    zero = [k for k, v in layers.items() if v == 0.0]
    frozen = _frozen_layers(stats) if zero else set()
    zero = [k for k in zero if k not in frozen]  # frozen on purpose (requires_grad=False): not dead
    unused = _unused_layers(stats, history, zero) if zero else set()
    zero = [k for k in zero if k not in unused]  # no backward reached it: not used this step, not dead
    if not zero or not any(v > 0 and math.isfinite(v) for v in layers.values()):
        return layers, []
    return layers, zero


def _grad_versions(stats: StepStats, layers: list[str]) -> dict[str, tuple[Any, int]]:
    """The gradient (weakly) and its ``_version`` for each parameter of ``layers`` (name -> both)."""
    params = stats.extra.get("params")
    if not isinstance(params, list) or len(params) != len(stats.names):
        return {}
    wanted = set(layers)
    out: dict[str, tuple[Any, int]] = {}
    for p, n, m in zip(params, stats.names, stats.modules):
        g = getattr(p, "grad", None)
        if layer_key(m) in wanted and g is not None:
            out[n] = (weakref.ref(g), g._version)
    return out


def _unused_layers(stats: StepStats, history: History, zero: list[str]) -> set[str]:
    """Zero layers that no backward pass reached since the previous check: with
    ``zero_grad(set_to_none=False)`` each step moves their gradient's version by the zeroing only (a head
    or expert used on some steps), where a dead layer's moves once more (backward adds its zeros)."""
    memory = history.memory.get(_VERSIONS, {}).get(stats.optimizer_index)
    if not memory:
        return set()
    previous, last_step = memory
    steps = max(1, stats.step - last_step)
    now = _grad_versions(stats, zero)
    unused = set()
    for layer in zero:
        names = [n for n, m in zip(stats.names, stats.modules) if layer_key(m) == layer]
        if names and all(
            n in previous and n in now and previous[n][0]() is now[n][0]() and now[n][1] - previous[n][1] <= steps
            for n in names
        ):  # the same gradient tensor (kept by zero_grad(set_to_none=False)), moved by the zeroing only
            unused.add(layer)
    return unused


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
    found = _zero_layers(stats, history)
    if not found or not found[1]:
        return []
    _layers, zero = found
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
            explanation=Explanation(
                what=f"Dead layer at step {stats.step}: the gradient of {names_text(new)} has been exactly zero for "
                f"the last {config.dead_steps} checked steps while the other layers' was not.",
                why="the layer no longer learns and will not recover by itself. Nothing reaches "
                "its output: usually the ReLUs after it output zero for every input (dead ReLUs); or the loss "
                "term it feeds is multiplied by 0 (a loss weight of 0 in a config, a term switched on later: "
                "then this is expected until the weight is raised).",
                fix="for dead ReLUs, use LeakyReLU or GELU instead of ReLU, lower the learning rate (a "
                "too-large step often kills the units), re-initialize the layer (kaiming init, biases at zero "
                "or slightly positive) or add normalization before the activation. If the layer is simply not "
                "used in forward, remove it (with zero_grad(set_to_none=False) an unused layer shows zero "
                "gradients).",
            ),
            params=params,
            module=new[0],
            data={"layers": new, "steps": config.dead_steps, "optimizer": stats.optimizer_index},
        )
    ]


def remember(stats: StepStats, history: History) -> None:
    found = _zero_layers(stats, history)
    if found is None:
        return
    layers, zero = found
    if not layers:  # no gradient norm is exactly zero (see _zero_layers): every run ends, no version to keep
        _forget(history, stats.optimizer_index)
        return
    # Versions of the zero layers' gradients, to tell an unused layer from a dead one at the next check.
    all_zero = [k for k, v in layers.items() if v == 0.0]
    versions = history.memory.setdefault(_VERSIONS, {})
    if all_zero:
        versions[stats.optimizer_index] = (_grad_versions(stats, all_zero), stats.step)
    elif stats.optimizer_index in versions:
        del versions[stats.optimizer_index]
    streaks = history.memory.setdefault(_KEY, {}).setdefault(stats.optimizer_index, {})
    if not zero and layers and not any(v > 0 for v in layers.values()):
        return  # every layer at zero: not counted either way
    for k in list(streaks):
        if k not in zero:
            del streaks[k]
    for k in zero:
        streaks[k] = streaks.get(k, 0) + 1


def _forget(history: History, optimizer_index: int) -> None:
    """A step without a zero layer: the optimizer's runs at zero end, its kept versions go."""
    versions = history.memory.get(_VERSIONS)
    if versions:
        versions.pop(optimizer_index, None)
    streaks = history.memory.get(_KEY, {}).get(optimizer_index)
    if streaks:
        streaks.clear()
