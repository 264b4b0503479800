"""Reproductions of real DDP/FSDP reports, two processes on gloo/CPU (``tests/_real_dist_worker.py``).

Every scenario runs once in one pair of processes started by ``test_distributed.launch``; a hang fails the
run through its timeout instead of blocking the suite.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from test_distributed import launch

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="torch.distributed with gloo is needed",
)

WORKER = os.path.join(os.path.dirname(__file__), "_real_dist_worker.py")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    import test_distributed

    tmp = str(tmp_path_factory.mktemp("real_dist"))
    codes, logs = launch(tmp, timeout=120, worker=WORKER)
    assert codes == [0, 0], f"a rank failed or hung (None = killed): {codes}\n" + "\n".join(logs)
    return test_distributed.read_runs(tmp)


def scenario(runs: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    both = [r[name] for r in runs]
    for rank, r in enumerate(both):
        assert not isinstance(r.get("error"), str), f"rank {rank}: {r.get('error')}"
    return both


def kinds(result: dict[str, Any]) -> list[tuple[str, int]]:
    return [(f["kind"], f["step"]) for f in result["findings"]]


def test_ddp_healthy_run_is_silent_on_every_rank_and_only_rank_zero_writes(runs: list[dict[str, Any]]) -> None:
    r0, r1 = scenario(runs, "healthy")
    assert kinds(r0) == kinds(r1) == [] and r0["warnings"] == r1["warnings"] == []
    assert r0["norms"] == r1["norms"] and r0["params"] == r1["params"]
    assert "none: gradients healthy" in r0["console"] and r1["console"] == ""
    assert len([f for f in r0["files"] if f.startswith("events.out")]) == 1  # one TensorBoard writer: rank 0's


def test_ddp_nan_in_one_ranks_batch_is_skipped_alike_and_named(runs: list[dict[str, Any]]) -> None:
    r0, r1 = scenario(runs, "nan_input")
    assert r0["skipped"] == r1["skipped"] == 1
    assert r0["params"] == r1["params"] and r0["state"] == r1["state"]  # Adam's moments too: no drift
    (f,) = [f for f in r0["findings"] if f["kind"] == "nonfinite_input"]
    assert f["step"] == 5 and f["data"]["ranks"] == [1]
    assert "rank 1: args[0] (1 NaN, 0 Inf)" in r0["console"]


# find_unused_parameters=False and a head skipped on step 2: DDP raised at step 3's forward with only
# "Parameter indices which did not receive grad for rank 0: 4 5", and gradwatch said nothing (the ranks had
# already stepped on un-averaged gradients at step 2).
def test_ddp_branch_skipped_without_find_unused_parameters_is_named_at_its_step(runs: list[dict[str, Any]]) -> None:
    for r in scenario(runs, "unused_static"):
        (at, raised) = [f for f in r["findings"] if f["kind"] == "ddp_unused_parameters"]
        assert (at["step"], at["data"]["cause"]) == (2, "unreduced")
        assert at["params"] == ["aux.weight", "aux.bias"] and at["module"] == "aux"
        assert "find_unused_parameters=True" in at["message"]
        assert r["error"]["step"] == 3 and "Expected to have finished reduction" in r["error"]["message"]
        assert (raised["step"], raised["data"]["cause"]) == (3, "raised")
        assert raised["params"] == ["aux.weight", "aux.bias"]
        assert r["explained"]["kind"] == "ddp_unused_parameters"


def test_ddp_layer_never_used_under_find_unused_parameters_is_reported_once(runs: list[dict[str, Any]]) -> None:
    for r in scenario(runs, "unused_dynamic"):
        assert kinds(r) == [("none_grad", 20)]  # once in 45 steps, about aux only
        assert r["findings"][0]["params"] == ["aux.weight", "aux.bias"]


def test_ddp_no_sync_accumulation_is_silent_and_norms_agree(runs: list[dict[str, Any]]) -> None:
    r0, r1 = scenario(runs, "accumulation")
    assert kinds(r0) == kinds(r1) == []
    assert r0["norms"] == r1["norms"] and r0["params"] == r1["params"]


def test_fsdp2_healthy_run_is_silent(runs: list[dict[str, Any]]) -> None:
    for r in scenario(runs, "fsdp2"):
        assert kinds(r) == [] and r["warnings"] == [] and r["skipped"] == 0


def test_fsdp2_nan_in_one_ranks_batch_is_skipped_on_both(runs: list[dict[str, Any]]) -> None:
    r0, r1 = scenario(runs, "fsdp2_nan")
    assert r0["skipped"] == r1["skipped"] == 1 and r0["finite"] and r1["finite"]
    assert r0["params"] == r1["params"]
    assert ("nonfinite_grad", 7) in kinds(r0)


# A weight changed on rank 1 after DDP wrapped the model: before, the differing parameters were taken for
# "independent models" (a k-fold sweep) and gradwatch stopped agreeing across ranks; mid-run it said nothing.
@pytest.mark.parametrize("name, step", [("diverged", 0), ("diverged_late", 8)])
def test_ddp_replicas_changed_on_one_rank_are_reported_with_the_parameter(
    runs: list[dict[str, Any]], name: str, step: int
) -> None:
    r0, r1 = scenario(runs, name)
    assert r0["params"] != r1["params"]  # the bug reproduced: the replicas differ
    for r in (r0, r1):
        assert kinds(r) == [("replicas_diverged", step)] and r["warnings"] == []
        assert r["findings"][0]["params"] == ["head.weight"] and r["findings"][0]["data"]["ranks"] == [1]
    assert "head.weight differs from rank 0's" in r0["findings"][0]["message"]
    assert "replicas_diverged at step" in r0["console"] and r1["console"] == ""


def test_ddp_replica_checks_on_a_healthy_run_find_nothing(runs: list[dict[str, Any]]) -> None:
    r0, r1 = scenario(runs, "replicas_healthy")
    assert kinds(r0) == kinds(r1) == [] and r0["params"] == r1["params"]
