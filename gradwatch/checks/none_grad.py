"""``none_grad``: trainable parameters in the optimizer that received no gradient."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gradwatch.core.config import Config
from gradwatch.core.findings import Explanation, Finding, names_text
from gradwatch.core.history import History
from gradwatch.core.stats import StepStats

_EMPTY: frozenset[str] = frozenset()
#: A parameter's place in a ModuleList/ModuleDict: (the container's path, the member's key).
Member = tuple[str, str]
#: Per container path, member keys.
Keys = dict[str, set[str]]


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


def _fresh(stats: StepStats, history: History, never: frozenset[str]) -> list[str]:
    """Parameters without a gradient that never had one, not reported yet, and the model's own."""
    seen = history.reported.get(f"none_grad/{stats.optimizer_index}", frozenset())
    # Parameters the model does not own are foreign_params' (or not_in_optimizer's) to report.
    foreign = set(stats.foreign)
    # Parameters the step's graph reached: backward gave them a gradient that the training code set to None
    # on purpose (a layer kept frozen for the first epoch by dropping its gradient): not unused.
    dropped = stats.extra.get("grad_dropped") or frozenset()
    return [n for n in stats.none_grad if n in never and n not in seen and n not in foreign and n not in dropped]


def _containers(stats: StepStats, member_of: Callable[[str], Member | None]) -> tuple[Keys, Keys]:
    """Per ModuleList/ModuleDict: the members with a gradient this step, and every trainable member."""
    busy: Keys = {}
    for m in filter(None, map(member_of, stats.names)):
        busy.setdefault(m[0], set()).add(m[1])
    every: Keys = {c: set(keys) for c, keys in busy.items()}
    for n in stats.none_grad:
        member = member_of(n)
        if member is not None:
            every.setdefault(member[0], set()).add(member[1])
    return busy, every


def _in_grace(name: str, member: Member | None, containers: tuple[Keys, Keys], none: frozenset[str],
              waiting: dict[str, int], step: int, every: int) -> bool:
    """A member of a container whose siblings got gradients this step, still within its grace (counted
    from the step it first went without one, noted in ``waiting``)."""
    if member is None:
        return False
    busy, members = containers
    busy_keys = busy.get(member[0], set())
    if not busy_keys - {member[1]} or _unused_in_every_member(name, member, busy_keys, none):
        return False
    grace = max(MEMBER_GRACE, PER_MEMBER * len(members[member[0]])) * every
    return step - waiting.setdefault(name, step) < grace


def _report_now(stats: StepStats, history: History, config: Config) -> tuple[tuple[str, ...], dict[str, int]]:
    """The parameters to report at this step, and the members of containers waiting for their grace."""
    never = _never(stats, history)
    fresh = _fresh(stats, history, never)
    waiting: dict[str, int] = dict(history.reported.get(f"none_grad_waiting/{stats.optimizer_index}", {}))
    # Reached only through a custom autograd Function: the next backward tells whether its backward returned
    # None for them (reported then) or the training code dropped their gradient (never reported).
    watched = stats.extra.get("grad_blocked_pending") or _EMPTY
    held = {n: waiting.setdefault(n, stats.step) for n in fresh if n in watched}
    # Those it did return None for get no grace: no routing or DDP schedule will give them a gradient.
    blocked = stats.extra.get("grad_blocked") or {}
    sure = [n for n in fresh if n in blocked]
    fresh = [n for n in fresh if n not in held and n not in blocked]
    member_of = stats.extra.get("member_of")
    every = max(1, config.every)
    if fresh and stats.extra.get("unused_expected"):
        # DDP(find_unused_parameters=True): parameters unused on some steps are expected; each gets
        # MEMBER_GRACE checked steps to get a gradient before it is reported.
        now = [n for n in fresh if stats.step - waiting.setdefault(n, stats.step) >= MEMBER_GRACE * every]
    elif not fresh or not callable(member_of):
        return (*sure, *fresh), held
    else:
        # Members of a ModuleList/ModuleDict whose siblings got gradients this step: used on some steps only?
        containers = _containers(stats, member_of)
        none = frozenset(stats.none_grad)
        now = [n for n in fresh if not _in_grace(n, member_of(n), containers, none, waiting, stats.step, every)]
    now = sure + now
    return tuple(now), {n: s for n, s in waiting.items() if n in never and n not in now}


@dataclass(frozen=True)
class NoneGradFacts:
    """What ``none_grad`` says about the parameters reported at one step."""

    step: int
    optimizer: int
    params: tuple[str, ...]
    #: The step their grace began (members of a container, parameters under DDP), or None.
    since: int | None
    #: ``gw.check()`` without an optimizer: the update is the user's own code.
    with_optimizer: bool
    unused_expected: bool
    #: zero_grad() ran between this step's backward passes.
    cleared: bool
    #: Words for parts unused in every member of their container ("" if none).
    idle_parts: str
    #: Per reentrant checkpoint fed an input without grad, the reported parameters inside it.
    cut: dict[str, list[str]]
    #: The custom autograd Function whose backward returned None for them: (its node's class name, its
    #: qualified name); the step's graph reaches them only through it. None for other parameters.
    gate: tuple[str, str] | None = None
    #: Their modules.
    modules: tuple[str, ...] = ()


def none_grad_facts(
    stats: StepStats, history: History, fresh: tuple[str, ...], gate: tuple[str, str] | None = None
) -> NoneGradFacts:
    waited = history.reported.get(f"none_grad_waiting/{stats.optimizer_index}", {})
    # Inside a reentrant checkpoint fed an input without grad (a frozen embedding before LoRA adapters)?
    # Not asked for parameters a custom Function's backward gave None: that cause is known.
    replay = stats.extra.get("reentrant_cut") if gate is None else None
    cut = {m: [n for n in names if n in fresh] for m, names in (replay() if callable(replay) else {}).items()}
    return NoneGradFacts(
        step=stats.step,
        optimizer=stats.optimizer_index,
        params=fresh,
        since=min((waited[n] for n in fresh if n in waited), default=None),
        # Without an optimizer (gw.check() before a hand-written update) there is no "optimizer 0".
        with_optimizer=stats.extra.get("optimizer") is not None,
        unused_expected=bool(stats.extra.get("unused_expected")),
        cleared=bool(stats.extra.get("cleared_between_backwards")),
        idle_parts=_idle_in_every_member(fresh, stats) if gate is None else "",
        cut={m: names for m, names in cut.items() if names},
        gate=gate,
        modules=_modules(fresh),
    )


def _modules(params: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(sorted({n.rsplit(".", 1)[0] if "." in n else "<root>" for n in params}))


def none_grad_cause(f: NoneGradFacts) -> str:
    """The cause to name, if any: a custom Function's backward returned None for them, a reentrant
    checkpoint cut the graph, zero_grad() between the step's backward passes, a part no member's forward
    calls; or ``none``."""
    if f.gate is not None:
        return "custom_function"
    if f.cut:
        return "reentrant"
    if f.cleared:
        return "cleared"
    return "idle_part" if f.idle_parts else "none"


def _reentrant_cause(f: NoneGradFacts) -> str:
    from gradwatch.diagnose.reentrant import reentrant_cause

    return reentrant_cause(f.cut)


#: The "Likely cause here" line, by cause.
_CAUSE_WORDS: dict[str, Callable[[NoneGradFacts], str]] = {
    "reentrant": _reentrant_cause,
    "cleared": lambda f: (
        "zero_grad() ran between this step's backward passes and wiped what the earlier "
        "loss's backward gave them (two losses with retain_graph=True, zero_grad() in between). Call "
        "zero_grad() once per step, before the first backward(); or, if that clearing is meant (SAM, "
        "adversarial examples), use them in the last loss too."
    ),
    "idle_part": lambda f: f.idle_parts,
}


def _function_explanation(f: NoneGradFacts) -> Explanation:
    """Words for parameters a custom autograd Function's backward returned None for."""
    assert f.gate is not None
    node, qualified = f.gate
    fn = qualified.rsplit(".", 1)[-1]
    when = f"at step {f.step}" if f.since is None else f"at every checked step from step {f.since} to step {f.step}"
    whose = f"in optimizer {f.optimizer}" if f.with_optimizer else "of the model"
    where = f" (module {', '.join(f.modules)})" if f.modules else ""
    updater = "the optimizer never updates them" if f.with_optimizer else "the update (by hand) never changes them"
    return Explanation(
        what=(
            f"{len(f.params)} trainable parameter(s) {whose} got no gradient {when}: {names_text(f.params)}"
            f"{where}. The step's graph reaches them only through the custom autograd Function {fn} "
            f"({qualified}, autograd node {node}), and {fn}.backward returned None for them: their .grad stayed "
            "None after backward."
        ),
        why=(
            f"{updater}, though they require grad. backward returns one gradient per input of forward, in order; "
            "None tells autograd that this input gets no gradient. No error, no NaN: they stay at their initial "
            "values."
        ),
        fix=(
            f"return their gradient from {fn}.backward: grad_output times the derivative of the output with "
            "respect to each of them (for x @ w.t(): grad_output.t() @ x), None only for inputs with "
            "ctx.needs_input_grad False. Check it with gradwatch.gradcheck(model, batch). If no gradient is meant, "
            f"freeze them with requires_grad_(False) or leave them out of "
            f"{'the optimizer' if f.with_optimizer else 'the update'}."
        ),
    )


def none_grad_explanation(f: NoneGradFacts) -> Explanation:
    if f.gate is not None:
        return _function_explanation(f)
    if f.since is None:
        when = f"at step {f.step}"
    else:
        members = "" if f.unused_expected else " (while other members of their ModuleList/ModuleDict did)"
        when = f"at any checked step since step {f.since}{members}"
    whose = f"in optimizer {f.optimizer}" if f.with_optimizer else "of the model"
    updater = "the optimizer never updates them" if f.with_optimizer else "the update (by hand) never changes them"
    cause = none_grad_cause(f)
    likely = f"Likely cause here: {_CAUSE_WORDS[cause](f)}\n" if cause != "none" else ""
    ddp_why, fix = _DDP_WORDS[f.unused_expected](f)
    return Explanation(
        what=f"{len(f.params)} trainable parameter(s) {whose} got no gradient {when}: {names_text(f.params)}.",
        why=f"{updater} (their .grad is None){ddp_why}\n{likely}{_ONCE}",
        fix="" if cause == "reentrant" else fix,  # the reentrant checkpoint's cause carries its fix
    )


def _usual_words(f: NoneGradFacts) -> tuple[str, str]:
    return (
        ", and under DistributedDataParallel they make backward fail or require find_unused_parameters=True.",
        "use them in forward on the path to the loss (check for a branch that is never taken or an output that "
        "is detached or dropped), or freeze them with requires_grad_(False), or leave them out of "
        f"{'the optimizer' if f.with_optimizer else 'the update'}.",
    )


def _unused_expected_words(f: NoneGradFacts) -> tuple[str, str]:
    # DistributedDataParallel(find_unused_parameters=True) is already set: they waited MEMBER_GRACE checked
    # steps, so they are unused on every step, not on some.
    return (
        ". DistributedDataParallel already has find_unused_parameters=True, so backward does not fail, but "
        "these are unused on every step, not on some: forward never reaches them. find_unused_parameters=True "
        "makes DDP traverse the autograd graph after every forward to find them, a cost paid on every step.",
        "remove them from the model, or use them in forward on the path to the loss (check for a branch that is "
        "never taken or an output that is detached or dropped); if no other parameter goes unused on some "
        "steps, drop find_unused_parameters=True then (DDP skips that traversal).",
    )


#: The words about DistributedDataParallel (the end of the why, and the fix), by whether the DDP module
#: already expects unused parameters (``find_unused_parameters=True``).
_DDP_WORDS: dict[bool, Callable[[NoneGradFacts], tuple[str, str]]] = {
    False: _usual_words,
    True: _unused_expected_words,
}


#: When none_grad speaks, and when it waits.
_ONCE = (
    "(Reported once, for parameters that have had no gradient on any checked step so far. If these are used on "
    "some steps only, e.g. an auxiliary head of some batches, ignore this; members of a ModuleList/ModuleDict "
    f"(experts, LayerDrop layers, task heads) get {MEMBER_GRACE} checked steps, or {PER_MEMBER} per member, and so "
    "does every parameter under DistributedDataParallel(find_unused_parameters=True).)"
)


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
    # One finding for the parameters a custom Function's backward returned None for, per Function; one
    # for the others.
    blocked = stats.extra.get("grad_blocked") or {}
    groups: dict[tuple[str, str] | None, list[str]] = {}
    for n in fresh:
        groups.setdefault(blocked.get(n), []).append(n)
    return [_finding(stats, none_grad_facts(stats, history, tuple(ps), gate)) for gate, ps in groups.items()]


def _finding(stats: StepStats, f: NoneGradFacts) -> Finding:
    return Finding(
        kind="none_grad",
        step=stats.step,
        severity="warning",
        explanation=none_grad_explanation(f),
        params=f.params,
        module=f.modules[0] if len(f.modules) == 1 else None,
        op=f.gate[0] if f.gate is not None else None,
        data={
            "modules": list(f.modules),
            "count": len(f.params),
            "none_grad_now": len(stats.none_grad),
            "optimizer": stats.optimizer_index,
            "cleared_between_backwards": f.cleared,
            "reentrant_checkpoint": f.cut,
            "custom_function": f.gate[1] if f.gate is not None else None,
        },
    )


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
