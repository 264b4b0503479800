"""Memory: watching keeps no gradient alive; what gradwatch holds grows with parameter tensors, not elements."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
import torch
from helpers import plain_console
from torch import nn

import gradwatch


def make_model(width: int = 16) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 1))


def train(model: nn.Module, opt: torch.optim.Optimizer, gw: Any, steps: int) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)
        loss = nn.functional.mse_loss(model(x), y)
        gw.observe_loss(loss)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


CONFIGS = {
    "default": {},
    "every=3": {"every": 3},
    "deferred": {"deferred": True, "on_nonfinite": "warn"},
    "warn": {"on_nonfinite": "warn"},
}


@pytest.mark.parametrize("config", list(CONFIGS), ids=list(CONFIGS))
def test_gradients_die_at_zero_grad_set_to_none(tmp_path: Any, config: str) -> None:
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with gradwatch.watch(model, opt, log_dir=str(tmp_path), console=plain_console(), **CONFIGS[config]) as gw:
        train(model, opt, gw, 7)
        x = torch.randn(16, 8)
        loss = model(x).pow(2).mean()
        gw.observe_loss(loss)
        loss.backward()
        opt.step()
        refs = [weakref.ref(p.grad) for p in model.parameters()]
        opt.zero_grad(set_to_none=True)
        gc.collect()
        alive = [i for i, r in enumerate(refs) if r() is not None]
        assert alive == [], f"gradients of parameters {alive} are still referenced after zero_grad"
        train(model, opt, gw, 2)  # and watching goes on normally
    assert gw.findings == []


def test_gradients_die_at_zero_grad_after_an_incident(tmp_path: Any) -> None:
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with gradwatch.watch(model, opt, log_dir=str(tmp_path), console=plain_console()) as gw:
        train(model, opt, gw, 3)
        loss = model(torch.randn(16, 8)).pow(2).mean() * float("nan")
        gw.observe_loss(loss)
        loss.backward()
        opt.step()  # skipped by gradwatch
        refs = [weakref.ref(p.grad) for p in model.parameters()]
        opt.zero_grad(set_to_none=True)
        gc.collect()
        assert [r() is None for r in refs] == [True] * len(refs)
    assert any(f.kind == "nonfinite_loss" for f in gw.findings)


def _held_tensor_elements(gw: Any) -> int:
    """Elements of every tensor reachable from the watcher's own state (model and optimizer excluded)."""
    model_ids = {id(t) for t in gw.model.parameters()} | {id(t) for t in gw.model.buffers()}
    skip = {id(gw.model), *(id(o) for o in gw.optimizers)}
    seen: set[int] = set()
    total = 0
    stack: list[Any] = [gw.engine]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or id(obj) in skip:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if id(obj) not in model_ids:
                total += obj.numel()
            continue
        if isinstance(obj, (nn.Module, torch.optim.Optimizer, type)) or (callable(obj) and not hasattr(obj, "__dict__")):
            continue
        if isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)) or type(obj).__name__ == "deque":
            stack.extend(obj)
        elif hasattr(obj, "__dict__"):
            stack.extend(vars(obj).values())
        elif hasattr(obj, "__slots__"):
            stack.extend(getattr(obj, s) for s in obj.__slots__ if hasattr(obj, s))
    return total


def test_state_held_between_steps_grows_with_tensors_not_elements(tmp_path: Any) -> None:
    """A model 64x wider (same number of parameter tensors) makes gradwatch hold no more tensor data."""
    held = []
    for width in (16, 1024):
        model = make_model(width)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        gw = gradwatch.watch(model, opt, log_dir=str(tmp_path / str(width)), console=plain_console(), update_ratio_every=0)
        train(model, opt, gw, 5)
        held.append(_held_tensor_elements(gw))
        gw.close()
    small, large = held
    assert large <= small + 64, held
