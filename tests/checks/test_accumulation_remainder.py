"""``accumulation_remainder``: the micro-batches left at an epoch's end summed into the next epoch's first
update (``if (i + 1) % accum == 0: step()`` over a loader whose length is not a multiple of accum,
timoschick/pet#36). Reported once, at the second such update, naming the first; silent on every healthy way
of accumulating."""

from __future__ import annotations

import itertools
import random
from typing import Any

import torch
from torch import nn

import gradwatch

ACC = 4


def _data(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 6, generator=g), torch.randn(8, 1, generator=g)) for _ in range(n)]


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 1))
    return model, torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)


def _epochs(
    model: nn.Module, opt: torch.optim.Optimizer, n: int, epochs: int = 3, *, flush: bool = False,
    zero_at_start: bool = False,
) -> None:
    data = _data(n)
    for _ in range(epochs):
        if zero_at_start:
            opt.zero_grad()
        for i, (x, y) in enumerate(data):
            (nn.functional.mse_loss(model(x), y) / ACC).backward()
            if (i + 1) % ACC == 0 or (flush and i + 1 == len(data)):
                opt.step()
                opt.zero_grad()


def _run(n: int, **kw: object) -> tuple[gradwatch.Watcher, nn.Module]:
    model, opt = _model()
    with gradwatch.watch(model, opt, console=False) as gw:
        _epochs(model, opt, n, **kw)  # type: ignore[arg-type]
    return gw, model


def _found(gw: Any) -> list[gradwatch.Finding]:
    return [f for f in gw.findings if f.kind == "accumulation_remainder"]


def test_remainder_of_each_epoch_is_reported_at_the_first_epoch_boundary() -> None:
    # 30 batches, accum 4: 7 updates per epoch, then 2 batches carried into the next epoch's first update.
    gw, model = _run(30)
    found = _found(gw)
    assert [(f.step, f.severity) for f in found] == [(7, "warning")]
    f = found[0]
    assert f.data["micro_batches"] == 6 and f.data["usual"] == 4 and f.data["period"] == 7
    assert "steps 7 and 14" in f.message
    assert "i + 1 == len(loader)" in f.message and "zero_grad() at the start of each epoch" in f.message
    assert [k.kind for k in gw.findings] == ["accumulation_remainder"]
    bare, opt = _model()
    _epochs(bare, opt, 30)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), bare.state_dict().values()))


def test_epoch_shorter_than_two_updates() -> None:
    # 7 batches, accum 4: one update per epoch, each after the first carries the 3 batches before it.
    found = _found(_run(7)[0])
    assert [(f.step, f.data["micro_batches"], f.data["period"]) for f in found] == [(1, 7, 1)]
    assert "the run's first update summed 4" in found[0].message


def test_healthy_accumulation_is_silent() -> None:
    for kw in ({"flush": True}, {"zero_at_start": True}):
        gw, _ = _run(30, **kw)
        assert gw.findings == [], kw
    gw, _ = _run(32)  # a multiple of accum
    assert gw.findings == []


def test_changed_or_varying_accumulation_is_silent() -> None:
    rng = random.Random(0)
    plans = {
        "schedule": [4] * 7 + [6] * 20,  # accum 4 for 7 updates, then 6 from there on
        "back and forth": [4] * 7 + [6] + [4] * 6 + [5] + [4] * 6,  # the second longer update has another count
        "token budget": [rng.choice([3, 4, 5, 6]) for _ in range(40)],
    }
    for name, plan in plans.items():
        model, opt = _model()
        it = itertools.cycle(_data(50))
        with gradwatch.watch(model, opt, console=False) as gw:
            for k in plan:
                for _ in range(k):
                    x, y = next(it)
                    (nn.functional.mse_loss(model(x), y) / k).backward()
                opt.step()
                opt.zero_grad()
        assert _found(gw) == [], name


def test_extra_pass_on_the_same_forward_is_not_a_remainder() -> None:
    # Every 7th update one micro-batch backpropagates a regularizer separately (two passes, one forward).
    model, opt = _model()
    data = _data(120)
    with gradwatch.watch(model, opt, console=False) as gw:
        for i, (x, y) in enumerate(data):
            out = model(x)
            if i % (7 * ACC) == 0 and i:
                out.pow(2).mean().mul(1e-3).backward(retain_graph=True)
            (nn.functional.mse_loss(out, y) / ACC).backward()
            if (i + 1) % ACC == 0:
                opt.step()
                opt.zero_grad()
    assert _found(gw) == []


def test_lightning_steps_the_remainder_itself(lightning_pytorch: Any) -> None:
    # Trainer(accumulate_grad_batches=4) over 10 batches an epoch: Lightning steps on the epoch's last batch.
    from conftest import tiny_module, tiny_trainer

    from gradwatch.lightning import GradWatchCallback

    cb = GradWatchCallback(console=False)
    trainer = tiny_trainer(lightning_pytorch, [cb], max_epochs=4, max_steps=-1, limit_train_batches=10,
                           accumulate_grad_batches=4)
    trainer.fit(tiny_module(lightning_pytorch))
    assert cb.engine is not None and cb.engine.step_counts == [12]
    assert cb.findings == []


def _manual_remainder_class(ns: Any) -> type:
    class ManualRemainder(ns.LightningModule):  # type: ignore[misc,name-defined]
        """Manual optimization stepping when (batch_idx + 1) % 4 == 0 over 10 batches an epoch."""

        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            torch.manual_seed(0)
            self.layer = nn.Linear(8, 1)

        def training_step(self, batch: Any, batch_idx: int) -> None:
            opt = self.optimizers()
            self.manual_backward(nn.functional.mse_loss(self.layer(batch[0]), batch[1]) / ACC)
            if (batch_idx + 1) % ACC == 0:
                opt.step()
                opt.zero_grad()

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=1e-2)

    return ManualRemainder


def test_lightning_manual_optimization_gets_the_fix_in_its_own_terms(pl_ns: Any) -> None:
    # The plain loop's `i + 1 == len(loader)` names nothing a training_step has: its batch index is batch_idx
    # and the epoch's length is the Trainer's num_training_batches.
    from helpers import tiny_data, tiny_trainer

    from gradwatch.lightning import GradWatchCallback

    cb = GradWatchCallback(console=False)
    tiny_trainer(pl_ns, [cb], max_epochs=4, max_steps=-1).fit(_manual_remainder_class(pl_ns)(), tiny_data(n=80))
    [f] = _found(cb)
    assert "batch_idx + 1 == self.trainer.num_training_batches" in f.fix
    assert "self.optimizers().zero_grad() in on_train_epoch_start" in f.fix
    assert "len(loader)" not in f.fix
