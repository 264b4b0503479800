"""A step one rank's loop skipped under DDP, as pure functions: the probe's marks in the agreement vector, which
flagged ranks saw values of their own, and the words rank zero says. The two-process run is in
test_distributed.py (test_a_step_one_rank_skips_on_its_own_is_skipped_on_every_rank_without_a_crash)."""

from __future__ import annotations

import torch

from gradwatch.core.stats import StepStats
from gradwatch.observe.distributed import flagged_ranks
from gradwatch.observe.rank_findings import skipped_step_finding
from gradwatch.observe.skipped_step import mark_probe, probing_ranks, ranks_that_saw_values, without_probes


def test_a_probe_flags_its_rank_and_leaves_no_stale_loss_once_its_mark_is_taken_out() -> None:
    world = 3
    vec = torch.zeros(2 * world)
    mark_probe(vec, 1, world)
    vec[world + 2] = 1.0  # rank 2: a real stale loss
    values = vec.tolist()
    assert probing_ranks(values, world) == [1]
    assert flagged_ranks(without_probes(values, world), world) == ([1], [2])


def test_every_rank_probing_is_told_apart_from_a_step_some_ranks_check() -> None:
    world = 2
    both, one = torch.zeros(2 * world), torch.zeros(2 * world)
    for r in range(world):
        mark_probe(both, r, world)
    mark_probe(one, 1, world)
    one[0] = 1.0  # rank 0 checks its step, with NaN gradients
    assert probing_ranks(both.tolist(), world) == [0, 1]
    assert probing_ranks(one.tolist(), world) == [1]


def test_a_rank_that_only_skipped_is_not_said_to_have_seen_nan() -> None:
    reports = [{"rank": 0, "nonfinite_count": 3}, {"rank": 1, "nonfinite_count": 0}, {"rank": 2, "loss_nonfinite": True}]
    assert ranks_that_saw_values([0, 1, 2], skipped=[1, 2], reports=reports) == [0, 2]


def test_rank_zero_names_the_rank_that_skipped_and_the_fix() -> None:
    f = skipped_step_finding(StepStats(step=3), [1])
    assert (f.kind, f.step, f.severity, f.data["skipped_ranks"]) == ("nonfinite_on_other_rank", 3, "warning", [1])
    assert "The training code of rank 1 skipped optimizer.step() at step 3 on its own" in f.message
    assert "skipped the update on every rank" in f.message
    assert "dist.all_reduce(bad)" in f.fix
