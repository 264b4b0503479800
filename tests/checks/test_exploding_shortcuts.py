"""exploding_grad's short path for the usual step (no test can fire, no spike pending: the check returns at once)
reports and remembers exactly what the general path does, over random runs with noise, drifts, spikes that
stay or fall back, overflows, layers joining, weights far below the gradient and runs that converge; and the
step's facts (median, excess) are those of the window as :func:`gradwatch.core.trend.median` gives them."""

from __future__ import annotations

import math
import random
from collections import deque
from typing import Any

import pytest
import torch

from gradwatch.checks import exploding
from gradwatch.core.config import Config
from gradwatch.core.history import History
from gradwatch.core.measured import PARAM_NORMS
from gradwatch.core.stats import StepStats
from gradwatch.core.trend import median

CONFIGS = [
    Config(),
    Config(exploding_norm=30.0),
    Config(exploding_ratio=None, spike_factor=3.0),
    Config(window=8, deferred=True, on_nonfinite="warn"),
    Config(exploding_ratio=50.0),
]


def _params(layers: list[str]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(len(layers))
    return [torch.randn(8, 8, generator=g) * 0.1 for _ in layers]


def _run_of(seed: int, steps: int) -> list[dict[str, Any]]:
    """Each step: per-layer gradient norms, the loss, overflowing layers, weight norms if measured."""
    rng = random.Random(seed)
    level, spike, jump, joined, loss = 1.0, 0, 1.0, False, 10.0
    converging = rng.random() < 0.4
    out = []
    for step in range(steps):
        level *= math.exp(rng.gauss(0.0, 0.05))
        if spike == 0 and rng.random() < 0.06:
            spike = rng.choice([1, 2, 3, 6])
            jump = rng.choice([3.0, 5.0, 8.0, 15.0, 30.0, 1e3, 1e5])
        factor = jump if spike else 1.0
        spike = max(0, spike - 1)
        jump *= rng.uniform(0.4, 1.0)  # a spike that stays up, or falls back part of the way
        if rng.random() < 0.03:
            joined = not joined  # a head joins (or leaves): the tensor count changes by more than COUNT_CHANGE
        layers = ["a", "b", "c", "d"] + (["e", "f"] if joined else [])
        norms = {k: level * factor * (1 + rng.random()) * (0.0 if rng.random() < 0.01 else 1.0) for k in layers}
        loss = loss * (0.9 if converging else 1.0)
        weights = rng.choice([1.0, 1e-3, 1e-6]) if step % 5 == 0 else None
        overflow = ("b.weight",) if rng.random() < 0.02 else ()
        out.append({"norms": norms, "loss": loss, "weights": weights, "overflow": overflow})
    return out


def _stats(step: int, s: dict[str, Any], params: dict[tuple[str, ...], list[torch.Tensor]]) -> StepStats:
    layers = list(s["norms"])
    stats = StepStats(step=step, names=[f"{k}.weight" for k in layers], modules=list(layers))
    stats.norms = [s["norms"][k] for k in layers]
    stats.layer_norms = dict(s["norms"])
    stats.total_norm = math.sqrt(sum(v * v for v in stats.norms))
    stats.overflow_norm = s["overflow"]
    stats.loss = s["loss"]
    stats.extra["params"] = params.setdefault(tuple(layers), _params(layers))
    if s["weights"] is not None:
        stats.extra[PARAM_NORMS] = dict.fromkeys(layers, s["weights"])
    return stats


def _memory(history: History) -> str:
    kept = dict(history.memory)
    recent = kept.pop(exploding._KEY, {})
    kept[exploding._KEY] = {i: [{k: v for k, v in f.items() if k != "history"} for f in d] for i, d in recent.items()}
    return repr(sorted(kept.items(), key=lambda kv: kv[0]))


def _outcomes(run: list[dict[str, Any]], config: Config) -> tuple[list[Any], list[Any], str]:
    history = History(window=config.window)
    params: dict[tuple[str, ...], list[torch.Tensor]] = {}
    found, notes = [], []
    for step, s in enumerate(run):
        stats = _stats(step, s, params)
        found += [(f.step, f.message, repr(f.data), tuple(f.data["reasons"]) + ("since",) * ("since" in f.data))
                  for f in exploding.check(stats, history, config)]
        exploding.remember(stats, history)
        history.record(stats, skipped=stats.is_nonfinite)
        notes.append(repr({k: v for k, v in stats.extra.items() if k.startswith("exploding")}))
    return found, notes, _memory(history)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"norm{c.exploding_norm}-ratio{c.exploding_ratio}")
def test_the_short_path_reports_and_remembers_what_the_general_path_does(
    seed: int, config: Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = _run_of(seed, 160)
    fast = _outcomes(run, config)
    monkeypatch.setattr(exploding, "_quiet", lambda facts, config: False)
    assert _outcomes(run, config) == fast


def test_the_runs_reach_every_test_and_the_short_path() -> None:
    reasons: set[str] = set()
    for seed in range(8):
        for config in CONFIGS:
            for *_, why in _outcomes(_run_of(seed, 160), config)[0]:
                reasons.update(why)
    assert reasons == {"overflow", "bound", "ratio", "spike", "since"}


def test_the_short_path_is_taken_on_the_usual_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    taken = []
    original = exploding._quiet
    monkeypatch.setattr(exploding, "_quiet", lambda facts, config: taken.append(original(facts, config)) or taken[-1])
    _outcomes(_run_of(0, 160), Config())
    assert sum(taken) > 100


@pytest.mark.parametrize("seed", range(20))
def test_the_median_and_excess_are_those_of_the_window(seed: int) -> None:
    rng = random.Random(seed)
    history = History(window=50)
    history.total_norms[0] = deque(
        (rng.choice([0.0, rng.lognormvariate(0, 3)]) for _ in range(rng.randrange(0, 60))), maxlen=50
    )
    total = rng.choice([0.0, 1.0, rng.lognormvariate(0, 3), math.inf])
    stats = StepStats(step=0, names=["a.weight"], modules=["a"], norms=[total], total_norm=total)
    stats.layer_norms = {"a": total}
    history.memory[exploding._COUNT] = {0: (1, rng.randrange(1, 80))}
    facts = exploding._measure(stats, history)
    assert facts is not None
    recent = list(history.total_norms.get(0, ()))
    recent = recent[max(0, len(recent) - history.memory[exploding._COUNT][0][1]) :]
    m = median([math.log(v) for v in recent if v > 0])
    assert facts["median"] == (math.exp(m) if math.isfinite(m) else None)
    expected = math.log(total) - m if total > 0 and math.isfinite(total) and math.isfinite(m) else None
    assert facts["excess"] == expected and facts["n"] == len(recent)


def _facts_near_thresholds(rng: random.Random, config: Config) -> dict[str, Any]:
    """Facts whose every number sits at, just below or just above the threshold it is compared with."""

    def near(x: float) -> float:
        return x * rng.choice([0.5, 1 - 1e-12, 1.0, 1 + 1e-12, 2.0])

    bound = config.exploding_norm or 10.0
    pt = rng.choice([None, 0.0, 1e-3, 1.0])
    ratio = config.exploding_ratio or 1.0
    total = near(rng.choice([bound, ratio * (pt or 1.0), 1.0]))
    logs = sorted(rng.gauss(0.0, 0.3) for _ in range(rng.choice([0, 5, 25])))
    return {
        "total": total,
        "layers": {"a": near(bound), "b": near(total)},
        "overflow": rng.choice([(), ("a.weight",)]),
        "n": rng.choice([exploding.MIN_HISTORY - 1, exploding.MIN_HISTORY, 40]),
        "excess": rng.choice([None, near(math.log(config.spike_factor))]),
        "logs": logs,
        "param_total": pt,
        "median": 1.0,
        "early": None,
        "history": lambda: None,
        "optimizer": 0,
    }


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"norm{c.exploding_norm}-ratio{c.exploding_ratio}")
def test_a_quiet_step_is_one_on_which_no_test_fires(config: Config) -> None:
    rng = random.Random(0)
    quiet = 0
    for step in range(3000):
        facts = _facts_near_thresholds(rng, config)
        if not exploding._quiet(facts, config):
            continue
        quiet += 1
        stats = StepStats(step=step, names=["a.weight"], modules=["a"], extra={"params": _params(["a"])})
        before = dict(facts)
        exploding._ratio_reference(stats, facts, config)
        assert facts == before and exploding._reasons(facts, config) == [], before
    assert quiet > 100


def test_a_spike_that_does_not_fall_back_but_is_no_longer_a_spike_is_reported_from_its_pending_state() -> None:
    # within the run's range (its first steps reach 8), so it waits to fall back; it stays above half its size
    # while below spike_factor x the median, where every test is quiet but the pending spike's is not
    norms = [8.0 if s % 7 == 0 else 1.0 for s in range(30)] + [15.0, 9.0, 9.0, 9.0, 9.0]
    runs = [{"norms": {"a": v}, "loss": None, "weights": None, "overflow": ()} for v in norms]
    found = _outcomes(runs, Config())[0]
    assert [(step, why) for step, *_, why in found] == [(33, ("spike", "since"))]
