"""Who is who: qualified names of parameters and modules, and which optimizer holds which parameter.

Built once at attach time and rebuilt only when the model's set of parameters changes (a head swapped
in, a parameter re-registered), which global registration hooks tell us without a per-step scan.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
from torch import nn

_REQUIRES_GRAD = operator.attrgetter("requires_grad")


@dataclass
class OptimizerParams:
    """The parameters one optimizer updates, in the optimizer's order, with their names."""

    index: int
    optimizer: torch.optim.Optimizer | None
    params: list[torch.Tensor]
    names: list[str]
    #: Module (qualified name) owning each parameter, "" for the root, None if the model does not own it.
    modules: list[str | None]
    #: Names of parameters this optimizer holds that the model does not own.
    foreign: list[str] = field(default_factory=list)


#: Attributes that wrappers put between the user's modules (torch.compile, FSDP1, activation
#: checkpointing, Lightning Fabric's ``fabric.setup(model)``); findings name the user's own module paths without them.
_WRAPPER_SEGMENTS = frozenset(
    {"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_forward_module", "_original_module"}
)
#: Wrappers that hold the user's model as ``.module``.
_MODULE_WRAPPERS = ("DistributedDataParallel", "DataParallel")


def user_path(qualified: str, module_wrappers: frozenset[str] = frozenset()) -> str:
    """A module or parameter path as the user wrote it: wrapper segments removed.

    ``torch.compile`` adds ``_orig_mod``, FSDP1 ``_fsdp_wrapped_module``; DDP and DataParallel add
    ``module``, which is dropped only right after a path listed in ``module_wrappers`` (the raw paths
    of the DDP/DataParallel wrappers; ``""`` for the root), so a user's own ``module`` attribute stays.

    Example:
        >>> user_path("module._orig_mod.encoder.0.weight", frozenset({""}))
        'encoder.0.weight'
    """
    if "_" not in qualified and not module_wrappers:
        return qualified
    out: list[str] = []
    raw = ""
    for part in qualified.split("."):
        wrapper_attr = part in _WRAPPER_SEGMENTS or (part == "module" and raw in module_wrappers)
        raw = f"{raw}.{part}" if raw else part
        if not wrapper_attr:
            out.append(part)
    return ".".join(out)


def user_module(model: nn.Module | None) -> nn.Module | None:
    """The user's own module behind Lightning Fabric's wrapper, else ``model`` itself.

    ``fabric.setup(model)`` returns a ``_FabricModule``. Fabric runs ``training_step`` (and methods marked with
    ``mark_forward_method``) on the module it wraps, or through the strategy's wrapper (DDP) and its
    ``forward``, never through the wrapper's own ``__call__``: hooks that must see every forward of the model
    (inputs, outputs, tracing, the replay) go on the user's module, as if it had been watched before
    ``fabric.setup``. Recognized by name (no import of Lightning).
    """
    if model is None or not any(c.__name__ == "_FabricModule" for c in type(model).__mro__):
        return model
    inner = model._modules.get("_original_module")
    return inner if isinstance(inner, nn.Module) else model


def fabric_redirect(module: nn.Module) -> bool:
    """This call of ``module`` is Fabric's way into ``training_step`` (or a marked method) through a strategy
    wrapper: Fabric patches ``module.forward`` to run that method and calls the wrapper (DDP), which calls
    ``module``. Not a forward of the model: the ``self(x)`` inside it is. O(1)."""
    fwd = module.__dict__.get("forward")
    return fwd is not None and "_redirection_through_forward" in getattr(fwd, "__qualname__", "")


def _owner(module: str) -> str:
    """The layer a parameter belongs to: a parametrized weight (``spectral_norm``, ``weight_norm``,
    ``orthogonal`` of ``torch.nn.utils.parametrizations``) lives in ``<layer>.parametrizations.weight``,
    but it is ``<layer>``'s weight (its bias is there too: a layer, not two)."""
    if module == "parametrizations" or module.startswith("parametrizations."):
        return ""
    head, sep, _rest = module.partition(".parametrizations.")
    if sep:
        return head
    return module.removesuffix(".parametrizations")


def module_wrappers(model: nn.Module) -> frozenset[str]:
    return frozenset(
        name
        for name, m in model.named_modules(remove_duplicate=False)
        if any(c.__name__ in _MODULE_WRAPPERS for c in type(m).__mro__)
    )


class ParamIndex:
    """Names for every parameter of ``model`` and the watched optimizers.

    Tied weights (one tensor registered in two modules) are named once, by their first owner.
    """

    def __init__(self, model: nn.Module | None, optimizers: list[torch.optim.Optimizer]) -> None:
        self.model = model
        self.optimizers = optimizers
        #: Names of the tensors the model has owned since the run began, also after it replaced them.
        self.former_name: dict[int, str] = {}
        self.rebuild()

    def rebuild(self) -> None:
        #: Layers that are lookup tables (``nn.Embedding``/``EmbeddingBag``): a batch reaches only its rows.
        self.lookup_layers: frozenset[str] = frozenset()
        self.param_name: dict[int, str] = {}
        self.param_module: dict[int, str] = {}
        self.module_name: dict[int, str] = {}
        self.model_params: list[tuple[str, torch.Tensor]] = []
        if self.model is not None:
            self._index_model(self.model)
        self.per_optimizer = [self._optimizer_params(i, o) for i, o in enumerate(self.optimizers)]
        if not self.optimizers:
            self.per_optimizer = [self._hand_written_updates()]
        self.held_ids = held = {id(p) for op in self.per_optimizer for p in op.params}
        self._index_holdings(held)
        # Keep the parameter objects alive only as long as the model/optimizer do: ids above are only
        # looked up for tensors we also hold strongly here, so an id cannot be reused while indexed.
        self._alive = [p for _, p in self.model_params]
        self._members: dict[str, tuple[str, str]] | None = None

    def _index_model(self, model: nn.Module) -> None:
        """Names of the model's modules and parameters (as the user wrote them: wrappers dropped), and its
        lookup-table layers."""
        wrappers = module_wrappers(model)
        lookups = []
        for mname, module in model.named_modules(remove_duplicate=False):
            self.module_name.setdefault(id(module), user_path(mname, wrappers))
            if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
                lookups.append(user_path(mname, wrappers) or "<root>")
        self.lookup_layers = frozenset(lookups)
        for mname, module in model.named_modules():
            mname = user_path(mname, wrappers)
            for pname, p in module.named_parameters(recurse=False):
                if id(p) in self.param_name:
                    continue
                qual = f"{mname}.{pname}" if mname else pname
                self.param_name[id(p)] = qual
                self.param_module[id(p)] = _owner(mname)
                self.model_params.append((qual, p))

    def _hand_written_updates(self) -> OptimizerParams:
        """Without an optimizer (hand-written updates): every trainable parameter of the model is "the optimizer's"."""
        trainable = [(n, p) for n, p in self.model_params if p.requires_grad]
        return OptimizerParams(
            0, None, [p for _, p in trainable], [n for n, _ in trainable], [self.param_module[id(p)] for _, p in trainable]
        )

    def _index_holdings(self, held: set[int]) -> None:
        """What the optimizers hold and what they miss, from the ids of the tensors they hold."""
        # Kept for the optimizers' tensors only (at most as many as they hold).
        self.former_name = {k: v for k, v in self.former_name.items() if k in held}
        for n, p in self.model_params:
            if id(p) in held:
                self.former_name.setdefault(id(p), n)
        # Meta-device parameters hold no values and are never trained (a template for torch.func's
        # functional_call / stack_module_state, whose real parameters the optimizer holds).
        self.not_in_optimizer: tuple[str, ...] = tuple(
            n for n, p in self.model_params if p.requires_grad and id(p) not in held and not p.is_meta
        )
        # Model parameters no optimizer holds: if one of them becomes trainable later (a backbone
        # unfrozen after warm-up), ``not_in_optimizer`` must be re-checked. Counting requires_grad over
        # this list is the only per-step cost, and the list is empty when the optimizer holds everything.
        self.unheld: list[torch.Tensor] = [p for _, p in self.model_params if id(p) not in held and not p.is_meta]
        self.unheld_trainable = len(self.not_in_optimizer)
        #: Whether the model has any trainable parameter (else its optimizers train inputs: style transfer).
        self.model_trainable = any(p.requires_grad and not p.is_meta for _, p in self.model_params)

    def _optimizer_params(self, index: int, optimizer: torch.optim.Optimizer) -> OptimizerParams:
        params: list[torch.Tensor] = []
        names: list[str] = []
        modules: list[str | None] = []
        foreign: list[str] = []
        seen: set[int] = set()
        for gi, group in enumerate(optimizer.param_groups):
            for pi, p in enumerate(group["params"]):
                if id(p) in seen:
                    continue
                seen.add(id(p))
                params.append(p)
                name = self.param_name.get(id(p))
                if name is None:
                    shape = "uninitialized" if nn.parameter.is_lazy(p) else tuple(p.shape)
                    former = self.former_name.get(id(p))
                    name = (
                        f"<{former}, replaced in the model>" if former is not None
                        else f"<optimizer {index} group {gi} param {pi} {shape}>"
                    )
                    if self.model is not None:
                        foreign.append(name)
                    modules.append(None)
                else:
                    modules.append(self.param_module[id(p)])
                names.append(name)
        return OptimizerParams(index, optimizer, params, names, modules, foreign)

    def member_of(self, name: str) -> tuple[str, str] | None:
        """``(container, key)`` when parameter ``name`` lives in an element of an ``nn.ModuleList`` or
        ``nn.ModuleDict`` (experts, LayerDrop layers, per-task heads), innermost container first; else None.
        Built on first use (a walk of the model's modules)."""
        if self._members is None:
            members: dict[str, tuple[str, str]] = {}
            if self.model is not None:
                wrappers = module_wrappers(self.model)
                for cname, container in self.model.named_modules():
                    if not isinstance(container, (nn.ModuleList, nn.ModuleDict)):
                        continue
                    cpath = user_path(cname, wrappers)
                    for key, child in container.named_children():
                        for p in child.parameters():
                            qual = self.param_name.get(id(p))
                            if qual is not None:
                                members[qual] = (cpath, key)  # later (inner) containers overwrite outer ones
            self._members = members
        return self._members.get(name)

    def unregistered(self) -> list[tuple[str, torch.Tensor, str]]:
        """Trainable tensors the model uses but does not register: ``(name, tensor, how)`` with ``how``
        ``"tensor"`` (a leaf tensor with ``requires_grad=True`` kept as a plain attribute, not an
        ``nn.Parameter``) or ``"container"`` (a parameter of a module kept in a Python list, tuple or dict
        instead of ``nn.ModuleList``/``nn.ModuleDict``). Only trainable ones that hold a gradient and that no
        watched optimizer holds (the engine also asks for that gradient to move between two checks: a frozen
        teacher's stale one does not). A scan of every module's attributes: first checks only.
        """
        if self.model is None:
            return []
        known = set(self.param_name)
        held = self.held_ids
        wrappers = module_wrappers(self.model)
        out: list[tuple[str, torch.Tensor, str]] = []
        seen: set[int] = set()

        def keep(name: str, t: torch.Tensor, how: str) -> None:
            if id(t) in known or id(t) in held or id(t) in seen or t.grad is None or not t.requires_grad:
                return
            seen.add(id(t))
            out.append((name, t, how))

        for mname, module in self.model.named_modules():
            prefix = user_path(mname, wrappers)
            prefix = f"{prefix}." if prefix else ""
            for attr, value in vars(module).items():
                if attr.startswith("__") or attr in ("_parameters", "_buffers", "_modules"):
                    continue
                if isinstance(value, torch.Tensor):
                    if value.requires_grad and value.is_leaf and not isinstance(value, nn.Parameter):
                        keep(f"{prefix}{attr}", value, "tensor")
                    continue
                if isinstance(value, (list, tuple)):
                    items = [(f"[{i}]", v) for i, v in enumerate(value[:256])]
                elif isinstance(value, dict):
                    items = [(f"[{k!r}]", v) for k, v in list(value.items())[:256]]
                else:
                    continue
                for key, sub in items:
                    if isinstance(sub, nn.Module) and id(sub) not in self.module_name:
                        for pname, p in sub.named_parameters():
                            keep(f"{prefix}{attr}{key}.{pname}", p, "container")
        return out

    def unheld_trainable_changed(self) -> bool:
        """Whether the number of trainable parameters outside every optimizer changed (cheap)."""
        if not self.unheld:
            return False
        return sum(map(_REQUIRES_GRAD, self.unheld)) != self.unheld_trainable

    def name_of(self, p: torch.Tensor) -> str | None:
        return self.param_name.get(id(p))

    def module_of(self, m: nn.Module) -> str | None:
        return self.module_name.get(id(m))
