"""Golden files: what a user reads, pinned word for word.

Each program below is a tiny training loop with one planted fault (or none). What it shows a user is
compared with ``tests/golden/<name>.out``: the console's panels in the order printed (title and related
lines), every finding in full (title, message, table) and the end-of-run summary. A change in any word a
user reads shows up here as a diff; when the change is intended, regenerate the files and review the diff:

    GRADWATCH_GOLDEN=regen python -m pytest tests/test_golden.py

Numbers with a decimal point or an exponent are masked (``#``) and runs of spaces are collapsed: the
digits move with the CPU, the thread count and the BLAS (and with them the console's line breaks and
column widths), while the words, the steps and the places must not.
"""

from __future__ import annotations

import io
import itertools
import os
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from rich.console import Console
from torch import nn

import gradwatch

GOLDEN = Path(__file__).parent / "golden"
WIDTH = 100

_FLOAT = re.compile(r"(?<![\w.])[-+]?(?:\d+\.\d+(?:e[-+]?\d+)?|\d+e[-+]?\d+)(?![\d.])")
_LINE = re.compile(r"((?:line|\.py:)\s?)\d+")
_PATH = re.compile(r"(/[^\s:'\"()]+)+/(?=[\w.]+\.py)")


def mask(text: str) -> str:
    """Mask what moves from machine to machine: float digits, line numbers, absolute paths."""
    text = _PATH.sub("<path>/", text)
    text = _LINE.sub(r"\1<n>", text)
    return _FLOAT.sub("#", text)


def console(width: int = WIDTH) -> Console:
    return Console(file=io.StringIO(), width=width, color_system=None, legacy_windows=False)


_TITLE = re.compile(r"gradwatch (?:info|warning|error): \w+ at step \d+(?: \(\+\d+ related\))?")
_RELATED = re.compile(r"^│ (- \w+): ", flags=re.MULTILINE)


def panels(text: str) -> list[str]:
    """The console's panels in print order: each title, then the kinds of its "Also at step" lines."""
    out = []
    for chunk in re.split(r"[╭┏]", text)[1:]:
        title = _TITLE.search(chunk.split("\n", 1)[0])
        if title:
            out += [title.group(0), *(f"  {kind}" for kind in _RELATED.findall(chunk))]
    out += [line.strip() for line in text.splitlines() if "are recorded but not printed" in line]
    return out


def flat(text: str) -> str:
    """One rendered line per line, digits masked, runs of spaces and rules collapsed."""
    lines = (re.sub(r"([─━═ ])\1+", r"\1", mask(line)).strip() for line in text.splitlines())
    return "\n".join(line for line in lines if line)


def shown(f: gradwatch.Finding) -> str:
    """A finding as data: its title, its message and its table, unwrapped."""
    lines = [f"## {f.kind} at step {f.step} [{f.severity}] op={f.op} module={f.module} params={list(f.params)}"]
    lines += [mask(f.message)]
    for row in f.data.get("table") or []:
        lines.append("| " + " | ".join(f"{k}={mask(str(v))}" for k, v in row.items()))
    return "\n".join(lines)


def golden_text(out: Console, gw: gradwatch.Watcher) -> str:
    summary = console(width=250)
    summary.print(gw.summary())
    return "\n\n".join(
        [
            "# console\n" + "\n".join(panels(out.file.getvalue())),
            "# findings\n" + "\n\n".join(shown(f) for f in gw.findings),
            "# summary\n" + flat(summary.file.getvalue()),
        ]
    ) + "\n"


def batches(n: int, shape: tuple[int, ...] = (8, 8), seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g) for _ in range(n)]


def mlp(*sizes: int, act: type[nn.Module] = nn.ReLU) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(sizes):
        layers += [nn.Linear(a, b), act()]
    return nn.Sequential(*layers[:-1])


def step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, scale: float = 1.0) -> None:
    opt.zero_grad()
    (model(x).pow(2).mean() * scale).backward()
    opt.step()


# -- programs: each runs a loop under gradwatch.watch(console=out) and returns nothing ---------------------
class LogSoftmaxByHand(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.head = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(torch.softmax(self.head(self.body(x)), dim=-1))


def nan_from_log_of_softmax(out: Console) -> gradwatch.Watcher:
    model = LogSoftmaxByHand()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradwatch.watch(model, opt, console=out) as gw:
        for i, x in enumerate(batches(5)):
            loss = F.nll_loss(model(x * (1e4 if i == 3 else 1)), torch.arange(8) % 5)
            gw.observe_loss(loss)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return gw


class SqrtNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return h / torch.sqrt((h * h).sum(-1, keepdim=True))


def nan_from_sqrt_at_zero(out: Console) -> gradwatch.Watcher:
    model = SqrtNorm()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradwatch.watch(model, opt, console=out) as gw:
        for i, x in enumerate(batches(4)):
            if i == 2:
                with torch.no_grad():
                    model.fc.weight.zero_()
                    model.fc.bias.zero_()
            step(model, opt, x)
    return gw


def nan_in_the_batch(out: Console) -> gradwatch.Watcher:
    model = mlp(8, 16, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradwatch.watch(model, opt, console=out) as gw:
        for i, x in enumerate(batches(4)):
            if i == 2:
                x[3, 1] = float("nan")
            step(model, opt, x)
    return gw


def zero_grad_forgotten(out: Console) -> gradwatch.Watcher:
    model = mlp(8, 16, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradwatch.watch(model, opt, console=out) as gw:
        for x in batches(4):
            model(x).pow(2).mean().backward()
            opt.step()
    return gw


def zero_grad_between_backward_and_step(out: Console) -> gradwatch.Watcher:
    model = mlp(8, 16, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradwatch.watch(model, opt, console=out) as gw:
        for x in batches(3):
            model(x).pow(2).mean().backward()
            opt.zero_grad()
            opt.step()
    return gw


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)
        self.aux_head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(x)))


def unused_head(out: Console) -> gradwatch.Watcher:
    model = TwoHeads()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with gradwatch.watch(model, opt, console=out) as gw:
        for x in batches(3):
            step(model, opt, x)
    return gw


def layer_added_after_the_optimizer(out: Console) -> gradwatch.Watcher:
    model = mlp(8, 16, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    torch.manual_seed(1)
    model.append(nn.Linear(1, 1))
    with gradwatch.watch(model, opt, console=out) as gw:
        for x in batches(3):
            step(model, opt, x)
    return gw


def step_without_backward(out: Console) -> gradwatch.Watcher:
    model = mlp(8, 16, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradwatch.watch(model, opt, console=out) as gw:
        for x in batches(2):
            opt.zero_grad()
            model(x).pow(2).mean()
            opt.step()
    return gw


def loss_weight_typo(out: Console) -> gradwatch.Watcher:
    model = mlp(8, 16, 16, 1, act=nn.Tanh)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with gradwatch.watch(model, opt, console=out) as gw:
        for i, x in enumerate(batches(32)):
            step(model, opt, x, scale=1e4 if i >= 30 else 1.0)
    return gw


def deep_sigmoid_vanishing(out: Console) -> gradwatch.Watcher:
    torch.manual_seed(0)
    model = mlp(8, *[32] * 16, 1, act=nn.Sigmoid)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradwatch.watch(model, opt, console=out) as gw:
        for x in batches(60, seed=1):
            step(model, opt, x)
    return gw


def dead_relu_layer(out: Console) -> gradwatch.Watcher:
    model = mlp(8, 16, 16, 1)
    with torch.no_grad():
        model[2].bias.fill_(-1e3)  # every unit of the second layer is negative: ReLU passes nothing back
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with gradwatch.watch(model, opt, console=out) as gw:
        for x in batches(30):
            step(model, opt, x)
    return gw


def loss_spike_observed(out: Console) -> gradwatch.Watcher:
    model = mlp(8, 16, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with gradwatch.watch(model, opt, console=out) as gw:
        for i, x in enumerate(batches(40)):
            loss = model(x).pow(2).mean() + (1e6 if i == 30 else 0.0)
            gw.observe_loss(loss)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return gw


class GatedHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(8, 8)
        self.gate = nn.Sigmoid()
        self.act = nn.ReLU(inplace=True)
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.act(self.gate(self.fc(x))))


def inplace_relu_after_sigmoid(out: Console) -> gradwatch.Watcher:
    model = GatedHead()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError), gradwatch.watch(model, opt, console=out) as gw:
        for x in batches(2):
            step(model, opt, x)
    return gw


def backward_twice(out: Console) -> gradwatch.Watcher:
    model = mlp(8, 16, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError), gradwatch.watch(model, opt, console=out) as gw:
        total = torch.zeros(())
        for x in batches(3):
            total = total + model(x).pow(2).mean()
            opt.zero_grad()
            total.backward()
            opt.step()
    return gw


def loss_under_no_grad(out: Console) -> gradwatch.Watcher:
    model = mlp(8, 16, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError), gradwatch.watch(model, opt, console=out) as gw:
        for x in batches(2):
            with torch.no_grad():
                loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    return gw


def unreduced_loss(out: Console) -> gradwatch.Watcher:
    model = mlp(8, 16, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError), gradwatch.watch(model, opt, console=out) as gw:
        for x in batches(2):
            opt.zero_grad()
            model(x).pow(2).backward()
            opt.step()
    return gw


def weight_decay_typo(out: Console) -> gradwatch.Watcher:
    model = mlp(8, 16, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=5000.0)
    with gradwatch.watch(model, opt, console=out) as gw:
        for x in batches(2):
            step(model, opt, x)
    return gw


def nan_every_step(out: Console) -> gradwatch.Watcher:
    model = mlp(8, 16, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(gradwatch.GradWatchError), gradwatch.watch(model, opt, console=out, max_skips=3) as gw:
        for x in batches(6):
            opt.zero_grad()
            (model(x).pow(2).mean() * float("nan")).backward()
            opt.step()
    return gw


def frozen_layer_still_moved(out: Console) -> gradwatch.Watcher:
    model = mlp(8, 16, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with gradwatch.watch(model, opt, console=out) as gw:
        for i, x in enumerate(batches(4)):
            if i == 2:
                model[0].requires_grad_(False)  # its .grad stays a zero tensor: momentum keeps moving it
            opt.zero_grad(set_to_none=False)
            model(x).pow(2).mean().backward()
            opt.step()
    return gw


def learning_rate_far_too_high(out: Console) -> gradwatch.Watcher:
    model = mlp(8, 16, 1)
    opt = torch.optim.SGD(model.parameters(), lr=50.0)
    with gradwatch.watch(model, opt, console=out, update_ratio_every=1) as gw:
        for x in batches(3):
            step(model, opt, x)
    return gw


def healthy_run(out: Console) -> gradwatch.Watcher:
    model = mlp(8, 16, 1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with gradwatch.watch(model, opt, console=out) as gw:
        for x in batches(30):
            loss = model(x).pow(2).mean()
            gw.observe_loss(loss)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return gw


PROGRAMS: dict[str, Callable[[Console], gradwatch.Watcher]] = {
    f.__name__: f
    for f in (
        nan_from_log_of_softmax,
        nan_from_sqrt_at_zero,
        nan_in_the_batch,
        zero_grad_forgotten,
        zero_grad_between_backward_and_step,
        unused_head,
        layer_added_after_the_optimizer,
        step_without_backward,
        loss_weight_typo,
        deep_sigmoid_vanishing,
        dead_relu_layer,
        loss_spike_observed,
        inplace_relu_after_sigmoid,
        backward_twice,
        loss_under_no_grad,
        unreduced_loss,
        weight_decay_typo,
        nan_every_step,
        frozen_layer_still_moved,
        learning_rate_far_too_high,
        healthy_run,
    )
}


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_console_output_matches_its_golden_file(name: str) -> None:
    out = console()
    text = golden_text(out, PROGRAMS[name](out))
    path = GOLDEN / f"{name}.out"
    if os.environ.get("GRADWATCH_GOLDEN") == "regen":
        GOLDEN.mkdir(exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"{path} is missing: run with GRADWATCH_GOLDEN=regen to create it"
    assert text == path.read_text(), f"console output of {name} changed; see the diff above"


def test_every_golden_file_has_its_program() -> None:
    assert sorted(p.stem for p in GOLDEN.glob("*.out")) == sorted(PROGRAMS)


def test_the_mask_hides_digits_but_keeps_steps_and_words() -> None:
    text = "norm 1.5e+04 at step 30, 12.5x the 0.002077 of line 88 in /tmp/x/y/model.py:17"
    assert mask(text) == "norm # at step 30, #x the # of line <n> in <path>/model.py:<n>"
