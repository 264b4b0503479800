"""Trends: decisions over a run's history the checks share, as small pure functions.

Robust statistics of a window (median, MAD spread, quantile), whether a condition has just become sustained,
whether the run has converged, the per-layer parameter norms a check remembers between measurements, and
:func:`once_per_check`, which lets a check and its ``remember`` share one computation per checked step.
"""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from gradwatch.core.measured import PARAM_NORMS

#: Scale factor that turns a median absolute deviation into a standard deviation for normal data.
MAD_TO_STD = 1.4826


def median(values: Iterable[float]) -> float:
    """Median of finite values (``nan`` for none)."""
    v = sorted(filter(math.isfinite, values))  # C loops: this runs on every checked step
    if not v:
        return math.nan
    n = len(v)
    return v[n // 2] if n % 2 else 0.5 * (v[n // 2 - 1] + v[n // 2])


def robust_spread(values: Iterable[float]) -> tuple[float, float]:
    """``(median, spread)`` where spread is the MAD scaled to a standard deviation."""
    v = list(filter(math.isfinite, values))
    m = median(v)
    if not v:
        return math.nan, math.nan
    return m, MAD_TO_STD * median([abs(x - m) for x in v])


def quantile(values: Iterable[float], q: float) -> float:
    """Nearest-rank quantile of finite values (``nan`` for none)."""
    v = sorted(filter(math.isfinite, values))
    if not v:
        return math.nan
    return v[min(len(v) - 1, max(0, round(q * (len(v) - 1))))]


_T = TypeVar("_T")


class _Gone:
    """Stands for a dead weak reference in an empty memo: matches no object, not even None."""

    def __call__(self) -> object:
        return self


_gone = _Gone()


def _none() -> None:
    return None


def once_per_check(fn: Callable[[Any, Any], _T]) -> Callable[[Any, Any], _T]:
    """Compute ``fn(stats, history)`` once per checked step: a check and its ``remember`` share it.

    The engine runs every check and then every ``remember`` on the same statistics before it records
    them in the history, so what ``fn`` reads does not change in between. The result is reused only for
    the same statistics object, the same history, and the same last recorded step of that history.
    """
    cell: list[tuple[Any, ...]] = [(_gone, _gone, _gone, None)]

    @functools.wraps(fn)
    def wrapper(stats: Any, history: Any) -> _T:
        memo = cell[0]  # one read: another thread may replace it, never half of it
        last = history.last.get(stats.optimizer_index)
        if memo[0]() is stats and memo[1]() is history and memo[2]() is last:
            return memo[3]  # type: ignore[no-any-return]
        value = fn(stats, history)
        # Everything weakly but the value: this cell outlives the run, which must not stay alive through it.
        cell[0] = (weakref.ref(stats), weakref.ref(history), weakref.ref(last) if last is not None else _none, value)
        return value

    return wrapper


def param_norms_of(stats: Any, history: Any) -> dict[str, float]:
    """Per-layer parameter norms: this step's measurement, else the latest remembered one."""
    now = stats.extra.get(PARAM_NORMS)
    if isinstance(now, dict):
        return now
    return history.memory.get("param_norms", {}).get(stats.optimizer_index, {})


_WEIGHTS: list[Any] = [None, {}, None]


def weight_summary(params: dict[str, float]) -> tuple[dict[str, float], float | None]:
    """``(usable, total)`` of per-layer weight norms: the positive finite ones, and the norm of all the
    weights. Computed once per measurement (every ``update_ratio_every`` steps), not on every step."""
    memo = _WEIGHTS
    if memo[0] is not params:
        usable = {k: w for k, w in params.items() if 0.0 < w < math.inf}
        total = math.sqrt(sum(v * v for v in params.values())) if params else None
        memo[0], memo[1], memo[2] = params, usable, total
    return memo[1], memo[2]


def remember_param_norms(stats: Any, history: Any, now: Any = None) -> None:
    """Keep the latest per-layer parameter norms (parameters change slowly between measurements): this
    step's measurement, or ``now``, norms a check measured on a suspicious step."""
    if now is None:
        now = stats.extra.get(PARAM_NORMS)
    if isinstance(now, dict):
        history.memory.setdefault("param_norms", {})[stats.optimizer_index] = now


#: Where the checks keep a run's early levels (set once, after their first 20 checked steps).
EARLY_LOSS = "loss_early"
EARLY_NORM = "exploding_early"
#: A loss (or total gradient norm) this many times below its early level: the run is at its minimum.
CONVERGED = 100.0


def converged(history: Any, optimizer_index: int) -> str | None:
    """``"loss"`` when the recent median loss is 100x below the run's early one, ``"norm"`` when the total
    gradient norm's is (no loss observed), else None. Only asked when a finding is about to fire."""
    loss_early = history.memory.get(EARLY_LOSS)
    if isinstance(loss_early, float) and loss_early > 0 and history.losses:
        return "loss" if median(history.losses) < loss_early / CONVERGED else None
    norm_early = history.memory.get(EARLY_NORM, {}).get(optimizer_index)
    recent = history.total_norms.get(optimizer_index, ())
    if norm_early and recent and median(recent) < norm_early / CONVERGED:
        return "norm"
    return None


def newly_sustained(previous: Any, current: bool, held: Any, n: int) -> bool:
    """True when a condition has just held for ``n`` observations in a row (not already before).

    ``previous`` holds the earlier observations (newest last, at least ``n`` kept); ``held(value)`` says
    whether the condition held for one of them; ``current`` says whether it holds now. Firing only at the
    crossing reports a persisting condition once, and again after it recovered and came back.
    """
    if not current:
        return False
    prev = list(previous)
    k = n - 1
    if len(prev) < k or not all(held(v) for v in (prev[len(prev) - k :] if k > 0 else [])):
        return False
    return not (len(prev) >= n and all(held(v) for v in prev[len(prev) - n :]))


#: A jump's start is named only with at least this many values before it to judge it against.
JUMP_BASE = 5


def jump_start(
    pairs: list[tuple[int, float]], current: float, threshold: Callable[[list[float]], float]
) -> tuple[int, list[float]] | None:
    """Where a jump found at the first judged step started, inside the history it was judged against.

    ``pairs`` are the ``(step, value)`` of that history, oldest first; ``threshold(values)`` is the check's
    spike threshold over ``values``. Returns ``(step, values before it)`` for the earliest start of an
    unbroken run of values, reaching ``current``, that are all above the threshold of the values before
    the run (at least ``JUMP_BASE`` of them), or None when the jump is ``current`` alone. Only called for
    a finding: a few sorts of at most ``MIN_HISTORY`` values per start.
    """
    values = [v for _, v in pairs]
    for s in range(JUMP_BASE, len(values)):
        t = threshold(values[:s])
        if current > t and all(v > t for v in values[s:]):
            return pairs[s][0], values[:s]
    return None


def matching_steps(pairs: Any, values: list[float]) -> list[tuple[int, float]] | None:
    """The ``(step, value)`` pairs kept for the last ``len(values)`` values of a rolling window, or None
    when they do not hold exactly those values (a skipped step, a resumed run): no step is named then."""
    if not isinstance(pairs, list) or len(pairs) < len(values):
        return None
    tail = pairs[len(pairs) - len(values) :]
    return tail if [v for _, v in tail] == values else None
