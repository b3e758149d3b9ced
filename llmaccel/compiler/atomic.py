"""A folder written whole or not at all: built in a hidden temporary folder beside the target,
then swapped into place by rename, so an interrupted write (Ctrl-C, kill -9, a full disk) leaves
the previous folder as it was and never a half-written one under the target's name."""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import secrets
import shutil
from contextlib import contextmanager
from pathlib import Path

from llmaccel.errors import LlmaccelError

_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100


def _temp_prefix(target: Path) -> str:
    return f".{target.name}.llmc-"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale(target: Path) -> None:
    """Temporary folders beside `target` left by writers that no longer run (killed)."""
    prefix = _temp_prefix(target)
    if not target.parent.is_dir():
        return
    for p in target.parent.iterdir():
        if not p.name.startswith(prefix):
            continue
        pid = p.name[len(prefix):].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(p, ignore_errors=True)


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2); False where the system cannot."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    fn = getattr(libc, "renameat2", None)
    if fn is None:
        return False
    return fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0


def _fsync_tree(root: Path) -> None:
    """Flush the files, then the folder, so that the rename never exposes unwritten data."""
    for p in root.iterdir():
        with open(p, "rb") as f:
            os.fsync(f.fileno())
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _swap_in(tmp: Path, target: Path) -> None:
    if not target.exists() or (target.is_dir() and not any(target.iterdir())):
        os.replace(tmp, target)  # a directory replaces an empty one atomically
        return
    if _exchange(tmp, target):
        shutil.rmtree(tmp, ignore_errors=True)  # now holds the previous folder
        return
    # Without renameat2 the target is missing for the instant between these two renames.
    old = tmp.with_name(tmp.name + "-old")
    os.replace(target, old)
    os.replace(tmp, target)
    shutil.rmtree(old, ignore_errors=True)


@contextmanager
def atomic_dir(target):
    """Yields a fresh temporary folder; on a clean exit it replaces `target`, on any error or
    interruption it is removed and `target` is untouched. A full disk or a permission problem
    becomes one LlmaccelError."""
    target = Path(target)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        remove_stale(target)
        tmp = target.with_name(f"{_temp_prefix(target)}{os.getpid()}-{secrets.token_hex(4)}")
        tmp.mkdir()
    except OSError as e:
        raise LlmaccelError(f"cannot write {target}: {e.strerror or e}") from None
    try:
        yield tmp
        _fsync_tree(tmp)
        _swap_in(tmp, target)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise LlmaccelError(f"cannot write {target}: {e.strerror or e}; the previous contents "
                            f"are unchanged") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
