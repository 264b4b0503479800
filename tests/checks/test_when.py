"""The check table: a check module's ``WHEN`` lets a step skip it only where it could find nothing.

Every gated module is run anyway, on real steps of real training loops, wherever none of its facts holds:
it must return no finding and leave the history as it found it. The loops cover what healthy training looks
like (loss handed over or not, frozen layers, gradient accumulation, a layer whose gradient is all zero, a
NaN batch, several optimizers, the update-ratio measurement steps), so a ``WHEN`` that hides work a check does
on such a step fails here.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import no_internal_failures, plain_console
from torch import nn

import gradwatch
from gradwatch.checks import FACTS, CheckModule, CheckTable, discover

_FACT = dict(FACTS)


def _gated() -> list[CheckModule]:
    return [m for m in discover() if m.when]


def _record_skips(gw: Any, seen: dict[str, int], wrong: list[tuple[str, int, str]]) -> None:
    """Wrap the engine's check run: before each step's checks, run every gated module whose facts do not hold
    and note in ``wrong`` where it found something or changed something (gradwatch turns an exception raised
    inside a check into a warning, so nothing is asserted in here)."""
    engine = gw.engine
    original = engine._run_checks

    def run(stats: Any) -> Any:
        history = engine.history
        for m in _gated():
            if any(_FACT[f](stats) for f in m.when):
                continue
            before = (repr(history.memory), repr(history.reported), dict(stats.extra))
            if m.check(stats, history, engine.config):
                wrong.append((m.name, stats.step, "found"))
            if m.remember is not None:
                m.remember(stats, history)
            if (repr(history.memory), repr(history.reported), dict(stats.extra)) != before:
                wrong.append((m.name, stats.step, "changed"))
            seen[m.name] = seen.get(m.name, 0) + 1
        return original(stats)

    engine._run_checks = run


def _mlp(frozen: bool = False) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))
    if frozen:
        model[0].requires_grad_(False)
    return model


def _plain(model: nn.Module, opt: torch.optim.Optimizer, steps: int, *, observe: bool, accumulate: int = 1,
           nan_at: int | None = None, zero_layer: bool = False) -> Callable[[Any], None]:
    def loop(gw: Any) -> None:
        g = torch.Generator().manual_seed(1)
        for step in range(steps):
            for _ in range(accumulate):
                x = torch.randn(16, 8, generator=g)
                if step == nan_at:
                    x[0, 0] = math.nan
                loss = nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)) / accumulate
                if observe:
                    gw.observe_loss(loss)
                loss.backward()
            if zero_layer:
                model[2].weight.grad.zero_()
                model[2].bias.grad.zero_()
            opt.step()
            opt.zero_grad()

    return loop


def _run(model: nn.Module, opt: Any, loop: Callable[[Any], None], **kwargs: Any) -> dict[str, int]:
    seen: dict[str, int] = {}
    wrong: list[tuple[str, int, str]] = []
    with no_internal_failures(), gradwatch.watch(
        model, opt, console=plain_console(), log_dir=None, update_ratio_every=5, **kwargs
    ) as gw:
        _record_skips(gw, seen, wrong)
        loop(gw)
    assert wrong == []
    return seen


SCENARIOS: dict[str, Callable[[], dict[str, int]]] = {}


def scenario(fn: Callable[[], dict[str, int]]) -> Callable[[], dict[str, int]]:
    SCENARIOS[fn.__name__] = fn
    return fn


@scenario
def healthy_with_loss() -> dict[str, int]:
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return _run(model, opt, _plain(model, opt, 40, observe=True))


@scenario
def healthy_without_loss() -> dict[str, int]:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    return _run(model, opt, _plain(model, opt, 40, observe=False))


@scenario
def frozen_first_layer() -> dict[str, int]:
    model = _mlp(frozen=True)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    return _run(model, opt, _plain(model, opt, 30, observe=True))


@scenario
def accumulation() -> dict[str, int]:
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return _run(model, opt, _plain(model, opt, 20, observe=True, accumulate=4))


@scenario
def a_zero_layer_and_a_nan_batch() -> dict[str, int]:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    return _run(model, opt, _plain(model, opt, 30, observe=True, nan_at=12, zero_layer=True))


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_a_gated_check_finds_nothing_and_remembers_nothing_where_its_facts_do_not_hold(name: str) -> None:
    seen = SCENARIOS[name]()
    # Every gated module was actually exercised on skipped steps (else this test proves nothing for it).
    assert {"amp_overflow", "nonfinite_update", "update_ratio", "early_update", "all_zero"} <= set(seen), seen


def test_every_gated_module_is_skipped_on_a_healthy_step_and_run_on_its_own() -> None:
    """On a healthy step with no loss handed over, every gated check is left out; each one's fact brings it back."""
    seen = healthy_without_loss()
    assert set(seen) == {m.name for m in _gated()}, seen
    assert {m.name for m in _gated()} >= {"loss_spike", "loss_diverging", "nonfinite", "not_in_optimizer"}


def test_an_unknown_fact_in_when_is_refused_at_once() -> None:
    with pytest.raises(ValueError, match="unknown step facts"):
        CheckTable([CheckModule("typo", lambda s, h, c: [], None, ("nonfinte",))])


def test_a_check_added_later_runs_from_the_next_step() -> None:
    calls: list[int] = []
    table = CheckTable(discover())
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with gradwatch.watch(model, opt, console=plain_console(), log_dir=None) as gw:
        gw.engine._check_modules = table
        _plain(model, opt, 3, observe=False)(gw)
        table.append(("late", lambda stats, history, config: calls.append(stats.step) or [], None))
        _plain(model, opt, 2, observe=False)(gw)
    assert calls == [3, 4]
