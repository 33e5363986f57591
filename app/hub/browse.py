"""Browse the Hub for EXL2 quants: search repos, list their branches with bits per weight and download size.
GPTQ-family builds (GPTQ, AutoRound, AWQ) of the architectures the import takes are listed too (`Quant.kind`
"import"): downloaded, then imported into EXL2 (app/hub/convert.py).

EXL2 repos keep one quant per git branch (`4.0bpw`, `6_5`, `8.0bpw-h8`...). A branch counts as a quant when
its tree holds `.safetensors` files. Bits per weight come from config.json's `quantization_config` when
present, otherwise from the branch name.

Hub answers are untrusted: a commit id must be 40 hex digits (it goes into URLs and the download manifest),
file sizes must be whole numbers, and config.json is read into memory, never through huggingface_hub's cache
(whose paths come from the revision, the X-Repo-Commit header and the ETag the endpoint sends).
"""
from __future__ import annotations

import io
import json
import re
from dataclasses import dataclass, field
from fnmatch import fnmatch

from huggingface_hub import HfApi, constants, get_session, hf_hub_url
from huggingface_hub.errors import OfflineModeIsEnabled
from huggingface_hub.file_download import http_get
from huggingface_hub.hf_api import RepoFile
from huggingface_hub.utils import build_hf_headers

from app.hub.errors import HubAccessError, HubError, TooLargeError, translate

from runtime import gptq_spec, tuning
from runtime.errors import ModelFolderError
from runtime.options import IMPORT_ARCHITECTURES

# Never downloaded: pickled checkpoints are never loaded (safetensors only) and GGUF is another format.
IGNORED_PATTERNS = ("*.bin", "*.pt", "*.pth", "*.pkl", "*.ckpt", "*.gguf", "*.msgpack", "*.h5")

CONFIG_MAX_BYTES = 4 << 20        # a config.json is kilobytes; more is not read
GPTQ_WORDS = ("gptq", "autoround", "auto-round", "awq", "int4", "int8")   # in the names of GPTQ-family builds
_COMMIT = re.compile(r"[0-9a-f]{40}")          # a git commit id, or a git blob id
_SHA256 = re.compile(r"[0-9a-f]{64}")
_BRANCH_BPW = re.compile(r"^(?:b)?(\d{1,2})(?:[._](\d{1,3}))?\s*(?:bpw|b)?(?:[-_]?h(?:b)?(\d{1,2}))?$", re.I)


def parse_branch_bpw(branch: str) -> tuple[float | None, float | None]:
    """Bits per weight and head bits from a branch name: "4.0bpw" -> (4.0, None), "6_5" -> (6.5, None),
    "8.0bpw-h8" -> (8.0, 8.0), "3bpw" -> (3.0, None); (None, None) for "main" or anything else."""
    m = _BRANCH_BPW.match(branch.strip())
    if not m:
        return None, None
    bpw = float(f"{m.group(1)}.{m.group(2) or 0}")
    if not 1.0 <= bpw <= 16.0:
        return None, None
    return bpw, (float(m.group(3)) if m.group(3) else None)


def endpoint() -> str:
    """The Hub address: HF_ENDPOINT read now (huggingface_hub reads it once, at import)."""
    return (tuning.hf_endpoint() or constants.ENDPOINT).rstrip("/")


def checked_commit(commit: object, where: str) -> str:
    """`commit` when it is a git commit id (40 lowercase hex digits), else a `HubError` naming `where`."""
    if not isinstance(commit, str) or not _COMMIT.fullmatch(commit):
        raise HubError(f"The Hub returned {str(commit)[:80]!r} as the commit of {where}: not a commit id. "
                       "Refusing the listing.")
    return commit


def checked_file(f: RemoteFile, where: str) -> RemoteFile:
    """`f` when its path is text, its size a byte count and its hash of the form it is checked against once
    downloaded; else a `HubError` naming `where` (a listing, a download manifest)."""
    if not isinstance(f.path, str) or isinstance(f.size, bool) or not isinstance(f.size, int) or f.size < 0:
        raise HubError(f"{where} gives {str(f.size)[:80]!r} as the size of {str(f.path)[:200]!r}: not a byte count. "
                       "Refusing it.")
    digest, pattern = (f.sha256, _SHA256) if f.sha256 is not None else (f.blob_id, _COMMIT)
    if not isinstance(digest, str) or not pattern.fullmatch(digest):
        raise HubError(f"{where} gives {str(digest)[:80]!r} as the hash of {f.path}: not a hash. Refusing it.")
    return f


class LimitedWriter:
    """A binary file stand-in for `http_get` that refuses to grow past `limit` bytes: the bytes the Hub lists
    for the file. Raises `TooLargeError` before writing the chunk that would pass it."""

    def __init__(self, fh, limit: int, path: str):
        self.fh, self.limit, self.path = fh, limit, path

    def write(self, chunk: bytes) -> int:
        if self.fh.tell() + len(chunk) > self.limit:
            raise TooLargeError(f"{self.path}: the server sent more than the {self.limit} bytes the Hub lists. "
                                "Stopped and discarded.", self.path, str(self.limit),
                                f"more than {self.limit}")
        return self.fh.write(chunk)

    def __getattr__(self, name):               # tell, seek, truncate: the file's own
        return getattr(self.fh, name)


def ended_short(exc: BaseException) -> bool:
    """True for `http_get`'s own size check: the response ended, complete by its own framing, short of the
    expected size (a plain OSError with no errno; the disk's errors carry one, HTTP errors are subclasses)."""
    return type(exc) is OSError and exc.errno is None


def is_ignored(path: str) -> bool:
    return any(fnmatch(path.rsplit("/", 1)[-1], pat) for pat in IGNORED_PATTERNS)


@dataclass(frozen=True)
class RepoSummary:
    repo_id: str
    downloads: int
    likes: int
    gated: bool
    tags: tuple[str, ...] = ()


@dataclass(frozen=True)
class RemoteFile:
    path: str              # as listed by the Hub: untrusted until `staging.safe_relpath` accepts it
    size: int
    sha256: str | None     # LFS files: the sha256 of the content
    blob_id: str           # git blob id (sha1 of "blob <size>\0" + content) for non-LFS files


@dataclass(frozen=True)
class Quant:
    repo_id: str
    branch: str
    commit: str
    bpw: float | None
    head_bits: float | None
    files: tuple[RemoteFile, ...]
    config: dict = field(default_factory=dict, compare=False)
    access: str = ""           # non-empty: why the files cannot be fetched now (gated repo without a token)
    kind: str = "exl2"         # "exl2", or "import": a GPTQ-family build, imported into EXL2 once downloaded
    label: str = ""            # an import's: "INT4 (GPTQ)"
    refusal: str = ""          # an import's: why it cannot be imported (the field named), or ""

    @property
    def size_bytes(self) -> int:
        return sum(f.size for f in self.files)


def sign_in(token: str) -> str:
    """Check `token` with the Hub and keep it in huggingface_hub's own token store; returns the user name.

    Every later call (listing, downloads) picks it up from there. The token itself is never logged.
    """
    from huggingface_hub import login

    token = token.strip()
    try:
        user = HfApi(endpoint=endpoint()).whoami(token=token)["name"]
        login(token=token, add_to_git_credential=False, skip_if_logged_in=False)
        return user
    except ValueError as exc:
        raise HubAccessError(f"Sign-in refused: {exc}") from None
    except Exception as exc:
        error = translate(exc, "checking the token")
        status = getattr(getattr(exc, "response", None), "status_code", None)
        if isinstance(error, HubAccessError) or status in (401, 403):
            raise HubAccessError("Sign-in refused: the Hub does not accept this token. Copy a token from "
                                 "your Hugging Face account settings (Access Tokens) and try again.") from None
        raise error from None


class HubClient:
    """Thin layer over `HfApi` that returns plain dataclasses and raises `HubError`s with clear messages."""

    def __init__(self, token: str | bool | None = None, hub_endpoint: str | None = None):
        self.endpoint = hub_endpoint or endpoint()
        self.token = token            # None: huggingface_hub's own stored token (login / HF_TOKEN), if any
        self.api = HfApi(endpoint=self.endpoint, token=token, library_name="moedesk")

    def check_online(self, what: str, timeout: float = 5.0) -> None:
        """Raise `HubOffline` at once when the Hub is unreachable (huggingface_hub would retry for ~20 s)."""
        try:
            if constants.is_offline_mode():
                raise OfflineModeIsEnabled("HF_HUB_OFFLINE is set")
            get_session().head(self.endpoint, timeout=timeout)
        except Exception as exc:
            raise translate(exc, what) from exc

    def search(self, query: str = "", limit: int = 50) -> list[RepoSummary]:
        """Repos tagged `exl2`, then repos with "exl2" in their name, then GPTQ-family builds (GPTQ, AutoRound,
        AWQ in their name: imported once downloaded), most downloaded first."""
        self.check_online(f"searching for {query!r}")
        found: dict[str, RepoSummary] = {}
        try:
            for tagged, words, default in ((True, ("",), "exl2"), (False, ("exl2",), "exl2"),
                                           (False, GPTQ_WORDS, "gptq")):
                kwargs = {"filter": "exl2"} if tagged else {}
                for m in self.api.list_models(search=query or default, sort="downloads", limit=limit, **kwargs):
                    if tagged or any(w in m.id.lower() for w in words):
                        found.setdefault(m.id, RepoSummary(m.id, m.downloads or 0, m.likes or 0,
                                                           bool(m.gated), tuple(m.tags or ())))
        except Exception as exc:
            raise translate(exc, f"searching the Hub for {query!r}") from exc
        return sorted(found.values(), key=lambda r: -r.downloads)[:limit]

    def quants(self, repo_id: str) -> list[Quant]:
        """Every branch of `repo_id` that holds safetensors, with its bits per weight and size."""
        self.check_online(f"listing the branches of {repo_id}")
        try:
            refs = self.api.list_repo_refs(repo_id)
        except Exception as exc:
            raise translate(exc, f"listing the branches of {repo_id}") from exc
        out = []
        for ref in refs.branches:
            quant = self.quant(repo_id, ref.name, checked_commit(ref.target_commit, f"{repo_id} at {ref.name}"))
            if quant is not None:
                out.append(quant)
        return sorted(out, key=lambda q: (q.bpw is None, q.bpw or 0.0, q.branch))

    def quant(self, repo_id: str, branch: str, commit: str | None = None) -> Quant | None:
        what = f"listing the files of {repo_id} at {branch}"
        try:
            if commit is None:
                commit = self.api.model_info(repo_id, revision=branch).sha
            checked_commit(commit, f"{repo_id} at {branch}")
            tree = [f for f in self.api.list_repo_tree(repo_id, recursive=True, revision=commit)
                    if isinstance(f, RepoFile)]
        except Exception as exc:
            raise translate(exc, what) from exc
        if any(not isinstance(f.size, int) or f.size < 0 for f in tree):
            raise HubError(f"The Hub listed a file size that is not a byte count while {what}. Refusing the listing.")
        files = tuple(checked_file(RemoteFile(f.path, f.size, f.lfs.sha256 if f.lfs else None, f.blob_id),
                                   f"The Hub's listing of {repo_id} at {branch}")
                      for f in tree if not is_ignored(f.path))
        if not any(f.path.endswith(".safetensors") for f in files):
            return None
        config, access = {}, ""
        listed = next((f for f in files if f.path == "config.json"), None)
        if listed is not None:
            try:
                config = self._config(repo_id, commit, listed.size)
            except HubAccessError as exc:       # gated: the listing is public, the files are not
                access = str(exc)
        bpw, head_bits = parse_branch_bpw(branch)
        if gptq_spec.quant_method(config) in gptq_spec.METHODS:
            return self._gptq_build(Quant(repo_id, branch, commit, None, None, files, config, access))
        qc = config.get("quantization_config") or {}
        if isinstance(qc, dict) and qc.get("quant_method") == "exl2":
            try:
                bpw = float(qc.get("bits") or bpw or 0) or bpw
                head_bits = float(qc.get("head_bits") or head_bits or 0) or head_bits
            except (TypeError, ValueError):
                pass                            # not numbers: the branch name's figures stand
        return Quant(repo_id, branch, commit, bpw, head_bits, files, config, access)

    @staticmethod
    def _gptq_build(quant: Quant) -> Quant:
        """A GPTQ-family branch: its label, the bits per weight its experts will store once imported (codes, and a
        4-bit EXL2 scale per column of each group), or why it cannot be imported."""
        import dataclasses
        config = quant.config
        archs = config.get("architectures") if isinstance(config.get("architectures"), list) else []
        try:
            spec = gptq_spec.read_spec(config, "config.json")
        except ModelFolderError as exc:
            return dataclasses.replace(quant, kind="import", label="GPTQ-family", refusal=exc.problem)
        if not any(a in IMPORT_ARCHITECTURES for a in archs):
            return dataclasses.replace(quant, kind="import", label=spec.label,
                                       refusal=f"architecture {', '.join(map(str, archs)) or '?'} is not imported")
        group = spec.group_size if spec.group_size > 0 else 4096
        return dataclasses.replace(quant, kind="import", label=spec.label, bpw=round(spec.bits + 4 / group, 3))

    def _config(self, repo_id: str, commit: str, size: int) -> dict:
        """config.json at `commit`, read into memory (at most its listed `size`, itself bounded)."""
        where = f"config.json of {repo_id} at {commit[:8]}"
        if size > CONFIG_MAX_BYTES:
            raise HubError(f"{where} is listed at {size} bytes: too large for a config, not read.")
        buffer = io.BytesIO()
        try:
            http_get(hf_hub_url(repo_id, "config.json", revision=commit, endpoint=self.endpoint),
                     LimitedWriter(buffer, size, "config.json"), expected_size=size,
                     headers=build_hf_headers(token=self.token, library_name="moedesk"))
            config = json.loads(buffer.getvalue().decode("utf-8"))
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            raise HubError(f"{where} is not valid JSON: {exc}") from exc
        except HubError as exc:
            raise HubError(f"{where}: {exc}") from exc
        except Exception as exc:
            if ended_short(exc):
                raise HubError(f"{where} is shorter than the Hub lists ({size} bytes).") from exc
            raise translate(exc, f"reading config.json of {repo_id}") from exc
        return config if isinstance(config, dict) else {}
