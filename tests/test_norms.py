"""Per-gradient norms on the CPU: large float32 gradients through dot products, small ones of one shape stacked,
the others fused.

Each test builds gradients whose norms differ by orders of magnitude, so a norm read into the wrong
position or a wrong sum fails by far more than any rounding of another CPU or thread count.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from helpers import plain_console
from torch import nn

import gradwatch
from gradwatch.core.stats import DOT_MIN_NUMEL, GROUP_MAX_NUMEL, SyncBatch, plan_norms, queue_all_norms, read_grad_norms

BIG = 1 << 9  # a 512 x 512 weight: past DOT_MIN_NUMEL


def _params(shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    """Parameters whose gradient ``i`` is all ``10 ** (i - 3)``: norm ``10 ** (i - 3) * sqrt(numel)``."""
    out = []
    for i, shape in enumerate(shapes):
        p = nn.Parameter(torch.zeros(shape))
        p.grad = torch.full(shape, 10.0 ** (i - 3))
        out.append(p)
    return out


def _read(params: list[torch.Tensor]) -> list[float] | None:
    op = SimpleNamespace(params=params)
    batch = SyncBatch()
    slots = queue_all_norms(batch, op, [p.grad for p in params])
    if slots is None:
        return None
    return read_grad_norms(batch.resolve(), slots, len(params))


def _expected(params: list[torch.Tensor]) -> list[float]:
    return [10.0 ** (i - 3) * math.sqrt(p.numel()) for i, p in enumerate(params)]


@pytest.mark.parametrize(
    "shapes",
    [
        [(7,), (BIG, BIG), (BIG,), (BIG, BIG), (3, 5), (BIG * BIG,)],
        [(BIG, BIG), (BIG,), (BIG, BIG), (BIG,)],  # Linear layers: weight, bias, weight, bias
        [(BIG, BIG), (BIG, BIG), (BIG,)],
        [(BIG, BIG), (BIG, BIG)],
        [(256,), (BIG, BIG), (256,), (3, 5), (3, 5), (256,), (7,), (64, 64), (64, 64)],  # groups, large and the rest
        [(256,), (256,), (256,)],  # one group
        [(), (), (256,), ()],  # 0-d parameters (a learned temperature, scale or gate) each have their own norm
        [(100, 100), (256,), (100, 100), (256,)],  # between the sizes: fused
    ],
)
def test_large_and_small_gradients_each_get_their_own_norm_in_the_parameters_order(shapes: list[tuple[int, ...]]) -> None:
    assert BIG * BIG >= DOT_MIN_NUMEL
    params = _params(shapes)
    got = _read(params)
    assert got is not None
    for g, want in zip(got, _expected(params)):
        assert math.isclose(g, want, rel_tol=1e-4), (got, _expected(params))


def test_each_layer_of_a_watched_mlp_gets_its_own_gradient_norm() -> None:
    model = nn.Sequential(nn.Linear(BIG, BIG), nn.Linear(BIG, BIG), nn.Linear(BIG, BIG))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with gradwatch.watch(model, opt, console=plain_console()) as gw:
        for i, p in enumerate(model.parameters()):
            p.grad = torch.full_like(p, 10.0 ** i)
        opt.step()
    layers = gw.engine.history.last[0].layer_norms
    want = {f"{k}": math.sqrt(BIG * BIG * 10.0 ** (4 * k) + BIG * 10.0 ** (4 * k + 2)) for k in range(3)}
    assert set(layers) == set(want)
    for k, v in want.items():
        assert math.isclose(layers[k], v, rel_tol=1e-4), (layers, want)


def test_a_nonfinite_large_gradient_reads_as_a_nonfinite_norm_and_leaves_the_others_alone() -> None:
    params = _params([(BIG, BIG), (BIG,), (BIG, BIG)])
    params[0].grad[3, 4] = float("nan")
    params[2].grad[0, 0] = float("inf")
    got = _read(params)
    assert got is not None
    assert math.isnan(got[0]) and got[2] == math.inf
    assert math.isclose(got[1], _expected(params)[1], rel_tol=1e-4)


def test_a_norm_past_float32_range_reads_as_inf_as_the_fused_kernel_reads_it() -> None:
    params = _params([(BIG, BIG), (BIG,)])
    params[0].grad.fill_(1e20)  # finite elements, squares past float32's range
    got = _read(params)
    fused = torch._foreach_norm([params[0].grad], 2, dtype=torch.float32)[0].item()
    assert got is not None and got[0] == fused == math.inf


def test_a_gradient_with_no_flat_view_makes_the_optimizer_use_the_fused_norms_from_then_on() -> None:
    params = _params([(BIG, BIG), (BIG,)])
    params[0].grad = torch.full((BIG, BIG), 1e-3).t().contiguous().t()  # same values, transposed strides
    assert not params[0].grad.is_contiguous()
    op = SimpleNamespace(params=params)
    for _ in range(2):  # the fallback step, then a step planned without dot products
        batch = SyncBatch()
        slots = queue_all_norms(batch, op, [p.grad for p in params])
        assert slots is not None
        got = read_grad_norms(batch.resolve(), slots, len(params))
        for g, want in zip(got, _expected(params)):
            assert math.isclose(g, want, rel_tol=1e-4)
    assert not op._norm_plan.split


def test_a_watched_loop_with_large_layers_reports_the_total_norm_clipping_measures() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(BIG, BIG), nn.Tanh(), nn.Linear(BIG, 4))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    seen = []
    with gradwatch.watch(model, opt, console=plain_console()) as gw:
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(16, BIG)).pow(2).mean().mul(1e3).backward()
            seen.append(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item())
            opt.step()
    totals = list(gw.engine.history.total_norms[0])
    assert len(totals) == 3
    for got, want in zip(totals, seen):
        assert math.isclose(got, want, rel_tol=1e-4)
    assert not gw.findings


def test_the_plan_splits_by_size_and_groups_small_gradients_by_shape() -> None:
    assert GROUP_MAX_NUMEL < DOT_MIN_NUMEL
    plan = plan_norms(_params([(256,), (BIG, BIG), (256,), (3, 5), (3, 5), (256,), (7,), (100, 100)]))
    assert plan.large == [1] and sorted(sorted(idx) for idx, _dims in plan.groups) == [[0, 2, 5], [3, 4]] and plan.rest == [6, 7]
    assert not plan_norms(_params([(7,), (100, 100)])).split  # nothing to split: one fused call
    assert not plan_norms(_params([(), (), ()])).split  # 0-d: nothing to stack them by
    half = [nn.Parameter(torch.zeros(BIG, BIG, dtype=torch.float16)), nn.Parameter(torch.zeros(256, dtype=torch.float16))]
    assert not plan_norms(half).split  # float32 only


def test_a_nonfinite_gradient_in_a_group_reads_as_a_nonfinite_norm_and_leaves_the_rest_of_the_group_alone() -> None:
    params = _params([(256,), (256,), (256,), (256,)])
    params[1].grad[7] = float("nan")
    params[2].grad[0] = float("-inf")
    got = _read(params)
    assert got is not None
    assert math.isnan(got[1]) and got[2] == math.inf
    for i in (0, 3):
        assert math.isclose(got[i], _expected(params)[i], rel_tol=1e-4)


def test_sparse_gradients_of_one_shape_are_measured_by_the_general_path() -> None:
    torch.manual_seed(0)
    model = nn.ModuleDict({"a": nn.Embedding(10, 4, sparse=True), "b": nn.Embedding(10, 4, sparse=True)})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradwatch.watch(model, opt, console=plain_console()) as gw:
        for _ in range(2):
            opt.zero_grad()
            idx = torch.tensor([1, 2, 3])
            (model["a"](idx).sum() + 100 * model["b"](idx).sum()).backward()
            opt.step()
    layers = gw.engine.history.last[0].layer_norms
    assert math.isclose(layers["a"], math.sqrt(12), rel_tol=1e-4) and math.isclose(layers["b"], 100 * math.sqrt(12), rel_tol=1e-4)
