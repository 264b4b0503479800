"""A long accumulation of large micro-batches: gradwatch does not keep every one of the step's inputs alive."""

from __future__ import annotations

import gc
import weakref

import torch
from torch import nn

import gradwatch
from gradwatch.diagnose.capture import MAX_GRADS, MAX_INPUT_BYTES


def test_the_inputs_a_step_keeps_for_replay_stay_within_the_byte_budget() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 4), nn.ReLU(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    rows = MAX_INPUT_BYTES // (256 * 4) // 4  # four micro-batches fill the budget
    k = 16  # accumulated micro-batches per step: four times the budget in all
    alive: list[weakref.ref[torch.Tensor]] = []
    with gradwatch.watch(model, opt, console=False) as gw:
        for _ in range(2):
            for _ in range(k):
                x = torch.randn(rows, 256)
                alive.append(weakref.ref(x))
                (model(x).pow(2).mean() / k).backward()
                del x
            gc.collect()
            held = sum(r() is not None for r in alive[-k:])
            assert MAX_GRADS <= held <= 5, held  # the budget's worth, not all 16
            opt.step()
            opt.zero_grad()
    assert not gw.findings
