"""Optimizer set-ups beyond one ``torch.optim`` optimizer over the model: wrappers whose own ``step()``
is bypassed (SAM) or never initialized (Lookahead ports), optimizers re-created mid-run, learnable loss
parameters, and optimizers over inputs of a frozen model (style transfer)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import kinds
from torch import nn

import gradwatch


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def data(n: int, nan_at: int = -1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)
        if i == nan_at:
            x[0, 0] = float("nan")
        out.append((x, y))
    return out


def finite(model: nn.Module) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


# https://github.com/davda54/sam (sam.py): first_step/second_step, base_optimizer.step() inside.
class SAM(torch.optim.Optimizer):
    def __init__(self, params: Any, base_optimizer: Any, rho: float = 0.05, **kwargs: Any) -> None:
        super().__init__(params, dict(rho=rho, **kwargs))
        self.base_optimizer = base_optimizer(self.param_groups, **kwargs)
        self.param_groups = self.base_optimizer.param_groups
        self.defaults.update(self.base_optimizer.defaults)

    @torch.no_grad()
    def first_step(self, zero_grad: bool = False) -> None:
        norm = torch.norm(
            torch.stack([p.grad.norm(2) for g in self.param_groups for p in g["params"] if p.grad is not None]), 2
        )
        for group in self.param_groups:
            scale = group["rho"] / (norm + 1e-12)
            for p in group["params"]:
                if p.grad is None:
                    continue
                self.state[p]["old_p"] = p.data.clone()
                p.add_(p.grad * scale.to(p))
        if zero_grad:
            self.zero_grad()

    @torch.no_grad()
    def second_step(self, zero_grad: bool = False) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.data = self.state[p]["old_p"]
        self.base_optimizer.step()
        if zero_grad:
            self.zero_grad()

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        closure = torch.enable_grad()(closure)
        self.first_step(zero_grad=True)
        closure()
        self.second_step()


@pytest.mark.parametrize("style", ["first_second_step", "step_closure"])
def test_sam_is_checked_every_step_and_a_nan_batch_is_skipped(style: str) -> None:
    model = mlp()
    opt = SAM(model.parameters(), torch.optim.SGD, lr=0.05, momentum=0.9)
    loss_fn = nn.MSELoss()
    with gradwatch.watch(model, opt, console=False) as gw:
        for x, y in data(10, nan_at=5):
            if style == "first_second_step":
                loss_fn(model(x), y).backward()
                opt.first_step(zero_grad=True)
                loss_fn(model(x), y).backward()
                opt.second_step(zero_grad=True)
            else:

                def closure(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
                    loss = loss_fn(model(x), y)
                    loss.backward()
                    return loss

                closure()
                opt.step(closure)
                opt.zero_grad()
    assert gw.summary().steps_checked == 10
    assert ("nonfinite_grad", 5) in kinds(gw, info=False), kinds(gw, info=False)
    assert {step for kind, step in kinds(gw, info=False) if kind.startswith("nonfinite")} == {5}
    assert not [k for k in kinds(gw, info=False) if k[0] == "unwatched_optimizer"]
    assert finite(model)
    assert not [f for f in gw.findings if f.data.get("no_update")]  # the first pass is the same step's
    inputs = [f for f in gw.findings if f.kind == "nonfinite_input"]
    assert inputs and inputs[0].message.count("args[0]") == 1  # one batch, fed to both passes


def test_sam_healthy_run_is_silent_and_unchanged() -> None:
    def run(watched: bool) -> nn.Module:
        model = mlp()
        opt = SAM(model.parameters(), torch.optim.SGD, lr=0.05, momentum=0.9)
        gw = gradwatch.watch(model, opt, console=False) if watched else None
        for x, y in data(8):
            nn.functional.mse_loss(model(x), y).backward()
            opt.first_step(zero_grad=True)
            nn.functional.mse_loss(model(x), y).backward()
            opt.second_step(zero_grad=True)
        if gw is not None:
            gw.close()
            assert kinds(gw, info=False) == [], kinds(gw, info=False)
        return model

    for a, b in zip(run(False).parameters(), run(True).parameters()):
        assert torch.equal(a, b)


# https://github.com/lonePatient/lookahead_pytorch (optimizer.py): never calls Optimizer.__init__.
class Lookahead(torch.optim.Optimizer):
    def __init__(self, optimizer: torch.optim.Optimizer, alpha: float = 0.5, k: int = 5) -> None:
        self.optimizer = optimizer
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state
        self.defaults = optimizer.defaults
        self.alpha, self.k, self.counter = alpha, k, 0
        self.slow = [[p.detach().clone() for p in g["params"]] for g in self.param_groups]

    def step(self, closure: Any = None) -> Any:
        loss = self.optimizer.step(closure)
        self.counter += 1
        if self.counter % self.k == 0:
            for group, slow in zip(self.param_groups, self.slow):
                for p, q in zip(group["params"], slow):
                    q.add_(p.detach() - q, alpha=self.alpha)
                    p.data.copy_(q)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none)


def test_lookahead_without_optimizer_init_is_watched_through_its_inner_optimizer() -> None:
    model = mlp()
    opt = Lookahead(torch.optim.Adam(model.parameters(), lr=1e-2))
    with gradwatch.watch(model, opt, console=False) as gw:
        for x, y in data(12, nan_at=7):
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    assert gw.summary().steps_checked == 12
    assert {step for kind, step in kinds(gw, info=False) if kind.startswith("nonfinite")} == {7}, kinds(gw, info=False)
    assert finite(model)


# https://www.codegenes.net/blog/pytorch-reset-optimizer ("reset the optimizer by re-initializing it")
def test_optimizer_recreated_mid_run_is_reported_once_at_its_first_step() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with gradwatch.watch(model, opt, console=False) as gw:
        for i, (x, y) in enumerate(data(10)):
            if i == 5:
                opt = torch.optim.SGD(model.parameters(), lr=0.01)  # a new learning rate: a new optimizer
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    found = [f for f in gw.findings if f.kind == "unwatched_optimizer"]
    assert [(f.step, f.severity) for f in found] == [(5, "warning")]
    assert set(found[0].params) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert "gradwatch.watch(model" in found[0].message


def test_optimizer_recreated_every_epoch_is_reported_at_the_run_step_it_takes_over() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with gradwatch.watch(model, opt, console=False) as gw:
        for epoch in range(4):
            if epoch:
                opt = torch.optim.SGD(model.parameters(), lr=0.05 / (epoch + 1))
            for x, y in data(5):
                opt.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                opt.step()
    assert [f.step for f in gw.findings if f.kind == "unwatched_optimizer"] == [5, 10, 15]


def test_optimizer_of_another_model_is_not_reported_as_unwatched() -> None:
    model, other = mlp(), nn.Linear(8, 1)
    opt, opt_other = torch.optim.SGD(model.parameters(), lr=0.05), torch.optim.SGD(other.parameters(), lr=0.05)
    with gradwatch.watch(model, opt, console=False) as gw:
        for x, y in data(4):
            for o, m in ((opt, model), (opt_other, other)):
                o.zero_grad()
                nn.functional.mse_loss(m(x), y).backward()
                o.step()
    assert kinds(gw, info=False) == []


# https://github.com/KaiyangZhou/pytorch-center-loss (centers trained by the model's optimizer)
def test_learnable_loss_parameters_in_the_optimizer_are_not_foreign_params() -> None:
    model = mlp()
    centers = nn.Parameter(torch.randn(4, 1))
    temperature = nn.Parameter(torch.zeros(()))
    opt = torch.optim.Adam([*model.parameters(), centers, temperature], lr=1e-3)
    with gradwatch.watch(model, opt, console=False) as gw:
        for x, y in data(6):
            out = model(x)
            loss = nn.functional.mse_loss(out, y) * torch.exp(-temperature) + temperature
            loss = loss + (out - centers[0]).pow(2).mean() * 0.01
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert kinds(gw, info=False) == [], kinds(gw, info=False)


# https://pytorch.org/tutorials/advanced/neural_style_tutorial.html (the input image is optimized)
def test_optimizing_the_input_of_a_frozen_model_is_watched() -> None:
    model = mlp().requires_grad_(False)
    image = torch.randn(4, 8, requires_grad=True)
    opt = torch.optim.Adam([image], lr=0.05)
    with gradwatch.watch(model, opt, console=False) as gw:
        for step in range(6):
            opt.zero_grad()
            loss = model(image).pow(2).mean()
            if step == 3:
                loss = loss * float("nan")
            loss.backward()
            opt.step()
    assert {k for k in kinds(gw, info=False) if k[0] != "nan_origin"} == {("nonfinite_grad", 3)}, kinds(gw, info=False)
    assert bool(torch.isfinite(image).all())


def test_forgotten_unfreeze_is_explained_when_backward_fails() -> None:
    model = mlp().requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="does not require grad"):
        with gradwatch.watch(model, opt, console=False) as gw:
            for x, y in data(2):
                opt.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                opt.step()
    found = [f for f in gw.findings if f.kind == "no_grad_graph"]
    assert found and found[0].data.get("cause") == "all_frozen", [(f.kind, f.data) for f in gw.findings]


# https://discuss.pytorch.org/t/why-there-is-still-a-small-change-in-frozen-layer-parameters/153740
# A parameter frozen mid-run was once picked for a gradient hook (internal error, reported and skipped).
@pytest.mark.filterwarnings("error::gradwatch.GradWatchInternalWarning")
@pytest.mark.parametrize(
    "optimizer,set_to_none,expected",
    [("adam", False, True), ("adamw_lr", False, True), ("adam", True, False), ("sgd", False, False)],
)
def test_layer_frozen_mid_run_that_the_optimizer_still_moves_is_reported(
    optimizer: str, set_to_none: bool, expected: bool
) -> None:
    model = mlp()
    if optimizer == "adam":
        opt: torch.optim.Optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    elif optimizer == "adamw_lr":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)  # no momentum, no decay: a zero grad moves nothing
    with gradwatch.watch(model, opt, console=False) as gw:
        for i, (x, y) in enumerate(data(10)):
            if i == 5:
                model[0].requires_grad_(False)
                frozen = model[0].weight.detach().clone()
            opt.zero_grad(set_to_none=set_to_none)
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    moved = not torch.equal(frozen, model[0].weight)
    found = [f for f in gw.findings if f.kind == "frozen_param_updated"]
    assert moved is expected  # the ground truth the finding must match
    assert [(f.step, f.params) for f in found] == ([(5, ("0.weight", "0.bias"))] if expected else [])


def test_nan_in_one_of_two_optimizers_skips_and_says_only_that_optimizer() -> None:
    model = mlp()
    first, second = list(model[0].parameters()), list(model[2].parameters())
    opt_a, opt_b = torch.optim.SGD(first, lr=0.05), torch.optim.SGD(second, lr=0.05)
    with gradwatch.watch(model, [opt_a, opt_b], console=False) as gw:
        for i, (x, y) in enumerate(data(4)):
            for o in (opt_a, opt_b):
                o.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            if i == 2:
                model[0].weight.grad[0, 0] = float("nan")  # only optimizer 0's gradients
            before = [p.detach().clone() for p in second]
            opt_a.step()
            opt_b.step()
            if i == 2:
                assert any(not torch.equal(b, p) for b, p in zip(before, second))  # optimizer 1 stepped
    (f,) = [f for f in gw.findings if f.kind == "nonfinite_grad"]
    assert f.step == 2 and "skipped optimizer 0's update" in f.message


@pytest.mark.parametrize("every", [1, 2])
def test_optimizer_created_inside_the_loop_is_reported_once_as_recreated(every: int) -> None:
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with gradwatch.watch(model, opt, console=False) as gw:
        for i, (x, y) in enumerate(data(20)):
            if i % every == 0:
                opt = torch.optim.Adam(model.parameters(), lr=1e-3)  # the bug: a fresh state every step or two
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    kinds = [(f.kind, f.step) for f in gw.findings]
    assert kinds == [("unwatched_optimizer", 0), ("optimizer_recreated", 2 * every)], kinds
    assert "before the training loop" in gw.findings[1].message


def test_optimizer_recreated_every_epoch_is_not_per_step() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradwatch.watch(model, opt, console=False) as gw:
        for _ in range(3):
            opt = torch.optim.SGD(model.parameters(), lr=0.01)  # a new one per epoch of 4 steps
            for x, y in data(4):
                loss = nn.functional.mse_loss(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
    assert {f.kind for f in gw.findings} == {"unwatched_optimizer"}


def test_a_fresh_parameter_added_to_the_optimizer_every_step_is_reported_once() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradwatch.watch(model, opt, console=False) as gw:
        for x, y in data(12):
            opt.add_param_group({"params": [nn.Parameter(torch.zeros(1))]})  # piles up, never used
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert [f.kind for f in gw.findings] == ["foreign_params"]


def test_a_wrapper_without_step_hooks_or_an_inner_optimizer_is_refused_with_what_to_pass() -> None:
    class Averaging(torch.optim.Optimizer):  # never runs Optimizer.__init__; keeps its optimizer elsewhere
        def __init__(self, params: Any) -> None:
            self.param_groups = [{"params": list(params)}]
            self.state: dict[Any, Any] = {}

    model = nn.Linear(4, 2)
    with pytest.raises(TypeError, match=r"cannot watch Averaging: .*Pass the torch optimizer that applies"):
        gradwatch.watch(model, Averaging(model.parameters()))


def _three_steps(model: nn.Module, opt: torch.optim.Optimizer) -> list[Any]:
    with gradwatch.watch(model, opt, console=False) as gw:
        for _ in range(3):
            loss = model(torch.randn(8, 4)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    return gw.findings


def test_a_weight_decay_typo_is_named_at_the_first_step() -> None:
    # SGD(lr=0.1, weight_decay=5e2) for 5e-4: every step multiplies the weights by -49. It showed as
    # exploding gradients and Inf losses with "clip, lower the learning rate" fixes; weight_decay was
    # never mentioned.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    findings = _three_steps(model, torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=5e2))
    (f,) = [f for f in findings if f.kind == "weight_decay_too_large"]
    assert f.step == 0 and f.data["weight_decay"] == 500.0 and "-49" in f.message


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1),
    lambda ps: torch.optim.SGD(ps, lr=0.5, momentum=0.9, weight_decay=5e-4),
    lambda ps: torch.optim.SGD([{"params": ps, "weight_decay": 1.0, "lr": 0.5}]),
])
def test_usual_weight_decay_settings_are_not_flagged(make: Any) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    findings = _three_steps(model, make(list(model.parameters())))
    assert not any(f.kind == "weight_decay_too_large" for f in findings)


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.Adam(ps, lr=0.1, weight_decay=10.0),
    lambda ps: torch.optim.Adagrad(ps, lr=0.5, weight_decay=2.0),
])
def test_coupled_l2_in_adaptive_optimizers_is_not_weight_decay_too_large(make: Any) -> None:
    # Adam's or Adagrad's coupled L2 is normalized with the gradient: the weights do not flip and grow.
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    assert not any(f.kind == "weight_decay_too_large" for f in _three_steps(model, make(list(model.parameters()))))


def test_an_optimizer_built_on_another_model_is_one_foreign_params_finding() -> None:
    model, other = mlp(), mlp()
    opt = torch.optim.SGD(other.parameters(), lr=0.05)  # the bug: the other model's parameters
    with gradwatch.watch(model, opt, console=False) as gw:
        for x, y in data(5):
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert kinds(gw, info=False) == [("foreign_params", 0)]
    (finding,) = gw.findings
    assert "build the optimizer from this model's parameters" in finding.message
    assert "holds none of the model's parameters" in finding.message
    assert finding.data["another_model"] is True and finding.data["model_params_not_in_optimizer"] == 4


def test_a_second_model_trained_jointly_in_the_same_optimizer_is_not_flagged() -> None:
    model, critic = mlp(), mlp()
    opt = torch.optim.Adam([*model.parameters(), *critic.parameters()], lr=1e-3)
    with gradwatch.watch(model, opt, console=False) as gw:
        for x, y in data(6):
            loss = nn.functional.mse_loss(model(x), y) + critic(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert kinds(gw, info=False) == []


# https://adversarial-ml-tutorial.org/adversarial_examples/ (PGD: the model is only put in eval mode)
def test_an_adversarial_perturbation_optimized_through_a_trainable_model_is_not_flagged() -> None:
    model = mlp().eval()  # requires_grad stays True, as in most attack code
    x, y = data(1)[0]
    delta = torch.zeros_like(x, requires_grad=True)
    opt = torch.optim.SGD([delta], lr=0.01)
    with gradwatch.watch(model, opt, console=False) as gw:
        for _ in range(6):
            loss = -nn.functional.mse_loss(model(x + delta), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert kinds(gw, info=False) == []


def test_weight_decay_that_a_warm_up_makes_too_large_is_named_when_it_crosses() -> None:
    # nanoGPT-style warm-up writing param_group["lr"] in the loop: at step 0 lr is ~0, and lr * weight_decay
    # (5e2 for 5e-4) crosses 1 at step 10 (lr = 2e-3 of a 6e-3 peak reached at step 30).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.0, weight_decay=5e2)
    with gradwatch.watch(model, opt, console=False) as gw:
        for step in range(40):
            for group in opt.param_groups:
                group["lr"] = 6e-3 * step / 30 if step < 30 else 6e-3
            loss = model(torch.randn(8, 4)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    (f,) = [f for f in gw.findings if f.kind == "weight_decay_too_large"]
    assert f.step in (10, 11) and f.data["weight_decay"] == 500.0


def test_a_warm_up_to_a_usual_weight_decay_is_not_flagged() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.0, weight_decay=0.1)
    with gradwatch.watch(model, opt, console=False) as gw:
        for step in range(40):
            for group in opt.param_groups:
                group["lr"] = 6e-3 * min(1.0, step / 30)
            loss = model(torch.randn(8, 4)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert not any(f.kind == "weight_decay_too_large" for f in gw.findings)


def test_unwatched_and_recreated_optimizers_carry_their_words_as_explanations() -> None:
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with gradwatch.watch(model, opt, console=False) as gw:
        for x, y in data(6):
            opt = torch.optim.Adam(model.parameters(), lr=1e-3)
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    unwatched, recreated = gw.findings
    for f in (unwatched, recreated):
        assert f.explanation is not None and f.message == f.explanation.render()
    assert unwatched.explanation.what.startswith("An optimizer gradwatch does not watch (Adam)")
    assert unwatched.explanation.why.startswith("usually the optimizer was re-created after watch()")
    assert unwatched.fix.startswith("watch every optimizer that updates the model")
    assert recreated.explanation.what.startswith("A new optimizer (Adam) over the same 4 parameter(s)")
    assert recreated.explanation.why.startswith("each one starts with an empty state")
    assert recreated.fix.startswith("create the optimizer once, before the training loop")
