"""JSON lines reporter: ``log_dir/gradwatch.jsonl``, one object per finding, flushed as it happens.

A crash or kill loses at most the line being written; readers skip a torn last line. Each record carries
``"run"``, an id of the watcher that wrote it: runs that reuse a ``log_dir`` append to the same file, and
``gradwatch summary`` reads the latest run's records.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from typing import Any, Iterator

from gradwatch.findings import Finding
from gradwatch.report import dir_identity, fs, recreate_log_dir

FILENAME = "gradwatch.jsonl"
_RUNS = itertools.count()


def new_run_id() -> str:
    """An id for the records of one run (one watcher; one Lightning callback across its fits)."""
    return f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}-{next(_RUNS)}"


class JsonlReporter:
    """Appends each finding as one line of JSON to ``log_dir/gradwatch.jsonl``."""

    def __init__(self, log_dir: str, run: str | None = None) -> None:
        fs.makedirs(log_dir)
        self.log_dir = log_dir
        self._dir_identity = dir_identity(log_dir)
        self.path = fs.join(log_dir, FILENAME)
        self.run = run or new_run_id()
        self._file: Any = self._open()

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
