"""Report: thin writers of findings and step scalars (console, TensorBoard, JSON lines).

Every reporter call goes through :class:`Reporters`, which isolates failures: an exception inside one
reporter (a full disk, a closed stdout, a broken writer) is reported once as a
:class:`GradWatchInternalWarning` and never reaches the training loop; the other reporters keep working.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Protocol

from gradwatch.core.failures import Fanout, GradWatchInternalWarning, internal_warning, safe_warn
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
        # Per method name, the reporters that define it, resolved once (the scalars go out every checked step),
        # again whenever ``items`` changes length; each reporter's failures are its own.
        self._fanout = Fanout(self.items)
        #: ``call(method, *args)``: ``method(*args)`` on every reporter that defines it.
        self.call = self._fanout.call

    def add(self, reporter: Any) -> None:
        self.items.append(reporter)

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
