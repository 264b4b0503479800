"""The reentrant-checkpoint cause: its words, and the restated no_grad_graph finding."""

from __future__ import annotations

from gradwatch.core.findings import Explanation, Finding
from gradwatch.diagnose.reentrant import explain_cut, reentrant_cause, reentrant_words

CUT = {"layers.0": ["layers.0.A", "layers.0.B"]}


def test_words_name_the_segment_and_its_parameters() -> None:
    cause, fix = reentrant_words(CUT)
    assert "ran `layers.0` on an input that does not require grad" in cause
    assert "(layers.0.A, layers.0.B)" in cause and cause.endswith("They are not frozen.")
    assert fix.startswith("checkpoint with use_reentrant=False")


def test_several_segments_are_worded_in_the_plural() -> None:
    cause, _fix = reentrant_words({"a": ["a.w"], "b": ["b.w"]})
    assert "on inputs that do not require grad" in cause and "inside them" in cause


def test_reentrant_cause_is_the_cause_then_its_fix() -> None:
    cause, fix = reentrant_words(CUT)
    assert reentrant_cause(CUT) == f"{cause} Fix: {fix}"


def test_a_message_only_no_grad_graph_finding_is_restated_as_an_explanation() -> None:
    before = Finding(
        kind="no_grad_graph", step=0, severity="error",
        message="backward() failed at step 0: no graph.\nCause: frozen layers.\nWhy it matters: nothing learns.",
        data={"cause": "frozen_path"},
    )
    after = explain_cut(before, CUT)
    assert after.explanation is not None and after.explanation.what == "backward() failed at step 0: no graph."
    assert after.explanation.cause == reentrant_words(CUT)[0] and after.fix == reentrant_words(CUT)[1]
    assert after.data["cause"] == "reentrant_checkpoint" and after.module == "layers.0"
    assert "frozen layers" not in after.message


def test_an_explained_finding_keeps_its_what_and_why() -> None:
    before = Finding(kind="no_grad_graph", step=0, severity="error", explanation=Explanation("what", why="why"))
    after = explain_cut(before, CUT)
    assert after.explanation is not None and (after.explanation.what, after.explanation.why) == ("what", "why")
