"""One rank of the two-process gloo runs in ``test_real_distributed.py``: reproductions of real DDP/FSDP reports.

Usage: ``python tests/_real_dist_worker.py RANK WORLD PORT OUT_DIR [NAMES]`` (the launch pattern of
``_dist_worker.py``): runs the scenarios named in ``NAMES`` (comma-separated; default: all) in one process
group and writes ``OUT_DIR/rank{RANK}.json``.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import torch
import torch.distributed as dist
from _dist_worker import AltNet, Net, batch, flat_params, run_scenarios
from helpers import plain_console
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradwatch


def _result(gw: Any, console: Any, model: nn.Module, caught: list[Any], **more: Any) -> dict[str, Any]:
    return {
        "findings": [f.to_dict() for f in gw.findings],
        "console": console.file.getvalue(),
        "params": flat_params(model),
        "skipped": gw.engine.steps_skipped,
        "warnings": [str(w.message) for w in caught if "gradwatch" in str(w.message)],
        **more,
    }


def _data(step: int, rank: int) -> torch.Tensor:
    """Each rank its own data (a DistributedSampler's shard)."""
    return batch(step + rank * 50, rank, bad=False)


def healthy(rank: int, out_dir: str) -> dict[str, Any]:
    """DDP, Adam, 30 steps, one log_dir shared by the ranks (the usual script)."""
    torch.manual_seed(0)
    model = DDP(Net())
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    console = plain_console()
    log_dir = os.path.join(out_dir, "healthy_logs")
    norms = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with gradwatch.watch(model, opt, console=console, log_dir=log_dir) as gw:
            for step in range(30):
                loss = model(_data(step, rank)).pow(2).mean()
                gw.observe_loss(loss)
                opt.zero_grad()
                loss.backward()
                opt.step()
                norms.append(gw.engine.history.last[0].total_norm)
    dist.barrier()
    files = sorted(os.listdir(log_dir)) if os.path.isdir(log_dir) else []
    return _result(gw, console, model.module, caught, norms=norms, files=files)


def nan_input(rank: int, out_dir: str) -> dict[str, Any]:
    """DDP, Adam, a NaN in one sample of rank 1's batch at step 5: DDP's average is NaN on both ranks."""
    torch.manual_seed(0)
    model = DDP(Net())
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    console = plain_console()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with gradwatch.watch(model, opt, console=console) as gw:
            for step in range(12):
                loss = model(batch(step + rank * 50, rank, bad=rank == 1 and step == 5)).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
    return _result(gw, console, model.module, caught, state=[v.tolist() for v in _adam_state(opt)])


def _adam_state(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [t.reshape(-1) for s in opt.state.values() for k, t in s.items() if k in ("exp_avg", "exp_avg_sq")]


def unused_static(rank: int, out_dir: str) -> dict[str, Any]:
    """find_unused_parameters=False and a head used on some steps only: DDP raises "Expected to have
    finished reduction in the prior iteration" at the forward after the step that skipped it."""
    torch.manual_seed(0)
    model = DDP(AltNet())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    console = plain_console()
    error = None
    explained = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gw = gradwatch.watch(model, opt, console=console)
        try:
            with gw:
                for step in range(6):
                    loss = model(_data(step, rank), use_aux=step != 2).pow(2).mean()
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
        except RuntimeError as exc:
            error = {"step": step, "message": str(exc)}
            found = gw.explain(exc)
            explained = found.to_dict() if found is not None else None
    return _result(gw, console, model.module, caught, error=error, explained=explained)


def unused_dynamic(rank: int, out_dir: str) -> dict[str, Any]:
    """find_unused_parameters=True with a layer never called: none_grad once, nothing about the used ones."""
    torch.manual_seed(0)
    model = DDP(Net(unused=True), find_unused_parameters=True)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    console = plain_console()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with gradwatch.watch(model, opt, console=console) as gw:
            for step in range(45):
                loss = model(_data(step, rank)).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
    return _result(gw, console, model.module, caught)


def accumulation(rank: int, out_dir: str) -> dict[str, Any]:
    """4 micro-batches per update, the first 3 under model.no_sync(); Adam; 8 updates."""
    torch.manual_seed(0)
    model = DDP(Net())
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    console = plain_console()
    g = torch.Generator().manual_seed(100 + rank)
    norms = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with gradwatch.watch(model, opt, console=console) as gw:
            for _ in range(8):
                for m in range(4):
                    with model.no_sync() if m < 3 else contextlib.nullcontext():
                        loss = model(torch.randn(8, 4, generator=g)).pow(2).mean() / 4
                        gw.observe_loss(loss)
                        loss.backward()
                opt.step()
                opt.zero_grad()
                norms.append(gw.engine.history.last[0].total_norm)
    return _result(gw, console, model.module, caught, norms=norms)


def loss_scale(rank: int, out_dir: str, start: int = 0) -> dict[str, Any]:
    """Rank 1 multiplies its loss by 1000 from step ``start`` on (a rank-local scale bug)."""
    torch.manual_seed(0)
    model = DDP(Net())
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    console = plain_console()
    norms = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with gradwatch.watch(model, opt, console=console) as gw:
            for step in range(30):
                loss = model(_data(step, rank)).pow(2).mean()
                if rank == 1 and step >= start:
                    loss = loss * 1000
                gw.observe_loss(loss)
                opt.zero_grad()
                loss.backward()
                opt.step()
                norms.append(gw.engine.history.last[0].total_norm)
    return _result(gw, console, model.module, caught, norms=norms)


def fsdp2(rank: int, out_dir: str, nan: bool = False) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = Net()
    fully_shard(model.encoder)
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    console = plain_console()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with gradwatch.watch(model, opt, console=console) as gw:
            for step in range(20):
                loss = model(batch(step + rank * 50, rank, bad=nan and rank == 1 and step == 7)).pow(2).mean()
                gw.observe_loss(loss)
                opt.zero_grad()
                loss.backward()
                opt.step()
    finite = all(bool(torch.isfinite(p.full_tensor()).all()) for p in model.parameters())
    return _result(gw, console, model, caught, finite=finite)


def diverged(rank: int, out_dir: str, at: int | None = 0, steps: int = 12) -> dict[str, Any]:
    """Rank 1 changes a weight after DDP's construction-time broadcast (at step ``at``): replicas diverge.
    ``at=None``: a healthy run long enough for the periodic replica checks."""
    import gradwatch.observe.distributed

    gradwatch.observe.distributed.REPLICA_CHECK_EVERY = 4  # the replica check every 4 checks, not 100
    torch.manual_seed(0)
    model = DDP(Net())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    console = plain_console()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with gradwatch.watch(model, opt, console=console) as gw:
            for step in range(steps):
                if rank == 1 and step == at:
                    with torch.no_grad():
                        model.module.head.weight.mul_(3.0)
                loss = model(_data(step, rank)).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
    return _result(gw, console, model.module, caught)


SCENARIOS: dict[str, Callable[[int, str], dict[str, Any]]] = {
    "healthy": healthy,
    "nan_input": nan_input,
    "unused_static": unused_static,
    "unused_dynamic": unused_dynamic,
    "accumulation": accumulation,
    "loss_scale": loss_scale,
    "loss_scale_late": lambda r, d: loss_scale(r, d, start=15),
    "fsdp2": fsdp2,
    "fsdp2_nan": lambda r, d: fsdp2(r, d, nan=True),
    "diverged": diverged,
    "diverged_late": lambda r, d: diverged(r, d, at=5),
    "replicas_healthy": lambda r, d: diverged(r, d, at=None, steps=20),
}


def main() -> None:
    run_scenarios(SCENARIOS, list(SCENARIOS))


if __name__ == "__main__":
    main()
