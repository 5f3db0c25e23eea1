"""The output directory of a run: one run writes it at a time, and a run never mixes its
checkpoints and metrics with an earlier run's.

While a run writes OUTPUT_DIR it holds an flock on OUTPUT_DIR/.lock, a file holding its pid. The
kernel drops the lock when the process ends, however it ends, so a lock file left by a killed run
is stale: the next run takes it over and says so. A run refuses a folder that holds an earlier
run's outputs unless it resumes that run (--resume_from=latest, or a checkpoint in it) or
replaces it (--overwrite_output_dir); a resumed run refuses to overwrite checkpoints newer than
the one it resumes. Under the lock, the temporary folders of interrupted saves are removed.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import stat

from v4train import checkpoint
from v4train.atomic import is_temporary, remove_dir, remove_temporaries

LOCK = ".lock"
# what --overwrite_output_dir deletes
RUN_OUTPUTS = re.compile(r"^(checkpoint-\d+|metrics\.jsonl|loss\.png|base_model|profile-step\d+\.json)$")


def _owner(fd: int) -> str:
    """The pid a lock file holds."""
    return os.read(fd, 64).decode(errors="replace").strip() or "unknown"


def writer(output_dir: str) -> str | None:
    """The pid of a live run that holds output_dir's lock (written in it), else None."""
    try:
        fd = os.open(os.path.join(output_dir, LOCK), os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return None
    except BlockingIOError:
        return _owner(fd)
    finally:
        os.close(fd)


class Claim:
    """`with Claim(output_dir, resume_path, overwrite) as claim:` the run owns output_dir; claim.notes
    says what was found and done (a stale lock taken over, temporary folders removed, outputs
    deleted). Raises ValueError, naming --output_dir, when the run may not write there."""

    def __init__(self, output_dir: str, resume_path: str | None, overwrite: bool):
        self.output_dir, self.resume_path, self.overwrite = os.path.abspath(output_dir), resume_path, overwrite
        self.notes: list[str] = []
        self.fd = None

    def __enter__(self) -> "Claim":
        self._lock()
        try:
            self._check_outputs()
            removed = remove_temporaries(self.output_dir)
            if removed:
                self.notes.append(f"removed {len(removed)} temporary folder(s) of an interrupted write: "
                                  f"{', '.join(removed)}")
        except BaseException:
            self.release()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def _lock(self) -> None:
        d = self.output_dir
        if os.path.exists(d) and not os.path.isdir(d):
            raise ValueError(f"--output_dir={d}: is a file, expected a directory")
        self.created = not os.path.exists(d)
        path = os.path.join(d, LOCK)
        try:
            os.makedirs(d, exist_ok=True)
            while True:
                # Never through a link: a `.lock` that is a symlink to a user's file would be truncated.
                try:
                    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
                except OSError as e:
                    if e.errno != errno.ELOOP:
                        raise
                    raise ValueError(f"--output_dir={d}: {LOCK} is a symbolic link, not v4train's lock file; "
                                     "remove it, or choose another --output_dir") from None
                # A hard link is a name of someone else's file: truncating it would empty that file.
                st = os.fstat(fd)
                if st.st_nlink == 0:  # its owner removed it as we opened it: open the file now there
                    os.close(fd)
                    continue
                if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
                    os.close(fd)
                    what = "not a regular file" if not stat.S_ISREG(st.st_mode) else \
                        f"a file with {st.st_nlink} links (a hard link to another file), not v4train's lock file"
                    raise ValueError(f"--output_dir={d}: {LOCK} is {what}; remove it, or choose another --output_dir")
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    owner = _owner(fd)
                    os.close(fd)
                    raise ValueError(f"--output_dir={d}: another run (pid {owner}) is writing it; wait for it to "
                                     "end, or choose another --output_dir") from None
                try:
                    if os.path.samestat(os.fstat(fd), os.stat(path)):
                        break
                except FileNotFoundError:
                    pass
                os.close(fd)  # its owner removed it as we opened it: lock the file now there
            stale = os.read(fd, 64).decode(errors="replace").strip()
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError as e:
            raise ValueError(f"--output_dir={d}: not writable ({e.strerror})") from None
        self.fd = fd
        if stale:
            self.notes.append(f"took over the stale lock of pid {stale}, which ended without releasing it")

    def _check_outputs(self) -> None:
        d = self.output_dir
        names = sorted(n for n in os.listdir(d) if n != LOCK and not is_temporary(os.path.join(d, n)))
        # A folder in which no step ran holds no earlier run: a metrics.jsonl with no row (an earlier
        # version wrote it at start-up), and then a base_model/ of a --model_config LoRA run that
        # stopped before its first step (no checkpoint names it as its base).
        # (A link named metrics.jsonl, dangling or not, is no empty file of ours: it counts, never followed.)
        names = [n for n in names if not (n == "metrics.jsonl" and not os.path.islink(os.path.join(d, n))
                                          and os.path.getsize(os.path.join(d, n)) == 0)]
        if not any(n == "metrics.jsonl" or checkpoint.step_of(n) is not None for n in names):
            names = [n for n in names if n != "base_model"]
        resumes_here = self.resume_path is not None and os.path.dirname(os.path.abspath(self.resume_path)) == d
        resume_step = checkpoint.step_of(self.resume_path) if resumes_here else None
        if resume_step is None:
            conflicting, what = names, "holds an earlier run"
        else:
            conflicting = [n for n in names if (checkpoint.step_of(n) or -1) > resume_step]
            what = f"holds checkpoints newer than --resume_from={self.resume_path}, which this run would overwrite"
        if not conflicting:
            return
        if not self.overwrite:
            shown = ", ".join(conflicting[:5]) + (", ..." if len(conflicting) > 5 else "")
            if self.resume_path is not None and not resumes_here:  # another run's checkpoint, resumed here
                raise ValueError(f"--output_dir={d} {what} ({shown}), and --resume_from={self.resume_path} is another "
                                 "folder's checkpoint: resume it into a new --output_dir, or replace this folder's "
                                 "run with --overwrite_output_dir")
            raise ValueError(f"--output_dir={d} {what} ({shown}): continue it with --resume_from=latest, replace it "
                             "with --overwrite_output_dir, or choose another --output_dir")
        deleted = [n for n in conflicting if RUN_OUTPUTS.match(n)]
        for name in deleted:
            path = os.path.join(d, name)
            remove_dir(path) if os.path.isdir(path) else os.remove(path)
        self.notes.append(f"--overwrite_output_dir: deleted the earlier run's {', '.join(deleted)}")

    def release(self) -> None:
        """Removes the lock file (and output_dir, if this run made it and wrote nothing there)."""
        if self.fd is None:
            return
        with contextlib.suppress(OSError):
            os.remove(os.path.join(self.output_dir, LOCK))
        os.close(self.fd)
        self.fd = None
        if self.created:
            with contextlib.suppress(OSError):
                os.rmdir(self.output_dir)
