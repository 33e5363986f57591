"""The automatic CPU team size under other programs' load: the decision from injected readings (no timing)."""
from __future__ import annotations

import io
import time

import pytest

from runtime import cpu_load
from runtime.cpu_load import CpuSample, ThreadGovernor, choose_threads, others_busy
from runtime.worker import Worker


@pytest.mark.parametrize("cores, others, threads", [
    (2, None, 2),        # no reading yet: all cores
    (2, 0.0, 2),         # quiet
    (2, 0.3, 2),         # a desktop's background fits in the slack
    (2, 0.6, 1),         # one busy program (`yes`) as the team shares the cores with it
    (2, 1.0, 1),         # ... and when the team has left it a core
    (2, 7.5, 1),         # a build on every core: never fewer than one
    (16, 0.2, 16),
    (16, 2.5, 13),
])
def test_the_team_leaves_the_cores_other_programs_use(cores, others, threads):
    assert choose_threads(cores, others) == threads


def test_others_are_the_busy_time_less_our_own():
    a = CpuSample(wall=10.0, busy=100.0, own=40.0)
    assert others_busy(a, CpuSample(wall=11.0, busy=102.0, own=41.0)) == pytest.approx(1.0)
    assert others_busy(a, CpuSample(wall=11.0, busy=101.0, own=41.0)) == 0.0     # ours alone
    assert others_busy(a, CpuSample(wall=10.1, busy=100.2, own=40.0)) is None    # too short to tell


def _readings(*others_per_second: float):
    """A sampler giving one sample per second in which other programs used the given CPUs."""
    samples, busy = [CpuSample(0.0, 0.0, 0.0)], 0.0
    for i, o in enumerate(others_per_second, 1):
        busy += o + 1.0                     # the engine itself used one CPU each second too
        samples.append(CpuSample(float(i), busy, float(i)))
    it = iter(samples)
    return lambda: next(it)


def test_governor_follows_load_and_quiet_and_reports_contention():
    g = ThreadGovernor(2, sampler=_readings(0.1, 1.0, 1.0, 0.0))
    assert g.threads == 2 and g.others is None and not g.contended
    assert g.observe() is None and g.threads == 2                 # quiet: no change
    assert g.observe() == 1 and g.contended                      # `yes` started
    assert g.observe() is None and g.threads == 1                # still there: no change
    assert g.observe() == 2 and not g.contended                  # gone
    assert g.figures() == {"cpu_threads": 2, "cpu_cores": 2, "cpu_busy_others": 0.0}


def test_governor_keeps_the_users_thread_count_but_still_measures():
    g = ThreadGovernor(2, fixed=2, sampler=_readings(1.0))
    assert g.observe() is None and g.threads == 2 and g.contended


class _Engine:
    """Just enough engine for the worker's thread decisions."""
    adapts_threads = True

    def __init__(self):
        self.resized: list[int] = []

    def set_cpu_threads(self, threads: int) -> None:
        self.resized.append(threads)

    def telemetry(self):
        return {"cpu_threads": self.resized[-1] if self.resized else 2}

    def close(self):
        pass


def test_worker_resizes_an_automatic_team_and_says_so_in_telemetry():
    w = Worker(io.StringIO())
    w.engine, w.governor = _Engine(), ThreadGovernor(2, sampler=_readings(1.2, 0.0))
    w._adapt_threads()
    t = w.telemetry()
    assert w.engine.resized == [1] and (t.cpu_threads, t.cpu_busy_others) == (1, pytest.approx(1.2))
    w._adapt_threads()
    assert w.engine.resized == [1, 2] and w.telemetry().cpu_busy_others == 0.0


def test_worker_leaves_a_fixed_team_alone():
    w = Worker(io.StringIO())
    w.engine = _Engine()
    w.engine.adapts_threads = False
    w.governor = ThreadGovernor(2, sampler=_readings(1.5))
    w._adapt_threads()
    assert w.engine.resized == [] and w.telemetry().cpu_busy_others == pytest.approx(1.5)


def test_the_machines_own_reading_is_a_number_of_cpus():
    others = cpu_load.measure_others()
    assert others is not None and 0.0 <= others <= (cpu_load.physical_cores() * 4)


def test_on_cores_runs_with_more_threads_and_puts_the_count_back_even_on_error():
    import torch

    from runtime.cpu_load import on_cores
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)                   # as a process started with OMP_NUM_THREADS=1
        assert on_cores(2, torch.get_num_threads) == 2
        assert torch.get_num_threads() == 1
        with pytest.raises(KeyError, match="load failed"):
            on_cores(3, lambda: (_ for _ in ()).throw(KeyError("load failed")))
        assert torch.get_num_threads() == 1
        torch.set_num_threads(2)
        assert on_cores(1, torch.get_num_threads) == 2          # never lowered
        assert torch.get_num_threads() == 2
        with torch.inference_mode():                            # the caller's modes carry over
            assert on_cores(2, torch.is_inference_mode_enabled)
        with torch.no_grad():
            assert not on_cores(2, torch.is_grad_enabled)
        assert on_cores(2, lambda a, b=0: a + b, 1, b=2) == 3
    finally:
        torch.set_num_threads(before)


def test_on_cores_leaves_no_grown_thread_team_behind():
    """The work's OpenMP team ends with its helper thread. Grown on the caller's thread it stayed docked
    for the process's life, and while more OpenMP threads live than the machine has CPUs, libgomp makes
    every team (the CPU expert path's too) sleep at its barriers after 100 spins instead of 300,000."""
    import psutil
    import torch

    from runtime.cpu_load import on_cores
    if "OpenMP" not in torch.__config__.parallel_info():
        pytest.skip("torch's CPU threads are not OpenMP here")
    before, proc = torch.get_num_threads(), psutil.Process()
    a = torch.randn(600, 600)

    def work() -> int:
        (a @ a).sum()
        a.add(1.0).sum()
        return proc.num_threads()
    try:
        torch.set_num_threads(1)
        n0 = proc.num_threads()
        inside = on_cores(6, work)
        assert inside >= n0 + 5                              # the team really grew (helper + 5 more)
        deadline = time.monotonic() + 5
        while proc.num_threads() > n0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert proc.num_threads() == n0
    finally:
        torch.set_num_threads(before)


def test_a_fixed_thread_count_holds_when_another_thread_sets_its_own_first():
    """torch sets a thread's count once more on its first parallel operation, to the value another
    thread set last: a copy thread set to 1 that had not yet computed took a load's 4 (a team of 4
    docked on it). fix_thread_count holds whatever another thread sets in between."""
    import threading

    import torch
    seen: dict = {}
    ready, go = threading.Event(), threading.Event()

    def body() -> None:
        cpu_load.fix_thread_count(1)
        ready.set()
        go.wait()
        torch.ones(1 << 16).sum()                   # its first parallel operation
        seen["threads"] = torch.get_num_threads()
    t = threading.Thread(target=body)
    before = torch.get_num_threads()
    t.start()
    try:
        ready.wait()
        torch.set_num_threads(3)                    # another thread's setting, before the first operation
        go.set()
        t.join()
    finally:
        torch.set_num_threads(before)
    assert seen["threads"] == 1
