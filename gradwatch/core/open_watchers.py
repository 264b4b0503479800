"""The watchers not closed yet, held weakly: read by the explainers of uncaught autograd errors.

One small module so that the explainers can see every open watcher without importing the plain-loop way in
(which imports the engine, which imports the explainers).
"""

from __future__ import annotations

import weakref
from typing import Any

_OPEN: weakref.WeakSet[Any] = weakref.WeakSet()


def register(watcher: Any) -> None:
    """Hold ``watcher`` (weakly) until it is garbage: its ``closed`` flag says whether it still watches."""
    _OPEN.add(watcher)


def open_watchers() -> list[Any]:
    """Every registered watcher still alive (closed ones too: an inner ``with`` block exits first)."""
    return list(_OPEN)


__all__ = ["open_watchers", "register"]
