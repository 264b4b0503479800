"""Rank agreement's decisions and words as pure functions, without a process group: which ranks are flagged,
which other rank's origin is relayed, and the explanations of the other-rank findings. The multi-process
behaviour is in test_distributed.py."""

from __future__ import annotations

from typing import Any

from gradwatch.core.findings import Explanation, Finding
from gradwatch.core.stats import StepStats
from gradwatch.observe.distributed import flagged_ranks
from gradwatch.observe.rank_findings import (
    origin_summary,
    origin_to_relay,
    other_rank_dropped_finding,
    other_rank_finding,
    other_rank_input_finding,
    relayed_finding,
)

REPORTS: list[dict[str, Any]] = [
    {"rank": 0, "nonfinite": [], "nonfinite_count": 0, "loss_nonfinite": False, "inputs": []},
    {"rank": 1, "nonfinite": ["fc.weight"], "nonfinite_count": 1, "nan": 2, "inf": 0, "loss_nonfinite": True,
     "inputs": [["x", 2, 0]]},
]


def test_flagged_ranks_read_the_two_halves_of_the_summed_vector() -> None:
    assert flagged_ranks([0.0, 1.0, 0.0, 1.0, 0.0, 0.0], 3) == ([1], [0])


def test_an_origin_named_by_another_rank_is_relayed_before_a_loss_only_summary() -> None:
    origin = {"rank": 1, "message": "m", "op": "LogBackward0"}
    loss = {"rank": 2, "message": "l", "loss_only": True}
    assert origin_to_relay([None, origin, loss], rank=0, loss_only_here=False) is origin
    assert origin_to_relay([None, loss], rank=0, loss_only_here=False) is loss


def test_nothing_is_relayed_when_this_rank_says_it_itself() -> None:
    loss = {"rank": 1, "message": "l", "loss_only": True}
    assert origin_to_relay([None, loss], rank=0, loss_only_here=True) is None
    assert origin_to_relay([{"rank": 0, "message": "mine"}], rank=0, loss_only_here=False) is None


def test_a_relayed_origin_keeps_the_other_ranks_words_in_parts() -> None:
    words = Explanation("NaN born in log at model.py:3.", why="it spreads.", fix="add an epsilon.")
    theirs = Finding(kind="nan_origin", step=5, severity="error", explanation=words, op="LogBackward0",
                     data={"phase": "forward", "op": "LogBackward0", "module": "head"})
    summary = origin_summary(1, theirs, None)
    assert summary is not None
    relayed = relayed_finding(StepStats(step=5), summary, rank=0)
    prefix = "On rank 1 (rank 0, reporting, got it through the gradient all-reduce): "
    assert relayed.message == prefix + theirs.message
    assert relayed.fix == "add an epsilon."
    assert relayed.data["origin_rank"] == 1 and "explanation" not in relayed.data and "message" not in relayed.data


def test_a_relayed_finding_from_a_message_alone_keeps_the_message() -> None:
    relayed = relayed_finding(StepStats(step=5), {"rank": 1, "message": "Loss is NaN.", "loss_only": True}, rank=0)
    assert (relayed.kind, relayed.message) == ("nonfinite_loss", "On rank 1: Loss is NaN.")


def test_the_other_rank_finding_says_why_and_how_to_fix_in_parts() -> None:
    f = other_rank_finding(StepStats(step=3), [1], REPORTS, "skip")
    assert f.explanation is not None
    assert f.explanation.what.startswith("Rank(s) 1 saw non-finite values at step 3:\n  rank 1: 1 gradient(s)")
    assert f.explanation.what.endswith("Every rank skipped this update, so the replicas stay identical.")
    assert "The data on rank 1 is the cause" in f.explanation.what
    assert f.explanation.why.startswith("one rank's NaN reaches every replica")
    assert f.fix.startswith("look at the batch that rank got at this step")


def test_the_dropped_and_input_findings_of_other_ranks_carry_a_fix() -> None:
    dropped = other_rank_dropped_finding(StepStats(step=4, extra={"scaler_dropped": (2, 1)}), [1])
    assert (dropped.step, dropped.fix.split(" (")[0]) == (2, "look at the data on rank 1 at that step")
    assert "NaN/Inf at step 2" in dropped.explanation.what  # type: ignore[union-attr]
    inputs = other_rank_input_finding(StepStats(step=4), [1], REPORTS, "raise")
    assert inputs.explanation is not None and inputs.explanation.what.endswith("every rank stops before the update.")
    assert inputs.fix.startswith("look at the batch rank 1 got at this step")
