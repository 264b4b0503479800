"""Accuracy on generated cases: random models, one fault injected at a random step and layer.

Models vary in depth, widths, frozen layers, an unused branch, a tied weight, parameter groups,
optimizer and dtype (float32/bfloat16). Faults: NaN/Inf in the loss, NaN/Inf in one element of one
layer's gradient, a layer left out of the optimizer, a forgotten ``zero_grad``. Properties:

- every injected fault is reported at its step, naming its layer, and nothing else is reported
  (no warning or error on a run without a fault);
- under ``"skip"`` the skipped step leaves parameters and optimizer state bit-identical, and the whole
  run ends bit-identical to an unwatched run that does not apply that step;
- under ``"raise"`` the run stops at the faulty step, before its update.

Run longer with ``HYPOTHESIS_PROFILE=long pytest tests/test_properties.py``.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st
from torch import nn

import gradwatch
from gradwatch import GradWatchError, GradWatchInternalWarning

SKIPPING_FAULTS = ("nan_loss", "inf_loss", "nan_grad", "inf_grad")
FAULTS = ("none", *SKIPPING_FAULTS, "left_out", "no_zero_grad")


@dataclass(frozen=True)
class Case:
    widths: tuple[int, ...]  # layer i maps widths[i] -> widths[i + 1]
    frozen: tuple[bool, ...]  # per layer
    unused_branch: bool
    tie: int | None  # layer whose weight a second module shares (same shape), used in forward too
    groups: int
    frozen_in_optimizer: bool
    optimizer: str
    dtype: torch.dtype
    steps: int
    fault: str
    fault_step: int
    fault_layer: int
    seed: int

    @property
    def depth(self) -> int:
        return len(self.widths) - 1


@st.composite
def cases(draw: Any, faults: tuple[str, ...] = FAULTS) -> Case:
    depth = draw(st.integers(1, 4))
    widths = tuple(draw(st.lists(st.integers(1, 6), min_size=depth + 1, max_size=depth + 1)))
    frozen = list(draw(st.lists(st.booleans(), min_size=depth, max_size=depth)))
    frozen[-1] = False  # something must train
    tie = draw(st.one_of(st.none(), st.integers(0, depth - 1)))
    if tie is not None and widths[tie] != widths[tie + 1]:
        tie = None  # a tied module maps widths[tie] -> widths[tie + 1] in a residual add: square only
    steps = draw(st.integers(3, 6))
    fault = draw(st.sampled_from(faults))
    trainable = [i for i in range(depth) if not frozen[i]]
    if fault == "left_out":
        assume(len(trainable) >= 2)  # the optimizer must keep something to update
    return Case(
        widths=widths,
        frozen=tuple(frozen),
        unused_branch=draw(st.booleans()),
        tie=tie,
        groups=draw(st.integers(1, 3)),
        frozen_in_optimizer=draw(st.booleans()),
        optimizer=draw(st.sampled_from(["sgd", "momentum", "adam", "adamw"])),
        dtype=draw(st.sampled_from([torch.float32, torch.bfloat16])),
        steps=steps,
        fault=fault,
        fault_step=draw(st.integers(1 if fault == "no_zero_grad" else 0, steps - 1)),
        fault_layer=draw(st.sampled_from(trainable)),
        seed=draw(st.integers(0, 2**16)),
    )


class Generated(nn.Module):
    def __init__(self, case: Case) -> None:
        super().__init__()
        w = case.widths
        self.layers = nn.ModuleList(nn.Linear(w[i], w[i + 1]) for i in range(case.depth))
        if case.unused_branch:
            self.branch = nn.Linear(w[0], 3)
        self.tie = case.tie
        if case.tie is not None:
            self.tied = nn.Linear(w[case.tie], w[case.tie + 1])
            self.tied.weight = self.layers[case.tie].weight
        for i, frozen in enumerate(case.frozen):
            if frozen:
                self.layers[i].requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            h = layer(x)
            if i == self.tie:
                h = h + self.tied(x)
            x = torch.tanh(h) if i < len(self.layers) - 1 else h
        return x


def build(case: Case) -> tuple[Generated, torch.optim.Optimizer]:
    torch.manual_seed(case.seed)
    model = Generated(case).to(case.dtype)
    left_out = set()
    if case.fault == "left_out":
        left_out = {id(p) for p in model.layers[case.fault_layer].parameters()}
    params = [
        p
        for p in model.parameters()
        if id(p) not in left_out and (p.requires_grad or case.frozen_in_optimizer)
    ]
    shares = [params[g :: case.groups] for g in range(case.groups)]
    groups = [{"params": share, "lr": 0.05 / (g + 1)} for g, share in enumerate(shares) if share]
    kind = case.optimizer
    if kind == "sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD(groups, lr=0.05)
    elif kind == "momentum":
        opt = torch.optim.SGD(groups, lr=0.05, momentum=0.9, weight_decay=1e-4)
    elif kind == "adam":
        opt = torch.optim.Adam(groups, lr=0.01)
    else:
        opt = torch.optim.AdamW(groups, lr=0.01)
    return model, opt


def param_name(model: Generated, p: torch.Tensor) -> str:
    """The name gradwatch gives a parameter: its first owner's (tied weights are named once)."""
    return next(n for n, q in model.named_parameters() if q is p)


def snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> tuple[list[torch.Tensor], dict[str, Any]]:
    return [p.detach().clone() for p in model.parameters()], copy.deepcopy(opt.state_dict()["state"])


def identical(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(identical(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(identical(x, y) for x, y in zip(a, b))
    return a == b


def run(case: Case, *, watched: bool, policy: str = "skip") -> dict[str, Any]:
    """Train the case; without a watcher the faulty step of a skipping fault is simply not applied."""
    model, opt = build(case)
    g = torch.Generator().manual_seed(case.seed)
    xs = [torch.randn(5, case.widths[0], generator=g).to(case.dtype) for _ in range(case.steps)]
    state = {"step": 0}
    if case.fault in ("nan_grad", "inf_grad"):
        value = float("nan") if case.fault == "nan_grad" else float("inf")

        def poison(grad: torch.Tensor) -> torch.Tensor:
            if state["step"] != case.fault_step:
                return grad
            grad = grad.clone()
            grad.view(-1)[0] = value
            return grad

        model.layers[case.fault_layer].weight.register_hook(poison)
    out: dict[str, Any] = {"around_fault": None, "raised": None}
    gw = gradwatch.watch(model, opt, console=False, on_nonfinite=policy) if watched else None
    try:
        for step, x in enumerate(xs):
            state["step"] = step
            loss = model(x).float().pow(2).mean()
            faulty = step == case.fault_step
            if faulty and case.fault == "nan_loss":
                loss = loss * float("nan")
            elif faulty and case.fault == "inf_loss":
                loss = loss + float("inf")  # the loss is Inf, the gradients stay finite
            if gw is not None:
                gw.observe_loss(loss)
            if not (faulty and case.fault == "no_zero_grad"):
                opt.zero_grad()
            loss.backward()
            skipped_by_reference = faulty and case.fault in SKIPPING_FAULTS and gw is None
            if faulty:
                before = snapshot(model, opt)
            if not skipped_by_reference:
                opt.step()
            if faulty:
                out["around_fault"] = (before, snapshot(model, opt))
    except GradWatchError as exc:
        out["raised"] = (state["step"], exc)
        out["around_fault"] = (before, snapshot(model, opt))
    finally:
        if gw is not None:
            gw.close()
    out["params"] = [p.detach().clone() for p in model.parameters()]
    out["findings"] = list(gw.findings) if gw is not None else []
    out["model"] = model
    return out


def expected_findings(case: Case, model: Generated) -> set[tuple[str, int, tuple[str, ...]]]:
    """(kind, step, params) of every warning/error finding the case must produce, and only those."""
    expected: set[tuple[str, int, tuple[str, ...]]] = set()
    layer = model.layers[case.fault_layer]
    k = case.fault_step
    # Findings list the optimizer's parameters in the optimizer's order.
    fresh, opt = build(case)
    trainable = tuple(param_name(fresh, p) for grp in opt.param_groups for p in grp["params"] if p.requires_grad)
    with_grad = tuple(n for n in trainable if not n.startswith("branch."))
    if case.unused_branch:
        expected.add(("none_grad", 0, tuple(n for n in trainable if n.startswith("branch."))))
    if case.fault == "nan_loss":
        expected |= {("nonfinite_loss", k, ()), ("nonfinite_grad", k, with_grad)}
    elif case.fault == "inf_loss":
        expected.add(("nonfinite_loss", k, ()))
    elif case.fault in ("nan_grad", "inf_grad"):
        expected.add(("nonfinite_grad", k, (param_name(model, layer.weight),)))
    elif case.fault == "left_out":
        names = tuple(param_name(model, p) for p in layer.parameters())
        expected.add(("not_in_optimizer", 0, names))
    elif case.fault == "no_zero_grad":
        expected.add(("zero_grad_missing", k, with_grad))
    return expected


def reported(findings: list[gradwatch.Finding]) -> set[tuple[str, int, tuple[str, ...]]]:
    return {(f.kind, f.step, f.params) for f in findings if f.severity in ("warning", "error")}


@pytest.mark.parametrize("fault", FAULTS)
@given(data=st.data())
def test_every_injected_fault_is_reported_at_its_step_naming_its_layer_and_nothing_else(fault: str, data: Any) -> None:
    case = data.draw(cases(faults=(fault,)), label="case")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = run(case, watched=True)
    internal = [str(w.message) for w in caught if issubclass(w.category, GradWatchInternalWarning)]
    assert internal == []
    found = reported(result["findings"])
    expected = expected_findings(case, result["model"])
    assert expected <= found
    # A non-finite incident may be explained by more findings (its origin op, the layers it reached),
    # all at the faulty step; nothing is reported anywhere else.
    extra = found - expected
    assert all(case.fault in SKIPPING_FAULTS and f[1] == case.fault_step for f in extra), extra
    if case.fault in ("nan_grad", "inf_grad"):
        (finding,) = [f for f in result["findings"] if f.kind == "nonfinite_grad"]
        assert finding.module == f"layers.{case.fault_layer}"
        counts = finding.data["nan_counts" if case.fault == "nan_grad" else "inf_counts"]
        assert counts == {param_name(result["model"], result["model"].layers[case.fault_layer].weight): 1}


@given(case=cases(faults=("none",)))
def test_run_without_a_fault_reports_nothing_and_trains_as_if_unwatched(case: Case) -> None:
    case = Case(**{**case.__dict__, "unused_branch": False})
    watched = run(case, watched=True)
    assert reported(watched["findings"]) == set()
    assert identical(watched["params"], run(case, watched=False)["params"])


@given(case=cases(faults=SKIPPING_FAULTS))
def test_skip_leaves_parameters_and_optimizer_state_bit_identical(case: Case) -> None:
    watched = run(case, watched=True)
    before, after = watched["around_fault"]
    assert identical(before, after)
    assert identical(watched["params"], run(case, watched=False)["params"])


@given(case=cases(faults=("left_out", "no_zero_grad")))
def test_faults_that_need_no_skip_leave_training_untouched(case: Case) -> None:
    assert identical(run(case, watched=True)["params"], run(case, watched=False)["params"])


@given(case=cases(faults=SKIPPING_FAULTS))
def test_raise_stops_at_the_faulty_step_before_its_update(case: Case) -> None:
    watched = run(case, watched=True, policy="raise")
    assert watched["raised"] is not None
    step, error = watched["raised"]
    assert step == case.fault_step
    before, after = watched["around_fault"]
    assert identical(before[0], after[0])  # no parameter moved
    assert {f.kind for f in error.findings} & {"nonfinite_loss", "nonfinite_grad"}
    assert all(f.step == case.fault_step for f in error.findings)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_generated_models_exercise_tied_weights_and_groups(dtype: torch.dtype) -> None:
    """The generator itself: a tied weight is one tensor, named by its first owner."""
    case = Case(
        widths=(3, 3, 2),
        frozen=(False, False),
        unused_branch=True,
        tie=0,
        groups=2,
        frozen_in_optimizer=False,
        optimizer="adam",
        dtype=dtype,
        steps=3,
        fault="nan_grad",
        fault_step=1,
        fault_layer=0,
        seed=0,
    )
    model, opt = build(case)
    assert model.tied.weight is model.layers[0].weight
    assert param_name(model, model.tied.weight) == "layers.0.weight"
    assert len(opt.param_groups) == 2
    assert all(p.dtype == dtype for p in model.parameters())
