"""not_in_optimizer and foreign_params: model parameters no optimizer updates, parameters an optimizer holds
that the model does not own, and tensors the model trains through without registering them; on
constructed statistics (real tensors where the check looks at them)."""

from __future__ import annotations

import torch
from _check_steps import kinds, run
from torch import nn

from gradwatch.checks import not_in_optimizer
from gradwatch.core.stats import StepStats


def test_a_layer_added_after_the_optimizer_is_flagged_once() -> None:
    steps = [StepStats(step=s, names=["body.weight"], not_in_optimizer=("head.weight", "head.bias"),
                       first_check=s == 0) for s in range(3)]
    (f,) = run(not_in_optimizer, steps)
    assert (f.kind, f.step, f.module) == ("not_in_optimizer", 0, "head") and "add_param_group" in f.fix


def test_a_head_replaced_after_the_optimizer_is_one_finding_that_names_the_old_one() -> None:
    stats = StepStats(step=0, names=["body.weight"], none_grad=("<old head>",), foreign=("<old head>",),
                      not_in_optimizer=("head.weight",), first_check=True)
    (f,) = run(not_in_optimizer, [stats])
    assert f.kind == "not_in_optimizer" and "the layer was replaced after the optimizer was built" in f.message


def test_an_optimizer_built_for_another_model_is_one_foreign_params_finding() -> None:
    stats = StepStats(step=0, none_grad=("<other>.weight",), foreign=("<other>.weight",),
                      not_in_optimizer=("fc.weight",), first_check=True)
    (f,) = run(not_in_optimizer, [stats])
    assert (f.kind, f.data["another_model"]) == ("foreign_params", True) and "It holds none of" in f.message


def test_unregistered_tensors_are_flagged_with_a_fix_per_way_they_escaped() -> None:
    unregistered = [("blocks[0].weight", "container"), ("scale", "tensor"), ("head.weight", "forward")]
    (f,) = run(not_in_optimizer, [StepStats(step=0, names=["fc.weight"], extra={"unregistered": unregistered})])
    assert f.data["containers"] == ["blocks"] and f.data["tensors"] == ["scale"]
    assert f.fix.index("create the layer once") < f.fix.index("nn.ModuleList") < f.fix.index("nn.Parameter")


def test_a_model_whose_optimizer_holds_every_parameter_is_not_flagged() -> None:
    assert run(not_in_optimizer, [StepStats(step=0, names=["fc.weight", "fc.bias"], first_check=True)]) == []


def test_parameters_of_the_loss_trained_with_the_model_are_not_flagged() -> None:
    # CenterLoss centers: foreign, but they get gradients next to the model's own
    stats = StepStats(step=0, names=["fc.weight", "<centers>"], foreign=("<centers>",), first_check=True)
    assert run(not_in_optimizer, [stats]) == []


def test_an_optimizer_over_inputs_is_not_flagged() -> None:
    # style transfer, adversarial examples: the model is the fixed function, the image is trained
    image = torch.zeros(1, 3, 4, 4, requires_grad=True)
    stats = StepStats(step=0, names=["<image>"], foreign=("<image>",), not_in_optimizer=("weight", "bias"),
                      first_check=True, extra={"params": [image]})
    assert kinds(run(not_in_optimizer, [stats])) == []
    # the same optimizer over an nn.Parameter the model does not own: a model it does not train
    stats.extra["params"] = [nn.Parameter(image.detach())]
    assert kinds(run(not_in_optimizer, [stats])) == ["not_in_optimizer", "foreign_params"]


def test_nothing_is_looked_at_between_changes_of_the_parameter_sets() -> None:
    stats = StepStats(step=5, names=["body.weight"], not_in_optimizer=("head.weight",))
    assert run(not_in_optimizer, [stats]) == []
