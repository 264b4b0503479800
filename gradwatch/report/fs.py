"""Where gradwatch's files are opened: a local path, or an fsspec URL (``memory://``, ``s3://``, ``gs://``).

Lightning's log directories may be URLs (``Trainer(default_root_dir="s3://bucket/run")``); Lightning writes
them through fsspec, and so do ``gradwatch.jsonl`` and the incident reports. A local path never needs fsspec
(it is not a dependency of gradwatch; it comes with Lightning). A URL is never handed to ``os``: that would
create a local folder named ``s3:``.
"""

from __future__ import annotations

import os
import re
from typing import IO, Any

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://")


def is_url(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a URL (``scheme://...``) other than ``file://``."""
    text = os.fspath(path)
    return bool(_URL.match(text)) and not text.startswith("file://")


def _filesystem(url: str) -> tuple[Any, str]:
    try:
        from fsspec.core import url_to_fs
    except ImportError as exc:
        raise OSError(f"{url!r} is a URL; writing there needs fsspec: pip install fsspec") from exc
    return url_to_fs(url)


def join(directory: str, *names: str) -> str:
    """``os.path.join`` for local paths; ``/`` for URLs."""
    if not is_url(directory):
        return os.path.join(directory, *names)
    return "/".join([directory.rstrip("/"), *names])


def makedirs(directory: str) -> None:
    """Create ``directory`` and its parents if they do not exist."""
    if not is_url(directory):
        os.makedirs(directory, exist_ok=True)
        return
    fs, path = _filesystem(directory)
    fs.makedirs(path, exist_ok=True)


def isdir(directory: str) -> bool:
    """Whether the directory exists (a URL is assumed to: object stores have no directories to lose)."""
    return os.path.isdir(directory) if not is_url(directory) else True


def open_file(path: str, mode: str, encoding: str | None = None) -> IO[Any]:
    """``open(path, mode)`` on the local disk or through fsspec. A filesystem that cannot append (object
    stores) gets the file rewritten with its old content first, then appended to until it is closed."""
    if not is_url(path):
        return open(path, mode, encoding=encoding)
    fs, target = _filesystem(path)
    if "a" not in mode:
        return fs.open(target, mode, encoding=encoding)
    try:
        return fs.open(target, mode, encoding=encoding)
    except (NotImplementedError, ValueError):
        old = fs.cat_file(target) if fs.exists(target) else b""
        f = fs.open(target, mode.replace("a", "w"), encoding=encoding)
        if old:
            f.write(old.decode("utf-8") if "b" not in mode else old)
        return f


def deleted(f: IO[Any]) -> bool:
    """Whether an open local file was deleted (its directory removed during the run); False for URLs."""
    try:
        return os.fstat(f.fileno()).st_nlink == 0
    except (AttributeError, OSError, ValueError):
        return False


__all__ = ["deleted", "is_url", "isdir", "join", "makedirs", "open_file"]
