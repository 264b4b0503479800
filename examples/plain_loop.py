"""gradwatch demo: a plain PyTorch training loop with three bugs planted on purpose.

    python examples/plain_loop.py [--steps 300] [--log-dir runs/plain_loop]

The model is a small regression MLP on synthetic data. Planted problems:
  1. ``model.unused`` is a layer that forward never calls  -> ``none_grad`` at step 0
  2. ``model.head_bias`` is a parameter left out of the optimizer -> ``not_in_optimizer`` at step 0
  3. at step 120 a log of zero makes the loss and gradients NaN  -> ``nonfinite_loss``/``nonfinite_grad``,
     the update is skipped, and gradwatch names the op and the module where the NaN was born.

Everything else is healthy, and gradwatch stays quiet about it. TensorBoard logs go to ``--log-dir``.
"""

from __future__ import annotations

import argparse
import shutil

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from torch import nn

import gradwatch


class Scorer(nn.Module):
    """Turns features into a positive score and takes its log (the planted NaN source)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, 1)

    def forward(self, h: torch.Tensor, poison: bool = False) -> torch.Tensor:
        score = nn.functional.softplus(self.proj(h))
        if poison:
            score = score * 0.0  # a score that collapses to exactly zero...
        return torch.log(score)  # ...and log(0) = -inf, whose gradient is NaN


class Regressor(nn.Module):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(8, width), nn.GELU(), nn.Linear(width, width), nn.GELU())
        self.scorer = Scorer(width)
        self.unused = nn.Linear(width, width)  # bug 1: never called in forward
        self.head_bias = nn.Parameter(torch.zeros(1))  # bug 2: left out of the optimizer below

    def forward(self, x: torch.Tensor, poison: bool = False) -> torch.Tensor:
        return self.scorer(self.encoder(x), poison=poison).squeeze(-1) + self.head_bias


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--nan-step", type=int, default=120)
    parser.add_argument("--log-dir", default="runs/plain_loop")
    args = parser.parse_args()

    torch.manual_seed(0)
    shutil.rmtree(args.log_dir, ignore_errors=True)
    console = Console()
    console.rule("[bold]gradwatch demo: a plain training loop with three planted bugs")

    model = Regressor()
    trainable = [p for n, p in model.named_parameters() if n != "head_bias"]  # bug 2
    optimizer = torch.optim.AdamW(trainable, lr=3e-3)
    true_w = torch.randn(8)

    progress = Progress(
        TextColumn("[bold blue]training"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]:.4f}"),
        TimeElapsedColumn(),
    )
    with progress, gradwatch.watch(model, optimizer, log_dir=args.log_dir) as gw:
        task = progress.add_task("train", total=args.steps, loss=float("nan"))
        for step in range(args.steps):
            x = torch.randn(64, 8)
            y = torch.log1p(torch.exp(x @ true_w * 0.3))
            pred = model(x, poison=(step == args.nan_step))  # bug 3 at one step
            loss = nn.functional.mse_loss(pred, y)
            gw.observe_loss(loss)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()  # gradwatch checks here, before the update
            progress.update(task, advance=1, loss=loss.item())

    finite = all(torch.isfinite(p).all() for p in model.parameters())
    console.print(
        f"\n[bold]{len(gw.findings)} findings[/bold]; weights finite after the run: "
        f"[{'green' if finite else 'red'}]{finite}[/]"
    )
    for f in gw.findings:
        where = f.where if len(f.where) < 60 else f"{len(f.params)} parameters"
        console.print(f"  step {f.step:>4}  {f.severity:<7}  {f.kind:<18} {where}", highlight=False)
    console.print(f"\nOpen the dashboard:  [bold]tensorboard --logdir {args.log_dir}[/bold]")
    console.print(f"Health report:       [bold]gradwatch summary {args.log_dir}[/bold]")


if __name__ == "__main__":
    main()
