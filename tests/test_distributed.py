"""Two processes, gloo on CPU: decisions agree across ranks, findings name the rank, sharded norms are global.

Every scenario runs once in one pair of processes (``tests/_dist_worker.py``); a hang fails the run
through the timeout instead of blocking the suite.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from typing import Any

import pytest
import torch
from helpers import free_port, panels

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="torch.distributed with gloo is needed",
)

WORKER = os.path.join(os.path.dirname(__file__), "_dist_worker.py")
TIMEOUT = 120


def launch(tmp: str, *args: str, timeout: float = TIMEOUT, worker: str = WORKER) -> tuple[list[int | None], list[str]]:
    """Start both ranks of ``worker``; kill both if either is still running after ``timeout`` seconds."""
    port = str(free_port())
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen(
            [sys.executable, worker, str(rank), "2", port, tmp, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for rank in (0, 1)
    ]
    codes: list[int | None] = []
    logs: list[str] = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=timeout)
            codes.append(p.returncode)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            out, _ = p.communicate()
            codes.append(None)
        logs.append(out)
    return codes, logs


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = str(tmp_path_factory.mktemp("dist"))
    codes, logs = launch(tmp)
    assert codes == [0, 0], f"a rank failed or hung (None = killed after {TIMEOUT}s): {codes}\n" + "\n".join(logs)
    return read_runs(tmp)


def read_runs(tmp: str) -> list[dict[str, Any]]:
    out = []
    for rank in (0, 1):
        with open(os.path.join(tmp, f"rank{rank}.json")) as f:
            out.append(json.load(f))
    return out


def scenario(runs: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    both = [r[name] for r in runs]
    for rank, r in enumerate(both):
        assert "error" not in r, f"rank {rank}: {r.get('error')}"
    return both


def kinds(result: dict[str, Any]) -> list[tuple[str, int]]:
    return [(f["kind"], f["step"]) for f in result["findings"]]


# -- one rank sees a NaN: both ranks act alike ---------------------------------------------------------
def test_nan_on_one_rank_only_is_skipped_on_both(runs: list[dict[str, Any]]) -> None:
    r0, r1 = scenario(runs, "skip")
    assert r0["skipped"] == r1["skipped"] == 1
    assert r0["unchanged_at_nan"] and r1["unchanged_at_nan"]


def test_replicas_stay_identical_after_a_nan_on_one_rank(runs: list[dict[str, Any]]) -> None:
    r0, r1 = scenario(runs, "skip")
    assert r0["params"] == r1["params"]
    assert all(math.isfinite(v) for v in r0["params"])  # no NaN reached the weights


def test_rank_zero_reports_the_other_ranks_problem_with_its_parameters(runs: list[dict[str, Any]]) -> None:
    r0, _ = scenario(runs, "skip")
    (f,) = [f for f in r0["findings"] if f["kind"] == "nonfinite_on_other_rank"]
    assert f["step"] == 3 and f["data"]["ranks"] == [1] and f["data"]["rank"] == 0
    assert "encoder.0.weight" in f["params"]
    assert "rank 1: 4 gradient(s) with NaN/Inf" in r0["console"]
    assert "Every rank skipped this update" in r0["console"]


def test_findings_carry_the_rank_that_saw_the_problem(runs: list[dict[str, Any]]) -> None:
    _, r1 = scenario(runs, "skip")
    (f,) = [f for f in r1["findings"] if f["kind"] == "nonfinite_grad"]
    assert f["step"] == 3 and f["data"]["rank"] == 1 and f["data"]["ranks"] == [1]


def test_only_rank_zero_prints(runs: list[dict[str, Any]]) -> None:
    r0, r1 = scenario(runs, "skip")
    assert "gradwatch summary" in r0["console"]
    assert r1["console"] == ""


def test_raise_raises_on_both_ranks_at_the_same_step(runs: list[dict[str, Any]]) -> None:
    r0, r1 = scenario(runs, "raise")
    assert r0["raised"]["step"] == r1["raised"]["step"] == 3
    assert "rank 1: 4 gradient(s) with NaN/Inf" in r0["raised"]["message"]


# -- DDP -----------------------------------------------------------------------------------------------
def test_ddp_nan_is_skipped_on_both_ranks_and_names_both(runs: list[dict[str, Any]]) -> None:
    r0, r1 = scenario(runs, "ddp_nan")
    assert r0["skipped"] == r1["skipped"] == 1
    assert r0["params"] == r1["params"]
    (f,) = [f for f in r0["findings"] if f["kind"] == "nonfinite_grad"]
    assert f["data"]["ranks"] == [0, 1]  # DDP's all-reduce carried rank 1's NaN to rank 0
    assert ("nonfinite_loss", 3) in kinds(r1) and ("nonfinite_loss", 3) not in kinds(r0)


# zero_grad() inside a 4-micro-batch accumulation loop under DDP (tester report r6): DDP's reducer writes the
# averaged gradient into .grad at the end of the last backward; that write was taken for the code's own.
@pytest.mark.parametrize(
    "name, found",
    [
        ("ddp_zero_grad_in_accumulation", [("zero_grad_in_accumulation", 0)]),
        ("ddp_zero_grad_in_accumulation_synced", [("zero_grad_in_accumulation", 0)]),
        ("ddp_accumulation", []),
        ("ddp_accumulation_synced", []),
    ],
)
def test_zero_grad_inside_ddp_accumulation_is_flagged_on_both_ranks(
    runs: list[dict[str, Any]], name: str, found: list[tuple[str, int]]
) -> None:
    r0, r1 = scenario(runs, name)
    assert kinds(r0) == kinds(r1) == found


# A batch whose targets are all ignore_index on rank 1 (a padded last batch): NaN loss, finite gradients. Rank
# zero, the rank that prints, said only "rank 1: a non-finite loss"; rank 1's own finding names the cause.
def test_rank_zero_says_why_another_ranks_loss_alone_was_nan(runs: list[dict[str, Any]]) -> None:
    r0, r1 = scenario(runs, "ddp_ignored_targets")
    (mine,) = [f for f in r1["findings"] if f["kind"] == "nonfinite_loss"]
    (relayed,) = [f for f in r0["findings"] if f["kind"] == "nonfinite_loss"]
    assert relayed["step"] == mine["step"] == 3 and relayed["data"]["origin_rank"] == 1
    assert relayed["message"] == "On rank 1: " + mine["message"]
    assert "every target equal to ignore_index" in " ".join(r0["console"].replace("│", " ").split())  # printed


# The epoch's remainder carried into the next epoch under DDP no_sync accumulation: the fix (also step on the
# last batch) must also take that backward out of no_sync, or the ranks step on unsynced gradients.
def test_ddp_accumulation_remainder_fix_says_the_last_backward_must_all_reduce(runs: list[dict[str, Any]]) -> None:
    for r in scenario(runs, "ddp_remainder"):
        (f,) = r["findings"]
        assert (f["kind"], f["step"]) == ("accumulation_remainder", 2)
        assert "Under DDP, the same condition must leave that last backward outside model.no_sync()" in f["message"]


@pytest.mark.parametrize("which", ["ddp_unused_wrapped", "ddp_unused_inner"])
def test_ddp_unused_parameters_are_named_by_their_module_path(runs: list[dict[str, Any]], which: str) -> None:
    r0, r1 = scenario(runs, which)
    for r in (r0, r1):
        (f,) = [f for f in r["findings"] if f["kind"] == "none_grad"]
        assert f["params"] == ["aux.weight", "aux.bias"]  # no "module." prefix from the DDP wrapper
        assert f["step"] == 20  # find_unused_parameters=True: unused on some steps is expected, so it waits


def test_ddp_head_used_on_some_steps_only_is_silent(runs: list[dict[str, Any]]) -> None:
    for r in scenario(runs, "ddp_alternating_head"):
        assert [f["kind"] for f in r["findings"]] == []


# -- DDP, NaN in rank 1's data: rank zero (the one that prints) names rank 1 and its data as the cause -----
def test_ddp_nan_in_one_ranks_inputs_is_named_with_that_rank_on_rank_zero(runs: list[dict[str, Any]]) -> None:
    r0, r1 = scenario(runs, "ddp_nan_input")
    assert r0["skipped"] == r1["skipped"] == 1 and r0["params"] == r1["params"]
    assert ("nonfinite_grad", 3) in kinds(r0)  # DDP's all-reduce carried rank 1's NaN here
    (f,) = [f for f in r0["findings"] if f["kind"] == "nonfinite_input"]
    assert f["step"] == 3 and f["data"]["ranks"] == [1] and f["data"]["rank"] == 0
    assert [(i["rank"], i["nan"]) for i in f["data"]["inputs"]] == [(1, 1)]
    assert "The data on rank 1, not the model, is the cause" in r0["console"]
    assert "rank 1: args[0] (1 NaN, 0 Inf)" in r0["console"]
    (own,) = [f for f in r1["findings"] if f["kind"] == "nonfinite_input"]  # rank 1's own, not printed
    assert own["data"]["ranks"] == [1] and r1["console"] == ""


def test_ddp_nan_in_one_ranks_loss_is_named_without_held_inputs(runs: list[dict[str, Any]]) -> None:
    r0, r1 = scenario(runs, "ddp_nan_loss")  # escalate=False: no inputs held, the observed losses tell
    assert r0["skipped"] == r1["skipped"] == 1 and r0["params"] == r1["params"]
    (f,) = [f for f in r0["findings"] if f["kind"] == "nonfinite_on_other_rank"]
    assert f["step"] == 3 and f["data"]["ranks"] == [1]
    assert "came from rank 1: the loss there was non-finite while this rank's was finite" in r0["console"]
    assert "rank 1: 4 gradient(s) with NaN/Inf (49 NaN, 0 Inf)" in r0["console"]


# Fused AdamW (nanoGPT's set-up) unscales in its own step, which then runs on the dropped step: rank 0
# reported only an ordinary overflow.
@pytest.mark.parametrize("name", ["ddp_nan_scaler", "ddp_nan_scaler_fused"])
def test_ddp_nan_step_a_grad_scaler_dropped_names_the_rank_of_the_nan_loss(
    runs: list[dict[str, Any]], name: str
) -> None:
    r0, r1 = scenario(runs, name)  # the scaler, not gradwatch, drops the step on both ranks
    assert r0["params"] == r1["params"] and all(math.isfinite(v) for v in r0["params"])
    (f,) = [f for f in r0["findings"] if f["kind"] == "nonfinite_on_other_rank"]
    assert f["severity"] == "warning" and f["data"]["ranks"] == [1]
    assert "The loss on rank 1 was NaN/Inf at step 3" in r0["console"]
    assert f["step"] == 3  # the step the scaler dropped, as rank 1 numbers it
    assert ("nonfinite_loss", 3) in kinds(r1)  # rank 1's own, at its step


def test_ranks_stepping_unevenly_finish_with_rank_agreement_off(runs: list[dict[str, Any]]) -> None:
    # With the agreement on, gradwatch's collective of one rank would pair with DDP's of the other.
    r0, r1 = scenario(runs, "ddp_guarded_step")
    assert r0["params"] == r1["params"] and all(math.isfinite(v) for v in r0["params"])
    assert ("nonfinite_grad", 3) in kinds(r0)  # rank 0 stepped on the NaN gradients: gradwatch skipped it


def test_other_ranks_finding_says_its_data_is_the_cause(runs: list[dict[str, Any]]) -> None:
    r0, _ = scenario(runs, "skip")  # no DDP: rank 0 is finite, rank 1's batch held the NaN
    (f,) = [f for f in r0["findings"] if f["kind"] == "nonfinite_on_other_rank"]
    assert f["data"]["input_ranks"] == [1]
    assert "head.bias; an input batch with NaN/Inf (args[0] (1 NaN, 0 Inf))" in f["message"]
    assert "The data on rank 1 is the cause" in r0["console"]


# -- DDP with uneven inputs under model.join(): gradwatch runs no collective of its own ----------------------
UNEVEN_TIMEOUT = TIMEOUT  # a hang fails here instead of blocking the suite; 40 s was too short on a busy machine


@pytest.fixture(scope="module")
def uneven_runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    names = "join_unwatched,join_ddp,join_inner,join_nan,rank0_only,probe_on_rank0,late_watcher"
    return _group_runs(tmp_path_factory, "dist_uneven", names, UNEVEN_TIMEOUT)


def _group_runs(factory: pytest.TempPathFactory, label: str, names: str, timeout: int) -> list[dict[str, Any]]:
    """Run the worker's scenarios ``names`` on two ranks; both must exit cleanly with no internal warning."""
    tmp = str(factory.mktemp(label))
    codes, logs = launch(tmp, names, timeout=timeout)
    assert codes == [0, 0], f"a rank failed or hung (None = killed after {timeout}s): {codes}\n" + "\n".join(logs)
    assert "GradWatchInternalWarning" not in logs[0] + logs[1], "\n".join(logs)
    return read_runs(tmp)


@pytest.mark.parametrize("which", ["join_ddp", "join_inner"])
def test_ddp_join_uneven_inputs_finish_like_an_unwatched_run(uneven_runs: list[dict[str, Any]], which: str) -> None:
    plain = scenario(uneven_runs, "join_unwatched")
    r0, r1 = scenario(uneven_runs, which)  # watching the DDP wrapper, or the module inside it
    assert (r0["done"], r1["done"]) == (plain[0]["done"], plain[1]["done"]) == (8, 5)
    assert r0["findings"] == r1["findings"] == []
    assert (r0["checked"], r1["checked"]) == (4, 3)  # every=2 on each rank's own step counter
    assert r0["params"] == plain[0]["params"] and r1["params"] == plain[1]["params"]
    assert r0["params"] == r1["params"]


def test_a_watcher_on_rank_zero_only_decides_alone_instead_of_pairing_with_ddps_all_reduce(
    uneven_runs: list[dict[str, Any]],
) -> None:
    r0, r1 = scenario(uneven_runs, "rank0_only")
    assert ("nonfinite_grad", 3) in kinds(r0)  # DDP averaged rank 1's NaN into rank 0's gradients: skipped
    assert all(math.isfinite(v) for v in r0["params"])
    assert len(r0["warnings"]) == 1 and "rank 1 had no open gradwatch watcher of this model" in r0["warnings"][0]
    assert r1["findings"] == [] and r1["warnings"] == []


def test_a_probe_watched_on_rank_zero_only_decides_alone_without_a_hang(uneven_runs: list[dict[str, Any]]) -> None:
    r0, r1 = scenario(uneven_runs, "probe_on_rank0")
    assert r0["checked"] == 12 and r1["checked"] == 6  # six steps: the model and the probe on rank 0
    assert r0["params"] == r1["params"]  # the DDP model's watchers still agree
    assert len(r0["warnings"]) == 1 and "rank 1 had no open gradwatch watcher of this model" in r0["warnings"][0]
    assert r1["warnings"] == []


def test_a_watcher_started_late_takes_the_groups_verdict(uneven_runs: list[dict[str, Any]]) -> None:
    r0, r1 = scenario(uneven_runs, "late_watcher")
    assert r0["metric"] == r1["metric"] == 3.0  # the user's all_reduce paired with its own counterpart
    assert r0["checked"] == r1["checked"] == 4
    # Rank 0 gave up waiting (rank 1 decides as it did), or had finished and closed its watcher already.
    assert "this rank's watcher of this model started more than" in r1["warnings"][0] or (
        "rank 0 had no open gradwatch watcher of this model" in r1["warnings"][0]
    )


def test_ddp_join_nan_is_skipped_by_a_local_decision_that_agrees(uneven_runs: list[dict[str, Any]]) -> None:
    r0, r1 = scenario(uneven_runs, "join_nan")
    assert (r0["skipped"], r1["skipped"]) == (2, 1)  # step 1 on both (DDP carried rank 1's NaN), step 4 on rank 0
    assert ("nonfinite_grad", 1) in kinds(r0) and ("nonfinite_grad", 4) in kinds(r0)
    assert ("nonfinite_grad", 1) in kinds(r1)
    assert r0["params"] == r1["params"]  # the join's final sync from rank 0, which skipped its NaN step
    assert all(math.isfinite(v) for v in r0["params"])


# -- a model that runs collectives of its own: the replay on one rank runs none -----------------------------
COLLECTIVE_TIMEOUT = TIMEOUT  # a hang fails here instead of blocking the suite; 40 s was too short on a busy machine


@pytest.fixture(scope="module")
def collective_runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    names = "ddp_gather_nan,ddp_funcol_gather_nan,ddp_backward_collective_nan,ddp_powersgd_nan,pipeline,"
    names += "ddp_guarded_step_agreed,ddp_guarded_inner_bn"
    return _group_runs(tmp_path_factory, "dist_collective", names, COLLECTIVE_TIMEOUT)


# A contrastive model gathering every rank's embeddings in forward (SimCLR/CLIP negatives, open_clip's
# gather_features), a NaN in rank 1's batch: rank 0's replay ran all_gather alone and gloo aborted both ranks.
@pytest.mark.parametrize("name", ["ddp_gather_nan", "ddp_funcol_gather_nan", "ddp_backward_collective_nan"])
def test_a_replay_on_one_rank_runs_no_collective_of_the_model(collective_runs: list[dict[str, Any]], name: str) -> None:
    r0, r1 = scenario(collective_runs, name)
    assert r0["skipped"] == r1["skipped"] == 1
    assert r0["params"] == r1["params"] and all(math.isfinite(v) for v in r0["params"])
    (f,) = [f for f in r0["findings"] if f["kind"] == "nonfinite_input"]
    assert f["step"] == 3 and f["data"]["ranks"] == [1]
    assert "The data on rank 1, not the model, is the cause" in r0["console"]
    assert not [f for f in r0["findings"] if f["kind"] == "nan_origin"]  # no origin made up from a cut replay


# DDP with the PowerSGD hook (torch's DDP communication hooks docs), a NaN in rank 1's batch: the hook's
# error-feedback memory kept the NaN gradient's residual and put NaN into every later step (skipped until
# too_many_skips raised). A skipped step now drops that memory on every rank.
def test_a_skipped_step_drops_powersgds_error_feedback_so_training_goes_on(
    collective_runs: list[dict[str, Any]],
) -> None:
    r0, r1 = scenario(collective_runs, "ddp_powersgd_nan")
    assert r0["raised"] is None and r1["raised"] is None
    assert r0["skipped"] == r1["skipped"] == 1
    assert [k for k in kinds(r0) if k[0] == "nonfinite_grad"] == [("nonfinite_grad", 3)]
    assert r0["params"] == r1["params"] and all(math.isfinite(v) for v in r0["params"])


# Pipeline stages on two ranks (forums: model parallel across processes with send/recv), each watched on its
# rank: the warning told a user who watches on every rank to "watch on every rank".
def test_pipeline_stages_watched_on_their_ranks_are_not_told_to_watch_on_every_rank(
    collective_runs: list[dict[str, Any]],
) -> None:
    for r in scenario(collective_runs, "pipeline"):
        (w,) = r["warnings"]
        assert "it watches another model (a pipeline stage, a model of its own)" in w
        assert "Nothing to change for pipeline stages" in w and "started more than" not in w
        assert r["findings"] == []


# -- FSDP2 (fully_shard): DTensor gradients ---------------------------------------------------------------
def test_fsdp_norms_are_the_norms_over_all_shards(runs: list[dict[str, Any]]) -> None:
    for r in scenario(runs, "fsdp"):
        assert not r["findings"]
        for reference, reported in zip(r["reference"], r["reported"]):
            assert reported.keys() == reference.keys()
            for name, value in reference.items():
                assert reported[name] == pytest.approx(value, rel=1e-5), name


def test_fsdp_nan_in_one_ranks_shard_is_skipped_on_both(runs: list[dict[str, Any]]) -> None:
    r0, r1 = scenario(runs, "fsdp_nan")
    assert r0["skipped"] == r1["skipped"] == 1
    assert r0["params"] == r1["params"]
    assert kinds(r0) == [("nonfinite_on_other_rank", 3)]
    (f,) = r1["findings"]
    assert (f["kind"], f["params"], f["data"]["rank"]) == ("nonfinite_grad", ["encoder.0.weight"], 1)
    assert "NaN, 0 Inf in this rank's shards" in f["message"]  # FSDP: the counts are local


# -- FSDP1 (FullyShardedDataParallel): plain tensors holding this rank's shard ------------------------------
@pytest.mark.parametrize("name", ["fsdp1", "fsdp1_orig"])
def test_fsdp1_healthy_run_is_silent_and_its_norms_are_global(runs: list[dict[str, Any]], name: str) -> None:
    for r in scenario(runs, name):
        assert r["findings"] == [] and r["warnings"] == [] and r["skipped"] == 0
        for reference, reported in r["totals"]:
            assert reported == pytest.approx(reference, rel=1e-5)


@pytest.mark.parametrize("name", ["fsdp1_nan", "fsdp1_orig_nan"])
def test_fsdp1_nan_on_one_rank_is_skipped_on_both_without_a_crash(runs: list[dict[str, Any]], name: str) -> None:
    r0, r1 = scenario(runs, name)
    assert r0["skipped"] == r1["skipped"] == 1
    assert r0["finite"] and r1["finite"]
    # The reduce-scatter may carry rank 1's NaN into rank 0's shard too: then rank 0 reports its own.
    assert {("nonfinite_on_other_rank", 3), ("nonfinite_grad", 3)} & set(kinds(r0))
    assert ("nonfinite_grad", 3) in kinds(r1)


# -- Lightning strategy="ddp" (two processes on CPU; Lightning starts the second one itself) ----------------
LIGHTNING_WORKER = os.path.join(os.path.dirname(__file__), "_lightning_ddp_worker.py")


@pytest.fixture(scope="module")
def lightning_runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    pytest.importorskip("lightning.pytorch")
    tmp = str(tmp_path_factory.mktemp("lightning_ddp"))
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        [sys.executable, LIGHTNING_WORKER, tmp], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    try:
        out, _ = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()  # Lightning's launcher takes its child process down with it
        out, _ = proc.communicate()
        pytest.fail(f"the Lightning ddp run hung for {TIMEOUT}s:\n{out}")
    assert proc.returncode == 0, out
    runs = []
    for rank in (0, 1):
        with open(os.path.join(tmp, f"lightning_rank{rank}.json")) as f:
            runs.append(json.load(f))
    return runs


def test_lightning_ddp_nan_on_one_rank_is_skipped_on_both(lightning_runs: list[dict[str, Any]]) -> None:
    r0, r1 = lightning_runs
    assert r0["skipped"] == r1["skipped"] == 1 and r0["global_step"] == r1["global_step"] == 6
    for r in (r0, r1):
        assert r["around_nan"]["before"] == r["around_nan"]["after"]
    assert r0["params"] == r1["params"]


def test_lightning_ddp_findings_carry_ranks_and_only_rank_zero_prints(lightning_runs: list[dict[str, Any]]) -> None:
    r0, r1 = lightning_runs
    (f,) = [f for f in r0["findings"] if f["kind"] == "nonfinite_grad"]
    assert f["step"] == 3 and f["data"]["rank"] == 0 and f["data"]["ranks"] == [0, 1]
    assert ("nonfinite_loss", 3) in kinds(r1) and ("nonfinite_loss", 3) not in kinds(r0)
    assert (["nan_origin", "nonfinite_grad", "nonfinite_on_other_rank"], 3) in panels(r0["console"])
    assert r1["console"] == ""


def test_rank_zero_reports_where_another_ranks_nan_was_born(runs: list[dict[str, Any]]) -> None:
    r0, r1 = scenario(runs, "ddp_op_nan")
    (own,) = [f for f in r1["findings"] if f["kind"] == "nan_origin"]
    (told,) = [f for f in r0["findings"] if f["kind"] == "nan_origin"]
    assert own["step"] == told["step"] == 3
    assert told["data"]["origin_rank"] == 1 and told["op"] == own["op"] == "LogBackward0"
    assert told["message"].startswith("On rank 1 (rank 0, reporting, got it through the gradient all-reduce): ")


def test_post_local_sgd_optimizer_is_watched_through_the_optimizer_it_wraps(runs: list[dict[str, Any]]) -> None:
    r0, r1 = scenario(runs, "post_local_sgd")
    assert r0["skipped"] == r1["skipped"] == 1  # rank 1's NaN during local SGD: skipped on both ranks
    assert ("nonfinite_grad", 3) in kinds(r1)
    assert all(math.isfinite(v) for v in r0["params"] + r1["params"])


@pytest.mark.parametrize("name", ["independent", "independent_same_seed"])
def test_ranks_training_different_models_decide_alone_and_never_pair_collectives(
    runs: list[dict[str, Any]], name: str
) -> None:
    # Same seed: the models differ from the first update on, seen at the second check.
    r0, r1 = scenario(runs, name)
    assert (r0["skipped"], r1["skipped"]) == (0, 1)  # rank 0's healthy updates went through
    assert r0["metric"] == r1["metric"] == 3.0  # the user's all_reduce paired with its own counterpart
    assert ("nonfinite_loss", 3) in kinds(r1) and kinds(r0) == []


# https://github.com/ecmwf/WeatherGenerator/pull/2718 (a NaN skip decided on each rank's own loss; here after
# backward: `loss.backward(); if not torch.isfinite(loss): continue`)
@pytest.mark.parametrize("name", ["ddp_guarded_step_agreed", "ddp_guarded_inner_bn"])
def test_a_step_one_rank_skips_on_its_own_is_skipped_on_every_rank_without_a_crash(
    collective_runs: list[dict[str, Any]], name: str
) -> None:
    r0, r1 = scenario(collective_runs, name)  # both ranks ran to the end
    assert r0["params"] == r1["params"] and all(math.isfinite(v) for v in r0["params"])
    assert r0["steps"] == r1["steps"] == [6]  # rank 1 counts the steps it skipped, as rank 0 does
    said = [f for f in r0["findings"] if f["kind"] == "nonfinite_on_other_rank" and f["severity"] == "warning"]
    assert [(f["step"], f["data"]["skipped_ranks"]) for f in said] == [(3, [1]), (5, [1])]  # 5: the last batch
    assert "The training code of rank 1 skipped optimizer.step() at step 3 on its own" in r0["console"]
    assert r0["skipped"] == 2  # rank 0 stepped on both, gradwatch skipped them
