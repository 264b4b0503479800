"""``ddp_unused_parameters``: DDP (``find_unused_parameters=False``) left a backward's gradients unreduced.

DDP's reducer all-reduces a bucket once every parameter in it has its gradient. When a branch of the model
is skipped on some step (an auxiliary head, a layer behind an ``if``), its parameters never report, their
bucket is never reduced, and every rank steps on its own un-averaged gradients; DDP then raises "Expected to
have finished reduction in the prior iteration before starting a new one" at the next forward, naming only
parameter indices. Two moments, one kind, two rows of :data:`CAUSES`:

- ``"unreduced"``: at the checked step whose backward DDP did not finish (:func:`unreduced_facts`, asked of
  DDP's own reducer, which takes no collective and no device sync);
- ``"raised"``: DDP's exception at the next forward (:func:`raised_facts`, from its message and the DDP
  module found in the exception's frames), explained with the parameter and module names.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from gradwatch.core.findings import Explanation, Finding

ERROR_TEXT = "Expected to have finished reduction in the prior iteration"
_INDICES = re.compile(r"Parameter indices which did not receive grad for rank (?P<rank>\d+): (?P<indices>[\d ]+)")
_NAMES = re.compile(r"Parameters which did not receive grad for rank (?P<rank>\d+): (?P<names>[^\n]+)")
_SHOWN = 8


@dataclass(frozen=True)
class UnusedFacts:
    """Which parameters of a DDP module got no gradient, and at which moment (a row of :data:`CAUSES`)."""

    cause: str  # "unreduced" (seen at the step) or "raised" (DDP's error at the next forward)
    step: int
    params: tuple[str, ...] = ()
    modules: tuple[str, ...] = ()
    rank: int | None = None


def _module_of(name: str) -> str:
    return name.rpartition(".")[0]


def _facts(cause: str, step: int, names: Iterable[str], rank: int | None = None) -> UnusedFacts:
    params = tuple(names)
    modules = tuple(dict.fromkeys(_module_of(n) for n in params))
    return UnusedFacts(cause, step, params, modules, rank)


def _ddp_names(ddp: Any) -> dict[int, str]:
    """id(parameter) -> its path in the module DDP wraps (the user's own names)."""
    return {id(p): n for n, p in ddp.module.named_parameters()}


def unreduced_facts(ddp: Any, step: int) -> UnusedFacts | None:
    """At a checked step: did ``ddp``'s reducer leave the latest backward unfinished? The parameters named
    are those without a gradient (``zero_grad(set_to_none=True)``, the default; none when the gradients were
    zeroed in place). None when DDP expects unused parameters or finished the reduction."""
    if ddp is None or getattr(ddp, "find_unused_parameters", True) or getattr(ddp, "static_graph", True):
        return None
    check = getattr(ddp, "_check_reducer_finalized", None)
    if check is None:
        return None
    try:
        check()
    except RuntimeError:
        names = _ddp_names(ddp)
        params = getattr(ddp, "_module_parameters", [])
        unused = [names[id(p)] for p in params if p.requires_grad and p.grad is None and id(p) in names]
        return _facts("unreduced", step, unused)
    return None


def raised_facts(exc: BaseException, step: int) -> UnusedFacts | None:
    """DDP's "Expected to have finished reduction" error, with the parameters it lists by index (or by name
    under ``TORCH_DISTRIBUTED_DEBUG=DETAIL``) named; None for any other exception."""
    text = str(exc)
    if ERROR_TEXT not in text:
        return None
    named = _NAMES.search(text)
    if named is not None:
        return _facts("raised", step, [n.strip() for n in named.group("names").split(",")], int(named.group("rank")))
    m = _INDICES.search(text)
    ddp = _ddp_in_traceback(exc)
    if m is None or ddp is None:
        return _facts("raised", step, [], int(m.group("rank")) if m else None)
    names = _ddp_names(ddp)
    params = list(getattr(ddp, "_module_parameters", []))
    unused = [names.get(id(params[int(i)]), f"#{i}") for i in m.group("indices").split() if int(i) < len(params)]
    return _facts("raised", step, unused, int(m.group("rank")))


def _ddp_in_traceback(exc: BaseException) -> Any:
    from torch.nn.parallel import DistributedDataParallel

    tb = exc.__traceback__
    found = None
    while tb is not None:
        candidate = tb.tb_frame.f_locals.get("self")
        if isinstance(candidate, DistributedDataParallel):
            found = candidate
        tb = tb.tb_next
    return found


def _listed(names: tuple[str, ...]) -> str:
    shown = ", ".join(names[:_SHOWN])
    return shown + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")


def _unused_text(facts: UnusedFacts) -> str:
    if not facts.params:
        return "some parameters of the DDP module got no gradient"
    where = f" (module {_listed(facts.modules)})" if any(facts.modules) else ""
    return f"{_listed(facts.params)}{where} got no gradient"


#: cause -> (what, why): the words of each moment. ``{unused}`` names the parameters, ``{step}`` the step.
CAUSES: dict[str, tuple[str, str]] = {
    "unreduced": (
        "DistributedDataParallel did not finish averaging the gradients at step {step}: {unused} in this "
        "backward, and the model is wrapped with find_unused_parameters=False.",
        "DDP all-reduces a bucket of gradients only once every parameter in it has reported; these never did, so "
        "the ranks step on gradients that were not averaged (the replicas drift apart), and DDP raises "
        "\"Expected to have finished reduction in the prior iteration\" at the next forward.",
    ),
    "raised": (
        "DistributedDataParallel refused the forward at step {step} because the previous backward left its "
        "gradient reduction unfinished: {unused} in that backward.",
        "with find_unused_parameters=False, DDP waits for a gradient from every parameter before it averages "
        "their bucket; a branch of the model skipped on that step (a head, a layer behind an if, an output left "
        "out of the loss) never reports.",
    ),
}

FIX = (
    "if {modules} is used on some steps only, pass find_unused_parameters=True to DistributedDataParallel "
    "(or static_graph=True when the same parameters go unused on every step); if it should take part in every "
    "step, find the branch that skipped it or the output left out of the loss; if it is not needed, delete it "
    "or freeze it with requires_grad_(False) before wrapping the model."
)


def unused_finding(facts: UnusedFacts) -> Finding:
    """The finding that words ``facts`` from its row of :data:`CAUSES`."""
    what, why = CAUSES[facts.cause]
    modules = _listed(facts.modules) if any(facts.modules) else "the branch they belong to"
    data: dict[str, Any] = {"cause": facts.cause}
    if facts.rank is not None:
        data["error_rank"] = facts.rank
    return Finding(
        kind="ddp_unused_parameters",
        step=facts.step,
        severity="error",
        params=facts.params,
        module=facts.modules[0] if len(facts.modules) == 1 and facts.modules[0] else None,
        data=data,
        explanation=Explanation(
            what=what.format(step=facts.step, unused=_unused_text(facts)),
            why=why,
            fix=FIX.format(modules=modules),
        ),
    )
