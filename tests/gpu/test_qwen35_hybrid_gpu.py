"""Qwen3.5-MoE in the hybrid engine on CUDA (exllamav2's quantized GEMM, our expert kernels, fp16
activations) against the same engine on the CPU (float32, projections dequantized: itself checked
against the CPU reference in tests/test_qwen35_hybrid_engine.py).

Models (synthetic, `synth`): `tiny-qwen3.5` (hidden 256, 4 layers, 16 experts top-4) and the real widths of
Qwen3.5-122B-A10B (hidden 3072, 256 experts top-8, 64 value heads, head_dim 256) cut to 2 layers, one
Gated DeltaNet and one gated attention (full_attention_interval 2), at 3.0 bpw.

- prefill, decode, a verify of K + 1 rows, a rollback to every accepted prefix 0..K+1 each followed by a
  verify of 2 and a decode: relative error of the logits (norm of the difference / norm of the CPU's).
- decode graphs: the script's short forwards with fixed shapes (`static`, what a graph captures) run
  eagerly against the CPU; then with graphs on (the first two buckets' graphs captured at load, then
  replayed) against those static forwards. Across bucket edges (a 1300-token context: buckets 512,
  1024 and the capped 1300): decodes at 509..513, verifies crossing an edge, each through the graph of
  its last row's bucket, against the static and the eager forwards; the graphs' memory pool grows by
  little more than each graph's output.
- offload: every expert's codes in pinned host memory, a few per layer in VRAM slots: as all in VRAM;
  under decode graphs, the graphs' logits as the static forwards'; with the CPU expert path computing
  part of the cold experts inside the graphs, as all in VRAM.
- the MTP head: its draft logits following replayed graphs against the CPU engine's head (tiny), and
  with graphs against without (real width); greedy MTP speculation against plain steps.

Shared picks. Where a row's k-th and (k+1)-th router logits nearly tie, two computations that round apart
pick different experts; the row then differs by ~1e-1 (seen on the H200: single steps at 0.09-0.2 among
steps at 3e-3), and so does every later row whose attention or DeltaNet state it reached. So every
comparison shares the picks (tests/gpu/routing_replay.py): against the CPU, the CUDA engine takes the CPU
engine's picks and weights, and its own router is checked against them (picks equal except where the CPU
router's gap is under TIE of its logits' standard deviation; weights over equal picks within the
logits' tolerance times `router_factor`); between two CUDA paths, the second takes the first's. A
rollback in the scripts stays inside the snapshot ring, so no forward runs unseen (a truncate before
it replays the kept tokens, where picks could not be given).

Tolerances: TOL (fp16 against the float32 CPU engine) and TOL_PATH (two fp16 computations of the same
picks by other kernels or orders of summation: graphs, host-read cold experts, the CPU expert path), each
WIDE times at the real width, as tests/gpu/test_mixtral_dbrx_gpu.py's; TOL_PATH was 1e-3 before the
picks were shared, under what the H200 showed between two CUDA paths on the miniature (2-3.5e-3; Mixtral's
miniature 1.4e-3).

The CPU engine's logits at real width take minutes: a thread computes them from the module's first test
on, beside the GPU tests that need none; the comparison with them runs last.

With MOEDESK_GPU_REPORT=FILE set, every measured figure is appended to FILE as JSON lines.
"""
from __future__ import annotations

import json
import threading
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from gpu_figures import record as _record, rel as _rel
from gpu_env import child_env
from routing_replay import Picks, router_factor
from runtime.options import LoadOptions, OffloadOptions
from tests.router_ties import logit_view

pytestmark = pytest.mark.gpu
TOL = 2e-2              # fp16 activations and exllamav2's fp16 GEMM against float32
TOL_PATH = 1e-2 * 2 ** 0.5   # two fp16 computations, each within 1e-2 of float32, of the same picks
WIDE = 2                # the tolerances' factor at the real width (fp16 rounding grows with it)
TIE = {"tiny": 0.01, "real": 0.05}     # a near tie: the CPU router's k-th and (k+1)-th logits this close (stds)
K = 5
WINDOW = K + 1
GiB = 1 << 30
SHAPES = {"tiny": ("tiny-qwen3.5", 4, 4), "real": ("qwen3.5-122b-a10b", 2, 2)}   # name, layers, attention every


def _tol(base: float, size: str) -> float:
    return base * (WIDE if size == "real" else 1)


@pytest.fixture(scope="module")
def models(synthetic):
    """size -> folder, written on first use (once per run: conftest's synthetic)."""
    def get(size: str) -> Path:
        from dataclasses import replace
        from runtime.exl2 import synth
        from runtime.exl2.shapes import get_shape
        name, layers, every = SHAPES[size]
        shape = replace(get_shape(name), layers=layers, full_attention_interval=every)
        return synthetic(f"{name}-{layers}l-every{every}-3.0bpw-s1",
                         lambda out: synth.write_synthetic(shape, 3.0, out, seed=1))
    return get


def _load(path, device="cuda", **kw):
    from runtime.backends import hybrid
    off = OffloadOptions(context_length=1024, **kw.pop("off", {}))
    return hybrid.load(path, LoadOptions(offload=off), device=device, window=WINDOW, **kw)


def _steps(vocab: int):
    """Prefill, decode, verify, rollback to every accepted prefix (inside the snapshot ring: after a
    verify of WINDOW rows from 73 the ring's base is 73): ("forward", ids) and ("truncate", length)."""
    g = torch.Generator().manual_seed(4)
    toks = torch.randint(0, min(vocab - 64, 240000), (120,), generator=g).tolist()   # no specials, no media ids
    yield "forward", toks[:70]
    for i in range(70, 73):
        yield "forward", [toks[i]]
    for keep in range(WINDOW + 1):
        yield "truncate", 73
        yield "forward", toks[73:73 + WINDOW]
        yield "truncate", 73 + keep
        yield "forward", toks[90 + keep:92 + keep]
        yield "forward", [toks[100 + keep]]


def _run(eng, steps, around=None) -> list[torch.Tensor]:
    """The logits (on the CPU) of every forward of `steps`; `around(i, ids, run)` wraps the i-th forward.
    A truncate to before the snapshot ring (which the engine serves by running the kept tokens again, a
    forward no wrapper would see) is a reset and a prefill of the kept tokens here, wrapped, its logits
    left out (the same engine logic on both devices decides where, so both take the same steps)."""
    out, n = [], 0

    def forward(ids):
        nonlocal n
        run = (lambda: eng.forward(ids))
        n += 1
        return around(n - 1, ids, run) if around is not None else run()
    eng.reset()
    for kind, arg in steps:
        if kind == "forward":
            out.append(forward(arg).float().cpu())
        elif 0 < arg < eng.cache.base:
            kept = list(eng.tokens[:arg])
            eng.reset()
            forward(kept)
        else:
            eng.truncate(arg)
    return out


def _script(eng, around=None) -> list[torch.Tensor]:
    return _run(eng, _steps(eng.info.vocab_size), around)


def _compare(got, want, tol, what):
    """The worst step (0: the prefill, 1-3: decodes, then per kept prefix: verify, verify of 2, decode)
    named in the failure."""
    assert len(got) == len(want), f"{what}: {len(got)} steps against {len(want)}"
    rels = [_rel(a, b) for a, b in zip(got, want)]
    worst = max(rels)
    _record(test="qwen35_hybrid", what=what, rel=worst, steps=[round(r, 5) for r in rels])
    assert worst <= tol, (f"{what}: relative logit error {worst:.2e} > {tol:.2e} at step {rels.index(worst)} "
                          f"(all: {', '.join(f'{r:.1e}' for r in rels)})")


class CpuRouters:
    """The CPU engine's routers (runtime/experts/layer.route, which its ExpertLayers call), recorded on the
    thread inside `recording()` (the real width's oracle runs in a thread beside the GPU tests): per call,
    the router's gate_w address, its picks (int32) and weights, its k-th minus (k+1)-th logit and the
    logits' standard deviation."""

    def __init__(self):
        from runtime.experts import layer
        self.layer, self.real, self.local = layer, layer.route, threading.local()
        layer.route = self._route

    def close(self) -> None:
        self.layer.route = self.real

    def _route(self, x, gate_w, top_k, renormalize=True):
        r = self.real(x, gate_w, top_k, renormalize)
        calls = getattr(self.local, "calls", None)
        if calls is not None:
            _, gap, spread = logit_view(x.float() @ gate_w.float().T, top_k)
            calls.append((gate_w.data_ptr(), r.ids.to(torch.int32).cpu(), r.weights.float().cpu(), gap.cpu(), spread))
        return r

    @contextmanager
    def recording(self):
        self.local.calls = []
        try:
            yield self.local.calls
        finally:
            self.local.calls = None


class Oracle:
    """The CPU engine's script: logits per forward; per forward and MoE layer, picks (ids, weights) and gaps."""

    def __init__(self, logits, picks, gaps, spread):
        self.logits, self.picks, self.gaps, self.spread = logits, picks, gaps, spread


def _cpu_oracle(path, routers: CpuRouters) -> Oracle:
    eng, _ = _load(path, device="cpu")
    picks, gaps = [], []
    try:
        gates = [m.experts.gate_w.data_ptr() for m in eng.moe]

        def around(i, ids, run):
            with routers.recording() as calls:
                out = run()
            mine = [[c for c in calls if c[0] == g] for g in gates]
            assert all(len(c) == 1 for c in mine), f"forward {i}: {[len(c) for c in mine]} routings per layer"
            picks.append([(c[0][1], c[0][2]) for c in mine])
            gaps.append([(c[0][3], c[0][4]) for c in mine])
            return out
        logits = _script(eng, around)
    finally:
        eng.close()
    spread = [s for _, s in gaps[0]]               # the prefill's logits' spread per layer: the gaps' unit
    return Oracle(logits, picks, [[g for g, _ in step] for step in gaps], spread)


@pytest.fixture(scope="module")
def oracle(models, request):
    """The CPU engine's script, per size. The real width's takes minutes of CPU: when this session will ask
    for it, a thread computes it from the module's first test on, while the tests that need no oracle use
    the GPU (test_cuda_matches_the_cpu_engine_... comes last for that)."""
    from concurrent.futures import ThreadPoolExecutor
    routers = CpuRouters()
    pool = ThreadPoolExecutor(1, thread_name_prefix="cpu-oracle")
    jobs = {}
    if any(item.name == f"{_ORACLE_TEST}[real]" for item in request.session.items):
        jobs["real"] = pool.submit(_cpu_oracle, models("real"), routers)     # written here, read in the thread

    done: dict[str, Oracle] = {}

    def get(size) -> Oracle:
        if size not in done:
            done[size] = jobs.pop(size).result() if size in jobs else _cpu_oracle(models(size), routers)
        return done[size]
    try:
        yield get
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        routers.close()


@pytest.fixture(scope="module", autouse=True)
def _oracle_ahead(oracle):
    """Every test of the module sets the oracle up first, so its thread starts with the first test."""


_ORACLE_TEST = "test_cuda_matches_the_cpu_engine_eager_and_with_graphs"


def _check_routers(own: dict, want: Oracle, size: str, what: str) -> None:
    """The CUDA engine's own picks (replaying the CPU's) against the CPU router's under the same history:
    equal except at near ties; its weights over equal picks within the logits' tolerance x router_factor."""
    parted, worst, factor = [], 0.0, router_factor(min(want.spread))
    for i, (mine, theirs, gaps) in enumerate(zip(own.values(), want.picks, want.gaps)):
        for layer, ((ids, w), (cids, cw), gap) in enumerate(zip(mine, theirs, gaps)):
            a, b = ids.long().sort(dim=-1), cids.long().sort(dim=-1)
            same = (a.values == b.values).all(dim=-1)
            for row in (~same).nonzero().flatten().tolist():
                g = float(gap[row]) / want.spread[layer]
                if not g < TIE[size]:
                    parted.append(f"forward {i} row {row} layer {layer}: {a.values[row].tolist()}, the CPU's "
                                  f"{b.values[row].tolist()} at a gap of {g:.3f} std")
            if same.any():
                worst = max(worst, _rel(w.gather(1, a.indices)[same], cw.gather(1, b.indices)[same]))
    _record(test="qwen35_hybrid_routers", what=what, router_weights=worst, router_factor=factor, parted=len(parted))
    assert not parted, f"{what}: picks differ from the CPU router's beyond near ties:\n" + "\n".join(parted)
    assert worst <= _tol(TOL, size) * factor, f"{what}: router weights {worst:.2e} from the CPU's"


@pytest.mark.parametrize("size", ["tiny", "real"])
def test_offloaded_experts_match_all_in_vram(size, models, routing):
    eng, _ = _load(models(size), graphs=False)
    try:
        rec = Picks(routing, eng)
        want = _script(eng, rec)
        layers, experts = eng.spec.layers, eng.spec.experts
    finally:
        eng.close()
    routing.reset()
    free = torch.cuda.mem_get_info()[0]
    eng, applied = _load(models(size), graphs=False, host_experts=True,
                         off={"vram_budget_gb": 0.9 * free / GiB, "placement": "stream"})
    try:
        assert eng.offload is not None, applied
        keep = experts // 4
        eng.place_experts([list(range(keep))] * layers)
        tel = eng.telemetry()
        assert tel["expert_paths"] == ["stream"] * layers, tel["expert_paths"]
        _compare(_script(eng, Picks(routing, eng, rec.picks)), want, _tol(TOL_PATH, size), f"{size} offload (stream)")
        tel = eng.telemetry()
        _record(test="qwen35_hybrid_offload", size=size, hit_rate=tel.get("expert_hit_rate"),
                pcie=tel.get("pcie_bytes_per_token"))
    finally:
        eng.close()


@pytest.mark.parametrize("size", ["tiny", "real"])
def test_offloaded_experts_under_decode_graphs(size, models, routing):
    """Graphs captured over offloaded layers (cold experts read in place from pinned host memory, the
    slot tables read on the device) replay the static forwards they captured."""
    free = torch.cuda.mem_get_info()[0]
    eng, applied = _load(models(size), graphs=True, host_experts=True,
                         off={"vram_budget_gb": 0.9 * free / GiB, "placement": "stream"})
    try:
        assert eng.offload is not None and eng.graphs is not None, applied
        eng.place_experts([list(range(eng.spec.experts // 4))] * eng.spec.layers)
        rec = Picks(routing, eng)
        got = _script(eng, rec)
        assert eng.graphs is not None, f"decode graphs turned off under offload: {eng.graph_error}"
        tel = eng.telemetry()
        assert tel["graph_shapes"] and tel["expert_paths"] == ["stream"] * eng.spec.layers, tel
        graphs, eng.graphs, eng.static = eng.graphs, None, True
        static = _script(eng, Picks(routing, eng, rec.picks))
        del graphs
    finally:
        eng.close()
    _compare(got, static, _tol(TOL_PATH, size), f"{size} offload: graphs vs static eager")


@pytest.mark.parametrize("size", ["tiny", "real"])
def test_the_cpu_expert_path_under_graphs_matches_all_in_vram(size, models, monkeypatch, routing):
    """Placement 'cpu' on the Qwen3.5 engine: part of each layer's cold experts computed on the CPU
    inside the captured decode steps, as on the exllamav2 engine (tests/gpu/test_offload_gpu.py; the
    split forced so that every layer owns experts whatever this host measures)."""
    from runtime.offload import cpu_share
    from runtime.offload.placement import CpuSplitCosts
    real_costs = cpu_share.CpuShare._split_costs
    monkeypatch.setattr(cpu_share.CpuShare, "_split_costs", lambda self, resident, threads: CpuSplitCosts(
        50e9, 50e9, 0.0, real_costs(self, resident, threads).cpu_bytes_ratio))
    eng, _ = _load(models(size), graphs=False)
    try:
        rec = Picks(routing, eng)
        want = _script(eng, rec)
    finally:
        eng.close()
    routing.reset()
    free = torch.cuda.mem_get_info()[0]
    eng, applied = _load(models(size), graphs=True, host_experts=True,
                         off={"vram_budget_gb": 0.9 * free / GiB, "placement": "cpu", "cpu_threads": 4})
    try:
        eng.place_experts([list(range(eng.spec.experts // 4))] * eng.spec.layers)
        eng.offload.cpu.set_path(True, "forced by the test")
        tel = eng.telemetry()
        assert tel["cpu_expert_path"] == "on" and tel["expert_paths"] == ["cpu+stream"] * eng.spec.layers, tel
        got = _script(eng, Picks(routing, eng, rec.picks))
        tel = eng.telemetry()
        assert eng.graphs is not None and eng.graphs.captured(), eng.graph_error
        assert tel["cpu_expert_pairs"] > 0 and "cpu_expert_errors" not in tel, tel
        _record(test="qwen35_hybrid_cpu_path", size=size, cpu_ms_per_token=tel.get("cpu_expert_ms_per_token"),
                placement=applied.get("offload.placement"))
    finally:
        eng.close()
    _compare(got, want, _tol(TOL_PATH, size), f"{size} CPU expert path under graphs vs all in VRAM")


def test_the_loader_runs_qwen35_on_cuda_in_the_hybrid_engine(models):
    """`auto` on a GPU: the hybrid engine on CUDA."""
    from runtime import loader
    from runtime.backends.hybrid import HybridExl2Engine
    eng, applied = loader.open_engine(str(models("tiny")), LoadOptions(offload=OffloadOptions(context_length=1024)),
                                      lambda *a: None, require_tokenizer=False)
    try:
        assert isinstance(eng, HybridExl2Engine) and eng.backend == "cuda", applied
        assert applied["offload.backend"].startswith("applied: cuda")
        assert torch.isfinite(eng.forward([1, 2, 3]).float()).all()
    finally:
        eng.close()


@pytest.mark.parametrize("draft", ["none", "ngram", "mtp"])
def test_moedesk_cli_chat_answers_with_it(models, draft):
    """`moedesk-cli chat` through a real worker: loaded on CUDA in the hybrid engine, an answer streamed
    to its end (n-gram and MTP drafting: verifies and rollbacks of the DeltaNet states)."""
    import subprocess
    import sys
    cmd = [sys.executable, "-m", "runtime.cli", "chat", "--model", str(models("tiny")), "--backend", "cuda",
           "--draft", draft, "--temperature", "0", "--max-tokens", "48", "--json", "say hello hello hello"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                         env=child_env())
    assert run.returncode == 0, run.stderr[-2000:]
    events = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    loaded = [e for e in events if e.get("type") == "loaded"]
    assert loaded and loaded[0]["backend"] == "cuda", events[:3]
    finished = [e for e in events if e.get("type") == "finished"]
    assert finished and finished[0]["stats"]["generated_tokens"] > 0, finished
    _record(test="qwen35_hybrid_chat", draft=draft, stats=finished[0]["stats"])


@pytest.mark.parametrize("size", ["tiny", "real"])
def test_cuda_matches_the_cpu_engine_eager_and_with_graphs(size, models, oracle, routing):
    """Eager against the CPU; then the static forwards (what the graphs capture, run eagerly) against the
    CPU; then the graphs against those static forwards: the same kernels, so a difference is the
    capture's or the replay's (a Python value baked in, a buffer that moved). Every forward takes the CPU
    engine's picks; the CUDA routers' own are checked against the CPU's."""
    want = oracle(size)
    eng, applied = _load(models(size), graphs=False)
    try:
        assert eng.backend == "cuda" and eng.offload is None, applied
        given = Picks(routing, eng, want.picks)
        _compare(_script(eng, given), want.logits, _tol(TOL, size), f"{size} eager")
        _check_routers(given.own, want, size, f"{size} eager")
        eng.static = True
        static = _script(eng, Picks(routing, eng, want.picks))
        _compare(static, want.logits, _tol(TOL, size), f"{size} static eager")
    finally:
        eng.close()
    routing.reset()
    routing.mode = "replay"                          # the graphs captured at load replay the given picks
    eng, _ = _load(models(size), graphs=True)
    try:
        assert eng.graphs is not None, "the engine was loaded without decode graphs"
        every = [(L, t) for L in (512, 1024) for t in range(1, WINDOW + 1)]
        assert eng.graphs.captured() == every, eng.graphs.captured()      # at load: both buckets of 1024
        eng.forward([5, 6, 7])                       # 3 rows: replayed
        while eng.idle_work():                       # nothing left to capture
            pass
        assert eng.graphs is not None, f"decode graphs turned off: {eng.graph_error}"
        assert (eng.position, eng.tokens) == (3, [5, 6, 7]), (eng.position, eng.tokens)
        got = _script(eng, Picks(routing, eng, want.picks))
        tel = eng.telemetry()
        assert tel["decode_graphs"] and not tel.get("graph_error"), tel.get("graph_error")
        assert eng.graphs.captured() == every, eng.graphs.captured()
        _compare(got, static, _tol(TOL_PATH, size), f"{size} graphs vs static eager")
        _record(test="qwen35_hybrid_vram", size=size, vram=torch.cuda.memory_allocated(),
                cache_bytes=tel["cache_bytes"])
    finally:
        eng.close()


EDGE_CONTEXT = 1300


def _edge_steps(vocab: int):
    """Decodes at 509..513, a verify of WINDOW rows from 508 (last row in bucket 1024; the 508 tokens
    prefilled again: a truncate there would replay them unseen), a rollback into it, a verify of 2 from
    511, a verify from 1020 into the capped bucket 1300, decodes at 1022..1024."""
    g = torch.Generator().manual_seed(7)
    toks = torch.randint(0, min(vocab - 64, 240000), (EDGE_CONTEXT,), generator=g).tolist()
    yield "forward", toks[:509]
    for i in range(509, 514):
        yield "forward", [toks[i]]
    yield "truncate", 0
    yield "forward", toks[:508]
    yield "forward", toks[600:600 + WINDOW]
    yield "truncate", 511
    yield "forward", toks[700:702]
    yield "forward", [toks[702]]
    yield "forward", toks[513:1020]
    yield "forward", toks[800:800 + WINDOW]
    yield "truncate", 1022
    for i in range(3):
        yield "forward", [toks[900 + i]]


@pytest.mark.parametrize("size", ["tiny", "real"])
def test_graphs_match_eager_across_bucket_edges_and_their_pool_stays_small(size, models, routing):
    from runtime.backends import hybrid
    opts = LoadOptions(offload=OffloadOptions(context_length=EDGE_CONTEXT))
    eng, _ = hybrid.load(models(size), opts, device="cuda", window=WINDOW, graphs=False)
    try:
        rec = Picks(routing, eng)
        eager = _run(eng, _edge_steps(eng.info.vocab_size), rec)
        eng.static = True
        static = _run(eng, _edge_steps(eng.info.vocab_size), Picks(routing, eng, rec.picks))
    finally:
        eng.close()
    _compare(static, eager, _tol(TOL_PATH, size), f"{size} static (bucketed) vs eager across bucket edges")
    routing.reset()
    routing.mode = "replay"                          # the graphs captured at load replay the given picks
    eng, _ = hybrid.load(models(size), opts, device="cuda", window=WINDOW, graphs=True)
    try:
        assert eng.graphs is not None, "the engine was loaded without decode graphs"
        torch.cuda.synchronize()
        reserved, held = torch.cuda.memory_reserved(), len(eng.graphs.graphs)
        got = _run(eng, _edge_steps(eng.info.vocab_size), Picks(routing, eng, rec.picks))
        assert eng.graphs is not None, f"decode graphs turned off: {eng.graph_error}"
        while eng.idle_work():
            pass
        tel = eng.telemetry()
        assert not tel.get("graph_error") and tel["graph_buckets"] == [512, 1024, 1300], tel
        torch.cuda.synchronize()
        added = len(eng.graphs.graphs) - held
        out_bytes = WINDOW * eng.info.vocab_size * 4
        growth = torch.cuda.memory_reserved() - reserved
        _record(test="qwen35_hybrid_graph_pool", size=size, graphs=len(eng.graphs.graphs), added=added,
                growth=growth)
        assert added > 0 and growth <= added * (out_bytes + (2 << 20)) + (64 << 20), (added, growth)
    finally:
        eng.close()
    _compare(got, static, _tol(TOL_PATH, size), f"{size} graphs vs static across bucket edges")
    _compare(got, eager, _tol(TOL_PATH, size), f"{size} graphs vs eager across bucket edges")


def _mtp_rows(eng, vocab: int, around=None) -> list[torch.Tensor]:
    """The MTP head's draft logits (on the CPU; the tokens a draft never offers, -inf in both engines, as 0)
    after a prefill, decode steps and a verify's rollback. The drafted tokens are fixed (not chosen from
    the rows), so both engines chain the same drafts even where a near-tie would pick differently.
    around(i, ids, run) wraps the i-th forward (Picks)."""
    g = torch.Generator().manual_seed(9)
    toks = torch.randint(0, min(vocab - 64, 240000), (100,), generator=g).tolist()
    rows: list[torch.Tensor] = []
    fixed = iter(toks[50:])
    n_forward = 0

    def choose(row):
        r = row.float().cpu()
        rows.append(r.masked_fill(r == float("-inf"), 0.0))
        return next(fixed)

    def forward(ids):
        nonlocal n_forward
        run = (lambda: eng.forward(ids))
        out = around(n_forward, ids, run) if around is not None else run()
        n_forward += 1
        return out
    eng.reset()
    eng.mtp_enable()
    forward(toks[:40])
    for n in range(40, 44):
        eng.mtp_draft(toks[:n + 1], 3, choose)
        forward([toks[n]])
    forward(toks[44:44 + WINDOW])
    eng.truncate(46)
    eng.mtp_draft(toks[:47], 3, choose)
    return rows


def test_the_mtp_head_drafts_on_cuda_as_on_the_cpu(models, routing):
    """The head (runtime/backends/hybrid_mtp.py) following replayed decode graphs, against the CPU
    engine's head on the tiny model (the model's layers take the CPU's picks forward by forward, the head's
    router the CPU head's call by call); then greedy MTP speculation against plain steps, as the other
    drafts (tests/gpu/test_speculative_gpu.check_greedy)."""
    from test_speculative_gpu import check_greedy
    from runtime.options import DraftOptions
    routers = CpuRouters()
    cpu, _ = _load(models("tiny"), device="cpu", mtp=True)
    try:
        gates = [m.experts.gate_w.data_ptr() for m in cpu.moe]
        head_gate = cpu.mtp_head.moe.experts.gate_w.data_ptr()
        with routers.recording() as calls:        # the head also runs outside the forwards (the drafts)
            want = _mtp_rows(cpu, cpu.info.vocab_size)
    finally:
        cpu.close()
        routers.close()
    per_layer = [[(c[1], c[2]) for c in calls if c[0] == g] for g in gates]
    assert len({len(p) for p in per_layer}) == 1, [len(p) for p in per_layer]
    picks = [list(step) for step in zip(*per_layer)]              # per forward, per layer
    head_calls = [(c[1], c[2]) for c in calls if c[0] == head_gate]
    eng, _ = _load(models("tiny"), mtp=True)
    try:
        assert eng.graphs is not None and eng.has_mtp, eng.graph_error
        head = eng.mtp_head.moe.experts.gate_w
        routing.follow(head, head_calls)
        given = Picks(routing, eng, picks)
        _compare(_mtp_rows(eng, eng.info.vocab_size, given), want, TOL, "tiny MTP drafts, CUDA (graphs) vs CPU")
        assert len(given.own) == len(picks) and routing.followed_left(head) == 0, \
            (len(given.own), len(picks), routing.followed_left(head))
        routing.leave(head)                      # speculation: the head drafts with its own picks
        routing.mode = "record"
        eng.reset_graphs()
        prompt = torch.randint(0, 1000, (12,), generator=torch.Generator().manual_seed(3)).tolist()
        f = check_greedy("qwen3.5 mtp", eng, prompt, DraftOptions(mode="mtp", draft_tokens=K, adaptive=False),
                         routing=routing)
        assert f["drafted"] > 0, f
        tel = eng.telemetry()
        assert eng.graphs is not None, eng.graph_error
        _record(test="qwen35_hybrid_mtp", size="tiny", head_bytes=tel["mtp_head_bytes"], drafted=f["drafted"],
                accepted=f["accepted"])
    finally:
        eng.close()


def test_the_mtp_head_reads_the_same_hidden_states_with_graphs_at_real_width(models, routing):
    """Graphs against eager, the model's layers taking the eager run's picks forward by forward and the
    head's router the eager head's call by call."""
    got, rec, head_calls = {}, None, None
    for graphs in (False, True):
        routing.reset()
        eng, _ = _load(models("real"), mtp=True, graphs=graphs)
        try:
            head = eng.mtp_head.moe.experts.gate_w
            if rec is None:
                head_calls = routing.follow(head)
                rec = wrap = Picks(routing, eng)
            else:
                routing.follow(head, head_calls)
                wrap = Picks(routing, eng, rec.picks)
            got[graphs] = _mtp_rows(eng, eng.info.vocab_size, wrap)
            if graphs:
                assert routing.followed_left(head) == 0, routing.followed_left(head)
                assert eng.graphs is not None, eng.graph_error
                _record(test="qwen35_hybrid_mtp", size="real", head_bytes=eng.telemetry()["mtp_head_bytes"])
        finally:
            eng.close()
    _compare(got[True], got[False], _tol(TOL_PATH, "real"), "real-width MTP drafts, graphs vs eager")
