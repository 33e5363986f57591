"""Qwen3.5-MoE in the hybrid engine on CUDA (exllamav2's quantized GEMM, our expert kernels, fp16
activations) against the same engine on the CPU (float32, projections dequantized: itself checked
against the CPU reference in tests/test_qwen35_hybrid_engine.py).

Models (synthetic, `synth`): `tiny-qwen3.5` (hidden 256, 4 layers) and the real widths of
Qwen3.5-122B-A10B (hidden 3072, 256 experts top-8, 64 value heads, head_dim 256) cut to 2 layers, one
Gated DeltaNet and one gated attention (full_attention_interval 2), at 3.0 bpw.

- prefill (two blocks of the chunked rule), decode, a verify of K + 1 rows, a rollback to every
  accepted prefix 0..K+1 each followed by a verify of 2 and a decode: relative error of the logits
  (norm of the difference / norm of the CPU's) <= TOL.
- decode graphs: the script's short forwards with fixed shapes (`static`, what a graph captures) run
  eagerly against the CPU; then with graphs on (the first two buckets' graphs captured at load, then
  replayed) against those static forwards. Across bucket edges (a 1300-token context: buckets 512,
  1024 and the capped 1300): decodes at 509..513, verifies crossing an edge, each through the graph of
  its last row's bucket, against the static and the eager forwards; the graphs' memory pool grows by
  little more than each graph's output.
- offload: every expert's codes in pinned host memory, a few per layer in VRAM slots: same logits
  as all in VRAM; under decode graphs, the graphs' logits as the static forwards'; with the CPU
  expert path computing part of the cold experts inside the graphs, as all in VRAM.
- the MTP head: its draft logits following replayed graphs against the CPU engine's head (tiny), and
  with graphs against without (real width); greedy MTP speculation against plain steps.

The CPU engine's logits at real width take minutes: a thread computes them from the module's first test
on, beside the GPU tests that need none; the comparison with them runs last.

With MOEDESK_GPU_REPORT=FILE set, every measured figure is appended to FILE as JSON lines.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gpu_figures import record as _record, rel as _rel
from gpu_env import child_env
from runtime.options import LoadOptions, OffloadOptions

pytestmark = pytest.mark.gpu
TOL = 2e-2              # fp16 activations and exllamav2's fp16 GEMM against float32
TOL_SAME = 1e-3         # the same kernels, another path (graphs, offload)
K = 5
WINDOW = K + 1
GiB = 1 << 30
SHAPES = {"tiny": ("tiny-qwen3.5", 4, 4), "real": ("qwen3.5-122b-a10b", 2, 2)}   # name, layers, attention every


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


def _script(eng, vocab: int) -> list[torch.Tensor]:
    """Prefill, decode, verify, rollback to every accepted prefix; the logits of every step (on the CPU)."""
    g = torch.Generator().manual_seed(4)
    toks = torch.randint(0, min(vocab - 64, 240000), (120,), generator=g).tolist()   # no specials, no media ids
    out = []
    eng.reset()
    out.append(eng.forward(toks[:70]).float().cpu())
    for i in range(70, 73):
        out.append(eng.forward([toks[i]]).float().cpu())
    for keep in range(WINDOW + 1):
        eng.truncate(73)
        out.append(eng.forward(toks[73:73 + WINDOW]).float().cpu())
        eng.truncate(73 + keep)
        out.append(eng.forward(toks[90 + keep:92 + keep]).float().cpu())
        out.append(eng.forward([toks[100 + keep]]).float().cpu())
    return out


def _compare(got, want, tol, what):
    """The worst step of the script (0: the prefill, 1-3: decodes, then per kept prefix: verify, verify
    of 2, decode) named in the failure."""
    assert len(got) == len(want), f"{what}: {len(got)} steps against {len(want)}"
    rels = [_rel(a, b) for a, b in zip(got, want)]
    worst = max(rels)
    _record(test="qwen35_hybrid", what=what, rel=worst)
    assert worst <= tol, (f"{what}: relative logit error {worst:.2e} > {tol} at step {rels.index(worst)} "
                          f"(all: {', '.join(f'{r:.1e}' for r in rels)})")


def _cpu_logits(path) -> list[torch.Tensor]:
    eng, _ = _load(path, device="cpu")
    try:
        return _script(eng, eng.info.vocab_size)
    finally:
        eng.close()


@pytest.fixture(scope="module")
def oracle(models, request):
    """The CPU engine's logits of the script, per size. The real width's take minutes of CPU: when this
    session will ask for them, a thread computes them from the module's first test on, while the tests
    that need no oracle use the GPU (test_cuda_matches_the_cpu_engine_... comes last for that)."""
    from concurrent.futures import ThreadPoolExecutor
    pool = ThreadPoolExecutor(1, thread_name_prefix="cpu-oracle")
    jobs = {}
    if any(item.name == f"{_ORACLE_TEST}[real]" for item in request.session.items):
        jobs["real"] = pool.submit(_cpu_logits, models("real"))     # written here, read in the thread

    done: dict[str, list[torch.Tensor]] = {}

    def get(size):
        if size not in done:
            done[size] = jobs.pop(size).result() if size in jobs else _cpu_logits(models(size))
        return done[size]
    yield get
    pool.shutdown(wait=True, cancel_futures=True)


@pytest.fixture(scope="module", autouse=True)
def _oracle_ahead(oracle):
    """Every test of the module sets the oracle up first, so its thread starts with the first test."""


_ORACLE_TEST = "test_cuda_matches_the_cpu_engine_eager_and_with_graphs"


@pytest.mark.parametrize("size", ["tiny", "real"])
def test_offloaded_experts_match_all_in_vram(size, models):
    eng, _ = _load(models(size), graphs=False)
    try:
        want = _script(eng, eng.info.vocab_size)
        layers, experts = eng.spec.layers, eng.spec.experts
    finally:
        eng.close()
    free = torch.cuda.mem_get_info()[0]
    eng, applied = _load(models(size), graphs=False, host_experts=True,
                         off={"vram_budget_gb": 0.9 * free / GiB, "placement": "stream"})
    try:
        assert eng.offload is not None, applied
        keep = experts // 4
        eng.place_experts([list(range(keep))] * layers)
        tel = eng.telemetry()
        assert tel["expert_paths"] == ["stream"] * layers, tel["expert_paths"]
        _compare(_script(eng, eng.info.vocab_size), want, TOL_SAME, f"{size} offload (stream)")
        tel = eng.telemetry()
        _record(test="qwen35_hybrid_offload", size=size, hit_rate=tel.get("expert_hit_rate"),
                pcie=tel.get("pcie_bytes_per_token"))
    finally:
        eng.close()


@pytest.mark.parametrize("size", ["tiny", "real"])
def test_offloaded_experts_under_decode_graphs(size, models):
    """Graphs captured over offloaded layers (cold experts read in place from pinned host memory, the
    slot tables read on the device) replay the static forwards they captured."""
    free = torch.cuda.mem_get_info()[0]
    eng, applied = _load(models(size), graphs=True, host_experts=True,
                         off={"vram_budget_gb": 0.9 * free / GiB, "placement": "stream"})
    try:
        assert eng.offload is not None and eng.graphs is not None, applied
        eng.place_experts([list(range(eng.spec.experts // 4))] * eng.spec.layers)
        got = _script(eng, eng.info.vocab_size)
        assert eng.graphs is not None, f"decode graphs turned off under offload: {eng.graph_error}"
        tel = eng.telemetry()
        assert tel["graph_shapes"] and tel["expert_paths"] == ["stream"] * eng.spec.layers, tel
        graphs, eng.graphs, eng.static = eng.graphs, None, True
        static = _script(eng, eng.info.vocab_size)
        del graphs
    finally:
        eng.close()
    _compare(got, static, TOL_SAME, f"{size} offload: graphs vs static eager")


@pytest.mark.parametrize("size", ["tiny", "real"])
def test_the_cpu_expert_path_under_graphs_matches_all_in_vram(size, models, monkeypatch):
    """Placement 'cpu' on the Qwen3.5 engine: part of each layer's cold experts computed on the CPU
    inside the captured decode steps, as on the exllamav2 engine (tests/gpu/test_offload_gpu.py; the
    split forced so that every layer owns experts whatever this host measures)."""
    from runtime.experts import cpu_share
    from runtime.experts.placement import CpuSplitCosts
    real_costs = cpu_share.CpuShare._split_costs
    monkeypatch.setattr(cpu_share.CpuShare, "_split_costs", lambda self, resident, threads: CpuSplitCosts(
        50e9, 50e9, 0.0, real_costs(self, resident, threads).cpu_bytes_ratio))
    eng, _ = _load(models(size), graphs=False)
    try:
        want = _script(eng, eng.info.vocab_size)
    finally:
        eng.close()
    free = torch.cuda.mem_get_info()[0]
    eng, applied = _load(models(size), graphs=True, host_experts=True,
                         off={"vram_budget_gb": 0.9 * free / GiB, "placement": "cpu", "cpu_threads": 4})
    try:
        eng.place_experts([list(range(eng.spec.experts // 4))] * eng.spec.layers)
        eng.offload.set_cpu_path(True, "forced by the test")
        tel = eng.telemetry()
        assert tel["cpu_expert_path"] == "on" and tel["expert_paths"] == ["cpu+stream"] * eng.spec.layers, tel
        got = _script(eng, eng.info.vocab_size)
        tel = eng.telemetry()
        assert eng.graphs is not None and eng.graphs.captured(), eng.graph_error
        assert tel["cpu_expert_pairs"] > 0 and "cpu_expert_errors" not in tel, tel
        _record(test="qwen35_hybrid_cpu_path", size=size, cpu_ms_per_token=tel.get("cpu_expert_ms_per_token"),
                placement=applied.get("offload.placement"))
    finally:
        eng.close()
    _compare(got, want, TOL, f"{size} CPU expert path under graphs vs all in VRAM")


def test_the_loader_runs_qwen35_on_cuda_in_the_hybrid_engine(models):
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
def test_cuda_matches_the_cpu_engine_eager_and_with_graphs(size, models, oracle):
    """Eager against the CPU; then the static forwards (what the graphs capture, run eagerly) against the
    CPU; then the graphs against those static forwards: the same kernels, so a difference is the
    capture's or the replay's (a Python value baked in, a buffer that moved)."""
    want = oracle(size)
    eng, applied = _load(models(size), graphs=False)
    try:
        assert eng.backend == "cuda" and eng.offload is None, applied
        _compare(_script(eng, eng.info.vocab_size), want, TOL, f"{size} eager")
        eng.static = True
        static = _script(eng, eng.info.vocab_size)
        _compare(static, want, TOL, f"{size} static eager")
    finally:
        eng.close()
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
        got = _script(eng, eng.info.vocab_size)
        tel = eng.telemetry()
        assert tel["decode_graphs"] and not tel.get("graph_error"), tel.get("graph_error")
        assert eng.graphs.captured() == every, eng.graphs.captured()
        _compare(got, static, TOL_SAME, f"{size} graphs vs static eager")
        _record(test="qwen35_hybrid_vram", size=size, vram=torch.cuda.memory_allocated(),
                cache_bytes=tel["cache_bytes"])
    finally:
        eng.close()


EDGE_CONTEXT = 1300


def _edges(eng) -> list[torch.Tensor]:
    """Decodes at 509..513, a verify of WINDOW rows from 508 (last row in bucket 1024), a rollback into
    it, a verify of 2 from 511, a verify from 1020 into the capped bucket 1300, decodes at 1022..1024."""
    g = torch.Generator().manual_seed(7)
    toks = torch.randint(0, min(eng.info.vocab_size - 64, 240000), (EDGE_CONTEXT,), generator=g).tolist()
    out = []
    eng.reset()
    out.append(eng.forward(toks[:509]).float().cpu())
    for i in range(509, 514):
        out.append(eng.forward([toks[i]]).float().cpu())
    eng.truncate(508)
    out.append(eng.forward(toks[600:600 + WINDOW]).float().cpu())
    eng.truncate(511)
    out.append(eng.forward(toks[700:702]).float().cpu())
    out.append(eng.forward([toks[702]]).float().cpu())
    out.append(eng.forward(toks[513:1020]).float().cpu())
    out.append(eng.forward(toks[800:800 + WINDOW]).float().cpu())
    eng.truncate(1022)
    for i in range(3):
        out.append(eng.forward([toks[900 + i]]).float().cpu())
    return out


@pytest.mark.parametrize("size", ["tiny", "real"])
def test_graphs_match_eager_across_bucket_edges_and_their_pool_stays_small(size, models):
    from runtime.backends import hybrid
    opts = LoadOptions(offload=OffloadOptions(context_length=EDGE_CONTEXT))
    eng, _ = hybrid.load(models(size), opts, device="cuda", window=WINDOW, graphs=False)
    try:
        eager = _edges(eng)
        eng.static = True
        static = _edges(eng)
    finally:
        eng.close()
    _compare(static, eager, TOL, f"{size} static (bucketed) vs eager across bucket edges")   # other SDPA kernels
    eng, _ = hybrid.load(models(size), opts, device="cuda", window=WINDOW, graphs=True)
    try:
        assert eng.graphs is not None, "the engine was loaded without decode graphs"
        torch.cuda.synchronize()
        reserved, held = torch.cuda.memory_reserved(), len(eng.graphs.graphs)
        got = _edges(eng)
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
    _compare(got, static, TOL_SAME, f"{size} graphs vs static across bucket edges")
    _compare(got, eager, TOL, f"{size} graphs vs eager across bucket edges")


def _mtp_rows(eng, vocab: int) -> list[torch.Tensor]:
    """The MTP head's draft logits (on the CPU) after a prefill, decode steps and a verify's rollback.
    The drafted tokens are fixed (not chosen from the rows), so both engines chain the same drafts
    even where a near-tie would pick differently."""
    g = torch.Generator().manual_seed(9)
    toks = torch.randint(0, min(vocab - 64, 240000), (100,), generator=g).tolist()
    rows: list[torch.Tensor] = []
    fixed = iter(toks[50:])

    def choose(row):
        rows.append(row.float().cpu())
        return next(fixed)
    eng.reset()
    eng.mtp_enable()
    eng.forward(toks[:40])
    for n in range(40, 44):
        eng.mtp_draft(toks[:n + 1], 3, choose)
        eng.forward([toks[n]])
    eng.forward(toks[44:44 + WINDOW])
    eng.truncate(46)
    eng.mtp_draft(toks[:47], 3, choose)
    return rows


def test_the_mtp_head_drafts_on_cuda_as_on_the_cpu(models):
    """The head (runtime/backends/hybrid_mtp.py) following replayed decode graphs, against the CPU
    engine's head on the tiny model; then greedy MTP speculation against plain steps, as the other
    drafts (tests/gpu/test_speculative_gpu.check_greedy)."""
    from test_speculative_gpu import check_greedy
    from runtime.options import DraftOptions
    cpu, _ = _load(models("tiny"), device="cpu", mtp=True)
    try:
        want = _mtp_rows(cpu, cpu.info.vocab_size)
    finally:
        cpu.close()
    eng, _ = _load(models("tiny"), mtp=True)
    try:
        assert eng.graphs is not None and eng.has_mtp, eng.graph_error
        _compare(_mtp_rows(eng, eng.info.vocab_size), want, TOL, "tiny MTP drafts, CUDA (graphs) vs CPU")
        prompt = torch.randint(0, 1000, (12,), generator=torch.Generator().manual_seed(3)).tolist()
        f = check_greedy("qwen3.5 mtp", eng, prompt, DraftOptions(mode="mtp", draft_tokens=K, adaptive=False))
        assert f["drafted"] > 0, f
        tel = eng.telemetry()
        assert eng.graphs is not None, eng.graph_error
        _record(test="qwen35_hybrid_mtp", size="tiny", head_bytes=tel["mtp_head_bytes"], drafted=f["drafted"],
                accepted=f["accepted"])
    finally:
        eng.close()


def test_the_mtp_head_reads_the_same_hidden_states_with_graphs_at_real_width(models):
    got = {}
    for graphs in (False, True):
        eng, _ = _load(models("real"), mtp=True, graphs=graphs)
        try:
            got[graphs] = _mtp_rows(eng, eng.info.vocab_size)
            if graphs:
                assert eng.graphs is not None, eng.graph_error
                _record(test="qwen35_hybrid_mtp", size="real", head_bytes=eng.telemetry()["mtp_head_bytes"])
        finally:
            eng.close()
    _compare(got[True], got[False], TOL, "real-width MTP drafts, graphs vs eager")
