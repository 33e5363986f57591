"""A subcommand whose worker dies says why (the worker's last log lines), not a bare traceback."""
from runtime import cli
from runtime.client import WorkerDied


def test_worker_death_prints_its_last_lines(monkeypatch, capsys):
    import bench.worker

    def run(args):
        raise WorkerDied("the worker process ended (exit code 1)",
                         ["Traceback (most recent call last):", "ModuleNotFoundError: No module named 'x'"], 1)

    monkeypatch.setattr(bench.worker, "run", run)
    assert cli.main(["bench-worker", "--model", "demo"]) == 1
    err = capsys.readouterr().err
    assert "moedesk-cli bench-worker: the worker process ended (exit code 1)" in err
    assert "No module named 'x'" in err
