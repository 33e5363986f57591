"""Convert an original Hugging Face checkpoint to EXL2 from the app: download it, then run `moedesk-cli convert`;
or import a GPTQ-family build (GPTQ, AutoRound, AWQ) the same way with `moedesk-cli import` (a job's `kind`).

The source is a Hub repository (its main branch) or a local folder. A Hub source is downloaded with the app's
own download machinery (`DownloadManager`: resumable, verified, hostile listings refused) into
`<models>/.convert-sources/`, which the model list never shows. The conversion itself runs as a separate
process (`python -m runtime.cli convert`, like the engine: the app never imports torch); its output lines give
the progress ("layer i/N quantized"), its last "moedesk-cli convert: ..." line the error in words.

The converter keeps its finished layers in `<models>/.<name>.partial/` and renames the model into place only
once complete, so the model list (which skips dot folders) never shows a half-written model. A stopped
conversion (Pause, app closed, crash, power cut) continues at the layer it stopped when started again: each
job is recorded in `<models>/.convert/<name>.json` and restored, paused, at the next start. Cancel deletes the
converter's partial folder, the downloaded source and the record.

Nothing here imports Qt or torch; events go to one callback, from background threads.
"""
from __future__ import annotations

import json
import logging
import re
import shutil
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

from app.hub.browse import HubClient, Quant
from app.hub.download import DownloadProgress, JobState
from app.hub.errors import HubError, NotEnoughDiskSpace
from app.hub.jobs import ENDED, RESUMABLE, JobQueue
from app.hub.queue import DownloadManager
from app.hub.staging import remove_staging, safe_name
from app.telemetry import fmt_bytes
from runtime import gptq_spec
from runtime.client import worker_env
from runtime.errors import ModelFolderError
from runtime.modelfolder import check_links, read_json
from runtime.options import CONVERT_ARCHITECTURES, CONVERT_HEAD_BITS, IMPORT_ARCHITECTURES

log = logging.getLogger(__name__)

SOURCES = ".convert-sources"         # downloaded original checkpoints
RECORDS = ".convert"                 # one JSON record per conversion, for restore after a restart
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# The files of an original checkpoint the converter reads or copies; nothing else is downloaded.
SOURCE_FILES = re.compile(r"(config\.json|generation_config\.json|model(-\d+-of-\d+)?\.safetensors|"
                          r"model\.safetensors\.index\.json|tokenizer\.json|tokenizer_config\.json|"
                          r"special_tokens_map\.json|tokenizer\.model|chat_template\.jinja)")
_LAYER = re.compile(r"^layer (\d+)/(\d+) (?:quantized|imported)")
_RESUME = re.compile(r"^resuming after layer (\d+) of (\d+)")
_ERROR = re.compile(r"^moedesk-cli (?:convert|import): ")
KINDS = ("convert", "import")
KILL_GRACE_S = 3.0                   # Pause or Cancel: SIGTERM, then SIGKILL this long after if it still runs
_VERB = {"convert": "Converting", "import": "Importing"}
# The converter's words for a partial folder left by a run with other settings (runtime/exl2/convert.py):
# in the app, Cancel is what starts over.
_OTHER_SETTINGS = "an interrupted conversion with other settings is there"


def _explain(error: str) -> str:
    """The converter's error line in the model manager's words."""
    if _OTHER_SETTINGS in error or "an interrupted import with other settings is there" in error:
        return ("This conversion was started with other settings (another version of MoE Desk, or other "
                "options) and cannot be resumed: press Cancel, then convert the model again.")
    return error
BPW_RANGE = (2.0, 8.0)


def _kill_if_running(proc: subprocess.Popen) -> None:
    """A converter still running KILL_GRACE_S after it was asked to stop: killed (it ignored SIGTERM)."""
    if proc.poll() is None:
        log.warning("the converter (pid %d) did not stop within %g s of SIGTERM: killing it", proc.pid, KILL_GRACE_S)
        proc.kill()


def convert_command() -> list[str]:
    """The converter's command line, to which the job's arguments are appended."""
    return [sys.executable, "-m", "runtime.cli", "convert"]


def import_command() -> list[str]:
    """The import's command line (`moedesk-cli import`), to which the job's arguments are appended."""
    return [sys.executable, "-m", "runtime.cli", "import"]


class ConvertPlanError(HubError):
    """A conversion that cannot start; the message says why in words."""


@dataclass(frozen=True)
class ConvertJob:
    id: str                   # the output folder's name inside the models folder
    source: str               # "owner/repo" on the Hub, or a local folder
    bpw: float
    hub: bool
    download_id: str = ""     # the source's download (Hub sources)
    layers: int = 0           # num_hidden_layers of the source, when known
    kind: str = "convert"     # "convert" (moedesk-cli convert) or "import" (moedesk-cli import: a GPTQ-family build)


@dataclass(frozen=True)
class ConvertProgress:
    job_id: str
    state: JobState
    phase: str                # "download" | "convert"
    done: int                 # bytes (download) or layers (convert)
    total: int
    message: str = ""
    eta_s: float | None = None    # converting: time left, from this run's layers so far


def output_name(source: str, bpw: float, kind: str = "convert") -> str:
    if kind == "import":
        try:
            return gptq_spec.import_name(source)
        except ModelFolderError:
            raise ConvertPlanError(f"Cannot make a model name from {source!r}.") from None
    base = source.rstrip("/\\").replace("\\", "/").rsplit("/", 1)[-1]
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", f"{base}-exl2-{bpw:.1f}bpw").lstrip("._-")
    if not name or name.startswith("exl2-"):
        raise ConvertPlanError(f"Cannot make a model name from {source!r}.")
    return name[:150]


def check_bpw(bpw: float) -> float:
    if not BPW_RANGE[0] <= bpw <= BPW_RANGE[1]:
        raise ConvertPlanError(f"Bits per weight must be between {BPW_RANGE[0]:g} and {BPW_RANGE[1]:g}, not {bpw:g}.")
    return float(bpw)


def check_config(config: dict, where: str, kind: str = "convert") -> int:
    """The source's layer count; ConvertPlanError when the converter (or the import) cannot handle it."""
    if not isinstance(config, dict) or not config:
        raise ConvertPlanError(f"{where} has no readable config.json: it is not a Hugging Face model.")
    if kind == "import":
        return check_import_config(config, where)
    archs = config.get("architectures") or []
    if not isinstance(archs, list) or not any(a in CONVERT_ARCHITECTURES for a in archs):
        raise ConvertPlanError(f"{where} is a {', '.join(map(str, archs)) or 'model of unknown architecture'}: "
                               f"the converter handles {', '.join(CONVERT_ARCHITECTURES)} only.")
    qc = config.get("quantization_config")
    if qc:
        method = qc.get("quant_method", "?") if isinstance(qc, dict) else "?"
        raise ConvertPlanError(f"{where} is already quantized ({method}): pick the original (fp16/bf16) "
                               "repository of this model.")
    return _layers(config, where)


def _layers(config: dict, where: str) -> int:
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    layers = config.get("num_hidden_layers", text.get("num_hidden_layers"))     # multimodal: under text_config
    if not isinstance(layers, int) or not 0 < layers < 100_000:
        raise ConvertPlanError(f"{where}: config.json gives no valid num_hidden_layers ({layers!r}).")
    return layers


def check_import_config(config: dict, where: str) -> int:
    """The layer count of a GPTQ-family build the import takes; ConvertPlanError naming what it cannot take."""
    archs = config.get("architectures") or []
    if not isinstance(archs, list) or not any(a in IMPORT_ARCHITECTURES for a in archs):
        raise ConvertPlanError(f"{where} is a {', '.join(map(str, archs)) or 'model of unknown architecture'}: "
                               f"the import handles {', '.join(IMPORT_ARCHITECTURES)} only.")
    if gptq_spec.quant_method(config) is None:
        raise ConvertPlanError(f"{where} is not quantized (no quantization_config): convert it to EXL2 instead.")
    try:
        gptq_spec.read_spec(config, where)
    except ModelFolderError as exc:
        raise ConvertPlanError(f"{where} cannot be imported: {exc.problem}.") from None
    return _layers(config, where)


def output_bytes(weight_bytes: int, bpw: float, kind: str = "convert") -> int:
    """Disk the conversion needs: the output (16-bit weights at bpw / 16 each) twice, layer files then model;
    an import's output weighs about its source (its layer files become the model's shards)."""
    if kind == "import":
        return int(weight_bytes)
    return int(weight_bytes / 16 * max(bpw, CONVERT_HEAD_BITS)) * 2


def check_space(models_dir: Path, need: int, what: str, margin: int) -> None:
    models_dir.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(models_dir).free
    if free < need + margin:
        raise NotEnoughDiskSpace(f"Not enough disk space to {what}: it needs {fmt_bytes(need + margin)}, and "
                                 f"{models_dir} has {fmt_bytes(free)} free. Free some space or pick fewer bits "
                                 "per weight.", need + margin, free)


def kind_of(config: dict) -> str:
    """"import" for a GPTQ-family build (its config's quant_method), else "convert"."""
    return "import" if isinstance(config, dict) and gptq_spec.quant_method(config) in gptq_spec.METHODS else "convert"


def hub_source(hub: HubClient, repo_id: str, kind: str | None = None) -> Quant:
    """The main branch of `repo_id` reduced to what the converter (or the import) reads; checked before any
    download. `kind` None: from its config (a GPTQ-family build is imported)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id
    try:
        validate_repo_id(repo_id)
    except HFValidationError as exc:
        raise ConvertPlanError(f"{repo_id[:200]!r} is not a repository name such as owner/model: {exc}") from None
    hub.check_online(f"listing the files of {repo_id}")
    quant = hub.quant(repo_id, "main")
    if quant is None:
        raise ConvertPlanError(f"{repo_id} has no safetensors weights on its main branch. Pickle weights "
                               "(.bin, .pt) are refused: loading them can run code. Pick a repository with "
                               "safetensors.")
    if quant.access:
        raise ConvertPlanError(quant.access)
    return source_files(quant, kind or kind_of(quant.config))


def source_files(quant: Quant, kind: str = "convert") -> Quant:
    """`quant` (a listed branch) reduced to the files the converter or the import reads, its config checked."""
    repo_id = quant.repo_id
    check_config(quant.config, repo_id, kind)
    files = tuple(f for f in quant.files if SOURCE_FILES.fullmatch(f.path))
    weights = [f.path for f in files if f.path.endswith(".safetensors")]
    index = next((f for f in files if f.path == "model.safetensors.index.json"), None)
    if index is None and weights != ["model.safetensors"]:
        raise ConvertPlanError(f"{repo_id}: its weights ({', '.join(weights[:4]) or 'none'}) are neither one "
                               "model.safetensors nor shards named in model.safetensors.index.json.")
    return replace(quant, files=files, bpw=None, head_bits=None)


def local_source(folder: Path, kind: str | None = "convert") -> int:
    """The layer count of a local checkpoint; ConvertPlanError when it cannot be converted (or imported)."""
    if not folder.is_dir():
        raise ConvertPlanError(f"{folder} is not a folder.")
    try:
        check_links(folder)                   # the converter refuses them too: say so before anything is queued
        if not (folder / "config.json").is_file():
            raise ConvertPlanError(f"{folder} has no config.json: it is not a Hugging Face model folder.")
        config = read_json(folder / "config.json")
    except ModelFolderError as exc:
        raise ConvertPlanError(exc.message) from None
    layers = check_config(config, str(folder), kind or kind_of(config))
    if not (folder / "model.safetensors").is_file() and not (folder / "model.safetensors.index.json").is_file():
        pickles = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise ConvertPlanError(f"{folder} holds pickle weights ({', '.join(pickles[:4])}), which can run code "
                                   "when loaded and are refused. Use a safetensors copy of the model.")
        raise ConvertPlanError(f"{folder} has no model.safetensors (or model.safetensors.index.json).")
    return layers


def weight_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


class ConvertManager(JobQueue[ConvertJob, ConvertProgress]):
    """Conversions, one process at a time; Hub sources downloaded first. Pause, resume, cancel, restore."""
    kind = "conversion"
    wait_s = 120.0

    def __init__(self, models_dir: Path, on_event: Callable[[ConvertProgress], None] | None = None,
                 command: list[str] | None = None, margin_bytes: int = 100_000_000, hub: str | None = None,
                 import_cmd: list[str] | None = None):
        super().__init__(on_event)
        self.models_dir = Path(models_dir)
        self.command = command or convert_command()
        self.import_cmd = import_cmd or import_command()
        self.margin_bytes = margin_bytes
        self.downloads = DownloadManager(on_event=self._on_download, models_dir=self.models_dir / SOURCES,
                                         margin_bytes=margin_bytes, hub=hub)
        self._proc: subprocess.Popen | None = None

    # -- paths
    def out_dir(self, job: ConvertJob) -> Path:
        return self.models_dir / job.id

    def partial_dir(self, job: ConvertJob) -> Path:
        return self.models_dir / f".{job.id}.partial"

    def source_dir(self, job: ConvertJob) -> Path:
        return self.models_dir / SOURCES / job.download_id if job.hub else Path(job.source)

    def _record(self, job_id: str) -> Path:
        return self.models_dir / RECORDS / f"{job_id}.json"

    # -- what the dialog calls (and pause, cancel, state, job, wait of JobQueue)
    def start_hub(self, quant: Quant, bpw: float, kind: str | None = None) -> ConvertJob:
        """Download `quant` (from `hub_source` / `source_files`) and convert or import it (`kind`; None: import a
        GPTQ-family build, convert anything else); raises HubError before any byte when it cannot."""
        bpw, kind = check_bpw(bpw), kind or kind_of(quant.config)
        job = ConvertJob(output_name(quant.repo_id, bpw, kind), quant.repo_id, bpw, True,
                         safe_name(quant.repo_id, quant.branch), check_config(quant.config, quant.repo_id, kind), kind)
        self._check_new(job)
        weights = sum(f.size for f in quant.files if f.path.endswith(".safetensors"))
        check_space(self.models_dir, quant.size_bytes + output_bytes(weights, bpw, kind),
                    f"download and {kind} {quant.repo_id}", self.margin_bytes)
        self._save(job)
        if self.source_dir(job).is_dir():               # downloaded by an earlier attempt
            self._enqueue(job.id)
        else:
            self.downloads.enqueue(quant)
        return job

    def start_local(self, folder: Path, bpw: float, kind: str | None = None) -> ConvertJob:
        bpw = check_bpw(bpw)
        folder = Path(folder).resolve()
        if kind is None:
            try:
                kind = kind_of(json.loads((folder / "config.json").read_text()))
            except (OSError, ValueError, RecursionError):
                kind = "convert"                          # local_source says what is wrong with it
        job = ConvertJob(output_name(str(folder), bpw, kind), str(folder), bpw, False, "", local_source(folder, kind),
                         kind)
        self._check_new(job)
        check_space(self.models_dir, output_bytes(weight_bytes(folder), bpw, kind), f"{kind} {folder.name}",
                    self.margin_bytes)
        self._save(job)
        self._enqueue(job.id)
        return job

    def restore(self) -> list[ConvertProgress]:
        """Conversions an earlier run left unfinished, as paused (Resume continues at the layer they stopped)."""
        self.downloads.restore()
        out = []
        for path in sorted((self.models_dir / RECORDS).glob("*.json")):
            try:
                job = ConvertJob(**json.loads(path.read_text()))
                trusted = (job.id == path.stem and job.kind in KINDS
                           and output_name(job.source, job.bpw, job.kind) == job.id and check_bpw(job.bpw) and isinstance(job.hub, bool) and isinstance(job.layers, int)
                           and job.download_id == (safe_name(job.source, "main") if job.hub else ""))
            except (OSError, ValueError, TypeError, AttributeError, RecursionError, HubError):
                trusted = False
            if not trusted or job.id in self._jobs:
                continue                                # not ours to trust (it names what it deletes): left alone
            self._jobs[job.id] = job
            out.append(self._emit(self._paused(job, "Unfinished from an earlier session: press Resume.")))
        return out

    def resume(self, job_id: str) -> None:
        job = self._jobs[job_id]
        if self._last[job_id].state not in RESUMABLE:
            return
        if job.hub and not self.source_dir(job).is_dir():
            if not self._downloading(job):
                self._emit(ConvertProgress(job_id, JobState.FAILED, "download", 0, 0, "The partial download of "
                                           "the original is gone: cancel this conversion and start it again."))
                return
            self.downloads.resume(job.download_id)
        else:
            self._enqueue(job_id)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the running conversion (its finished layers stay for the next start) and the downloads."""
        self.downloads.shutdown()
        super().shutdown(timeout)

    # -- internals
    def _check_new(self, job: ConvertJob) -> None:
        current = self._last.get(job.id)
        if current and current.state not in ENDED:
            raise ConvertPlanError(f"{job.id} is being made already: see Conversions.")
        if self.out_dir(job).exists():
            raise ConvertPlanError(f"A model named {job.id} exists already: delete it first to {job.kind} again.")

    def _save(self, job: ConvertJob) -> None:
        self._record(job.id).parent.mkdir(parents=True, exist_ok=True)
        tmp = self._record(job.id).with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(job), indent=1))
        tmp.replace(self._record(job.id))
        self._jobs[job.id] = job

    def _downloading(self, job: ConvertJob) -> bool:
        return any(p.job_id == job.download_id for p in self.downloads.all())

    def _paused(self, job: ConvertJob, message: str) -> ConvertProgress:
        state = self._partial_state()
        return ConvertProgress(job.id, JobState.PAUSED, "convert", state.get(job.id, 0), job.layers, message)

    def _partial_state(self) -> dict[str, int]:
        out = {}
        for job in self._jobs.values():
            try:                                 # the converter's file, checked by it: here only shown
                done = read_json(self.partial_dir(job) / "state.json").get("layers_done")
            except (ModelFolderError, AttributeError):
                done = None
            out[job.id] = done if type(done) is int and 0 <= done <= job.layers else 0
        return out

    def _on_download(self, p: DownloadProgress) -> None:
        job = next((j for j in self._jobs.values() if j.hub and j.download_id == p.job_id), None)
        if job is None:
            return
        if p.state is JobState.DONE:
            self._enqueue(job.id)
            return
        if p.state is JobState.CANCELLED:
            return                                       # the conversion's cancel emits its own event
        what = "the build" if job.kind == "import" else "the original"
        message = p.message if p.state is not JobState.RUNNING else f"Downloading {what}: {p.message}"
        self._emit(ConvertProgress(job.id, p.state, "download", p.done_bytes, p.total_bytes, message, p.eta_s))

    def _enqueue(self, job_id: str) -> None:
        job = self._jobs[job_id]
        self._queue_job(ConvertProgress(job_id, JobState.QUEUED, "convert", self._partial_state()[job_id],
                                        job.layers, "Waiting to convert"))

    def _stop(self, job_id: str, reason: str) -> None:
        job = self._jobs[job_id]
        if self._stop_running(job_id, reason):
            return                                       # the converter is terminated: it stops now
        if job.hub and not self.source_dir(job).is_dir() and self._downloading(job):
            (self.downloads.cancel if reason == "cancel" else self.downloads.pause)(job.download_id)
            self.downloads.wait(job.download_id, 30)
        if reason == "cancel":
            self._emit(self._cancelled(job))
        elif self._last[job_id].state is JobState.QUEUED:
            self._emit(self._paused(job, "Paused"))

    def _cancelled(self, job: ConvertJob) -> ConvertProgress:
        shutil.rmtree(self.partial_dir(job), ignore_errors=True)
        if job.hub:
            shutil.rmtree(self.source_dir(job), ignore_errors=True)
            remove_staging(self.models_dir / SOURCES, job.download_id)
        self._record(job.id).unlink(missing_ok=True)
        return ConvertProgress(job.id, JobState.CANCELLED, "convert", 0, job.layers,
                               "Cancelled; its partial files were deleted.")

    def _interrupt(self) -> None:                        # holds self._cv
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.terminate()                             # its finished layers are on disk: it may stop at once
            killer = threading.Timer(KILL_GRACE_S, _kill_if_running, (proc,))
            killer.daemon = True
            killer.start()

    def _run(self, job: ConvertJob) -> ConvertProgress:
        try:
            return self._convert(job)
        except Exception as exc:                         # a bug: say so, keep the finished layers
            log.exception("conversion %s crashed", job.id)
            return ConvertProgress(job.id, JobState.FAILED, "convert", 0, job.layers,
                                   f"Unexpected error: {exc.__class__.__name__}: {exc}")
        finally:
            with self._cv:
                self._proc = None

    def _command(self, job: ConvertJob, src: Path, out: Path) -> list[str]:
        if job.kind == "import":
            return [*self.import_cmd, str(src), "--out", str(out), "--bpw", f"{job.bpw:g}"]
        return [*self.command, "--model", str(src), "--bpw", f"{job.bpw:g}", "--out", str(out),
                "--head-bits", str(CONVERT_HEAD_BITS)]

    def _convert(self, job: ConvertJob) -> ConvertProgress:
        src, out = self.source_dir(job), self.out_dir(job)
        if out.exists():
            return self._finished(job)
        try:
            if not self.partial_dir(job).exists():
                check_space(self.models_dir, output_bytes(weight_bytes(src), job.bpw, job.kind),
                            f"{job.kind} {job.source}", self.margin_bytes)
        except (HubError, OSError) as exc:
            return ConvertProgress(job.id, JobState.FAILED, "convert", 0, job.layers, str(exc))
        done, total = self._partial_state()[job.id], job.layers
        with self._cv:
            if self._stop_reason.get(job.id):
                return self._stopped(job, done)
            self._proc = subprocess.Popen(self._command(job, src, out), stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True, encoding="utf-8", errors="replace",
                                          env=worker_env(), bufsize=1)
            proc = self._proc
        self._emit(ConvertProgress(job.id, JobState.RUNNING, "convert", done, total,
                                   f"{_VERB[job.kind]}: layer {done} of {total} done"))
        done, total, error, last = self._follow(job, proc, done, total)
        code = proc.wait()
        if self._stop_reason.get(job.id):
            return self._stopped(job, done)
        if code == 0 and out.is_dir():
            return self._finished(job)
        if not error:
            error = (f"The {'import' if job.kind == 'import' else 'converter'} stopped unexpectedly (exit code "
                     f"{code}{': ' + last if last else ''}). Press Resume: it continues after the last finished layer.")
        return ConvertProgress(job.id, JobState.FAILED, "convert", done, total, error)

    def _follow(self, job: ConvertJob, proc, done: int, total: int) -> tuple[int, int, str, str]:
        """Read the process's lines until it ends: layer events with the time left (from this run's own layers),
        the error line, the rest to the log. -> (layers done, total, error in words, last line)."""
        error, tail, start = "", deque(maxlen=20), None
        for line in proc.stdout:
            line = line.rstrip()
            tail.append(line)
            m = _LAYER.match(line) or _RESUME.match(line)
            if m:
                done, total = int(m.group(1)), int(m.group(2))
                eta = None
                if m.re is _RESUME or start is None:
                    start = (time.monotonic(), done)         # the first layer of this run starts the clock
                elif done > start[1]:
                    eta = (time.monotonic() - start[0]) / (done - start[1]) * (total - done)
                what = "Resuming after layer" if m.re is _RESUME else f"{_VERB[job.kind]}: layer"
                self._emit(ConvertProgress(job.id, JobState.RUNNING, "convert", done, total,
                                           f"{what} {done} of {total} done", eta))
            elif _ERROR.match(line):
                error = _explain(_ERROR.sub("", line))
            elif line:                                   # the allocation used and why, the CPU threads, notes
                log.info("%s %s: %s", job.kind, job.id, line)
        return done, total, error, next((t for t in reversed(tail) if t.strip()), "")

    def _stopped(self, job: ConvertJob, done: int) -> ConvertProgress:
        if self._stop_reason.get(job.id) == "cancel":
            return self._cancelled(job)
        return replace(self._paused(job, f"Paused after layer {done}: press Resume to continue."), done=done)

    def _finished(self, job: ConvertJob) -> ConvertProgress:
        if job.hub:                                      # the original is not needed any more
            shutil.rmtree(self.source_dir(job), ignore_errors=True)
        self._record(job.id).unlink(missing_ok=True)
        return ConvertProgress(job.id, JobState.DONE, "convert", job.layers, job.layers,
                               f"{'Imported' if job.kind == 'import' else 'Converted'}: {job.id} is in the model list.")
