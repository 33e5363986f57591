"""Message rendering and the list model: Markdown, code blocks, thinking, per-token change signals."""
from __future__ import annotations

import pytest
from PySide6.QtCore import QSize
from PySide6.QtWidgets import QStyleOptionViewItem

from app.chat import markdown
from app.chat.delegate import MessageDelegate
from app.chat.model import ChatItem, ContentRole, IsLastRole, MessageListModel, StateRole


def test_markdown_code_blocks_are_highlighted_and_copyable():
    text = "Use this:\n\n```python\ndef f(x):\n    return x < 1\n```\n\nand `inline` code.\n\n    indented = 1\n"
    r = markdown.render(text)
    assert r.code_blocks == ["def f(x):\n    return x < 1", "indented = 1"]
    assert f'href="{markdown.app_link("code", 0)}"' in r.html and f'href="{markdown.app_link("code", 1)}"' in r.html
    assert "<code>inline</code>" in r.html
    assert 'style="color: #' in r.html          # pygments colours, inline for QTextDocument
    assert "&lt; 1" in r.html or "&lt;" in r.html


def test_raw_html_in_a_message_is_text():
    r = markdown.render('<img src=x onerror="alert(1)"> <b>bold?</b>')
    assert "<img" not in r.html and "&lt;img" in r.html and "<b>" not in r.html
    user = markdown.render("<b>hi</b>\nline two", plain=True)
    assert "&lt;b&gt;hi&lt;/b&gt;<br>line two" in user.html


def test_thinking_sections_fold():
    text = "<think>Paris is in France.\nSo...</think>The capital is **Paris**."
    folded = markdown.render(text)
    assert folded.thinks == 1 and f'href="{markdown.app_link("think", 0)}"' in folded.html
    assert "Paris is in France" not in folded.html and "<strong>Paris</strong>" in folded.html
    open_ = markdown.render(text, expanded=frozenset({0}))
    assert "Paris is in France" in open_.html
    assert markdown.strip_thinking(text) == "The capital is **Paris**."


@pytest.mark.parametrize("text", ["<think>a b</think>answer", "pre<think>x</think>mid<think>y</think>post",
                                  "é<think>ü</think>ß"])
def test_streaming_prefixes_at_every_split_never_lose_text(text):
    """Each prefix (as streamed) renders; the visible text plus thinking is always the prefix itself."""
    for i in range(len(text) + 1):
        prefix = text[:i]
        segs = markdown.split_thinking(prefix)
        rebuilt = "".join((markdown.THINK_OPEN + s.text + (markdown.THINK_CLOSE if s.closed else ""))
                          if s.kind == "think" else s.text for s in segs)
        # An opening tag cut in half is plain text until the rest arrives.
        assert rebuilt == prefix
        markdown.render(prefix)


def test_model_signals_only_the_streaming_row_and_content_role(qtbot):
    model = MessageListModel()
    model.append(ChatItem(1, "user", "hi"))
    model.append(ChatItem(2, "assistant", "", state="streaming"))
    seen = []
    model.dataChanged.connect(lambda a, b, roles: seen.append((a.row(), b.row(), list(roles))))
    for tok in ["Hel", "lo", "!"]:
        model.append_text(1, tok)
    assert seen == [(1, 1, [ContentRole])] * 3
    assert model.items[1].content == "Hello!"
    seen.clear()
    model.update(1, state="done")
    assert seen == [(1, 1, [StateRole])]
    assert model.index(1).data(IsLastRole) and not model.index(0).data(IsLastRole)
    model.truncate(1)
    assert model.rowCount() == 1 and model.index(0).data(IsLastRole)


def test_delegate_links_and_height_grow_with_text(qtbot):
    model = MessageListModel()
    model.append(ChatItem(1, "user", "Question"))
    model.append(ChatItem(2, "assistant", "```sh\nls\n```", state="done"))
    d = MessageDelegate()
    opt = QStyleOptionViewItem()
    opt.rect.setSize(QSize(600, 100))
    link = markdown.app_link
    assert d.hyperlinks(model.index(0), opt) == [link("copy"), link("edit"), link("fork")]
    assert d.hyperlinks(model.index(1), opt) == [link("copy"), link("regenerate"), link("fork"), link("code", 0)]
    got = []
    d.action.connect(lambda kind, row, payload: got.append((kind, row, payload)))
    d.activate(link("code", 0), model.index(1))
    d.activate(link("regenerate"), model.index(1))
    assert got == [("copy_code", 1, "ls"), ("regenerate", 1, None)]
    h1 = d.sizeHint(opt, model.index(1)).height()
    model.append_text(1, "\n\n" + "More text. " * 200)
    assert d.sizeHint(opt, model.index(1)).height() > h1 + 50


def test_chat_settings_dialog_values_and_presets(qtbot, tmp_path):
    from app.chat.settings_dialog import NO_PRESET, ConversationSettingsDialog
    from app.store import Store
    from runtime.options import SamplingOptions

    store = Store(tmp_path / "s.sqlite3")
    start = SamplingOptions(temperature=0.3, top_k=7, seed=None, stop=("###",))
    dlg = ConversationSettingsDialog(store, "Be terse.", start)
    qtbot.addWidget(dlg)
    prompt, sampling, preset = dlg.result_values()
    assert (prompt, preset) == ("Be terse.", "")
    assert sampling == start                       # untouched fields (stop) survive the round trip
    dlg.form.editors["temperature"].setValue(1.25)
    dlg.form.editors["seed"].setValue(42)
    dlg._save_preset("Creative")
    assert [p.name for p in store.presets()] == ["Creative"]
    assert dlg.presets.currentText() == "Creative"
    dlg._defaults()
    assert dlg.result_values()[1].temperature == SamplingOptions().temperature
    dlg.presets.setCurrentIndex(dlg.presets.findText("Creative"))
    dlg._apply_preset(dlg.presets.currentIndex())
    prompt, sampling, preset = dlg.result_values()
    assert (prompt, sampling.temperature, sampling.seed, preset) == ("Be terse.", 1.25, 42, "Creative")
    dlg._delete_preset()
    assert store.presets() == [] and dlg.presets.currentText() == NO_PRESET


def test_window_chat_and_store_modules_do_not_import_torch():
    import os
    import subprocess
    import sys
    code = ("import sys, app.main, app.window, app.store, app.theme, app.screenshots, app.chat.view, "
            "app.chat.session, app.chat.conversations, app.chat.panel, app.chat.settings_dialog, "
            "app.chat.bench_scroll\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'exllamav2', 'transformers')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "QT_QPA_PLATFORM": "offscreen"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
