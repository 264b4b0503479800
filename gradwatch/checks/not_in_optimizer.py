"""``not_in_optimizer``: trainable model parameters no watched optimizer updates.

Also reports parameters an optimizer holds that the model does not own (``foreign_params``).
Checked at the first step and whenever the model's or optimizer's set of parameters changes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from gradwatch.core.config import Config
from gradwatch.core.findings import Explanation, Finding, names_text
from gradwatch.core.history import History
from gradwatch.core.stats import StepStats

#: Runs only on steps where one of these facts holds (see :data:`gradwatch.checks.FACTS`).
WHEN = ('params_changed',)


@dataclass(frozen=True)
class CoverageFacts:
    """Which parameters the model trains and the optimizer does not update, or the other way round."""

    #: Parameters the optimizer holds that the model no longer owns and that got no gradient.
    stale: tuple[str, ...]
    #: The optimizer was built for another model (one foreign_params finding says it all).
    elsewhere: bool
    #: A layer replaced after the optimizer was built: model parameters in no optimizer, next to stale ones.
    replaced: bool
    #: The optimizer's parameters to report as foreign, and whether it holds only foreign ones.
    shown: tuple[str, ...]
    all_foreign: bool


def coverage_facts(stats: StepStats, history: History) -> CoverageFacts:
    # Parameters the optimizer holds that the model no longer owns and that got no gradient: next to model
    # parameters no optimizer holds, a layer replaced after the optimizer was built. One finding says both.
    stale = tuple(n for n in stats.foreign if n in set(stats.none_grad))
    elsewhere = built_for_another_model(stats)
    replaced = bool(stats.not_in_optimizer) and bool(stale) and not elsewhere
    shown, all_foreign = ((), False) if replaced else _foreign_to_show(stats, history)
    return CoverageFacts(stale, elsewhere, replaced, shown, all_foreign)


def _foreign_to_show(stats: StepStats, history: History) -> tuple[tuple[str, ...], bool]:
    """The foreign parameters to report (once per optimizer, when they changed), and whether the optimizer
    holds nothing else."""
    i = stats.optimizer_index
    if not stats.foreign or history.reported.get(f"foreign/{i}") == stats.foreign:
        return (), False
    if history.reported.get(f"foreign_reported/{i}"):  # once per optimizer
        return (), False
    # Parameters of the loss trained with the model (CenterLoss centers, a learned temperature) are
    # foreign but get gradients next to the model's own: not a mistake. Report the optimizer that holds
    # none of the model's parameters, or foreign ones that got no gradient (another model's).
    foreign = set(stats.foreign)
    held = [*stats.names, *stats.none_grad]
    all_foreign = bool(held) and all(n in foreign for n in held)
    # A tensor the model itself replaced (an attribute re-assigned in forward: an EMA codebook's
    # ``self.w = nn.Parameter(...)``) is the optimizer's stale copy: a head swapped in for training is
    # reported by not_in_optimizer, not here.
    unused = tuple(
        n for n in stats.foreign if n in set(stats.none_grad) and not n.endswith(", replaced in the model>")
    )
    return (stats.foreign if all_foreign else unused), all_foreign


def report_missing(stats: StepStats, history: History, facts: CoverageFacts) -> bool:
    """Report model parameters in no optimizer: not when the optimizer was built for another model
    (foreign_params says it), and once per set of them."""
    return (
        bool(stats.not_in_optimizer)
        and not facts.elsewhere
        and history.reported.get("not_in_optimizer") != stats.not_in_optimizer
    )


def check(stats: StepStats, history: History, config: Config) -> list[Finding]:
    out: list[Finding] = []
    unregistered = stats.extra.get("unregistered") or []
    names = tuple(n for n, _ in unregistered)
    if names and not set(names) <= set(history.reported.get("unregistered", ())):
        out.append(_unregistered(stats, unregistered))
    if not (stats.first_check or stats.params_changed):
        return out
    if optimizes_inputs(stats):
        return out  # adversarial examples, style transfer: the model is the fixed function, not trained
    facts = coverage_facts(stats, history)
    if report_missing(stats, history, facts):
        out.append(_missing(stats, facts))
    if facts.shown:
        stats.extra[_FOREIGN_SHOWN] = True  # a note for remember: reported once per optimizer
        out.append(_foreign(stats, facts))
    return out


def _missing(stats: StepStats, facts: CoverageFacts) -> Finding:
    modules = sorted({n.rsplit(".", 1)[0] if "." in n else "<root>" for n in stats.not_in_optimizer})
    what = (
        f"{len(stats.not_in_optimizer)} trainable parameter(s) of the model are in no watched "
        f"optimizer: {names_text(stats.not_in_optimizer)}."
    )
    if facts.replaced:
        what += (
            f"\nOptimizer {stats.optimizer_index} holds {len(facts.stale)} parameter(s) the model no longer owns "
            f"instead ({names_text(facts.stale)}): the layer was replaced after the optimizer was built (a new head "
            "for fine-tuning), so the optimizer updates the old one, which no longer runs."
        )
    return Finding(
        kind="not_in_optimizer",
        step=stats.step,
        severity="warning",
        explanation=Explanation(
            what=what,
            why="they get gradients but are never updated, so those layers stay at "
            "their initial values (a classic after swapping a head or building layers lazily "
            "after the optimizer).",
            fix="create the optimizer after the model is complete (after the first forward for "
            "lazy layers), or add them with optimizer.add_param_group({'params': [...]}) (also "
            "when unfreezing layers the optimizer was built without); if they "
            "should not train, call requires_grad_(False) on them; if another optimizer updates "
            "them, watch it too: gradwatch.watch(model, [opt_a, opt_b]).",
        ),
        params=stats.not_in_optimizer,
        module=modules[0] if len(modules) == 1 else None,
        data={"modules": modules, "count": len(stats.not_in_optimizer)},
    )


def _foreign(stats: StepStats, facts: CoverageFacts) -> Finding:
    shown = facts.shown
    what = (
        f"Optimizer {stats.optimizer_index} holds {len(shown)} parameter(s) that the "
        f"watched model does not own{'' if facts.all_foreign else ' and that got no gradient'}: "
        f"{names_text(shown)}."
    )
    if facts.elsewhere:
        what += "\n" + _untrained(stats)
    return Finding(
        kind="foreign_params",
        step=stats.step,
        severity="warning",
        explanation=Explanation(
            what=what,
            why="usually the optimizer was built for another model (or a copy of this "
            "one, e.g. before deepcopy or .to() with new parameters), so this model never trains.",
            fix="build the optimizer from this model's parameters: optim.AdamW(model.parameters()). "
            "(With torch.func.functional_call(model, params, x) and the optimizer over `params`, the "
            "module is only a template and this is expected: build it on the meta device, "
            "model.to('meta'), and gradwatch stays quiet.)",
        ),
        params=shown,
        data={
            "count": len(shown),
            "optimizer": stats.optimizer_index,
            "all_foreign": facts.all_foreign,
            "another_model": facts.elsewhere,
            "model_params_not_in_optimizer": len(stats.not_in_optimizer),
        },
    )


_FOREIGN_SHOWN = "foreign_params/shown"


def built_for_another_model(stats: StepStats) -> bool:
    """The optimizer holds none of the model's parameters, only tensors the model does not own that got no
    gradient from the step's backward: it was built for another model (or a copy of this one).

    An optimizer over the model's parameters plus extra tensors (a learned temperature, a second model
    trained jointly) holds some of the model's; one over inputs (style transfer, adversarial examples)
    gives them gradients; a model with nothing trainable has no foreign parameters at all."""
    held_without_grad = set(stats.none_grad)
    return bool(held_without_grad) and not stats.names and held_without_grad <= set(stats.foreign)


def optimizes_inputs(stats: StepStats) -> bool:
    """The optimizer trains inputs, not a model: every tensor it holds is a plain tensor (no
    ``nn.Parameter``) the model does not own, and every one got a gradient (an adversarial perturbation, a
    style-transfer image), while the model may still have ``requires_grad=True`` (``model.eval()`` only)."""
    held = stats.extra.get("params") or []
    return (
        bool(held)
        and not stats.none_grad
        and set(stats.names) <= set(stats.foreign)
        and not any(isinstance(p, torch.nn.Parameter) for p in held)
    )


def _untrained(stats: StepStats) -> str:
    return (
        f"It holds none of the model's parameters, so the model's {len(stats.not_in_optimizer)} trainable "
        f"parameter(s) ({names_text(stats.not_in_optimizer)}) get gradients but are never updated, and "
        "optimizer.step() updates nothing: none of the tensors it holds got a gradient from this loss."
    )


def _built_words(names: list[str]) -> tuple[str, str]:
    what = (
        "parameters of a layer built inside forward(), new at every call (`nn.Linear(16, 1)(h)` in forward "
        "creates a freshly initialized layer each time: it never learns, and its random weights change "
        "the output at every step)"
    )
    return what, "create the layer once in __init__ (`self.head = nn.Linear(16, 1)`) and call `self.head(h)` in forward"


def _container_words(names: list[str]) -> tuple[str, str]:
    containers = sorted({n.split("[", 1)[0] for n in names})
    return (
        f"modules kept in a plain Python list or dict ({', '.join(containers)})",
        "hold the modules in nn.ModuleList([...]) / nn.ModuleDict({...}) instead of a list or dict",
    )


def _tensor_words(names: list[str]) -> tuple[str, str]:
    return (
        f"tensors with requires_grad=True that are not nn.Parameter ({', '.join(names)})",
        "wrap the tensors in nn.Parameter(...) when assigning them to the module",
    )


#: What went wrong and its fix, by how a tensor escaped registration (in the order they are said).
_UNREGISTERED_WORDS: dict[str, Callable[[list[str]], tuple[str, str]]] = {
    "forward": _built_words,
    "container": _container_words,
    "tensor": _tensor_words,
}


def _unregistered(stats: StepStats, unregistered: list[tuple[str, str]]) -> Finding:
    names = tuple(n for n, _ in unregistered)
    by_how: dict[str, list[str]] = {how: [] for how in _UNREGISTERED_WORDS}
    for n, how in unregistered:
        if how in by_how:
            by_how[how].append(n)
    words = [_UNREGISTERED_WORDS[how](found) for how, found in by_how.items() if found]
    return Finding(
        kind="not_in_optimizer",
        step=stats.step,
        severity="warning",
        explanation=Explanation(
            what=f"{len(names)} tensor(s) the model trains through are not registered with it, so no optimizer "
            f"updates them: {names_text(names)}; {' and '.join(what for what, _ in words)}.",
            why="they get gradients at every step but never change: model.parameters() (and so "
            "the optimizer), model.state_dict() (checkpoints), model.to(device) and DDP all skip them.",
            fix=f"{'; '.join(fix for _, fix in words)}, then build the optimizer from model.parameters().",
        ),
        params=names,
        data={
            "unregistered": True,
            "count": len(names),
            "containers": sorted({n.split("[", 1)[0] for n in by_how["container"]}),
            "tensors": by_how["tensor"],
        },
    )


def remember(stats: StepStats, history: History) -> None:
    unregistered = stats.extra.get("unregistered")
    if unregistered:
        history.reported["unregistered"] = sorted({*history.reported.get("unregistered", ()),
                                                   *(n for n, _ in unregistered)})
    if stats.first_check or stats.params_changed:
        history.reported["not_in_optimizer"] = stats.not_in_optimizer
        history.reported[f"foreign/{stats.optimizer_index}"] = stats.foreign
        if stats.extra.get(_FOREIGN_SHOWN):
            history.reported[f"foreign_reported/{stats.optimizer_index}"] = True
