"""A queue of downloads run one at a time on a background thread; pause, resume, cancel; restore after restart.

Events (`DownloadProgress`) go to one callback, called from the download thread; the dialog turns them into
Qt signals. Nothing here imports Qt.
"""
from __future__ import annotations

import logging
import threading
from collections import deque
from pathlib import Path
from typing import Callable

from app.hub.browse import Quant
from app.hub.download import DownloadProgress, Interrupted, JobState, RetryPolicy, progress_for, run_job
from app.hub.staging import (MANIFEST, MANIFEST_ERRORS, DownloadJob, bytes_on_disk, check_disk_space, plan,
                             read_manifest, remove_staging, staged_jobs, staging_dir, write_manifest)
from app.hub.errors import HubError
from app.telemetry import fmt_bytes
from runtime import paths

log = logging.getLogger(__name__)
_FINAL = (JobState.PAUSED, JobState.CANCELLED, JobState.FAILED, JobState.DONE)


class DownloadManager:
    def __init__(self, on_event: Callable[[DownloadProgress], None] | None = None, models_dir: Path | None = None,
                 retry: RetryPolicy = RetryPolicy(), margin_bytes: int = 100_000_000, hub: str | None = None):
        self.models_dir = Path(models_dir or paths.models_dir())
        self.on_event = on_event or (lambda p: None)
        self.retry, self.margin_bytes, self.hub = retry, margin_bytes, hub
        self._jobs: dict[str, DownloadJob] = {}
        self._last: dict[str, DownloadProgress] = {}
        self._queue: deque[str] = deque()
        self._interrupt: dict[str, str] = {}
        self._running: str | None = None
        self._cv = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None

    # -- what the dialog calls
    def restore(self) -> list[DownloadProgress]:
        """Register downloads an earlier run left unfinished, as paused (press Resume to continue)."""
        out = []
        for job in staged_jobs(self.models_dir):
            if job.id not in self._jobs:
                self._jobs[job.id] = job
                out.append(self._emit(progress_for(job, self.models_dir, JobState.PAUSED,
                                                   "Unfinished from an earlier session: press Resume.")))
        return out

    def enqueue(self, quant: Quant) -> DownloadJob:
        """Queue `quant`; raises `HubError` (e.g. `NotEnoughDiskSpace`) when it cannot start, before any byte."""
        job = plan(quant)
        with self._cv:
            current = self._last.get(job.id)
            if current and current.state in (JobState.QUEUED, JobState.RUNNING):
                return self._jobs[job.id]
            if (self.models_dir / job.id).exists():
                raise HubError(f"{job.repo_id} ({job.branch}) is already downloaded: {self.models_dir / job.id}")
            stage = staging_dir(self.models_dir, job.id)
            if (stage / MANIFEST).is_file() and _staged_commit(stage) != job.commit:
                remove_staging(self.models_dir, job.id)     # the branch moved on: old bytes are not its files
            check_disk_space(job, self.models_dir, self.margin_bytes)
            write_manifest(job, self.models_dir)
            self._jobs[job.id] = job
            self._queue_job(job.id)
        return job

    def resume(self, job_id: str) -> None:
        with self._cv:
            if self._last[job_id].state in (JobState.PAUSED, JobState.FAILED):
                self._queue_job(job_id)

    def pause(self, job_id: str) -> None:
        self._stop(job_id, "pause")

    def cancel(self, job_id: str) -> None:
        self._stop(job_id, "cancel")

    def state(self, job_id: str) -> DownloadProgress:
        return self._last[job_id]

    def all(self) -> list[DownloadProgress]:
        return list(self._last.values())

    def job(self, job_id: str) -> DownloadJob:
        return self._jobs[job_id]

    def wait(self, job_id: str, timeout: float = 60.0) -> DownloadProgress:
        """Block until the job stops (done, failed, paused or cancelled); for tests and the CLI."""
        with self._cv:
            self._cv.wait_for(lambda: self._last[job_id].state in _FINAL and self._running != job_id, timeout)
            return self._last[job_id]

    def shutdown(self, timeout: float = 30.0) -> None:
        """Pause what runs (its partial files stay for the next start) and stop the thread."""
        with self._cv:
            self._closed = True
            if self._running:
                self._interrupt[self._running] = "pause"
            self._cv.notify_all()
        if self._thread:
            self._thread.join(timeout)

    # -- internals
    def _queue_job(self, job_id: str) -> None:          # holds self._cv
        self._interrupt.pop(job_id, None)
        self._queue.append(job_id)
        job = self._jobs[job_id]
        self._emit(progress_for(job, self.models_dir, JobState.QUEUED, "Waiting to start"))
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._work, name="downloads", daemon=True)
            self._thread.start()
        self._cv.notify_all()

    def _stop(self, job_id: str, reason: str) -> None:
        with self._cv:
            if self._running == job_id:
                self._interrupt[job_id] = reason      # the download thread stops at its next chunk
                self._cv.notify_all()
                return
            if job_id in self._queue:
                self._queue.remove(job_id)
            job = self._jobs[job_id]
            if reason == "cancel":
                remove_staging(self.models_dir, job_id)
                self._emit(DownloadProgress(job_id, JobState.CANCELLED, 0, job.total_bytes,
                                            message="Cancelled; its files were deleted."))
            elif self._last[job_id].state == JobState.QUEUED:
                self._emit(progress_for(job, self.models_dir, JobState.PAUSED, "Paused"))
            self._cv.notify_all()

    def _check(self, job_id: str) -> None:
        reason = self._interrupt.get(job_id)
        if reason:
            raise Interrupted(reason)

    def _wait(self, job_id: str, seconds: float) -> None:
        with self._cv:
            self._cv.wait_for(lambda: job_id in self._interrupt, seconds)
        self._check(job_id)

    def _work(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._queue or self._closed)
                if self._closed:
                    return
                job_id = self._queue.popleft()
                self._running = job_id
            job = self._jobs[job_id]
            try:
                folder = run_job(job, self.models_dir, self._emit, lambda: self._check(job_id),
                                 lambda s: self._wait(job_id, s), self.retry, self.margin_bytes, self.hub)
                result = DownloadProgress(job_id, JobState.DONE, job.total_bytes, job.total_bytes,
                                          message=f"Downloaded and verified: {folder.name}")
            except Interrupted as stop:
                if stop.reason == "cancel":
                    remove_staging(self.models_dir, job_id)
                    result = DownloadProgress(job_id, JobState.CANCELLED, 0, job.total_bytes,
                                              message="Cancelled; its files were deleted.")
                else:
                    result = progress_for(job, self.models_dir, JobState.PAUSED,
                                          f"Paused at {fmt_bytes(bytes_on_disk(job, self.models_dir))}")
            except HubError as exc:
                log.warning("download %s failed: %s", job_id, exc)
                result = progress_for(job, self.models_dir, JobState.FAILED, str(exc))
            except Exception as exc:          # a bug: say so, keep the partial files
                log.exception("download %s crashed", job_id)
                result = progress_for(job, self.models_dir, JobState.FAILED,
                                      f"Unexpected error: {exc.__class__.__name__}: {exc}")
            with self._cv:
                self._running = None
                self._interrupt.pop(job_id, None)
                self._emit(result)
                self._cv.notify_all()

    def _emit(self, progress: DownloadProgress) -> DownloadProgress:
        self._last[progress.job_id] = progress
        try:
            self.on_event(progress)
        except Exception:                     # a broken listener must not kill the download
            log.exception("download listener failed")
        return progress


def _staged_commit(stage: Path) -> str | None:
    """The commit an earlier download in `stage` was for; None when its manifest cannot be read (or trusted)."""
    try:
        return read_manifest(stage).commit
    except MANIFEST_ERRORS:
        return None
