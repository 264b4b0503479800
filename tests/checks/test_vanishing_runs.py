"""vanishing_grad's runs kept by their start (``_Runs``) report exactly what counting every layer's run each
step reports: the same layers at the same steps, for the window rule and the fast rule, over random
sequences where layers go below the ratio, far below it, come back and stay."""

from __future__ import annotations

import random

import pytest
from helpers import layer_stats

from gradwatch.checks import vanishing
from gradwatch.core.config import Config
from gradwatch.core.history import History
from gradwatch.core.stats import StepStats

LAYERS = [f"layer{i}" for i in range(8)]  # 0-3 move, 4-7 stay at the typical level (the 75th percentile: 1.0)


def _stats(step: int, values: dict[str, float]) -> StepStats:
    return layer_stats(step, {m: values[m] for m in LAYERS}, dict.fromkeys(LAYERS, 1.0))


def _counted(rel: dict[str, float], runs: dict[str, int], far: dict[str, int], thr: float, n: int) -> list[str]:
    """The check as it was written with a count per layer (the reference)."""
    if min(rel.values()) >= thr:
        return []
    return [
        k for k, v in rel.items()
        if v < thr and (runs.get(k, 0) == n - 1 or vanishing._fast(v, far.get(k, 0), runs.get(k, 0), thr, n))
    ]


def _count(rel: dict[str, float], runs: dict[str, int], far: dict[str, int], thr: float, n: int) -> tuple[dict, dict]:
    far_now = {k: far.get(k, 0) + 1 if v < thr * vanishing.FAR else 0 for k, v in rel.items()}
    runs_now = {
        k: (n if vanishing._fast(v, far.get(k, 0), runs.get(k, 0), thr, n) else runs.get(k, 0) + 1) if v < thr else 0
        for k, v in rel.items()
    }
    return runs_now, far_now


@pytest.mark.parametrize("seed", range(12))
def test_runs_by_their_start_report_what_counting_each_step_reports(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.choice([4, 5, 6, 9])
    config = Config(window=n)
    thr = config.vanishing_ratio
    levels = {"normal": 1.0, "low": thr / 10, "far": thr * vanishing.FAR / 10}
    history = History(window=n)
    state = dict.fromkeys(LAYERS[:4], "normal")
    runs: dict[str, int] = {}
    far: dict[str, int] = {}
    reported_new, reported_ref = [], []
    for step in range(400):
        for k in state:  # sticky: runs of every length
            if rng.random() < 0.15:
                state[k] = rng.choice(list(levels))
        values = {k: levels[state.get(k, "normal")] * (1 + rng.random() / 4 if k in state else 1.0) for k in LAYERS}
        stats = _stats(step, values)
        found = vanishing.check(stats, history, config)
        vanishing.remember(stats, history)
        history.record(stats, skipped=False)
        reported_new += [(step, layer) for f in found for layer in f.data["layers"]]
        rel = vanishing.relative_to_typical(_stats(step, values), History(window=n))
        reported_ref += [(step, layer) for layer in _counted(rel, runs, far, thr, n)]
        runs, far = _count(rel, runs, far, thr, n)
    assert reported_new == reported_ref
    assert len(reported_ref) >= 5  # the sequences do reach both rules
