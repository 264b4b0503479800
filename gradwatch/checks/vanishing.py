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
from typing import Any, NamedTuple

from gradwatch.core.config import Config
from gradwatch.core.findings import Explanation, Finding, names_text
from gradwatch.core.history import History
from gradwatch.core.stats import StepStats, layer_norms
from gradwatch.core.trend import param_norms_of, quantile, remember_param_norms, weight_summary

#: Fewest layers with a measurable relative gradient before layers are compared.
MIN_LAYERS = 3
#: A layer below ``vanishing_ratio * FAR`` of the typical layer for FAST checked steps in a row is reported
#: then, without waiting for ``window`` steps.
FAR = 1e-4
FAST = 5

_KEY = "vanishing"


class _Relative(NamedTuple):
    """Each layer's relative gradient (``values``, aligned with ``layers``), the typical one (the 75th
    percentile over layers) and the lowest layer's relative to it (``min(values) / typical``: dividing by a
    positive number keeps the order, so this is exactly the smallest of the divided values)."""

    layers: tuple[str, ...]
    values: list[float]
    typical: float
    lowest: float

    def normalized(self) -> list[float]:
        """Each layer's relative gradient divided by the typical one (aligned with ``layers``)."""
        return list(map(operator.truediv, self.values, itertools.repeat(self.typical)))

    def to_typical(self) -> dict[str, float]:
        return dict(zip(self.layers, self.normalized()))


#: ``[weights, layer order, their weights in that order]`` of the latest step: the weights are measured every
#: ``update_ratio_every`` steps and the layers are the same from step to step, so the lookups are made once.
_ALIGNED: list[Any] = [None, (), None]


def _aligned(weights: dict[str, float], layers: tuple[str, ...]) -> list[float] | None:
    """``weights`` in the order of ``layers`` (None when a layer has no usable weight norm)."""
    memo = _ALIGNED
    if memo[0] is not weights or memo[1] != layers:
        aligned = list(map(weights.__getitem__, layers)) if weights.keys() >= set(layers) else None
        memo[0], memo[1], memo[2] = weights, layers, aligned
    return memo[2]  # type: ignore[no-any-return]


def relative(stats: StepStats, history: History) -> _Relative | None:
    """The layers' relative gradients against the typical layer's (None if unknown)."""
    if not stats.names or stats.is_nonfinite:
        return None
    return _relative(stats, history)


def _relative(stats: StepStats, history: History) -> _Relative | None:
    """:func:`relative` for a step with finite gradients."""
    weights = weight_summary(param_norms_of(stats, history))[0]
    if not weights:
        return None
    layers = stats.layer_norms or layer_norms(stats.modules, stats.norms)
    # A lookup table's gradient covers only the rows of the batch, its weights every row: its relative
    # gradient shrinks with the table's size (a 400k-row user table), whatever the training does.
    lookups = stats.extra.get("lookup_layers") or ()
    grads = layers.values()
    keys = tuple(layers)
    aligned = None
    if not lookups and grads and min(grads) > 0.0 and all(map(math.isfinite, grads)):
        aligned = _aligned(weights, keys)
    if aligned is None:
        inf = math.inf
        rel = {k: g / weights[k] for k, g in layers.items() if 0.0 < g < inf and k in weights and k not in lookups}
        return _against_typical(tuple(rel), list(rel.values()))
    values = list(map(operator.truediv, grads, aligned))  # every layer: C loops
    ordered = sorted(values)
    if len(ordered) < MIN_LAYERS or ordered[-1] == math.inf:
        return _against_typical(keys, values)
    # Every value is finite: the 75th percentile and the smallest are those of trend.quantile and min.
    typical = ordered[round(0.75 * (len(ordered) - 1))]
    return _Relative(keys, values, typical, ordered[0] / typical) if typical > 0 else None


def _against_typical(keys: tuple[str, ...], values: list[float]) -> _Relative | None:
    if len(values) < MIN_LAYERS:
        return None
    typical = quantile(values, 0.75)
    if not typical > 0:
        return None
    return _Relative(keys, values, typical, min(values) / typical)


def relative_to_typical(stats: StepStats, history: History) -> dict[str, float]:
    """Each layer's relative gradient divided by the 75th percentile over layers (empty if unknown)."""
    rel = relative(stats, history)
    return rel.to_typical() if rel is not None else {}


class _Runs:
    """Runs of recorded steps in a row, kept by their start: ``start[layer]`` is the count of recorded steps at
    which the layer's current run began (its run is ``t - start``), ``at[count]`` the layers whose run began
    then. A layer that stays in its run costs nothing per step: only one that enters or leaves is written."""

    __slots__ = ("at", "start")

    def __init__(self) -> None:
        self.start: dict[str, int] = {}
        self.at: dict[int, set[str]] = {}

    def run(self, layer: str, t: int) -> int:
        start = self.start.get(layer)
        return 0 if start is None else t - start

    def of_length(self, length: int, t: int) -> set[str]:
        """The layers whose run is ``length`` (>= 1) at count ``t``."""
        return self.at.get(t - length, set())

    def set_start(self, layer: str, start: int) -> None:
        old = self.start.get(layer)
        if old is not None:
            self._unmark(layer, old)
        self.start[layer] = start
        self.at.setdefault(start, set()).add(layer)

    def _unmark(self, layer: str, start: int) -> None:
        group = self.at[start]
        group.discard(layer)
        if not group:
            del self.at[start]

    def advance(self, inside: set[str], t: int) -> None:
        """Count ``t`` (the previous plus one) is recorded: the layers ``inside`` extend or start a run, the others end it."""
        start = self.start
        for layer in start.keys() - inside:
            self._unmark(layer, start.pop(layer))
        for layer in inside - start.keys():
            self.set_start(layer, t - 1)

    def clear(self) -> None:
        self.start, self.at = {}, {}


def _streaks(history: History, optimizer_index: int, thr: float) -> dict[str, Any]:
    """This optimizer's record of the layers' runs below the threshold (``low``) and ``FAR`` times below it
    (``far``), with ``t`` recorded steps; started again when the threshold changes."""
    kept = history.memory.setdefault(_KEY, {})
    record = kept.get(optimizer_index)
    if record is None or record["threshold"] != thr:
        record = kept[optimizer_index] = {"threshold": thr, "t": 0, "low": _Runs(), "far": _Runs()}
    return record


def _below(facts: _Relative, values: list[float], thr: float) -> list[str]:
    """The layers whose value (aligned with ``facts.layers``) is below ``thr``, in order (C loops)."""
    return list(itertools.compress(facts.layers, map(operator.gt, itertools.repeat(thr), values)))


def _due(record: dict[str, Any], low: list[str], n: int) -> set[str]:
    """Of the layers ``low`` now, those that may newly sustain it: a run below of ``n - 1`` steps so far, or
    of ``FAST - 1`` steps far below (the fast rule, confirmed by :func:`_fast`)."""
    t, runs, far = record["t"], record["low"], record["far"]
    due = set(runs.of_length(n - 1, t)) if n > 1 else {k for k in low if runs.run(k, t) == 0}
    if FAST > 1:
        due |= far.of_length(FAST - 1, t)
    else:  # pragma: no cover - FAST is a constant above 1
        due |= set(low)
    return due.intersection(low)


def _none_due(record: dict[str, Any], n: int) -> bool:
    """True when no run is one step short of either rule, so that :func:`_due` finds no layer whatever is low
    now: the usual step, told by two lookups before any relative gradient is computed (``remember`` computes
    them once per step)."""
    t = record["t"]
    return n > 1 and t - (n - 1) not in record["low"].at and t - (FAST - 1) not in record["far"].at


def _has_matrix(stats: StepStats, layer: str) -> bool:
    """Whether the layer holds a parameter of 2+ dimensions (a weight, not only a bias or a scale)."""
    params = stats.extra.get("params") or ()
    return any(m == layer and getattr(p, "ndim", 2) >= 2 for m, p in zip(stats.modules, params))


def _fast(rel: float, far_run: int, run: int, thr: float, n: int) -> bool:
    """FAST checked steps in a row FAR below the threshold, before the ``window`` rule reported it."""
    return rel < thr * FAR and far_run == FAST - 1 and run < n - 1


def check(stats: StepStats, history: History, config: Config) -> list[Finding]:
    thr, n = config.vanishing_ratio, config.window
    record = _streaks(history, stats.optimizer_index, thr)
    if _none_due(record, n):  # the usual step, whatever the gradients: no run can reach either rule now
        return []
    facts = relative(stats, history)
    if facts is None or facts.lowest >= thr:  # no layer below the ratio
        return []
    values = facts.normalized()
    low = _below(facts, values, thr)  # only a layer below the ratio now can newly sustain it
    due = _due(record, low, n)
    if not due:
        return []
    rel = dict(zip(facts.layers, values))
    t, runs, far = record["t"], record["low"], record["far"]
    # Below for n steps in a row as of now, not before; or FAST steps far below.
    new = [
        k for k in low
        if k in due
        and (runs.run(k, t) == n - 1 or _fast(rel[k], far.run(k, t), runs.run(k, t), thr, n))
        and _has_matrix(stats, k)
    ]
    if not new:
        return []
    steps = min(n, max(runs.run(k, t) + 1 for k in new))
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
    facts = _relative(stats, history)
    record = history.memory.get(_KEY, {}).get(stats.optimizer_index)  # set by check() on this step
    if facts is None or record is None:
        return
    # Runs by their start (see _Runs): a few C loops per step whatever the window, Python work only for a layer
    # that goes below or comes back. A layer missing from a step (no measurable gradient) ends its run.
    thr, n = record["threshold"], history.window
    lowest = facts.lowest
    if lowest >= thr and lowest >= thr * FAR:  # the usual step: no layer below, every run ends
        record["t"] += 1
        record["low"].clear()
        record["far"].clear()
        return
    _advance(record, facts, thr, n)


def _unchanged(runs: _Runs, far: _Runs, low: set[str], far_low: set[str], t: int) -> bool:
    """True when recording a step changes no run: every layer below stays below, no other joins, and none is
    due for the fast rule (the usual step of a layer that stays below)."""
    return runs.start.keys() == low and far.start.keys() == far_low and t - (FAST - 1) not in far.at


def _advance(record: dict[str, Any], facts: _Relative, thr: float, n: int) -> None:
    """One recorded step: each layer below ``thr`` (``thr * FAR``) extends its run or starts one, the others end
    theirs. A layer reported by the fast rule counts as reported by the window rule too (once per run below)."""
    t, runs, far = record["t"], record["low"], record["far"]
    values = facts.normalized()
    low = set(_below(facts, values, thr))
    # None is far below when the lowest is not (it is exactly the smallest of ``values``).
    far_low = set(_below(facts, values, thr * FAR)) if facts.lowest < thr * FAR else set()
    if _unchanged(runs, far, low, far_low, t):
        record["t"] = t + 1
        return
    candidates = far.of_length(FAST - 1, t) & far_low & low
    rel = dict(zip(facts.layers, values)) if candidates else {}
    fast = [k for k in candidates if _fast(rel[k], far.run(k, t), runs.run(k, t), thr, n)]
    now = t + 1
    far.advance(far_low, now)
    runs.advance(low, now)
    for k in fast:
        runs.set_start(k, now - n)  # its run counts n: reported
    record["t"] = now
