"""One build at a time per folder, and no build that waits on a dead one.

torch.utils.cpp_extension guards a build folder with a baton file, `lock`, made when a build starts and
removed when it ends, and waits without end while the file exists. A build stopped midway (the app
closed during its first build, a crash, a power cut) leaves the file behind, and every later start
that builds or loads that extension waits for ever: the worker never answers.

`one_build(folder)` wraps a build in an operating-system lock on `folder/moedesk.lock` (the filelock
package's), which the system releases when the process holding it ends, however it ends. Every build of
ours runs inside it, so while holding it no live build of ours is in the folder, and a baton found there
is a dead build's: removed. Torch-free (the GUI's welcome screen imports the GPU setup that uses it).
"""
from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Iterator

from filelock import FileLock

BATON = "lock"              # torch.utils.cpp_extension's (torch/utils/file_baton.py)
LOCK = "moedesk.lock"       # ours, beside it: filelock's OS lock (fcntl / msvcrt), gone with its process

log = logging.getLogger(__name__)


@contextlib.contextmanager
def one_build(folder: Path) -> Iterator[bool]:
    """Hold `folder`'s build lock (made if missing), waiting while another process builds there; yields
    whether a dead build's baton was found and removed. Where the file system cannot lock, the build
    goes ahead unguarded, as torch alone would run it."""
    folder.mkdir(parents=True, exist_ok=True)
    lock = FileLock(folder / LOCK)
    try:
        lock.acquire()
    except (OSError, NotImplementedError) as e:     # (filelock: NotImplementedError where flock is missing)
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
        lock.release()
