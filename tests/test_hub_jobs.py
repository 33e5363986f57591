"""The job queue the downloads and the conversions share (app/hub/jobs.py), with a job of its own: one at a
time, pause and cancel of a running and of a waiting job, wait, shutdown, a broken listener."""
from __future__ import annotations

import threading
from dataclasses import dataclass

from app.hub.download import JobState
from app.hub.jobs import JobQueue


@dataclass(frozen=True)
class Event:
    job_id: str
    state: JobState


class Steps(JobQueue[str, Event]):
    """A job runs until its stop reason is set or `finish` is set; `_interrupt` wakes it."""
    kind = "step"

    def __init__(self, on_event=None):
        super().__init__(on_event)
        self.finish = threading.Event()
        self.interrupted = 0

    def add(self, job_id: str) -> None:
        self._jobs[job_id] = job_id
        self._queue_job(Event(job_id, JobState.QUEUED))

    def let_finish(self) -> None:
        with self._cv:
            self.finish.set()
            self._cv.notify_all()

    def _interrupt(self) -> None:
        self.interrupted += 1

    def _run(self, job: str) -> Event:
        with self._cv:
            self._emit(Event(job, JobState.RUNNING))
            self._cv.notify_all()
            self._cv.wait_for(lambda: job in self._stop_reason or self.finish.is_set(), 10)
            reason = self._stop_reason.get(job)
        if reason:
            return Event(job, JobState.CANCELLED if reason == "cancel" else JobState.PAUSED)
        return Event(job, JobState.DONE)

    def _stop(self, job_id: str, reason: str) -> None:
        if not self._stop_running(job_id, reason):
            self._emit(Event(job_id, JobState.CANCELLED if reason == "cancel" else JobState.PAUSED))


def running(q: Steps, job_id: str) -> bool:
    with q._cv:
        return q._cv.wait_for(lambda: q._running == job_id and q.state(job_id).state is JobState.RUNNING, 5)


def test_one_at_a_time_and_pause_or_cancel_of_a_waiting_or_running_job():
    seen = []
    q = Steps(seen.append)
    for job in ("a", "b", "c"):
        q.add(job)
    assert running(q, "a") and q.state("b").state is JobState.QUEUED
    q.pause("b")                                       # waiting: out of line, paused at once
    assert q.state("b").state is JobState.PAUSED and list(q._queue) == ["c"] and q.interrupted == 0
    q.cancel("a")                                      # running: asked to stop, then stops
    assert q.wait("a", 5).state is JobState.CANCELLED and q.interrupted == 1
    assert running(q, "c")
    q.let_finish()
    assert q.wait("c", 5).state is JobState.DONE
    events = [(e.job_id, e.state.value) for e in seen]
    # each job's own events in order (the queue's thread may start "a" before "b" and "c" are queued)
    assert {j: [st for i, st in events if i == j] for j in "abc"} == {
        "a": ["queued", "running", "cancelled"], "b": ["queued", "paused"], "c": ["queued", "running", "done"]}
    assert events.index(("a", "cancelled")) < events.index(("c", "running"))     # one at a time
    q.add("b")                                         # resumed: in line again
    assert q.wait("b", 5).state is JobState.DONE
    assert {e.job_id: e.state for e in q.all()} == {"a": JobState.CANCELLED, "b": JobState.DONE,
                                                    "c": JobState.DONE}
    q.shutdown(5)
    assert not q._thread.is_alive()


def test_shutdown_pauses_the_running_job_and_a_broken_listener_stops_nothing():
    def listener(event):
        raise RuntimeError("broken")

    q = Steps(listener)
    q.add("a")
    assert running(q, "a")
    assert q._thread.name == "steps"
    q.shutdown(5)
    assert not q._thread.is_alive() and q.interrupted == 1
    assert q.state("a").state is JobState.PAUSED and q._running is None
