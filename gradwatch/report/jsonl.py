"""JSON lines reporter: ``log_dir/gradwatch.jsonl``, one object per finding, flushed as it happens.

A crash or kill loses at most the line being written; readers skip a torn last line. Runs that reuse a
``log_dir`` append to the same file, so every record carries ``"run"``, a random id (uuid4) of the run
that wrote it, and two kinds of records mark where runs begin:

- ``{"event": "run_start", "run": ..., "time": ..., "pid": ..., "event_files": [...]}``, written when a
  watcher opens the file (a healthy run has no other record). ``event_files`` names the TensorBoard
  event files of the run in the same directory, so each chart value belongs to one run too.
- ``{"event": "run_continued", "run": ..., "from": ..., "at_step": ...}``, written when a run resumes from
  a checkpoint (``load_state_dict``, a Lightning ``ckpt_path``): the records of ``"from"`` belong to
  ``"run"`` from then on, and its earlier findings at ``at_step`` or later were made again.

Findings are the other records (they have ``"kind"``).
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Iterator
from typing import Any

from gradwatch.core.findings import Finding
from gradwatch.report import dir_identity, fs, recreate_log_dir

FILENAME = "gradwatch.jsonl"
RUN_START = "run_start"
RUN_CONTINUED = "run_continued"


def new_run_id() -> str:
    """An id for the records of one run (one watcher; one Lightning callback across the fits of one
    Trainer): random, so runs started in the same second (or by processes with the same pid) differ."""
    return uuid.uuid4().hex


class JsonlReporter:
    """Appends each finding as one line of JSON to ``log_dir/gradwatch.jsonl``."""

    def __init__(self, log_dir: str, run: str | None = None, event_files: list[str] | tuple[str, ...] = ()) -> None:
        fs.makedirs(log_dir)
        self.log_dir = log_dir
        self._dir_identity = dir_identity(log_dir)
        self.path = fs.join(log_dir, FILENAME)
        self.run = run or new_run_id()
        self._event_files = list(event_files)
        self._file: Any = self._open()

    def start(self) -> None:
        """Mark where this run's records begin (called once, when the watcher is set up)."""
        self.write(run_start_record(self.run, self._event_files))

    def continue_run(self, run: str, at_step: int) -> None:
        """From now on write as ``run`` (resumed from a checkpoint at ``at_step``), and say so in the file."""
        if run == self.run:
            return
        previous, self.run = self.run, run
        self.write({"event": RUN_CONTINUED, "run": run, "from": previous, "at_step": int(at_step), "time": time.time()})

    def _open(self) -> Any:
        torn = False
        try:
            with fs.open_file(self.path, "rb") as r:
                if r.seek(0, os.SEEK_END) > 0:
                    r.seek(-1, os.SEEK_END)
                    torn = r.read(1) != b"\n"
        except OSError:
            pass  # a new file, or a device that cannot seek: nothing to repair
        f = fs.open_file(self.path, "a", encoding="utf-8")
        if torn:  # an interrupted write left half a line: start ours on a line of its own
            f.write("\n")
        return f

    def finding(self, finding: Finding) -> None:
        self.write({**finding.to_dict(), "run": self.run})

    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, allow_nan=False) + "\n"
        if self._file is not None and fs.deleted(self._file):
            self._drop_file()  # log_dir removed during the run: write to a new file, not a deleted one
        if self._file is None:
            if not fs.isdir(self.log_dir):
                recreate_log_dir(self.log_dir, self._dir_identity)
            self._file = self._open()
        try:
            self._file.write(line)
            self._file.flush()
        except Exception:
            self._drop_file()  # a failed flush leaves a torn buffer: the next finding starts a clean line
            raise

    def _drop_file(self) -> None:
        f, self._file = self._file, None
        if f is not None:
            try:
                f.close()
            except Exception:  # noqa: BLE001 - the buffer could not be flushed (full disk): nothing to keep
                pass

    def close(self, summary: Any = None) -> None:
        f, self._file = self._file, None
        if f is not None:
            f.close()


def run_start_record(run: str, event_files: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    from gradwatch.version import __version__

    return {
        "event": RUN_START,
        "run": run,
        "time": time.time(),
        "pid": os.getpid(),
        "event_files": list(event_files),
        "gradwatch": __version__,
    }


def is_finding(record: dict[str, Any]) -> bool:
    """A finding's record (the others mark where runs begin: ``run_start``, ``run_continued``)."""
    return isinstance(record.get("kind"), str) and "event" not in record


def read_jsonl(path: str) -> Iterator[dict[str, Any]]:
    """Records of a ``gradwatch.jsonl`` file; a torn or invalid line (interrupted write) is skipped."""
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            line = line.strip()
            if not line:
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue
