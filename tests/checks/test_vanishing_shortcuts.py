"""vanishing_grad's short paths for the usual step (no run one step short of a rule: the check computes nothing;
no run changes: remember only counts the step) report and remember exactly what the general path does, over
random sequences where layers go below the ratio, far below it, come back, stay, and miss steps."""

from __future__ import annotations

import random
from typing import Any

import pytest
from helpers import layer_stats

from gradwatch.checks import vanishing
from gradwatch.core.config import Config
from gradwatch.core.history import History
from gradwatch.core.stats import StepStats

LAYERS = [f"layer{i}" for i in range(8)]  # 0-4 move, 5-7 stay at the typical level


def _stats(step: int, values: dict[str, float]) -> StepStats:
    return layer_stats(step, values, dict.fromkeys(LAYERS, 1.0))


def _sequence(seed: int, thr: float, steps: int) -> list[dict[str, float]]:
    rng = random.Random(seed)
    levels = {"normal": 1.0, "low": thr / 10, "far": thr * vanishing.FAR / 10, "gone": 0.0}
    state = dict.fromkeys(LAYERS[:5], "normal")
    out = []
    for _ in range(steps):
        for k in state:  # sticky: runs of every length, and long stretches where nothing changes
            if rng.random() < 0.12:
                state[k] = rng.choice(list(levels))
        values = {k: levels[state.get(k, "normal")] * (1 + rng.random() / 4) for k in LAYERS}
        out.append({k: v for k, v in values.items() if v > 0})  # a layer with no gradient misses the step
    return out


def _run(sequence: list[dict[str, float]], n: int) -> tuple[list[tuple[int, str, str]], list[Any]]:
    config = Config(window=n)
    history = History(window=n)
    found, states = [], []
    for step, values in enumerate(sequence):
        stats = _stats(step, values)
        found += [(f.step, f.message, repr(f.data)) for f in vanishing.check(stats, history, config)]
        vanishing.remember(stats, history)
        history.record(stats, skipped=False)
        record = history.memory[vanishing._KEY][0]
        states.append((record["t"], dict(record["low"].start), dict(record["far"].start)))
    return found, states


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("n", [4, 5, 7])
def test_the_short_paths_report_and_remember_what_the_general_path_does(
    seed: int, n: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    sequence = _sequence(seed, Config().vanishing_ratio, 300)
    fast = _run(sequence, n)
    monkeypatch.setattr(vanishing, "_none_due", lambda record, n: False)
    monkeypatch.setattr(vanishing, "_unchanged", lambda runs, far, low, far_low, t: False)
    general = _run(sequence, n)
    assert fast == general
    assert fast[0]  # the sequences do reach the rules


def test_the_short_paths_are_taken_on_the_usual_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    taken = {"_none_due": 0, "_unchanged": 0}
    for name in taken:
        original = getattr(vanishing, name)

        def counted(*args: Any, _original: Any = original, _name: str = name) -> bool:
            result = bool(_original(*args))
            taken[_name] += result
            return result

        monkeypatch.setattr(vanishing, name, counted)
    _run(_sequence(0, Config().vanishing_ratio, 300), 6)
    assert taken["_none_due"] > 200 and taken["_unchanged"] > 50
