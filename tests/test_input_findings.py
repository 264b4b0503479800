"""Findings about data and model state: their words come from tables keyed by cause; the message renders
from the explanation."""

from __future__ import annotations

import pytest

from gradwatch.diagnose.input_findings import (
    NO_FORWARD_WORDS,
    WEIGHTS_FIX,
    WEIGHTS_WHY,
    PoisonFacts,
    forward_error_finding,
    input_finding,
    loop_input_finding,
    no_forward_finding,
    poisoned_explanation,
    poisoned_finding,
    weights_cause,
    weights_fix_key,
)

ROWS = {"emb.weight": ([3, 7], 100)}


@pytest.mark.parametrize(
    ("facts", "cause"),
    [
        (PoisonFacts(5, ["w"], buffers=False, policy="warn", every=4), "applied"),
        (PoisonFacts(5, ["w"], buffers=False, every=4), "unchecked"),
        (PoisonFacts(5, ["w"], buffers=False, earlier=False, rows=ROWS), "rows"),
        (PoisonFacts(5, ["w"], buffers=False, earlier=True, rows=ROWS), "before"),
        (PoisonFacts(5, ["w"], buffers=False, earlier=False), "before"),
    ],
)
def test_weights_cause(facts: PoisonFacts, cause: str) -> None:
    assert weights_cause(facts) == cause
    assert cause in WEIGHTS_WHY


@pytest.mark.parametrize(
    ("facts", "key"),
    [
        (PoisonFacts(5, ["w"], buffers=False, earlier=True, rows=ROWS), "earlier"),
        (PoisonFacts(5, ["w"], buffers=False, earlier=False, rows=ROWS), "rows"),
        (PoisonFacts(5, ["w"], buffers=False, earlier=False), "reload"),
    ],
)
def test_weights_fix_key(facts: PoisonFacts, key: str) -> None:
    assert weights_fix_key(facts) == key
    assert key in WEIGHTS_FIX


def test_embedding_rows_are_listed_and_the_step_is_not_called_unlocalizable() -> None:
    text = poisoned_explanation(PoisonFacts(5, ["emb.weight"], buffers=False, earlier=False, rows=ROWS))
    assert "emb.weight: rows 3, 7 (2 of 100)" in text.what
    assert "cannot be localized" not in text.what
    assert text.fix.startswith("re-initialize those rows")


def test_reload_fix_asks_for_every_step_when_steps_are_skipped() -> None:
    fix = poisoned_explanation(PoisonFacts(5, ["w"], buffers=False, every=4, earlier=False)).fix
    assert "every=1" in fix and fix.endswith(".")


def test_poisoned_buffers_finding_renders_what_then_fix() -> None:
    f = poisoned_finding(PoisonFacts(2, ["bn.running_var"], buffers=True), layers=[])
    assert f.kind == "nan_origin" and f.data["phase"] == "buffers"
    assert f.message == f"{f.explanation.what}\nFix: {f.fix}"
    assert f.message.startswith("Buffers of the model hold NaN/Inf at step 2: bn.running_var. A forward pass")
    assert f.message.split("\n")[0].endswith("The origin cannot be localized from this step.")


def test_input_finding_keeps_the_data_cause_in_what_and_stale_buffers_after_the_fix() -> None:
    f = input_finding(3, [("args[0]", 2, 0)], buffers=["bn.running_mean"])
    assert f.explanation is not None and "args[0] (2 NaN, 0 Inf)" in f.explanation.what
    assert f.fix.startswith("find where the batch is built")
    assert f.message.endswith("or every later step is non-finite.")


def test_forward_error_finding_wraps_the_input_finding_with_the_exception() -> None:
    exc = ValueError("all elements of input should be between 0 and 1\nmore")
    f = forward_error_finding(4, exc, [("args[0]", 1, 0)], [])
    assert f.explanation is not None
    assert f.explanation.what.startswith("Training stopped at step 4 with ValueError: all elements of input")
    assert f.fix == input_finding(4, [("args[0]", 1, 0)]).fix
    assert f.data["raised"] == "ValueError" and f.data["outputs"] == []


def test_forward_error_finding_on_finite_inputs_names_the_models_output() -> None:
    f = forward_error_finding(4, RuntimeError("boom"), [], [("output", 0, 3)])
    assert "output (0 NaN, 3 Inf)" in f.message and f.data["inputs"] == []


def test_loop_input_finding_is_a_warning_with_the_targets_fix() -> None:
    f = loop_input_finding(1, [("y (in main() at train.py:3)", 4, 0)])
    assert f.severity == "warning" and f.data["source"] == "loop"
    assert f.fix.startswith("find where the targets are built")


@pytest.mark.parametrize(("model", "key"), [(None, "loop"), (type("M", (), {"training_step": print})(), "training_step")])
def test_no_forward_finding_words_by_who_went_around_the_forward(model: object, key: str) -> None:
    f = no_forward_finding(6, model)  # type: ignore[arg-type]
    cause, fix = NO_FORWARD_WORDS[key]
    assert cause in f.explanation.what and f.fix.startswith(fix)
    assert f.message.endswith("a NaN born in an op is named with its line.")
