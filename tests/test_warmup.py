"""Warm-up ahead of need: which decode graphs are captured where, and the worker's idle loop."""
from __future__ import annotations

import threading
import time

from runtime import protocol as P
from runtime.backends.exl2_graph import BUCKET, answer_plan, bucket, capture_position, warm_plan
from runtime.worker import Worker


def test_capture_position_stays_past_the_cache_and_in_the_bucket():
    assert capture_position(512, 1, 0, 4096) == 0
    assert capture_position(1024, 1, 0, 4096) == 512              # the next bucket, ahead of need
    assert capture_position(1024, 9, 700, 4096) == 700
    assert capture_position(512, 9, 505, 4096) is None           # 9 rows from 505 reach the next bucket
    assert capture_position(512, 1, 600, 4096) is None           # behind the cache's end
    for L, T, first in ((512, 3, 10), (1536, 5, 1100), (4096, 2, 4000)):
        pos = capture_position(L, T, first, 4096)
        assert pos >= first and bucket(pos, T, 4096) == L


def test_warm_plan_puts_decode_steps_of_the_next_buckets_first():
    plan = warm_plan(100, 5, 4096, captured=[])
    assert plan[:3] == [(512, 1), (1024, 1), (1536, 1)]          # decode, now and two buckets ahead
    assert plan[3:7] == [(512, 2), (512, 3), (512, 4), (512, 5)]  # then verify rows of the drafting K
    assert (512, 9) in plan and (1536, 9) not in plan
    assert len(plan) == len(set(plan))
    done = warm_plan(100, 5, 4096, captured=plan)
    assert done == []                                             # nothing left: the worker idles
    assert warm_plan(4000, 1, 4096, captured=[])[:1] == [(4096, 1)]   # capped at the cache
    assert all(L % BUCKET == 0 for L, _ in warm_plan(1300, 9, 8192, captured=[]))


def test_an_answer_gets_the_graphs_of_every_bucket_it_can_reach_before_token_1():
    """A code edit at 1967 tokens with 160 to write crosses into 2560: its decode graph (and with
    drafting the verify rows) is captured before the first token, not between two tokens."""
    assert answer_plan(1967, 160, 1, 8192, captured=[]) == [(2048, 1), (2560, 1)]
    assert answer_plan(1967, 160, 1, 8192, captured=[(2048, 1)]) == [(2560, 1)]
    assert answer_plan(100, 160, 1, 8192, captured=[]) == [(512, 1)]          # stays in its bucket
    plan = answer_plan(1967, 160, 3, 8192, captured=[])
    assert plan[:2] == [(2048, 1), (2560, 1)] and set(plan[2:]) == {(2048, 2), (2048, 3), (2560, 2), (2560, 3)}
    assert answer_plan(100, 5000, 1, 8192, captured=[]) == [(512, 1), (1024, 1), (1536, 1)]   # at most 2 ahead
    assert answer_plan(8100, 500, 1, 8192, captured=[]) == [(8192, 1)]         # capped at the cache


def test_a_context_not_a_multiple_of_the_bucket_gets_its_capped_last_bucket():
    """A 1300-token context: the last bucket is 1024..1300, attended as L = 1300, captured from 1024 on."""
    assert capture_position(1300, 1, 0, 1300) == 1024 and bucket(1024, 1, 1300) == 1300
    assert capture_position(1300, 6, 1290, 1300) == 1290 and capture_position(1300, 6, 1296, 1300) is None
    assert warm_plan(0, 1, 1300, captured=[], max_rows=1) == [(512, 1), (1024, 1), (1300, 1)]
    assert answer_plan(1000, 400, 1, 1300, captured=[]) == [(1024, 1), (1300, 1)]    # it crosses into 1300
    assert answer_plan(1000, 10, 1, 1300, captured=[]) == [(1024, 1)]


class Lines:
    """The worker's event channel, each line with its arrival time."""

    def __init__(self):
        self.events: list[tuple[float, object]] = []

    def write(self, line: str) -> None:
        self.events.append((time.perf_counter(), P.decode_event(line)))

    def flush(self) -> None:
        pass


class IdleEngine:
    """Idle work of STEP seconds a step, `left` steps of it."""
    STEP = 0.05

    def __init__(self, left: int):
        self.left, self.done, self.closed = left, 0, False
        self.starts: list[float] = []

    def idle_work(self) -> bool:
        if self.left == 0:
            return False
        self.starts.append(time.perf_counter())
        time.sleep(self.STEP)
        self.left -= 1
        self.done += 1
        return True

    def close(self) -> None:
        self.closed = True


def test_idle_work_runs_between_commands_and_yields_within_one_step():
    out = Lines()
    w = Worker(out)
    engine = w.engine = IdleEngine(left=1000)
    serving = threading.Thread(target=w.serve, daemon=True)
    serving.start()
    deadline = time.time() + 5
    while engine.done < 3 and time.time() < deadline:
        time.sleep(0.01)
    assert engine.done >= 3                                       # idle: the engine works ahead
    w.on_line(P.encode(P.Unload(request_id="u")))                 # queued when on_line returns
    t0 = time.perf_counter()
    deadline = time.time() + 5
    while not any(isinstance(e, P.Unloaded) for _, e in out.events) and time.time() < deadline:
        time.sleep(0.005)
    assert any(isinstance(e, P.Unloaded) for _, e in out.events)
    # the command waited for one step at most: the one the worker may have begun just as it was queued
    assert sum(t > t0 for t in engine.starts) <= 1, [t - t0 for t in engine.starts if t > t0]
    assert engine.closed and engine.left > 0
    w.on_line(P.encode(P.Shutdown()))
    serving.join(5)
    assert not serving.is_alive()


def test_failing_idle_work_is_logged_and_left_alone(capsys):
    class Broken(IdleEngine):
        def idle_work(self):
            self.done += 1
            raise RuntimeError("capture refused")

    out = Lines()
    w = Worker(out)
    w.engine = engine = Broken(left=5)
    serving = threading.Thread(target=w.serve, daemon=True)
    serving.start()
    time.sleep(0.2)
    w.on_line(P.encode(P.Shutdown()))
    serving.join(5)
    assert engine.done == 1 and "capture refused" in capsys.readouterr().err


class _Graphs:
    max_rows = 9

    def __init__(self):
        self.done: list = []
        self.attention_warmed_at = self.attention_rows = None

    def warm_attention(self, progress, rows=None):
        self.attention_warmed_at = len(self.done)       # graphs captured before it (none: it runs first)
        self.attention_rows = rows
        return 0

    def captured(self):
        return list(self.done)

    def prepare(self, L, T, pos):
        self.done.append((L, T))
        return True


def _engine(monkeypatch, context: int = 4096):
    """An Exl2Engine without a model: prefill and the graphs are fakes, what is counted is real."""
    import types

    import torch

    from runtime.backends.exl2 import Exl2Engine
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    e = Exl2Engine.__new__(Exl2Engine)
    e.info = types.SimpleNamespace(context_length=context)
    e.vocab, e.offload, e.graphs, e.warm_rows = 100, None, _Graphs(), 1
    e.cache = types.SimpleNamespace(current_seq_len=0)
    e.prefills = []
    e.prefill = lambda tokens: e.prefills.append(len(tokens))
    return e


def test_warm_up_progress_never_counts_past_its_total(monkeypatch):
    """The H200 log said "Preparing GPU kernels 6/5 ... 15/5": with the capture left to after the
    expert path is settled, the warm-up still captured (graphs the settling then dropped) past the
    total it had announced."""
    from runtime.backends.exl2 import PREFILL_WARM_ROWS
    for capture, draft_rows in ((False, 5), (True, 5), (True, 1)):
        e = _engine(monkeypatch)
        seen = []
        e.warm_up(lambda stage, msg, done, total: seen.append((msg, done, total)), draft_rows, capture=capture)
        assert e.prefills == list(PREFILL_WARM_ROWS)
        assert all(d <= t for _, d, t in seen), seen
        counts = [m.split()[-1] for m, _, _ in seen if m.startswith("Preparing")]
        assert all(int(a.split("/")[0]) <= int(a.split("/")[1]) for a in counts), counts
        assert seen[-1][0] == f"GPU kernels ready ({seen[-1][2]} prepared)"
        if capture:
            assert e.graphs.done and seen[-1][2] == len(PREFILL_WARM_ROWS) + len(e.graphs.done)
        else:
            assert e.graphs.done == []          # captured once, after the path is settled
    # a plan longer than the total a caller announced: the total grows, the counter never passes it
    e = _engine(monkeypatch)
    e.warm_rows = 5
    seen = []
    e.prepare_graphs(lambda stage, msg, done, total: seen.append((msg, done, total)), 5, 5)
    assert len(e.graphs.done) > 0 and all(d < t for _, d, t in seen[:-1]) and seen[-1][1] == seen[-1][2]


def test_warm_up_compiles_the_attention_variants_before_any_capture(monkeypatch):
    """A fresh machine: a later bucket's capture compiled Triton attention kernels (1.7 s in idle time on
    the H200; right before a first token when a prompt jumps past the prepared buckets). The load runs the
    variants of every bucket at the rows an answer captures first, with or without its own captures."""
    for capture in (True, False):
        e = _engine(monkeypatch)
        e.warm_up(lambda *a: None, 3, capture=capture)
        assert e.graphs.attention_warmed_at == 0
        assert e.graphs.attention_rows == 3             # the rows an answer captures (answer_plan), not all 9


def test_attention_variants_are_few_and_cover_every_bucket():
    """Qwen3-30B-A3B's attention (32 query heads, 4 KV heads, head dim 128) over a 32K cache: 64 buckets,
    8 variants a row count (the chunk and the splits' padding change at powers of two)."""
    from runtime.backends.attention import variant
    from runtime.backends.exl2_graph import MAX_ROWS, attention_variants, bucket_lengths
    Ls = bucket_lengths(32768)
    assert len(Ls) == 64 and Ls[0] == BUCKET and Ls[-1] == 32768
    assert bucket_lengths(1300) == [512, 1024, 1300] and bucket_lengths(300) == [300]
    got = attention_variants(32768, 32, 4, 128)
    assert {T for _, T in got.values()} == set(range(1, MAX_ROWS + 1))
    per_rows = [sum(1 for _, t in got.values() if t == T) for T in range(1, MAX_ROWS + 1)]
    assert per_rows == [8] * MAX_ROWS, per_rows
    for key, (L, T) in got.items():                       # a representative launches its variant
        assert L in Ls and variant(L, T, 32, 4, 128) == key
    for T in (1, 5, 9):                                   # and every bucket's launch is listed
        assert {variant(L, T, 32, 4, 128) for L in Ls} <= set(got)
    one = attention_variants(32768, 32, 4, 128, max_rows=1)
    assert sorted(L for L, _ in one.values())[:3] == [512, 1024, 1536]     # 8, 16, 32 splits (padded)
    # 32 query heads on one KV head: 9 rows would be 288 query rows a program, more than the kernel takes
    assert max(T for _, T in attention_variants(4096, 32, 1, 128).values()) == 8
