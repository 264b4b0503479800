"""``vanishing_grad``: layers whose gradients stay tiny for their weights and next to the other layers.

A layer's *relative gradient* is ``||grad|| / ||weights||``: how fast gradient descent can move it. A layer
is vanishing when its relative gradient stays below ``vanishing_ratio`` times the typical layer's (the
75th percentile over layers) for ``window`` checked steps in a row. Comparing with the other layers
makes the test independent of the loss scale and the learning rate; requiring it to persist keeps single
quiet batches out. Parameter norms come from :mod:`gradwatch.observe.magnitude` (every ``update_ratio_every``
checked steps; weights change slowly in between). Layers with exactly zero gradients are left to
``dead_layer``; lookup tables (``nn.Embedding``) are not compared (a batch reaches only its rows), nor
are layers of vectors only (a bias or a scale of its own): a bias feeding a BatchNorm gets a gradient of
zero up to rounding, by design, since the normalization subtracts the mean.
A layer ``FAR`` times further below (orders of magnitude below ``vanishing_ratio``: a 16-layer sigmoid MLP's
first layer at 1e-13 of the typical layer from step 0) is reported after ``FAST`` checked steps: no
quiet batch goes that low. Reported once per layer, again only after it recovered.
"""

from __future__ import annotations

import itertools
import math
import operator
from typing import Any

from gradwatch.core.config import Config
from gradwatch.core.findings import Explanation, Finding, names_text
from gradwatch.core.history import History
from gradwatch.core.stats import StepStats, layer_norms
from gradwatch.core.trend import once_per_check, param_norms_of, quantile, remember_param_norms, weight_summary

#: Fewest layers with a measurable relative gradient before layers are compared.
MIN_LAYERS = 3
#: A layer below ``vanishing_ratio * FAR`` of the typical layer for FAST checked steps in a row is reported
#: then, without waiting for ``window`` steps.
FAR = 1e-4
FAST = 5

_KEY = "vanishing"


@once_per_check
def relative_to_typical(stats: StepStats, history: History) -> dict[str, float]:
    """Each layer's relative gradient divided by the 75th percentile over layers (empty if unknown)."""
    if not stats.names or stats.is_nonfinite:
        return {}
    weights = weight_summary(param_norms_of(stats, history))[0]
    if not weights:
        return {}
    layers = stats.layer_norms or layer_norms(stats.modules, stats.norms)
    inf = math.inf
    # A lookup table's gradient covers only the rows of the batch, its weights every row: its relative
    # gradient shrinks with the table's size (a 400k-row user table), whatever the training does.
    lookups = stats.extra.get("lookup_layers") or ()
    grads = layers.values()
    if not lookups and grads and min(grads) > 0.0 and all(map(math.isfinite, grads)) and weights.keys() >= layers.keys():
        rel = dict(zip(layers, map(operator.truediv, grads, map(weights.__getitem__, layers))))  # every layer: C loops
    else:
        rel = {k: g / weights[k] for k, g in layers.items() if 0.0 < g < inf and k in weights and k not in lookups}
    if len(rel) < MIN_LAYERS:
        return {}
    typical = quantile(rel.values(), 0.75)
    if not typical > 0:
        return {}
    return dict(zip(rel, map(operator.truediv, rel.values(), itertools.repeat(typical))))


def _streaks(history: History, optimizer_index: int, thr: float) -> dict[str, Any]:
    """This optimizer's record ``{"threshold", "runs"}``; ``runs[layer]`` counts the recorded steps in a
    row (up to the last one) the layer stayed below the threshold. Started again when the threshold changes."""
    kept = history.memory.setdefault(_KEY, {})
    record = kept.get(optimizer_index)
    if record is None or record["threshold"] != thr:
        record = kept[optimizer_index] = {"threshold": thr, "runs": {}}
    return record


def _has_matrix(stats: StepStats, layer: str) -> bool:
    """Whether the layer holds a parameter of 2+ dimensions (a weight, not only a bias or a scale)."""
    params = stats.extra.get("params") or ()
    return any(m == layer and getattr(p, "ndim", 2) >= 2 for m, p in zip(stats.modules, params))


def _fast(rel: float, far_run: int, run: int, thr: float, n: int) -> bool:
    """FAST checked steps in a row FAR below the threshold, before the ``window`` rule reported it."""
    return rel < thr * FAR and far_run == FAST - 1 and run < n - 1


def check(stats: StepStats, history: History, config: Config) -> list[Finding]:
    rel = relative_to_typical(stats, history)
    if not rel:
        return []
    thr = config.vanishing_ratio
    record = _streaks(history, stats.optimizer_index, thr)
    runs, far = record["runs"], record.setdefault("far", {})
    if min(rel.values()) >= thr:  # the usual step: no layer below the ratio (one C loop)
        return []
    low = [k for k, v in rel.items() if v < thr]  # only a layer below the ratio now can newly sustain it
    if not low:
        return []
    n = config.window
    # Below for n steps in a row as of now, not before; or FAST steps far below.
    new = [
        k for k in low
        if (runs.get(k, 0) == n - 1 or _fast(rel[k], far.get(k, 0), runs.get(k, 0), thr, n)) and _has_matrix(stats, k)
    ]
    if not new:
        return []
    steps = min(n, max(runs.get(k, 0) + 1 for k in new))
    rows = [{"layer": k, "relative_to_typical": rel[k]} for k in new]
    worst = min(rel[k] for k in new)
    best = max(rel[k] for k in new)
    return [
        Finding(
            kind="vanishing_grad",
            step=stats.step,
            severity="warning",
            explanation=Explanation(
                what=f"Vanishing gradient at step {stats.step} in {len(new)} layer(s): {names_text(new)}. For "
                f"the last {steps} checked steps their gradient, relative to their weights, stayed below "
                f"{thr if steps == n else thr * FAR:g} of the typical layer's (now {worst:.2g}"
                + (f" to {best:.2g}" if best != worst else "")
                + ").",
                why="these layers barely learn while the others do; in a deep stack the "
                "early layers stay near their random init and the network behaves like a much shallower one.",
                fix="replace saturating activations (sigmoid/tanh) with ReLU, LeakyReLU or GELU; use an "
                "init matched to the activation (nn.init.kaiming_normal_ for ReLU, xavier for tanh); add "
                "normalization (BatchNorm/LayerNorm) or residual connections; or make the network shallower.",
            ),
            module=new[0],
            data={"layers": new, "relative_to_typical": {k: rel[k] for k in new}, "table": rows,
                  "optimizer": stats.optimizer_index},
        )
    ]


def remember(stats: StepStats, history: History) -> None:
    remember_param_norms(stats, history)
    if not stats.names or stats.is_nonfinite:
        return
    rel = relative_to_typical(stats, history)
    record = history.memory.get(_KEY, {}).get(stats.optimizer_index)  # set by check() on this step
    if not rel or record is None:
        return
    # Run lengths instead of a window of past values: O(layers) per step whatever the window. A layer
    # missing from a step (no measurable gradient) ends its run.
    thr, runs, far, n = record["threshold"], record["runs"], record.get("far", {}), history.window
    lowest = min(rel.values())
    if lowest >= thr and lowest >= thr * FAR:  # the usual step: no layer below, every run ends (C loops)
        record["far"] = dict.fromkeys(rel, 0)
        record["runs"] = dict.fromkeys(rel, 0)
        return
    record["far"] = {k: far.get(k, 0) + 1 if v < thr * FAR else 0 for k, v in rel.items()}
    # A layer reported by the fast rule counts as reported by the window rule too (once per run below).
    record["runs"] = {
        k: (n if _fast(v, far.get(k, 0), runs.get(k, 0), thr, n) else runs.get(k, 0) + 1) if v < thr else 0
        for k, v in rel.items()
    }
