"""The worker's process name is cosmetic: without setproctitle it still starts."""
import sys

from runtime import worker


def test_name_process_without_setproctitle(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "setproctitle", None)    # import fails as if not installed
    worker.name_process()
    assert "setproctitle is not installed" in capsys.readouterr().err
