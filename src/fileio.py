"""Small file helpers: nothing the project writes is ever left half-written."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path


@functools.cache
def _new_file_mode() -> int:
    """The mode ``open()`` gives a new file under this process's umask (0o644 under the usual 022). Read once:
    reading the umask means setting it, for a moment, for every thread of the process."""
    umask = os.umask(0o022)
    os.umask(umask)
    return 0o666 & ~umask


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; when the block succeeds it is flushed to disk and renamed over
    ``path`` in one step, and when it fails it is removed. Readers see the old file or the new one. The file
    gets the mode any new file gets (mkstemp's own, 0o600, would hide checkpoints, summaries and a shared cache
    from the rest of a lab's group)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.fchmod(fd, _new_file_mode())
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        with open(tmp_path, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp_path, path)
    finally:
        tmp_path.unlink(missing_ok=True)


def write_text(path: str | Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_json(path: str | Path, obj) -> None:
    write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")
