"""The replay's pure parts: which result ends the search, which outputs get which gradient, private inputs."""

from __future__ import annotations

import torch

from gradwatch.diagnose.capture import Batch, Call
from gradwatch.diagnose.localize import Localization, Origin
from gradwatch.diagnose.replay import (
    MAX_REPLAYS,
    ReplayResult,
    backward_targets,
    lightning_order,
    preserved,
    replay_input,
    replay_verdict,
    set_rng_state,
    suspect_calls,
)

ORIGIN = Origin(phase="forward", op="SqrtBackward0", forward_op="torch.sqrt", module="body", source=None, code=None)


def _result(origin: Origin | None = None, *, upstream_bad: bool = False, forward_finite: bool = True) -> ReplayResult:
    loc = Localization(origin=origin, forward_finite=forward_finite)
    return ReplayResult(loc, replayed=True, surrogate=False, upstream_bad=upstream_bad)


def test_a_named_origin_is_found_even_after_a_collective() -> None:
    assert replay_verdict(_result(ORIGIN), stopped=True) == "found"
    assert replay_verdict(_result(ORIGIN), stopped=False) == "found"


def test_a_replay_stopped_at_a_collective_before_the_origin_stops_the_search() -> None:
    assert replay_verdict(_result(upstream_bad=True), stopped=True) == "stop"


def test_a_finite_replay_moves_to_the_next_call() -> None:
    assert replay_verdict(_result(), stopped=False) == "next"


def test_a_nonfinite_upstream_or_forward_is_found_without_an_op() -> None:
    assert replay_verdict(_result(upstream_bad=True), stopped=False) == "found"
    assert replay_verdict(_result(forward_finite=False), stopped=False) == "found"


def test_loss_born_means_a_finite_forward_and_a_nonfinite_upstream_gradient() -> None:
    assert _result(upstream_bad=True).loss_born
    assert not _result(upstream_bad=True, forward_finite=False).loss_born
    assert not _result(ORIGIN, upstream_bad=True).loss_born
    assert _result(ORIGIN).named and not _result().named


def test_backward_targets_use_the_received_gradients_and_skip_outputs_without_one() -> None:
    a = torch.ones(2, requires_grad=True) * 2
    b = torch.ones(3, requires_grad=True) * 3
    g = torch.full((2,), 5.0)
    targets, grads = backward_targets([a, "not a tensor", b], {0: g})
    assert len(targets) == 1 and targets[0] is a and grads[0] is g


def test_backward_targets_send_ones_when_no_gradient_is_held() -> None:
    a = torch.ones(2, requires_grad=True) * 2
    targets, grads = backward_targets([a, torch.zeros(2)], None)
    assert targets == [a] and torch.equal(grads[0], torch.ones(2))


def test_backward_targets_skip_a_held_gradient_of_another_shape() -> None:
    a = torch.ones(2, requires_grad=True) * 2
    assert backward_targets([a], {0: torch.ones(3)}) == ([], [])


def test_suspect_calls_are_those_whose_output_gradient_or_loss_went_nonfinite() -> None:
    calls = [Call((torch.ones(1),), {}, None) for _ in range(3)]
    calls[1].set_grad(0, torch.tensor([float("nan")]))
    assert suspect_calls(calls) == [calls[1]]


def test_lightning_order_puts_batches_with_a_nonfinite_loss_first() -> None:
    batches = [Batch(i, i, None, None) for i in range(MAX_REPLAYS + 2)]
    batches[3].losses.append(torch.tensor(float("inf")))
    order = lightning_order(batches)
    assert order[0] is batches[3] and len(order) == MAX_REPLAYS and batches[0] in order


def test_replay_input_is_a_private_copy_that_keeps_requires_grad() -> None:
    x = torch.ones(2, requires_grad=True)
    c = replay_input(x)
    assert c is not x and c.requires_grad and c.grad_fn is None
    c.detach().add_(1)
    assert torch.equal(x.detach(), torch.ones(2))
    assert replay_input(3) == 3


def test_preserved_restores_buffers_and_the_random_state() -> None:
    model = torch.nn.BatchNorm1d(2)
    before = model.running_mean.clone()
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    with preserved(model):
        model(torch.randn(4, 2) + 10)
        torch.rand(7)
    assert torch.equal(model.running_mean, before)
    assert torch.equal(torch.rand(3), expected)


def test_set_rng_state_draws_again_the_numbers_drawn_from_that_state() -> None:
    state = (torch.get_rng_state(), None)
    first = torch.rand(3)
    set_rng_state(state)
    assert torch.equal(torch.rand(3), first)
    set_rng_state(None)  # no state was kept: nothing to set
