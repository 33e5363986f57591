"""Downloads from the fake hub on loopback: whole branch, dropped connections, restart, 5xx, stalls,
corruption, cancel, disk space, gated repos. No test touches the internet."""
import os
import subprocess
import time
from pathlib import Path

import pytest
from fakehub import Fault, fake_hub, tiny_exl2_repo  # noqa: F401 (fake_hub is a fixture)

from app.hub import download, staging
from app.hub.browse import HubClient
from app.hub.download import JobState, RetryPolicy
from app.hub.staging import safe_name, safe_relpath
from app.hub.errors import NotEnoughDiskSpace, UnsafePathError
from app.hub.queue import DownloadManager

REPO = "tester/Tiny-MoE-exl2"
FAST_RETRY = RetryPolicy(attempts=4, base_s=0.05, max_s=0.2)


@pytest.fixture
def hub(fake_hub, monkeypatch):
    monkeypatch.setattr(download, "CHUNK_BYTES", 16 * 1024)      # many chunks per file: mid-file events
    monkeypatch.setattr(download, "PROGRESS_INTERVAL_S", 0.0)    # an event per chunk
    return fake_hub


def quant(branch="4.0bpw", repo=REPO):
    return next(q for q in HubClient().quants(repo) if q.branch == branch)


def manager(models: Path, events=None, **kw) -> DownloadManager:
    kw.setdefault("retry", FAST_RETRY)
    return DownloadManager(on_event=(events.append if isinstance(events, list) else events),
                           models_dir=models, margin_bytes=0, **kw)


def assert_model_matches(folder: Path, hub, branch: str):
    files = hub.repos[REPO].branches[branch].files
    for path, data in files.items():
        assert (folder / path).read_bytes() == data, path


def test_download_a_branch(hub, tmp_path):
    events = []
    m = manager(tmp_path / "models", events)
    job = m.enqueue(quant("4.0bpw"))
    final = m.wait(job.id)
    assert final.state is JobState.DONE, final.message
    folder = tmp_path / "models" / job.id
    assert job.id == "tester--Tiny-MoE-exl2--4.0bpw"
    assert_model_matches(folder, hub, "4.0bpw")
    assert (folder / staging.SOURCE).is_file() and not (folder / staging.MANIFEST).exists()
    assert not list((tmp_path / "models" / staging.STAGING).iterdir())
    running = [e for e in events if e.state is JobState.RUNNING]
    assert any(e.current_file == "model.safetensors" and 0 < e.done_bytes < job.total_bytes for e in running)
    assert [e.done_bytes for e in running] == sorted(e.done_bytes for e in running)
    assert final.done_bytes == final.total_bytes == job.total_bytes
    m.shutdown()


def test_dropped_connection_resumes_from_where_it_stopped(hub, tmp_path):
    fault = Fault("model.safetensors", "close", at=100_000)
    hub.faults.append(fault)
    m = manager(tmp_path / "models")
    job = m.enqueue(quant())
    assert m.wait(job.id).state is JobState.DONE
    gets = hub.gets("/model.safetensors")
    assert len(gets) == 2 and gets[0].range is None
    start = int(gets[1].range.removeprefix("bytes=").rstrip("-"))
    assert 0 < start <= 100_000                       # resumed, not restarted
    assert fault.times == 0
    assert_model_matches(tmp_path / "models" / job.id, hub, "4.0bpw")


def test_restart_resumes_the_partial_file(hub, tmp_path):
    models = tmp_path / "models"
    holder = {}

    def pause_midway(p):
        if p.state is JobState.RUNNING and p.current_file == "model.safetensors" and p.done_bytes > 60_000:
            holder["m"].pause(p.job_id)
    holder["m"] = first = manager(models, pause_midway)
    job = first.enqueue(quant())
    assert first.wait(job.id).state is JobState.PAUSED
    first.shutdown()                                  # the app quits
    part = models / staging.STAGING / job.id / staging.PARTIAL / "model.safetensors"
    kept = part.stat().st_size
    assert 0 < kept < len(hub.repos[REPO].branches["4.0bpw"].files["model.safetensors"])

    second = manager(models)                          # the app starts again
    (restored,) = second.restore()
    assert restored.state is JobState.PAUSED and restored.done_bytes > kept
    second.resume(job.id)
    assert second.wait(job.id).state is JobState.DONE
    assert hub.gets("/model.safetensors")[-1].range == f"bytes={kept}-"
    assert_model_matches(models / job.id, hub, "4.0bpw")


def test_server_errors_are_retried_with_backoff(hub, tmp_path):
    hub.faults.append(Fault("model.safetensors", "error", times=3, status=500))
    events = []
    m = manager(tmp_path / "models", events)
    job = m.enqueue(quant())
    assert m.wait(job.id).state is JobState.DONE
    assert len(hub.gets("/model.safetensors")) == 4
    assert sum("Retrying in" in e.message for e in events) == 3


def test_server_errors_give_up_with_a_message(hub, tmp_path):
    hub.faults.append(Fault("model.safetensors", "error", times=99, status=503))
    m = manager(tmp_path / "models")
    job = m.enqueue(quant())
    final = m.wait(job.id)
    assert final.state is JobState.FAILED
    assert "HTTP 503" in final.message and "Gave up after 4 attempts" in final.message
    assert not (tmp_path / "models" / job.id).exists()


def test_stalled_connection_times_out_and_resumes(hub, tmp_path, monkeypatch):
    from huggingface_hub import constants
    monkeypatch.setattr(constants, "HF_HUB_DOWNLOAD_TIMEOUT", 1)
    hub.faults.append(Fault("model.safetensors", "stall", at=50_000, seconds=10))
    m = manager(tmp_path / "models")
    job = m.enqueue(quant())
    t0 = time.monotonic()
    assert m.wait(job.id, timeout=30).state is JobState.DONE
    assert time.monotonic() - t0 < 9                  # did not wait for the stalled server
    assert hub.gets("/model.safetensors")[-1].range.startswith("bytes=")
    assert_model_matches(tmp_path / "models" / job.id, hub, "4.0bpw")


def test_a_corrupted_byte_is_detected_and_fetched_again(hub, tmp_path):
    hub.faults.append(Fault("model.safetensors", "corrupt", at=1234))
    events = []
    m = manager(tmp_path / "models", events)
    job = m.enqueue(quant())
    assert m.wait(job.id).state is JobState.DONE
    assert any("model.safetensors arrived corrupted" in e.message for e in events)
    assert_model_matches(tmp_path / "models" / job.id, hub, "4.0bpw")


def test_persistent_corruption_fails_and_nothing_becomes_loadable(hub, tmp_path):
    hub.faults.append(Fault("model.safetensors", "corrupt", at=150_000, times=99))
    m = manager(tmp_path / "models")
    job = m.enqueue(quant())
    final = m.wait(job.id)
    assert final.state is JobState.FAILED
    assert "model.safetensors arrived corrupted" in final.message and "(4 times)" in final.message
    assert [p.name for p in (tmp_path / "models").iterdir()] == [staging.STAGING]


def test_cancel_deletes_the_partial_download(hub, tmp_path):
    models = tmp_path / "models"
    holder = {}

    def cancel_midway(p):
        if p.state is JobState.RUNNING and p.done_bytes > 30_000:
            holder["m"].cancel(p.job_id)
    holder["m"] = m = manager(models, cancel_midway)
    job = m.enqueue(quant())
    final = m.wait(job.id)
    assert final.state is JobState.CANCELLED and "deleted" in final.message
    assert not (models / job.id).exists()
    assert not (models / staging.STAGING / job.id).exists()


def test_pause_and_resume_in_one_session(hub, tmp_path):
    holder = {"paused": False}

    def pause_once(p):
        if p.state is JobState.RUNNING and p.done_bytes > 30_000 and not holder["paused"]:
            holder["paused"] = True
            holder["m"].pause(p.job_id)
    holder["m"] = m = manager(tmp_path / "models", pause_once)
    job = m.enqueue(quant())
    assert m.wait(job.id).state is JobState.PAUSED
    m.resume(job.id)
    assert m.wait(job.id).state is JobState.DONE
    assert_model_matches(tmp_path / "models" / job.id, hub, "4.0bpw")


def test_queue_runs_downloads_one_after_another(hub, tmp_path):
    m = manager(tmp_path / "models")
    a, b = m.enqueue(quant("4.0bpw")), m.enqueue(quant("6_5"))
    assert m.state(b.id).state in (JobState.QUEUED, JobState.RUNNING, JobState.DONE)
    assert m.wait(a.id).state is JobState.DONE and m.wait(b.id).state is JobState.DONE
    assert_model_matches(tmp_path / "models" / b.id, hub, "6_5")


# -- disk space: a real small filesystem (tmpfs) so the kernel itself says "no space left"

@pytest.fixture
def small_disk(tmp_path):
    mounted = []

    def make(size: str) -> Path:
        d = tmp_path / f"disk{len(mounted)}"
        d.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(d)], capture_output=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a small tmpfs here (needs root): {r.stderr.decode().strip()}")
        mounted.append(d)
        return d
    yield make
    for d in mounted:
        subprocess.run(["umount", "-l", str(d)], check=False)


def test_not_enough_space_is_refused_before_any_byte(hub, small_disk):
    disk = small_disk("256k")
    m = manager(disk / "models")
    q = quant("6_5")
    with pytest.raises(NotEnoughDiskSpace, match=r"Not enough disk space for tester/Tiny-MoE-exl2 \(6_5\)"):
        m.enqueue(q)
    assert hub.gets("/model.safetensors") == []


def test_disk_filling_up_midway_gives_a_clear_error_then_resumes(hub, small_disk):
    disk = small_disk("1m")
    filler = disk / "filler"

    def fill_disk(p):
        if p.state is JobState.RUNNING and p.current_file == "model.safetensors" and not filler.exists():
            with open(filler, "wb") as fh:       # another program eats the free space
                try:
                    while True:
                        fh.write(b"\0" * 4096)
                        fh.flush()
                except OSError:
                    pass
    m = manager(disk / "models", fill_disk)
    job = m.enqueue(quant())
    final = m.wait(job.id, timeout=30)
    assert final.state is JobState.FAILED
    assert f"The disk holding {disk / 'models'} is full" in final.message
    assert "press Resume" in final.message
    filler.unlink()
    m.on_event = lambda p: None
    m.resume(job.id)
    assert m.wait(job.id).state is JobState.DONE
    assert_model_matches(disk / "models" / job.id, hub, "4.0bpw")


# -- gated repos and tokens

def test_gated_repo_needs_a_token_and_the_token_is_never_logged(hub, tmp_path, monkeypatch, caplog):
    caplog.set_level("DEBUG")
    hub.add(tiny_exl2_repo("tester/Gated-exl2", token="hf_secret_token_123"))
    q = next(q for q in HubClient().quants("tester/Gated-exl2") if q.branch == "4.0bpw")
    assert "gated" in q.access and q.bpw == 4.0      # listed, with bpw from the branch name
    m = manager(tmp_path / "models")
    job = m.enqueue(q)
    final = m.wait(job.id)
    assert final.state is JobState.FAILED and "gated" in final.message and "Sign in" in final.message
    monkeypatch.setenv("HF_TOKEN", "hf_secret_token_123")      # HF's own token lookup
    m.resume(job.id)
    final = m.wait(job.id)
    assert final.state is JobState.DONE, final.message
    assert hub.gets("/model.safetensors")[-1].authorized
    assert "hf_secret_token_123" not in caplog.text


# -- paths from the listing

@pytest.mark.parametrize("bad", ["../evil", "a/../../evil", "/etc/passwd", "a\\b", "C:evil", "", "a//b",
                                 "./a", staging.MANIFEST, ".partial/x"])
def test_unsafe_paths_are_refused(bad):
    with pytest.raises(UnsafePathError):
        safe_relpath(bad)


def test_a_listing_with_an_escaping_path_is_refused_before_download(hub, tmp_path):
    from fakehub import Branch, Repo
    files = dict(tiny_exl2_repo().branches["4.0bpw"].files, **{"../../escape.txt": b"owned"})
    hub.add(Repo("evil/Model-exl2", {"4.0bpw": Branch("4.0bpw", files)}, tags=["exl2"]))
    q = HubClient().quants("evil/Model-exl2")[0]
    with pytest.raises(UnsafePathError, match="could write outside"):
        manager(tmp_path / "models").enqueue(q)
    assert not (tmp_path / "escape.txt").exists() and not os.path.exists(tmp_path.parent / "escape.txt")


def test_safe_names():
    assert safe_name("a/b", "4.0bpw") == "a--b--4.0bpw"
    assert safe_name("a/b", "../../x y") == "a--b--.._.._x_y"
    with pytest.raises(UnsafePathError, match="cannot make a folder name"):
        safe_name("..", "/")


def test_a_branch_that_moved_on_starts_afresh(hub, tmp_path):
    models = tmp_path / "models"
    holder = {}

    def pause_midway(p):
        if p.state is JobState.RUNNING and p.done_bytes > 60_000:
            holder["m"].pause(p.job_id)
    holder["m"] = m = manager(models, pause_midway)
    job = m.enqueue(quant())
    assert m.wait(job.id).state is JobState.PAUSED
    from fakehub import Branch, exl2_branch
    old = hub.repos[REPO].branches["4.0bpw"]
    new = exl2_branch("4.0bpw", 4.0, seed=7)
    readme = old.files["README.md"].upper()                 # same size: only the commit says it changed
    hub.repos[REPO].branches["4.0bpw"] = Branch("4.0bpw", dict(new.files, **{"README.md": readme}))
    assert hub.repos[REPO].branches["4.0bpw"].commit != old.commit
    m.on_event = lambda p: None
    job2 = m.enqueue(quant())
    assert job2.commit != job.commit
    assert m.wait(job2.id).state is JobState.DONE
    assert (models / job2.id / "README.md").read_bytes() == readme
    assert_model_matches(models / job2.id, hub, "4.0bpw")


def test_sign_in_stores_the_token_where_huggingface_hub_keeps_it(hub, tmp_path, caplog):
    from huggingface_hub import constants, get_token

    from app.hub.browse import sign_in
    from app.hub.errors import HubAccessError
    caplog.set_level("DEBUG")
    hub.add(tiny_exl2_repo("tester/Gated-exl2", token="hf_secret_token_456"))
    hub.valid_tokens.add("hf_secret_token_456")
    with pytest.raises(HubAccessError, match="does not accept this token"):
        sign_in("hf_wrong")
    assert get_token() is None
    assert sign_in(" hf_secret_token_456\n") == "tester"
    assert Path(constants.HF_TOKEN_PATH).read_text().strip() == "hf_secret_token_456"
    q = next(q for q in HubClient().quants("tester/Gated-exl2") if q.branch == "6_5")
    assert q.access == "" and q.config                # with the token the files (config.json) are readable
    m = manager(tmp_path / "models")
    job = m.enqueue(q)
    assert m.wait(job.id).state is JobState.DONE
    assert "hf_secret_token_456" not in caplog.text
