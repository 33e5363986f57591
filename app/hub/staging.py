"""The staging folder of a download: names, paths checked against escape, the manifest, disk space, hashes.

  <models>/.staging/<name>/.moedesk-download.json   what to fetch: repo, branch, commit, files, sizes, hashes
  <models>/.staging/<name>/.partial/<path>          bytes received so far of one file
  <models>/.staging/<name>/<path>                   files received and verified
Nothing from a repository listing may land outside the download's folder.
"""
from __future__ import annotations

import hashlib
import json
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path, PurePosixPath

from app.hub.browse import Quant, RemoteFile, checked_commit, checked_file
from app.hub.errors import HubError, NotEnoughDiskSpace, UnsafePathError
from app.telemetry import fmt_bytes

STAGING = ".staging"
MANIFEST = ".moedesk-download.json"
PARTIAL = ".partial"
SOURCE = "moedesk-source.json"       # written into a finished model folder: where it came from


@dataclass(frozen=True)
class DownloadJob:
    id: str                    # the folder name: "<owner>--<repo>--<branch>"
    repo_id: str
    branch: str
    commit: str
    files: tuple[RemoteFile, ...]
    bpw: float | None = None

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)



def safe_name(repo_id: str, branch: str) -> str:
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", f"{repo_id.replace('/', '--')}--{branch}").lstrip("._-")
    if not name:
        raise UnsafePathError(f"cannot make a folder name from {repo_id!r} at {branch!r}", repo_id)
    return name[:150]


def safe_relpath(path: str) -> PurePosixPath:
    """A repository path accepted only when it stays inside the folder it is joined to."""
    parts = path.split("/")
    if (not path or "\\" in path or "\0" in path or ":" in path or path.startswith("/")
            or any(p in ("", ".", "..") for p in parts) or parts[0] in (MANIFEST, PARTIAL, SOURCE)):
        raise UnsafePathError(f"refusing the repository path {path!r}: it could write outside the model folder",
                              path)
    return PurePosixPath(*parts)


def inside(root: Path, rel: PurePosixPath) -> Path:
    target = root.joinpath(*rel.parts)
    if not target.resolve().is_relative_to(root.resolve()):
        raise UnsafePathError(f"refusing {str(rel)!r}: it resolves outside {root}", str(rel))
    return target


def staging_dir(models_dir: Path, job_id: str) -> Path:
    return models_dir / STAGING / job_id


def plan(quant: Quant) -> DownloadJob:
    """A job for `quant`, with every listed path checked."""
    for f in quant.files:
        safe_relpath(f.path)
    checked_commit(quant.commit, f"{quant.repo_id} at {quant.branch}")
    return DownloadJob(safe_name(quant.repo_id, quant.branch), quant.repo_id, quant.branch, quant.commit,
                       quant.files, quant.bpw)


def write_manifest(job: DownloadJob, models_dir: Path) -> None:
    stage = staging_dir(models_dir, job.id)
    stage.mkdir(parents=True, exist_ok=True)
    data = {"repo_id": job.repo_id, "branch": job.branch, "commit": job.commit, "bpw": job.bpw,
            "files": [asdict(f) for f in job.files]}
    (stage / MANIFEST).write_text(json.dumps(data, indent=1))


MANIFEST_ERRORS = (ValueError, KeyError, TypeError, RecursionError, HubError)   # what an unreadable manifest raises


def read_manifest(stage: Path) -> DownloadJob:
    """The job a manifest written by `write_manifest` describes, each field checked (it is a file on disk, which
    anything may have changed); one of MANIFEST_ERRORS otherwise."""
    data = json.loads((stage / MANIFEST).read_text(encoding="utf-8"))
    where = f"The download manifest in {stage}"
    files = tuple(checked_file(RemoteFile(**f), where) for f in data["files"])
    for f in files:
        safe_relpath(f.path)
    commit = checked_commit(data["commit"], where)
    repo_id, branch, bpw = data["repo_id"], data["branch"], data.get("bpw")
    if not (isinstance(repo_id, str) and isinstance(branch, str)
            and (bpw is None or isinstance(bpw, (int, float)) and not isinstance(bpw, bool))):
        raise HubError(f"{where} gives a repository, branch or bits per weight that are not what they should be.")
    return DownloadJob(stage.name, repo_id, branch, commit, files, bpw)


def bytes_on_disk(job: DownloadJob, models_dir: Path) -> int:
    """Bytes already there: verified files count in full, partial files by their size."""
    stage = staging_dir(models_dir, job.id)
    done = 0
    for f in job.files:
        rel = safe_relpath(f.path)
        final, part = stage.joinpath(*rel.parts), stage.joinpath(PARTIAL, *rel.parts)
        if final.is_file():
            done += f.size
        elif part.is_file():
            done += min(part.stat().st_size, f.size)
    return done


def check_disk_space(job: DownloadJob, models_dir: Path, margin_bytes: int) -> None:
    models_dir.mkdir(parents=True, exist_ok=True)
    needed = job.total_bytes - bytes_on_disk(job, models_dir)
    free = shutil.disk_usage(models_dir).free
    if free < needed + margin_bytes:
        raise NotEnoughDiskSpace(
            f"Not enough disk space for {job.repo_id} ({job.branch}): it needs {fmt_bytes(needed + margin_bytes)}, "
            f"and {models_dir} has {fmt_bytes(free)} free. Free some space or choose a smaller quant.",
            needed + margin_bytes, free)



def file_digest(path: Path, remote: RemoteFile) -> tuple[str, str]:
    """(expected, actual): sha256 for LFS files, git blob id (sha1 of "blob <size>\\0" + bytes) otherwise."""
    if remote.sha256:
        h, expected = hashlib.sha256(), remote.sha256
    else:
        h, expected = hashlib.sha1(b"blob %d\0" % path.stat().st_size), remote.blob_id
    with open(path, "rb") as fh:
        while block := fh.read(1 << 22):
            h.update(block)
    return expected, h.hexdigest()


def partial_total(job: DownloadJob, stage: Path) -> int:
    total = 0
    for f in job.files:
        part = stage.joinpath(PARTIAL, *safe_relpath(f.path).parts)
        if part.is_file() and not stage.joinpath(*safe_relpath(f.path).parts).is_file():
            total += min(part.stat().st_size, f.size)
    return total



def remove_staging(models_dir: Path, job_id: str) -> None:
    shutil.rmtree(staging_dir(models_dir, job_id), ignore_errors=True)


def staged_jobs(models_dir: Path) -> list[DownloadJob]:
    """Downloads left unfinished by an earlier run (or a crash), oldest first."""
    root = models_dir / STAGING
    if not root.is_dir():
        return []
    jobs = []
    for stage in sorted(root.iterdir(), key=lambda p: p.stat().st_mtime):
        if (stage / MANIFEST).is_file():
            try:
                jobs.append(read_manifest(stage))
            except MANIFEST_ERRORS:
                continue                              # unreadable manifest: leave the folder alone
    return jobs
