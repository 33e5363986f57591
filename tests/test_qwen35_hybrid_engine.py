"""The hybrid engine (runtime/backends/hybrid.py) on the CPU against the CPU reference engine, on a
`tiny-qwen3.5` synthetic EXL2 folder: the same layers, the projections dequantized (QuantLinear's CPU
implementation), the routed experts through ExpertLayer, the DeltaNet states in the preallocated cache.

Tolerance: max |logit difference| <= 2e-3 against the float32 reference, logits of order 1: the one
difference in the math is the experts' intermediate, kept in fp16 as the GPU kernels keep it
(runtime/experts/layer.experts_reference), about 1e-3 here. A wrong state or rollback shows as more
than ten times that (checked: the logits after two neighbouring accepted prefixes differ by more).
"""
from __future__ import annotations

import pytest
import torch

from runtime.backends import hybrid
from runtime.errors import BadRequest, ContextOverflow, EngineError, UnsupportedArchitecture
from runtime.options import LoadOptions, OffloadOptions
from runtime.reference import load as reference_load

TOL = 2e-3
V = 1024
K = 5                 # drafts of a verify: K + 1 rows
WINDOW = K + 1


@pytest.fixture(scope="module")
def folder(tiny_qwen35):
    return tiny_qwen35


@pytest.fixture(scope="module")
def ref(folder):
    engine, _ = reference_load(folder, precision="float32")
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def eng(folder):
    engine, _ = hybrid.load(folder, LoadOptions(offload=OffloadOptions(context_length=512)), device="cpu",
                            window=WINDOW)
    yield engine
    engine.close()


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _close(got, want, what):
    assert got.shape == want.shape, what
    diff = (got - want).abs().max().item()
    assert diff <= TOL, f"{what}: max |logit diff| {diff:.2e} > {TOL}"


def _both(ref, eng, tokens, what):
    want, got = ref.forward(tokens), eng.forward(tokens)
    _close(got, want, what)
    return got


def test_prefill_across_chunks_decode_and_verify_match_the_reference(ref, eng):
    ref.reset(), eng.reset()
    seq = _tokens(90, 1)
    got = _both(ref, eng, seq[:70], "prefill of 70 (two blocks of the chunked rule)")
    assert got.abs().max() > 0.5, "logits too small for the comparison to mean anything"
    for i in range(70, 74):
        _both(ref, eng, [seq[i]], f"decode at {i}")
    _both(ref, eng, seq[74:74 + WINDOW], f"verify of {WINDOW} rows")
    _both(ref, eng, seq[80:83], "verify of 3 past the snapshot window (the ring moves)")
    assert eng.position == ref.position == 83
    assert eng.prefill(seq[83:90]).shape == (1, V)
    ref.forward(seq[83:90])
    _both(ref, eng, [5], "decode after a prefill that returned the last row only")


@pytest.mark.parametrize("prompt", [70, 9], ids=["after-a-long-prefill", "after-short-forwards"])
def test_verify_rolls_back_to_every_accepted_prefix(ref, eng, prompt):
    """Verify K drafts (K + 1 rows), keep each prefix 0..K+1 of them in turn and go on from there: the
    DeltaNet states are those after that prefix (what the next verify and decode see)."""
    ref.reset(), eng.reset()
    seq = _tokens(prompt + WINDOW, 4)
    _both(ref, eng, seq[:prompt], "prompt") if prompt > 8 else None
    seen = []
    for keep in range(WINDOW + 1):
        ref.truncate(prompt), eng.truncate(prompt)
        _both(ref, eng, seq[prompt:], "verify")
        ref.truncate(prompt + keep), eng.truncate(prompt + keep)
        assert eng.position == prompt + keep and eng.tokens == seq[:prompt + keep]
        after = _tokens(3, 10 + keep)
        seen.append(_both(ref, eng, after[:2], f"verify of 2 after keeping {keep}"))
        _both(ref, eng, after[2:], f"decode after keeping {keep}")
    # the tolerance tells states apart: the same two tokens after neighbouring prefixes differ far more
    eng.truncate(prompt + 1)
    assert (eng.forward(_tokens(3, 11)[:2]) - seen[1]).abs().max() <= TOL, "the same prefix and tokens"
    eng.truncate(prompt + 2)
    assert (eng.forward(_tokens(3, 11)[:2]) - seen[1]).abs().max() > 10 * TOL


def test_snapshots_hold_the_states_of_a_fresh_run_of_the_prefix(folder, eng):
    """The states a rollback restores are those a forward of exactly the kept rows leaves (up to the
    rounding of a one-row against a six-row projection: float32 matmuls summed in another order)."""
    seq = _tokens(20, 5)
    eng.reset()
    eng.forward(seq[:12])
    eng.forward(seq[12:12 + WINDOW])
    for keep in (0, 1, 3, WINDOW):
        eng.truncate(12 + keep)
        conv, rec = eng.cache.conv.clone(), eng.cache.rec.clone()
        eng.truncate(12)
        if keep:
            eng.forward(seq[12:12 + keep])
        assert torch.allclose(conv, eng.cache.conv, rtol=1e-4, atol=1e-4), f"convolution state after {keep}"
        assert torch.allclose(rec, eng.cache.rec, rtol=1e-4, atol=1e-6), f"recurrent state after {keep}"
        eng.truncate(12)
        eng.forward(seq[12:12 + WINDOW])


def test_single_token_steps_and_a_truncate_before_the_window_replay(ref, eng):
    """Drafter-like single-token steps rolled back inside the ring (a copy), then a truncate to before
    it (the kept tokens replayed): the next tokens see the same states as the reference's."""
    ref.reset(), eng.reset()
    seq = _tokens(40, 6)
    _both(ref, eng, seq[:20], "prompt")
    for i in range(20, 20 + WINDOW):
        _both(ref, eng, [seq[i]], f"step {i}")
    ref.truncate(22), eng.truncate(22)
    _both(ref, eng, seq[30:32], "after stepping back inside the ring")
    base = eng.cache.base
    ref.truncate(15), eng.truncate(15)
    assert 15 < base and eng.position == 15
    _both(ref, eng, seq[32:35], "after a truncate before the ring (replayed)")


def test_static_forward_what_a_graph_captures_matches(ref, eng):
    """Short forwards with every shape fixed (attention over the whole cache, masked by position)."""
    ref.reset(), eng.reset()
    seq = _tokens(40, 7)
    _both(ref, eng, seq[:20], "prompt")
    eng.static = True
    try:
        for i in range(20, 23):
            _both(ref, eng, [seq[i]], f"static decode at {i}")
        _both(ref, eng, seq[23:23 + WINDOW], "static verify")
        ref.truncate(25), eng.truncate(25)
        _both(ref, eng, seq[30:32], "static after a rollback")
    finally:
        eng.static = False


def test_offloaded_experts_give_the_same_logits(folder, eng):
    """Every expert's codes in host memory, a few placed in slots by the offload manager: the
    layers read their experts through the offload tables, the logits do not change."""
    off, _ = hybrid.load(folder, LoadOptions(offload=OffloadOptions(context_length=512)), device="cpu",
                         window=WINDOW, host_experts=True)
    try:
        assert off.offload is not None and all(lay.offload is not None for lay in off.model.expert_layers())
        off.place_experts([[0, 3, 7], [1], [], list(range(16))])
        assert off.offload.layers[0].resident() == [0, 3, 7]
        seq = _tokens(30, 8)
        eng.reset()
        for part in (seq[:20], [seq[20]], seq[21:21 + WINDOW]):
            assert torch.equal(off.forward(part), eng.forward(part))
        off.truncate(22), eng.truncate(22)
        assert torch.equal(off.forward([seq[28]]), eng.forward([seq[28]]))
    finally:
        off.close()


def test_bad_requests_are_refused_in_words(eng):
    eng.reset()
    with pytest.raises(BadRequest, match="outside the vocabulary"):
        eng.forward([1, V])
    with pytest.raises(BadRequest, match="at least one token"):
        eng.forward([])
    with pytest.raises(ContextOverflow):
        eng.forward([1] * 513)
    eng.forward([1, 2, 3])
    with pytest.raises(EngineError, match="cannot truncate to 4"):
        eng.truncate(4)
    assert eng.position == 3


def test_a_folder_that_is_not_exl2_is_refused_by_name(tmp_path):
    pytest.importorskip("transformers")
    from tests.test_qwen35_parity import make_model
    make_model("conditional", tmp_path)
    with pytest.raises(UnsupportedArchitecture, match="not an EXL2 folder"):
        hybrid.load(tmp_path, device="cpu")


def test_the_window_follows_the_draft_options():
    from runtime.options import DraftOptions
    assert hybrid.rollback_window(LoadOptions()) == hybrid.MIN_WINDOW
    assert hybrid.rollback_window(LoadOptions(draft=DraftOptions(mode="ngram", draft_tokens=8))) == 9


def _untied_tokens(ref, n: int, seed: int, margin: float = 2e-3) -> list[int]:
    """Tokens (from `seed` on) where the reference's router never nearly ties: its k-th and (k+1)-th
    logits further apart than `margin` x their standard deviation in every layer and row. Where they
    nearly tie, the engine's rounding may pick the other expert (gaps of 2e-4 seen), and the recurrent
    state carries that row's difference into every later row: a different model, not an error."""
    from runtime.reference import qwen35 as rq
    from tests.router_ties import router_gaps
    for s in range(seed, seed + 50):
        seq = _tokens(n, s)
        if router_gaps(ref, rq, seq).min() >= margin:
            return seq
    raise AssertionError(f"no token sequence from seeds {seed}..{seed + 49} without a near tie in the router")


def test_a_long_forward_runs_in_chunks_with_every_row(ref, eng, monkeypatch):
    monkeypatch.setattr(hybrid, "PREFILL_CHUNK", 16)
    seq = _untied_tokens(ref, 50, 9)
    ref.reset(), eng.reset()
    _both(ref, eng, seq[:40], "a forward of 40 rows in chunks of 16")
    assert eng.position == 40 and eng.tokens == seq[:40]
    last = eng.prefill(seq[40:50])
    _close(last, ref.forward(seq[40:50])[-1:], "prefill in one chunk")


def test_a_prefill_in_chunks_runs_the_head_on_its_last_row_only(ref, eng, monkeypatch):
    """A prefill's chunks computed every row's logits and kept the first chunk's alive in the list of
    outputs: at qwen3.5-122b-a10b's 248,320-token vocabulary a 512-row chunk's are 0.47 GiB in float32, and
    the second chunk ran out of memory at a 24 GB budget on the H200."""
    monkeypatch.setattr(hybrid, "PREFILL_CHUNK", 16)
    seq = _untied_tokens(ref, 50, 9)
    rows, head = [], eng.model.head

    class Head:
        def __call__(self, x):
            rows.append(x.shape[0])
            return head(x)
    monkeypatch.setattr(eng.model, "head", Head())
    ref.reset(), eng.reset()
    last = eng.prefill(seq[:40])
    assert rows == [1, 1, 1], rows                  # chunks of 16, 16 and 8 rows
    _close(last, ref.forward(seq[:40])[-1:], "the last row of a prefill in chunks")
    _both(ref, eng, [seq[40]], "decode after it")


def test_the_cuda_linear_feeds_exllamav2_what_its_linear_would(folder, monkeypatch):
    """QuantLinear's CUDA implementation on a stand-in of exllamav2's extension (the real one needs a
    GPU): it is handed q_perm = argsort(q_invperm) and every tensor of each part, writes [T, N] fp16
    outputs that are cut to each part's width and concatenated; the result equals the CPU one's."""
    import sys
    import types
    from runtime.backends import quant_linear
    from runtime.exl2.format import dequantize
    from runtime.modelfolder import ModelFolder
    made = []

    def make_q_matrix(w, temp_dq, max_dq_rows=0):
        assert torch.equal(w["q_perm"].long(), torch.argsort(w["q_invperm"]).long())
        assert temp_dq.dtype == torch.float16 and max_dq_rows * w["q_weight"].shape[1] <= temp_dq.numel()
        made.append(dequantize({k: v for k, v in w.items() if k != "q_perm"}, torch.float32))   # [N, K]
        return len(made) - 1

    def gemm_half_q_half(x, handle, y, force_cuda):
        assert x.dtype == y.dtype == torch.float16 and y.shape == (x.shape[0], made[handle].shape[0])
        y.copy_((x.float() @ made[handle].T).half())

    ext_c = types.SimpleNamespace(gemm_half_q_half=gemm_half_q_half)
    stand_in = types.SimpleNamespace(make_q_matrix=make_q_matrix, exllamav2_ext=ext_c)
    monkeypatch.setitem(sys.modules, "exllamav2", types.SimpleNamespace(ext=stand_in))
    monkeypatch.setitem(sys.modules, "exllamav2.ext", stand_in)
    f = ModelFolder(folder)
    try:
        a = "model.language_model.layers.0.linear_attn"
        names = [f"{a}.in_proj_qkv", f"{a}.in_proj_z", f"{a}.in_proj_b", f"{a}.in_proj_a"]
        outs = [2 * 4 * 32 + 32 * 32, 32 * 32, 32, 32]           # tiny-qwen3.5: C, HV*dv, HV, HV
        cuda_like = quant_linear.CudaExl2Linear([quant_linear.exl2_parts(f, n) for n in names], outs, names,
                                                torch.device("cpu"))
        cpu = quant_linear.build(f, names, outs, torch.device("cpu"), torch.float32)
    finally:
        f.close()
    assert len(made) == 4 and cuda_like.out_features == cpu.out_features == sum(outs)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0)).half()
    got, want = cuda_like(x), cpu(x.float())
    assert got.dtype == torch.float16 and got.shape == (3, sum(outs))
    assert (got.float() - want).abs().max() <= 2e-3 * want.abs().max()


def test_a_forward_that_fails_half_way_leaves_the_states_as_they_were(ref, eng):
    """A failure inside a layer (here the last MoE block, after every DeltaNet state was written) takes
    the cache back to before that forward: by the snapshot ring for a short one, by a replay for a long one."""
    ref.reset(), eng.reset()
    seq = _tokens(40, 12)
    _both(ref, eng, seq[:20], "prompt")
    block = eng.model.blocks[-1]

    class Boom(RuntimeError):
        pass

    def failing(h):                     # a transient failure: the replay after it runs
        eng.model.blocks[-1] = block
        raise Boom("a kernel failed")
    for rows in (3, 12):
        eng.model.blocks[-1] = (*block[:4], failing)
        with pytest.raises(Boom):
            eng.forward(seq[20:20 + rows])
        assert eng.position == 20 and eng.tokens == seq[:20]
        _both(ref, eng, [seq[30]], f"decode after a failed forward of {rows}")
        ref.truncate(20), eng.truncate(20)


def test_an_experiment_reaches_every_moe_layer_and_the_offload_manager(folder):
    """bench.offload drives this engine as the exllamav2 one: `set_experiment` hands forced picks to every
    MoE layer (uniform routing: the GPU kernels apply them, this CPU path keeps the router's) and the rest
    to the offload manager; a wrong number of pick sets is refused in words; NO_EXPERIMENT undoes it."""
    from runtime.offload.experiment import NO_EXPERIMENT, Experiment
    from runtime.experts.routing import UniformPicks
    off, _ = hybrid.load(folder, LoadOptions(offload=OffloadOptions(context_length=512)), device="cpu",
                         window=WINDOW, host_experts=True)
    try:
        first = off.moe[0].experts
        assert [m.experts for m in off.moe] == off.model.expert_layers()
        picks = UniformPicks.draw(first.num_experts, first.top_k, first.gate_w.device)
        run = off.experiment.replace(forced_routing=tuple(picks.for_layer(i) for i in range(len(off.moe))),
                                     routing_label="uniform", naive=True)
        off.set_experiment(run)
        assert off.experiment is run and off.offload.experiment is run
        assert all(m.experts.forced is run.forced_routing[i] for i, m in enumerate(off.moe))
        with pytest.raises(EngineError, match="1 pick sets for 4 MoE layers"):
            off.set_experiment(Experiment(forced_routing=(picks.for_layer(0),)))
        off.set_experiment(NO_EXPERIMENT)
        assert all(m.experts.forced is None for m in off.moe) and off.offload.experiment is NO_EXPERIMENT
    finally:
        off.close()
    plain, _ = hybrid.load(folder, LoadOptions(offload=OffloadOptions(context_length=256)), device="cpu")
    try:
        with pytest.raises(EngineError, match="needs a model loaded with expert offload"):
            plain.set_vram_budget(24)
        with pytest.raises(EngineError, match="needs a model loaded with expert offload"):
            plain.set_experiment(Experiment(naive=True))
    finally:
        plain.close()


def test_the_expert_path_trials_steps_leave_the_conversation_as_it_was(ref, eng):
    """expert_path.time_decode_steps (the CPU expert path's trial) decodes past the cache's end and
    comes back through `hold_position`: 20 steps, more than the rollback window, need no replay of the
    conversation, and the next step's logits are the reference's; a truncate before the held position
    still works (by replaying)."""
    from runtime.backends.expert_path import time_decode_steps
    seq = _tokens(60, 12)
    ref.reset(), eng.reset()
    _both(ref, eng, seq[:40], "prefill")
    replays = []
    recover = eng._recover
    eng._recover = lambda length: replays.append(length) or recover(length)
    try:
        times = time_decode_steps(eng, steps=20)
        assert len(times) == 20 and not replays, replays
        assert eng.position == 40 and eng.tokens == seq[:40]
        _both(ref, eng, [seq[40]], "the step after the trial")
        eng.truncate(37), ref.truncate(37)
        assert replays == [37]
        _both(ref, eng, seq[41:43], "a verify after a truncate before the held position")
    finally:
        eng._recover = recover


@pytest.mark.parametrize("break_it, says", [
    (lambda t: t.update(q_groups=t["q_groups"].flip(0)), "q_groups"),
    (lambda t: t.update(q_invperm=torch.zeros_like(t["q_invperm"])), "not a permutation"),
    (lambda t: t.update(q_scale=t["q_scale"][:, :1]), "scales per group"),
], ids=["group-table", "permutation", "scales"])
def test_exllamav2s_kernels_get_no_inconsistent_exl2_tensors(break_it, says):
    """The GPU engine's quantized linears check each EXL2 tensor set before exllamav2 indexes by it
    (quant_linear.check_exl2, run by CudaExl2Linear): a folder's bytes are untrusted."""
    from runtime.backends.quant_linear import check_exl2
    from runtime.errors import InvalidModel
    from runtime.exl2.synth import _random_linear
    t = _random_linear(64, 128, 4.0, torch.Generator().manual_seed(0))
    check_exl2(t, "layers.0.q_proj")
    break_it(t)
    with pytest.raises(InvalidModel, match=f"layers.0.q_proj.*{says}"):
        check_exl2(t, "layers.0.q_proj")


def test_the_expert_path_decision_runs_on_this_engine(folder, tmp_path, monkeypatch):
    """expert_path's decision (shared with the exllamav2 engine) finds on this engine what it asks for:
    the judge made and consulted, its telemetry, the idle step with nothing to re-check, a new budget's
    judge. (On the CPU the offload manager streams: the decision is the GPU-only path, untimed.)"""
    from runtime.backends.expert_path import settle_cpu_path
    monkeypatch.setenv("MOEDESK_HOME", str(tmp_path))
    off, _ = hybrid.load(folder, LoadOptions(offload=OffloadOptions(context_length=512)), device="cpu",
                         window=WINDOW, host_experts=True)
    try:
        said = []
        settle_cpu_path(off, lambda stage, message, done, total: said.append(message))
        assert off.path_judge is not None and off.path_judge.path == "stream", said
        assert said and said[-1].startswith("Expert path:")
        assert off.telemetry()["placement_decision"]["path"] == "stream"
        assert off.idle_work() is False                   # no drift to re-check, no graphs on the CPU
        off.forward(_tokens(3, 2))
        for t in _tokens(4, 3):
            off.forward([t])                              # one-row steps the judge hears
        assert off.path_judge.telemetry()["path"] == "stream"
    finally:
        off.close()


def test_a_request_drafting_more_than_the_load_planned_is_capped_not_replayed(folder):
    """The snapshot ring holds the rows the load's draft options planned (here 2 drafts + 1); a request
    asking for 8 drafts (the settings changed without a reload) verifies at most 2, so every rejection
    rolls back by a copy: no verify runs the whole conversation again, and the text is plain decoding's."""
    from runtime import sampling
    from runtime.options import DraftOptions, SamplingOptions
    from runtime.speculative import make_decoder
    greedy = SamplingOptions(temperature=0.0)
    eng, _ = hybrid.load(folder, LoadOptions(offload=OffloadOptions(context_length=512)), device="cpu", window=3)
    try:
        assert eng.max_draft_tokens == 2
        prompt = _tokens(12, 4) * 3                                  # n-gram lookup finds drafts at once
        plain = prompt + [sampling.sample(eng.forward(prompt)[-1], prompt, greedy)]
        while len(plain) < len(prompt) + 24:
            plain.append(sampling.sample(eng.forward(plain[-1:])[0], plain, greedy))
        eng.reset()
        replays: list[int] = []
        recover = eng._recover
        eng._recover = lambda length: replays.append(length) or recover(length)
        dec = make_decoder(eng, DraftOptions(mode="ngram", draft_tokens=8, adaptive=False), greedy)
        got = prompt + [sampling.sample(eng.forward(prompt)[-1], prompt, greedy)]
        while len(got) < len(prompt) + 24:
            got += dec.step(got)
        s = dec.stats()
        assert got[:len(plain)] == plain and s.drafted_tokens > 0 and not replays, (s, replays)
        assert max(r for r in range(len(s.acceptance_histogram)) if s.acceptance_histogram[r]) <= 2
    finally:
        eng.close()
