"""Download one EXL2 branch into the models folder: resumable, verified, with progress as callbacks.

Files travel through huggingface_hub's own HTTP layer (`hf_hub_url`, `build_hf_headers` with its stored token,
`http_get` with its Range resume and stream retries). Not `snapshot_download`: in huggingface_hub 2.x each file
goes to a process-unique temporary file that is deleted on any failure, so a cancelled, paused or crashed
download starts every file from zero; and it offers no way to stop it. Here partial bytes are kept.

A download lives in `<models>/.staging/<name>/` (layout in `app/hub/staging.py`): partial files under
`.partial/`, each file moved beside them once its size and hash (sha256 for LFS files, the git blob id
otherwise) match the listing, and the whole folder renamed to `<models>/<name>/` when every file is there.
The model list skips `.staging`, so nothing half-downloaded ever looks loadable.

The listing's size bounds every file: a server that sends more (with or without a Content-Length) is cut off
before the first byte past it. Partial bytes stay only where a resume can use them (a pause, a dropped
connection, a 5xx, a full disk); bytes that cannot be the file (too many, a hash that does not match,
or a response that ended short of the listed size as if complete) are deleted before the error is reported.
"""
from __future__ import annotations

import json
import shutil
import time
from collections import deque
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Callable

import httpx2
from huggingface_hub import constants, hf_hub_url
from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled
from huggingface_hub.file_download import http_get
from huggingface_hub.utils import build_hf_headers

from app.hub.browse import LimitedWriter, RemoteFile, ended_short, endpoint as hub_endpoint
from app.hub.errors import DiskFullError, HubError, IntegrityError, is_disk_full, translate
from app.hub.staging import (MANIFEST, PARTIAL, SOURCE, DownloadJob, bytes_on_disk, check_disk_space, file_digest,
                             inside, partial_total, safe_relpath, staging_dir, write_manifest)
from app.telemetry import fmt_bytes

CHUNK_BYTES = 1 << 20                # huggingface_hub streams 10 MB chunks; 1 MiB keeps pause/cancel prompt
PROGRESS_INTERVAL_S = 0.2
SPEED_WINDOW_S = 5.0
_RETRY_STATUS = {408, 429, 500, 502, 503, 504}


class JobState(str, Enum):
    QUEUED = "queued"
    RUNNING = "running"
    PAUSED = "paused"
    CANCELLED = "cancelled"
    FAILED = "failed"
    DONE = "done"


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 6          # per file; each attempt resumes from the bytes already on disk
    base_s: float = 2.0
    max_s: float = 60.0

    def delay(self, attempt: int) -> float:
        return min(self.max_s, self.base_s * 2 ** (attempt - 1))


@dataclass(frozen=True)
class DownloadProgress:
    job_id: str
    state: JobState
    done_bytes: int
    total_bytes: int
    speed_bps: float = 0.0
    eta_s: float | None = None
    current_file: str = ""
    message: str = ""          # in words: what is happening, or the error


class Interrupted(Exception):
    def __init__(self, reason: str):   # "pause" | "cancel"
        super().__init__(reason)
        self.reason = reason


class _Tracker:
    """Aggregates bytes into DownloadProgress events: speed over a sliding window, ETA, current file."""

    def __init__(self, job: DownloadJob, done: int, emit: Callable[[DownloadProgress], None],
                 check: Callable[[], None]):
        self.job, self.base, self.file_bytes, self.emit, self.check = job, done, 0, emit, check
        self.current = ""
        self.samples: deque[tuple[float, int]] = deque([(time.monotonic(), done)])
        self.last_emit = 0.0

    @property
    def done(self) -> int:
        return self.base + self.file_bytes

    def start_file(self, path: str, initial: int) -> None:
        self.current, self.file_bytes = path, initial
        self.publish(force=True)

    def finish_file(self, size: int) -> None:
        self.base += size
        self.file_bytes = 0

    def add(self, n: int) -> None:
        self.file_bytes += n
        self.check()                      # raises Interrupted on pause / cancel
        self.publish()

    def publish(self, force: bool = False, message: str = "") -> None:
        now = time.monotonic()
        if not force and now - self.last_emit < PROGRESS_INTERVAL_S:
            return
        self.last_emit = now
        self.samples.append((now, self.done))
        while len(self.samples) > 2 and now - self.samples[0][0] > SPEED_WINDOW_S:
            self.samples.popleft()
        (t0, b0), (t1, b1) = self.samples[0], self.samples[-1]
        speed = (b1 - b0) / (t1 - t0) if t1 > t0 else 0.0
        left = self.job.total_bytes - self.done
        eta = left / speed if speed > 0 else None
        self.emit(DownloadProgress(self.job.id, JobState.RUNNING, self.done, self.job.total_bytes, speed, eta,
                                   self.current, message or f"Downloading {self.current}"))

    def bar_class(self):
        """A tqdm stand-in for `http_get(tqdm_class=...)`: feeds this tracker, raises on pause/cancel."""
        tracker = self

        class _Bar:
            def __init__(self, *args, total=None, initial=0, **kwargs):
                tracker.file_bytes = initial or 0     # restarts from 0 if the server ignored our Range

            def update(self, n=1):
                tracker.add(int(n or 0))

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False

            def close(self):
                pass
        return _Bar


def run_job(job: DownloadJob, models_dir: Path, emit: Callable[[DownloadProgress], None],
            check: Callable[[], None], wait: Callable[[float], None], retry: RetryPolicy = RetryPolicy(),
            margin_bytes: int = 100_000_000, hub: str | None = None) -> Path:
    """Fetch every missing file of `job`, verify each, and move the folder into place; returns that folder.

    `check()` raises `Interrupted` when the user paused or cancelled; `wait(s)` sleeps s seconds unless
    interrupted (then raises). Raises `HubError`s with messages for the user; partial files stay for a resume.
    """
    try:
        return _run_job(job, models_dir, emit, check, wait, retry, margin_bytes, hub)
    except OSError as exc:             # the manifest, a rename, the source note: any write can meet a full disk
        if is_disk_full(exc):
            raise DiskFullError(f"The disk holding {models_dir} is full ({fmt_bytes(shutil.disk_usage(models_dir).free)} "
                                "free). Free some space, then press Resume: the download continues where it "
                                "stopped.", str(models_dir)) from exc
        raise HubError(f"Cannot write the download of {job.repo_id} ({job.branch}) into {models_dir}: "
                       f"{exc.strerror or exc}") from exc


def _run_job(job: DownloadJob, models_dir: Path, emit: Callable[[DownloadProgress], None],
             check: Callable[[], None], wait: Callable[[float], None], retry: RetryPolicy, margin_bytes: int,
             hub: str | None) -> Path:
    stage = staging_dir(models_dir, job.id)
    final = models_dir / job.id
    if final.exists():
        raise HubError(f"{final} already exists: delete it first to download {job.repo_id} ({job.branch}) again.")
    check_disk_space(job, models_dir, margin_bytes)
    write_manifest(job, models_dir)
    tracker = _Tracker(job, bytes_on_disk(job, models_dir) - partial_total(job, stage), emit, check)
    hub = hub or hub_endpoint()
    constants.DOWNLOAD_CHUNK_SIZE = CHUNK_BYTES

    for f in job.files:
        rel = safe_relpath(f.path)
        dest, part = inside(stage, rel), inside(stage / PARTIAL, rel)
        if dest.is_file() and dest.stat().st_size == f.size:
            continue                                  # verified in an earlier run
        for attempt in range(1, retry.attempts + 1):
            try:
                _fetch(job, f, part, tracker, hub)
                tracker.publish(force=True, message=f"Verifying {f.path}")
                expected, actual = file_digest(part, f)
                if expected != actual:
                    raise IntegrityError(f"{f.path} arrived corrupted: its hash is {actual[:12]}…, the Hub lists "
                                         f"{expected[:12]}…", f.path, expected, actual)
                dest.parent.mkdir(parents=True, exist_ok=True)
                part.replace(dest)
                tracker.finish_file(f.size)
                break
            except Interrupted:
                raise
            except IntegrityError as exc:            # these bytes cannot be the file: never kept for a resume
                part.unlink(missing_ok=True)
                if attempt == retry.attempts:
                    raise IntegrityError(f"{exc} ({attempt} times). The download stopped; press Resume to try "
                                         "again.", exc.path, exc.expected, exc.actual) from None
                problem = f"{exc}: discarded."
            except HubError:
                raise
            except Exception as exc:
                fatal = _classify(exc, job, f, models_dir)
                if fatal is not None:
                    raise fatal from exc
                if attempt == retry.attempts:
                    raise _gave_up(exc, f, attempt) from exc
                problem = _retry_reason(exc, f)
            tracker.file_bytes = 0
            tracker.publish(force=True, message=f"{problem} Retrying in {retry.delay(attempt):.3g} s "
                                                f"(attempt {attempt + 1} of {retry.attempts}).")
            wait(retry.delay(attempt))
    return _finish(job, stage, final)


def _fetch(job: DownloadJob, f: RemoteFile, part: Path, tracker: _Tracker, hub: str) -> None:
    part.parent.mkdir(parents=True, exist_ok=True)
    if part.exists() and part.stat().st_size > f.size:
        part.unlink()                                 # longer than the file: not ours to trust
    url = hf_hub_url(job.repo_id, f.path, revision=job.commit, endpoint=hub)
    # token=None: huggingface_hub adds the token it stores (login / HF_TOKEN); it never reaches our logs.
    headers = build_hf_headers(library_name="moedesk", headers={"Accept-Encoding": "identity"})
    with open(part, "ab") as fh:
        resume = fh.tell()
        tracker.start_file(f.path, resume)
        if resume < f.size:
            try:
                http_get(url, LimitedWriter(fh, f.size, f.path), resume_size=resume, headers=headers,
                         expected_size=f.size, displayed_filename=f.path, tqdm_class=tracker.bar_class())
            except HfHubHTTPError as exc:
                if exc.response is None or exc.response.status_code != 416:
                    raise                         # 416: the server's file ends before the bytes we hold
            except OSError as exc:
                if not ended_short(exc):
                    raise                         # the disk's own errors (full, permissions): kept for a resume
    received = part.stat().st_size
    if received != f.size:
        raise IntegrityError(f"{f.path} is shorter than the Hub lists: the server sent {received} of {f.size} "
                             "bytes", f.path, str(f.size), str(received))


def _classify(exc: Exception, job: DownloadJob, f: RemoteFile, models_dir: Path) -> HubError | None:
    """The error to show for `exc`, or None when it is worth retrying (network, 5xx, short file)."""
    if is_disk_full(exc):
        return DiskFullError(f"The disk holding {models_dir} is full: {f.path} could not be written "
                             f"({fmt_bytes(shutil.disk_usage(models_dir).free)} free). Free some space, then press "
                             "Resume: the download continues where it stopped.", str(models_dir))
    if isinstance(exc, OfflineModeIsEnabled):
        return translate(exc, f"downloading {f.path}")
    if isinstance(exc, HfHubHTTPError):
        status = exc.response.status_code if exc.response is not None else 0
        return None if status in _RETRY_STATUS else translate(exc, f"downloading {f.path} of {job.repo_id}")
    if isinstance(exc, (httpx2.TransportError, OSError)):
        return None
    return translate(exc, f"downloading {f.path}")


def _retry_reason(exc: Exception, f: RemoteFile) -> str:
    if isinstance(exc, HfHubHTTPError) and exc.response is not None:
        return f"{f.path}: the Hub answered HTTP {exc.response.status_code}."
    if isinstance(exc, httpx2.TransportError):
        return f"{f.path}: connection problem ({exc.__class__.__name__})."
    return f"{f.path}: {exc}."


def _gave_up(exc: Exception, f: RemoteFile, attempts: int) -> HubError:
    if isinstance(exc, (httpx2.TransportError, HfHubHTTPError)):
        error = translate(exc, f"downloading {f.path}")
        return type(error)(f"{error} Gave up after {attempts} attempts; press Resume to continue where it stopped.")
    return HubError(f"Downloading {f.path} failed {attempts} times ({exc}). Press Resume to continue where it "
                    "stopped.")


def _finish(job: DownloadJob, stage: Path, final: Path) -> Path:
    for f in job.files:                               # sizes once more, after everything moved in place
        p = stage.joinpath(*safe_relpath(f.path).parts)
        if not p.is_file() or p.stat().st_size != f.size:
            raise IntegrityError(f"{f.path} is missing or has the wrong size after download", f.path,
                                 str(f.size), str(p.stat().st_size if p.exists() else 0))
    (stage / SOURCE).write_text(json.dumps({"repo_id": job.repo_id, "branch": job.branch, "commit": job.commit,
                                            "bpw": job.bpw, "downloaded_at": time.time()}, indent=1))
    (stage / MANIFEST).unlink()
    shutil.rmtree(stage / PARTIAL, ignore_errors=True)
    stage.rename(final)
    return final


def progress_for(job: DownloadJob, models_dir: Path, state: JobState, message: str = "") -> DownloadProgress:
    return DownloadProgress(job.id, state, bytes_on_disk(job, models_dir), job.total_bytes, message=message)
