"""``replicas_diverged``: the ranks of a DDP run hold different parameters.

DDP broadcasts rank 0's parameters once, when it wraps the model, and from then on averages gradients: a
weight changed on some ranks only after that (a checkpoint loaded on rank 0 alone, an init or a ``.data`` edit
under ``if rank == ...``) stays different for the rest of the run, and every rank trains its own model while
the loss curves look normal. :class:`~gradwatch.observe.distributed.RankAgreement` notices it from the
fingerprint that rides on its agreement collective (the first checks, then every
:data:`REPLICA_CHECK_EVERY`); on that rare step every rank gathers a per-parameter fingerprint
(:func:`param_signatures`) so that :func:`diverged_facts` can name the parameters and the ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from gradwatch.core.findings import Explanation, Finding

#: Under DDP, a replica fingerprint rides on the agreement collective every this many checks (after the first
#: ones): a weight changed on one rank mid-run is found within this many steps, at no extra collective.
REPLICA_CHECK_EVERY = 100
_SHOWN = 8


@dataclass(frozen=True)
class DivergedFacts:
    """Which parameters differ from rank 0's, and on which ranks."""

    step: int
    params: tuple[str, ...]
    ranks: tuple[int, ...]


def param_signatures(params: list[torch.Tensor]) -> torch.Tensor:
    """Per parameter, ``[sum, sum of |x|]`` in float64: equal on replicas, almost never equal otherwise."""
    rows = [torch.stack([p.detach().double().sum(), p.detach().double().abs().sum()]) for p in params]
    return torch.stack(rows) if rows else torch.zeros(0, 2, dtype=torch.float64)


def diverged_facts(step: int, names: list[str], gathered: list[torch.Tensor]) -> DivergedFacts:
    """The parameters (by ``names``) whose signature on some rank differs from rank 0's, and those ranks."""
    reference = gathered[0]
    params: list[str] = []
    ranks: list[int] = []
    for rank, sig in enumerate(gathered[1:], start=1):
        scale = reference.abs().clamp_min(1e-30)
        differs = ((sig - reference).abs() > 1e-6 * scale).any(dim=1)
        if bool(differs.any()):
            ranks.append(rank)
            params.extend(names[i] for i in differs.nonzero().flatten().tolist() if names[i] not in params)
    return DivergedFacts(step, tuple(params), tuple(ranks))


def diverged_finding(facts: DivergedFacts) -> Finding:
    more = len(facts.params) - _SHOWN
    shown = ", ".join(facts.params[:_SHOWN]) + (f" and {more} more" if more > 0 else "")
    ranks = ", ".join(map(str, facts.ranks)) or "some rank"
    return Finding(
        kind="replicas_diverged",
        step=facts.step,
        severity="error",
        params=facts.params,
        data={"ranks": list(facts.ranks)},
        explanation=Explanation(
            what=(
                f"The DistributedDataParallel replicas hold different parameters at step {facts.step}: on rank(s) "
                f"{ranks}, {shown or 'some parameters'} {'differs' if len(facts.params) == 1 else 'differ'} from rank 0's."
            ),
            why=(
                "DDP copies rank 0's parameters to every rank only when it wraps the model, then averages "
                "gradients: a weight changed on some ranks after that stays different for the rest of the run, so "
                "every rank trains its own model, and a checkpoint saved from rank 0 is not what the others train."
            ),
            fix=(
                "change parameters before wrapping the model in DDP, or alike on every rank: load a checkpoint on "
                "every rank (torch.load(..., map_location=...)) before DistributedDataParallel(model), and do not "
                "edit weights under an `if rank == ...`; to resync now, torch.distributed.broadcast(p.data, src=0) "
                "for every parameter on every rank."
            ),
        ),
    )


def gather_signatures(
    dist: Any, group: Any, world: int, params: list[torch.Tensor], device: torch.device
) -> list[torch.Tensor]:
    """Every rank's :func:`param_signatures` (one ``all_gather``; every rank runs it on the same check)."""
    mine = param_signatures(params).to(device)
    out = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(out, mine, group=group)
    return [t.cpu() for t in out]
