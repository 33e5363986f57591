"""The model manager's "Convert to EXL2…" (pytest-qt, offscreen): a Hub original downloaded through the fake hub
or a local folder, converted by moedesk-cli in its own process, with progress, refusals in words, a crash
resumed after a restart, and nothing partial in the model list."""
import json
import logging
import signal
import sys
import time
from pathlib import Path

import pytest
from convert_fixtures import link_out, tiny_checkpoint
from fakehub import Branch, Repo, fake_hub  # noqa: F401 (fake_hub is a fixture)

from app.hub import convert as app_convert
from app.hub.download import JobState
from app.hub.local import list_local_models
from app.models_dialog import ModelManagerDialog
from runtime.options import CONVERT_ARCHITECTURES

CRASH = [sys.executable, str(Path(__file__).parent / "convert_crash.py")]


def files_of(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


@pytest.fixture
def dialog(qtbot, tmp_path, fake_hub):
    d = ModelManagerDialog(models_dir=tmp_path / "models")
    qtbot.addWidget(d)
    yield d
    d.shutdown()


@pytest.fixture
def warnings(monkeypatch):
    shown = []
    monkeypatch.setattr("app.models_dialog.QMessageBox.warning", lambda *a: shown.append(a[2]))
    return shown


def names(d) -> list[str]:
    return [m.name for m in d._local]


def test_the_converter_and_the_app_agree_on_architectures():
    pytest.importorskip("torch")
    from runtime import qwen35
    from runtime.exl2.convert import ARCHITECTURES
    assert set(ARCHITECTURES) | set(qwen35.ARCHITECTURES) == set(CONVERT_ARCHITECTURES)


def test_hub_original_is_downloaded_then_converted_with_layer_progress(qtbot, dialog, fake_hub, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="app.hub.convert")
    files = files_of(tiny_checkpoint(tmp_path / "src", layers=3))
    files["pytorch_model.bin"] = b"\x80\x02pickle bytes that must never be fetched" * 40
    files["README.md"] = b"# Tiny Llama\n"
    fake_hub.add(Repo("tester/Tiny-Llama", {"main": Branch("main", files)}))
    seen = []
    dialog.conversions.event.connect(lambda p: seen.append(p))

    dialog.start_conversion(True, "tester/Tiny-Llama", 4.0)
    qtbot.waitUntil(lambda: "Tiny-Llama-exl2-4.0bpw" in names(dialog), timeout=120_000)

    phases = [(p.phase, p.state) for p in seen]
    assert ("download", JobState.RUNNING) in phases and ("convert", JobState.RUNNING) in phases
    assert [p.done for p in seen if p.phase == "convert" and p.state is JobState.RUNNING][-3:] == [1, 2, 3]
    assert dialog.conversions.row_text("Tiny-Llama-exl2-4.0bpw")[:2] == ("done", "layer 3 of 3")
    logged = [r.getMessage() for r in caplog.records]
    assert any(": bit allocation: " in m for m in logged) and any(": CPU threads: " in m for m in logged), logged
    model = next(m for m in dialog._local if m.name == "Tiny-Llama-exl2-4.0bpw")
    assert model.loadable and model.bits_per_weight
    assert not fake_hub.gets("pytorch_model.bin") and not fake_hub.gets("README.md")
    models = tmp_path / "models"
    assert not (models / app_convert.SOURCES / "tester--Tiny-Llama--main").exists()     # original removed
    assert list((models / app_convert.RECORDS).iterdir()) == []
    assert sorted(p.name for p in models.iterdir() if not p.name.startswith(".")) == ["Tiny-Llama-exl2-4.0bpw"]


def test_refusals_are_said_before_any_download(qtbot, dialog, fake_hub, tmp_path, warnings, monkeypatch):
    fake_hub.add(Repo("tester/Pickled", {"main": Branch("main", {
        "config.json": json.dumps({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2}).encode(),
        "pytorch_model.bin": b"\x80\x02" * 600})}))
    dialog.start_conversion(True, "tester/Pickled", 4.0)
    qtbot.waitUntil(lambda: len(warnings) == 1, timeout=20_000)
    assert "no safetensors weights" in warnings[0] and "Pickle weights (.bin, .pt) are refused" in warnings[0]
    assert not fake_hub.gets("pytorch_model.bin")

    dialog.start_conversion(True, "../../etc/passwd", 4.0)
    qtbot.waitUntil(lambda: len(warnings) == 2, timeout=20_000)
    assert warnings.pop().startswith("'../../etc/passwd' is not a repository name such as owner/model")

    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "n_layer": 12}))
    (gpt2 / "model.safetensors").write_bytes(b"\0" * 64)
    dialog.start_conversion(False, str(gpt2), 4.0)
    qtbot.waitUntil(lambda: len(warnings) == 2, timeout=20_000)
    assert warnings[1] == (f"{gpt2} is a GPT2LMHeadModel: the converter handles "
                           f"{', '.join(CONVERT_ARCHITECTURES)} only.")
    assert dialog.local_status.text() == warnings[1]

    (gpt2 / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2}))
    (gpt2 / "model.safetensors").unlink()
    (gpt2 / "pytorch_model.bin").write_bytes(b"\x80\x02")
    dialog.start_conversion(False, str(gpt2), 4.0)
    qtbot.waitUntil(lambda: len(warnings) == 3, timeout=20_000)
    assert "holds pickle weights (pytorch_model.bin)" in warnings[2] and "refused" in warnings[2]

    small = tiny_checkpoint(tmp_path / "Tiny-Qwen3", "qwen3")
    monkeypatch.setattr(app_convert.shutil, "disk_usage", lambda p: type("U", (), {"free": 1000})())
    dialog.start_conversion(False, str(small), 4.0)
    qtbot.waitUntil(lambda: len(warnings) == 4, timeout=20_000)
    assert warnings[3].startswith("Not enough disk space to convert Tiny-Qwen3: it needs")
    assert "1000 B free" in warnings[3] or "free" in warnings[3]
    assert dialog.conversions.table.rowCount() == 0 and not (tmp_path / "models" / app_convert.RECORDS).exists()


def test_missing_shards_fail_in_words_and_leave_no_model(qtbot, dialog, tmp_path):
    src = tiny_checkpoint(tmp_path / "Sharded")
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "model.embed_tokens.weight": "model-00001-of-00002.safetensors",
        "lm_head.weight": "model-00002-of-00002.safetensors"}}))
    (src / "model.safetensors").rename(src / "model-00001-of-00002.safetensors")
    dialog.start_conversion(False, str(src), 4.0)
    job = "Sharded-exl2-4.0bpw"
    qtbot.waitUntil(lambda: job in dialog.conversions._rows
                    and dialog.conversions.row_text(job)[0] == "failed", timeout=120_000)
    details = dialog.conversions.row_text(job)[2]
    assert "missing shards model-00002-of-00002.safetensors" in details
    assert names(dialog) == []


def _crashed_after_layer_1(qtbot, tmp_path, monkeypatch):
    """A 3-layer conversion whose converter is killed after its first layer: (models, job, its dialog)."""
    models = tmp_path / "models"
    src = tiny_checkpoint(tmp_path / "Tiny-MoE", "qwen3_moe", layers=3)
    monkeypatch.setattr(app_convert, "convert_command", lambda: CRASH)
    first = ModelManagerDialog(models_dir=models)
    qtbot.addWidget(first)
    first.start_conversion(False, str(src), 3.0)
    job = "Tiny-MoE-exl2-3.0bpw"
    qtbot.waitUntil(lambda: job in first.conversions._rows
                    and first.conversions.row_text(job)[0] == "failed", timeout=120_000)
    return models, job, first


def test_a_resume_with_other_settings_says_to_cancel_and_convert_again(qtbot, tmp_path, monkeypatch):
    """A partial conversion the converter refuses to resume (made with other settings, e.g. by another
    version): the row says what to do in the app's words, and the partial folder stays until Cancel."""
    models, job, first = _crashed_after_layer_1(qtbot, tmp_path, monkeypatch)
    first.shutdown()

    monkeypatch.setattr(app_convert, "convert_command",            # other calibration settings than the crash's
                        lambda: [sys.executable, "-m", "runtime.cli", "convert", "--rows", "2"])
    second = ModelManagerDialog(models_dir=models)
    qtbot.addWidget(second)
    second.conversions.select(job)
    second.conversions.resume_button.click()
    qtbot.waitUntil(lambda: second.conversions.row_text(job)[0] == "failed", timeout=120_000)
    details = second.conversions.row_text(job)[2]
    assert details.startswith("This conversion was started with other settings") and "press Cancel" in details
    assert (models / f".{job}.partial" / "layer-00000.safetensors").is_file()
    second.shutdown()


def test_a_crash_resumes_at_its_layer_after_a_restart(qtbot, tmp_path, monkeypatch):
    models, job, first = _crashed_after_layer_1(qtbot, tmp_path, monkeypatch)
    state, bar, details = first.conversions.row_text(job)
    assert bar == "layer 1 of 3"
    assert details.startswith("The converter stopped unexpectedly (exit code -9") and "press resume" in details.lower()
    assert list_local_models(models) == [] and (models / f".{job}.partial" / "layer-00000.safetensors").is_file()
    first.shutdown()

    # the crashed run's calibration (the shipped text: a resume needs the same settings, and it is small)
    from runtime.exl2.convert import DEFAULT_CALIBRATION
    monkeypatch.setattr(app_convert, "convert_command", lambda: [sys.executable, "-m", "runtime.cli", "convert",
                                                                 "--calibration", str(DEFAULT_CALIBRATION)])
    second = ModelManagerDialog(models_dir=models)                  # the app started again
    qtbot.addWidget(second)
    seen = []
    second.conversions.event.connect(lambda p: seen.append(p))
    assert second.conversions.row_text(job) == ("paused", "layer 1 of 3",
                                                "Unfinished from an earlier session: press Resume.")
    second.conversions.select(job)
    assert second.conversions.resume_button.isEnabled() and not second.conversions.pause_button.isEnabled()
    second.conversions.resume_button.click()
    qtbot.waitUntil(lambda: job in names(second), timeout=120_000)
    assert [p.message for p in seen if p.state is JobState.RUNNING] == [   # layer 1 is not done again
        "Converting: layer 1 of 3 done", "Resuming after layer 1 of 3 done", "Converting: layer 2 of 3 done",
        "Converting: layer 3 of 3 done"]
    assert not (models / f".{job}.partial").exists()
    second.shutdown()


def test_cancel_deletes_the_partial_layers_and_the_record(qtbot, tmp_path, monkeypatch):
    models = tmp_path / "models"
    src = tiny_checkpoint(tmp_path / "Tiny", layers=3)
    monkeypatch.setattr(app_convert, "convert_command", lambda: CRASH)
    d = ModelManagerDialog(models_dir=models)
    qtbot.addWidget(d)
    d.start_conversion(False, str(src), 4.0)
    job = "Tiny-exl2-4.0bpw"
    qtbot.waitUntil(lambda: job in d.conversions._rows and d.conversions.row_text(job)[0] == "failed",
                    timeout=120_000)
    assert (models / f".{job}.partial").is_dir() and (models / app_convert.RECORDS / f"{job}.json").is_file()
    d.conversions.select(job)
    d.conversions.cancel_button.click()
    qtbot.waitUntil(lambda: d.conversions.row_text(job)[0] == "cancelled", timeout=10_000)
    assert not (models / f".{job}.partial").exists() and not (models / app_convert.RECORDS / f"{job}.json").exists()
    assert src.is_dir() and (src / "model.safetensors").is_file()          # a local source is never touched
    d.shutdown()


def test_the_form_gives_source_and_width(qtbot):
    from app.convert_panel import ConvertForm
    form = ConvertForm()
    qtbot.addWidget(form)
    qtbot.keyClicks(form.folder_edit, "/models/Llama")
    form.bpw_spin.setValue(5.5)
    assert form.values() == (False, "/models/Llama", 5.5)
    qtbot.keyClicks(form.repo_edit, "owner/model ")
    assert form.values() == (True, "owner/model", 5.5)


def test_pause_stops_the_process_and_keeps_the_state(qtbot, tmp_path, monkeypatch):
    slow = [sys.executable, "-c", "import time; print('layer 1/3 quantized', flush=True); time.sleep(120)"]
    monkeypatch.setattr(app_convert, "convert_command", lambda: slow)
    d = ModelManagerDialog(models_dir=tmp_path / "models")
    qtbot.addWidget(d)
    d.start_conversion(False, str(tiny_checkpoint(tmp_path / "Tiny")), 4.0)
    job = "Tiny-exl2-4.0bpw"
    qtbot.waitUntil(lambda: job in d.conversions._rows and d.conversions.row_text(job)[1] == "layer 1 of 3",
                    timeout=30_000)
    d.conversions.select(job)
    assert d.conversions.pause_button.isEnabled()
    d.conversions.pause_button.click()
    qtbot.waitUntil(lambda: d.conversions.row_text(job)[0] == "paused", timeout=10_000)
    assert d.conversions.row_text(job)[2] == "Paused after layer 1: press Resume to continue."
    assert (tmp_path / "models" / app_convert.RECORDS / f"{job}.json").is_file()
    d.shutdown()


def test_a_record_naming_other_folders_is_not_trusted(qtbot, tmp_path):
    """A record is what cancel deletes from: one that points its download elsewhere is left alone."""
    models = tmp_path / "models"
    victim = tmp_path / "victim"
    victim.mkdir()
    (models / app_convert.RECORDS).mkdir(parents=True)
    (models / app_convert.RECORDS / "x-exl2-4.0bpw.json").write_text(json.dumps(
        {"id": "x-exl2-4.0bpw", "source": "owner/x", "bpw": 4.0, "hub": True, "download_id": "../../victim",
         "layers": 2}))
    (models / app_convert.RECORDS / "y-exl2-9.0bpw.json").write_text(json.dumps(
        {"id": "y-exl2-9.0bpw", "source": "y", "bpw": 9.0, "hub": False, "download_id": "", "layers": 2}))
    d = ModelManagerDialog(models_dir=models)
    qtbot.addWidget(d)
    assert d.conversions.table.rowCount() == 0 and victim.is_dir()
    d.shutdown()


def test_screenshot_helper_writes_a_png(qtbot, tmp_path):
    from app.models_dialog import grab_conversions
    out = grab_conversions(tmp_path / "shots" / "model-manager-convert.png")
    assert out.is_file() and out.stat().st_size > 10_000


def test_the_app_side_never_imports_torch():
    import subprocess
    code = ("import sys, app.models_dialog, app.convert_panel, app.hub.convert; "
            "print([m for m in ('torch', 'transformers') if m in sys.modules])")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**__import__("os").environ, "QT_QPA_PLATFORM": "offscreen",
                            "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stderr


# -- hostile inputs: links out of a local source, a damaged state, a converter that ignores SIGTERM

@pytest.mark.parametrize("name", ["chat_template.jinja", "config.json", "model.safetensors"])
def test_a_local_source_linking_out_of_its_folder_is_refused_before_it_is_queued(qtbot, dialog, tmp_path, warnings,
                                                                                 name):
    src = tiny_checkpoint(tmp_path / "Linked")
    secret = link_out(src, name, tmp_path)
    dialog.start_conversion(False, str(src), 4.0)
    qtbot.waitUntil(lambda: len(warnings) == 1, timeout=20_000)
    assert warnings[0].startswith(f"{src / name}: is a link to {secret}, outside the model folder")
    assert dialog.conversions.table.rowCount() == 0 and not (tmp_path / "models" / app_convert.RECORDS).exists()


def test_a_damaged_partial_state_does_not_stop_the_model_manager(qtbot, tmp_path):
    models = tmp_path / "models"
    job = "Tiny-exl2-4.0bpw"
    (models / app_convert.RECORDS).mkdir(parents=True)
    (models / app_convert.RECORDS / f"{job}.json").write_text(json.dumps(
        {"id": job, "source": str(tmp_path / "Tiny"), "bpw": 4.0, "hub": False, "download_id": "", "layers": 3}))
    (models / app_convert.RECORDS / "y-exl2-4.0bpw.json").write_text(json.dumps(
        {"id": "y-exl2-4.0bpw", "source": 5, "bpw": 4.0, "hub": False, "download_id": "", "layers": 3}))
    (models / f".{job}.partial").mkdir()
    (models / f".{job}.partial" / "state.json").write_text('{"layers_done": ' + "[" * 100_000 + "]" * 100_000 + "}")
    d = ModelManagerDialog(models_dir=models)
    qtbot.addWidget(d)
    assert d.conversions.row_text(job) == ("paused", "layer 0 of 3", "Unfinished from an earlier session: press Resume.")
    assert d.conversions.table.rowCount() == 1
    (models / f".{job}.partial" / "state.json").write_text('{"layers_done": 99}')
    assert d.conversions.manager._partial_state() == {job: 0}
    d.shutdown()


def test_cancel_kills_a_converter_that_ignores_sigterm(qtbot, tmp_path, monkeypatch):
    stubborn = [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                                      "print('layer 1/3 quantized', flush=True); time.sleep(120)"]
    monkeypatch.setattr(app_convert, "convert_command", lambda: stubborn)
    events = []
    manager = app_convert.ConvertManager(tmp_path / "models", on_event=events.append)
    job = manager.start_local(tiny_checkpoint(tmp_path / "Tiny"), 4.0)
    qtbot.waitUntil(lambda: any(e.done == 1 and e.state is JobState.RUNNING for e in events), timeout=30_000)
    proc = manager._proc
    t0 = time.monotonic()
    manager.cancel(job.id)
    assert manager.wait(job.id, 30).state is JobState.CANCELLED
    took = time.monotonic() - t0
    assert proc.poll() == -signal.SIGKILL and took < app_convert.KILL_GRACE_S + 5, took
    assert not manager.partial_dir(job).exists()
    manager.shutdown()
