"""Shared fixtures: tiny models and tiny Lightning set-ups that train in well under a second on CPU."""

from __future__ import annotations

import io
import os
import re
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings
from torch import nn

LIGHTNING_NAMESPACES = ("lightning.pytorch", "pytorch_lightning")

# Property-based tests: "ci" (default) is small and deterministic; HYPOTHESIS_PROFILE=long explores more.
_NO_DEADLINE = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow]}
settings.register_profile("ci", max_examples=15, derandomize=True, database=None, print_blob=True, **_NO_DEADLINE)
settings.register_profile("long", max_examples=400, **_NO_DEADLINE)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture
def text_console() -> Any:
    """A rich console that renders plain text into a buffer: ``console.file.getvalue()``."""
    from rich.console import Console

    return Console(file=io.StringIO(), width=120, color_system=None)


def panels(text: str) -> list[tuple[list[str], int]]:
    """The console's finding panels: (kinds, step) each; an incident's panel lists its head kind, then the
    related kinds of its "Also at step N:" lines."""
    out = []
    for chunk in re.split(r"[╭┏]", text)[1:]:
        title = re.match(r"─ gradwatch (?:info|warning|error): (\w+) at step (\d+)", chunk)
        if title is None:
            continue
        related = re.findall(r"^│ - (\w+): ", chunk, flags=re.MULTILINE)
        out.append(([title.group(1), *related], int(title.group(2))))
    return out


def lightning_namespace(name: str) -> Any:
    """``lightning.pytorch`` or ``pytorch_lightning``; skips the test when it is not installed."""
    return pytest.importorskip(name)


@pytest.fixture(params=LIGHTNING_NAMESPACES)
def pl_ns(request: pytest.FixtureRequest) -> Any:
    """Each installed Lightning namespace in turn."""
    return lightning_namespace(request.param)


@pytest.fixture
def lightning_pytorch() -> Any:
    return lightning_namespace("lightning.pytorch")


def tiny_data(n: int = 96, batch_size: int = 8, seed: int = 0) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = x @ torch.randn(8, 1, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch_size)


_CLASSES: dict[tuple[str, str], type] = {}


def tiny_module(ns: Any, **kwargs: Any) -> Any:
    """A two-layer regression LightningModule of namespace ``ns`` (automatic optimization).

    Keyword arguments: ``nan_at`` (global step whose loss is made NaN), ``raise_at`` (global step whose
    training_step raises ValueError), ``none_at`` (global step whose training_step returns None),
    ``unused`` (add a submodule that forward never uses), ``frozen`` (freeze every parameter),
    ``lr``, ``momentum``.
    """
    return _module_class(ns, "auto")(**kwargs)


def manual_module(ns: Any, **kwargs: Any) -> Any:
    """Manual optimization with two optimizers (body and head), like a GAN-style loop.

    Keyword arguments: ``nan_at`` (batch index whose loss is made NaN), ``lr``, ``raw`` (step the torch
    optimizers themselves: ``self.optimizers(use_pl_optimizer=False)``).
    """
    return _module_class(ns, "manual")(**kwargs)


def _module_class(ns: Any, kind: str) -> type:
    key = (ns.__name__, kind)
    if key not in _CLASSES:
        _CLASSES[key] = _build_auto(ns) if kind == "auto" else _build_manual(ns)
    return _CLASSES[key]


def _build_auto(ns: Any) -> type:
    class TinyModule(ns.LightningModule):  # type: ignore[misc,name-defined]
        def __init__(
            self,
            nan_at: int | None = None,
            raise_at: int | None = None,
            none_at: int | None = None,
            unused: bool = False,
            frozen: bool = False,
            lr: float = 0.05,
            momentum: float = 0.9,
        ) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.body = nn.Linear(8, 16)
            self.head = nn.Linear(16, 1)
            if unused:
                self.aux_head = nn.Linear(16, 1)
            if frozen:
                self.requires_grad_(False)
            self.nan_at, self.raise_at, self.none_at = nan_at, raise_at, none_at
            self.lr, self.momentum = lr, momentum
            self.opt: torch.optim.Optimizer | None = None

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(torch.tanh(self.body(x)))

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            if self.raise_at is not None and self.global_step == self.raise_at:
                raise ValueError("broken batch")
            if self.none_at is not None and self.global_step == self.none_at:
                return None
            x, y = batch
            loss = nn.functional.mse_loss(self(x), y)
            if self.nan_at is not None and self.global_step == self.nan_at:
                loss = loss * float("nan")
            return loss

        def configure_optimizers(self) -> Any:
            self.opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)
            return self.opt

        def train_dataloader(self) -> Any:
            return tiny_data()

    return TinyModule


def _build_manual(ns: Any) -> type:
    class ManualModule(ns.LightningModule):  # type: ignore[misc,name-defined]
        def __init__(self, nan_at: int | None = None, lr: float = 0.05, raw: bool = False) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.automatic_optimization = False
            self.body = nn.Linear(8, 16)
            self.head = nn.Linear(16, 1)
            self.nan_at, self.lr, self.raw = nan_at, lr, raw

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(torch.tanh(self.body(x)))

        def training_step(self, batch: Any, batch_idx: int) -> None:
            opt_body, opt_head = self.optimizers(use_pl_optimizer=not self.raw)  # raw: torch's own step()
            x, y = batch
            loss = nn.functional.mse_loss(self(x), y)
            if self.nan_at is not None and batch_idx == self.nan_at:
                loss = loss * float("nan")
            opt_body.zero_grad()
            opt_head.zero_grad()
            self.manual_backward(loss)
            opt_body.step()
            opt_head.step()

        def configure_optimizers(self) -> Any:
            return (
                torch.optim.SGD(self.body.parameters(), lr=self.lr, momentum=0.9),
                torch.optim.Adam(self.head.parameters(), lr=self.lr),
            )

        def train_dataloader(self) -> Any:
            return tiny_data()

    return ManualModule


def tiny_trainer(ns: Any, callbacks: list[Any], **kwargs: Any) -> Any:
    """A CPU Trainer for a few steps with everything optional switched off (override with kwargs)."""
    options: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "max_steps": 6,
        "logger": False,
        "enable_checkpointing": False,
        "enable_model_summary": False,
        "enable_progress_bar": False,
        "num_sanity_val_steps": 0,
    }
    options.update(kwargs)
    return ns.Trainer(callbacks=callbacks, **options)
