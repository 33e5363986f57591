"""A fake Hugging Face Hub: a real HTTP server on 127.0.0.1 speaking the routes huggingface_hub uses.

Routes: GET /api/whoami-v2 (token check), GET /api/models (search, filter), GET /api/models/{repo}[/revision/{rev}] (model info),
GET /api/models/{repo}/refs, GET /api/models/{repo}/tree/{rev}[/{path}] (recursive listing with LFS
metadata), HEAD and GET /{repo}/resolve/{rev}/{path} (ETag, X-Repo-Commit, X-Linked-Etag, X-Linked-Size,
Range requests). Errors carry the X-Error-Code header huggingface_hub maps to its exceptions.

Faults (`FakeHub.faults`), applied to GETs of a file, each used `times` times:
  close   — send the bytes before offset `at`, then drop the connection
  error   — answer HTTP `status` (500) instead of the file
  stall   — send the bytes before `at`, wait `seconds`, then drop the connection
  corrupt — flip the byte at offset `at`
  flood   — no Content-Length, then `at` bytes of b"A" (the file's listed size means nothing to it)
The server logs every request (`FakeHub.log`) so tests can check Range headers and what was fetched.

A hostile hub: `Branch(commit=...)` may be any string (a traversal such as `../../x`), and
`FakeHub.lie_headers` overrides response headers of file routes (ETag, X-Repo-Commit...) with any value,
`FakeHub.lie_sizes` and `FakeHub.lie_oids` make the tree listing claim other sizes and hashes than the files served,
`Fault(kind="flood")` streams `at` bytes with no Content-Length whatever the file's size.
"""
from __future__ import annotations

import functools
import hashlib
import json
import re
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit


LFS_MIN_SIZE = 1024          # like the Hub: weights (and big files) are LFS


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Branch:
    name: str
    files: dict[str, bytes]
    commit: str = ""

    def __post_init__(self):
        if not self.commit:
            h = hashlib.sha1(self.name.encode())
            for path in sorted(self.files):
                h.update(path.encode() + hashlib.sha256(self.files[path]).digest())
            self.commit = h.hexdigest()


@dataclass
class Repo:
    repo_id: str
    branches: dict[str, Branch]
    tags: list[str] = field(default_factory=list)
    downloads: int = 0
    token: str | None = None          # set: files need "Authorization: Bearer <token>" (a gated repo)


@dataclass
class Fault:
    path: str
    kind: str                          # close | error | stall | corrupt | flood
    at: int = 0
    times: int = 1
    status: int = 500
    seconds: float = 0.0
    sent: list[int] = field(default_factory=list)    # flood: bytes written per request before the client left


@dataclass
class Request:
    method: str
    path: str
    range: str | None
    authorized: bool


class FakeHub:
    def __init__(self):
        self.repos: dict[str, Repo] = {}
        self.faults: list[Fault] = []
        self.log: list[Request] = []
        self.lock = threading.Lock()
        self.lie_headers: dict[str, str] = {}   # headers of file answers replaced with these (a hostile hub)
        self.lie_sizes: dict[str, int] = {}     # file path -> the size the tree listing claims instead of the truth
        self.lie_oids: dict[str, object] = {}   # file path -> the git blob id (or LFS sha256) the listing claims
        self.valid_tokens: set[str] = set()  # tokens /api/whoami-v2 accepts (login checks them there)
        self.connections: set = set()       # open client sockets, closed by stop() like a vanished host
        self.server: ThreadingHTTPServer | None = None
        self.url = ""

    def add(self, repo: Repo) -> Repo:
        self.repos[repo.repo_id] = repo
        return repo

    def start(self) -> str:
        hub = self

        class Handler(_Handler):
            pass
        Handler.hub = hub
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        return self.url

    def stop(self):
        if self.server:
            self.server.shutdown()
            self.server.server_close()
            with self.lock:
                for conn in list(self.connections):
                    try:
                        conn.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                self.connections.clear()

    def take_fault(self, path: str) -> Fault | None:
        with self.lock:
            for f in self.faults:
                if f.path == path and f.times > 0:
                    f.times -= 1
                    return f
        return None

    def gets(self, path_suffix: str) -> list[Request]:
        return [r for r in self.log if r.method == "GET" and r.path.endswith(path_suffix)]


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    hub: FakeHub

    def log_message(self, *args):
        pass

    def setup(self):
        super().setup()
        with self.hub.lock:
            self.hub.connections.add(self.connection)

    def finish(self):
        with self.hub.lock:
            self.hub.connections.discard(self.connection)
        super().finish()

    # -- plumbing
    def _send(self, status: int, body: bytes = b"", headers: dict | None = None, head: bool = False):
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head and self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, obj, headers=None):
        self._send(200, json.dumps(obj).encode(), {"Content-Type": "application/json", **(headers or {})})

    def _error(self, status: int, code: str, message: str, head=False, commit: str | None = None):
        headers = {"X-Error-Code": code, "X-Error-Message": message, "Content-Type": "application/json"}
        if commit:
            headers["X-Repo-Commit"] = commit
        self._send(status, json.dumps({"error": message}).encode(), headers, head)

    def do_HEAD(self):
        self._route("HEAD")

    def do_GET(self):
        self._route("GET")

    def _route(self, method: str):
        url = urlsplit(self.path)
        parts = [unquote(p) for p in url.path.split("/") if p]
        auth = self.headers.get("authorization", "")
        self.hub.log.append(Request(method, url.path, self.headers.get("Range"), bool(auth)))
        query = parse_qs(url.query)
        if not parts:
            return self._send(200, b"fake hub", {"Content-Type": "text/plain"})
        if parts == ["api", "whoami-v2"]:
            token = auth.removeprefix("Bearer ")
            if token not in self.hub.valid_tokens:
                return self._send(401, b'{"error": "Invalid credentials"}',
                                  {"X-Error-Message": "Invalid credentials in Authorization header"})
            return self._json({"type": "user", "name": "tester",
                               "auth": {"accessToken": {"displayName": "moedesk-test", "role": "read"}}})
        if parts[:2] == ["api", "models"]:
            if len(parts) == 2:
                return self._search(query)
            repo = self.hub.repos.get("/".join(parts[2:4]))
            if repo is None:
                return self._error(401, "RepoNotFound", "Repository not found")
            rest = parts[4:]
            if not rest:
                return self._info(repo, "main")
            if rest[0] == "revision" and len(rest) == 2:
                return self._info(repo, rest[1])
            if rest == ["refs"]:
                return self._json({"branches": [{"name": b.name, "ref": f"refs/heads/{b.name}",
                                                 "targetCommit": b.commit} for b in repo.branches.values()],
                                   "converts": [], "tags": []})
            if rest[0] == "tree" and len(rest) >= 2:
                return self._tree(repo, rest[1], "/".join(rest[2:]))
        if len(parts) >= 5 and parts[2] == "resolve":
            repo = self.hub.repos.get("/".join(parts[:2]))
            if repo is None:
                return self._error(401, "RepoNotFound", "Repository not found", method == "HEAD")
            return self._resolve(repo, parts[3], "/".join(parts[4:]), method, auth)
        self._error(404, "NotFound", f"no route for {url.path}")

    def _branch(self, repo: Repo, rev: str) -> Branch | None:
        for b in repo.branches.values():
            if rev in (b.name, b.commit):
                return b
        return None

    # -- API routes
    def _search(self, query):
        search = (query.get("search") or [""])[0].lower()
        filters = query.get("filter") or []
        limit = int((query.get("limit") or ["1000"])[0])
        hits = [r for r in self.hub.repos.values()
                if search in r.repo_id.lower() and all(f in r.tags for f in filters)]
        hits.sort(key=lambda r: -r.downloads)
        self._json([{"id": r.repo_id, "_id": r.repo_id, "modelId": r.repo_id, "author": r.repo_id.split("/")[0],
                     "downloads": r.downloads, "likes": 0, "tags": r.tags, "private": False,
                     "gated": "manual" if r.token else False} for r in hits[:limit]])

    def _info(self, repo: Repo, rev: str):
        b = self._branch(repo, rev)
        if b is None:
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
        self._json({"id": repo.repo_id, "_id": repo.repo_id, "modelId": repo.repo_id, "sha": b.commit,
                    "tags": repo.tags, "private": False, "gated": "manual" if repo.token else False,
                    "downloads": repo.downloads, "siblings": [{"rfilename": p} for p in sorted(b.files)]})

    def _tree(self, repo: Repo, rev: str, prefix: str):
        b = self._branch(repo, rev)
        if b is None:
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
        entries, dirs = [], set()
        for path in sorted(b.files):
            if prefix and not path.startswith(prefix.rstrip("/") + "/"):
                continue
            data = b.files[path]
            size = self.hub.lie_sizes.get(path, len(data))
            oid = self.hub.lie_oids.get(path)
            entry = {"type": "file", "path": path, "size": size, "oid": oid if oid is not None else git_blob_id(data)}
            if len(data) >= LFS_MIN_SIZE:
                entry["lfs"] = {"oid": oid if oid is not None else hashlib.sha256(data).hexdigest(), "size": size,
                                "pointerSize": 134}
            entries.append(entry)
            for i in range(1, path.count("/") + 1):
                dirs.add("/".join(path.split("/")[:i]))
        entries += [{"type": "directory", "path": d, "oid": git_blob_id(d.encode())} for d in sorted(dirs)]
        self._json(entries)

    # -- file downloads
    def _resolve(self, repo: Repo, rev: str, path: str, method: str, auth: str):
        head = method == "HEAD"
        if repo.token and auth != f"Bearer {repo.token}":
            return self._error(403 if auth else 401, "GatedRepo", "Access to this model is restricted", head)
        b = self._branch(repo, rev)
        if b is None:
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}", head)
        if path not in b.files:
            return self._error(404, "EntryNotFound", f"{path} does not exist", head, commit=b.commit)
        data = b.files[path]
        lfs = len(data) >= LFS_MIN_SIZE
        etag = hashlib.sha256(data).hexdigest() if lfs else git_blob_id(data)
        headers = {"ETag": f'"{etag}"', "X-Repo-Commit": b.commit, "Accept-Ranges": "bytes",
                   "Content-Type": "application/octet-stream"}
        if lfs:
            headers.update({"X-Linked-Etag": f'"{etag}"', "X-Linked-Size": str(len(data))})
        headers.update(self.hub.lie_headers)
        fault = None if head else self.hub.take_fault(path)
        if fault and fault.kind == "error":
            return self._error(fault.status, "ServerError", "injected failure")
        if fault and fault.kind == "flood":
            return self._flood(fault, headers)
        start = 0
        rng = self.headers.get("Range")
        status = 200
        if rng and rng.startswith("bytes="):
            first, _, last = rng[6:].partition("-")
            start = int(first)
            end = int(last) if last else len(data) - 1
            if start >= len(data):
                return self._send(416, b"", {"Content-Range": f"bytes */{len(data)}"}, head)
            status = 206
            headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
            body = data[start:end + 1]
        else:
            body = data
        if fault and fault.kind == "corrupt" and start <= fault.at < start + len(body):
            i = fault.at - start
            body = body[:i] + bytes([body[i] ^ 0xFF]) + body[i + 1:]
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if head:
            return
        if fault and fault.kind in ("close", "stall"):
            cut = max(fault.at - start, 0)
            self.wfile.write(body[:cut])
            self.wfile.flush()
            if fault.kind == "stall":
                time.sleep(fault.seconds)
            self.close_connection = True
            return
        self.wfile.write(body)

    def _flood(self, fault: Fault, headers: dict):
        """`fault.at` bytes with no Content-Length (the end is where the server closes the connection); the
        bytes written before the client hung up are appended to `fault.sent`."""
        self.send_response(200)
        for k, v in headers.items():
            self.send_header(k, v)
        self.end_headers()
        self.close_connection = True
        block, sent = b"A" * (1 << 16), 0
        try:
            while sent < fault.at:
                self.wfile.write(block[:fault.at - sent])
                sent += min(len(block), fault.at - sent)
        except OSError:
            pass                              # the client hung up: what a client that stops in time does
        fault.sent.append(sent)


# ------------------------------------------------------------------------------------------------
# A tiny EXL2 repo: a 2-layer Qwen3-MoE shape, real safetensors files of random EXL2-shaped tensors.

TINY_CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 64,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "intermediate_size": 128, "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2,
    "vocab_size": 1024, "tie_word_embeddings": False, "max_position_embeddings": 2048,
    "torch_dtype": "float16", "rms_norm_eps": 1e-6,
}


def tiny_tokenizer_json(vocab_size: int = 1024, salt: str = "") -> bytes:
    vocab = {f"<{salt}{i}>": i for i in range(vocab_size)}
    return json.dumps({"version": "1.0", "added_tokens": [], "normalizer": None, "pre_tokenizer": None,
                       "model": {"type": "BPE", "vocab": vocab, "merges": []}}).encode()


@functools.lru_cache(maxsize=None)
def exl2_safetensors(bits: float, seed: int, head_bits: int = 6) -> bytes:
    """A valid EXL2 model of TINY_CONFIG's shape (random weights, round-to-nearest quantized)."""
    import torch
    from safetensors.torch import save

    from runtime.exl2.format import quantize
    from runtime.modelfolder import layout

    gen = torch.Generator().manual_seed(seed)
    lay = layout(TINY_CONFIG)
    tensors = {name: (torch.randn(shape, generator=gen) * 0.02 + (1.0 if name.endswith("norm.weight") else 0.0))
               .to(torch.float16) for name, shape in lay.plain.items()}
    quantized: dict[str, dict] = {}            # one quantized weight per kind, reused across layers and experts
    for prefix, (out, inp) in lay.linears.items():
        if prefix.endswith("mlp.gate"):                                 # the router stays FP16
            tensors[f"{prefix}.weight"] = (torch.randn(out, inp, generator=gen) * 0.05).to(torch.float16)
            continue
        kind = re.sub(r"\.\d+\.", ".#.", prefix)
        if kind not in quantized:
            w = torch.randn(out, inp, generator=gen) * 0.05
            quantized[kind] = quantize(w, head_bits if prefix == "lm_head" else bits, 32, name=prefix)
        tensors.update({f"{prefix}.{k}": v.clone() for k, v in quantized[kind].items()})
    return save(tensors, metadata={"format": "pt"})


def exl2_branch(name: str, bits: float, seed: int, head_bits: int = 6) -> Branch:
    config = dict(TINY_CONFIG, quantization_config={"quant_method": "exl2", "version": "0.3.2",
                                                    "bits": bits, "head_bits": head_bits})
    return Branch(name, {
        "config.json": json.dumps(config, indent=2).encode(),
        "tokenizer.json": tiny_tokenizer_json(),
        "tokenizer_config.json": b'{"eos_token": "<255>"}',
        "model.safetensors": exl2_safetensors(bits, seed, head_bits),
        "README.md": f"# tiny exl2 {name}\n".encode(),
    })


def tiny_exl2_repo(repo_id: str = "tester/Tiny-MoE-exl2", token: str | None = None) -> Repo:
    return Repo(repo_id, {
        "main": Branch("main", {"README.md": b"# Tiny MoE, EXL2 quants on branches\n",
                                "measurement.json": b'{"measurement": {}}'}),
        "4.0bpw": exl2_branch("4.0bpw", 4.0, seed=1),
        "6_5": exl2_branch("6_5", 6.5, seed=2),
    }, tags=["exl2", "safetensors", "qwen3_moe"], downloads=10, token=token)


# ------------------------------------------------------------------------------------------------
# pytest fixture: import it into a test module (`from fakehub import fake_hub`).

import pytest  # noqa: E402


@pytest.fixture
def fake_hub(monkeypatch, tmp_path):
    """The tiny repo served on loopback; huggingface_hub pointed at it, online, with an empty token store."""
    from huggingface_hub import constants, hf_api

    hub = FakeHub()
    hub.add(tiny_exl2_repo())
    url = hub.start()
    monkeypatch.setenv("HF_ENDPOINT", url)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    # huggingface_hub reads these once, at import: point the module values at the fake hub and a temp home.
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(hf_api.api, "endpoint", url)       # the module-level HfApi behind whoami(), login()
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "hf" / "token"))
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(tmp_path / "hf" / "stored_tokens"))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.setattr(constants, "AGENT_HARNESSES_PATH", str(tmp_path / "hf" / "agent_harnesses.json"))
    yield hub
    hub.stop()
