"""Report: thin writers of findings and step scalars (console, TensorBoard, JSON lines).

Every reporter call goes through :class:`Reporters`, which isolates failures: an exception inside one
reporter (a full disk, a closed stdout, a broken writer) is reported once as a
:class:`GradWatchInternalWarning` and never reaches the training loop; the other reporters keep working.
"""

from __future__ import annotations

import functools
import os
import threading
from typing import Any, Protocol

from gradwatch.core.failures import GradWatchInternalWarning, call_each, internal_warning, safe_warn
from gradwatch.core.findings import Finding

_recreated: set[tuple[str, int]] = set()
_recreated_lock = threading.Lock()


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
    with _recreated_lock:
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
        # Per method name: ``(reporter, bound method)`` of the reporters that define it, resolved once (the
        # scalars go out every checked step), again whenever ``items`` changes length.
        self._methods: dict[str, list[tuple[Any, Any]]] = {}
        self._fns: dict[str, tuple[list[Any], Any]] = {}  # the bound methods alone, and what reports a failure
        self._resolved_for = 0

    def add(self, reporter: Any) -> None:
        self.items.append(reporter)
        self._resolved_for = -1

    def _with(self, method: str) -> list[tuple[Any, Any]]:
        if self._resolved_for != len(self.items):
            self._methods = {}
            self._resolved_for = len(self.items)
        found = self._methods.get(method)
        if found is None:
            found = self._methods[method] = [(r, fn) for r in self.items if (fn := getattr(r, method, None)) is not None]
            self._fns[method] = ([fn for _r, fn in found], functools.partial(self._failed, method))
        return found

    def call(self, method: str, *args: Any) -> None:
        if self._with(method):
            fns, failed = self._fns[method]
            call_each(fns, args, failed)

    def _failed(self, method: str, i: int, exc: Exception) -> None:  # a reporter must never stop training
        r = self._methods[method][i][0]
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
