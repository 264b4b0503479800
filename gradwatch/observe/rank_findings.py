"""Findings about the other ranks of a distributed run: what each rank relays of its own incident, and the words.

:class:`~gradwatch.observe.distributed.RankAgreement` gathers the facts (which ranks flagged a non-finite
step, what each rank found as its origin); the functions here turn them into findings on this rank. Pure:
no collective, no tensor.
"""

from __future__ import annotations

from typing import Any

from gradwatch.core.findings import Explanation, Finding, names_text
from gradwatch.core.stats import StepStats

#: What a rank's ``nan_origin`` summary carries to the others, besides its rank and words.
_ORIGIN_KEYS = ("phase", "op", "forward_op", "module", "source", "code")


def own_origin(findings: list[Finding]) -> tuple[Finding | None, Finding | None]:
    """This rank's ``nan_origin`` (one that named where), and its own ``nonfinite_loss`` with finite gradients.

    A NaN/Inf loss whose gradients are finite has no origin to localize, but its own finding names the usual
    causes (every target equal to ignore_index on that rank's batch): rank zero would only say "a non-finite
    loss" of the other rank."""
    mine = next((f for f in findings if f.kind == "nan_origin" and f.data.get("phase")), None)
    loss_only = next(
        (f for f in findings if f.kind == "nonfinite_loss" and f.data.get("grads_finite") and not f.data.get("rank_relayed")),
        None,
    )
    return mine, loss_only


def origin_summary(rank: int, mine: Finding | None, loss_only: Finding | None) -> dict[str, Any] | None:
    """What this rank tells the others about where its NaN/Inf came from (None: nothing)."""
    if mine is not None:
        return {"rank": rank, **_words(mine), **{k: mine.data.get(k) for k in _ORIGIN_KEYS}}
    if loss_only is not None:
        return {"rank": rank, **_words(loss_only), "loss_only": True}
    return None


def _words(f: Finding) -> dict[str, Any]:
    """A finding's message, and its explanation's parts when it has one (to relay them as parts)."""
    words: dict[str, Any] = {"message": f.message}
    if f.explanation is not None:
        words["explanation"] = f.explanation.to_dict()
    return words


def origin_to_relay(summaries: list[Any], rank: int, loss_only_here: bool) -> dict[str, Any] | None:
    """Which other rank's summary this rank (which localized nothing) reports: an origin another rank named,
    else another rank's loss-only finding when this rank has none of its own; None for neither."""
    others = [o for o in summaries if isinstance(o, dict) and o.get("rank") != rank]
    other = next((o for o in others if not o.get("loss_only")), None)
    if other is not None:
        return other
    loss = next((o for o in others if o.get("loss_only")), None)
    return None if loss is None or loss_only_here else loss  # this rank's own loss finding says it


def _relayed_explanation(prefix: str, summary: dict[str, Any]) -> Explanation:
    """The other rank's words, led by ``prefix``."""
    parts = summary.get("explanation")
    if isinstance(parts, dict):
        return Explanation(
            what=prefix + str(parts.get("what", "")),
            why=str(parts.get("why", "")),
            cause=str(parts.get("cause", "")),
            fix=str(parts.get("fix", "")),
        )
    return Explanation(what=prefix + str(summary.get("message", "")))


def relayed_finding(stats: StepStats, other: dict[str, Any], rank: int) -> Finding:
    """Another rank's origin (or loss-only) finding, reported by this rank."""
    if other.get("loss_only"):
        return Finding(
            kind="nonfinite_loss",
            step=stats.step,
            severity="error",
            explanation=_relayed_explanation(f"On rank {other['rank']}: ", other),
            data={"grads_finite": True, "origin_rank": other["rank"], "rank_relayed": True},
        )
    data = {k: v for k, v in other.items() if k not in ("message", "explanation")}
    data["origin_rank"] = data.pop("rank")
    prefix = f"On rank {data['origin_rank']} (rank {rank}, reporting, got it through the gradient all-reduce): "
    return Finding(
        kind="nan_origin",
        step=stats.step,
        severity="error",
        explanation=_relayed_explanation(prefix, other),
        module=data.get("module"),
        op=data.get("op"),
        data=data,
    )


_ACTION = {
    "skip": "Every rank skipped this update, so the replicas stay identical.",
    "warn": "on_nonfinite='warn': every rank applied the update.",
    "raise": "on_nonfinite='raise': every rank stops before the update.",
}


def other_rank_finding(
    stats: StepStats, ranks: list[int], reports: list[dict[str, Any]], policy: str, *, carried: bool = False
) -> Finding:
    """The finding a rank reports when only other ranks saw non-finite values this step (``carried``: this
    rank saw them too, in its gradients only, while its loss was finite: they came from those ranks)."""
    lines = []
    params: list[str] = []
    data_ranks: list[int] = []
    for r in sorted(reports, key=lambda d: d.get("rank", 0)):
        if r.get("rank") not in ranks:
            continue
        what = []
        if r.get("nonfinite_count"):
            what.append(
                f"{r['nonfinite_count']} gradient(s) with NaN/Inf ({r.get('nan', 0)} NaN, {r.get('inf', 0)} Inf): "
                f"{names_text(r.get('nonfinite') or [])}"
            )
            params.extend(n for n in r.get("nonfinite") or [] if n not in params)
        if r.get("loss_nonfinite"):
            what.append("a non-finite loss")
        if r.get("inputs"):
            what.append(f"an input batch with NaN/Inf ({_inputs_text(r['inputs'])})")
            data_ranks.append(r.get("rank", 0))
        lines.append(f"  rank {r.get('rank')}: " + ("; ".join(what) or "non-finite values"))
    where = "\n".join(lines) if lines else f"  rank(s) {', '.join(map(str, ranks))}"
    head = f"Rank(s) {', '.join(map(str, ranks))} saw non-finite values at step {stats.step}:\n{where}\n"
    if carried:
        head = (
            f"The non-finite gradients of step {stats.step} came from {_ranks_text(ranks)}: the loss there was "
            "non-finite while this rank's was finite, and the gradient all-reduce carried the NaN/Inf to "
            f"every rank.\n{where}\n"
        )
    cause = ""
    if data_ranks:
        cause = (
            f"The data on {_ranks_text(data_ranks)} is the cause: the input batch there held NaN/Inf before "
            "the model ran.\n"
        )
    return Finding(
        kind="nonfinite_on_other_rank",
        step=stats.step,
        severity="error",
        explanation=Explanation(
            what=f"{head}{cause}{_ACTION.get(policy, '')}",
            why="one rank's NaN reaches every replica through the gradient all-reduce (or leaves the replicas "
            "out of step if it does not).",
            fix="look at the batch that rank got at this step (a bad sample or data shard); when that rank "
            "localized the op, the nan_origin finding of this step (\"On rank ...\") names it here too.",
        ),
        params=tuple(params),
        data={
            "ranks": list(ranks),
            "input_ranks": data_ranks,
            "reports": reports,
            "optimizer": stats.optimizer_index,
        },
    )


def other_rank_dropped_finding(stats: StepStats, ranks: list[int]) -> Finding:
    """Another rank's loss was non-finite on a batch whose update was dropped (by a GradScaler, on every
    rank, since the all-reduce carried the NaN/Inf there) or skipped by the training code."""
    which = _ranks_text(ranks)
    dropped = stats.extra.get("scaler_dropped")
    # A GradScaler's dropped steps are counted as steps: name the (first) one it dropped, as that rank does.
    # A fused optimizer's step runs on a dropped step: this very step was dropped.
    here = bool(stats.extra.get("amp_dropped_here"))
    step = dropped[0] if isinstance(dropped, tuple) else stats.step
    when = f"at step {step}" if isinstance(dropped, tuple) or here else f"on a batch before step {step}"
    return Finding(
        kind="nonfinite_on_other_rank",
        step=step,
        severity="warning",
        explanation=Explanation(
            what=f"The loss on {which} was NaN/Inf {when}, on a batch no update used: the "
            "gradient all-reduce carried its NaN/Inf to every rank, and a GradScaler dropped that step on "
            "every rank (here it looks like an ordinary fp16 overflow), or the training code skipped it.",
            why=f"the batch or the forward pass on {which} produces NaN/Inf and will again with similar data.",
            fix=f"look at the data on {which} at that step (its own findings name the input or the op: "
            "``gw.findings`` there); filter bad samples, or guard the loss (log/sqrt/division of zero).",
        ),
        data={"ranks": list(ranks), "no_update": True, "optimizer": stats.optimizer_index},
    )


def skipped_step_finding(stats: StepStats, ranks: list[int]) -> Finding:
    """The training code of ``ranks`` skipped ``optimizer.step()`` after a synchronized backward while this rank
    stepped (see :mod:`gradwatch.observe.skipped_step`); every rank skipped the update."""
    which = _ranks_text(ranks)
    return Finding(
        kind="nonfinite_on_other_rank",
        step=stats.step,
        severity="warning",
        explanation=Explanation(
            what=f"The training code of {which} skipped optimizer.step() at step {stats.step} on its own (a check "
            "of that rank's own loss or gradients after backward(), such as `if not torch.isfinite(loss): "
            "continue`), while this rank stepped. gradwatch settled that step with that rank before its next "
            "forward and skipped the update on every rank, so the replicas stay identical.",
            why="a step skipped on some ranks only leaves the ranks out of step: the next gradient all-reduce "
            "pairs with a collective of another iteration (gloo aborts, NCCL hangs), and the ranks that step "
            "apply an update the others do not.",
            fix="drop the per-rank guard: gradwatch already skips a NaN/Inf update on every rank at once "
            "(on_nonfinite='skip'); or decide on every rank alike, e.g. `bad = torch.tensor(float(not "
            "torch.isfinite(loss))); dist.all_reduce(bad)` and skip when bad > 0.",
        ),
        data={"skipped_ranks": list(ranks), "ranks": list(ranks), "optimizer": stats.optimizer_index},
    )


def other_rank_input_finding(
    stats: StepStats, input_ranks: list[int], reports: list[dict[str, Any]], policy: str
) -> Finding:
    """``nonfinite_input`` on a rank whose own inputs were finite: another rank's batch held NaN/Inf and the
    gradient all-reduce carried it here."""
    rows: list[dict[str, Any]] = []
    lines = []
    for r in sorted(reports, key=lambda d: d.get("rank", 0)):
        if r.get("rank") not in input_ranks:
            continue
        lines.append(f"  rank {r.get('rank')}: {_inputs_text(r['inputs'])}")
        rows.extend({"rank": r.get("rank"), "input": n, "nan": a, "inf": b} for n, a, b in r["inputs"])
    which = _ranks_text(input_ranks)
    return Finding(
        kind="nonfinite_input",
        step=stats.step,
        severity="error",
        explanation=Explanation(
            what=f"The input batch of {which} at step {stats.step} already held non-finite values before "
            "the model ran:\n" + "\n".join(lines) + "\n"
            f"The data on {which}, not the model, is the cause: this rank's own inputs were finite, and "
            "the gradient all-reduce carried the NaN/Inf into every rank's gradients.\n"
            f"{_ACTION.get(policy, '')}",
            fix=f"look at the batch {which} got at this step (its data shard: missing values in the "
            "dataset, a normalization by a zero std, a broken augmentation); filter or impute bad samples, and "
            "assert torch.isfinite(x).all() in the data pipeline while debugging.",
        ),
        data={"ranks": list(input_ranks), "inputs": rows, "table": rows, "optimizer": stats.optimizer_index},
    )


def _ranks_text(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _inputs_text(inputs: list[Any]) -> str:
    return ", ".join(f"{n} ({a} NaN, {b} Inf)" for n, a, b in inputs)
