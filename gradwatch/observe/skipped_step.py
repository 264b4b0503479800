"""Distributed runs: a rank whose training code skipped ``optimizer.step()`` after a synchronized backward.

Under DDP every rank runs the same backward passes, and gradwatch's agreement (one ``all_reduce`` per checked
step, see :mod:`gradwatch.observe.distributed`) runs inside ``optimizer.step()``. A loop that decides on one
rank's own values whether to step (``loss.backward(); if not torch.isfinite(loss): continue``) leaves the
ranks that did step waiting in that ``all_reduce`` while the skipping rank's next backward starts DDP's own
gradient all-reduce: the two collectives pair up across ranks (gloo aborts the process on the size mismatch,
NCCL hangs or mixes the buffers).

A rank cannot tell that case on its own from a loop that accumulates several synchronized backward passes
(no ``no_sync``), where no rank steps in between: both call forward again after a synchronized backward with no
optimizer step since. So in that case (only) the rank *probes*, before the forward: it runs the agreement's
``all_reduce`` with a probe mark. Where every rank probes (accumulation, or every rank skipping alike) the
result says so to all of them and nothing else happens. Where some ranks are waiting in a step's check, the
probe pairs with their ``all_reduce``; the probing ranks then join the rest of that check's collectives (what
each rank saw, where the NaN was born) and count the step as the others count it. Their flag makes every rank
skip the update, so the replicas stay identical, and the ranks that stepped report which rank skipped.

Layout of the probe in the agreement vector ``[0:world]`` (flags) and ``[world:2*world]`` (stale losses): a
probing rank sets its flag to 1 and its stale slot to :data:`PROBE` (a stale loss adds at most 1 per rank).
"""

from __future__ import annotations

from typing import Any

import torch

#: A probing rank's mark in its stale-loss slot of the agreement vector (a real stale flag is 0 or 1).
PROBE = 2.0


def ddp_synced(ddp: Any) -> bool:
    """Whether DDP all-reduces the gradients of the backward of the forward about to run (not ``no_sync``)."""
    return ddp is not None and bool(getattr(ddp, "require_backward_grad_sync", False))


def under_fp16_autocast() -> bool:
    """A forward under float16 autocast: a GradScaler drops overflow steps on every rank alike (no probe)."""
    for device in ("cuda", "cpu"):
        try:
            if torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) == torch.float16:
                return True
        except (TypeError, RuntimeError, AttributeError):  # a torch without the per-device form
            return torch.is_autocast_enabled()
    return False


def mark_probe(vec: torch.Tensor, rank: int, world: int) -> None:
    """Write a probing rank's marks: its flag (every rank skips the update it owes) and the probe mark."""
    vec[rank] = 1.0
    vec[world + rank] = PROBE


def probing_ranks(values: Any, world: int) -> list[int]:
    """The ranks that probed, from the summed agreement vector."""
    return [r for r in range(world) if values[world + r] >= PROBE]


def without_probes(values: Any, world: int) -> list[float]:
    """The summed agreement vector with the probe marks taken out of the stale-loss slots."""
    out = [float(v) for v in values]
    for r in range(world):
        if out[world + r] >= PROBE:
            out[world + r] -= PROBE
    return out


def backward_left_unstepped(engine: Any) -> bool:
    """A backward pass reached the gradients since the engine's last step (one optimizer, checked this step)."""
    if engine.closed or engine.config.deferred or len(engine.optimizers) != 1:
        return False
    return engine.ledger.backwards > 0 and engine.should_check(0)


def ranks_that_saw_values(ranks: list[int], skipped: list[int], reports: list[dict[str, Any]]) -> list[int]:
    """Of the flagged ``ranks``, those with NaN/Inf values of their own (not only a step their loop skipped)."""
    saw = {d.get("rank") for d in reports if d.get("nonfinite_count") or d.get("loss_nonfinite") or d.get("inputs")}
    return [r for r in ranks if r not in skipped or r in saw]
