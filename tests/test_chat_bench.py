"""A 2,000-message conversation opens and scrolls end to top: records the figures (no timing asserts)."""
from __future__ import annotations

import json

import pytest

from app.chat import bench_scroll


@pytest.mark.slow
def test_two_thousand_messages_open_and_scroll(qtbot, record_property, capsys):
    r = bench_scroll.run(2000)
    with capsys.disabled():
        print("\nscroll benchmark:", json.dumps(r.__dict__))
    for k, v in r.__dict__.items():
        record_property(k, v)
    # The whole conversation is reachable: about one page per few messages, top reached.
    assert r.messages == 2000
    assert r.scroll_pages > 2000 // 10
