"""Hooks on the user's modules that copies of the module do not carry.

``copy.deepcopy(model)`` and ``torch.save(model)`` inside a training loop (an EMA or teacher copy, a snapshot)
reduce the module with its hook dictionaries. gradwatch's forward hooks are bound to objects that hold autograd
nodes, the engine and weak references: the copy would fail (``cannot pickle 'AddmmBackward0'``), or drag the
whole engine along and run its hooks. Every hook gradwatch puts on a module goes through :func:`owned`, which
marks the module: while it holds gradwatch hooks, its reduction (``pickle``, ``torch.save``, ``copy.copy`` and
``copy.deepcopy`` all ask ``module.__reduce_ex__``) leaves them out, so the copy is the module as it would be
without gradwatch. The mark is removed with the module's last gradwatch hook. Instance attributes gradwatch
sets for a while (:func:`patched`: the inert ``log``/``optimizers`` of a localization replay of ``training_step``)
are left out the same way.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

from torch import nn

#: Where ``nn.Module`` keeps its own hooks, keyed by the handle's id.
_HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_backward_pre_hooks",
    "_backward_hooks",
)
_MARK = "__reduce_ex__"  # looked up on the instance first by pickle and copy
_ABSENT = object()


class _Reduction:
    """The module's ``__reduce_ex__`` while gradwatch has hooks on it: the usual reduction, without them."""

    __slots__ = ("__weakref__", "attrs", "ids", "module")

    def __init__(self, module: nn.Module) -> None:
        self.module = weakref.ref(module)
        self.ids: set[int] = set()
        self.attrs: dict[str, Any] = {}  # instance attributes gradwatch set -> what was there (or _ABSENT)

    def __call__(self, protocol: int) -> Any:
        module = self.module()
        if module is None:  # the mark outlived its module (a shallow clone of its __dict__)
            raise TypeError("cannot reduce a module whose gradwatch mark outlived it")
        reduced = type(module).__reduce_ex__(module, protocol)
        if not isinstance(reduced, tuple) or len(reduced) < 3 or not isinstance(reduced[2], dict):
            return reduced  # a module with its own reduction: left as it is
        return (*reduced[:2], _without(reduced[2], self.ids, self.attrs), *reduced[3:])

    def release(self, module: nn.Module) -> None:
        if not self.ids and not self.attrs and module.__dict__.get(_MARK) is self:
            del module.__dict__[_MARK]


def _without(state: dict[str, Any], ids: set[int], attrs: dict[str, Any]) -> dict[str, Any]:
    state = dict(state)
    if isinstance(state.get(_MARK), _Reduction):
        del state[_MARK]
    for name, before in attrs.items():
        if before is _ABSENT:
            state.pop(name, None)
        else:
            state[name] = before
    for name in _HOOK_DICTS:
        hooks = state.get(name)
        if isinstance(hooks, dict) and not ids.isdisjoint(hooks):
            state[name] = OrderedDict((k, v) for k, v in hooks.items() if k not in ids)
    return state


class OwnedHandle:
    """A hook handle whose ``remove()`` also takes the hook off the module's mark."""

    __slots__ = ("handle", "module", "reduction")

    def __init__(self, handle: Any, module: nn.Module, reduction: _Reduction) -> None:
        self.handle = handle
        self.module = weakref.ref(module)
        self.reduction = reduction

    @property
    def id(self) -> int:
        return int(self.handle.id)

    def remove(self) -> None:
        self.handle.remove()
        reduction = self.reduction
        reduction.ids.discard(self.handle.id)
        module = self.module()
        if module is not None:
            reduction.release(module)


def _mark(module: nn.Module) -> _Reduction:
    reduction = module.__dict__.get(_MARK)
    if not isinstance(reduction, _Reduction):
        reduction = _Reduction(module)
        module.__dict__[_MARK] = reduction  # not through Module.__setattr__: no attribute of the model
    return reduction


def owned(module: nn.Module, handle: Any) -> OwnedHandle:
    """Mark ``handle`` (just returned by one of ``module``'s ``register_*_hook``) as gradwatch's: copies and
    pickles of the module leave it out. Returns a handle that removes the hook and the mark."""
    reduction = _mark(module)
    reduction.ids.add(handle.id)
    return OwnedHandle(handle, module, reduction)


@contextlib.contextmanager
def patched(module: nn.Module, attributes: dict[str, Any]) -> Iterator[None]:
    """Set instance attributes of ``module`` (bypassing ``Module.__setattr__``) for the ``with`` block, then
    put back what was there. Copies and pickles of the module taken meanwhile hold what was there."""
    reduction = _mark(module)
    before = {name: module.__dict__.get(name, _ABSENT) for name in attributes}
    reduction.attrs.update(before)
    try:
        module.__dict__.update(attributes)
        yield
    finally:
        for name, value in before.items():
            if value is _ABSENT:
                module.__dict__.pop(name, None)
            else:
                module.__dict__[name] = value
            reduction.attrs.pop(name, None)
        reduction.release(module)


__all__ = ["OwnedHandle", "owned", "patched"]
