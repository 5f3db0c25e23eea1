"""Atomic writes and removals, so that a process killed at any moment leaves every folder whole
or absent: a folder is built in a temporary sibling and renamed into place; a folder is renamed
away before it is deleted. What a killed process leaves behind are temporary siblings (`.tmp-*`,
`.old-*`), which `remove_temporaries` clears under the run's lock (v4train.run_dir).

`kill_point` is the fault-injection hook of the tests: V4TRAIN_KILL_AT=NAME[:N] SIGKILLs the
process the N-th time (default the first) it passes the point NAME.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile

TEMPORARY = (".tmp-", ".old-")  # prefixes of the siblings made here
_passes: dict[str, int] = {}


def kill_point(name: str) -> None:
    point, _, nth = os.environ.get("V4TRAIN_KILL_AT", "").partition(":")
    if point == name:
        _passes[name] = _passes.get(name, 0) + 1
        if _passes[name] == int(nth or 1):
            os.kill(os.getpid(), signal.SIGKILL)


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: str) -> None:
    """Files on disk before the rename that publishes them (a power cut must not leave a complete-
    looking folder of empty files)."""
    for parent, _, files in os.walk(root):
        for name in files:
            _fsync(os.path.join(parent, name))


def _sibling(path: str, prefix: str) -> str:
    return tempfile.mkdtemp(prefix=prefix + os.path.basename(path) + "-", dir=os.path.dirname(path))


def _move_away(path: str) -> str:
    """Renames the folder `path` into a new `.old-*` sibling, which it returns."""
    trash = _sibling(path, ".old-")
    os.rename(path, os.path.join(trash, "x"))
    return trash


def remove_dir(path: str) -> None:
    """Deletes the folder `path`: renamed away first, so that no half-deleted folder keeps its name."""
    trash = _move_away(os.path.abspath(path))
    kill_point("remove-dir")
    shutil.rmtree(trash)


@contextlib.contextmanager
def atomic_dir(final: str):
    """Yields a temporary folder beside `final`; on success it becomes `final` (replacing an old
    one), on any error it is removed and `final` is left as it was. A process killed midway
    leaves only a `.tmp-*` folder, never a half-written `final`."""
    final = os.path.abspath(final)
    parent = os.path.dirname(final)
    os.makedirs(parent, exist_ok=True)
    tmp = _sibling(final, ".tmp-")
    try:
        yield tmp
        _fsync_tree(tmp)
        old = _move_away(final) if os.path.exists(final) else None
        os.rename(tmp, final)
        _fsync(parent)
        if old:
            shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def replace_file(path: str, text: str) -> None:
    """Writes `path` with `text` atomically (a temporary sibling renamed over it)."""
    fd, tmp = tempfile.mkstemp(prefix=".tmp-" + os.path.basename(path) + "-", dir=os.path.dirname(path))
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def remove_temporaries(parent: str) -> list[str]:
    """Removes the temporary siblings that killed writers left in `parent`; returns their names.
    Only for a folder no live writer uses (the caller holds its lock)."""
    found = sorted(name for name in os.listdir(parent) if name.startswith(TEMPORARY))
    for name in found:
        path = os.path.join(parent, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.remove(path)
    return found
