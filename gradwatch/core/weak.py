"""Callbacks that hold their target weakly: a process-wide hook must not keep a run's objects alive."""

from __future__ import annotations

import weakref
from typing import Any


def weak_method(obj: Any, name: str) -> Any:
    """A function calling ``obj.<name>(...)`` while ``obj`` lives, and doing nothing after."""
    ref = weakref.ref(obj)

    def call(*args: Any, **kwargs: Any) -> Any:
        target = ref()
        return getattr(target, name)(*args, **kwargs) if target is not None else None

    return call
