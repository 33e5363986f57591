"""The CUDA engine's contract where there is no GPU: a clear error, and exllamav2 is never imported."""
from __future__ import annotations

import sys

import pytest
import torch

from runtime.errors import ContextOverflow, CudaUnavailable
from runtime.options import LoadOptions


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_load_without_cuda_says_so(tmp_path):
    from runtime.backends import exl2
    from runtime.errors import EngineError
    with pytest.raises(EngineError) as ei:
        exl2.load(tmp_path, LoadOptions(), lambda *a: None)
    assert isinstance(ei.value, CudaUnavailable)
    assert "CPU" in ei.value.message
    assert "exllamav2" not in sys.modules


def test_out_of_memory_recognised():
    from runtime.backends.gpu_engine import is_oom
    assert is_oom(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not is_oom(RuntimeError("shape mismatch"))
    assert not is_oom(ValueError("out of memory"))


@pytest.mark.parametrize("step,words", [("check_folder", "first checks on the GPU"),
                                        ("read_config", "first checks on the GPU"),
                                        ("build_model", "weights and a 4096-token"),
                                        ("place_experts", "weights and a 4096-token"),
                                        ("make_engine", "decode graphs"), ("warm_up", "warm-up")])
def test_out_of_memory_at_any_step_of_a_load_is_an_out_of_memory_error(monkeypatch, tmp_path, step, words):
    """The H200 showed a load with 8 MiB of the GPU free run out in its first check (the prefill attention's
    probe, whose kernel loaded on first use): torch raised an AcceleratorError, which the load mapped only
    in its build and engine steps, so it reached the caller raw. Every step's out-of-memory is OutOfMemory."""
    from runtime.backends import exl2, gpu_engine, gpu_offload
    from runtime.errors import OutOfMemory
    from runtime.options import OffloadOptions
    monkeypatch.setattr(gpu_offload, "return_cached_memory", lambda: None)
    monkeypatch.setattr(gpu_engine, "free_vram", lambda: (8 << 20, "0.0 GiB free of 140.0 GiB"))
    loading = exl2._Loading(tmp_path, LoadOptions(offload=OffloadOptions(context_length=4096)), lambda *a: None,
                            "own", True)
    assert step in loading.steps()
    loading.step = step
    make = gpu_engine.failure(loading, RuntimeError("CUDA error: out of memory"))   # an AcceleratorError is one
    assert make is not None
    err = make()
    assert isinstance(err, OutOfMemory) and words in err.message and err.free_bytes == 8 << 20, err.message
    assert gpu_engine.failure(loading, RuntimeError("shape mismatch")) is None


def test_out_of_memory_under_a_budget_names_the_budget_and_where():
    """A load held to a VRAM budget that runs out says so (the GPU's free memory, the only figure
    before, said 137 GiB free), and its detail keeps torch's words and the frames it came from."""
    from runtime.backends.gpu_engine import oom as _oom, oom_context as _oom_context

    def pack_experts():
        raise RuntimeError("CUDA out of memory. Tried to allocate 768.00 MiB")
    try:
        pack_experts()
    except RuntimeError as e:
        context = _oom_context(e)
    assert "pack_experts" in context and "torch held" in context
    err = _oom("the model's weights", RuntimeError("CUDA out of memory. Tried to allocate 768.00 MiB"),
               cap=int(3.9 * (1 << 30)), context=context)
    assert "within the VRAM budget of 3.9 GiB" in err.message and "larger VRAM budget" in err.message
    assert err.detail.startswith("CUDA out of memory. Tried to allocate 768.00 MiB; raised at ")
    plain = _oom("the model's weights", RuntimeError("CUDA out of memory."))
    assert "budget" not in plain.message and plain.detail == "CUDA out of memory."


# -- which forwards replay a graph: the engine's dispatch and the graphs' bookkeeping, with stand-ins for
# exllamav2 and the GPU (the graphs themselves are checked on the GPU: tests/gpu/test_exl2_engine.py) --

V, H = 40, 8


class Cache:
    def __init__(self, n):
        self.current_seq_len = 0
        self.max_seq_len = n


class LoopModel:
    """exllamav2's model.forward stand-in: logits [1, T, V'] (V' > V: padded vocabulary), advances the cache."""

    def __init__(self):
        self.calls = []

    def forward(self, ids, cache, last_id_only=False):
        T = ids.shape[1]
        self.calls.append((cache.current_seq_len, T))
        self.last_id_only = last_id_only
        cache.current_seq_len += T
        rows = (cache.current_seq_len - T + torch.arange(T, dtype=torch.float16))[-1:] if last_id_only else \
            cache.current_seq_len - T + torch.arange(T, dtype=torch.float16)
        return rows[None, :, None].expand(1, len(rows), V + 8).contiguous()


class StepGraphs:
    """DecodeGraphs stand-in: logits row t = position + t; capture of `fail_rows` rows fails."""
    max_rows = 9
    attention = "triton"

    def __init__(self, fail_rows=()):
        self.fail_rows = set(fail_rows)
        self.steps = []

    def captured(self):
        return sorted({(512, T) for _, T in self.steps})

    def step(self, ids, position):
        T = ids.shape[1]
        if T in self.fail_rows:
            raise RuntimeError("operation not permitted when stream is capturing")
        self.steps.append((position, T))
        return (position + torch.arange(T, dtype=torch.float16))[:, None].expand(T, V + 8).contiguous()


def _engine(graphs, n=64):
    from runtime.backends.exl2 import Exl2Engine
    from runtime.engine import ModelInfo
    info = ModelInfo(name="stub", path="", architecture="Qwen3MoeForCausalLM", vocab_size=V,
                     context_length=n, num_layers=1)
    eng = Exl2Engine(LoopModel(), Cache(n), info, graphs=False)
    eng.graphs = graphs
    return eng


def test_forwards_of_up_to_nine_rows_replay_a_graph(monkeypatch):
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: 0)
    g = StepGraphs()
    eng = _engine(g)
    out = eng.forward(list(range(12)))                          # prefill: the layer loop
    assert eng.model.calls == [(0, 12)] and eng.position == 12 and out.shape == (12, V)
    for T in (1, 2, 5, 9):
        pos = eng.position
        out = eng.forward([3] * T)
        assert out.shape == (T, V) and eng.position == pos + T
        assert torch.equal(out[:, 0], pos + torch.arange(T, dtype=torch.float16))     # row t of the graph
    assert g.steps == [(12, 1), (13, 2), (15, 5), (20, 9)]
    eng.truncate(20)
    eng.forward([1] * 10)                                       # 10 rows: the loop again
    assert eng.model.calls[-1] == (20, 10) and eng.position == 30
    from runtime.errors import EngineError
    with pytest.raises(EngineError) as ei:                      # the overflow check still comes first
        eng.forward([1] * 35)
    assert isinstance(ei.value, ContextOverflow) and eng.position == 30


def test_prefill_asks_exllamav2_for_the_last_row_only(monkeypatch):
    """`prefill` returns [1, V], the last row, through exllamav2's last_id_only (no [T, V'] logits in
    VRAM); `forward` keeps every row; a graph-sized prefill slices the graph's rows."""
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: 0)
    g = StepGraphs()
    eng = _engine(g)
    out = eng.prefill(list(range(12)))
    assert out.shape == (1, V) and eng.model.last_id_only and eng.position == 12
    assert out[0, 0].item() == 11                                # the last row's position
    out = eng.forward(list(range(12)))
    assert out.shape == (12, V) and not eng.model.last_id_only and out[-1, 0].item() == 23
    out = eng.prefill([1, 2, 3])                                 # 3 rows: a graph, its last row
    assert out.shape == (1, V) and out[0, 0].item() == 26 and g.steps[-1] == (24, 3)


def test_a_failed_verify_capture_keeps_the_one_row_graph(monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: 0)
    g = StepGraphs(fail_rows={5})
    eng = _engine(g)
    eng.forward([1, 2, 3])                                      # 3 rows: a graph
    out = eng.forward([1] * 5)                                  # capture fails: recomputed by the loop
    assert out.shape == (5, V) and eng.position == 8 and eng.model.calls == [(3, 5)]
    assert eng.graphs is g and g.max_rows == 4
    tel = eng.telemetry()
    assert "5 rows" in tel["graph_error"] and tel["graph_rows"] == 4
    eng.forward([1] * 6)                                        # above the lowered limit: the loop
    eng.forward([1] * 4)
    eng.forward([1])
    assert eng.model.calls == [(3, 5), (8, 6)] and g.steps[-2:] == [(14, 4), (18, 1)]
    g.fail_rows = {1}
    eng.forward([1])                                            # the one-row capture fails: graphs off
    assert eng.graphs is None and eng.model.calls[-1] == (19, 1) and eng.position == 20


def test_graphs_key_by_bucket_and_rows_and_keep_the_recent(monkeypatch):
    """DecodeGraphs.step: the bucket from the last row, the rows' embeddings in the input, one capture
    per (bucket, rows), least recently used dropped beyond MAX_GRAPHS."""
    import types
    from runtime.backends import exl2_graph
    from runtime.backends.exl2_graph import DecodeGraphs
    fake = types.ModuleType("exllamav2")
    fake_device = types.ModuleType("exllamav2.device")
    fake_device.set_device_streams = lambda: None
    monkeypatch.setitem(sys.modules, "exllamav2", fake)
    monkeypatch.setitem(sys.modules, "exllamav2.device", fake_device)
    monkeypatch.setattr(exl2_graph, "MAX_GRAPHS", 4)

    class Graph:
        replays = 0

        def replay(self):
            Graph.replays += 1

    g = object.__new__(DecodeGraphs)
    g.embed = types.SimpleNamespace(forward=lambda ids: ids[..., None].expand(1, ids.shape[1], H).half())
    g.cache = Cache(2048)
    g.x_in = torch.zeros(1, exl2_graph.MAX_ROWS, H, dtype=torch.float16)
    g.pos32 = torch.zeros(1, dtype=torch.int32)
    g.attention = "triton"
    g.graphs = {}
    captures = []

    def capture(L, T):
        captures.append((L, T))
        g.graphs[(L, T)] = (Graph(), torch.zeros(T, V))

    g._capture = capture
    g.step(torch.tensor([[7, 8, 9]]), 509)                      # rows 509..511: bucket 512
    assert torch.equal(g.x_in[0, :3, 0], torch.tensor([7.0, 8.0, 9.0], dtype=torch.float16))
    assert g.pos32.item() == 509
    g.step(torch.tensor([[1] * 4]), 509)                        # rows 509..512: bucket 1024
    g.step(torch.tensor([[1] * 3]), 100)                        # (512, 3) again: replayed, not captured
    assert captures == [(512, 3), (1024, 4)] and Graph.replays == 3
    for T in (1, 2, 5):
        g.step(torch.tensor([[1] * T]), 600)
    assert g.captured() == [(512, 3), (1024, 1), (1024, 2), (1024, 5)]     # (1024, 4): least recent
    with pytest.raises(ValueError, match="10 rows at position 0"):
        g.step(torch.tensor([[1] * 10]), 0)
    with pytest.raises(ValueError, match="within the 2048-token cache"):
        g.step(torch.tensor([[1] * 2]), 2047)


def test_forwards_that_stage_offloaded_experts_run_the_loop(monkeypatch):
    """Expert offload stages cold experts from the host for many rows (per call): those forwards stay
    out of the graphs, however few rows that is for the model."""
    import types
    fake = types.ModuleType("exllamav2")
    fake_device = types.ModuleType("exllamav2.device")
    fake_device.set_device_streams = lambda: None
    monkeypatch.setitem(sys.modules, "exllamav2", fake)
    monkeypatch.setitem(sys.modules, "exllamav2.device", fake_device)

    class Offload:
        def step_boundary(self, rows):
            pass

        def begin_forward(self, rows):
            return rows >= 8                    # staged: copies from the host, no graph

    g = StepGraphs()
    eng = _engine(g)
    eng.offload = Offload()
    eng.forward([1] * 7)
    eng.forward([1] * 8)
    assert g.steps == [(0, 7)] and eng.model.calls == [(7, 8)] and eng.position == 15


# -- exllamav2's attention over several rows: its SDPA branch passes no causal mask; the wrapper does --

class _Params:
    """What the wrapper reads of exllamav2's attention Params."""
    def __init__(self, causal=True):
        self.paged, self.block_diag_layers, self._causal = False, set(), causal

    def is_causal(self):
        return self._causal


def _noncausal_attn_torch(self, batch_size, q_len, q, k, v, params, cfg, causal=True):
    """exllamav2 0.3.2's SDPA branch in effect: GQA by repetition, no mask at all."""
    self.calls += 1
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=self.scaling)
    return out.transpose(1, 2).reshape(batch_size, q_len, -1)


def _explicit_causal(q, k, v, scale):
    """Softmax with a lower-right causal mask, one batch, float64: [rows, heads, D] inputs."""
    q, k, v = (t[0].double().transpose(0, 1) for t in (q, k, v))
    g = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(g, 0), v.repeat_interleave(g, 0)
    rows, kv = q.shape[1], k.shape[1]
    allowed = torch.arange(kv)[None, :] <= torch.arange(rows)[:, None] + (kv - rows)
    s = (q @ k.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
    return (torch.softmax(s, -1) @ v).transpose(0, 1).reshape(1, rows, -1)


@pytest.mark.parametrize("rows,kv", [(24, 24), (5, 29), (1, 7)])
def test_prefill_attention_wrapper_is_causal(rows, kv):
    from types import SimpleNamespace
    from runtime.backends.exl2 import causal_sdpa_attention
    heads, kv_heads, D = 8, 2, 16
    fake = SimpleNamespace(scaling=D ** -0.5, sliding_window=0, layer_idx=0, calls=0)
    cfg = SimpleNamespace(no_sdpa=False, attn_logit_softcapping=None)
    g = torch.Generator().manual_seed(rows)
    q = torch.randn(1, rows, heads, D, generator=g)
    k, v = (torch.randn(1, kv, kv_heads, D, generator=g) for _ in range(2))
    want = _explicit_causal(q, k, v, fake.scaling)
    if rows > 1:        # the stand-in really is exllamav2's bug: without a mask the first rows see the future
        bad = _noncausal_attn_torch(fake, 1, rows, q, k, v, _Params(), cfg)
        assert (bad.double() - want).abs().max() > 1e-2
    fixed = causal_sdpa_attention(_noncausal_attn_torch)
    fake.calls = 0
    got = fixed(fake, 1, rows, q, k, v, _Params(), cfg)
    assert (got.double() - want).abs().max() < 1e-5
    assert fake.calls == (1 if rows == 1 else 0)        # one row: nothing to mask, exllamav2's own path


def test_prefill_attention_wrapper_leaves_other_cases_to_exllamav2():
    from types import SimpleNamespace
    from runtime.backends.exl2 import causal_sdpa_attention
    fixed = causal_sdpa_attention(_noncausal_attn_torch)
    assert fixed.wraps_exllamav2 is _noncausal_attn_torch
    q = torch.randn(1, 4, 2, 8)
    ok = SimpleNamespace(no_sdpa=False, attn_logit_softcapping=None)
    cases = [
        (dict(), ok, _Params(causal=False), True),                       # an input mask: exllamav2 builds it
        (dict(sliding_window=2), ok, _Params(), True),
        (dict(), SimpleNamespace(no_sdpa=True, attn_logit_softcapping=None), _Params(), True),
        (dict(), SimpleNamespace(no_sdpa=False, attn_logit_softcapping=30.0), _Params(), True),
        (dict(), ok, _Params(), False),                                    # causal=False requested
    ]
    for extra, cfg, params, causal in cases:
        fake = SimpleNamespace(**{"scaling": 0.3, "sliding_window": 0, "layer_idx": 0, "calls": 0, **extra})
        fixed(fake, 1, 4, q, q, q, params, cfg, causal)
        assert fake.calls == 1, (extra, cfg, causal)
    params = _Params()
    params.block_diag_layers = {0}
    fake = SimpleNamespace(scaling=0.3, sliding_window=0, layer_idx=0, calls=0)
    fixed(fake, 1, 4, q, q, q, params, ok)
    assert fake.calls == 1


def test_qwen3_head_norms_are_rms():
    from types import SimpleNamespace
    from runtime.backends.exl2 import rms_head_norms
    for arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
        cfg = SimpleNamespace(architecture=arch, arch=SimpleNamespace(lm=SimpleNamespace(headnorm="layernorm")))
        assert rms_head_norms(cfg) and cfg.arch.lm.headnorm == "rmsnorm"
        assert not rms_head_norms(cfg)                          # already right: nothing to change
    cfg = SimpleNamespace(architecture="LlamaForCausalLM", arch=SimpleNamespace(lm=SimpleNamespace(headnorm="layernorm")))
    assert not rms_head_norms(cfg) and cfg.arch.lm.headnorm == "layernorm"      # no head norms to fix


class _Opened:
    """A part a load opened (model, offload manager, budgets): records how it was freed."""

    def __init__(self, log: list, name: str):
        self.log, self.name = log, name
        self.applied, self.stats_warning, self.offload = {}, "", False
        self.capped = False                     # (a setup: no allocator cap, so an OOM names no budget)

    def unload(self):
        self.log.append(f"{self.name} unloaded")

    def close(self):
        self.log.append(f"{self.name} closed")

    def release(self):
        self.log.append(f"{self.name} released")


def _failing_load(monkeypatch, step: str, error: BaseException):
    """exl2.load with its steps replaced by fakes that open parts; `step` raises `error`."""
    from runtime.backends import exl2
    log: list[str] = []
    opens = {"plan_offload": "setup", "build_model": "model", "place_experts": "manager"}
    for name in ("check_folder", "prepare_kernels", "read_config", "plan_offload", "build_model", "allocate_cache",
                 "place_experts", "make_engine", "warm_up", "settle_expert_path"):
        def fake(self, name=name):
            log.append(name)
            if name == step:
                raise error
            if name in opens:
                setattr(self, opens[name], _Opened(log, opens[name]))
        monkeypatch.setattr(exl2._Loading, name, fake)
    monkeypatch.delenv("MOEDESK_NO_WARMUP", raising=False)
    with pytest.raises(BaseException) as ei:
        exl2.load("/models/m", LoadOptions(), lambda *a: None)
    return ei.value, log


def _frames(err: BaseException) -> list[str]:
    tb, names = err.__traceback__, []
    while tb is not None:
        names.append(tb.tb_frame.f_code.co_name)
        tb = tb.tb_next
    return names


def test_a_load_that_fails_frees_what_it_opened_in_one_place(monkeypatch):
    from runtime.errors import InvalidModel, OutOfMemory
    err, log = _failing_load(monkeypatch, "allocate_cache", torch.cuda.OutOfMemoryError("CUDA out of memory"))
    assert isinstance(err, OutOfMemory) and "the model's weights and a 4096-token fp16 KV cache" in err.message
    assert log[-3:] == ["allocate_cache", "model unloaded", "setup released"]
    assert "fake" not in _frames(err) and err.__context__ is None     # no frame of the step (its tensors) kept

    err, log = _failing_load(monkeypatch, "place_experts", KeyError("model.layers.3.mlp.gate.weight"))
    assert isinstance(err, InvalidModel) and err.file == "/models/m" and "KeyError" in err.problem
    assert log[-2:] == ["model unloaded", "setup released"]

    err, log = _failing_load(monkeypatch, "read_config", RuntimeError("out of memory"))   # nothing opened yet
    assert isinstance(err, RuntimeError) and log[-1] == "read_config"


def test_a_bug_in_a_load_step_is_raised_as_it_is_after_the_same_cleanup(monkeypatch):
    err, log = _failing_load(monkeypatch, "place_experts", TypeError("a bug"))
    assert type(err) is TypeError and log[-2:] == ["model unloaded", "setup released"] and "fake" in _frames(err)
    err, log = _failing_load(monkeypatch, "make_engine", TypeError("a bug"))
    assert type(err) is TypeError and log[-3:] == ["manager closed", "model unloaded", "setup released"]
