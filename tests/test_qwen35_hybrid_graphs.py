"""The hybrid engine's decode graphs (runtime/backends/hybrid_graphs.py) on the CPU, with a stand-in of
torch.cuda's graph API (`FakeCuda`) that keeps what matters of a real capture:

- a capture records the forward's call, the Python values of that moment baked in (as a CUDA graph
  bakes them into its kernels), and runs nothing: every tensor it wrote is put back (emulated by
  running the forward for its output buffer, then restoring the cache);
- inside a capture, reading a value on the host (`.item()`, `.tolist()`, `bool(t)`, data-dependent
  shapes such as nonzero) or making a tensor from Python data fails the test (`NoHostReads`): on CUDA
  each invalidates the capture or bakes a value in. The routed experts' CPU path reads its picks on
  the host (the CUDA kernels do not), so these tests route through a sync-free stand-in of it;
- replay re-runs the recorded call and writes the recorded output buffer.

The GPU test's sequence (tests/gpu/test_qwen35_hybrid_gpu.py) runs here: a 3-row forward, the idle
captures, the script of decodes, verifies and rollbacks; the graphs' logits equal the same static
forwards run eagerly.
"""
from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from runtime import tuning
from runtime.backends import hybrid
from runtime.backends.hybrid_graphs import StepGraphs, idle_rows
from runtime.experts.layer import ExpertLayer, route
from runtime.experts.pack import dequantize_packed
from runtime.options import LoadOptions, OffloadOptions

K = 5
WINDOW = K + 1
CONTEXT = 512


class _HostReadOps(TorchDispatchMode):
    FORBIDDEN = {"aten::_local_scalar_dense", "aten::nonzero", "aten::unique", "aten::_unique",
                 "aten::_unique2", "aten::unique_consecutive", "aten::unique_dim", "aten::masked_select",
                 "aten::lift_fresh", "aten::lift_fresh_copy"}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if name in self.FORBIDDEN or name == "aten::repeat_interleave" and func._overloadname.startswith("Tensor"):
            raise AssertionError(f"{name} inside a capture: a host read or a tensor from Python data")
        return func(*args, **(kwargs or {}))


class _HostReadMethods(TorchFunctionMode):
    FORBIDDEN = {torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.item, torch.Tensor.__bool__,
                 torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.FORBIDDEN:
            raise AssertionError(f"Tensor.{func.__name__} inside a capture: a host read")
        return func(*args, **(kwargs or {}))


@contextmanager
def NoHostReads():
    """Fails on what a captured forward must not do: read a device value on the host, or give a kernel
    a tensor made from Python data."""
    with _HostReadMethods(), _HostReadOps():
        yield


class FakeStream:
    def __init__(self, name):
        self.name = name

    def wait_stream(self, other):
        pass


class FakeGraph:
    def __init__(self, api):
        self.api, self.call, self.out = api, None, None

    def pool(self):
        return ("pool of", id(self))

    def replay(self):
        forward, args, kwargs = self.call
        self.api.log.append(("replay", args[0].shape[0]))
        self.api.replaying = True
        try:
            self.out.copy_(forward(*args, **kwargs))
        finally:
            self.api.replaying = False


class FakeCuda:
    """torch.cuda as StepGraphs uses it, on the CPU (see the module's docstring)."""

    def __init__(self, engine):
        self.engine = engine
        self.log: list[tuple] = []
        self.current = FakeStream("default")
        self.capturing = self.replaying = False
        self.valid = True

    def Stream(self, device=None):
        return FakeStream("side")

    def current_stream(self, device=None):
        return self.current

    @contextmanager
    def stream(self, s):
        prev, self.current = self.current, s
        try:
            yield
        finally:
            self.current = prev

    def synchronize(self):
        pass

    def CUDAGraph(self):
        return FakeGraph(self)

    def capture_is_valid(self, stream):
        return self.valid

    def _state(self):
        c = self.engine.cache
        return [c.k, c.v, c.conv, c.rec, c.hist_conv, c.hist_rec, c.positions, c.slots] + \
            [lay.counts for lay in self.engine.model.expert_layers()]

    @contextmanager
    def graph(self, g, pool=None, stream=None, capture_error_mode="global"):
        model = self.engine.model
        forward = model.forward

        def record(*args, **kwargs):
            self.log.append(("capture", args[0].shape[0], pool, stream.name, capture_error_mode))
            out = forward(*args, **kwargs)
            g.call, g.out = (forward, args, {k: v for k, v in kwargs.items() if k != "probe"}), out
            return out
        before = [t.clone() for t in self._state()]
        model.forward, self.capturing, self.valid = record, True, True
        prev, self.current = self.current, stream
        try:
            with NoHostReads():
                yield
        finally:
            model.forward, self.capturing, self.current = forward, False, prev
            for t, b in zip(self._state(), before):          # a capture runs no kernel
                t.copy_(b)
        if not self.valid:
            raise RuntimeError("operation not permitted when stream is capturing (stand-in)")


def sync_free_experts(self, x):
    """runtime/experts/layer.experts_reference without reading the picks on the host: every chosen
    expert's weights gathered by id (the tiny model's experts, dequantized once)."""
    if not hasattr(self, "_dense"):
        E = self.num_experts
        self._dense = [torch.stack([dequantize_packed(w, e).float() for e in range(E)]) for w in (self.w1, self.w3,
                                                                                                   self.w2)]
    w1, w3, w2 = self._dense
    r = route(x, self.gate_w, self.top_k, self.renormalize)
    self.counts.index_add_(0, r.ids.reshape(-1), torch.ones_like(r.ids.reshape(-1), dtype=torch.int32))
    xf = x.float()
    g = torch.einsum("th,taih->tai", xf, w1[r.ids])
    u = torch.einsum("th,taih->tai", xf, w3[r.ids])
    h = (torch.nn.functional.silu(g) * u).half().float()[..., :self.w2.in_features]
    y = torch.einsum("tai,tahi->tah", h, w2[r.ids])[..., :x.shape[1]]
    return (y * r.weights[..., None]).sum(dim=1)


@pytest.fixture(scope="module")
def folder(tiny_qwen35):
    return tiny_qwen35


@pytest.fixture(scope="module")
def eng(folder):
    engine, _ = hybrid.load(folder, LoadOptions(offload=OffloadOptions(context_length=CONTEXT)), device="cpu",
                            window=WINDOW)
    yield engine
    engine.close()


@pytest.fixture
def fake(eng, monkeypatch):
    monkeypatch.setattr(ExpertLayer, "__call__", sync_free_experts)
    api = FakeCuda(eng)
    eng.reset()
    eng.graphs, eng.graph_error, eng.static = StepGraphs(eng, cuda=api), None, False
    yield api
    eng.graphs, eng.graph_error, eng.static = None, None, False


def _script(eng, vocab: int) -> list[torch.Tensor]:
    """The GPU test's script: prefill, decodes, a verify and a rollback to every accepted prefix."""
    g = torch.Generator().manual_seed(4)
    toks = torch.randint(0, vocab - 64, (120,), generator=g).tolist()
    out = []
    eng.reset()
    out.append(eng.forward(toks[:70]).clone())
    for i in range(70, 73):
        out.append(eng.forward([toks[i]]).clone())
    for keep in range(WINDOW + 1):
        eng.truncate(73)
        out.append(eng.forward(toks[73:73 + WINDOW]).clone())
        eng.truncate(73 + keep)
        out.append(eng.forward(toks[90 + keep:92 + keep]).clone())
        out.append(eng.forward([toks[100 + keep]]).clone())
    return out


def test_the_gpu_tests_sequence_captures_each_row_count_once_and_replays_the_static_forwards(eng, fake):
    streams = []
    forward = eng.model.forward

    def watched(*args, **kwargs):
        if not (fake.capturing or fake.replaying):
            streams.append((args[0].shape[0], kwargs.get("static", False), fake.current.name))
        return forward(*args, **kwargs)
    eng.model.forward = watched
    try:
        eng.forward([5, 6, 7])
        while eng.idle_work():
            pass
        assert eng.graphs is not None, eng.graph_error
        assert eng.graphs.captured() == [1, 3, WINDOW], eng.graphs.captured()
        assert (eng.position, eng.tokens) == (3, [5, 6, 7]), (eng.position, eng.tokens)
        captures = [e for e in fake.log if e[0] == "capture"]
        mode = tuning.current().capture_mode
        first_pool = ("pool of", id(eng.graphs.graphs[3][0]))
        assert captures == [("capture", 3, None, "side", mode), ("capture", 1, first_pool, "side", mode),
                            ("capture", WINDOW, first_pool, "side", mode)], captures
        # each row count's first forward ran once, eagerly, with fixed shapes, on the capture stream
        assert streams == [(3, True, "side"), (1, True, "side"), (WINDOW, True, "side")], streams
        got = _script(eng, eng.info.vocab_size)
        tel = eng.telemetry()
        assert tel["decode_graphs"] and not tel.get("graph_error"), tel.get("graph_error")
        assert eng.graphs.captured() == [1, 2, 3, WINDOW], eng.graphs.captured()
        replays = [e[1] for e in fake.log if e[0] == "replay"]
        assert replays.count(1) == 3 + WINDOW + 1 and replays.count(WINDOW) == WINDOW + 1, replays
        assert replays.count(2) == WINDOW, replays            # the first verify of 2 ran eagerly, then captured
        assert [s for s in streams[3:] if s[1]] == [(2, True, "side")], streams
    finally:
        eng.model.forward = forward
    eng.graphs, eng.static = None, True
    want = _script(eng, eng.info.vocab_size)
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"step {i}: graphs differ from the static forward by {(a - b).abs().max():.2e}"


def test_idle_work_captures_the_decode_step_then_a_full_verify_where_they_fit(eng, fake):
    assert idle_rows(WINDOW, {}) == [1, WINDOW] and idle_rows(WINDOW, {1: None}) == [WINDOW]
    assert idle_rows(2, {}) == [1, 2] and idle_rows(1, {}) == [1] and idle_rows(WINDOW, {1: 0, WINDOW: 0}) == []
    prompt = list(range(10, 10 + CONTEXT - 3))
    eng.forward(prompt)                                    # a long forward: not through the graphs
    assert eng.graphs.captured() == []
    conv, rec = eng.cache.conv.clone(), eng.cache.rec.clone()
    assert eng.idle_work() is True                         # the decode step: 1 row fits
    assert eng.idle_work() is False                        # a full verify would pass the context's end
    assert eng.graphs.captured() == [1] and eng.position == CONTEXT - 3 and eng.tokens == prompt
    assert torch.equal(conv, eng.cache.conv) and torch.equal(rec, eng.cache.rec)
    eng.prepare_decode(8)                                  # nothing left that fits
    assert eng.graphs.captured() == [1]


def test_a_failed_capture_names_the_part_and_the_engine_goes_on_eagerly(eng, fake):
    """A kernel that invalidates the capture in layer 2's MoE: the step's eager result stands, the
    graphs go off with an error naming that part, and later steps run eagerly."""
    kind, attn_norm, mlp_norm, mixer, moe = eng.model.blocks[2]

    class Breaking:
        experts = moe.experts

        def __call__(self, h):
            if fake.capturing:
                fake.valid = False
            return moe(h)
    graphs, eng.graphs, eng.static = eng.graphs, None, True
    want = [eng.forward([5, 6, 7]).clone(), eng.forward([8]).clone()]
    eng.reset()
    eng.graphs, eng.static = graphs, False
    eng.model.blocks[2] = (kind, attn_norm, mlp_norm, mixer, Breaking())
    try:
        got = [eng.forward([5, 6, 7]).clone()]
        assert eng.graphs is None and eng.graph_error, "the capture should have failed"
        assert eng.graph_error.startswith("capture of 3 rows failed (invalidated by layer 2 (MoE)): RuntimeError"), \
            eng.graph_error
        got.append(eng.forward([8]).clone())
    finally:
        eng.model.blocks[2] = (kind, attn_norm, mlp_norm, mixer, moe)
    assert eng.telemetry()["graph_error"] == eng.graph_error and not eng.telemetry()["decode_graphs"]
    assert torch.equal(got[0], want[0]) and (got[1] - want[1]).abs().max() <= 1e-4


def test_the_static_forward_uses_neither_cudnn_nor_flash_attention(eng, monkeypatch):
    """cuDNN's attention failed inside a captured graph on the H200; flash takes no mask."""
    seen = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append((torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled(),
                     torch.backends.cuda.mem_efficient_sdp_enabled() and torch.backends.cuda.math_sdp_enabled()))
        return sdpa(*args, **kwargs)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    eng.reset()
    eng.static = True
    try:
        eng.forward([5, 6, 7])
        eng.forward([8])
    finally:
        eng.static = False
    assert seen == [(False, False, True)] * 2, seen
    assert torch.backends.cuda.cudnn_sdp_enabled() and torch.backends.cuda.flash_sdp_enabled()


def test_the_host_read_check_catches_what_breaks_a_capture():
    x = torch.arange(4.0)
    with NoHostReads():
        (x * 2).sum()
        torch.arange(3)
    for what in (lambda: x.sum().item(), lambda: bool(x[0]), lambda: torch.nonzero(x),
                 lambda: torch.tensor([1, 2]), lambda: x.tolist(), lambda: x.repeat_interleave(torch.tensor(2))):
        with pytest.raises(AssertionError, match="inside a capture"):
            with NoHostReads():
                what()
