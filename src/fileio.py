"""Small file helpers: nothing the project writes is ever left half-written."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


@functools.cache
def _umask() -> int:
    """This process's umask (usually 0o022). Read once: reading it means setting it, for a moment, for every
    thread of the process."""
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


def _new_file_mode() -> int:
    """The mode ``open()`` gives a new file under the umask (0o644 under the usual 022)."""
    return 0o666 & ~_umask()


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
        _fsync_dir(path.parent)
    finally:
        tmp_path.unlink(missing_ok=True)


def _fsync_dir(directory: Path) -> None:
    """Flush a directory's entries to disk: a rename is durable only once its directory is (after a power cut, the
    file could otherwise still be missing, or be the old one). Where a directory cannot be opened so (some network
    file systems), the rename stays as the file system keeps it."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def link_atomically(existing: Path, path: Path) -> bool:
    """``path`` made a second name of the file ``existing`` (a hard link, which replaces any file at ``path`` in one
    step): no second copy on disk, none written. False, and nothing changed, where the file system has no hard
    links (or ``existing`` is gone)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}-link.tmp")  # atomic_path's pattern: a kill leaves it to clean
    try:
        os.link(existing, tmp)
    except OSError:
        return False
    os.replace(tmp, path)
    return True


@contextlib.contextmanager
def atomic_dir(path: str | Path) -> Iterator[Path]:
    """``atomic_path`` for a directory of files written by a library (``save_pretrained``): a temporary directory
    beside ``path``, which replaces it when the block succeeds (an earlier one is moved aside, then removed) and is
    removed when it fails. Readers find the old directory or the new one whole, never a half-written one (or,
    for the moment between the two renames, none)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
    os.chmod(tmp, 0o777 & ~_umask())  # what mkdir gives (mkdtemp's own is 0o700)
    old = None
    try:
        yield tmp
        for file in tmp.rglob("*"):
            if file.is_file():
                with open(file, "rb") as f:
                    os.fsync(f.fileno())
        if path.exists():
            old = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".old"))
            os.replace(path, old / path.name)
        try:
            os.replace(tmp, path)
        except BaseException:
            if old is not None:  # the earlier one goes back
                os.replace(old / path.name, path)
            raise
        _fsync_dir(path.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def write_text(path: str | Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_json(path: str | Path, obj) -> None:
    write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


@contextlib.contextmanager
def locked(path: str | Path, wait: bool = True, note: str = "") -> Iterator[bool]:
    """An exclusive lock on the file ``path`` (made if missing) for the block: the kernel's (``flock``), so a process
    that dies, killed or not, leaves none behind. ``wait``: until it is free; else the block runs at once, with
    False, when another process holds it. ``note``: written into the file once held (who holds it, for the others'
    messages). Where no lock can be had (a read-only directory, a network file system without locks) the block
    runs unguarded, with True."""
    import fcntl

    try:
        f = open(path, "a+", encoding="utf-8")  # noqa: SIM115 (a lock, not data; closed below, which releases it)
    except OSError:
        yield True
        return
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        except OSError:
            pass  # no locks on this file system: unguarded
        if note:
            f.truncate(0)
            f.write(note)
            f.flush()
        yield True
