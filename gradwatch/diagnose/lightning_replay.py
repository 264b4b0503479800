"""Lightning replay guards: a replayed ``training_step`` logs nothing, steps no optimizer or scheduler.

Logging, ``manual_backward``, optimizer and scheduler steps are neutralized for the replay
(:func:`lightning_guards`); the precision plugin's ``train_step_context`` (autocast) is entered as in training
(:func:`train_step_context`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from gradwatch.observe.module_hooks import patched


class _InertOptimizer:
    """Stands in for a LightningOptimizer during a replay: ``step``/``zero_grad`` do nothing, except that
    ``step(closure)`` evaluates the closure once (manual optimization builds its loss there; its
    ``manual_backward`` and ``zero_grad`` are inert during the replay too)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        return closure() if callable(closure) else None

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None

    def toggle_model(self, *args: Any, **kwargs: Any) -> Any:
        return contextlib.nullcontext()

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._inner, name)
        if callable(value) and name not in _READ_ONLY:
            # Other methods of the optimizer move the weights too (SAM's first_step/second_step, which
            # calls base_optimizer.step()): inert during the replay.
            return lambda *args, **kwargs: None
        return value


_READ_ONLY = frozenset({"state_dict", "__repr__", "__str__"})


class _InertScheduler(_InertOptimizer):
    def step(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        return None


def _inert(value: Any, cls: type) -> Any:
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        return type(value)(cls(v) for v in value)
    return cls(value)


@contextlib.contextmanager
def lightning_guards(pl_module: Any, losses: list[torch.Tensor]) -> Iterator[None]:
    """Neutralize training_step's side effects: logging, manual backward, optimizer and scheduler steps."""
    optimizers = pl_module.optimizers(use_pl_optimizer=True) if _has_trainer(pl_module) else None
    try:
        schedulers = pl_module.lr_schedulers() if _has_trainer(pl_module) else None
    except Exception:  # noqa: BLE001
        schedulers = None
    fake_opts = _inert(optimizers, _InertOptimizer)
    fake_scheds = _inert(schedulers, _InertScheduler)

    def manual_backward(loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        losses.append(loss)

    patches: dict[str, Any] = {
        "log": lambda *a, **k: None,
        "log_dict": lambda *a, **k: None,
        "manual_backward": manual_backward,
        "optimizers": lambda *a, **k: fake_opts,
        "lr_schedulers": lambda *a, **k: fake_scheds,
        "toggle_optimizer": lambda *a, **k: None,
        "untoggle_optimizer": lambda *a, **k: None,
        "toggled_optimizer": lambda *a, **k: contextlib.nullcontext(),
        "clip_gradients": lambda *a, **k: None,
    }
    with patched(pl_module, patches):  # a copy of the module taken by training_step gets none of them
        yield


def _has_trainer(pl_module: Any) -> bool:
    try:
        return pl_module.trainer is not None
    except Exception:  # noqa: BLE001 - Lightning raises when no trainer is attached
        return False


def train_step_context(trainer: Any) -> Any:
    plugin = getattr(getattr(trainer, "strategy", None), "precision_plugin", None)
    ctx = getattr(plugin, "train_step_context", None)
    if ctx is None:
        return contextlib.nullcontext()
    try:
        return ctx()
    except Exception:  # noqa: BLE001
        return contextlib.nullcontext()
