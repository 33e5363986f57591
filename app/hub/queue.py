"""A queue of downloads run one at a time on a background thread; pause, resume, cancel; restore after restart.

Events (`DownloadProgress`) go to one callback, called from the download thread; the dialog turns them into
Qt signals. Nothing here imports Qt.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

from app.hub.browse import Quant
from app.hub.download import DownloadProgress, Interrupted, JobState, RetryPolicy, progress_for, run_job
from app.hub.staging import (MANIFEST, MANIFEST_ERRORS, DownloadJob, bytes_on_disk, check_disk_space, plan,
                             read_manifest, remove_staging, staged_jobs, staging_dir, write_manifest)
from app.hub.errors import HubError
from app.hub.jobs import ACTIVE, RESUMABLE, JobQueue
from app.telemetry import fmt_bytes
from runtime import paths

log = logging.getLogger(__name__)


class DownloadManager(JobQueue[DownloadJob, DownloadProgress]):
    kind = "download"

    def __init__(self, on_event: Callable[[DownloadProgress], None] | None = None, models_dir: Path | None = None,
                 retry: RetryPolicy = RetryPolicy(), margin_bytes: int = 100_000_000, hub: str | None = None):
        super().__init__(on_event)
        self.models_dir = Path(models_dir or paths.models_dir())
        self.retry, self.margin_bytes, self.hub = retry, margin_bytes, hub

    # -- what the dialog calls (and pause, cancel, state, all, job, wait, shutdown of JobQueue)
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
            if current and current.state in ACTIVE:
                return self._jobs[job.id]
            if (self.models_dir / job.id).exists():
                raise HubError(f"{job.repo_id} ({job.branch}) is already downloaded: {self.models_dir / job.id}")
            stage = staging_dir(self.models_dir, job.id)
            if (stage / MANIFEST).is_file() and _staged_commit(stage) != job.commit:
                remove_staging(self.models_dir, job.id)     # the branch moved on: old bytes are not its files
            check_disk_space(job, self.models_dir, self.margin_bytes)
            write_manifest(job, self.models_dir)
            self._jobs[job.id] = job
            self._queue_job(self._queued(job))
        return job

    def resume(self, job_id: str) -> None:
        with self._cv:
            if self._last[job_id].state in RESUMABLE:
                self._queue_job(self._queued(self._jobs[job_id]))

    # -- internals
    def _queued(self, job: DownloadJob) -> DownloadProgress:
        return progress_for(job, self.models_dir, JobState.QUEUED, "Waiting to start")

    def _stop(self, job_id: str, reason: str) -> None:
        with self._cv:
            if self._stop_running(job_id, reason):
                return                                # the download thread stops at its next chunk
            job = self._jobs[job_id]
            if reason == "cancel":
                self._emit(self._cancelled(job))
            elif self._last[job_id].state == JobState.QUEUED:
                self._emit(progress_for(job, self.models_dir, JobState.PAUSED, "Paused"))
            self._cv.notify_all()

    def _cancelled(self, job: DownloadJob) -> DownloadProgress:
        remove_staging(self.models_dir, job.id)
        return DownloadProgress(job.id, JobState.CANCELLED, 0, job.total_bytes,
                                message="Cancelled; its files were deleted.")

    def _check(self, job_id: str) -> None:
        reason = self._stop_reason.get(job_id)
        if reason:
            raise Interrupted(reason)

    def _wait(self, job_id: str, seconds: float) -> None:
        with self._cv:
            self._cv.wait_for(lambda: job_id in self._stop_reason, seconds)
        self._check(job_id)

    def _run(self, job: DownloadJob) -> DownloadProgress:
        try:
            folder = run_job(job, self.models_dir, self._emit, lambda: self._check(job.id),
                             lambda s: self._wait(job.id, s), self.retry, self.margin_bytes, self.hub)
            return DownloadProgress(job.id, JobState.DONE, job.total_bytes, job.total_bytes,
                                    message=f"Downloaded and verified: {folder.name}")
        except Interrupted as stop:
            if stop.reason == "cancel":
                return self._cancelled(job)
            return progress_for(job, self.models_dir, JobState.PAUSED,
                                f"Paused at {fmt_bytes(bytes_on_disk(job, self.models_dir))}")
        except HubError as exc:
            log.warning("download %s failed: %s", job.id, exc)
            return progress_for(job, self.models_dir, JobState.FAILED, str(exc))
        except Exception as exc:          # a bug: say so, keep the partial files
            log.exception("download %s crashed", job.id)
            return progress_for(job, self.models_dir, JobState.FAILED,
                                f"Unexpected error: {exc.__class__.__name__}: {exc}")


def _staged_commit(stage: Path) -> str | None:
    """The commit an earlier download in `stage` was for; None when its manifest cannot be read (or trusted)."""
    try:
        return read_manifest(stage).commit
    except MANIFEST_ERRORS:
        return None
