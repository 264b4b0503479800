"""gradwatch in a Lightning run: one callback, two bugs planted on purpose.

    python examples/lightning_example.py [--epochs 3] [--save-dir runs]

A small classifier trains on synthetic data with ``GradWatchCallback(on_nonfinite="skip")``. Planted problems:
  1. ``aux_head`` is an auxiliary classifier that ``training_step`` never uses -> ``none_grad`` at step 0
  2. one training sample holds a NaN feature (a corrupted row in the data), so the batch that contains it
     makes the loss and every gradient NaN, once per epoch -> ``nonfinite_loss``/``nonfinite_grad``; the
     update is skipped each time, the weights stay finite and training carries on.

gradwatch writes into the Trainer's ``TensorBoardLogger`` run (next to Lightning's own ``train_loss``), with
``trainer.global_step`` as x-axis: gradient norms per layer, the clipping ratio, skipped steps, findings.
Works the same with ``import pytorch_lightning as pl`` (the callback fits either namespace).
"""

from __future__ import annotations

import argparse
import os

import torch
from torch import nn

try:  # the script builds its own Trainer, so either namespace will do
    import lightning.pytorch as pl
except ImportError:
    import pytorch_lightning as pl  # type: ignore[no-redef]

from gradwatch.lightning import GradWatchCallback

FEATURES, CLASSES, SAMPLES, BATCH = 32, 4, 2048, 32
CORRUPT_ROW = 40 * BATCH + 5  # sample 5 of batch 40: every epoch's step 40 (plus 64 per earlier epoch)


def synthetic_data(seed: int = 0) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    teacher = torch.randn(FEATURES, CLASSES, generator=g)
    y = (x @ teacher).argmax(dim=1)
    x[CORRUPT_ROW, 7] = float("nan")  # the planted data bug
    return torch.utils.data.TensorDataset(x, y)


class Classifier(pl.LightningModule):
    def __init__(self, lr: float = 3e-3) -> None:
        super().__init__()
        self.lr = lr
        self.encoder = nn.Sequential(nn.Linear(FEATURES, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU())
        self.head = nn.Linear(64, CLASSES)
        self.aux_head = nn.Linear(64, CLASSES)  # the planted bug: built, optimized, never used

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(synthetic_data(), batch_size=BATCH, shuffle=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--save-dir", default="runs")
    args = parser.parse_args()

    torch.manual_seed(0)
    watcher = GradWatchCallback(on_nonfinite="skip")
    logger = pl.loggers.TensorBoardLogger(save_dir=args.save_dir, name="lightning_example")
    trainer = pl.Trainer(
        max_epochs=args.epochs,
        accelerator="cpu",
        devices=1,
        logger=logger,
        callbacks=[watcher, pl.callbacks.RichProgressBar()],
        gradient_clip_val=1.0,
        log_every_n_steps=10,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    model = Classifier()
    trainer.fit(model)

    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    kinds: dict[str, list[int]] = {}
    for f in watcher.findings:
        kinds.setdefault(f.kind, []).append(f.step)
    print()
    print("gradwatch findings (kind: steps):")
    for kind, steps in kinds.items():
        print(f"  {kind}: {steps}")
    engine = watcher.engine
    if engine is not None:
        print(f"updates skipped: {engine.steps_skipped} of {trainer.global_step} optimizer steps")
    print(f"weights finite after training: {finite}")
    print(f"findings as JSON lines: {os.path.join(logger.log_dir, 'gradwatch.jsonl')}")
    print(f"\nOpen the dashboard:  tensorboard --logdir {os.path.join(args.save_dir, 'lightning_example')}")


if __name__ == "__main__":
    main()
