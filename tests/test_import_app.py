"""The model manager and the CLI with GPTQ-family builds (pytest-qt, offscreen, the fake hub): listed as "INT4
(GPTQ) — imports in minutes" with a fit, downloaded and imported with progress and time left, a killed import
resumed after a restart, refusals naming the field before any byte, and `moedesk-cli import OWNER/REPO`."""
import json
import sys
from pathlib import Path

import pytest
from convert_fixtures import tiny_checkpoint
from fakehub import Branch, Repo, fake_hub  # noqa: F401 (fake_hub is a fixture)
from gptq_fixtures import gptq_folder

from app.hub import convert as app_convert
from app.hub.browse import HubClient
from app.hub.download import JobState
from app.models_dialog import ModelManagerDialog
from test_convert_app import warnings  # noqa: F401 (the fixture: message boxes collected, not shown)

pytest.importorskip("torch")
REPO = "tester/Tiny-MoE-GPTQ-Int4"
JOB = "Tiny-MoE-GPTQ-Int4-exl2"
NO_CALIBRATION = [sys.executable, "-m", "runtime.cli", "import", "--no-calibrate", "--threads", "1"]
CRASH = [sys.executable, str(Path(__file__).parent / "import_crash.py")]


def _build(tmp_path, layers: int = 3, **changes) -> dict[str, bytes]:
    src = tmp_path / "gptq"
    gptq_folder(tiny_checkpoint(tmp_path / "hf", "qwen3_moe", layers=layers), src)
    if changes:
        config = json.loads((src / "config.json").read_text())
        config["quantization_config"].update(changes)
        (src / "config.json").write_text(json.dumps(config))
    return {p.name: p.read_bytes() for p in src.iterdir() if p.is_file()}


@pytest.fixture
def dialog(qtbot, tmp_path, fake_hub, monkeypatch):
    monkeypatch.setattr(app_convert, "import_command", lambda: NO_CALIBRATION)     # fast: no forward pass
    d = ModelManagerDialog(models_dir=tmp_path / "models")
    d.set_memory(24 * 1024 ** 3, 64 * 1024 ** 3, "a 24 GB GPU")
    qtbot.addWidget(d)
    yield d
    d.shutdown()


def test_a_gptq_build_is_listed_found_and_its_fit_estimated(fake_hub, tmp_path):
    fake_hub.add(Repo(REPO, {"main": Branch("main", _build(tmp_path))}))
    hub = HubClient()
    assert REPO in [r.repo_id for r in hub.search("Tiny")]
    (quant,) = hub.quants(REPO)
    assert (quant.kind, quant.label, quant.bpw, quant.refusal) == ("import", "INT4 (GPTQ)", 4.125, "")


def test_download_then_import_with_layer_progress_and_time_left(qtbot, dialog, fake_hub, tmp_path):
    fake_hub.add(Repo(REPO, {"main": Branch("main", _build(tmp_path))}))
    seen = []
    dialog.conversions.event.connect(lambda p: seen.append(p))
    dialog.show_quants(REPO, HubClient().quants(REPO))
    assert dialog.quant_table.item(0, 1).text() == "INT4 (GPTQ) — imports in minutes"
    assert dialog.quant_table.item(0, 3).text() == "fits in VRAM"
    dialog._download_selected()
    qtbot.waitUntil(lambda: JOB in [m.name for m in dialog._local], timeout=120_000)
    phases = [(p.phase, p.state) for p in seen]
    assert ("download", JobState.RUNNING) in phases and ("convert", JobState.RUNNING) in phases
    running = [p for p in seen if p.phase == "convert" and p.state is JobState.RUNNING]
    assert [p.message for p in running][-3:] == [f"Importing: layer {i} of 3 done" for i in (1, 2, 3)]
    assert running[-1].eta_s is not None and running[-1].eta_s == 0.0     # after its 3rd layer: none left
    assert running[-2].eta_s is not None and running[-2].eta_s > 0
    assert dialog.conversions.row_text(JOB)[:2] == ("done", "layer 3 of 3")
    model = next(m for m in dialog._local if m.name == JOB)
    assert model.loadable
    assert not (tmp_path / "models" / app_convert.SOURCES / "tester--Tiny-MoE-GPTQ-Int4--main").exists()


def test_a_build_it_cannot_import_is_refused_by_name_before_any_byte(qtbot, dialog, fake_hub, tmp_path, warnings):
    fake_hub.add(Repo(REPO, {"main": Branch("main", _build(tmp_path, bits=3))}))
    dialog.show_quants(REPO, HubClient().quants(REPO))
    assert dialog.quant_table.item(0, 3).text().startswith("cannot import: 'quantization_config.bits' is 3")
    dialog._download_selected()
    assert len(warnings) == 1 and "'quantization_config.bits' is 3: the import takes 4- or 8-bit codes" in warnings[0]
    assert not fake_hub.gets("model.safetensors") and dialog.conversions.table.rowCount() == 0


def test_a_killed_import_resumes_at_its_layer_after_a_restart(qtbot, tmp_path, monkeypatch):
    models, src = tmp_path / "models", tmp_path / "Tiny-GPTQ"
    gptq_folder(tiny_checkpoint(tmp_path / "hf", "qwen3_moe", layers=3), src)
    monkeypatch.setattr(app_convert, "import_command", lambda: CRASH)
    first = ModelManagerDialog(models_dir=models)
    qtbot.addWidget(first)
    job = first.conversions.manager.start_local(src, 6.0, "import").id
    assert job == "Tiny-GPTQ-exl2"
    qtbot.waitUntil(lambda: job in first.conversions._rows and first.conversions.row_text(job)[0] == "failed",
                    timeout=120_000)
    state, bar, details = first.conversions.row_text(job)
    assert bar == "layer 1 of 3" and details.startswith("The import stopped unexpectedly (exit code -9")
    first.shutdown()

    monkeypatch.setattr(app_convert, "import_command", lambda: NO_CALIBRATION)
    second = ModelManagerDialog(models_dir=models)                  # the app started again
    qtbot.addWidget(second)
    seen = []
    second.conversions.event.connect(lambda p: seen.append(p))
    assert second.conversions.row_text(job)[:2] == ("paused", "layer 1 of 3")
    second.conversions.select(job)
    second.conversions.resume_button.click()
    qtbot.waitUntil(lambda: job in [m.name for m in second._local], timeout=120_000)
    assert [p.message for p in seen if p.state is JobState.RUNNING] == [
        "Importing: layer 1 of 3 done", "Resuming after layer 1 of 3 done", "Importing: layer 2 of 3 done",
        "Importing: layer 3 of 3 done"]
    assert not (models / f".{job}.partial").exists()
    second.shutdown()


def test_the_cli_downloads_a_repository_then_imports_it(fake_hub, tmp_path, monkeypatch, capsys):
    from runtime.cli import main
    fake_hub.add(Repo(REPO, {"main": Branch("main", _build(tmp_path, layers=2))}))
    monkeypatch.setenv("MOEDESK_HOME", str(tmp_path / "home"))
    assert main(["import", REPO, "--no-calibrate", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert f"downloading {REPO}" in out and "layer 2/2 imported" in out
    from runtime import paths
    assert (paths.models_dir() / JOB / "config.json").is_file()
    assert main(["import", "tester/Missing", "--no-calibrate"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("moedesk-cli import: ")


def test_convert_to_exl2_imports_a_local_gptq_folder(qtbot, dialog, tmp_path):
    """"Convert to EXL2…" on a GPTQ build: imported (its experts kept), not refused as already quantized."""
    src = tmp_path / "Local-GPTQ"
    gptq_folder(tiny_checkpoint(tmp_path / "hf", "qwen3_moe", layers=2), src)
    dialog.start_conversion(False, str(src), 6.0)
    qtbot.waitUntil(lambda: "Local-GPTQ-exl2" in [m.name for m in dialog._local], timeout=120_000)
    assert dialog.conversions.manager.job("Local-GPTQ-exl2").kind == "import"
