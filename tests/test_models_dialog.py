"""The model manager dialog (pytest-qt, offscreen) against the fake hub on loopback."""
import pytest
from fakehub import Fault, fake_hub  # noqa: F401 (fake_hub is a fixture)

from app.hub import download
from app.models_dialog import ModelManagerDialog

GiB = 1024 ** 3


@pytest.fixture
def dialog(qtbot, tmp_path, fake_hub, monkeypatch):
    monkeypatch.setattr(download, "CHUNK_BYTES", 16 * 1024)
    d = ModelManagerDialog(models_dir=tmp_path / "models")
    d.set_memory(8 * GiB, 32 * GiB, "Test GPU")
    qtbot.addWidget(d)
    yield d
    d.shutdown()


def search_and_pick(qtbot, d):
    d.search_edit.setText("tiny")
    d.search()
    qtbot.waitUntil(lambda: d.repo_list.count() == 1, timeout=10_000)
    d.repo_list.setCurrentRow(0)
    qtbot.waitUntil(lambda: d.quant_table.rowCount() == 2, timeout=10_000)


def cell(table, row, col):
    return table.item(row, col).text()


def test_branches_show_sizes_and_fit_verdicts(qtbot, dialog, fake_hub):
    search_and_pick(qtbot, dialog)
    t = dialog.quant_table
    assert [cell(t, r, 0) for r in range(2)] == ["4.0bpw", "6_5"]
    assert cell(t, 0, 1) == "4 (head 6)"
    size = sum(len(b) for b in fake_hub.repos["tester/Tiny-MoE-exl2"].branches["4.0bpw"].files.values())
    assert cell(t, 0, 2) == f"{size / 1024:.1f} KiB"          # GiB/MiB/KiB, as everywhere in the app
    assert all(cell(t, r, 3) == "fits in VRAM" for r in range(2))
    assert "KV cache" in t.item(0, 3).toolTip()
    dialog.set_memory(0, 32 * GiB, "no GPU")               # no GPU: the verdict changes, in words
    assert cell(t, 0, 3).startswith("does not fit — needs") and "more VRAM" in cell(t, 0, 3)


def test_a_download_in_progress_then_loadable(qtbot, dialog, fake_hub, tmp_path):
    fake_hub.faults.append(Fault("model.safetensors", "stall", at=120_000, seconds=1.5))
    search_and_pick(qtbot, dialog)
    dialog.quant_table.selectRow(0)
    dialog.download_button.click()
    t = dialog.download_table
    qtbot.waitUntil(lambda: t.rowCount() == 1 and cell(t, 0, 1) == "running"
                    and "model.safetensors" in cell(t, 0, 5), timeout=10_000)
    assert 0 < t.cellWidget(0, 2).value() < 1000
    dialog.grab().save(str(tmp_path / "in-progress.png"))
    assert dialog.local_table.rowCount() == 0              # nothing loadable while downloading
    qtbot.waitUntil(lambda: cell(t, 0, 1) == "done", timeout=30_000)
    assert t.cellWidget(0, 2).value() == 1000
    assert dialog.local_table.rowCount() == 1 and cell(dialog.local_table, 0, 6) == "ready"
    dialog.local_table.selectRow(0)
    with qtbot.waitSignal(dialog.load_requested) as sig:
        dialog.load_button.click()
    assert sig.args == [str(tmp_path / "models" / "tester--Tiny-MoE-exl2--4.0bpw")]


def test_cancel_from_the_dialog_leaves_nothing_to_load(qtbot, dialog, fake_hub, tmp_path):
    fake_hub.faults.append(Fault("model.safetensors", "stall", at=50_000, seconds=1.0))
    search_and_pick(qtbot, dialog)
    dialog.download_button.click()
    t = dialog.download_table
    qtbot.waitUntil(lambda: t.rowCount() == 1 and cell(t, 0, 1) == "running", timeout=10_000)
    t.selectRow(0)
    dialog.cancel_button.click()
    qtbot.waitUntil(lambda: cell(t, 0, 1) == "cancelled", timeout=20_000)
    dialog.refresh_local()
    assert dialog.local_table.rowCount() == 0
    assert not any((tmp_path / "models").glob("tester*"))


def test_disk_refusal_is_shown(qtbot, dialog, monkeypatch):
    search_and_pick(qtbot, dialog)
    shown = []
    monkeypatch.setattr("app.models_dialog.QMessageBox.warning", lambda *a: shown.append(a[2]))
    monkeypatch.setattr(download.shutil, "disk_usage", lambda p: type("U", (), {"free": 1000})())
    dialog.download_button.click()
    assert shown and shown[0].startswith("Not enough disk space for tester/Tiny-MoE-exl2 (4.0bpw)")
    assert dialog.hub_status.text() == shown[0]
    assert dialog.download_table.rowCount() == 0


def test_offline_hub_is_said_and_local_models_still_work(qtbot, dialog, fake_hub, tmp_path):
    from test_hub_local import write_model
    write_model(tmp_path / "models" / "local-one")
    dialog.refresh_local()
    fake_hub.stop()
    dialog.search_edit.setText("tiny")
    dialog.search()
    qtbot.waitUntil(lambda: "cannot be reached" in dialog.hub_status.text(), timeout=15_000)
    assert "Local models keep working" in dialog.hub_status.text()
    assert dialog.local_table.rowCount() == 1 and cell(dialog.local_table, 0, 6) == "ready"


def test_import_of_a_broken_folder_says_what_is_missing(qtbot, dialog, tmp_path):
    from test_hub_local import write_model
    src = write_model(tmp_path / "src" / "broken", **{"tokenizer.json": None})
    dialog.import_path(src)
    qtbot.waitUntil(lambda: dialog.local_status.text().startswith("Cannot import"), timeout=10_000)
    assert "tokenizer" in dialog.local_status.text()
    good = write_model(tmp_path / "src" / "good")
    dialog.import_path(good)
    qtbot.waitUntil(lambda: dialog.local_status.text() == "Imported good.", timeout=10_000)
    assert dialog.local_table.rowCount() == 1


def test_screenshot_helper_writes_a_png(qtbot, tmp_path):
    from app.models_dialog import grab_model_manager
    out = grab_model_manager(tmp_path / "shots" / "model-manager.png")
    assert out.is_file() and out.stat().st_size > 10_000


def test_delete_asks_first_and_reveal_opens_the_folder(qtbot, dialog, tmp_path, monkeypatch):
    from PySide6.QtWidgets import QMessageBox
    from test_hub_local import write_model
    folder = write_model(tmp_path / "models" / "to-delete")
    dialog.refresh_local()
    dialog.local_table.selectRow(0)
    opened = []
    monkeypatch.setattr("app.models_dialog.QDesktopServices.openUrl", lambda url: opened.append(url.toLocalFile()))
    dialog.reveal_button.click()
    assert opened == [str(folder)]
    asked = []
    monkeypatch.setattr("app.models_dialog.QMessageBox.question",
                        lambda *a: asked.append(a[2]) or QMessageBox.No)
    dialog.delete_button.click()
    assert folder.is_dir() and "Delete to-delete" in asked[0]
    monkeypatch.setattr("app.models_dialog.QMessageBox.question", lambda *a: QMessageBox.Yes)
    dialog.local_table.selectRow(0)
    dialog.delete_button.click()
    assert not folder.exists() and dialog.local_table.rowCount() == 0


def test_mixtral_and_dbrx_branches_get_fit_verdicts(qtbot, dialog, fake_hub):
    """The Hub's EXL2 repositories of both (config.json as their branches hold it): sized, and judged
    from their parameter counts (DBRX's sizes are nested in attn_config / ffn_config)."""
    import json

    from fakehub import Branch, Repo
    from test_fit import DBRX_INSTRUCT, MIXTRAL_8X22B
    for repo, config in (("turboderp/Mixtral-8x22B-Instruct-v0.1-exl2", MIXTRAL_8X22B),
                         ("turboderp/dbrx-instruct-exl2", DBRX_INSTRUCT)):
        branches = {b: Branch(b, {"config.json": json.dumps(dict(config, quantization_config={
            "quant_method": "exl2", "bits": float(b[:3]), "head_bits": 6})).encode(),
            "output.safetensors": b"x" * 64}) for b in ("3.0bpw", "6.0bpw")}
        fake_hub.add(Repo(repo, branches, tags=["exl2"], downloads=5))
    dialog.set_memory(24 * GiB, 128 * GiB, "Test GPU")
    for query, repo in (("mixtral-8x22b", "turboderp/Mixtral-8x22B-Instruct-v0.1-exl2"),
                        ("dbrx", "turboderp/dbrx-instruct-exl2")):
        dialog.search_edit.setText(query)
        dialog.search()
        qtbot.waitUntil(lambda: dialog.repo_list.count() == 1 and repo in dialog.repo_list.item(0).text(),
                        timeout=10_000)
        dialog.repo_list.setCurrentRow(0)
        qtbot.waitUntil(lambda: dialog.hub_status.text().startswith(f"{repo}: 2 quants"), timeout=10_000)
        t = dialog.quant_table
        assert [cell(t, r, 0) for r in range(2)] == ["3.0bpw", "6.0bpw"]
        assert cell(t, 0, 3).startswith("fits with expert offload"), cell(t, 0, 3)
        assert cell(t, 1, 3).startswith("does not fit") or "offload" in cell(t, 1, 3), cell(t, 1, 3)


def test_a_task_cancelled_at_shutdown_is_dropped(dialog):
    """shutdown() cancels queued tasks; their done-callbacks still arrive and must not raise CancelledError."""
    from concurrent.futures import Future
    future, called = Future(), []
    future.cancel()
    dialog._finish_task((called.append, called.append), future)
    assert called == []
