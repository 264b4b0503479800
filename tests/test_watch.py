"""The plain-loop watcher: each core check fires on its bug at the right step and stays silent otherwise."""

from __future__ import annotations

import copy
import io
import json
import math
import warnings
from pathlib import Path

import pytest
import torch
from helpers import kinds, panels
from rich.console import Console
from torch import nn

import gradwatch
from gradwatch import GradWatchError


class Net(nn.Module):
    def __init__(self, unused: bool = False) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(4, 8), nn.Tanh())
        self.head = nn.Linear(8, 1)
        if unused:
            self.aux = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))


def console() -> tuple[Console, io.StringIO]:
    buf = io.StringIO()
    return Console(file=buf, width=120, color_system=None), buf


def batches(n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(16, 4, generator=g) for _ in range(n)]


def train(model, opt, gw, xs, nan_at=None, inf_grad_at=None):
    for step, x in enumerate(xs):
        loss = model(x).pow(2).mean()
        if step == nan_at:
            loss = loss * float("nan")
        if gw is not None:
            gw.observe_loss(loss)
        opt.zero_grad()
        loss.backward()
        if step == inf_grad_at:
            model.head.bias.grad[0] = float("inf")
        opt.step()


def snapshot(model, opt):
    params = [p.detach().clone() for p in model.parameters()]
    state = {k: {kk: (vv.clone() if torch.is_tensor(vv) else vv) for kk, vv in v.items()} for k, v in opt.state.items()}
    return params, state


def same_state(a, b) -> bool:
    pa, sa = a
    pb, sb = b
    if not all(torch.equal(x, y) for x, y in zip(pa, pb)):
        return False
    if sa.keys() != sb.keys():
        return False
    for k in sa:
        for kk in sa[k]:
            x, y = sa[k][kk], sb[k][kk]
            if torch.is_tensor(x):
                if not torch.equal(x, y):
                    return False
            elif x != y:
                return False
    return True


def test_healthy_run_is_silent():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    con, buf = console()
    gw = gradwatch.watch(model, opt, console=con)
    train(model, opt, gw, batches(30))
    assert gw.findings == []
    assert buf.getvalue() == ""  # nothing printed on healthy steps
    gw.close()
    assert "gradwatch summary" in buf.getvalue()
    assert "none: gradients healthy" in buf.getvalue()


def test_nonfinite_loss_found_at_its_step_and_skipped_exactly():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    xs = batches(8)
    with gradwatch.watch(model, opt, console=False) as gw:
        train(model, opt, gw, xs[:5])
        before = snapshot(model, opt)
        train(model, opt, gw, xs[5:6], nan_at=0)  # the 6th step (index 5) is non-finite
        assert same_state(before, snapshot(model, opt))
        train(model, opt, gw, xs[6:])
    assert ("nonfinite_loss", 5) in kinds(gw)
    assert ("nonfinite_grad", 5) in kinds(gw)
    assert gw.summary().steps_skipped == 1
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_skip_restores_the_gradients_after_the_step():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with gradwatch.watch(model, opt, console=False):
        loss = model(batches(1)[0]).sum() * float("nan")
        loss.backward()
        grads = [p.grad for p in model.parameters()]
        opt.step()
        assert [p.grad for p in model.parameters()] == grads  # same tensor objects, unchanged


def test_inf_gradient_names_the_parameter_and_counts_inf_apart_from_nan():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradwatch.watch(model, opt, console=False) as gw:
        train(model, opt, gw, batches(4), inf_grad_at=2)
    grad_findings = [f for f in gw.findings if f.kind == "nonfinite_grad"]
    assert len(grad_findings) == 1
    f = grad_findings[0]
    assert f.step == 2
    assert f.params == ("head.bias",)
    assert f.data["inf_counts"] == {"head.bias": 1}
    assert f.data["nan_counts"] == {}
    assert "head.bias" in f.message


def test_warn_lets_the_update_happen():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradwatch.watch(model, opt, console=False, on_nonfinite="warn") as gw:
        train(model, opt, gw, batches(3), nan_at=1)
    assert ("nonfinite_loss", 1) in kinds(gw)
    assert not all(torch.isfinite(p).all() for p in model.parameters())


def test_raise_stops_before_the_update():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    xs = batches(4)
    with pytest.raises(GradWatchError) as info:
        with gradwatch.watch(model, opt, console=False, on_nonfinite="raise") as gw:
            train(model, opt, gw, xs[:2])
            before = snapshot(model, opt)
            train(model, opt, gw, xs[2:3], nan_at=0)
    assert same_state(before, snapshot(model, opt))
    assert {f.kind for f in info.value.findings} >= {"nonfinite_loss", "nonfinite_grad"}
    assert "step 2" in str(info.value)


def test_persistent_nonfinite_raises_after_max_skips():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    xs = batches(10)
    with pytest.raises(GradWatchError, match="max_skips=3"):
        with gradwatch.watch(model, opt, console=False, max_skips=3) as gw:
            for x in xs:
                loss = model(x).sum() * float("nan")
                opt.zero_grad()
                loss.backward()
                opt.step()
    assert gw.summary().steps_skipped == 3
    assert gw.findings[-1].kind == "too_many_skips"


def test_unused_parameters_are_named_once():
    torch.manual_seed(0)
    model = Net(unused=True)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    con, buf = console()
    with gradwatch.watch(model, opt, console=con) as gw:
        train(model, opt, gw, batches(10))
    found = [f for f in gw.findings if f.kind == "none_grad"]
    assert len(found) == 1
    assert found[0].step == 0
    assert found[0].params == ("aux.weight", "aux.bias")
    assert "aux.weight" in buf.getvalue()


def test_none_grad_reported_again_when_the_set_changes():
    torch.manual_seed(0)
    model = Net(unused=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradwatch.watch(model, opt, console=False) as gw:
        for step, x in enumerate(batches(6)):
            out = model(x)
            if step >= 3:
                out = out + model.aux(model.encoder(x)).sum()
            opt.zero_grad()
            out.pow(2).mean().backward()
            opt.step()
    found = [(f.step, f.params) for f in gw.findings if f.kind == "none_grad"]
    assert found == [(0, ("aux.weight", "aux.bias"))]  # used from step 3 on: the set became empty


def test_frozen_layers_are_not_flagged():
    torch.manual_seed(0)
    model = Net()
    model.encoder.requires_grad_(False)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    with gradwatch.watch(model, opt, console=False) as gw:
        train(model, opt, gw, batches(10))
    assert gw.findings == []


def test_parameter_left_out_of_the_optimizer_is_named():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.head.parameters(), lr=0.1)
    with gradwatch.watch(model, opt, console=False) as gw:
        train(model, opt, gw, batches(5))
    found = [f for f in gw.findings if f.kind == "not_in_optimizer"]
    assert len(found) == 1
    assert found[0].step == 0
    assert set(found[0].params) == {"encoder.0.weight", "encoder.0.bias"}


class _MeanTeacher(nn.Module):
    """Mean teacher / BYOL: the teacher is a deepcopy of the student, requires_grad left True, run under
    no_grad and moved by an EMA of the student after each step."""

    def __init__(self) -> None:
        super().__init__()
        self.student = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        self.teacher = copy.deepcopy(self.student)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            t = self.teacher(x)
        return self.student(x), t


def test_ema_teacher_outside_the_optimizer_is_silent():
    torch.manual_seed(0)
    model = _MeanTeacher()
    opt = torch.optim.SGD(model.student.parameters(), lr=0.05, momentum=0.9)
    with gradwatch.watch(model, opt, console=False) as gw:
        for _ in range(30):
            s, t = model(torch.randn(16, 8))
            loss = (s - t).pow(2).mean() + s.pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            with torch.no_grad():
                for pt, ps in zip(model.teacher.parameters(), model.student.parameters()):
                    pt.mul_(0.99).add_(ps, alpha=0.01)
    assert gw.findings == []


def test_teacher_that_gets_gradients_outside_the_optimizer_is_named():
    # The same teacher run with grad enabled: its gradients are computed and never used.
    torch.manual_seed(0)
    model = _MeanTeacher()
    model.forward = lambda x: (model.student(x), model.teacher(x))  # type: ignore[method-assign]
    opt = torch.optim.SGD(model.student.parameters(), lr=0.05)
    with gradwatch.watch(model, opt, console=False) as gw:
        for _ in range(3):
            s, t = model(torch.randn(16, 8))
            loss = (s - t).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    found = [f for f in gw.findings if f.kind == "not_in_optimizer"]
    assert [f.step for f in found] == [0] and found[0].params[0].startswith("teacher.")


class _HeadBuiltInForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(4, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.Linear(16, 1)(torch.relu(self.enc(x)))  # the bug: a new random layer at every call


def test_layer_built_inside_forward_is_named_with_its_fix():
    torch.manual_seed(0)
    model = _HeadBuiltInForward()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with gradwatch.watch(model, opt, console=False) as gw:
        train(model, opt, gw, batches(5))
    found = [f for f in gw.findings if f.kind == "not_in_optimizer"]
    assert [(f.step, f.params) for f in found] == [
        (1, ("<parameter (1, 16) created in forward>", "<parameter (1,) created in forward>"))
    ]
    assert "create the layer once in __init__" in found[0].message


def test_head_swapped_after_the_optimizer_is_found_at_that_step():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradwatch.watch(model, opt, console=False) as gw:
        train(model, opt, gw, batches(3))
        model.head = nn.Linear(8, 1)  # the classic fine-tuning bug
        train(model, opt, gw, batches(3))
    found = [f for f in gw.findings if f.kind == "not_in_optimizer"]
    assert [(f.step, f.params) for f in found] == [(3, ("head.weight", "head.bias"))]
    # One finding for one cause: the old head the optimizer still holds is not none_grad/foreign_params too.
    assert [f.kind for f in gw.findings] == ["not_in_optimizer"]
    assert "replaced after the optimizer was built" in found[0].message


def test_step_without_any_gradient():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradwatch.watch(model, opt, console=False) as gw:
        train(model, opt, gw, batches(2))
        opt.zero_grad()
        opt.step()
    assert ("no_grads", 2) in kinds(gw)
    assert "loss.backward()" in gw.findings[-1].message


def test_intentional_accumulation_is_not_flagged():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    xs = batches(16)
    with gradwatch.watch(model, opt, console=False) as gw:
        for i in range(0, 16, 4):
            opt.zero_grad()
            for x in xs[i : i + 4]:
                loss = model(x).pow(2).mean() / 4
                gw.observe_loss(loss)
                loss.backward()
            opt.step()
    assert gw.findings == []


def test_tied_weights_are_named_once_and_not_flagged():
    torch.manual_seed(0)

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(10, 6)
            self.out = nn.Linear(6, 10, bias=False)
            self.out.weight = self.emb.weight

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            return self.out(self.emb(idx))

    model = Tied()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with gradwatch.watch(model, opt, console=False) as gw:
        for _ in range(5):
            idx = torch.randint(0, 10, (4, 3))
            loss = nn.functional.cross_entropy(model(idx).reshape(-1, 10), idx.reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert gw.findings == []
    assert gw.engine.index.per_optimizer[0].names == ["emb.weight"]


def test_lbfgs_checks_the_gradients_of_the_closure():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4)
    xs = batches(6)
    with gradwatch.watch(model, opt, console=False) as gw:
        for step, x in enumerate(xs):

            def closure(x=x, step=step):
                opt.zero_grad()
                loss = model(x).pow(2).mean()
                if step == 3:
                    loss = loss * float("nan")
                loss.backward()
                return loss

            if step == 3:
                before = snapshot(model, opt)
            opt.step(closure)
            if step == 3:
                assert same_state(before, snapshot(model, opt))
    assert [k for k in kinds(gw) if k[0].startswith("nonfinite")] == [("nonfinite_loss", 3), ("nonfinite_grad", 3)]
    assert all(torch.isfinite(p).all() for p in model.parameters())


def _boundary_problem(line_search: str | None):
    """The pull towards 1.5 drives w past |w| = 1, where sqrt(1 - w^2) and its gradient turn NaN: LBFGS's
    iterations within one step cross it (https://github.com/pytorch/pytorch/issues/5953)."""
    w = torch.nn.Parameter(torch.tensor([0.0, 0.1]))
    model = torch.nn.Module()
    model.w = w
    opt = torch.optim.LBFGS([w], lr=1.0, max_iter=10, line_search_fn=line_search)

    def closure():
        opt.zero_grad()
        loss = -torch.sqrt(1 - w.pow(2)).sum() * 0.1 + ((w - 1.5) ** 2).sum() * 5
        loss.backward()
        return loss

    return model, opt, closure


def test_lbfgs_line_search_stepping_into_nan_is_reported_at_its_step_and_backs_off():
    model, opt, closure = _boundary_problem("strong_wolfe")
    with gradwatch.watch(model, opt, console=False) as gw:
        losses = [float(opt.step(closure).detach()) for _ in range(5)]
    # Unwatched, the line search accepts the NaN trial and every weight ends NaN.
    found = [f for f in gw.findings if f.kind.startswith("nonfinite")]
    assert [(f.kind, f.step) for f in found] == [("nonfinite_loss", 0)], kinds(gw)
    assert found[0].data["closure_evaluation"] > 1 and "LBFGS" in found[0].message
    assert torch.isfinite(model.w).all() and (model.w.abs() < 1).all()
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]


@pytest.mark.parametrize("policy", ["skip", "raise"])
def test_lbfgs_nan_in_a_later_closure_evaluation_is_never_applied(policy: str):
    model, opt, closure = _boundary_problem(None)
    with gradwatch.watch(model, opt, console=False, on_nonfinite=policy) as gw:
        try:
            opt.step(closure)
        except gradwatch.GradWatchError as exc:
            assert policy == "raise" and "step 0" in str(exc)
        else:
            assert policy == "skip"
    # Unwatched, the NaN gradient of the 3rd evaluation becomes the next iteration's direction: NaN weights.
    assert torch.isfinite(model.w).all()
    first = gw.findings[0]
    assert (first.kind, first.step, first.data["closure_evaluation"]) == ("nonfinite_loss", 0, 3)
    assert first.params == ("w",)


def test_lbfgs_nan_in_a_later_closure_evaluation_under_warn_is_reported_and_applied():
    model, opt, closure = _boundary_problem(None)
    with gradwatch.watch(model, opt, console=False, on_nonfinite="warn") as gw:
        opt.step(closure)
    assert [(f.kind, f.step) for f in gw.findings][:1] == [("nonfinite_loss", 0)]
    assert "on_nonfinite='warn'" in gw.findings[0].message


def test_healthy_lbfgs_is_silent():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4)
    with gradwatch.watch(model, opt, console=False) as gw:
        for x in batches(5):

            def closure(x=x):
                opt.zero_grad()
                loss = model(x).pow(2).mean()
                loss.backward()
                return loss

            opt.step(closure)
    assert gw.findings == []


def test_several_optimizers_each_checked_on_its_own():
    torch.manual_seed(0)
    model = Net()
    opt_a = torch.optim.SGD(model.encoder.parameters(), lr=0.1)
    opt_b = torch.optim.Adam(model.head.parameters(), lr=1e-2)
    with gradwatch.watch(model, [opt_a, opt_b], console=False) as gw:
        for step, x in enumerate(batches(6)):
            loss = model(x).pow(2).mean()
            opt_a.zero_grad()
            opt_b.zero_grad()
            loss.backward()
            if step == 4:
                model.head.weight.grad.fill_(float("nan"))
            opt_a.step()
            opt_b.step()
    assert [(f.kind, f.step, f.params, f.data["optimizer"]) for f in gw.findings] == [
        ("nonfinite_grad", 4, ("head.weight",), 1)
    ]


def test_per_layer_scalars_of_each_optimizer_keep_their_own_cadence(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    torch.manual_seed(0)
    model = Net()
    opt_a = torch.optim.SGD(model.encoder.parameters(), lr=0.1)  # like a GAN: two optimizers, each step
    opt_b = torch.optim.SGD(model.head.parameters(), lr=0.1)
    with gradwatch.watch(model, [opt_a, opt_b], console=False, log_dir=str(tmp_path), layer_every=5):
        for x in batches(12):
            loss = model(x).pow(2).mean()
            opt_a.zero_grad()
            opt_b.zero_grad()
            loss.backward()
            opt_a.step()
            opt_b.step()
    acc = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0})
    acc.Reload()
    assert [e.step for e in acc.Scalars("gradwatch/grad_norm/encoder.0")] == [0, 5, 10]
    assert [e.step for e in acc.Scalars("gradwatch/grad_norm/head")] == [0, 5, 10]


def test_hand_written_update_with_check():
    torch.manual_seed(0)
    model = Net()
    applied = []
    with gradwatch.watch(model, console=False) as gw:
        for step, x in enumerate(batches(4)):
            model.zero_grad()
            loss = model(x).pow(2).mean() * (float("nan") if step == 2 else 1.0)
            loss.backward()
            ok = gw.check()
            applied.append(ok)
            if ok:
                with torch.no_grad():
                    for p in model.parameters():
                        p -= 0.1 * p.grad
    assert applied == [True, True, False, True]
    assert ("nonfinite_grad", 2) in kinds(gw)


def test_every_checks_only_every_nth_step():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradwatch.watch(model, opt, console=False, every=3) as gw:
        train(model, opt, gw, batches(7), inf_grad_at=4)
    assert gw.summary().steps_checked == 3  # steps 0, 3, 6
    # step 4 was not checked, so its Inf reached the weights; the next checked step sees the damage
    assert {f.step for f in gw.findings if f.kind.startswith("nonfinite")} == {6}


def test_tensorboard_tags_and_jsonl(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradwatch.watch(model, opt, console=False, log_dir=str(tmp_path)) as gw:
        train(model, opt, gw, batches(6), nan_at=3)
    acc = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {
        "gradwatch/grad_norm/total",
        "gradwatch/grad_norm/encoder.0",
        "gradwatch/grad_norm/head",
        "gradwatch/loss",
        "gradwatch/skipped_steps",
        "gradwatch/findings/nonfinite_loss",
    } <= tags
    total = acc.Scalars("gradwatch/grad_norm/total")
    assert [e.step for e in total] == [0, 1, 2, 4, 5]  # the non-finite step is not charted
    skipped = {e.step: e.value for e in acc.Scalars("gradwatch/skipped_steps")}
    # 0 at step 0 (the engine's cadence), repeated at step 2 (a step, not a ramp, at the skipped step 3),
    # then 1 at every step (smoothing only delays it)
    assert skipped == {0: 0, 2: 0, 3: 1, 4: 1, 5: 1}
    assert "gradwatch/findings/text_summary" in acc.Tags()["tensors"]
    lines = [json.loads(line) for line in Path(tmp_path, "gradwatch.jsonl").read_text().splitlines()]
    assert lines[0]["event"] == "run_start" and lines[0]["run"] == gw.engine.run_id
    assert [(r["kind"], r["step"]) for r in lines[1:]] == kinds(gw)
    assert [k for k in kinds(gw) if k[0].startswith("nonfinite")] == [("nonfinite_loss", 3), ("nonfinite_grad", 3)]


@pytest.mark.parametrize("layer_every", [10, 1])
def test_per_layer_scalars_every_layer_every_steps_and_on_findings(tmp_path, layer_every):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradwatch.watch(model, opt, console=False, log_dir=str(tmp_path), layer_every=layer_every) as gw:
        train(model, opt, gw, batches(25), inf_grad_at=13)
    acc = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0})
    acc.Reload()
    steps = lambda tag: [e.step for e in acc.Scalars(tag)]  # noqa: E731
    assert steps("gradwatch/grad_norm/total") == [s for s in range(25) if s != 13]  # every step but the Inf one
    assert steps("gradwatch/loss") == list(range(25))
    expected = [0, 10, 13, 20] if layer_every == 10 else list(range(25))  # 13: the step with a finding
    assert steps("gradwatch/grad_norm/encoder.0") == expected
    assert steps("gradwatch/grad_norm/head") == [s for s in expected if s != 13]  # its Inf norm is not charted
    nonfinite = {e.step: e.value for e in acc.Scalars("gradwatch/nonfinite_grads")}
    assert nonfinite[13] == 1 and nonfinite[14] == 0  # counters: written when they change


def test_float64_model_is_checked_like_any_other():
    torch.manual_seed(0)
    model = Net().double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    xs = [x.double() for x in batches(4)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an internal error of gradwatch would be a warning
        with gradwatch.watch(model, opt, console=False) as gw:
            train(model, opt, gw, xs, nan_at=2)
    assert gw.summary().steps_checked == 4
    assert [k for k in kinds(gw) if k[0].startswith("nonfinite")] == [("nonfinite_loss", 2), ("nonfinite_grad", 2)]
    last = gw.engine.history.last[0]
    expected = [float(p.grad.norm()) for p in model.parameters()]
    assert last.norms == pytest.approx(expected, rel=1e-5)


def test_close_leaves_no_hook_behind():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gw = gradwatch.watch(model, opt, console=False)
    train(model, opt, gw, batches(2))
    gw.close()
    gw.close()  # idempotent
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks
    for m in model.modules():
        assert not m._forward_pre_hooks and not m._forward_hooks and not m._backward_hooks
    for p in model.parameters():
        assert not p._backward_hooks
    # a new watcher can attach to the same optimizer
    with gradwatch.watch(model, opt, console=False) as gw2:
        train(model, opt, gw2, batches(2))
    assert gw2.findings == []


def test_a_second_live_watcher_on_the_same_optimizer_is_refused():
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradwatch.watch(model, opt, console=False):
        with pytest.raises(RuntimeError, match="already watched"):
            gradwatch.watch(model, opt, console=False)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"on_nonfinite": "ignore"}, ValueError, r"on_nonfinite='ignore' is not one of 'warn', 'skip', 'raise'"),
        ({"every": 0}, ValueError, r"every=0 must be an integer >= 1"),
        ({"every": 1.5}, TypeError, r"every=1.5"),
        ({"max_skips": -1}, ValueError, r"max_skips=-1"),
        ({"log_dirr": "x"}, TypeError,
         r"unknown gradwatch option 'log_dirr' \(did you mean 'log_dir'\?\); known options: on_nonfinite, log_dir"),
        ({"console": "yes"}, TypeError, r"console='yes'"),
    ],
)
def test_bad_configuration_is_refused_with_the_value(kwargs, error, match):
    model = Net()
    with pytest.raises(error, match=match):
        gradwatch.watch(model, torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)


def test_a_misspelled_keyword_suggests_the_nearest_one():
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"'on_nonfinte' \(did you mean 'on_nonfinite'\?\)"):
        gradwatch.watch(model, opt, on_nonfinte="skip")
    with pytest.raises(TypeError) as info:  # nothing near: no guess, the list of every keyword
        gradwatch.watch(model, opt, colour_scheme="dark")
    assert "did you mean" not in str(info.value) and "known options: on_nonfinite" in str(info.value)


def test_swapped_model_and_optimizer_name_the_types_not_the_reprs():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    with pytest.raises(TypeError) as info:
        gradwatch.watch(opt, model)
    message = str(info.value)
    assert "got AdamW and a Sequential module as optimizer" in message
    assert "watch(model, optimizer)" in message
    assert "\n" not in message and "Parameter Group" not in message and "lr:" not in message


def test_bad_model_and_optimizer_are_refused():
    model = Net()
    with pytest.raises(TypeError, match=r"needs a torch\.nn\.Module"):
        gradwatch.watch("model")
    with pytest.raises(TypeError, match="the class Net"):
        gradwatch.watch(Net)
    with pytest.raises(TypeError, match="the class SGD"):
        gradwatch.watch(model, torch.optim.SGD)
    frozen = Net().requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        gradwatch.watch(frozen)


def test_unwritable_log_dir_warns_and_keeps_the_console(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    con, buf = console()
    with pytest.warns(gradwatch.GradWatchInternalWarning, match="cannot write logs"):
        gw = gradwatch.watch(model, opt, console=con, log_dir=str(blocker / "run"))
    train(model, opt, gw, batches(3), nan_at=1)
    gw.close()
    assert ("nonfinite_loss", 1) in kinds(gw)
    assert any("nonfinite_loss" in k and step == 1 for k, step in panels(buf.getvalue()))


def test_repeated_findings_are_rate_limited_on_the_console():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    con, buf = console()
    with gradwatch.watch(model, opt, console=con, rate_limit=2, max_skips=None) as gw:
        for x in batches(6):
            loss = model(x).sum() * float("nan")
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert len([f for f in gw.findings if f.kind == "nonfinite_grad"]) == 6
    out = buf.getvalue()
    assert [step for k, step in panels(out) if "nonfinite_grad" in k] == [0, 1]
    assert "further 'nonfinite_grad' findings are recorded but not printed" in out


@pytest.mark.parametrize("set_to_none", [True, False])
def test_batch_the_user_skipped_does_not_skip_the_next_healthy_update(set_to_none: bool) -> None:
    # The user guards the step: no optimizer.step() when the gradients are non-finite, then zero_grad.
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    applied = []
    with gradwatch.watch(model, opt, console=False) as gw:
        for step, x in enumerate(batches(8)):
            loss = model(x).pow(2).mean()
            if step == 3:
                loss = loss * float("nan")
            gw.observe_loss(loss)
            loss.backward()
            before = [p.detach().clone() for p in model.parameters()]
            if all(torch.isfinite(p.grad).all() for p in model.parameters()):
                opt.step()
            opt.zero_grad(set_to_none=set_to_none)
            applied.append(any(not torch.equal(b, p) for b, p in zip(before, model.parameters())))
    assert applied == [True, True, True, False, True, True, True, True]
    assert gw.engine.steps_skipped == 0
    (f,) = gw.findings
    assert (f.kind, f.severity, f.step) == ("nonfinite_loss", "warning", 3)
    assert "no update used it" in f.message


def _nan_guarded_run(watched: bool, guard: str, k: int, nan_at: int):
    # `loss = ...; gw.observe_loss(loss); if not torch.isfinite(loss): continue` before backward():
    # "zg" calls zero_grad() at the top of every batch (the canonical loop); "cont" accumulates k
    # micro-batches and skips the NaN one; "zgcont" also throws the window away with zero_grad().
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ctx = gradwatch.watch(model, opt, console=False) if watched else None
    for i, x in enumerate(batches(12 * k)):
        if guard == "zg":
            opt.zero_grad()
        loss = model(x).pow(2).mean() / k
        if i == nan_at:
            loss = loss * float("nan")
        if ctx is not None:
            ctx.observe_loss(loss)
        if not torch.isfinite(loss):
            if guard == "zgcont":
                opt.zero_grad()
            continue
        loss.backward()
        if guard == "zg" or (i + 1) % k == 0:
            opt.step()
            if guard != "zg":
                opt.zero_grad()
    if ctx is not None:
        ctx.close()
    return model, ctx


@pytest.mark.parametrize("guard,k,nan_at", [("zg", 1, 5), ("cont", 1, 3), ("cont", 4, 9), ("zgcont", 4, 9),
                                            ("cont", 4, 11)])
def test_a_nan_loss_the_code_never_backpropagated_does_not_skip_the_next_update(guard: str, k: int,
                                                                                 nan_at: int) -> None:
    # The common NaN guard `if torch.isnan(loss): continue` after gw.observe_loss(loss): that batch's NaN
    # loss was charged to the next (healthy) update, which gradwatch skipped.
    bare, _ = _nan_guarded_run(False, guard, k, nan_at)
    model, gw = _nan_guarded_run(True, guard, k, nan_at)
    assert all(torch.equal(a, b) for a, b in zip(bare.state_dict().values(), model.state_dict().values()))
    assert gw.engine.steps_skipped == 0
    (f,) = gw.findings
    assert (f.kind, f.severity, f.data["no_update"]) == ("nonfinite_loss", "warning", True)
    assert "did not backpropagate" in f.message


def test_a_nan_loss_that_is_backpropagated_is_still_skipped_at_its_step() -> None:
    # Accumulation with observe_loss per micro-batch, the NaN micro-batch backpropagated: its step is skipped.
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with gradwatch.watch(model, opt, console=False) as gw:
        for i, x in enumerate(batches(16)):
            loss = model(x).pow(2).mean() / 4
            if i == 9:
                loss = loss + float("nan")  # the loss value only: every gradient stays finite
            gw.observe_loss(loss)
            loss.backward()
            if i % 4 == 3:
                opt.step()
                opt.zero_grad()
    assert gw.engine.steps_skipped == 1
    assert ("nonfinite_loss", 2) in kinds(gw)
    assert all(f.severity == "error" for f in gw.findings if f.kind == "nonfinite_loss")


# https://github.com/pytorch/pytorch/pull/53843 (clip_grad_norm_'s error_if_nonfinite)
def test_clip_grad_norm_raising_on_a_nan_step_is_named_and_the_error_kept():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="non-finite, so it cannot be clipped"):
        with gradwatch.watch(model, opt, console=False) as gw:
            for step, x in enumerate(batches(5)):
                loss = model(x).pow(2).mean() * (float("nan") if step == 3 else 1.0)
                gw.observe_loss(loss)
                opt.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
                opt.step()
    f, origin = gw.findings
    assert (f.kind, f.step, f.data["raised"]) == ("nonfinite_grad", 3, "RuntimeError")
    assert "the loss was nan" in f.message and "before the optimizer step" in f.message
    # Localized as a checked step would be: born in the loss code, outside the model.
    assert (origin.kind, origin.step, origin.data["phase"]) == ("nan_origin", 3, "loss")
    assert gw.summary().kind_counts == {"nonfinite_grad": 1, "nan_origin": 1}


# The tester's s05b scenario: clip_grad_norm_(error_if_nonfinite=True) raises on a NaN batch; the batch is named
# as on a checked step, and the user's exception is the one torch raised (type, message, traceback).
@pytest.mark.parametrize("observed", [True, False])
def test_clip_grad_norm_raising_on_a_nan_batch_names_the_batch(observed: bool):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError) as raised:
        with gradwatch.watch(model, opt, console=False) as gw:
            for step, x in enumerate(batches(6)):
                if step == 4:
                    x[0, 0] = float("nan")
                loss = model(x).pow(2).mean()
                if observed:
                    gw.observe_loss(loss)
                opt.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
                opt.step()
    assert str(raised.value).startswith("The total norm of order 2.0 for gradients from `parameters` is non-finite")
    assert raised.traceback[-1].path.name == "clip_grad.py"  # raised where torch raised it
    assert [(f.kind, f.step) for f in gw.findings] == [("nonfinite_grad", 4), ("nonfinite_input", 4)]
    (f,) = [f for f in gw.findings if f.kind == "nonfinite_input"]
    assert f.data["inputs"] == [{"input": "args[0]", "nan": 1, "inf": 0}]
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_users_own_nan_check_raising_is_named_at_its_step():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="NaN loss"):
        with gradwatch.watch(model, opt, console=False) as gw:
            for step, x in enumerate(batches(5)):
                loss = model(x).pow(2).mean() * (float("nan") if step == 2 else 1.0)
                gw.observe_loss(loss)
                if not torch.isfinite(loss):
                    raise ValueError("NaN loss")
                opt.zero_grad()
                loss.backward()
                opt.step()
    assert [(f.kind, f.step) for f in gw.findings] == [("nonfinite_loss", 2)]


@pytest.mark.parametrize("width", [40, 80, 200])
def test_the_end_of_run_summary_prints_the_log_path_whole(tmp_path, width: int) -> None:
    log_dir = str(tmp_path / "lightning_logs" / "pl_healthy" / "version_12" / "a_long_experiment_name")
    buf = io.StringIO()
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradwatch.watch(model, opt, console=Console(file=buf, width=width, color_system=None), log_dir=log_dir):
        loss = model(torch.randn(4, 4)).pow(2).mean()
        loss.backward()
        opt.step()
    text = buf.getvalue()
    assert "…" not in text.split("gradwatch summary", 1)[1]
    assert log_dir in "".join(line.strip() for line in text.splitlines())
