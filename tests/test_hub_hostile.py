"""A hostile Hub on loopback: commit ids and ETags that are paths, listings that lie about sizes, a server that
never stops sending. Nothing may be written outside the models folder and the cache, and nothing half-received
may be left behind where a resume cannot use it."""
import json
import os
import time
from pathlib import Path

import pytest
from fakehub import Branch, Fault, Repo, fake_hub, tiny_exl2_repo  # noqa: F401 (fake_hub is a fixture)

from app.hub import download, staging
from app.hub.browse import HubClient
from app.hub.download import JobState, RetryPolicy
from app.hub.errors import HubError
from app.hub.queue import DownloadManager
from runtime import paths

FAST_RETRY = RetryPolicy(attempts=3, base_s=0.02, max_s=0.05)
GOOD = tiny_exl2_repo().branches["4.0bpw"].files


@pytest.fixture
def hub(fake_hub, monkeypatch):
    monkeypatch.setattr(download, "CHUNK_BYTES", 16 * 1024)
    return fake_hub


@pytest.fixture
def outside(tmp_path):
    """A sentinel file outside the app's folders, and a check that nothing outside them changed."""
    sentinel = tmp_path / "sentinel.txt"
    sentinel.write_text("original")
    allowed = (paths.models_dir(), paths.cache_dir())

    def snapshot():
        return {p: p.read_bytes() for p in tmp_path.rglob("*")
                if p.is_file() and not any(p.is_relative_to(a) for a in allowed)}
    before = snapshot()

    def unchanged():
        assert sentinel.read_text() == "original"
        assert snapshot() == before
    unchanged.sentinel = sentinel
    return unchanged


def manager(events=None) -> DownloadManager:
    return DownloadManager(on_event=(events.append if events is not None else None), models_dir=paths.models_dir(),
                           retry=FAST_RETRY, margin_bytes=0)


def run(quant, events=None):
    m = manager(events)
    job = m.enqueue(quant)
    final = m.wait(job.id, timeout=60)
    m.shutdown()
    return job, final


def relpath_to(target: Path, start: Path) -> str:
    return os.path.relpath(target, start)


# -- commit ids and ETags: values from the network that libraries turn into paths

def test_a_commit_id_that_is_a_path_is_refused(hub, outside):
    store = paths.cache_dir() / "hub" / "models--evil--Model-exl2"
    commit = relpath_to(outside.sentinel, store / "refs")          # huggingface_hub's cache: refs/<revision>
    hub.add(Repo("evil/Model-exl2", {"4.0bpw": Branch("4.0bpw", GOOD, commit=commit)}, tags=["exl2"]))
    hub.lie_headers["X-Repo-Commit"] = "0123456789abcdef0123456789abcdef01234567"
    with pytest.raises(HubError, match=r"evil/Model-exl2 .*4\.0bpw.* not a commit id"):
        HubClient().quants("evil/Model-exl2")
    with pytest.raises(HubError, match="not a commit id"):
        HubClient().quant("evil/Model-exl2", "4.0bpw")             # the commit from the model info route
    outside()


def test_hostile_etags_and_commit_headers_write_nothing_outside(hub, outside):
    blobs = paths.cache_dir() / "hub" / "models--tester--Tiny-MoE-exl2" / "blobs"
    evil = relpath_to(outside.sentinel, blobs)
    hub.lie_headers.update({"ETag": f'"{evil}"', "X-Linked-Etag": f'"{evil}"',
                            "X-Repo-Commit": relpath_to(outside.sentinel, blobs.parent / "refs")})
    q = next(q for q in HubClient().quants("tester/Tiny-MoE-exl2") if q.branch == "4.0bpw")
    assert q.bpw == 4.0 and q.config["num_experts"] == 8        # config.json read all the same
    job, final = run(q)
    assert final.state is JobState.DONE, final.message
    assert (paths.models_dir() / job.id / "config.json").read_bytes() == GOOD["config.json"]
    outside()


def test_a_manifest_with_a_forged_commit_is_not_resumed(tmp_path):
    models = paths.models_dir()
    stage = staging.staging_dir(models, "x--y--4.0bpw")
    stage.mkdir(parents=True)
    (stage / staging.MANIFEST).write_text('{"repo_id": "x/y", "branch": "4.0bpw", "commit": "../../etc", '
                                          '"files": []}')
    assert staging.staged_jobs(models) == []


GOOD_FILE = {"path": "config.json", "size": 10, "sha256": None, "blob_id": "0" * 40}


@pytest.mark.parametrize("manifest", [
    {"files": [{**GOOD_FILE, "size": "abc"}]}, {"files": [{**GOOD_FILE, "size": -1}]},
    {"files": [{**GOOD_FILE, "size": True}]}, {"files": [{**GOOD_FILE, "path": 5}]},
    {"files": [{**GOOD_FILE, "blob_id": "abc"}]}, {"files": [{**GOOD_FILE, "sha256": ["x"]}]},
    {"files": [{**GOOD_FILE, "extra": 1}]}, {"files": [[1]]}, {"files": {"a": 1}}, {"repo_id": ["x"]},
    {"branch": None}, {"bpw": "4"}, {"commit": 7}, "[1]", "\xff\xfe", "[" * 100_000,
])
def test_a_damaged_manifest_does_not_stop_the_model_manager(qtbot, tmp_path, manifest):
    """A size of "abc" once stopped the model manager from opening; the download it stood for is left alone."""
    from app.models_dialog import ModelManagerDialog
    models = paths.models_dir()
    good = {"repo_id": "x/y", "branch": "4.0bpw", "commit": "a" * 40, "bpw": 4.0, "files": [GOOD_FILE]}
    for name, data in (("x--y--4.0bpw", good), ("x--z--4.0bpw", manifest)):
        stage = staging.staging_dir(models, name)
        stage.mkdir(parents=True)
        text = json.dumps({**good, **data}) if isinstance(data, dict) else data
        (stage / staging.MANIFEST).write_bytes(text.encode("utf-8", "surrogateescape"))
    assert [job.id for job in staging.staged_jobs(models)] == ["x--y--4.0bpw"]
    d = ModelManagerDialog(models_dir=models)
    qtbot.addWidget(d)
    assert [p.job_id for p in d.manager.all()] == ["x--y--4.0bpw"]
    assert staging.staging_dir(models, "x--z--4.0bpw").is_dir()        # left alone, not deleted
    d.shutdown()


def test_an_oversized_config_is_not_read(hub):
    hub.repos["tester/Tiny-MoE-exl2"].branches["4.0bpw"].files["config.json"] = b" " * (5 << 20) + GOOD["config.json"]
    with pytest.raises(HubError, match="config.json of tester/Tiny-MoE-exl2 .* too large"):
        HubClient().quant("tester/Tiny-MoE-exl2", "4.0bpw")


@pytest.mark.parametrize("path, oid", [("README.md", "../../x"), ("model.safetensors", "abc"),
                                       ("config.json", 12), ("config.json", "F" * 40)])
def test_a_listing_whose_hashes_are_not_hashes_is_refused(hub, path, oid):
    hub.lie_oids[path] = oid
    with pytest.raises(HubError, match=f"{path}.* not a hash"):
        HubClient().quant("tester/Tiny-MoE-exl2", "4.0bpw")


# -- sizes: the listing is the bound

def test_a_server_that_never_stops_sending_is_cut_off_at_the_listed_size(hub, outside):
    listed = len(GOOD["README.md"])
    flood = Fault("README.md", "flood", at=48 << 20, times=99)    # no Content-Length, 48 MB for a tiny file
    hub.faults.append(flood)
    events = []
    job, final = run(next(q for q in HubClient().quants("tester/Tiny-MoE-exl2") if q.branch == "4.0bpw"), events)
    assert final.state is JobState.FAILED
    assert f"README.md: the server sent more than the {listed} bytes the Hub lists" in final.message
    deadline = time.monotonic() + 10      # the server's handler records the last request after the client left
    while len(flood.sent) < FAST_RETRY.attempts and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(flood.sent) == FAST_RETRY.attempts and max(flood.sent) < 16 << 20   # stopped, did not drain it
    part = staging.staging_dir(paths.models_dir(), job.id) / staging.PARTIAL / "README.md"
    assert not part.exists()                                    # the discarded bytes are gone
    assert not (paths.models_dir() / job.id).exists()
    outside()


def test_a_file_shorter_than_listed_leaves_no_partial_bytes(hub):
    data = GOOD["model.safetensors"]
    hub.lie_sizes["model.safetensors"] = len(data) + 4096        # the listing promises more than the server has
    job, final = run(next(q for q in HubClient().quants("tester/Tiny-MoE-exl2") if q.branch == "4.0bpw"))
    assert final.state is JobState.FAILED
    assert (f"model.safetensors is shorter than the Hub lists: the server sent {len(data)} of {len(data) + 4096} "
            "bytes") in final.message
    stage = staging.staging_dir(paths.models_dir(), job.id)
    assert not (stage / staging.PARTIAL / "model.safetensors").exists()
    assert (stage / "config.json").read_bytes() == GOOD["config.json"]    # verified files stay for a later try

