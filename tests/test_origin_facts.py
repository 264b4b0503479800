"""The words of a located nan_origin, from its facts alone: the fix table's rows and the phase's message."""

from __future__ import annotations

import dataclasses
import math

from gradwatch.diagnose.op_fixes import fix_for
from gradwatch.diagnose.origin import OriginFacts, origin_fix, origin_message

SQRT_BACKWARD = OriginFacts(
    step=7,
    phase="backward",
    op="SqrtBackward0",
    forward_op="torch.sqrt",
    module="encoder.norm",
    lightning=False,
    source="model.py:12 in forward",
    code="return x.sqrt()",
    incoming={"max_abs": 1.0, "forward_min_abs": 0.0, "forward_max_abs": 2.0},
    outgoing={"inf": True, "nan": False},
    forward_birth=False,
    explicit_operand=False,
    masked=False,
    loss_before_model=False,
    surrogate=False,
    half=False,
    half_weights=False,
    first_module=None,
    first_module_inputs={},
)


def test_with_no_row_matching_the_fix_is_the_ops_own() -> None:
    assert origin_fix(SQRT_BACKWARD) == fix_for("SqrtBackward0", "torch.sqrt")


def test_backward_message_names_op_module_line_and_step() -> None:
    message = origin_message(SQRT_BACKWARD)
    assert message.startswith(
        "Born in the backward pass of step 7 (the forward pass was finite): op SqrtBackward0 (torch.sqrt) "
        "in module encoder.norm\n    model.py:12 in forward\n      return x.sqrt()\nIt received a finite "
        "gradient (|g| up to 1) and produced Inf."
    )
    assert "\nFix: the derivative of sqrt is infinite at 0" in message


def test_rows_apply_in_order_and_an_explicit_operand_replaces_them_all() -> None:
    half = dataclasses.replace(SQRT_BACKWARD, half=True)
    assert origin_fix(half).endswith("Otherwise: " + fix_for("SqrtBackward0", "torch.sqrt"))
    explicit = dataclasses.replace(half, explicit_operand=True)
    assert origin_fix(explicit).startswith("the float('inf')/float('nan') written in this line")


def test_softmax_inputs_range_tells_a_plus_inf_logit_from_a_masked_row() -> None:
    softmax = dataclasses.replace(SQRT_BACKWARD, phase="forward", op="SoftmaxBackward0", forward_op="torch.softmax")
    masked_row = dataclasses.replace(softmax, incoming={"inf": True, "min": -math.inf, "max": 1.0})
    plus_inf = dataclasses.replace(softmax, incoming={"inf": True, "min": 0.0, "max": math.inf})
    assert origin_fix(masked_row).startswith("a fully masked row")
    assert origin_fix(plus_inf).startswith("a logit of +inf")


def test_a_loss_that_went_first_names_the_first_backward_op_without_the_word_op() -> None:
    first = dataclasses.replace(SQRT_BACKWARD, loss_before_model=True)
    message = origin_message(first)
    assert "In the backward pass the first op to go non-finite was SqrtBackward0 (torch.sqrt) in module " in message
    assert "\nFix: the model's output (and so its inputs or weights) reached values the loss cannot hold" in message


def test_a_backward_mul_of_a_masked_inf_takes_the_fix_of_the_op_that_made_the_inf() -> None:
    mul = dataclasses.replace(
        SQRT_BACKWARD, op="MulBackward0", forward_op="Tensor.mul", outgoing={"nan": True, "inf": False},
        incoming={"max_abs": 0.1, "forward_min": -math.inf, "forward_max_abs": math.inf},
        inf_op="torch.log", inf_forward_op="torch.log", inf_source="model.py:9 in forward", inf_code="w * x.log()",
    )
    assert origin_fix(mul).startswith(fix_for("LogBackward0") + " Here the Inf it made was masked out")
    assert "The Inf among its forward inputs was made by op torch.log at model.py:9 in forward: w * x.log();" in (
        origin_message(mul)
    )
    assert origin_fix(dataclasses.replace(mul, inf_op=None)) == fix_for("MulBackward0")
