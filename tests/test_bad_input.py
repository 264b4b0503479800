"""Bad input at the public entry points: a clear error at construction, or a clean documented behaviour.

``gradwatch.watch(...)`` and ``gradwatch.Config(...)`` are fuzzed with wrong types and values; unusual
but legal models (sparse, complex, meta, lazy, swapped heads) train without a traceback from inside
gradwatch.
"""

from __future__ import annotations

import math
import pathlib
import warnings
from typing import Any

import pytest
import torch
from helpers import kinds
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import gradwatch
from gradwatch import GradWatchInternalWarning
from gradwatch.core.config import keywords

# -- configuration -----------------------------------------------------------------------------------

ANY_VALUE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["warn", "skip", "raise", "", " ", "runs/x"]),
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    st.builds(object),
    st.just(pathlib.Path("runs/fuzz")),
)


def _valid(cfg: gradwatch.Config) -> None:
    """What a Config that was accepted must satisfy."""
    assert cfg.on_nonfinite in ("warn", "skip", "raise")
    assert cfg.log_dir is None or (isinstance(cfg.log_dir, str) and cfg.log_dir.strip())
    for name in ("every", "escalate_steps", "tb_flush_every", "window", "dead_steps"):
        v = getattr(cfg, name)
        assert isinstance(v, int) and not isinstance(v, bool) and v >= 1, name
    for name in ("histogram_every", "rate_limit"):
        v = getattr(cfg, name)
        assert isinstance(v, int) and not isinstance(v, bool) and v >= 0, name
    for name in ("spike_factor", "vanishing_ratio"):
        v = getattr(cfg, name)
        assert not isinstance(v, bool) and math.isfinite(v) and v > 0, name


#: Config checks cost microseconds: explore five times more examples than the profile's default.
cheap = settings(max_examples=5 * settings.default.max_examples)


@cheap
@given(name=st.sampled_from(keywords()), value=ANY_VALUE)
def test_any_config_value_is_accepted_valid_or_rejected_naming_the_keyword(name: str, value: Any) -> None:
    try:
        cfg = gradwatch.Config(**{name: value})
    except (TypeError, ValueError) as exc:
        assert f"{name}=" in str(exc), str(exc)
        return
    _valid(cfg)


@cheap
@given(value=ANY_VALUE)
def test_on_nonfinite_errors_list_the_allowed_policies(value: Any) -> None:
    if value in ("warn", "skip", "raise"):
        return
    with pytest.raises((TypeError, ValueError)) as info:
        gradwatch.Config(on_nonfinite=value)
    assert all(p in str(info.value) for p in ("'warn'", "'skip'", "'raise'"))


@given(name=st.text(min_size=1, max_size=12).filter(lambda n: n not in keywords() and n != "scaler"))
def test_unknown_keyword_to_watch_names_it_and_lists_the_known_ones(name: str) -> None:
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError) as info:
        gradwatch.watch(model, opt, **{name: 1})
    assert repr(name) in str(info.value) and "on_nonfinite" in str(info.value)
    assert not opt._optimizer_step_pre_hooks  # nothing was attached
    gradwatch.watch(model, opt, console=False).close()  # and the optimizer can still be watched


def test_empty_log_dir_is_rejected() -> None:
    with pytest.raises(ValueError, match="log_dir=''"):
        gradwatch.Config(log_dir="")


def test_log_dir_may_be_a_path_object(tmp_path) -> None:
    assert gradwatch.Config(log_dir=tmp_path / "runs").log_dir == str(tmp_path / "runs")


def test_config_errors_leave_no_hook_behind() -> None:
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    from torch.nn.modules import module as mod

    before = len(mod._global_parameter_registration_hooks), len(mod._global_module_registration_hooks)
    with pytest.raises(ValueError, match="every=0"):
        gradwatch.watch(model, opt, every=0)
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks
    assert (len(mod._global_parameter_registration_hooks), len(mod._global_module_registration_hooks)) == before


# -- model and optimizer arguments -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ("model", "needs a torch.nn.Module as model, got str"),
        (None, "needs a torch.nn.Module as model, got NoneType"),
        (nn.Linear, "needs a model instance, got the class Linear"),
        (torch.randn(3, requires_grad=True), "needs a torch.nn.Module as model, got Tensor"),
    ],
    ids=["str", "None", "class", "tensor"],
)
def test_model_that_is_not_a_module_instance(model: Any, message: str) -> None:
    with pytest.raises(TypeError, match=message):
        gradwatch.watch(model, console=False)


@pytest.mark.parametrize(
    "model", [nn.ReLU(), nn.Linear(2, 2).requires_grad_(False)], ids=["no-parameters", "all-frozen"]
)
def test_model_without_trainable_parameters(model: nn.Module) -> None:
    with pytest.raises(ValueError, match="no trainable parameters"):
        gradwatch.watch(model, console=False)


def test_optimizer_class_instead_of_instance() -> None:
    with pytest.raises(TypeError, match="optimizer instance, got the class SGD"):
        gradwatch.watch(nn.Linear(2, 1), torch.optim.SGD, console=False)


def test_parameters_instead_of_an_optimizer() -> None:
    model = nn.Linear(2, 1)
    with pytest.raises(TypeError, match=r"got 2 tensors \(model.parameters\(\)\?\)"):
        gradwatch.watch(model, model.parameters(), console=False)


@pytest.mark.parametrize("optimizer", [[], {"opt": 1}, "adam", 3], ids=["empty", "dict", "str", "int"])
def test_optimizer_of_the_wrong_type(optimizer: Any) -> None:
    with pytest.raises(TypeError, match=r"optimizer must be a torch\.optim\.Optimizer"):
        gradwatch.watch(nn.Linear(2, 1), optimizer, console=False)


def test_same_optimizer_watched_twice_at_once() -> None:
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradwatch.watch(model, opt, console=False):
        with pytest.raises(RuntimeError, match="already watched"):
            gradwatch.watch(model, opt, console=False)


@pytest.mark.parametrize("loss", ["0.5", None, [1.0], True], ids=["str", "None", "list", "bool"])
def test_observe_loss_of_the_wrong_type(loss: Any) -> None:
    with gradwatch.watch(nn.Linear(2, 1), console=False) as gw:
        expected = f"observe_loss.. takes the loss as a tensor or a number, got {type(loss).__name__}"
        with pytest.raises(TypeError, match=expected):
            gw.observe_loss(loss)


# -- unusual models: a clean behaviour ---------------------------------------------------------------


def run(model: nn.Module, opt: torch.optim.Optimizer, make_loss: Any, steps: int = 3, **config: Any) -> Any:
    """Train ``steps`` steps with a watcher; returns it. Fails on any internal gradwatch warning."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with gradwatch.watch(model, opt, console=False, **config) as gw:
            for step in range(steps):
                loss = make_loss(step)
                gw.observe_loss(loss)
                opt.zero_grad()
                loss.backward()
                opt.step()
    internal = [str(w.message) for w in caught if issubclass(w.category, GradWatchInternalWarning)]
    assert internal == []
    return gw


def test_optimizer_over_foreign_parameters_is_reported_not_fatal() -> None:
    torch.manual_seed(0)
    model, other = nn.Linear(3, 1), nn.Linear(3, 1)
    opt = torch.optim.SGD(list(model.parameters()) + list(other.parameters()), lr=0.1)
    gw = run(model, opt, lambda s: model(torch.randn(4, 3)).pow(2).mean())
    foreign = [f for f in gw.findings if f.kind == "foreign_params"]
    assert len(foreign) == 1 and foreign[0].step == 0 and len(foreign[0].params) == 2
    assert "does not own" in foreign[0].message


def test_sparse_gradients_healthy_run_reports_nothing() -> None:
    torch.manual_seed(0)
    emb = nn.Embedding(10, 3, sparse=True)
    opt = torch.optim.SparseAdam(emb.parameters())
    gw = run(emb, opt, lambda s: emb(torch.tensor([1, 2, s])).pow(2).sum())
    assert kinds(gw, info=False) == []


def test_sparse_gradient_nan_is_found_and_skipped() -> None:
    torch.manual_seed(0)
    emb = nn.Embedding(10, 3, sparse=True)
    opt = torch.optim.SparseAdam(emb.parameters())
    weights: list[torch.Tensor] = []

    def loss(step: int) -> torch.Tensor:
        weights.append(emb.weight.detach().clone())
        out = emb(torch.tensor([1, 2, 3])).pow(2).sum()
        return out * float("nan") if step == 1 else out

    gw = run(emb, opt, loss)
    grad = [f for f in gw.findings if f.kind == "nonfinite_grad"]
    assert [(f.step, f.params) for f in grad] == [(1, ("weight",))]
    assert torch.equal(weights[1], weights[2])  # the NaN update was skipped


class ComplexModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, dtype=torch.cfloat))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.w * x).abs()


def test_complex_parameters_healthy_and_nan() -> None:
    torch.manual_seed(0)
    model = ComplexModel()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    gw = run(model, opt, lambda s: model(torch.randn(4)).sum() * (float("nan") if s == 2 else 1.0))
    assert [(f.kind, f.step, f.params) for f in gw.findings if f.kind.startswith("nonfinite_")][:2] == [
        ("nonfinite_loss", 2, ()),
        ("nonfinite_grad", 2, ("w",)),
    ]
    assert all(f.step == 2 for f in gw.findings)


def test_model_on_the_meta_device_trains_without_findings_or_internal_errors() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).to("meta")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gw = run(model, opt, lambda s: model(torch.randn(2, 3, device="meta")).pow(2).mean())
    assert gw.findings == []
    assert gw.summary().steps == 3


def lazy_model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.LazyLinear(4), nn.Tanh(), nn.Linear(4, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_lazy_module_with_the_optimizer_built_before_the_first_forward() -> None:
    model, opt = lazy_model()
    gw = run(model, opt, lambda s: model(torch.randn(2, 3)).pow(2).mean())
    assert kinds(gw, info=False) == []


def test_lazy_module_left_out_of_the_optimizer_is_named_once_materialized() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.LazyLinear(1))
    opt = torch.optim.SGD(model[0].parameters(), lr=0.1)
    gw = run(model, opt, lambda s: model(torch.randn(2, 3)).pow(2).mean())
    assert [(f.kind, f.step, f.params) for f in gw.findings if f.kind == "not_in_optimizer"] == [
        ("not_in_optimizer", 0, ("2.weight", "2.bias"))
    ]


def test_head_swapped_after_the_optimizer_was_built_is_not_in_optimizer() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def loss(step: int) -> torch.Tensor:
        if step == 2:
            model[2] = nn.Linear(4, 1)
        return model(torch.randn(2, 3)).pow(2).mean()

    gw = run(model, opt, loss, steps=4)
    assert [(f.kind, f.step, f.params) for f in gw.findings if f.kind == "not_in_optimizer"] == [
        ("not_in_optimizer", 2, ("2.weight", "2.bias"))
    ]


class _ListBlocks(nn.Module):
    """Blocks in a Python list and a scale that is a plain tensor: neither is registered with the model."""

    def __init__(self, registered: bool) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        blocks = [nn.Linear(8, 8), nn.Linear(8, 8)]
        self.blocks = nn.ModuleList(blocks) if registered else blocks
        self.head = nn.Linear(8, 1)
        scale = torch.ones(1, requires_grad=True)
        self.scale = nn.Parameter(scale) if registered else scale
        self.teacher = [nn.Linear(4, 8).requires_grad_(False)]  # kept out of state_dict on purpose: frozen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x) + self.teacher[0](x)
        for b in self.blocks:
            h = torch.tanh(b(h))
        return self.head(h) * self.scale


@pytest.mark.parametrize("registered", [False, True])
def test_modules_in_a_python_list_and_plain_tensors_are_reported_as_never_updated(registered: bool) -> None:
    torch.manual_seed(0)
    model = _ListBlocks(registered)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model.blocks[0].weight.detach().clone()
    gw = run(model, opt, lambda step: model(torch.randn(4, 4)).pow(2).mean(), steps=4)
    found = [f for f in gw.findings if f.kind == "not_in_optimizer"]
    if registered:
        assert gw.findings == []
        return
    assert [(f.step, f.params) for f in found] == [
        (1, ("blocks[0].weight", "blocks[0].bias", "blocks[1].weight", "blocks[1].bias", "scale"))
    ]
    assert "nn.ModuleList" in found[0].message and "nn.Parameter" in found[0].message
    assert torch.equal(model.blocks[0].weight, before)  # what the finding says: never updated
    assert [f.kind for f in gw.findings] == ["not_in_optimizer"]


def test_a_teacher_in_a_python_list_with_stale_gradients_from_its_own_training_is_silent() -> None:
    # Distillation: the teacher was trained earlier in the script (its .grad is still there, requires_grad
    # left on) and is kept out of the student's state_dict on purpose; it runs under no_grad.
    torch.manual_seed(0)
    teacher = nn.Linear(4, 3)
    teacher(torch.randn(8, 4)).pow(2).mean().backward()

    class Student(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(4, 3)
            self._teacher = [teacher]

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                target = self._teacher[0](x)
            return (self.net(x) - target).pow(2).mean()

    model = Student()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gw = run(model, opt, lambda step: model(torch.randn(8, 4)), steps=4)
    assert gw.findings == []


@pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs a second device (CPU + CUDA)")
def test_parameters_on_several_devices() -> None:  # pragma: no cover - no GPU on CI
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1).cuda())

    class Split(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = model[0], model[1]

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x).cuda())

    split = Split()
    opt = torch.optim.SGD(split.parameters(), lr=0.1)
    gw = run(split, opt, lambda s: split(torch.randn(2, 3)).pow(2).mean() * (float("nan") if s == 1 else 1.0))
    assert ("nonfinite_grad", 1) in kinds(gw, info=False)


def test_scaler_that_is_not_a_grad_scaler() -> None:
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"scaler must be a torch\.amp\.GradScaler or None, got str"):
        gradwatch.watch(model, opt, scaler="amp", console=False)
    assert not opt._optimizer_step_pre_hooks


def test_close_removes_every_process_wide_hook() -> None:
    from torch.nn.modules import module as mod
    from torch.optim import optimizer as optim_mod

    def counts() -> tuple[int, int, int]:
        return (
            len(mod._global_parameter_registration_hooks),
            len(mod._global_module_registration_hooks),
            len(optim_mod._global_optimizer_pre_hooks),
        )

    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = counts()
    gw = gradwatch.watch(model, opt, console=False)
    assert counts() == (before[0] + 1, before[1] + 1, before[2] + 1)
    gw.close()
    assert counts() == before


def test_a_closed_run_keeps_nothing_of_its_model_alive() -> None:
    import gc
    import weakref

    def run() -> weakref.ref[nn.Module]:
        model = nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with gradwatch.watch(model, opt, console=False):
            for _ in range(3):
                opt.zero_grad()
                model(torch.randn(4, 2)).sum().backward()
                opt.step()
        return weakref.ref(model)

    ref = run()
    gc.collect()
    assert ref() is None


def test_a_meta_device_template_for_functional_call_is_not_reported() -> None:
    # torch.func.functional_call with the real parameters in a dict the optimizer holds (stack_module_state
    # style): the module is a template on the meta device, never trained itself.
    from torch.func import functional_call

    torch.manual_seed(0)
    template = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    params = {k: v.detach().clone().requires_grad_() for k, v in template.named_parameters()}
    template = template.to("meta")
    opt = torch.optim.Adam(params.values(), lr=1e-2)
    gw = run(template, opt, lambda step: functional_call(template, params, (torch.randn(16, 8),)).pow(2).mean(),
             steps=4)
    assert gw.findings == []
    assert gw.engine.index.unheld == []  # nothing to re-check on every step
