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

The GPU test's sequences (tests/gpu/test_qwen35_hybrid_gpu.py) run here: a 3-row forward, the idle
captures, the script of decodes, verifies and rollbacks; steps at bucket edges (511, 512, 513), verifies
crossing an edge, in a context not a multiple of 512. Each step replays the graph of its last row's
bucket L, and the graphs' logits equal the same static forwards run eagerly (and the eager forwards).
"""
from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from runtime.backends import hybrid
from runtime.backends.exl2_graph import bucket
from runtime.backends.hybrid_graphs import StepGraphs
from runtime.experts.layer import ExpertLayer, route
from runtime.experts.pack import dequantize_packed
from runtime.experts.shapes import CAPTURE_MODE
from runtime.options import LoadOptions, OffloadOptions

K = 5
WINDOW = K + 1
CONTEXT = 1300                  # buckets 512, 1024 and the capped 1300
BUCKETS = (512, 1024, 1300)


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
        self.api.log.append(("replay", args[0].shape[0], kwargs["span"]))
        self.api.replaying = True
        try:
            if kwargs.get("keep") is not None:           # the captured hidden states' buffer is written too
                kept: list = []
                self.out.copy_(forward(*args, **{**kwargs, "keep": kept}))
                self.hidden.copy_(kept[0])
            else:
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
            self.log.append(("capture", args[0].shape[0], kwargs["span"], pool, stream.name, capture_error_mode))
            out = forward(*args, **kwargs)
            g.call, g.out = (forward, args, {k: v for k, v in kwargs.items() if k != "probe"}), out
            g.hidden = kwargs["keep"][-1] if kwargs.get("keep") is not None else None
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
                            window=WINDOW, mtp=True)
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


def _state(eng):
    c = eng.cache
    return [c.conv.clone(), c.rec.clone(), c.k[:, :, :c.length].clone(), c.v[:, :, :c.length].clone()]


def _same_state(eng, before):
    return all(torch.equal(a, b) for a, b in zip(_state(eng), before))


def test_the_gpu_tests_sequence_captures_each_bucket_and_row_count_once_and_replays_the_static_forwards(eng, fake):
    streams = []
    forward = eng.model.forward

    def watched(*args, **kwargs):
        if not (fake.capturing or fake.replaying):
            streams.append((args[0].shape[0], kwargs.get("static", False), fake.current.name))
        return forward(*args, **kwargs)
    eng.model.forward = watched
    try:
        eng.forward([5, 6, 7])
        before = _state(eng)
        while eng.idle_work():
            pass
        assert eng.graphs is not None, eng.graph_error
        every = sorted((L, t) for L in BUCKETS for t in range(1, WINDOW + 1))
        assert eng.graphs.captured() == every, eng.graphs.captured()
        assert (eng.position, eng.tokens) == (3, [5, 6, 7]) and _same_state(eng, before)
        captures = [e for e in fake.log if e[0] == "capture"]
        mode = CAPTURE_MODE
        first_pool = ("pool of", id(eng.graphs.graphs[(512, 3)][0]))
        assert captures[0] == ("capture", 3, 512, None, "side", mode), captures[0]
        # idle time: the decode step of this bucket and the next two first, then the verifies'
        assert [c[1:3] for c in captures[1:4]] == [(1, 512), (1, 1024), (1, 1300)], captures[:4]
        assert all(c[3:] == (first_pool, "side", mode) for c in captures[1:]), captures
        assert len(captures) == len(every) and len(streams) == len(every)
        assert all(s[1:] == (True, "side") for s in streams), streams   # each first run: static, capture stream
        fake.log.clear()
        got = _script(eng, eng.info.vocab_size)
        tel = eng.telemetry()
        assert tel["decode_graphs"] and not tel.get("graph_error"), tel.get("graph_error")
        assert tel["graph_buckets"] == list(BUCKETS) and len(tel["graph_shapes"]) == len(every)
        assert not [e for e in fake.log if e[0] == "capture"], fake.log            # every short step replayed
        assert not [s for s in streams[len(every):] if s[1]], streams             # (the rest: long forwards)
        replays = [e[1:] for e in fake.log if e[0] == "replay"]
        assert {L for _, L in replays} == {512}, replays          # positions 70..110: the first bucket
        assert replays.count((1, 512)) == 3 + WINDOW + 1 and replays.count((WINDOW, 512)) == WINDOW + 1, replays
    finally:
        eng.model.forward = forward
    eng.graphs, eng.static = None, True
    want = _script(eng, eng.info.vocab_size)
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"step {i}: graphs differ from the static forward by {(a - b).abs().max():.2e}"


def _edges(eng) -> tuple[list[torch.Tensor], list[tuple[int, int]]]:
    """Steps at and across bucket edges: decodes at 509..513, a verify of WINDOW rows from 508 (last row
    513: bucket 1024) and a rollback into it, a verify of 2 from 511, then a verify from 1020 into the
    capped last bucket (1300) and decodes at 1022..1024. -> the logits, and each short step's (rows, L)."""
    g = torch.Generator().manual_seed(7)
    toks = torch.randint(0, eng.info.vocab_size - 64, (CONTEXT,), generator=g).tolist()
    out, steps = [], []

    def short(ids):
        steps.append((len(ids), bucket(eng.position, len(ids), CONTEXT)))
        out.append(eng.forward(ids).clone())
    eng.reset()
    out.append(eng.forward(toks[:509]).clone())
    for i in range(509, 514):
        short([toks[i]])
    eng.truncate(508)                                       # before the ring: the kept tokens replayed
    short(toks[600:600 + WINDOW])
    eng.truncate(511)                                       # a rollback inside the verify
    short(toks[700:702])
    short([toks[702]])
    out.append(eng.forward(toks[513:1020]).clone())
    short(toks[800:800 + WINDOW])
    eng.truncate(1022)
    for i in range(3):
        short([toks[900 + i]])
    return out, steps


def test_each_step_replays_the_graph_of_its_last_rows_bucket_and_matches_the_eager_forward(eng, fake):
    got, steps = _edges(eng)
    assert eng.graphs is not None, eng.graph_error
    assert steps == [(1, 512), (1, 512), (1, 512), (1, 1024), (1, 1024), (WINDOW, 1024), (2, 1024), (1, 1024),
                     (WINDOW, 1300), (1, 1024), (1, 1024), (1, 1300)], steps
    ran = [e[1:3] for e in fake.log if e[0] in ("capture", "replay")]
    assert ran == steps, ran                                # each through the graph of its (rows, bucket)
    assert [e[1:3] for e in fake.log if e[0] == "capture"] == list(dict.fromkeys(steps)), fake.log
    graphs, eng.graphs, eng.static = eng.graphs, None, True
    static, _ = _edges(eng)
    eng.static = False
    eager, _ = _edges(eng)
    for i, (a, b, c) in enumerate(zip(got, static, eager)):
        assert torch.equal(a, b), f"step {i}: graphs differ from the static forward by {(a - b).abs().max():.2e}"
        assert (a - c).abs().max() <= 1e-4, f"step {i}: graphs differ from the eager forward by {(a - c).abs().max()}"
    # the bucket must cover the last row: a verify attending the first row's bucket misses rows past its edge
    eng.graphs, eng.static = graphs, False
    fake.log.clear()
    graphs.graphs.clear()
    graphs.span = lambda position, t: bucket(position, 1, CONTEXT)
    short, _ = _edges(eng)
    assert not torch.equal(short[6], static[6]) and torch.equal(short[1], static[1])


def test_load_answer_and_idle_captures_follow_the_plans_and_leave_the_cache_as_it_was(eng, fake):
    first = [(L, t) for L in (512, 1024) for t in range(1, WINDOW + 1)]
    assert eng.prepare_graphs() == len(first) and eng.graphs.captured() == first     # at load: the first two buckets
    assert eng.position == 0 and not eng.tokens
    prompt = [10 + i % 900 for i in range(1000)]
    eng.forward(prompt)                                     # a long forward: not through the graphs
    before = _state(eng)
    eng.prepare_decode(400)                                 # 1000 + 400 crosses into the capped 1300
    assert eng.graphs.captured() == sorted(first + [(1300, t) for t in range(1, WINDOW + 1)])
    assert (eng.position, eng.tokens) == (1000, prompt) and _same_state(eng, before)
    eng.forward(list(range(20, 317)))                       # to 1297: 3 rows left
    n = eng.position
    before = _state(eng)
    eng.graphs.graphs.clear()
    while eng.idle_work():
        pass
    assert eng.graphs.captured() == [(1300, 1), (1300, 2), (1300, 3)]     # what fits before the context's end
    assert eng.position == n and _same_state(eng, before)
    eng.prepare_decode(8)                                   # nothing left that fits
    assert len(eng.graphs.graphs) == 3


def test_the_graphs_held_are_capped_least_recently_used_first_and_idle_time_stops_when_full(eng, fake):
    eng.graphs.max_graphs = 4
    held = []
    forward = eng.forward

    def counted(ids):
        out = forward(ids)
        held.append(len(eng.graphs.graphs))
        return out
    eng.forward = counted
    try:
        got, steps = _edges(eng)
    finally:
        del eng.forward
    assert max(held) == 4 and eng.graphs is not None, held
    recent = sorted((L, t) for t, L in list(dict.fromkeys(reversed(steps)))[:4])     # the four most recently used
    assert len(set(steps)) > 4 and eng.graphs.captured() == recent, (eng.graphs.captured(), steps)
    calls = 0
    while eng.idle_work():
        calls += 1
        assert calls < 10, "idle time captures in a circle"
    assert len(eng.graphs.graphs) == 4
    graphs, eng.graphs, eng.static = eng.graphs, None, True
    want, _ = _edges(eng)
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"step {i}: graphs differ from the static forward by {(a - b).abs().max():.2e}"


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
        assert eng.graph_error.startswith("capture of 3 rows over 512 failed (invalidated by layer 2 (MoE)): "
                                          "RuntimeError"), eng.graph_error
        got.append(eng.forward([8]).clone())
    finally:
        eng.model.blocks[2] = (kind, attn_norm, mlp_norm, mixer, moe)
    assert eng.telemetry()["graph_error"] == eng.graph_error and not eng.telemetry()["decode_graphs"]
    assert torch.equal(got[0], want[0]) and (got[1] - want[1]).abs().max() <= 1e-4


def test_a_static_forward_needs_an_attended_length_that_fits(eng):
    eng.reset()
    eng.cache.begin(1)
    tok = torch.tensor([5])
    for span in (None, 0, CONTEXT + 1):
        with pytest.raises(ValueError, match="attended length"):
            eng.model.forward(tok, eng.cache, 0, True, static=True, span=span)


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


def test_mtp_drafts_read_the_hidden_states_the_graphs_keep(eng, fake, monkeypatch):
    """With the MTP head following (runtime/backends/hybrid_mtp.py), a replayed step hands it the rows'
    final hidden states, which each graph keeps beside its logits: the drafts after decode steps and a
    verify's rollback equal those of the same steps run as static forwards without graphs."""
    seq = torch.randint(0, 1000, (60,), generator=torch.Generator().manual_seed(7)).tolist()

    def run() -> list[torch.Tensor]:
        eng.reset()
        eng.mtp_enable()
        rows: list[torch.Tensor] = []
        eng.forward(seq[:40])
        for n in range(40, 45):
            eng.mtp_draft(seq[:n + 1], 2, lambda row: rows.append(row.clone()) or int(row.argmax()))
            eng.forward([seq[n]])
        eng.forward(seq[45:45 + WINDOW])
        eng.truncate(47)
        eng.mtp_draft(seq[:48], 2, lambda row: rows.append(row.clone()) or int(row.argmax()))
        return rows

    rebuilt: list[int] = []
    monkeypatch.setattr(eng, "_mtp_rebuild", lambda n: rebuilt.append(n))     # the head never fell behind
    try:
        got = run()
        assert eng.graphs is not None, eng.graph_error
        assert not rebuilt, rebuilt
        assert sum(e[0] == "replay" for e in fake.log) >= 3, fake.log
        graphs, eng.graphs, eng.static = eng.graphs, None, True
        want = run()
        eng.graphs, eng.static = graphs, False
    finally:
        eng.reset()
        eng.mtp_on = False
    assert len(got) == len(want) == 12
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"draft row {i}: the graphs' hidden states differ from the static forward's"


def test_under_offload_short_steps_replay_graphs_and_a_replacement_drops_them(folder, monkeypatch):
    """With the experts offloaded (their codes in host memory, a few in slots), decode and verify steps
    go through the graphs as without offload; a forward the manager stages for runs eagerly; moving the
    slots (place_experts, the routing prior's re-placement) drops every graph and its pool, so no replay
    reads the old slots, and the next steps capture again."""
    monkeypatch.setattr(ExpertLayer, "__call__", sync_free_experts)
    off, _ = hybrid.load(folder, LoadOptions(offload=OffloadOptions(context_length=CONTEXT)), device="cpu",
                         window=WINDOW, host_experts=True)
    try:
        assert off.offload is not None
        api = FakeCuda(off)
        off.graphs = StepGraphs(off, cuda=api)
        off.place_experts([[0, 1]] * off.spec.layers)
        seq = torch.randint(0, 1000, (40,), generator=torch.Generator().manual_seed(5)).tolist()
        off.forward(seq[:20])
        for i in range(20, 23):
            off.forward([seq[i]])
        off.forward(seq[23:23 + WINDOW])
        assert [e[0] for e in api.log] == ["capture", "replay", "replay", "capture"], api.log
        begin = off.offload.begin_forward
        monkeypatch.setattr(off.offload, "begin_forward", lambda rows: begin(rows) or rows >= 2)   # as for a long one
        off.forward(seq[30:33])
        assert len(api.log) == 4, "a staged forward went through a graph"
        monkeypatch.undo()
        monkeypatch.setattr(ExpertLayer, "__call__", sync_free_experts)
        assert off.graphs.captured() == [(512, 1), (512, WINDOW)]
        off.graphs.pool = ("pool of", 1)
        off.place_experts([[2, 3]] * off.spec.layers)
        assert off.graphs is not None and off.graphs.captured() == [] and off.graphs.pool is None
        off.forward([seq[33]])
        assert api.log[-1][0] == "capture" and off.graphs.captured() == [(512, 1)]
    finally:
        off.close()
