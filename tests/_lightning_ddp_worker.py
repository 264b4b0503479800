"""A Lightning ``strategy="ddp"`` run on CPU with two processes, for ``test_distributed.py``.

Usage: ``python tests/_lightning_ddp_worker.py OUT_DIR``. Lightning starts the second process by running
this script again; each rank writes ``OUT_DIR/lightning_rank{RANK}.json``.
"""

from __future__ import annotations

import io
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import lightning.pytorch as pl
import torch
from helpers import tiny_module, tiny_trainer
from rich.console import Console

from gradwatch.lightning import GradWatchCallback

NAN_STEP = 3


class NanOnRankOne(pl.Callback):
    """Makes rank 1's loss NaN at NAN_STEP (through the module's own ``nan_at``)."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        pl_module.nan_at = NAN_STEP if trainer.global_rank == 1 else None


class Record(pl.Callback):
    def __init__(self) -> None:
        self.params_around_nan: dict[str, list[float]] = {}

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: object, idx: int) -> None:
        if trainer.global_step == NAN_STEP:
            self.params_around_nan["before"] = flat(pl_module)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: object) -> None:
        if trainer.global_step == NAN_STEP + 1:
            self.params_around_nan["after"] = flat(pl_module)


def flat(module: torch.nn.Module) -> list[float]:
    return [v for p in module.parameters() for v in p.detach().reshape(-1).tolist()]


def main() -> None:
    out_dir = sys.argv[1]
    console = Console(file=io.StringIO(), width=120, color_system=None)
    cb = GradWatchCallback(console=console)
    record = Record()
    model = tiny_module(pl)
    trainer = tiny_trainer(pl, [cb, NanOnRankOne(), record], max_steps=6, devices=2, strategy="ddp")
    trainer.fit(model)
    result = {
        "findings": [f.to_dict() for f in cb.findings],
        "console": console.file.getvalue(),
        "params": flat(model),
        "around_nan": record.params_around_nan,
        "skipped": cb.engine.steps_skipped if cb.engine is not None else None,
        "global_step": trainer.global_step,
    }
    with open(os.path.join(out_dir, f"lightning_rank{trainer.global_rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
