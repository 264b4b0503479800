"""Failure isolation: gradwatch's own failures never reach the training loop.

:func:`internal_warning` reports an exception caught inside gradwatch once per place (as a
:class:`GradWatchInternalWarning`), :func:`safe_warn` warns without letting a warnings filter set to "error"
raise into the loop, :func:`call_each` calls a list of functions so that one failing leaves the others running
(:class:`Fanout`: the same method of several objects),
and :func:`host_rng_kept` puts the user's Python and NumPy random state back around
gradwatch's own work. Every part (observers, checks, diagnosis, reporters) uses these; they import nothing of
gradwatch but :mod:`gradwatch.core.compat`.
"""

from __future__ import annotations

import contextlib
import random
import sys
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from itertools import repeat
from typing import Any

from gradwatch.core.compat import call


class GradWatchInternalWarning(RuntimeWarning):
    """gradwatch's own code failed; training continues and the rest of gradwatch keeps working."""


_warned: set[str] = set()
_warned_by_owner: weakref.WeakKeyDictionary[Any, set[str]] = weakref.WeakKeyDictionary()
_warned_lock = threading.Lock()


def internal_warning(where: str, exc: BaseException, *, owner: Any = None, key: str | None = None) -> None:
    """Warn once per place that gradwatch's own code failed.

    Args:
        where: What failed, named in the message (e.g. ``"ConsoleReporter.finding"``).
        exc: The exception caught.
        owner: Whose failures these are (an engine, a reporter). Each owner reports each place once, so a
            new run in the same process reports its own failures again. ``None``: once per process.
        key: The place; defaults to ``where``. A reporter's methods share one key (its class name), so a
            broken disk or stream is reported once, not once per method.
    """
    place = where if key is None else key
    with _warned_lock:
        seen = _warned
        if owner is not None:
            try:
                seen = _warned_by_owner.setdefault(owner, set())
            except TypeError:  # not weak-referenceable: fall back to once per process
                place = f"{type(owner).__name__}:{place}"
        if place in seen:
            return
        seen.add(place)
    safe_warn(
        f"gradwatch: internal error in {where}: {type(exc).__name__}: {exc}. Training continues; this part "
        "of gradwatch is skipped when it fails (reported once).",
        GradWatchInternalWarning,
        stacklevel=4,
    )


def safe_warn(message: str, category: type[Warning] = UserWarning, stacklevel: int = 3) -> None:
    """``warnings.warn`` that cannot end training: a closed or broken ``sys.stderr`` (a detached terminal, a
    closed pipe) makes Python's warning display raise, and that must not leave ``optimizer.step()``. A
    warning turned into an error by the user's filters (``-W error``) is still raised: that is their choice.
    """
    try:
        warnings.warn(message, category, stacklevel=stacklevel)
    except Warning:
        raise
    except Exception:  # noqa: BLE001, S110 - gradwatch's own output failed: nothing else to tell it with
        pass


def safe_warn_explicit(message: Any, category: type[Warning], filename: str, lineno: int, source: Any = None) -> None:
    """``warnings.warn_explicit`` with the guarantee of :func:`safe_warn`."""
    try:
        warnings.warn_explicit(message, category, filename, lineno, source=source)
    except Warning:
        raise
    except Exception:  # noqa: BLE001, S110 - see safe_warn
        pass


@contextlib.contextmanager
def host_rng_kept() -> Iterator[None]:
    """Put Python's ``random`` (and NumPy's global generator, when NumPy is loaded) back as they were.

    Around gradwatch's own work that may draw from them: importing ``rich.style`` (at the first printed
    finding) draws from ``random``, and a replay of the model's forward draws what the forward draws. A
    training loop that samples with ``random`` (replay buffers, augmentation) would otherwise take other
    samples than the unwatched run from the first finding on."""
    state = random.getstate()
    np = sys.modules.get("numpy")
    np_state = None
    try:
        np_state = np.random.get_state() if np is not None else None
    except Exception:  # noqa: BLE001 - a NumPy without the legacy global generator
        np_state = None
    try:
        yield
    finally:
        random.setstate(state)
        if np_state is not None:
            np.random.set_state(np_state)


def call_each(
    fns: Sequence[Callable[..., Any]],
    args: tuple[Any, ...],
    failed: Callable[[int, Exception], None],
    passes: tuple[type[BaseException], ...] = (),
) -> list[Any]:
    """``[fn(*args) for fn in fns]``, where a function that raises gets None: ``failed(its index, the exception)``
    is called and the next ones still run. Exceptions of a ``passes`` type propagate.

    The usual call runs every function in one C loop (``list.extend`` keeps what it appended before an
    exception, so the length of the result names the function that raised).
    """
    out: list[Any] = []
    try:
        out.extend(map(call, fns, *map(repeat, args)))
    except passes:
        raise
    except Exception as exc:  # noqa: BLE001
        _call_rest(fns, args, failed, passes, out, exc)
    return out


def _call_rest(
    fns: Sequence[Callable[..., Any]],
    args: tuple[Any, ...],
    failed: Callable[[int, Exception], None],
    passes: tuple[type[BaseException], ...],
    out: list[Any],
    exc: Exception,
) -> None:
    """:func:`call_each` after ``fns[len(out)]`` raised ``exc``: report it, then call the ones after it."""
    while True:
        done = len(out) + 1
        failed(done - 1, exc)
        out.append(None)
        try:
            out.extend(map(call, fns[done:], *map(repeat, args)))
            return
        except passes:
            raise
        except Exception as again:  # noqa: BLE001
            exc = again


class Fanout:
    """The objects of ``items`` that define a method, and calls to all of them through :func:`call_each`.

    Each method's bound methods are resolved once (a healthy step calls the same few every time), again when
    ``items`` (a list the owner edits in place) changes length. One that raises is reported once per class
    (``where``: ``Class.method``) and the others still run; exceptions of a ``passes`` type propagate.

    Args:
        items: The objects, in call order.
        owner: Whose internal failures these are; None: each object's own.
        passes: Exception types that go through (an extension's ``GradWatchError``).
    """

    def __init__(self, items: list[Any], owner: Any = None, passes: tuple[type[BaseException], ...] = ()) -> None:
        self.items = items
        self.owner = owner
        self.passes = passes
        self._methods: dict[str, tuple[list[tuple[Any, Any]], list[Any], Callable[[int, Exception], None]]] = {}
        self._resolved_for = 0

    def methods(self, method: str) -> list[tuple[Any, Any]]:
        """``(object, bound method)`` of every object that defines ``method``, in order."""
        return self._resolved(method)[0]

    def call(self, method: str, *args: Any) -> None:
        """``method(*args)`` on every object that defines it."""
        entry = self._methods.get(method) if self._resolved_for == len(self.items) else None
        if entry is None:
            entry = self._resolved(method)
        if entry[1]:
            call_each(entry[1], args, entry[2], self.passes)

    def _resolved(self, method: str) -> tuple[list[tuple[Any, Any]], list[Any], Callable[[int, Exception], None]]:
        if self._resolved_for != len(self.items):
            self._methods = {}
            self._resolved_for = len(self.items)
        entry = self._methods.get(method)
        if entry is None:
            found = [(obj, fn) for obj in self.items if (fn := getattr(obj, method, None)) is not None]

            def failed(i: int, exc: Exception) -> None:
                obj = found[i][0]
                owner = obj if self.owner is None else self.owner
                internal_warning(f"{type(obj).__name__}.{method}", exc, owner=owner, key=type(obj).__name__)

            entry = self._methods[method] = (found, [fn for _obj, fn in found], failed)
        return entry
