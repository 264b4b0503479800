"""``not_in_optimizer``: trainable model parameters no watched optimizer updates.

Also reports parameters an optimizer holds that the model does not own (``foreign_params``).
Checked at the first step and whenever the model's or optimizer's set of parameters changes.
"""

from __future__ import annotations

import torch

from gradwatch.core.config import Config
from gradwatch.core.findings import Finding, names_text
from gradwatch.core.history import History
from gradwatch.core.stats import StepStats


def check(stats: StepStats, history: History, config: Config) -> list[Finding]:
    out: list[Finding] = []
    unregistered = stats.extra.get("unregistered") or []
    names = tuple(n for n, _ in unregistered)
    if names and not set(names) <= set(history.reported.get("unregistered", ())):
        out.append(_unregistered(stats, unregistered))
    if not (stats.first_check or stats.params_changed):
        return out
    # Parameters the optimizer holds that the model no longer owns and that got no gradient: next to model
    # parameters no optimizer holds, a layer replaced after the optimizer was built. One finding says both.
    stale = tuple(n for n in stats.foreign if n in set(stats.none_grad))
    elsewhere = built_for_another_model(stats)  # one foreign_params finding says it all
    if optimizes_inputs(stats):
        return out  # adversarial examples, style transfer: the model is the fixed function, not trained
    replaced = bool(stats.not_in_optimizer) and bool(stale) and not elsewhere
    if (
        stats.not_in_optimizer
        and not elsewhere
        and history.reported.get("not_in_optimizer") != stats.not_in_optimizer
    ):
        modules = sorted({n.rsplit(".", 1)[0] if "." in n else "<root>" for n in stats.not_in_optimizer})
        instead = (
            f"Optimizer {stats.optimizer_index} holds {len(stale)} parameter(s) the model no longer owns instead "
            f"({names_text(stale)}): the layer was replaced after the optimizer was built (a new head for "
            "fine-tuning), so the optimizer updates the old one, which no longer runs.\n"
            if replaced
            else ""
        )
        out.append(
            Finding(
                kind="not_in_optimizer",
                step=stats.step,
                severity="warning",
                message=(
                    f"{len(stats.not_in_optimizer)} trainable parameter(s) of the model are in no watched "
                    f"optimizer: {names_text(stats.not_in_optimizer)}.\n" + instead +
                    "Why it matters: they get gradients but are never updated, so those layers stay at "
                    "their initial values (a classic after swapping a head or building layers lazily "
                    "after the optimizer).\n"
                    "Fix: create the optimizer after the model is complete (after the first forward for "
                    "lazy layers), or add them with optimizer.add_param_group({'params': [...]}) (also "
                    "when unfreezing layers the optimizer was built without); if they "
                    "should not train, call requires_grad_(False) on them; if another optimizer updates "
                    "them, watch it too: gradwatch.watch(model, [opt_a, opt_b])."
                ),
                params=stats.not_in_optimizer,
                module=modules[0] if len(modules) == 1 else None,
                data={"modules": modules, "count": len(stats.not_in_optimizer)},
            )
        )
    if replaced:
        shown: tuple[str, ...] = ()
    elif (
        stats.foreign
        and history.reported.get(f"foreign/{stats.optimizer_index}") != stats.foreign
        and not history.reported.get(f"foreign_reported/{stats.optimizer_index}")  # once per optimizer
    ):
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
        shown = stats.foreign if all_foreign else unused
    else:
        shown = ()
    if shown:
        stats.extra[_FOREIGN_SHOWN] = True  # a note for remember: reported once per optimizer
        out.append(
            Finding(
                kind="foreign_params",
                step=stats.step,
                severity="warning",
                message=(
                    f"Optimizer {stats.optimizer_index} holds {len(shown)} parameter(s) that the "
                    f"watched model does not own{'' if all_foreign else ' and that got no gradient'}: "
                    f"{names_text(shown)}.\n" + _untrained(stats, elsewhere) +
                    "Why it matters: usually the optimizer was built for another model (or a copy of this "
                    "one, e.g. before deepcopy or .to() with new parameters), so this model never trains.\n"
                    "Fix: build the optimizer from this model's parameters: optim.AdamW(model.parameters()). "
                    "(With torch.func.functional_call(model, params, x) and the optimizer over `params`, the "
                    "module is only a template and this is expected: build it on the meta device, "
                    "model.to('meta'), and gradwatch stays quiet.)"
                ),
                params=shown,
                data={
                    "count": len(shown),
                    "optimizer": stats.optimizer_index,
                    "all_foreign": all_foreign,
                    "another_model": elsewhere,
                    "model_params_not_in_optimizer": len(stats.not_in_optimizer),
                },
            )
        )
    return out


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


def _untrained(stats: StepStats, elsewhere: bool) -> str:
    if not elsewhere:
        return ""
    return (
        f"It holds none of the model's parameters, so the model's {len(stats.not_in_optimizer)} trainable "
        f"parameter(s) ({names_text(stats.not_in_optimizer)}) get gradients but are never updated, and "
        "optimizer.step() updates nothing: none of the tensors it holds got a gradient from this loss.\n"
    )


def _unregistered(stats: StepStats, unregistered: list[tuple[str, str]]) -> Finding:
    names = tuple(n for n, _ in unregistered)
    containers = sorted({n.split("[", 1)[0] for n, how in unregistered if how == "container"})
    tensors = [n for n, how in unregistered if how == "tensor"]
    built = [n for n, how in unregistered if how == "forward"]
    what: list[str] = []
    fixes: list[str] = []
    if built:
        what.append(
            "parameters of a layer built inside forward(), new at every call (`nn.Linear(16, 1)(h)` in forward "
            "creates a freshly initialized layer each time: it never learns, and its random weights change "
            "the output at every step)"
        )
        fixes.append(
            "create the layer once in __init__ (`self.head = nn.Linear(16, 1)`) and call `self.head(h)` in forward"
        )
    if containers:
        what.append(f"modules kept in a plain Python list or dict ({', '.join(containers)})")
        fixes.append("hold the modules in nn.ModuleList([...]) / nn.ModuleDict({...}) instead of a list or dict")
    if tensors:
        what.append(f"tensors with requires_grad=True that are not nn.Parameter ({', '.join(tensors)})")
        fixes.append("wrap the tensors in nn.Parameter(...) when assigning them to the module")
    return Finding(
        kind="not_in_optimizer",
        step=stats.step,
        severity="warning",
        message=(
            f"{len(names)} tensor(s) the model trains through are not registered with it, so no optimizer "
            f"updates them: {names_text(names)}; {' and '.join(what)}.\n"
            "Why it matters: they get gradients at every step but never change: model.parameters() (and so "
            "the optimizer), model.state_dict() (checkpoints), model.to(device) and DDP all skip them.\n"
            f"Fix: {'; '.join(fixes)}, then build the optimizer from model.parameters()."
        ),
        params=names,
        data={"unregistered": True, "count": len(names), "containers": containers, "tensors": tensors},
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
