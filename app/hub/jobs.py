"""What the download queue and the conversions share: jobs run one at a time on a background thread, the last
event of each, pause, resume and cancel, waiting for a job to stop, shutdown.

A subclass says how a job runs (`_run`, on the jobs' thread, returning its final event) and what stopping a job
that is not running means (`_stop`); each keeps its own jobs, events and files. Events go to one callback, from
background threads. Nothing here imports Qt.
"""
from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Callable, Generic, TypeVar

from app.hub.download import JobState

ACTIVE = (JobState.QUEUED, JobState.RUNNING)        # Pause applies
RESUMABLE = (JobState.PAUSED, JobState.FAILED)      # Resume applies
ENDED = (JobState.CANCELLED, JobState.DONE)         # nothing applies any more
STOPPED = RESUMABLE + ENDED                         # neither running nor waiting to

Job = TypeVar("Job")
Progress = TypeVar("Progress")                      # an event: has .job_id and .state


class JobQueue(Generic[Job, Progress]):
    kind = "job"                 # "download", "conversion": in the thread's name (plural) and the log
    wait_s = 60.0                # wait()'s default timeout

    def __init__(self, on_event: Callable[[Progress], None] | None = None):
        self.on_event = on_event or (lambda p: None)
        self._jobs: dict[str, Job] = {}
        self._last: dict[str, Progress] = {}
        self._queue: deque[str] = deque()
        self._running: str | None = None
        self._stop_reason: dict[str, str] = {}      # "pause" | "cancel", asked of the running job
        self._cv = threading.Condition()            # its lock is an RLock: subclasses may hold it around calls here
        self._closed = False
        self._thread: threading.Thread | None = None

    def pause(self, job_id: str) -> None:
        self._stop(job_id, "pause")

    def cancel(self, job_id: str) -> None:
        self._stop(job_id, "cancel")

    def state(self, job_id: str) -> Progress:
        return self._last[job_id]

    def all(self) -> list[Progress]:
        return list(self._last.values())

    def job(self, job_id: str) -> Job:
        return self._jobs[job_id]

    def wait(self, job_id: str, timeout: float | None = None) -> Progress:
        """Block until the job stops (done, failed, paused or cancelled); for tests and the CLI."""
        with self._cv:
            self._cv.wait_for(lambda: self._last[job_id].state in STOPPED and self._running != job_id,
                              self.wait_s if timeout is None else timeout)
            return self._last[job_id]

    def shutdown(self, timeout: float = 30.0) -> None:
        """Pause the running job (what it has done stays for the next start) and stop the thread."""
        with self._cv:
            self._closed = True
            if self._running:
                self._stop_reason[self._running] = "pause"
                self._interrupt()
            self._cv.notify_all()
        if self._thread:
            self._thread.join(timeout)

    # -- for subclasses
    def _run(self, job: Job) -> Progress:
        """Run `job` on the jobs' thread; its final event (done, failed, paused or cancelled)."""
        raise NotImplementedError

    def _stop(self, job_id: str, reason: str) -> None:
        """Pause or cancel; `_stop_running` first, then what stopping a job that does not run means."""
        raise NotImplementedError

    def _interrupt(self) -> None:
        """Called holding the lock once the running job has a stop reason; by default it checks that itself."""

    def _queue_job(self, queued: Progress) -> None:
        """Put the job of `queued` (its QUEUED event) in line, unless it is there or running, and say so."""
        job_id = queued.job_id
        with self._cv:
            self._stop_reason.pop(job_id, None)
            if job_id not in self._queue and self._running != job_id:
                self._queue.append(job_id)
            self._emit(queued)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._work, name=f"{self.kind}s", daemon=True)
                self._thread.start()
            self._cv.notify_all()

    def _stop_running(self, job_id: str, reason: str) -> bool:
        """Ask the running job to stop (True), or take a waiting one out of line (False: it stopped now)."""
        with self._cv:
            if self._running == job_id:
                self._stop_reason[job_id] = reason
                self._interrupt()
                self._cv.notify_all()
                return True
            if job_id in self._queue:
                self._queue.remove(job_id)
            return False

    def _work(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._queue or self._closed)
                if self._closed:
                    return
                job_id = self._queue.popleft()
                self._running = job_id
            result = self._run(self._jobs[job_id])
            with self._cv:
                self._running = None
                self._stop_reason.pop(job_id, None)
                self._emit(result)
                self._cv.notify_all()

    def _emit(self, progress: Progress) -> Progress:
        self._last[progress.job_id] = progress
        try:
            self.on_event(progress)
        except Exception:                           # a broken listener must not stop the job
            logging.getLogger(type(self).__module__).exception("%s listener failed", self.kind)
        return progress
