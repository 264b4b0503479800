"""``none_grad``: trainable parameters in the optimizer that received no gradient."""

from __future__ import annotations

from gradwatch.core.config import Config
from gradwatch.core.findings import Finding, names_text
from gradwatch.core.history import History
from gradwatch.core.stats import StepStats

_EMPTY: frozenset[str] = frozenset()


def _never(stats: StepStats, history: History) -> frozenset[str]:
    """Parameters of this optimizer that have had no gradient on any checked step so far."""
    previous = history.reported.get(f"none_grad_never/{stats.optimizer_index}")
    now = frozenset(stats.none_grad)
    if previous is None or stats.params_changed:
        return now
    return previous & now


#: Checked steps (times ``every``) a parameter of a ModuleList/ModuleDict member may go without a gradient
#: while other members get theirs, before it is reported: experts without tokens, dropped layers and heads
#: of tasks not in the batch are used on later steps. At least this many, and PER_MEMBER per member of
#: the container (12 task heads taken in turn, or sampled by dataset size, need more than 12 steps).
MEMBER_GRACE = 20
PER_MEMBER = 8


def _unused_in_every_member(name: str, member: tuple[str, str], busy_keys: set[str], none: frozenset[str]) -> bool:
    """The same submodule (by its path inside the member: ``blocks.0.ln_3.weight`` is ``ln_3.weight``) has
    no gradient in every member whose other parameters got theirs: ``forward`` never calls it, in any member
    at once. Routing leaves whole members idle, not the same part of every busy one."""
    container, key = member
    prefix = f"{container}.{key}." if container else f"{key}."
    if len(busy_keys) < 2 or not name.startswith(prefix):
        return False
    inner = name[len(prefix) :]
    return all(
        (f"{container}.{k}." if container else f"{k}.") + inner in none for k in busy_keys
    )


def _idle_in_every_member(fresh: tuple[str, ...], stats: StepStats) -> str:
    """Words for parameters unused in every member of their ModuleList/ModuleDict at once, or ''."""
    member_of = stats.extra.get("member_of")
    if not callable(member_of):
        return ""
    busy: dict[str, set[str]] = {}
    for m in filter(None, map(member_of, stats.names)):
        busy.setdefault(m[0], set()).add(m[1])
    none = frozenset(stats.none_grad)
    parts: dict[str, set[str]] = {}
    for n in fresh:
        m = member_of(n)
        if m is not None and _unused_in_every_member(n, m, busy.get(m[0], set()), none):
            inner = n[len(f"{m[0]}.{m[1]}." if m[0] else f"{m[1]}.") :]
            parts.setdefault(m[0], set()).add(inner.rsplit(".", 1)[0] if "." in inner else inner)
    return " ".join(
        f"{', '.join(sorted(subs))} got no gradient in any of the {len(busy[c])} members of {c or 'the model'} "
        "while their other parameters did: forward never calls it (not routing, which leaves whole members "
        "idle)."
        for c, subs in sorted(parts.items())
    )


def _report_now(stats: StepStats, history: History, config: Config) -> tuple[tuple[str, ...], dict[str, int]]:
    """The parameters to report at this step, and the members of containers waiting for their grace."""
    i = stats.optimizer_index
    seen = history.reported.get(f"none_grad/{i}", frozenset())
    never = _never(stats, history)
    # Parameters the model does not own are foreign_params' (or not_in_optimizer's) to report.
    foreign = set(stats.foreign)
    # Parameters the step's graph reached: backward gave them a gradient that the training code set to None
    # on purpose (a layer kept frozen for the first epoch by dropping its gradient): not unused.
    dropped = stats.extra.get("grad_dropped") or frozenset()
    fresh = [n for n in stats.none_grad if n in never and n not in seen and n not in foreign and n not in dropped]
    waiting: dict[str, int] = dict(history.reported.get(f"none_grad_waiting/{i}", {}))
    member_of = stats.extra.get("member_of")
    if fresh and stats.extra.get("unused_expected"):
        # DDP(find_unused_parameters=True): parameters unused on some steps are expected; each gets
        # MEMBER_GRACE checked steps to get a gradient before it is reported.
        grace = MEMBER_GRACE * max(1, config.every)
        now = [n for n in fresh if stats.step - waiting.setdefault(n, stats.step) >= grace]
        return tuple(now), {n: s for n, s in waiting.items() if n in never and n not in now}
    if not fresh or not callable(member_of):
        return tuple(fresh), {}
    # Members of a ModuleList/ModuleDict whose siblings got gradients this step: used on some steps only?
    busy = {m for m in map(member_of, stats.names) if m is not None}
    busy_containers: dict[str, set[str]] = {}
    for container, key in busy:
        busy_containers.setdefault(container, set()).add(key)
    idle_keys: dict[str, set[str]] = {}
    for n in stats.none_grad:  # with the busy ones: every trainable member the optimizer holds
        member = member_of(n)
        if member is not None:
            idle_keys.setdefault(member[0], set()).add(member[1])
    none = frozenset(stats.none_grad)
    now: list[str] = []
    for n in fresh:
        member = member_of(n)
        busy_keys = busy_containers.get(member[0], set()) if member is not None else set()
        if member is not None and busy_keys - {member[1]} and not _unused_in_every_member(n, member, busy_keys, none):
            members = len(busy_containers[member[0]] | idle_keys.get(member[0], set()))
            grace = max(MEMBER_GRACE, PER_MEMBER * members) * max(1, config.every)
            first = waiting.setdefault(n, stats.step)
            if stats.step - first < grace:
                continue
        now.append(n)
    return tuple(now), {n: s for n, s in waiting.items() if n in never and n not in now}


def check(stats: StepStats, history: History, config: Config) -> list[Finding]:
    # With no gradient at all, ``no_grads`` speaks instead.
    if not stats.none_grad or not stats.names:
        return []
    # Report parameters that never had a gradient, once. One that had gradients before and misses one now
    # is used on some steps only (mixture-of-experts routing, LayerDrop, one head per task): not a bug.
    fresh, waiting = _report_now(stats, history, config)
    stats.extra["none_grad_report"] = (fresh, waiting)
    if not fresh:
        return []
    waited = history.reported.get(f"none_grad_waiting/{stats.optimizer_index}", {})
    since = min((waited[n] for n in fresh if n in waited), default=None)
    modules = sorted({n.rsplit(".", 1)[0] if "." in n else "<root>" for n in fresh})
    cleared = bool(stats.extra.get("cleared_between_backwards"))
    cause = (
        "Likely cause here: zero_grad() ran between this step's backward passes and wiped what the earlier "
        "loss's backward gave them (two losses with retain_graph=True, zero_grad() in between). Call "
        "zero_grad() once per step, before the first backward(); or, if that clearing is meant (SAM, "
        "adversarial examples), use them in the last loss too.\n"
        if cleared
        else ""
    )
    when = (
        f"at any checked step since step {since}"
        + ("" if stats.extra.get("unused_expected") else " (while other members of their ModuleList/ModuleDict did)")
        if since is not None
        else f"at step {stats.step}"
    )
    # Without an optimizer (gw.check() before a hand-written update) there is no "optimizer 0".
    with_optimizer = stats.extra.get("optimizer") is not None
    whose = f"in optimizer {stats.optimizer_index}" if with_optimizer else "of the model"
    updater = "the optimizer never updates them" if with_optimizer else "the update (by hand) never changes them"
    left_out = "the optimizer" if with_optimizer else "the update"
    idle_parts = _idle_in_every_member(fresh, stats)
    if idle_parts and not cleared:
        cause = f"Likely cause here: {idle_parts}\n"
    # Inside a reentrant checkpoint fed an input without grad (a frozen embedding before LoRA adapters)?
    replay = stats.extra.get("reentrant_cut")
    cut = {m: [n for n in names if n in fresh] for m, names in (replay() if callable(replay) else {}).items()}
    cut = {m: names for m, names in cut.items() if names}
    if cut:
        from gradwatch.diagnose.escalation import reentrant_cause

        cause = "Likely cause here: " + reentrant_cause(cut) + "\n"
    return [
        Finding(
            kind="none_grad",
            step=stats.step,
            severity="warning",
            message=(
                f"{len(fresh)} trainable parameter(s) {whose} got no "
                f"gradient {when}: {names_text(fresh)}.\n"
                f"Why it matters: {updater} (their .grad is None), and under "
                "DistributedDataParallel they make backward fail or require find_unused_parameters=True.\n"
                + cause
                + "(Reported once, for parameters that have had no gradient on any checked step so far. If "
                "these are used on some steps only, e.g. an auxiliary head of some batches, ignore this; "
                f"members of a ModuleList/ModuleDict (experts, LayerDrop layers, task heads) get {MEMBER_GRACE} "
                f"checked steps, or {PER_MEMBER} per member, and so does every parameter under "
                "DistributedDataParallel(find_unused_parameters=True).)"
                + (
                    ""  # the reentrant checkpoint's cause carries its fix
                    if cut
                    else "\nFix: use them in forward on the path to the loss (check for a branch that is never "
                    "taken or an output that is detached or dropped), or freeze them with requires_grad_(False), "
                    f"or leave them out of {left_out}."
                )
            ),
            params=fresh,
            module=modules[0] if len(modules) == 1 else None,
            data={
                "modules": modules,
                "count": len(fresh),
                "none_grad_now": len(stats.none_grad),
                "optimizer": stats.optimizer_index,
                "cleared_between_backwards": cleared,
                "reentrant_checkpoint": cut,
            },
        )
    ]


def remember(stats: StepStats, history: History) -> None:
    """Record every parameter reported so far, so each is reported once, which parameters never had a
    gradient, and the container members still in their grace (called by the engine; O(1) on a step where
    every parameter has one)."""
    i = stats.optimizer_index
    never_key = f"none_grad_never/{i}"
    if not stats.none_grad:
        if stats.names and history.reported.get(never_key) is not _EMPTY:
            history.reported[never_key] = _EMPTY  # every parameter has had a gradient now
            history.reported.pop(f"none_grad_waiting/{i}", None)
        return
    if not stats.names:
        return
    history.reported[never_key] = _never(stats, history)
    report = stats.extra.get("none_grad_report")
    reported, waiting = report if isinstance(report, tuple) else (tuple(stats.none_grad), {})
    key = f"none_grad/{i}"
    seen = history.reported.get(key, frozenset())
    # Parameters that had a gradient before are never reported: mark them seen with the reported ones.
    settled = [n for n in stats.none_grad if n not in waiting]
    if any(n not in seen for n in settled) or reported:
        history.reported[key] = frozenset(seen) | frozenset(settled) | frozenset(reported)
    if waiting or f"none_grad_waiting/{i}" in history.reported:
        history.reported[f"none_grad_waiting/{i}"] = waiting
