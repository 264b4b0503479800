"""Forgotten ``zero_grad`` (``zero_grad_missing``) and ``zero_grad`` between backward and step
(``grads_cleared_before_step``) in plain loops: flagged at the right step, silent on every healthy way of
clearing or accumulating gradients."""

from __future__ import annotations

import io
from collections.abc import Callable

import pytest
import torch
from helpers import EncoderHead
from rich.console import Console
from torch import nn

import gradwatch
from gradwatch.observe.zero_grad import ZeroGradTracker

Net = EncoderHead


def batches(n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(16, 4, generator=g) for _ in range(n)]


def kinds(gw: gradwatch.Watcher) -> list[tuple[str, int]]:
    return [(f.kind, f.step) for f in gw.findings]


ZERO_KINDS = ("zero_grad_missing", "grads_cleared_before_step")


def zero_kinds(gw: gradwatch.Watcher) -> list[tuple[str, int]]:
    return [k for k in kinds(gw) if k[0] in ZERO_KINDS]


def loop(
    clear: Callable[[nn.Module, torch.optim.Optimizer], None], steps: int = 5, **config: object
) -> gradwatch.Watcher:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    with gradwatch.watch(model, opt, console=False, **config) as gw:
        for x in batches(steps):
            loss = model(x).pow(2).mean()
            clear(model, opt)
            loss.backward()
            opt.step()
    return gw


def _each_grad(model: nn.Module, fn: Callable[[torch.Tensor], None]) -> None:
    for p in model.parameters():
        if p.grad is not None:
            fn(p.grad)


# -- must flag ------------------------------------------------------------------------------------
def test_forgotten_zero_grad_is_flagged_at_the_second_step() -> None:
    gw = loop(lambda model, opt: None)
    assert zero_kinds(gw) == [("zero_grad_missing", 1)]
    f = gw.findings[0]
    assert f.severity == "error"
    assert f.data["optimizer"] == 0
    assert set(f.params) == {"encoder.0.weight", "encoder.0.bias", "head.weight", "head.bias"}
    assert "optimizer.zero_grad()" in f.message


def test_forgotten_zero_grad_is_printed_with_the_fix() -> None:
    buf = io.StringIO()
    console = Console(file=buf, width=120, color_system=None)
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradwatch.watch(model, opt, console=console):
        for x in batches(3):
            model(x).pow(2).mean().backward()
            opt.step()
    text = buf.getvalue()
    assert "gradwatch error: zero_grad_missing at step 1" in text
    assert "optimizer 0 stepped at step 1 with gradients accumulated on top of the previous step's" in text
    assert "call optimizer.zero_grad() (or model.zero_grad()) once per step before loss.backward()" in text


def test_forgotten_zero_grad_with_every_names_the_previous_checked_step() -> None:
    gw = loop(lambda model, opt: None, steps=7, every=3)
    assert zero_kinds(gw) == [("zero_grad_missing", 3)]
    f = gw.findings[0]
    assert f.data["previous_step"] == 0 and f.data["backward_passes"] == 3
    assert "not cleared after the update of step 0 (3 backward passes" in f.message


class Gated(nn.Module):
    """A rarely routed expert behind a scalar gate: the smallest parameter gets a gradient every 5th step."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        self.expert = nn.Linear(4, 2)
        self.gate = nn.Parameter(torch.zeros(()))

    def forward(self, x: torch.Tensor, use_expert: bool) -> torch.Tensor:
        out = self.body(x)
        return out + self.gate.sigmoid() * self.expert(x) if use_expert else out


@pytest.mark.parametrize("forget", [True, False])
def test_forgotten_zero_grad_is_found_when_the_smallest_parameter_is_rarely_used(forget: bool) -> None:
    model = Gated()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    with gradwatch.watch(model, opt, console=False) as gw:
        for i, x in enumerate(batches(12)):
            if not forget:
                opt.zero_grad()
            model(x, use_expert=i % 5 == 0).pow(2).mean().backward()
            opt.step()
    assert zero_kinds(gw) == ([("zero_grad_missing", 2)] if forget else []), kinds(gw)


# https://github.com/KaiyangZhou/pytorch-center-loss (the centers are trained by an optimizer too)
@pytest.mark.parametrize("clear", ["model", "none"])
def test_loss_parameters_not_cleared_by_model_zero_grad_are_named(clear: str) -> None:
    torch.manual_seed(0)
    model = Net()
    centers = nn.Parameter(torch.randn(3, 2))
    opt = torch.optim.SGD([*model.parameters(), centers], lr=0.01)
    with gradwatch.watch(model, opt, console=False) as gw:
        for x in batches(4):
            if clear == "model":
                model.zero_grad()  # leaves the centers' gradient in place
            out = model(x)
            (out.pow(2).mean() + (out[:, :1] - centers[:, :1].mean()).pow(2).mean()).backward()
            opt.step()
    assert zero_kinds(gw) == [("zero_grad_missing", 1)]
    f = gw.findings[0]
    if clear == "model":
        assert f.params == ("<optimizer 0 group 0 param 4 (3, 2)>",)
        assert "model.zero_grad() never clears them: call optimizer.zero_grad()" in f.message
    else:
        assert len(f.params) == 5 and "model.zero_grad() never clears them" not in f.message


# https://discuss.pytorch.org/t/how-to-use-the-backward-functions-for-multiple-losses/1826
@pytest.mark.parametrize("bug", [True, False])
def test_zero_grad_between_two_backward_passes_of_one_step_is_named_as_the_cause(bug: bool) -> None:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradwatch.watch(model, opt, console=False) as gw:
        for x in batches(3):
            h = model.encoder(x)
            task = model.head(h).pow(2).mean()
            regularizer = 1e-3 * h.pow(2).mean()  # reaches the encoder only
            opt.zero_grad()
            task.backward(retain_graph=True)
            if bug:
                opt.zero_grad()  # wipes the task loss's gradients
            regularizer.backward()
            opt.step()
    found = [f for f in gw.findings if f.kind == "none_grad"]
    if bug:
        assert [(f.step, f.params) for f in found] == [(0, ("head.weight", "head.bias"))]
        assert found[0].data["cleared_between_backwards"] is True
        assert "zero_grad() ran between this step's backward passes" in found[0].message
    else:
        assert found == []


@pytest.mark.parametrize("every", [1, 2])
def test_a_branch_unused_on_a_later_step_of_an_ordinary_loop_is_silent(every: int) -> None:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradwatch.watch(model, opt, console=False, every=every) as gw:
        for i, x in enumerate(batches(8)):
            opt.zero_grad()
            h = model.encoder(x)
            loss = h.pow(2).mean() if i == 4 else model.head(h).pow(2).mean()  # the head unused at step 4
            loss.backward()
            opt.step()
    # The head had gradients before: a step without one is intermittent use, not an unused parameter,
    # and the usual zero_grad() at the start of each step is no clearing between backward passes.
    assert [f for f in gw.findings if f.kind == "none_grad"] == []
    assert [f for f in gw.findings if f.severity != "info"] == []


def test_zero_grad_on_the_wrong_optimizer_is_flagged_for_the_other_one() -> None:
    torch.manual_seed(0)
    model = Net()
    opt_enc = torch.optim.SGD(model.encoder.parameters(), lr=0.01)
    opt_head = torch.optim.SGD(model.head.parameters(), lr=0.01)
    with gradwatch.watch(model, [opt_enc, opt_head], console=False) as gw:
        for x in batches(4):
            loss = model(x).pow(2).mean()
            opt_enc.zero_grad()
            opt_enc.zero_grad()  # meant opt_head
            loss.backward()
            opt_enc.step()
            opt_head.step()
    found = [f for f in gw.findings if f.kind == "zero_grad_missing"]
    assert [(f.step, f.data["optimizer"]) for f in found] == [(1, 1)]
    assert set(found[0].params) == {"head.weight", "head.bias"}


# One optimizer over an encoder and a decoder kept as two modules (seq2seq tutorials), only one of them
# zeroed (tester report): the other part accumulates. Named once the next check shows which part it is
# (one step later); found also when the evidence parameter sits in the part that was zeroed.
@pytest.mark.parametrize(
    "zeroed, set_to_none", [("enc", True), ("dec", True), ("dec", False), ("both", True), ("both", False)]
)
def test_zero_grad_on_one_of_the_models_an_optimizer_trains_names_the_other(zeroed: str, set_to_none: bool) -> None:
    torch.manual_seed(0)
    enc = nn.Sequential(nn.Linear(6, 16), nn.Tanh())
    dec = nn.Linear(16, 1)  # holds the smallest parameter (dec.bias)
    opt = torch.optim.Adam([*enc.parameters(), *dec.parameters()], lr=1e-2)
    with gradwatch.watch(nn.ModuleDict({"enc": enc, "dec": dec}), opt, console=False) as gw:
        for _ in range(6):
            for part in (enc, dec):
                if zeroed == "both" or part is {"enc": enc, "dec": dec}[zeroed]:
                    part.zero_grad(set_to_none=set_to_none)
            nn.functional.mse_loss(dec(enc(torch.randn(8, 6))), torch.randn(8, 1)).backward()
            opt.step()
    if zeroed == "both":
        assert kinds(gw) == []
        return
    (f,) = gw.findings
    other = "dec" if zeroed == "enc" else "enc"
    assert (f.kind, f.step) == ("zero_grad_missing", 2)
    assert f.params == tuple(n for n in ("enc.0.weight", "enc.0.bias", "dec.weight", "dec.bias") if n.startswith(other))
    assert f"were cleared: zero_grad() was called on part of the model only ({zeroed}.zero_grad())" in f.message
    assert (
        f"Fix: call optimizer.zero_grad(), which clears every parameter optimizer 0 updates, instead of {zeroed}.zero_grad()"
        in f.message
    )


def test_zero_grad_called_once_before_the_loop_is_flagged() -> None:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradwatch.watch(model, opt, console=False) as gw:
        opt.zero_grad()
        for x in batches(4):
            model(x).pow(2).mean().backward()
            opt.step()
    assert zero_kinds(gw) == [("zero_grad_missing", 1)]


def test_forgotten_zero_grad_is_flagged_with_hand_written_updates() -> None:
    torch.manual_seed(0)
    model = Net()
    with gradwatch.watch(model, console=False) as gw:
        for x in batches(3):
            model(x).pow(2).mean().backward()
            if gw.check():
                with torch.no_grad():
                    for p in model.parameters():
                        p -= 0.01 * p.grad
    assert zero_kinds(gw) == [("zero_grad_missing", 1)]
    text = gw.findings[0].message  # no optimizer to speak of
    assert "optimizer" not in text, text
    assert text.startswith("the update was checked at step 1") and "call model.zero_grad() once per step" in text


def test_forgotten_zero_grad_is_flagged_in_deferred_mode() -> None:
    gw = loop(lambda model, opt: None, deferred=True, on_nonfinite="warn")
    assert zero_kinds(gw) == [("zero_grad_missing", 1)]


def test_zero_grad_between_backward_and_step_is_flagged_not_no_grads() -> None:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradwatch.watch(model, opt, console=False) as gw:
        for x in batches(3):
            model(x).pow(2).mean().backward()
            opt.zero_grad()
            opt.step()
    assert kinds(gw) == [("grads_cleared_before_step", 0)]
    assert "zero_grad() was called between loss.backward() and optimizer.step()" in gw.findings[0].message


@pytest.mark.parametrize("k", [1, 4])
def test_zero_grad_without_set_to_none_between_backward_and_step_is_flagged_at_step_0(k: int) -> None:
    # With k micro-batches: `if (i + 1) % k == 0: opt.zero_grad(set_to_none=False); opt.step()` (PyTorch forums,
    # "loss not decreasing with gradient accumulation"). It came at step 1, zero_grad() at step 0.
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradwatch.watch(model, opt, console=False) as gw:
        for i, x in enumerate(batches(3 * k)):
            (model(x).pow(2).mean() / k).backward()
            if (i + 1) % k == 0:
                opt.zero_grad(set_to_none=False)
                opt.step()
    assert zero_kinds(gw) == [("grads_cleared_before_step", 0)]


# -- must not flag: every healthy way of clearing gradients ----------------------------------------
def test_zero_grad_set_to_none_is_silent() -> None:
    assert kinds(loop(lambda model, opt: opt.zero_grad(set_to_none=True))) == []


def test_zero_grad_without_set_to_none_is_silent() -> None:
    assert kinds(loop(lambda model, opt: opt.zero_grad(set_to_none=False))) == []


def test_model_zero_grad_is_silent() -> None:
    assert kinds(loop(lambda model, opt: model.zero_grad())) == []


def test_grads_set_to_none_by_hand_is_silent() -> None:
    def clear(model: nn.Module, opt: torch.optim.Optimizer) -> None:
        for p in model.parameters():
            p.grad = None

    assert kinds(loop(clear)) == []


def test_grad_zero_in_place_is_silent() -> None:
    assert kinds(loop(lambda model, opt: _each_grad(model, lambda g: g.zero_()))) == []


def test_grad_data_zero_in_place_is_silent() -> None:
    # .data.zero_() leaves grad._version alone: the value of the old gradient decides.
    assert kinds(loop(lambda model, opt: _each_grad(model, lambda g: g.data.zero_()))) == []


def test_gradient_clipping_between_backward_and_step_is_silent() -> None:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradwatch.watch(model, opt, console=False) as gw:
        for x in batches(5):
            opt.zero_grad(set_to_none=False)
            model(x).pow(2).mean().backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
            opt.step()
    assert kinds(gw) == []


def test_all_zero_gradients_that_are_clipped_are_not_taken_for_cleared_ones() -> None:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradwatch.watch(model, opt, console=False) as gw:
        for x in batches(4):
            opt.zero_grad(set_to_none=False)
            (model(x) * 0).sum().backward()  # every gradient exactly zero
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # changes them in place after backward
            opt.step()
    assert zero_kinds(gw) == []


def test_intentional_accumulation_over_several_backward_calls_is_silent() -> None:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs = batches(12)
    with gradwatch.watch(model, opt, console=False) as gw:
        for i, x in enumerate(xs):
            (model(x).pow(2).mean() / 4).backward()
            if i % 4 == 3:
                opt.step()
                opt.zero_grad(set_to_none=False)
    assert kinds(gw) == []


# The accumulation pattern of https://discuss.pytorch.org/t/pytorch-gradient-accumulation/55955 with
# zero_grad() moved into the micro-batch loop: only the last micro-batch reaches each update.
@pytest.mark.parametrize("where", ["before_backward", "after_each_micro_batch", "clipped_before_step"])
def test_zero_grad_inside_the_accumulation_loop_is_flagged(where: str) -> None:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradwatch.watch(model, opt, console=False) as gw:
        for i, x in enumerate(batches(16)):
            if where != "after_each_micro_batch":
                opt.zero_grad()
            (model(x).pow(2).mean() / 4).backward()
            if i % 4 == 3:
                if where == "clipped_before_step":  # scales the last pass's gradient in place: still its
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
                opt.step()
            if where == "after_each_micro_batch":
                opt.zero_grad()
    found = [f for f in gw.findings if f.kind == "zero_grad_in_accumulation"]
    # At step 0: the first step's own micro-batches, no earlier step for a one-off run of passes to follow.
    assert [(f.step, f.severity) for f in found] == [(0, "warning")]
    assert "last of its 4 backward passes" in found[0].message and "the same happened" not in found[0].message
    assert "right after optimizer.step()" in found[0].message
    assert kinds(gw) == [("zero_grad_in_accumulation", 0)]


# HF Accelerate (huggingface/accelerate#1299): optimizer.zero_grad() at the top of `with
# accelerator.accumulate(model):`. The prepared optimizer clears (and steps) only on the syncing micro-batch,
# so the 3 micro-batches accumulated before it are cleared right before its backward pass, every update.
@pytest.mark.parametrize("set_to_none", [False, True])
def test_zero_grad_before_the_stepping_micro_batch_is_flagged(set_to_none: bool) -> None:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradwatch.watch(model, opt, console=False) as gw:
        for i, x in enumerate(batches(16)):
            sync = i % 4 == 3  # accelerator.sync_gradients
            if sync:  # AcceleratedOptimizer.zero_grad() is a no-op on the other micro-batches
                opt.zero_grad(set_to_none=set_to_none)
            (model(x).pow(2).mean() / 4).backward()
            if sync:
                opt.step()
    found = [f for f in gw.findings if f.kind == "zero_grad_in_accumulation"]
    assert [(f.step, f.severity) for f in found] == [(0, "warning")]
    text = found[0].message
    assert "last of its 4 backward passes" in text and "the 3 passes before it had accumulated" in text
    assert "after optimizer.step()" in text and "accelerator.accumulate" in text
    assert kinds(gw) == [("zero_grad_in_accumulation", 0)]


def test_an_accumulation_window_cleared_once_by_a_skipped_batch_is_silent() -> None:
    # `if not torch.isfinite(loss): opt.zero_grad(); continue` once: that window loses its first
    # micro-batches, the others are whole.
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradwatch.watch(model, opt, console=False) as gw:
        for i, x in enumerate(batches(20)):
            loss = model(x).pow(2).mean() / 4
            if i in (6, 10):  # a bad micro-batch in two windows running (the NaN check stands for it)
                opt.zero_grad()
                continue
            loss.backward()
            if i % 4 == 3:
                opt.step()
                opt.zero_grad()
    assert kinds(gw) == []


def test_two_cleared_backward_passes_per_step_are_silent() -> None:
    # SAM's two passes, an adversarial example's pass before the training pass: zero_grad() in between.
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradwatch.watch(model, opt, console=False) as gw:
        for x in batches(10):
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.zero_grad()
            model(x + 0.01).pow(2).mean().backward()
            opt.step()
    assert kinds(gw) == []


def _pgd_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    # Adversarial training taking the input gradient with model.zero_grad(); loss.backward().
    delta = torch.zeros_like(x, requires_grad=True)
    for _ in range(3):
        model.zero_grad()
        model(x + delta).pow(2).mean().backward()
        with torch.no_grad():
            delta += 0.01 * delta.grad.sign()
        delta.grad = None
    opt.zero_grad()
    model(x + delta.detach()).pow(2).mean().backward()


def _per_term_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, write: str) -> None:
    # One forward, one backward per loss term (each term's gradient logged, or PCGrad's projection).
    out = model(x)
    terms = [out.pow(2).mean(), out.abs().mean(), out.tanh().pow(2).mean()]
    grads = []
    for t in terms:
        opt.zero_grad()
        t.backward(retain_graph=True)
        grads.append([p.grad.clone() for p in model.parameters()])
    if write == "sum_backward":
        opt.zero_grad()
        sum(terms).backward()
    else:
        with torch.no_grad():
            for i, p in enumerate(model.parameters()):
                p.grad.copy_(sum(g[i] for g in grads) / len(grads))


def _fisher_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    # Per-sample passes (an empirical Fisher estimate) before the batch's own, every step.
    for k in range(3):
        opt.zero_grad()
        model(x[k : k + 1]).pow(2).mean().backward()
    opt.zero_grad()
    model(x).pow(2).mean().backward()


def _per_task_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    # Multi-task PCGrad (WeiChengTseng/Pytorch-PCGrad style): one batch per task, each task's gradient
    # collected with zero_grad + backward, the earlier tasks' then added into .grad in place.
    grads = []
    for k in range(3):
        opt.zero_grad()
        model(x + k).pow(2).mean().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.grad.add_(grads[0][i] + grads[1][i])


@pytest.mark.parametrize("pattern", ["pgd", "per_term_logging", "pcgrad_copy", "fisher_every_step", "per_task_add"])
def test_several_cleared_backward_passes_that_are_not_micro_batches_are_silent(pattern: str) -> None:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradwatch.watch(model, opt, console=False) as gw:
        for x in batches(8):
            if pattern == "pgd":
                _pgd_step(model, opt, x)
            elif pattern == "fisher_every_step":
                _fisher_step(model, opt, x)
            elif pattern == "per_task_add":
                _per_task_step(model, opt, x)
            else:
                _per_term_step(model, opt, x, "sum_backward" if pattern == "per_term_logging" else "copy")
            opt.step()
    assert kinds(gw) == []


@pytest.mark.parametrize("write", ["assign", "data", "copy", "copy_unclipped_passes"])
def test_per_sample_gradients_assembled_by_hand_are_silent(write: str) -> None:
    # DP-SGD written by hand: one backward per sample, each clipped and summed, then put into .grad.
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradwatch.watch(model, opt, console=False) as gw:
        for x in batches(6):
            total = [torch.zeros_like(p) for p in model.parameters()]
            for row in x[:4]:
                opt.zero_grad()
                model(row[None]).pow(2).mean().backward()
                if write == "copy_unclipped_passes":  # clip factor folded into the sum, .grad untouched
                    norm = torch.stack([p.grad.norm() for p in model.parameters()]).norm()
                    coef = (1.0 / (norm + 1e-6)).clamp(max=1.0)
                else:
                    coef = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).new_ones(())
                for t, p in zip(total, model.parameters()):
                    t += p.grad * coef
            for t, p in zip(total, model.parameters()):
                if write == "assign":
                    p.grad = t / 4
                elif write == "data":
                    p.grad.data = t / 4  # the same tensor object, a new storage
                else:  # the last pass's tensor, its values overwritten
                    p.grad.copy_(t / 4 + 0.01 * torch.randn_like(t))
            opt.step()
    assert kinds(gw) == []


def test_a_one_off_run_of_cleared_backward_passes_between_steps_is_silent() -> None:
    # An EWC-style Fisher estimate (one backward per sample, cleared in between) at one point of the run.
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    fisher = [torch.zeros_like(p) for p in model.parameters()]
    with gradwatch.watch(model, opt, console=False) as gw:
        for i, x in enumerate(batches(8)):
            if i == 4:
                for row in x[:5]:
                    model.zero_grad()
                    model(row[None]).pow(2).mean().backward()
                    for f, p in zip(fisher, model.parameters()):
                        f += p.grad.pow(2)
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
    assert kinds(gw) == []


def _lbfgs(clear: Callable[[nn.Module, torch.optim.Optimizer], None]) -> gradwatch.Watcher:
    """Three LBFGS steps (max_iter=4: several closure evaluations per step); ``clear`` opens the closure."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4)
    with gradwatch.watch(model, opt, console=False) as gw:
        for x in batches(3):

            def closure(x: torch.Tensor = x) -> torch.Tensor:
                clear(model, opt)
                loss = model(x).pow(2).mean()
                loss.backward()
                return loss

            opt.step(closure)
    return gw


def test_lbfgs_closure_is_silent() -> None:
    assert kinds(_lbfgs(lambda model, opt: opt.zero_grad())) == []


# LBFGS evaluates the closure several times within step 0 already (max_iter=4): a closure without
# zero_grad() adds each evaluation's gradient onto the last one's from the first step on.
def test_zero_grad_missing_in_an_lbfgs_closure_is_flagged_at_step_0() -> None:
    gw = _lbfgs(lambda model, opt: None)
    assert kinds(gw) == [("zero_grad_missing", 0)]
    text = gw.findings[0].message
    assert "optimizer 0 (LBFGS) evaluated its closure a second time at step 0" in text
    assert "call optimizer.zero_grad() at the top of the closure" in text


def _zero_through_data(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    for p in model.parameters():
        if p.grad is not None:
            p.grad.data.zero_()  # no version bump: only the value tells


def test_lbfgs_closure_clearing_through_data_is_silent() -> None:
    assert kinds(_lbfgs(_zero_through_data)) == []


def test_gan_with_d_stepping_five_times_per_g_step_is_silent() -> None:
    # G's backward also fills D's gradients; D clears them before its own backward. Each optimizer is
    # zeroed on its own schedule.
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 2))
    disc = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 1))
    model = nn.ModuleDict({"gen": gen, "disc": disc})
    opt_d = torch.optim.SGD(disc.parameters(), lr=0.01)
    opt_g = torch.optim.SGD(gen.parameters(), lr=0.01)
    with gradwatch.watch(model, [opt_d, opt_g], console=False) as gw:
        for _ in range(3):
            for _ in range(5):
                opt_d.zero_grad(set_to_none=False)
                fake = gen(torch.randn(8, 2)).detach()
                loss_d = disc(fake).mean() - disc(torch.randn(8, 2)).mean()
                loss_d.backward()
                opt_d.step()
            opt_g.zero_grad()
            loss_g = -disc(gen(torch.randn(8, 2))).mean()
            loss_g.backward()
            opt_g.step()
    assert kinds(gw) == []


def test_parameters_without_gradient_this_step_are_silent() -> None:
    # The smallest parameter (aux.bias) gets a gradient only on even steps.
    torch.manual_seed(0)

    class Branchy(Net):
        def __init__(self) -> None:
            super().__init__()
            self.aux = nn.Linear(8, 1)

        def forward(self, x: torch.Tensor, use_aux: bool = False) -> torch.Tensor:
            h = self.encoder(x)
            return self.head(h) + (self.aux(h) if use_aux else 0)

    model = Branchy()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradwatch.watch(model, opt, console=False) as gw:
        for i, x in enumerate(batches(6)):
            opt.zero_grad(set_to_none=i % 3 == 0)
            model(x, use_aux=i % 2 == 0).pow(2).mean().backward()
            opt.step()
    assert zero_kinds(gw) == []


def test_skipped_steps_are_silent() -> None:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradwatch.watch(model, opt, console=False, on_nonfinite="skip") as gw:
        for i, x in enumerate(batches(5)):
            opt.zero_grad(set_to_none=False)
            loss = model(x).pow(2).mean()
            if i == 1:
                loss = loss * float("nan")
            loss.backward()
            opt.step()
    assert gw.engine.steps_skipped == 1
    assert zero_kinds(gw) == []


def test_checking_every_other_step_is_silent() -> None:
    assert kinds(loop(lambda model, opt: opt.zero_grad(set_to_none=False), steps=6, every=2)) == []


# -- cost and cleanliness -------------------------------------------------------------------------
def test_only_one_parameter_per_optimizer_carries_hooks_and_close_removes_them() -> None:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def hooked() -> list[str]:
        return [
            n
            for n, p in model.named_parameters()
            if p._backward_hooks or getattr(p, "_post_accumulate_grad_hooks", None)
        ]

    gw = gradwatch.watch(model, opt, console=False)
    # The smallest parameter; on the first step also one that samples its gradient (zero_grad() in an
    # accumulation loop is told from a rewritten gradient at step 0), dropped by the first check.
    assert hooked() == ["encoder.0.weight", "head.bias"]
    for x in batches(2):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        assert hooked() == ["head.bias"]
    gw.close()
    assert hooked() == []


@pytest.mark.parametrize("set_to_none", [True, False])
def test_fresh_gradients_add_no_device_value_to_the_step(set_to_none: bool) -> None:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradwatch.watch(model, opt, console=False) as gw:
        tracker = gw.engine.extension(ZeroGradTracker)
        for x in batches(3):
            opt.zero_grad(set_to_none=set_to_none)
            model(x).pow(2).mean().backward()
            opt.step()
            assert tracker.trackers[0].old_nonzero == []
            assert tracker.trackers[0].post_nonzero is None
    assert kinds(gw) == []


# Porting a plain loop to Lightning (tester report): self.optimizers().zero_grad() left at the top of
# training_step under Trainer(accumulate_grad_batches=4). Lightning steps and clears itself, so the fix is
# to delete the call, not to move it after an optimizer.step() the module never calls.
@pytest.mark.parametrize("where", ["training_step", "on_after_backward", "manual"])
def test_zero_grad_of_a_lightning_module_names_the_lightning_fix(where: str) -> None:
    from conftest import lightning_namespace, tiny_data, tiny_trainer

    pl = lightning_namespace("lightning.pytorch")
    from gradwatch.lightning import GradWatchCallback

    class Module(pl.LightningModule):  # type: ignore[misc,name-defined]
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
            self.automatic_optimization = where != "manual"

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], i: int) -> torch.Tensor | None:
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x), y)
            if where == "on_after_backward":
                return loss
            opt = self.optimizers()
            opt.zero_grad()  # the bug: every batch
            if where == "training_step":
                return loss
            self.manual_backward(loss / 4)
            if i % 4 == 3:
                opt.step()
            return None

        def on_after_backward(self) -> None:
            if where == "on_after_backward":
                self.optimizers().zero_grad()  # the bug: between backward and Lightning's step

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    cb = GradWatchCallback(console=False)
    accumulate = 4 if where == "training_step" else 1
    trainer = tiny_trainer(pl, [cb], max_steps=-1, max_epochs=1, accumulate_grad_batches=accumulate)
    trainer.fit(Module(), tiny_data())
    (f,) = cb.findings
    if where == "on_after_backward":
        assert f.kind == "grads_cleared_before_step"
    else:
        assert (f.kind, f.step) == ("zero_grad_in_accumulation", 0)
    fix = f.message.split("Fix: ")[1]
    if where == "manual":  # the module steps itself: the plain-loop fix holds
        assert "right after optimizer.step()" in fix
    else:
        assert fix.startswith("delete that zero_grad() call") and "Lightning clears the gradients itself" in fix
        assert "optimizer.step()" not in fix


def _actor_critic(clear_before_critic: bool) -> list[gradwatch.Finding]:
    """Actor phase first: the actor's loss goes through the critic (Q(s, pi(s)))."""
    torch.manual_seed(0)
    actor, critic = nn.Linear(4, 2), nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 1))
    opt_a, opt_c = torch.optim.Adam(actor.parameters(), 1e-3), torch.optim.Adam(critic.parameters(), 1e-3)
    model = nn.ModuleDict({"actor": actor, "critic": critic})
    with gradwatch.watch(model, [opt_a, opt_c], console=False) as gw:
        for _ in range(4):
            s = torch.randn(16, 4)
            actor_loss = -critic(torch.cat([s, actor(s)], 1)).mean()
            opt_a.zero_grad()
            actor_loss.backward()
            opt_a.step()
            if clear_before_critic:
                opt_c.zero_grad()
            q = critic(torch.cat([s, torch.randn(16, 2)], 1))
            (q - torch.randn(16, 1)).pow(2).mean().backward()
            opt_c.step()
            opt_c.zero_grad()
    return gw.findings


def test_an_actor_loss_left_in_the_critics_gradient_is_found() -> None:
    # The critic's optimizer clears only after its step, so its update also follows the actor's loss.
    (f,) = [f for f in _actor_critic(clear_before_critic=False) if f.kind == "grads_span_other_step"]
    assert f.data["optimizer"] == 1 and f.step == 0


def test_a_critic_cleared_before_its_own_backward_is_silent() -> None:
    assert [f.kind for f in _actor_critic(clear_before_critic=True) if f.severity != "info"] == []


def test_an_optimizer_accumulating_over_another_ones_steps_on_one_shared_loss_is_silent() -> None:
    # Must not flag: one loss for the whole model; the head's optimizer steps every step, the embedding's
    # every 4 steps over its accumulated gradient (a slower update rate on purpose).
    torch.manual_seed(0)
    emb, head = nn.Embedding(50, 8), nn.Linear(8, 1)
    fast, slow = torch.optim.SGD(head.parameters(), lr=0.1), torch.optim.SGD(emb.parameters(), lr=0.1)
    model = nn.ModuleDict({"emb": emb, "head": head})
    with gradwatch.watch(model, [fast, slow], console=False) as gw:
        for i in range(12):
            loss = head(emb(torch.randint(0, 50, (16,)))).pow(2).mean()
            loss.backward()
            fast.step()
            fast.zero_grad()
            if i % 4 == 3:
                slow.step()
                slow.zero_grad()
    assert not any(f.kind == "grads_span_other_step" for f in gw.findings)


def test_a_backbone_accumulating_next_to_an_online_probe_is_silent() -> None:
    # Must not flag: an SSL backbone accumulating over 4 micro-batches next to a linear probe on detached
    # features that steps every micro-batch (solo-learn / lightly "online linear eval"). The probe's loss
    # never reaches the backbone.
    torch.manual_seed(0)
    backbone, probe = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8)), nn.Linear(8, 3)
    opt_b, opt_p = torch.optim.SGD(backbone.parameters(), 0.05), torch.optim.SGD(probe.parameters(), 0.1)
    model = nn.ModuleDict({"backbone": backbone, "probe": probe})
    with gradwatch.watch(model, [opt_b, opt_p], console=False) as gw:
        for it in range(12):
            z = backbone(torch.randn(8, 6))
            opt_p.zero_grad()
            nn.functional.cross_entropy(probe(z.detach()), torch.randint(0, 3, (8,))).backward()
            opt_p.step()
            (z.pow(2).mean() / 4).backward()
            if (it + 1) % 4 == 0:
                opt_b.step()
                opt_b.zero_grad()
    assert not any(f.kind == "grads_span_other_step" for f in gw.findings)


def test_a_generator_accumulating_next_to_a_discriminator_stepping_every_batch_is_silent() -> None:
    # Must not flag (reported on a Lightning GAN with toggle_optimizer): D steps every batch on its own loss
    # (fake detached); G accumulates over 2 batches with D frozen during its phase (pix2pix's
    # set_requires_grad). G's gradient holds its own two passes only; D's backward between them never
    # reached G, it merely ran with no step in between.
    torch.manual_seed(0)
    gen, disc = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8)), nn.Sequential(nn.Linear(8, 1))
    opt_g, opt_d = torch.optim.Adam(gen.parameters(), 2e-3), torch.optim.Adam(disc.parameters(), 2e-3)
    bce = nn.functional.binary_cross_entropy_with_logits
    model = nn.ModuleDict({"G": gen, "D": disc})
    with gradwatch.watch(model, [opt_g, opt_d], console=False) as gw:
        for i in range(8):
            real, z = torch.randn(8, 8), torch.randn(8, 4)
            opt_d.zero_grad()
            (bce(disc(real), torch.ones(8, 1)) + bce(disc(gen(z).detach()), torch.zeros(8, 1))).backward()
            opt_d.step()
            disc.requires_grad_(False)
            (bce(disc(gen(z)), torch.ones(8, 1)) / 2).backward()
            disc.requires_grad_(True)
            if i % 2 == 1:
                opt_g.step()
                opt_g.zero_grad()
    assert [f.kind for f in gw.findings if f.severity != "info"] == []
