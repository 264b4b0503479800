"""One rank of the two-process gloo runs in ``test_distributed.py``.

Usage: ``python tests/_dist_worker.py RANK WORLD PORT OUT_DIR [NAMES]``. Runs the scenarios named in
``NAMES`` (comma-separated; default: every scenario of ``SCENARIOS``) in one process group (one process
start-up for all of them) and writes ``OUT_DIR/rank{RANK}.json``. The uneven-input scenarios
(``UNEVEN``) run only when named: before gradwatch stood aside under ``join()`` they hung.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import traceback
import warnings
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import torch
import torch.distributed as dist
from helpers import plain_console
from torch import nn

import gradwatch

NAN_STEP = 3
STEPS = 6


class Net(nn.Module):
    def __init__(self, unused: bool = False) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(4, 8), nn.Tanh())
        self.head = nn.Linear(8, 1)
        if unused:
            self.aux = nn.Linear(8, 8)  # never called in forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))


def batch(step: int, rank: int, bad: bool) -> torch.Tensor:
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(100 + step))
    if bad:
        x[0, 1] = float("nan")  # one feature of one sample: NaN in encoder.0.weight's column 1
    return x


def flat_params(model: nn.Module) -> list[float]:
    out: list[float] = []
    for p in model.parameters():
        t = p.detach()
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()
        out.extend(t.reshape(-1).tolist())
    return out


def replicas(rank: int, policy: str) -> dict[str, Any]:
    """Identical replicas on identical data; rank 1 alone gets a NaN at NAN_STEP (no DDP to spread it)."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    console = plain_console()
    raised = None
    before_nan: list[float] = []
    with gradwatch.watch(model, opt, console=console, on_nonfinite=policy) as gw:
        try:
            for step in range(STEPS):
                if step == NAN_STEP:
                    before_nan = flat_params(model)
                loss = model(batch(step, rank, bad=rank == 1 and step == NAN_STEP)).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                if step == NAN_STEP:
                    unchanged_at_nan = flat_params(model) == before_nan
        except gradwatch.GradWatchError as exc:
            raised = {"step": step, "message": str(exc)}
            unchanged_at_nan = None
    return {
        "findings": [f.to_dict() for f in gw.findings],
        "console": console.file.getvalue(),
        "params": flat_params(model),
        "unchanged_at_nan": unchanged_at_nan,
        "raised": raised,
        "skipped": gw.engine.steps_skipped,
    }


class AltNet(Net):
    """An auxiliary head used on odd steps only (find_unused_parameters=True is what DDP needs for it)."""

    def __init__(self) -> None:
        super().__init__()
        self.aux = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, use_aux: bool = False) -> torch.Tensor:  # type: ignore[override]
        h = self.encoder(x)
        return self.head(h) + (self.aux(h) if use_aux else 0)


def ddp_unused(rank: int, wrapped: bool, alternating: bool = False) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    inner = AltNet() if alternating else Net(unused=True)
    model = DDP(inner, find_unused_parameters=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradwatch.watch(model if wrapped else inner, opt, console=plain_console()) as gw:
        for step in range(22):  # none_grad waits 20 checked steps under find_unused_parameters=True
            x = batch(step, rank, bad=False)
            loss = (model(x, use_aux=step % 2 == 1) if alternating else model(x)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    return {"findings": [f.to_dict() for f in gw.findings]}


def _stepped(gw: Any, console: Any, module: nn.Module) -> dict[str, Any]:
    """What a loop whose ranks may step unevenly reports: findings, console, parameters, skips, step counts."""
    return {
        "findings": [f.to_dict() for f in gw.findings],
        "console": console.file.getvalue(),
        "params": flat_params(module),
        "skipped": gw.engine.steps_skipped,
        "steps": list(gw.engine.step_counts),
    }


def ddp_nan(
    rank: int, *, adam: bool = False, escalate: bool = True, observe: bool = True, scaler: bool = False,
    guard: bool = False, fused: bool = False, agreement: bool = False,
) -> dict[str, Any]:
    """DDP, a NaN in one sample of rank 1's batch at NAN_STEP; rank 0's data is finite. ``escalate=False``
    holds no inputs: then only the observed losses can say where the NaN came from. ``scaler``: a
    GradScaler (bf16 autocast) drops the NaN step on every rank. ``guard``: each rank skips
    ``opt.step()`` on its own non-finite loss (ranks step unevenly), watched with ``rank_agreement=False``.
    ``fused``: AdamW(fused=True) (nanoGPT's set-up), which unscales in its own step: step() runs on the step
    the scaler drops. ``agreement``: the guard watched with the agreement on, and rank 1's last batch holds a
    NaN too (the loop ends right after a skipped step)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(Net())
    if fused:
        opt: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    elif adam:
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    console = plain_console()
    amp = torch.amp.GradScaler("cpu") if scaler else None
    options: dict[str, Any] = {"scaler": amp} if amp is not None else {}
    if guard and not agreement:
        options["rank_agreement"] = False
    with gradwatch.watch(model, opt, console=console, escalate=escalate, **options) as gw:
        for step in range(STEPS):
            bad = rank == 1 and (step == NAN_STEP or (agreement and step == STEPS - 1))
            x = batch(step + rank * 50, rank, bad=bad)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=scaler):
                loss = model(x).float().pow(2).mean()
            if observe:
                gw.observe_loss(loss)
            opt.zero_grad()
            if amp is not None:
                amp.scale(loss).backward()
                amp.step(opt)
                amp.update()
                continue
            loss.backward()
            if guard and not torch.isfinite(loss):
                continue  # this rank alone skips its step
            opt.step()
    return _stepped(gw, console, model.module)


def rank0_only(rank: int) -> dict[str, Any]:
    """DDP watched on rank 0 only (a common "log on rank 0" pattern), a NaN in rank 1's batch at NAN_STEP.
    Rank 1 has no watcher: gradwatch's all_reduce on rank 0 would pair with one of DDP's on rank 1."""
    import warnings

    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradwatch.observe.distributed

    gradwatch.observe.distributed.PEER_WAIT = 1.0
    torch.manual_seed(0)
    model = DDP(Net())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gw = gradwatch.watch(model, opt, console=plain_console()) if rank == 0 else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(STEPS):
            x = batch(step + rank * 50, rank, bad=rank == 1 and step == NAN_STEP)
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    if gw is not None:
        gw.close()
    return {
        "findings": [f.to_dict() for f in gw.findings] if gw is not None else [],
        "warnings": [str(w.message) for w in caught if "gradwatch" in str(w.message)],
        "params": flat_params(model.module),
    }


def probe_on_rank0(rank: int) -> dict[str, Any]:
    """DDP watched on every rank, plus a linear probe on detached features trained and watched on rank 0
    only (online evaluation). The probe's agreement all_reduce had no partner on rank 1 (which has *a*
    watcher): both ranks hung until the process-group timeout."""
    import warnings

    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradwatch.observe.distributed

    gradwatch.observe.distributed.PEER_WAIT = 1.0
    torch.manual_seed(0)
    model = DDP(Net())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    probe = nn.Linear(8, 3)
    probe_opt = torch.optim.SGD(probe.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gw = gradwatch.watch(model, opt, console=plain_console())
        pw = gradwatch.watch(probe, probe_opt, console=plain_console()) if rank == 0 else None
        for step in range(STEPS):
            x = batch(step + rank * 50, rank, bad=False)
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if pw is not None:
                feats = model.module.encoder(x).detach()
                probe_loss = probe(feats).pow(2).mean()
                probe_opt.zero_grad()
                probe_loss.backward()
                probe_opt.step()
        gw.close()
        if pw is not None:
            pw.close()
    return {
        "warnings": [str(w.message) for w in caught if "gradwatch" in str(w.message)],
        "checked": gw.engine.steps_checked + (pw.engine.steps_checked if pw is not None else 0),
        "params": flat_params(model.module),
    }


def late_watcher(rank: int) -> dict[str, Any]:
    """Independent models (a k-fold job, no DDP); rank 1 prepares its fold longer than PEER_WAIT before
    watch(). Rank 0 gave up waiting and decided alone; rank 1 then found rank 0's watcher and ran the
    agreement all_reduce, which paired with the user's final all_reduce on rank 0: gloo aborted."""
    import time
    import warnings

    import gradwatch.observe.distributed

    gradwatch.observe.distributed.PEER_WAIT = 1.0
    torch.manual_seed(rank)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if rank == 1:
            time.sleep(2.5)
        with gradwatch.watch(model, opt, console=plain_console()) as gw:
            for step in range(4):
                loss = model(batch(step, rank, bad=False)).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
    metric = torch.tensor([float(rank + 1)])
    dist.all_reduce(metric)
    return {
        "metric": metric.item(),
        "checked": gw.engine.steps_checked,
        "warnings": [str(w.message) for w in caught if "gradwatch" in str(w.message)],
    }


def join_uneven(rank: int, watched: str | None, nan: bool = False) -> dict[str, Any]:
    """DDP with uneven inputs under ``model.join()``: rank 0 has 5 batches, rank 1 has 2, then (without
    ``nan``) 3 more even steps after the join block, when the ranks' step counters differ. ``watched``:
    ``"ddp"`` (the wrapper), ``"inner"`` (the module inside it) or None (no gradwatch). ``nan``: a NaN in
    rank 1's batch at step 1 (both ranks active) and in rank 0's at step 4 (rank 1 has joined)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    inner = Net()
    model = DDP(inner)
    # No momentum: the ranks' optimizer states would differ after uneven steps (the join syncs the weights
    # only), and so would the replicas, with or without gradwatch.
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    console = plain_console()
    target = {"ddp": model, "inner": inner}.get(watched or "")
    every = 1 if nan else 2  # every=2: the steps after the join block would select different iterations
    cm = gradwatch.watch(target, opt, console=console, every=every) if target is not None else None
    done = 0
    with cm if cm is not None else contextlib.nullcontext() as gw:
        with model.join():
            for step in range(5 if rank == 0 else 2):
                bad = nan and ((rank == 1 and step == 1) or (rank == 0 and step == 4))
                loss = model(batch(step + rank * 50, rank, bad=bad)).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                done += 1
        for step in range(0 if nan else 3):
            loss = model(batch(step + 10 + rank * 50, rank, bad=False)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            done += 1
    return {
        "findings": [f.to_dict() for f in gw.findings] if gw is not None else [],
        "console": console.file.getvalue(),
        "params": flat_params(inner),
        "done": done,
        "skipped": gw.engine.steps_skipped if gw is not None else 0,
        "checked": gw.engine.steps_checked if gw is not None else 0,
    }


def fsdp(rank: int, nan: bool) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = Net()
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    console = plain_console()
    reference: list[dict[str, float]] = []
    reported: list[dict[str, float]] = []
    with gradwatch.watch(model, opt, console=console, per_layer=True) as gw:
        for step in range(STEPS):
            loss = model(batch(step + rank * 50, rank, bad=False)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            if nan and rank == 1 and step == NAN_STEP:
                with torch.no_grad():  # one element of the shard this rank holds, on this rank only
                    model.encoder[0].weight.grad.to_local()[0, 0] = float("nan")
            full = {n: p.grad.full_tensor().norm().item() for n, p in model.named_parameters()}
            full["<total>"] = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).full_tensor().item()
            opt.step()
            last = gw.engine.history.last[0]
            got = dict(zip(last.names, last.norms))
            got["<total>"] = last.total_norm
            reference.append(full)
            reported.append(got)
    local_nonfinite = [f.to_dict() for f in gw.findings]
    return {
        "reference": reference,
        "reported": reported,
        "findings": local_nonfinite,
        "params": flat_params(model),
        "skipped": gw.engine.steps_skipped,
    }


def fsdp1(rank: int, nan: bool, orig: bool) -> dict[str, Any]:
    """FSDP1 (FullyShardedDataParallel): plain tensors holding this rank's shard of a flat parameter, whose
    storage FSDP frees between uses. A NaN in rank 1's batch crashed both processes (a localization replay
    read freed storage, and ran the wrapper's all-gather on one rank); a healthy run warned that the ranks
    trained different models; with use_orig_params=True a shard empty on this rank was reported as
    ``none_grad`` and the ranks' agreement vectors differed in length (gloo aborted)."""
    import warnings

    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    torch.manual_seed(0)
    model = FSDP(Net(), use_orig_params=orig, device_id=torch.device("cpu"))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    totals: list[tuple[float, float]] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with gradwatch.watch(model, opt, console=plain_console()) as gw:
            for step in range(STEPS):
                loss = model(batch(step + rank * 50, rank, bad=nan and rank == 1 and step == NAN_STEP)).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                reference = float(model.clip_grad_norm_(float("inf")))  # FSDP1's own total norm (a collective)
                opt.step()
                totals.append((reference, gw.engine.history.last[0].total_norm))
    return {
        "findings": [f.to_dict() for f in gw.findings],
        "warnings": [str(w.message) for w in caught if "gradwatch" in str(w.message)],
        "finite": all(bool(torch.isfinite(p).all()) for p in model.parameters()),
        "skipped": gw.engine.steps_skipped,
        "totals": totals,
    }


def post_local_sgd(rank: int) -> dict[str, Any]:
    """torch's PostLocalSGDOptimizer (its docs example): a wrapper that never ran Optimizer.__init__ and keeps
    the optimizer in ``.optim``; watch() raised AttributeError. A NaN in rank 1's batch at NAN_STEP, during
    local SGD (no gradient all-reduce): both ranks must still skip it, so that the averaging stays finite."""
    from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook
    from torch.distributed.algorithms.model_averaging import averagers
    from torch.distributed.optim import PostLocalSGDOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(Net())
    subgroup, _ = dist.new_subgroups(group_size=1)
    state = PostLocalSGDState(process_group=None, subgroup=subgroup, start_localSGD_iter=2)
    model.register_comm_hook(state, post_localSGD_hook)
    local = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = PostLocalSGDOptimizer(optim=local, averager=averagers.PeriodicModelAverager(period=2, warmup_steps=2))
    with gradwatch.watch(model, opt, console=plain_console()) as gw:
        for step in range(STEPS):
            loss = model(batch(step + rank * 50, rank, bad=rank == 1 and step == NAN_STEP)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    return {"findings": [f.to_dict() for f in gw.findings], "params": flat_params(model.module),
            "skipped": gw.engine.steps_skipped}


class LogNet(Net):
    """log of a probability that is 0 on rank 1's NAN_STEP (a NaN born in an op, not in the data)."""

    def forward(self, x: torch.Tensor, zero: bool = False) -> torch.Tensor:  # type: ignore[override]
        p = torch.sigmoid(self.head(self.encoder(x)))
        return torch.log(p * 0 if zero else p)


def ddp_op_nan(rank: int) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(LogNet())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradwatch.watch(model, opt, console=plain_console()) as gw:
        for step in range(STEPS):
            loss = -model(batch(step, rank, bad=False), zero=rank == 1 and step == NAN_STEP).mean()
            gw.observe_loss(loss)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return {"findings": [f.to_dict() for f in gw.findings]}


def independent(rank: int, same_seed: bool = False) -> dict[str, Any]:
    """A k-fold style job: each rank trains its own model (other seeds, no DDP) for its own number of steps,
    then the ranks exchange a metric. A NaN on rank 1 must skip rank 1's update only. ``same_seed``: a sweep
    (one seed, a learning rate per rank), whose models differ from the first update on."""
    torch.manual_seed(0 if same_seed else rank)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1 * (rank + 1))
    with gradwatch.watch(model, opt, console=plain_console()) as gw:
        for step in range(6 if rank == 0 else 4):
            loss = model(batch(step, rank, bad=rank == 1 and step == NAN_STEP)).pow(2).mean()
            gw.observe_loss(loss)
            opt.zero_grad()
            loss.backward()
            opt.step()
    metric = torch.tensor([float(rank + 1)])
    dist.all_reduce(metric)  # the user's own collective after training
    return {"skipped": gw.engine.steps_skipped, "metric": metric.item(), "findings": [f.to_dict() for f in gw.findings]}


def ddp_accumulation(rank: int, bug: bool, no_sync: bool = True, bucket_view: bool = False) -> dict[str, Any]:
    """4 micro-batches per update, each rank its own data; ``bug``: zero_grad() in every micro-batch.
    ``no_sync``: the first 3 backward passes under model.no_sync(), otherwise every pass all-reduces."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(Net(), gradient_as_bucket_view=bucket_view)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(100 + rank)
    with gradwatch.watch(model, opt, console=plain_console()) as gw:
        for _ in range(4):
            for m in range(4):
                x = torch.randn(8, 4, generator=g)
                if bug:
                    opt.zero_grad()
                with model.no_sync() if no_sync and m < 3 else contextlib.nullcontext():
                    (model(x).pow(2).mean() / 4).backward()
            opt.step()
            if not bug:
                opt.zero_grad()
    return {"findings": [f.to_dict() for f in gw.findings]}


class _AllReduceInBackward(torch.autograd.Function):
    """Identity forward, gradient all-reduced in backward (Megatron's copy_to_tensor_model_parallel_region)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        g = g.clone()
        dist.all_reduce(g)
        return g


class Contrastive(Net):
    """Each rank's embeddings scored against every rank's (SimCLR/CLIP negatives gathered in forward, with
    ``torch.distributed.nn`` or, ``how="funcol"``, a functional collective), or, ``how="backward"``, a collective
    in a backward function only."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        z = self.encoder(x)
        if self.how == "backward":
            return self.head(_AllReduceInBackward.apply(z))
        if self.how == "funcol":
            import torch.distributed._functional_collectives as funcol

            everyone = funcol.all_gather_tensor_autograd(z, 0, dist.group.WORLD)
        else:
            import torch.distributed.nn.functional as dist_nn

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # all_gather's deprecation notice
                everyone = torch.cat(dist_nn.all_gather(z), 0)
        return self.head(z) + (z @ everyone.t()).mean(1, keepdim=True)


def ddp_collective_nan(rank: int, how: str = "gather") -> dict[str, Any]:
    """DDP over a model that runs a collective of its own (in forward, or in backward only); a NaN in one sample
    of rank 1's batch at NAN_STEP. Rank 0's inputs are finite, so it replays the step: alone."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    inner = Contrastive(how)
    model = DDP(inner)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    console = plain_console()
    with gradwatch.watch(model, opt, console=console) as gw:
        for step in range(STEPS):
            loss = model(batch(step + 10 * rank, rank, bad=rank == 1 and step == NAN_STEP)).pow(2).mean()
            gw.observe_loss(loss)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return {"findings": [f.to_dict() for f in gw.findings], "params": flat_params(inner),
            "skipped": gw.engine.steps_skipped, "console": console.file.getvalue()}


def ddp_guarded_inner_bn(rank: int) -> dict[str, Any]:
    """The per-rank guard of ``ddp_nan(guard=True, agreement=True)`` with the model inside the DDP wrapper watched,
    a BatchNorm in it: DDP's forward broadcasts its buffers before the watched module's own hooks run."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    console = plain_console()
    with gradwatch.watch(model.module, opt, console=console) as gw:
        for step in range(STEPS):
            bad = rank == 1 and step in (NAN_STEP, STEPS - 1)
            loss = model(batch(step + rank * 50, rank, bad=bad)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            if not torch.isfinite(loss):
                continue  # this rank alone skips its step
            opt.step()
    return _stepped(gw, console, model.module)


def ddp_powersgd_nan(rank: int) -> dict[str, Any]:
    """DDP with the PowerSGD communication hook (error feedback and warm start, torch's defaults) from the second
    step on; a NaN in one sample of rank 1's batch at NAN_STEP."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    inner = Net()
    model = DDP(inner)
    state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2,
                                   min_compression_rate=0.5)
    model.register_comm_hook(state, powersgd.powerSGD_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    raised = None
    with gradwatch.watch(model, opt, console=plain_console(), max_skips=3) as gw:
        try:
            for step in range(STEPS + 2):
                loss = model(batch(step + 10 * rank, rank, bad=rank == 1 and step == NAN_STEP)).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
        except gradwatch.GradWatchError as exc:
            raised = str(exc)[:300]
    return {"findings": [f.to_dict() for f in gw.findings], "params": flat_params(inner),
            "skipped": gw.engine.steps_skipped, "raised": raised}


def ddp_remainder(rank: int) -> dict[str, Any]:
    """DDP, 4 micro-batches per update (the first 3 under no_sync) over 10 batches per epoch, 3 epochs: the last 2
    batches of each epoch are carried into the next epoch's first update."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(Net())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(100 + rank)
    with gradwatch.watch(model, opt, console=plain_console()) as gw:
        for _ in range(3):
            for i in range(10):
                x = torch.randn(8, 4, generator=g)
                with model.no_sync() if (i + 1) % 4 else contextlib.nullcontext():
                    (model(x).pow(2).mean() / 4).backward()
                if (i + 1) % 4 == 0:
                    opt.step()
                    opt.zero_grad()
    return {"findings": [f.to_dict() for f in gw.findings]}


def ddp_ignored_targets(rank: int) -> dict[str, Any]:
    """DDP classifier; at NAN_STEP every target of rank 1's batch is ignore_index (a fully padded batch):
    cross_entropy's mean over zero elements is NaN there, with finite gradients."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    console = plain_console()
    g = torch.Generator().manual_seed(rank)
    with gradwatch.watch(model, opt, console=console) as gw:
        for step in range(STEPS):
            y = torch.randint(0, 3, (16,), generator=g)
            if rank == 1 and step == NAN_STEP:
                y[:] = -100
            loss = nn.functional.cross_entropy(model(batch(step + 10 * rank, rank, bad=False)), y)
            gw.observe_loss(loss)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return {"findings": [f.to_dict() for f in gw.findings], "console": console.file.getvalue()}


def pipeline(rank: int) -> dict[str, Any]:
    """A hand-written two-stage pipeline: rank 0 runs the encoder and sends its output, rank 1 the head and the
    loss, and sends the activation's gradient back. Each rank watches its own stage."""
    import warnings

    import gradwatch.observe.distributed as gd

    torch.manual_seed(rank)
    stage = nn.Sequential(nn.Linear(4, 8), nn.Tanh()) if rank == 0 else nn.Linear(8, 1)
    opt = torch.optim.SGD(stage.parameters(), lr=0.1)
    wait, gd.PEER_WAIT = gd.PEER_WAIT, 1.0  # each stage's watcher waits for the other stage's model in vain
    try:
        with warnings.catch_warnings(record=True) as caught, gradwatch.watch(stage, opt, console=plain_console()) as gw:
            warnings.simplefilter("always")
            for step in range(3):
                opt.zero_grad()
                if rank == 0:
                    h = stage(batch(step, rank, bad=False))
                    dist.send(h.detach(), 1)
                    grad = torch.empty_like(h)
                    dist.recv(grad, 1)
                    h.backward(grad)
                else:
                    h = torch.empty(16, 8)
                    dist.recv(h, 0)
                    h.requires_grad_()
                    stage(h).pow(2).mean().backward()
                    dist.send(h.grad, 0)
                opt.step()
    finally:
        gd.PEER_WAIT = wait
    return {"findings": [f.to_dict() for f in gw.findings],
            "warnings": [str(w.message) for w in caught if str(w.message).startswith("gradwatch")]}


SCENARIOS: dict[str, Callable[[int], dict[str, Any]]] = {
    "independent": independent,
    "post_local_sgd": post_local_sgd,
    "independent_same_seed": lambda r: independent(r, same_seed=True),
    "ddp_op_nan": ddp_op_nan,
    "skip": lambda r: replicas(r, "skip"),
    "raise": lambda r: replicas(r, "raise"),
    "ddp_unused_wrapped": lambda r: ddp_unused(r, wrapped=True),
    "ddp_unused_inner": lambda r: ddp_unused(r, wrapped=False),
    "ddp_alternating_head": lambda r: ddp_unused(r, wrapped=True, alternating=True),
    "ddp_nan": ddp_nan,
    "ddp_nan_input": lambda r: ddp_nan(r, adam=True, observe=False),
    "ddp_nan_loss": lambda r: ddp_nan(r, adam=True, escalate=False),
    "ddp_nan_scaler": lambda r: ddp_nan(r, scaler=True),
    "ddp_nan_scaler_fused": lambda r: ddp_nan(r, scaler=True, fused=True),
    "ddp_guarded_step": lambda r: ddp_nan(r, guard=True),
    "ddp_zero_grad_in_accumulation": lambda r: ddp_accumulation(r, bug=True),
    "ddp_zero_grad_in_accumulation_synced": lambda r: ddp_accumulation(r, bug=True, no_sync=False, bucket_view=True),
    "ddp_accumulation": lambda r: ddp_accumulation(r, bug=False),
    "ddp_remainder": ddp_remainder,
    "ddp_ignored_targets": ddp_ignored_targets,
    "ddp_accumulation_synced": lambda r: ddp_accumulation(r, bug=False, no_sync=False, bucket_view=True),
    "fsdp": lambda r: fsdp(r, nan=False),
    "fsdp_nan": lambda r: fsdp(r, nan=True),
    "fsdp1": lambda r: fsdp1(r, nan=False, orig=False),
    "fsdp1_orig": lambda r: fsdp1(r, nan=False, orig=True),
    "fsdp1_nan": lambda r: fsdp1(r, nan=True, orig=False),
    "fsdp1_orig_nan": lambda r: fsdp1(r, nan=True, orig=True),
}

UNEVEN: dict[str, Callable[[int], dict[str, Any]]] = {
    "rank0_only": rank0_only,
    "join_unwatched": lambda r: join_uneven(r, None),
    "join_ddp": lambda r: join_uneven(r, "ddp"),
    "join_inner": lambda r: join_uneven(r, "inner"),
    "join_nan": lambda r: join_uneven(r, "ddp", nan=True),
    "probe_on_rank0": probe_on_rank0,
    "late_watcher": late_watcher,
    # Before replays ran no collective, rank 0's replay paired its all_gather with another collective of rank 1
    # (gloo aborted both processes) or waited for it.
    "ddp_gather_nan": ddp_collective_nan,
    "ddp_funcol_gather_nan": lambda r: ddp_collective_nan(r, how="funcol"),
    "ddp_backward_collective_nan": lambda r: ddp_collective_nan(r, how="backward"),
    "ddp_powersgd_nan": ddp_powersgd_nan,
    "pipeline": pipeline,
    # Before a rank's skipped step was settled, rank 0's agreement all_reduce paired with rank 1's next DDP
    # all-reduce (gloo aborted rank 0).
    "ddp_guarded_step_agreed": lambda r: ddp_nan(r, guard=True, agreement=True),
    "ddp_guarded_inner_bn": ddp_guarded_inner_bn,
}


def run_scenarios(scenarios: dict[str, Any], default: list[str]) -> None:
    """Run the scenarios named on the command line (default: ``default``), each called as ``fn(rank, out_dir)``,
    and write this rank's results to ``out_dir/rank<N>.json``. Arguments: rank, world size, port, out_dir[, names]."""
    rank, world, port, out_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    names = sys.argv[5].split(",") if len(sys.argv) > 5 else default
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = port
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results: dict[str, Any] = {}
    try:
        for name in names:
            try:
                results[name] = scenarios[name](rank, out_dir)
            except Exception:  # noqa: BLE001 - reported to the test, which fails on it
                results[name] = {"error": traceback.format_exc()}
            dist.barrier()
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
        dist.destroy_process_group()


def main() -> None:
    every = {**SCENARIOS, **UNEVEN}
    run_scenarios({name: (lambda rank, _out, fn=fn: fn(rank)) for name, fn in every.items()}, list(SCENARIOS))


if __name__ == "__main__":
    main()
