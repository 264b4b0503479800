"""A training run whose ``sys.stdout`` and ``sys.stderr`` are broken, for ``test_reliability.py``.

Usage: ``python tests/_broken_streams_worker.py INTEGRATION STREAM OUT_FILE``: INTEGRATION is ``plain`` or
``lightning``, STREAM ``closed`` (a closed file: ``ValueError: I/O operation on closed file``) or
``broken-pipe`` (every write raises ``BrokenPipeError``). Trains once unwatched and once watched (the
watched run with both streams broken, gradwatch printing to the global console), and writes
``OUT_FILE`` as JSON: ``{"error": ..., "same_weights": ...}``.

It runs in its own process because pytest records warnings itself: only there does ``warnings.warn``
write to ``sys.stderr`` as in a user's script.
"""

from __future__ import annotations

import io
import json
import os
import sys
import traceback
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
from torch import nn

import gradwatch

STEPS = 6


class Net(nn.Module):
    """A layer forward never uses: a ``none_grad`` finding at step 0, printed to the (broken) console."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 8)
        self.head = nn.Linear(8, 1)
        self.unused = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x)))


def data() -> torch.Tensor:
    return torch.randn(STEPS * 16, 4, generator=torch.Generator().manual_seed(0))


class BrokenPipe(io.TextIOBase):
    def write(self, s: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self) -> None:
        raise BrokenPipeError(32, "Broken pipe")


def broken(kind: str) -> Any:
    if kind == "broken-pipe":
        return BrokenPipe()
    stream = io.StringIO()
    stream.close()
    return stream


def plain(watched: bool) -> nn.Module:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    gw = gradwatch.watch(model, opt, console=True) if watched else None
    for x in data().split(16):
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    if gw is not None:
        gw.close()
    return model


def lightning(watched: bool, root: str) -> nn.Module:
    import lightning.pytorch as pl

    from gradwatch.lightning import GradWatchCallback

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = Net()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    torch.manual_seed(0)
    module = Module()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data()), batch_size=16)
    callbacks = [GradWatchCallback(console=True)] if watched else []
    trainer = pl.Trainer(
        max_steps=STEPS, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
        enable_checkpointing=False, enable_model_summary=False, default_root_dir=root, callbacks=callbacks,
    )
    trainer.fit(module, loader)
    return module.net


def main() -> None:
    integration, kind, out_file = sys.argv[1:4]
    run = plain if integration == "plain" else (lambda w: lightning(w, os.path.dirname(out_file)))
    reference = run(False)
    result: dict[str, Any] = {"error": None, "same_weights": None}
    saved = sys.stdout, sys.stderr
    sys.stdout = sys.stderr = broken(kind)
    try:
        watched = run(True)
    except BaseException:  # noqa: BLE001 - what reached the training loop is the result
        result["error"] = traceback.format_exc()
        watched = None
    finally:
        sys.stdout, sys.stderr = saved
    if watched is not None:
        result["same_weights"] = all(torch.equal(p, q) for p, q in zip(reference.parameters(), watched.parameters()))
    with open(out_file, "w", encoding="utf-8") as fh:
        json.dump(result, fh)


if __name__ == "__main__":
    main()
