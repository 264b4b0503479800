"""The incident's decisions: which finding a localization ends in, the report's note, the saved inputs."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from gradwatch.diagnose.capture import Batch, Call
from gradwatch.diagnose.incident import layer_table, needs_loop_scan, origin_verdict, replay_note, saved_inputs
from gradwatch.diagnose.localize import Localization
from gradwatch.diagnose.replay import ReplayResult


def test_stale_buffers_win_over_a_replay_that_named_no_op() -> None:
    assert origin_verdict(has_result=True, stale_buffers=True) == "stale"
    assert origin_verdict(has_result=False, stale_buffers=True) == "stale"


def test_a_replay_result_without_stale_buffers_is_the_origin() -> None:
    assert origin_verdict(has_result=True, stale_buffers=False) == "origin"


def test_nothing_replayed_and_no_stale_buffers_reports_no_origin() -> None:
    assert origin_verdict(has_result=False, stale_buffers=False) is None


def test_the_loop_is_scanned_only_for_a_nan_born_in_the_loss_code_of_a_plain_loop() -> None:
    born_in_loss = ReplayResult(Localization(), replayed=True, surrogate=False, upstream_bad=True)
    finite = ReplayResult(Localization(), replayed=True, surrogate=False, upstream_bad=False)
    assert needs_loop_scan(True, born_in_loss)
    assert not needs_loop_scan(False, born_in_loss)
    assert not needs_loop_scan(True, finite)
    assert not needs_loop_scan(True, None)


def test_replay_note_says_why_nothing_was_found() -> None:
    assert replay_note(True, None) is None
    assert "torch.distributed.all_gather" in (replay_note(False, "all_gather") or "")
    assert "was finite" in (replay_note(False, None) or "")


def test_saved_inputs_are_the_culprits_and_every_call_of_the_step() -> None:
    calls = [Call((torch.ones(1),), {"k": i}, None) for i in range(2)]
    saved = saved_inputs(calls, calls[0])
    assert saved is not None and saved["kwargs"] == {"k": 0} and len(saved["calls"]) == 2


def test_saved_inputs_of_lightning_batches_default_to_the_last() -> None:
    batches = [Batch("b0", 0, None, None), Batch("b1", 1, None, None)]
    saved = saved_inputs(batches, None)
    assert saved is not None and saved["batch"] == "b1" and saved["batch_idx"] == 1 and len(saved["batches"]) == 2
    assert saved_inputs([], None) is None


def test_layer_table_sums_norms_and_counts_per_module() -> None:
    stats = SimpleNamespace(
        names=["a.w", "a.b", "w"], modules=["a", "a", ""], norms=[3.0, 4.0, 1.0],
        nan_counts={"a.b": 2}, inf_counts={"w": 1},
    )
    rows = layer_table(stats)
    assert [r["layer"] for r in rows] == ["a", "<root>"]
    assert rows[0]["grad_norm"] == 5.0 and rows[0]["nan"] == 2 and rows[1]["inf"] == 1
