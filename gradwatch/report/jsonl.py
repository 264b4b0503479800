"""JSON lines reporter: ``log_dir/gradwatch.jsonl``, one object per finding, flushed as it happens.

A crash or kill loses at most the line being written; readers skip a torn last line.
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterator

from gradwatch.findings import Finding

FILENAME = "gradwatch.jsonl"


class JsonlReporter:
    """Appends each finding as one line of JSON to ``log_dir/gradwatch.jsonl``."""

    def __init__(self, log_dir: str) -> None:
        os.makedirs(log_dir, exist_ok=True)
        self.path = os.path.join(log_dir, FILENAME)
        self._file: Any = open(self.path, "a", encoding="utf-8")

    def finding(self, finding: Finding) -> None:
        self.write(finding.to_dict())

    def write(self, record: dict[str, Any]) -> None:
        if self._file is None:
            self._file = open(self.path, "a", encoding="utf-8")
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()

    def close(self, summary: Any = None) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


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
