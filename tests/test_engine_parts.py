"""The engine's parts alone: weak callbacks, the loss ledger, the update guard, the parameter tracker, the extension
bus, the reporters' fan-out and the step scalars."""

from __future__ import annotations

import functools
import gc
import math
import operator
import random
import warnings
from collections import Counter
from typing import Any

import pytest
import torch
from torch import nn

from gradwatch.core.extension_bus import ExtensionBus
from gradwatch.core.failures import GradWatchInternalWarning
from gradwatch.core.loss_ledger import LossLedger
from gradwatch.core.param_tracker import ParamTracker
from gradwatch.core.params import ParamIndex
from gradwatch.core.stats import StepStats, SyncBatch, layer_norms, total_norm
from gradwatch.core.update_guard import UpdateGuard
from gradwatch.core.weak import weak_method
from gradwatch.report import Reporters
from gradwatch.report.scalars import StepScalars


class _Target:
    def __init__(self) -> None:
        self.calls: list[int] = []

    def hit(self, n: int) -> int:
        self.calls.append(n)
        return n * 2


def test_weak_method_calls_while_the_target_lives_and_does_not_keep_it_alive() -> None:
    target = _Target()
    call = weak_method(target, "hit")
    assert call(3) == 6 and target.calls == [3]
    del target
    gc.collect()
    assert call(4) is None  # the target is gone: nothing is called, nothing raised


def test_the_ledger_reads_the_losses_a_backward_reached_and_sets_the_others_aside() -> None:
    w = nn.Parameter(torch.ones(2))
    ledger = LossLedger([])
    used = (w * 2).sum()
    left_out = (w * float("nan")).sum()  # a batch the loop skipped before backward()
    ledger.observe(used)
    ledger.observe(left_out)
    used.backward()
    ledger.backward_reached()
    stats = StepStats(step=0)
    ledger.take_backward_passes(stats)
    batch = SyncBatch()
    loss_slot, stale_slot = ledger.queue(batch, [w.grad], stats)
    values = batch.resolve()
    assert values[loss_slot] == [4.0]  # the NaN of the batch never backpropagated is not this update's
    assert len(values[stale_slot]) == 1 and values[stale_slot][0] != values[stale_slot][0]
    assert stats.extra["stale_unused"] == 1
    assert stats.extra["backward_passes"] == (1, 0)
    assert ledger.losses == [] and ledger.stale == []


def test_the_ledger_counts_backward_passes_that_found_the_gradients_cleared() -> None:
    ledger = LossLedger([])
    for _ in range(3):  # zero_grad() inside an accumulation loop: every pass but the first found them cleared
        ledger.backward_reached()
        ledger.gradients_cleared()
    stats = StepStats(step=0)
    ledger.take_backward_passes(stats)
    assert stats.extra["backward_passes"] == (3, 3)
    assert stats.extra["cleared_between_backwards"] is True
    assert (ledger.backwards, ledger.cleared_backwards, ledger.cleared_between_backwards) == (0, 0, False)


def test_the_update_guard_makes_a_momentum_step_a_no_op_and_restores_grads_and_state() -> None:
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()  # momentum buffers exist now
    weights = [p.detach().clone() for p in model.parameters()]
    grads = [p.grad for p in model.parameters()]
    buffers = [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    guard = UpdateGuard(ParamIndex(model, [opt]))
    guard.suppress(0)
    opt.step()
    guard.restore()
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))
    assert all(p.grad is g for p, g in zip(model.parameters(), grads))
    assert all(torch.equal(opt.state[p]["momentum_buffer"], b) for p, b in zip(model.parameters(), buffers))


def test_the_tracker_rebuilds_the_index_when_a_param_group_is_added() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    opt = torch.optim.SGD(model[0].parameters(), lr=0.1)
    index = ParamIndex(model, [opt])
    tracker = ParamTracker(index, [opt], owner=None)
    assert tracker.refresh() is False
    assert len(index.per_optimizer[0].params) == 2
    opt.add_param_group({"params": list(model[1].parameters())})
    assert tracker.refresh() is True
    assert len(index.per_optimizer[0].params) == 4
    assert tracker.refresh() is False


class _Hooked:
    """An extension with ``before_sync`` only; ``fail`` makes it raise there."""

    def __init__(self, log: list[str], name: str, fail: bool = False) -> None:
        self.log, self.name, self.fail = log, name, fail

    def before_sync(self, ctx: Any) -> None:
        self.log.append(self.name)
        if self.fail:
            raise RuntimeError("extension bug")


class _Hookless:
    pass


def test_the_extension_bus_calls_the_extensions_defining_a_method_in_order_and_those_added_later() -> None:
    log: list[str] = []
    bus = ExtensionBus(owner=_Target())
    first = bus.add(_Hooked(log, "a"))
    bus.add(_Hookless())
    bus.call("before_sync", None)
    assert log == ["a"] and [e for e, _fn in bus.methods("before_sync")] == [first]
    assert bus.find(_Hooked) is first and bus.find(_Target) is None
    bus.add(_Hooked(log, "b"))
    bus.items.append(_Hooked(log, "c"))  # the engine's ``extensions`` list, edited in place
    bus.call("before_sync", None)
    assert log == ["a", "a", "b", "c"] and bus.methods("after_sync") == []


def test_an_extension_that_fails_is_reported_once_and_the_others_still_run() -> None:
    log: list[str] = []
    bus = ExtensionBus(owner=_Target())
    bus.add(_Hooked(log, "broken", fail=True))
    bus.add(_Hooked(log, "ok"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        bus.call("before_sync", None)
        bus.call("before_sync", None)
    assert log == ["broken", "ok", "broken", "ok"]
    assert len([w for w in caught if issubclass(w.category, GradWatchInternalWarning)]) == 1


def test_a_check_that_raises_is_reported_once_and_the_checks_and_remembers_after_it_still_run() -> None:
    from gradwatch.checks import CheckTable
    from gradwatch.core.config import Config
    from gradwatch.core.history import History
    from gradwatch.core.step_pipeline import run_checks

    log: list[str] = []

    def check(name: str, fail: bool = False) -> Any:
        def fn(stats: Any, history: Any, config: Any) -> list[str]:
            log.append(name)
            if fail:
                raise ZeroDivisionError(name)
            return [f"found by {name}"]

        return fn

    def remember(name: str, fail: bool = False) -> Any:
        def fn(stats: Any, history: Any) -> None:
            log.append(f"{name}.remember")
            if fail:
                raise KeyError(name)

        return fn

    table = CheckTable([("a", check("a"), remember("a")), ("b", check("b", True), remember("b", True)),
                        ("c", check("c"), None), ("d", check("d", True), remember("d")), ("e", check("e"), None)])
    owner = _Target()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found = [run_checks(table, StepStats(step=s), History(), Config(), owner) for s in range(2)]
    assert found == [["found by a", "found by c", "found by e"]] * 2
    assert log == ["a", "b", "c", "d", "e", "a.remember", "b.remember", "d.remember"] * 2
    told = [str(w.message) for w in caught if issubclass(w.category, GradWatchInternalWarning)]
    assert len(told) == 2 and "check b:" in told[0] and "check d:" in told[1], told


class _ScalarsSeen:
    def __init__(self) -> None:
        self.steps: list[int] = []

    def scalars(self, step: int, values: dict[str, float]) -> None:
        self.steps.append(step)


def test_a_reporter_added_to_the_items_after_the_first_call_gets_the_next_calls() -> None:
    first, later = _ScalarsSeen(), _ScalarsSeen()
    reporters = Reporters([first, _Hookless()])
    reporters.call("scalars", 0, {})
    reporters.items.append(later)
    reporters.call("scalars", 1, {})
    assert first.steps == [0, 1] and later.steps == [1]


def test_step_scalars_write_the_counters_only_when_they_change_between_full_steps() -> None:
    scalars = StepScalars(layer_every=100, several_optimizers=False)
    counts: Counter[str] = Counter()

    def at(step: int, skipped: int) -> dict[str, float]:
        return scalars.of(StepStats(step=step, names=["w"], total_norm=1.0), skipped, counts)

    assert at(0, 0) == {
        "gradwatch/grad_norm/total": 1.0, "gradwatch/skipped_steps": 0.0, "gradwatch/nonfinite_grads": 0.0,
    }
    assert at(1, 0) == {"gradwatch/grad_norm/total": 1.0}
    counts["loss_spike"] += 1
    assert at(2, 0) == {"gradwatch/grad_norm/total": 1.0, "gradwatch/findings/loss_spike": 1.0}
    assert at(3, 0) == {"gradwatch/grad_norm/total": 1.0}
    assert at(4, 1) == {"gradwatch/grad_norm/total": 1.0, "gradwatch/skipped_steps": 1.0}
    counts["loss_spike"] += 1
    assert scalars.of(StepStats(step=5), 1, counts, every_value=True) == {
        "gradwatch/skipped_steps": 1.0, "gradwatch/nonfinite_grads": 0.0, "gradwatch/findings/loss_spike": 2.0,
    }


@pytest.mark.parametrize("modules", [["a", "a", "b", "b"], ["a", "b", "b", "c"]])
def test_layer_norms_of_norms_known_finite_are_those_found_by_looking(modules: list[str]) -> None:
    norms = [3.0, 4.0, 1e30, 2.5e-20]
    assert layer_norms(modules, norms, finite=True) == layer_norms(modules, norms)


def test_the_total_norm_is_the_square_root_of_the_squares_added_in_order() -> None:
    rng = random.Random(0)
    for n in (1, 2, 80, 257):
        norms = [rng.random() * 10.0 ** rng.randint(-30, 30) for _ in range(n)]
        in_order = functools.reduce(operator.add, [v * v for v in norms], 0.0)
        assert total_norm(norms) == math.sqrt(in_order)
    assert total_norm([1.0, math.inf]) == math.inf and math.isnan(total_norm([1.0, math.nan]))


def test_a_ledger_with_no_loss_observed_queues_nothing_and_forgets_the_latest_backward() -> None:
    ledger = LossLedger([])
    ledger.backward_reached()
    batch = SyncBatch()
    assert ledger.queue(batch, [], StepStats(step=0)) == (-1, -1)
    assert batch.stage() is None and ledger.mark == 0 and batch.resolve() == []
