"""Atomic writes and removals, so that a process killed at any moment leaves every folder whole
or absent: a folder is built in a temporary sibling and renamed into place; a folder is renamed
away before it is deleted. What a killed process leaves behind are temporary siblings
(`.tmp-NAME-XXXXXXXX`, `.old-NAME-XXXXXXXX`, each holding the marker file `.v4train-temporary`),
which `remove_temporaries` clears under the run's lock (v4train.run_dir). Nothing else is ever
deleted there: a user's `.tmp-notes/` has neither the exact name nor the marker.

`kill_point` is the fault-injection hook of the tests: V4TRAIN_KILL_AT=NAME[:N[:ACTION]] acts the
N-th time (default the first) the process passes the point NAME: ACTION kill (the default:
SIGKILL), raise (an OSError) or hang (sleeps for ever); with V4TRAIN_KILL_RANK=R only the rank R
of a run of several processes does.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import tempfile
import time

MARKER = ".v4train-temporary"  # inside every temporary sibling made here
_OWN = re.compile(r"^\.(tmp|old)-.+-[a-z0-9_]{8}$")  # their names: tempfile.mkdtemp's 8 random characters
_passes: dict[str, int] = {}


def kill_point(name: str) -> None:
    point, _, rest = os.environ.get("V4TRAIN_KILL_AT", "").partition(":")
    if point != name or os.environ.get("V4TRAIN_KILL_RANK", os.environ.get("RANK", "0")) != os.environ.get("RANK", "0"):
        return
    nth, _, action = rest.partition(":")
    _passes[name] = _passes.get(name, 0) + 1
    if _passes[name] != int(nth or 1):
        return
    if action == "raise":
        raise OSError(f"fault injected at {name} (V4TRAIN_KILL_AT)")
    if action == "hang":
        while True:
            time.sleep(60)
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
    """A new temporary sibling folder of `path`, marked as v4train's own."""
    folder = tempfile.mkdtemp(prefix=prefix + os.path.basename(path) + "-", dir=os.path.dirname(path))
    with open(os.path.join(folder, MARKER), "w") as f:
        f.write("a temporary folder of v4train: a write or deletion that did not finish\n")
    return folder


def is_temporary(path: str) -> bool:
    """Whether `path` is a temporary sibling that v4train made: the exact name and the marker
    inside, a real folder (not a link)."""
    return (bool(_OWN.match(os.path.basename(path))) and os.path.isdir(path) and not os.path.islink(path)
            and os.path.isfile(os.path.join(path, MARKER)) and not os.path.islink(os.path.join(path, MARKER)))


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
    """Yields a new folder inside a temporary sibling of `final`; on success it becomes `final`
    (replacing an old one), on any error the sibling is removed and `final` is left as it was. A
    process killed midway leaves only the `.tmp-*` sibling, never a half-written `final`."""
    final = os.path.abspath(final)
    parent = os.path.dirname(final)
    os.makedirs(parent, exist_ok=True)
    tmp = _sibling(final, ".tmp-")
    content = os.path.join(tmp, "content")
    try:
        os.mkdir(content)
        yield content
        _fsync_tree(content)
        old = _move_away(final) if os.path.exists(final) else None
        os.rename(content, final)
        _fsync(parent)
        shutil.rmtree(tmp)
        if old:
            shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextlib.contextmanager
def replacing(path: str):
    """Yields a new file's path in a temporary sibling folder of `path`; on success the file is
    renamed over `path`. The rename replaces what `path` is: a link there (to a user's file) is
    replaced, never followed, and a reader sees the old file or the new one, never half of it."""
    tmp = _sibling(os.path.abspath(path), ".tmp-")
    try:
        yield os.path.join(tmp, "content")
        os.replace(os.path.join(tmp, "content"), path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def replace_file(path: str, text: str) -> None:
    """Writes `path` with `text` atomically (`replacing`)."""
    with replacing(path) as tmp, open(tmp, "w") as f:
        f.write(text)


def remove_temporaries(parent: str) -> list[str]:
    """Removes the temporary siblings that killed writers left in `parent` (is_temporary: the
    exact name and the marker, never a name prefix alone); returns their names. Only for a folder
    no live writer uses (the caller holds its lock)."""
    found = sorted(name for name in os.listdir(parent) if is_temporary(os.path.join(parent, name)))
    for name in found:
        shutil.rmtree(os.path.join(parent, name))
    return found
