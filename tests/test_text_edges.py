"""Text at its awkward edges: exported code fences, chat titles, list dates, search hits, model names."""
from __future__ import annotations

import time

import pytest

from app.chat import conversations, session
from app.chat.conversations import when
from app.store import Store
from runtime import paths

HIT_START, HIT_END = "\x02", "\x03"         # app.store's markers of a hit in a snippet


@pytest.mark.parametrize("text, closed", [
    ("Here:\n```python\nprint(1)", "Here:\n```python\nprint(1)\n```"),
    ("~~~\ncode", "~~~\ncode\n~~~"),
    ("````md\n```python\nx\n```\nstill code", "````md\n```python\nx\n```\nstill code\n````"),
    ("```\nnested ```` inside\n```` not closing", "```\nnested ```` inside\n```` not closing\n`````"),
])
def test_an_open_fence_is_closed_by_a_longer_one(text, closed):
    from app.store import close_fences
    assert close_fences(text) == closed


@pytest.mark.parametrize("text", ["plain", "```\ncode\n```\nafter", "a ``` b", "````\nx\n````", ""])
def test_closed_or_no_fences_are_left_alone(text):
    from app.store import close_fences
    assert close_fences(text) == text


def test_markdown_export_of_a_stopped_code_block_keeps_later_messages_out_of_it(tmp_path):
    store = Store(tmp_path / "c.sqlite3")
    conv = store.create_conversation("Code")
    store.add_message(conv.id, "user", "Write code")
    store.add_message(conv.id, "assistant", "Sure:\n```python\nfor i in range(", state="cancelled")
    store.add_message(conv.id, "user", "Thanks")
    md = store.export_markdown(conv.id)
    store.close()
    fences = [line for line in md.splitlines() if line.startswith("```")]
    assert fences == ["```python", "```"] and md.index("## You", md.index("range(")) > md.rindex("```")


def test_titles_are_cut_at_a_word_with_an_ellipsis():
    title_from, TITLE_CHARS = session.title_from, session.TITLE_CHARS
    long = "Explain how the expert offload of mixture models decides which experts stay in VRAM"
    title = title_from(long)
    assert title.endswith("…") and len(title) <= TITLE_CHARS
    assert long.startswith(title[:-1]) and long[len(title) - 1] == " "      # ends where a word ends
    assert title_from("Short question?\nmore lines") == "Short question?"
    assert title_from("\n\n  Leading blank lines") == "Leading blank lines"
    assert title_from("   ") == "New chat"
    assert title_from("x" * 100) == "x" * (TITLE_CHARS - 1) + "…"          # one long word: cut it


def test_list_dates_say_the_date_when_not_today():
    now = time.mktime((2026, 12, 1, 15, 0, 0, 0, 0, -1))
    assert when(now - 3600, now) == "14:00"
    two_days = when(now - 2 * 86400, now)
    assert two_days.endswith("29 Nov") and two_days.split()[0].isalpha()   # "Sun 29 Nov"
    assert when(now - 40 * 86400, now) == "22 Oct"
    assert when(now - 400 * 86400, now) == "27 Oct 2025"


def test_search_hits_render_bold_and_copy_without_markers():
    entry_html, plain = conversations.entry_html, conversations.plain
    sub = f"…the capital is {HIT_START}Paris{HIT_END}, a city…"
    assert entry_html("Capitals <1>", sub) == ("Capitals &lt;1&gt;<br><small>…the capital is <b><u>Paris</u></b>, "
                                               "a city…</small>")
    assert plain(f"Capitals\n{sub}") == "Capitals\n…the capital is Paris, a city…"
    assert "[" not in plain(sub)


def test_store_search_marks_hits_with_private_markers(tmp_path):
    store = Store(tmp_path / "c.sqlite3")
    conv = store.create_conversation("Geography")
    store.add_message(conv.id, "assistant", "The capital of France is Paris [citation needed].")
    hit = store.search("paris")[0]
    store.close()
    assert HIT_START + "Paris" + HIT_END in hit.snippet and "[Paris]" not in hit.snippet


def test_one_name_per_model():
    assert paths.display_name(paths.DEMO_ALIAS) == paths.DEMO_MODEL_NAME
    assert paths.display_name(str(paths.models_dir() / paths.DEMO_MODEL_NAME)) == paths.DEMO_MODEL_NAME
    assert paths.display_name("Qwen3-30B-A3B-exl2") == "Qwen3-30B-A3B-exl2"


def test_missing_x11_libraries_are_named_with_the_install_command():
    from app import display_check as dc
    assert dc.uses_xcb({"DISPLAY": ":0"}, "linux")
    assert not dc.uses_xcb({"DISPLAY": ":0", "QT_QPA_PLATFORM": "offscreen"}, "linux")
    assert not dc.uses_xcb({"DISPLAY": ":0", "WAYLAND_DISPLAY": "wayland-0"}, "linux")
    assert dc.uses_xcb({"QT_QPA_PLATFORM": "xcb"}, "linux") and not dc.uses_xcb({"DISPLAY": ":0"}, "win32")
    missing = dc.missing_for_display(lambda soname: soname not in ("libxcb-icccm.so.4", "libxcb-keysyms.so.1"))
    assert missing == ["libxcb-icccm4", "libxcb-keysyms1"]
    assert "sudo apt-get install libxcb-icccm4 libxcb-keysyms1" in dc.advice(missing)
    assert dc.advice(dc.missing_for_display(lambda soname: True)) is None


def test_moedesk_says_what_to_install_instead_of_qts_abort(monkeypatch, capsys):
    from app import display_check as dc
    from app.main import main
    monkeypatch.setattr(dc, "uses_xcb", lambda: True)
    monkeypatch.setattr(dc, "_loads", lambda soname: soname != "libxcb-cursor.so.0")
    assert main([]) == 1
    assert "sudo apt-get install libxcb-cursor0" in capsys.readouterr().err
