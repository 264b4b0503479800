"""Sync budget: at most one device-to-host sync per optimizer step on healthy steps; none when deferred.

On CPU there is no device to wait for, so the tests count *synchronising calls* instead: ``.item()``,
``.tolist()``, ``bool()``/``float()``/``int()`` of a tensor, ``.cpu()``, ``.numpy()`` and blocking
``.to("cpu")``, made from gradwatch's code, on a tensor computed during the current training step (that
is what makes a GPU wait for the step's kernels; reading back a value that was computed, and copied
without blocking, one step earlier does not). The counter is a ``TorchFunctionMode`` active around
whole training steps (forward, backward, ``optimizer.step()`` with gradwatch's checks inside it,
``zero_grad``). On a CUDA machine, ``torch.cuda.set_sync_debug_mode`` checks the real thing.
"""

from __future__ import annotations

import os
import sys
import warnings
import weakref
from typing import Any

import pytest
import torch
from helpers import plain_console
from torch import nn
from torch.overrides import TorchFunctionMode

import gradwatch

GRADWATCH_DIR = os.path.dirname(os.path.abspath(gradwatch.__file__)) + os.sep
SYNCING = frozenset({"item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu", "numpy"})


def _is_sync(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    if name in SYNCING:
        return True
    if name == "to" and not kwargs.get("non_blocking", False):
        targets = list(args[1:]) + [kwargs.get("device")]
        return any(
            (isinstance(t, str) and t.startswith("cpu")) or (isinstance(t, torch.device) and t.type == "cpu")
            for t in targets
        )
    return False


def _called_from_gradwatch() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.startswith(GRADWATCH_DIR):
            return True
        frame = frame.f_back
    return False


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for t in obj if isinstance(t, torch.Tensor)]
    return []


class SyncCounter(TorchFunctionMode):
    """Counts gradwatch's synchronising calls on tensors computed in the current step, per step."""

    def __init__(self) -> None:
        super().__init__()
        self.per_step: list[list[str]] = [[]]
        self._earlier: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
        self._current: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()

    def next_step(self) -> None:
        self._earlier.update(self._current)
        self._current = weakref.WeakValueDictionary()
        self.per_step.append([])

    def _from_earlier_step(self, t: Any) -> bool:
        return isinstance(t, torch.Tensor) and self._earlier.get(id(t)) is t

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if (
            args
            and _is_sync(name, args, kwargs)
            and not self._from_earlier_step(args[0])
            and _called_from_gradwatch()
        ):
            self.per_step[-1].append(name)
        if name.endswith("_") and not name.startswith("__") and args:
            for t in _tensors(args[0]):  # written in place now: its values are this step's
                self._earlier.pop(id(t), None)
        out = func(*args, **kwargs)
        if name != "__get__":  # attribute reads (``p.grad``) return tensors computed elsewhere
            for t in _tensors(out):
                self._current[id(t)] = t
        return out


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)) for _ in range(n)]


def run_counted(steps: int, tmp_path: Any, nan_at: int | None = None, **config: Any) -> tuple[SyncCounter, Any]:
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    counter = SyncCounter()
    with gradwatch.watch(model, opt, log_dir=str(tmp_path), console=plain_console(), **config) as gw, counter:
        for i, (x, y) in enumerate(batches(steps)):
            counter.next_step()
            loss = nn.functional.mse_loss(model(x), y)
            if i == nan_at:
                loss = loss * float("nan")
            gw.observe_loss(loss)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return counter, gw


def test_default_mode_makes_exactly_one_sync_per_healthy_step(tmp_path: Any) -> None:
    counter, gw = run_counted(12, tmp_path)
    assert gw.findings == []
    per_step = [len(calls) for calls in counter.per_step[1:]]
    assert per_step == [1] * 12, counter.per_step


def test_every_10_syncs_only_on_checked_steps(tmp_path: Any) -> None:
    counter, _gw = run_counted(20, tmp_path, every=10)
    per_step = [len(calls) for calls in counter.per_step[1:]]
    assert per_step == [1] + [0] * 9 + [1] + [0] * 9, counter.per_step


def test_deferred_mode_makes_no_sync_in_any_step(tmp_path: Any) -> None:
    counter, gw = run_counted(12, tmp_path, deferred=True, on_nonfinite="warn")
    assert gw.findings == []
    assert [len(calls) for calls in counter.per_step[1:]] == [0] * 12, counter.per_step
    assert gw.engine.history.last[0].step == 11  # the last step too was checked (at close())


def test_counter_sees_a_sync_on_this_steps_values() -> None:
    counter = SyncCounter()
    with counter:
        counter.next_step()
        t = torch.ones(3) * 2
        assert counter.per_step[-1] == []
        gradwatch.core.stats.SyncBatch().add(t)  # queuing is not a sync
        values = _resolve_now(t)
    assert values == [[2.0, 2.0, 2.0]]
    assert counter.per_step[-1] == ["tolist"]


def _resolve_now(t: torch.Tensor) -> list[list[float]]:
    batch = gradwatch.core.stats.SyncBatch()
    batch.add(t)
    return batch.resolve()


def test_deferred_findings_carry_the_step_they_concern(tmp_path: Any) -> None:
    _counter, gw = run_counted(10, tmp_path, nan_at=6, deferred=True, on_nonfinite="warn", escalate=False)
    first = {}
    for f in gw.findings:
        first.setdefault(f.kind, f.step)
    assert first.get("nonfinite_loss") == 6, [(f.kind, f.step) for f in gw.findings]
    assert all(f.step >= 6 for f in gw.findings)


def test_deferred_nonfinite_grad_does_not_claim_zero_nan_and_inf_counts(tmp_path: Any) -> None:
    _counter, gw = run_counted(10, tmp_path, nan_at=6, deferred=True, on_nonfinite="warn", escalate=False)
    f = next(f for f in gw.findings if f.kind == "nonfinite_grad")
    assert "0 NaN, 0 Inf" not in f.message and "not read in deferred mode" in f.message


def test_deferred_finding_of_the_last_step_is_reported_at_close(tmp_path: Any) -> None:
    _counter, gw = run_counted(5, tmp_path, nan_at=4, deferred=True, on_nonfinite="warn", escalate=False)
    assert [(f.kind, f.step) for f in gw.findings if f.kind == "nonfinite_loss"] == [("nonfinite_loss", 4)]


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _cuda_steps(steps: int, tmp_path: Any, **config: Any) -> Any:
    torch.manual_seed(0)
    model = make_model().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    data = [(x.cuda(), y.cuda()) for x, y in batches(steps + 2)]
    with gradwatch.watch(model, opt, log_dir=str(tmp_path), console=plain_console(), **config) as gw:
        for x, y in data[:2]:  # first steps: one-time set-up (parameter index, tracing)
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        mode = "error" if config.get("deferred") else "warn"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode(mode)
            try:
                for x, y in data[2:]:
                    loss = nn.functional.mse_loss(model(x), y)
                    gw.observe_loss(loss)
                    loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
            finally:
                torch.cuda.set_sync_debug_mode(0)
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    return gw, syncs


@cuda
def test_cuda_deferred_mode_passes_sync_debug_mode_error(tmp_path: Any) -> None:
    gw, syncs = _cuda_steps(6, tmp_path, deferred=True, on_nonfinite="warn")
    assert syncs == []
    assert gw.findings == []


@cuda
def test_cuda_default_mode_syncs_at_most_once_per_step(tmp_path: Any) -> None:
    gw, syncs = _cuda_steps(6, tmp_path)
    assert len(syncs) <= 6
    assert gw.findings == []
