"""Report: thin writers of findings and step scalars (console, TensorBoard, JSON lines).

Every reporter call goes through :class:`Reporters`, which isolates failures: an exception inside one
reporter (a full disk, a closed stdout, a broken writer) is reported once as a
:class:`GradWatchInternalWarning` and never reaches the training loop; the other reporters keep working.
"""

from __future__ import annotations

import contextlib
import os
import random
import sys
import threading
import warnings
import weakref
from collections.abc import Iterator
from typing import Any, Protocol

from gradwatch.core.findings import Finding


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


_recreated: set[tuple[str, int]] = set()


def dir_identity(path: str) -> int:
    """The inode of a log directory, to tell "removed and recreated" apart from "still there"."""
    try:
        return os.stat(path).st_ino
    except OSError:
        return -1


def recreate_log_dir(log_dir: str, identity: int) -> None:
    """Recreate a log_dir removed during the run; one warning for every reporter that writes there."""
    if "://" in log_dir:
        return  # a URL (fsspec): nothing local to recreate
    os.makedirs(log_dir, exist_ok=True)
    key = (os.path.abspath(log_dir), identity)
    with _warned_lock:
        if key in _recreated:
            return
        _recreated.add(key)
    safe_warn(
        f"gradwatch: log_dir {log_dir!r} was removed during the run; recreated it. TensorBoard events and "
        "gradwatch.jsonl lines written before are lost; findings are still in memory (watcher.findings).",
        GradWatchInternalWarning,
        stacklevel=4,
    )


class Reporter(Protocol):
    """What a reporter may implement (all optional)."""

    def finding(self, finding: Finding) -> None: ...

    def findings(self, findings: list[Finding]) -> None: ...

    def scalars(self, step: int, values: dict[str, float]) -> None: ...

    def close(self, summary: Any) -> None: ...


class Reporters:
    """Fan-out to several reporters with per-reporter fault isolation."""

    def __init__(self, reporters: list[Any]) -> None:
        self.items = list(reporters)

    def add(self, reporter: Any) -> None:
        self.items.append(reporter)

    def call(self, method: str, *args: Any) -> None:
        for r in self.items:
            fn = getattr(r, method, None)
            if fn is None:
                continue
            try:
                fn(*args)
            except Exception as exc:  # noqa: BLE001 - a reporter must never stop training
                internal_warning(f"{type(r).__name__}.{method}", exc, owner=r, key=type(r).__name__)

    def findings(self, findings: list[Finding]) -> None:
        """One step's findings: to reporters that take them together (the console groups an incident's
        findings into one panel), else one by one."""
        for r in self.items:
            together = getattr(r, "findings", None)
            if together is None:
                fn = getattr(r, "finding", None)
                if fn is None:
                    continue
            try:
                if together is not None:
                    together(findings)
                else:
                    for f in findings:
                        fn(f)
            except Exception as exc:  # noqa: BLE001 - a reporter must never stop training
                internal_warning(f"{type(r).__name__}.findings", exc, owner=r, key=type(r).__name__)

    def of_type(self, cls: type) -> Any:
        return next((r for r in self.items if isinstance(r, cls)), None)
