"""One build at a time per folder, and no build that waits on a dead one.

torch.utils.cpp_extension guards a build folder with a baton file, `lock`, made when a build starts and
removed when it ends, and waits without end while the file exists. A build stopped midway (the app
closed during its first build, a crash, a power cut) leaves the file behind, and every later start
that builds or loads that extension waits for ever: the worker never answers.

`one_build(folder)` wraps a build in an operating-system lock on `folder/moedesk.lock`, which the system
releases when the process holding it ends, however it ends. Every build of ours runs inside it, so while
holding it no live build of ours is in the folder, and a baton found there is a dead build's: removed.
Torch-free and standard library only (the GUI's welcome screen imports the GPU setup that uses it).
"""
from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Iterator

BATON = "lock"              # torch.utils.cpp_extension's (torch/utils/file_baton.py)
LOCK = "moedesk.lock"       # ours, beside it

log = logging.getLogger(__name__)


def _acquire(fd: int) -> None:
    if os.name == "nt":
        import msvcrt
        while True:
            try:
                msvcrt.locking(fd, msvcrt.LK_LOCK, 1)      # gives up after 10 tries a second apart: wait on
                return
            except OSError:
                continue
    import fcntl
    fcntl.flock(fd, fcntl.LOCK_EX)


def _release(fd: int) -> None:
    if os.name == "nt":
        import msvcrt
        os.lseek(fd, 0, os.SEEK_SET)
        msvcrt.locking(fd, msvcrt.LK_UNLCK, 1)
    else:
        import fcntl
        fcntl.flock(fd, fcntl.LOCK_UN)


@contextlib.contextmanager
def one_build(folder: Path) -> Iterator[bool]:
    """Hold `folder`'s build lock (made if missing), waiting while another process builds there; yields
    whether a dead build's baton was found and removed. Where the file system cannot lock, the build
    goes ahead unguarded, as torch alone would run it."""
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            _acquire(fd)
        except OSError as e:
            log.warning("cannot lock %s (%s): building without the guard against a stopped build", folder, e)
            yield False
            return
        try:
            baton = folder / BATON
            stale = baton.exists()
            if stale:
                baton.unlink(missing_ok=True)
                log.warning("removed %s: left by a build that was stopped before it finished", baton)
            yield stale
        finally:
            _release(fd)
    finally:
        os.close(fd)
