"""Atomic directory writes: build in a temporary sibling folder, then rename into place."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile


@contextlib.contextmanager
def atomic_dir(final: str):
    """Yields a temporary folder beside `final`; on success it becomes `final` (replacing an old
    one), on any error it is removed and `final` is left as it was. A process killed midway
    leaves only a `.tmp-*` folder, never a half-written `final`."""
    final = os.path.abspath(final)
    parent = os.path.dirname(final)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-" + os.path.basename(final) + "-", dir=parent)
    try:
        yield tmp
        if os.path.exists(final):
            old = tempfile.mkdtemp(prefix=".old-" + os.path.basename(final) + "-", dir=parent)
            os.rename(final, os.path.join(old, "x"))
            os.rename(tmp, final)
            shutil.rmtree(old)
        else:
            os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
