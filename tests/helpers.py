"""Shared test helpers: plain-text consoles, finding filters, tiny Lightning set-ups, small context managers.

Import them by name (``from helpers import kinds, tiny_module``): ``tests/`` is on ``sys.path`` whenever pytest
has loaded ``tests/conftest.py``, so test files in subfolders (``tests/checks/``) import them the same way.
Fixtures live in ``conftest.py``; everything here is a plain function.
"""

from __future__ import annotations

import contextlib
import io
import re
import socket
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import pytest
import torch
from rich.console import Console
from torch import nn

LIGHTNING_NAMESPACES = ("lightning.pytorch", "pytorch_lightning")


# -- consoles and what they printed ----------------------------------------------------------------------
def plain_console(width: int = 120) -> Console:
    """A rich console that renders plain text into a buffer: ``console.file.getvalue()``."""
    return Console(file=io.StringIO(), width=width, color_system=None)


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


# -- finding filters -------------------------------------------------------------------------------------
def kinds(source: Any, *, info: bool = True) -> list[tuple[str, int]]:
    """(kind, step) of each finding, in order. ``source`` is a watcher or callback (anything with
    ``.findings``) or an iterable of findings; ``info=False`` leaves out the info-level ones."""
    findings: Iterable[Any] = source.findings if hasattr(source, "findings") else source
    return [(f.kind, f.step) for f in findings if info or f.severity != "info"]


# -- run conditions --------------------------------------------------------------------------------------
@contextlib.contextmanager
def single_thread() -> Iterator[None]:
    """Torch on one thread: on tiny models thread start-up costs more than the math, and the machine may be
    oversubscribed."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


@contextlib.contextmanager
def no_internal_failures() -> Iterator[None]:
    """gradwatch's own failures are reported as GradWatchInternalWarning: none may happen inside."""
    from gradwatch import GradWatchInternalWarning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    internal = [str(w.message) for w in caught if issubclass(w.category, GradWatchInternalWarning)]
    assert not internal, internal


def free_port() -> int:
    """A TCP port on localhost that nothing listens on (for a process group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- tiny Lightning set-ups ------------------------------------------------------------------------------
def lightning_namespace(name: str) -> Any:
    """``lightning.pytorch`` or ``pytorch_lightning``; skips the test when it is not installed."""
    return pytest.importorskip(name)


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


# -- small models and statistics shared by several test files ---------------------------------------------
class EncoderHead(nn.Module):
    """Linear(4, 8) + Tanh as ``encoder``, Linear(8, 1) as ``head``: two submodules to clear apart."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(4, 8), nn.Tanh())
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))


def layer_stats(step: int, values: dict[str, float], weights: dict[str, float]) -> Any:
    """A step's statistics from per-layer gradient norms (a weight and a bias per layer, each half of the
    layer's square) and per-layer weight norms, as the checks of relative gradients read them."""
    from gradwatch.core.measured import PARAM_NORMS
    from gradwatch.core.stats import StepStats

    layers = list(values)
    modules = [m for m in layers for _ in (0, 1)]
    stats = StepStats(step=step, names=[f"{m}.{p}" for m in layers for p in ("weight", "bias")], modules=modules)
    stats.norms = [values[m] / 2**0.5 for m in modules]
    stats.layer_norms = dict(values)
    stats.total_norm = sum(v * v for v in values.values()) ** 0.5
    stats.extra["params"] = [torch.empty(2, 2) if i % 2 == 0 else torch.empty(2) for i in range(len(modules))]
    stats.extra[PARAM_NORMS] = dict(weights)
    return stats
