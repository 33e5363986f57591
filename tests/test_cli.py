"""moedesk-cli imports only the module of the subcommand it runs."""
from __future__ import annotations

import pytest

from runtime import cli


def test_a_broken_subcommand_module_does_not_break_the_others(monkeypatch, capsys):
    monkeypatch.setitem(cli.SUBCOMMANDS, "bench", ("runtime.no_such_module", "broken"))
    with pytest.raises(SystemExit) as ei:
        cli.main(["synth", "--help"])
    assert ei.value.code == 0
    assert "--shape" in capsys.readouterr().out
    with pytest.raises(ModuleNotFoundError):
        cli.main(["bench", "--model", "demo"])


def test_unknown_subcommand_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as ei:
        cli.main(["nope"])
    assert ei.value.code == 2
    assert "invalid choice: 'nope'" in capsys.readouterr().err
