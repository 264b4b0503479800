"""none_grad: a submodule unused in every member of a ModuleList at once is reported at the first step;
members idle on some batches (mixture-of-experts routing) keep their grace."""

from __future__ import annotations

import torch
from torch import nn

import gradwatch


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln_1, self.fc, self.ln_3 = nn.LayerNorm(d), nn.Linear(d, d), nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(self.ln_1(x))  # ln_3 is never called


class Blocks(nn.Module):
    def __init__(self, n: int = 3) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Block(8) for _ in range(n))
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


class ExpertMoE(nn.Module):
    """Top-1 routing over 4 two-layer experts (each with its own LayerNorm): experts without tokens idle."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.router = nn.Linear(8, 4)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)) for _ in range(4)
        )
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = torch.softmax(self.router(x), dim=-1)
        choice = gate.argmax(dim=-1)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            picked = choice == i
            if picked.any():
                out[picked] = expert(x[picked]) * gate[picked, i : i + 1]
        return self.head(out)


def _train(model: nn.Module, steps: int, rows: int = 6) -> gradwatch.Watcher:
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    with gradwatch.watch(model, opt, console=False) as gw:
        for step in range(steps):
            x = torch.randn(rows, 8, generator=g)
            if step == 0:
                x = x[[0] * rows]  # one expert only on the first batch
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
    return gw


def test_a_submodule_unused_in_every_member_of_a_module_list_is_reported_at_the_first_step() -> None:
    gw = _train(Blocks(), 30)
    found = [f for f in gw.findings if f.kind == "none_grad"]
    assert [(f.step, f.params) for f in found] == [
        (0, tuple(f"blocks.{i}.ln_3.{w}" for i in range(3) for w in ("weight", "bias")))
    ], [(f.kind, f.step) for f in gw.findings]
    assert "ln_3 got no gradient in any of the 3 members of blocks" in found[0].message


def test_experts_idle_on_some_batches_stay_quiet() -> None:
    gw = _train(ExpertMoE(), 40)
    assert [f for f in gw.findings if f.kind == "none_grad"] == [], [(f.kind, f.step) for f in gw.findings]


def test_a_part_unused_in_some_members_only_keeps_the_grace() -> None:
    # ln_3 unused in block 0 only (the others call it): a per-member difference, like routing; it waits.
    class Partly(Blocks):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for i, b in enumerate(self.blocks):
                x = b(x) if i == 0 else b.ln_3(b(x))
            return self.head(x)

    gw = _train(Partly(), 30)
    found = [(f.step, f.params) for f in gw.findings if f.kind == "none_grad"]
    assert found == [(24, ("blocks.0.ln_3.weight", "blocks.0.ln_3.bias"))], found
