"""`moedesk-cli import OWNER/REPO`: the repository's main branch downloaded by the app's own download queue
(resumable, verified, hostile listings refused) before the import reads it. No Qt, no torch.

The files go where the model manager's imports keep their sources, `<models>/.convert-sources/<owner>--<repo>--main/`:
a download stopped with Ctrl+C (or a crash) continues where it stopped when the command runs again, and the
model manager's import of the same repository finds it there.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from app.hub.browse import HubClient
from app.hub.convert import SOURCES, hub_source
from app.hub.download import DownloadProgress, JobState
from app.hub.errors import HubError
from app.hub.queue import DownloadManager
from app.hub.staging import safe_name
from app.telemetry import fmt_bytes
from runtime import paths

REPORT_EVERY_S = 10.0


def download_source(repo_id: str, say: Callable[[str], None], models_dir: Path | None = None,
                    hub: HubClient | None = None) -> Path:
    """The folder holding what the import reads of `repo_id` (its main branch), downloaded first where it is not
    there yet; HubError (or its subclasses) in words when it cannot be."""
    sources = Path(models_dir or paths.models_dir()) / SOURCES
    folder = sources / safe_name(repo_id, "main")
    if folder.is_dir():
        return folder
    hub = hub or HubClient()
    quant = hub_source(hub, repo_id, "import")              # checked (architecture, quantization) before any byte
    last = [0.0]

    def report(p: DownloadProgress) -> None:
        if p.state is JobState.RUNNING and time.monotonic() - last[0] >= REPORT_EVERY_S:
            last[0] = time.monotonic()
            eta = f", about {p.eta_s / 60:.0f} min left" if p.eta_s else ""
            say(f"downloading {repo_id}: {fmt_bytes(p.done_bytes)} of {fmt_bytes(p.total_bytes)}{eta}")

    manager = DownloadManager(on_event=report, models_dir=sources, hub=hub.endpoint)
    try:
        job = manager.enqueue(quant)
        say(f"downloading {repo_id} ({fmt_bytes(job.total_bytes)}) into {sources / job.id}")
        while True:
            state = manager.wait(job.id, 3600)
            if state.state in (JobState.DONE, JobState.FAILED, JobState.CANCELLED, JobState.PAUSED):
                break
    finally:
        manager.shutdown()                                    # Ctrl+C: the download pauses, its bytes stay
    if state.state is not JobState.DONE:
        raise HubError(f"downloading {repo_id} did not finish: {state.message} Run the command again to resume.")
    return sources / job.id
