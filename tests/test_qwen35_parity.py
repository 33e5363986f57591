"""Qwen3.5-MoE on the CPU reference engine against transformers' own model, on tiny random configs.

Every step is compared with a cache-free transformers forward over the same tokens: prefill (the
chunked delta rule), decode and verify (the recurrent one), truncate and rollback to every accepted
prefix of a verify window, a drafter's single-token steps rolled back, and a truncate to before the
rollback checkpoint (the kept tokens replayed). Tolerance: max |logit difference| <= 1e-3 in float32,
logits of order 1-10: the recurrence carries float32 rounding from token to token, summed in another
order by the chunked and the recurrent form (transformers' own cached decode differs from its cache-free
forward by up to 5e-5 here; a long prefill and decode measured 3.2e-4 on an AMD EPYC with AVX-512, under
2.5e-4 on the Xeons before); a wrong state or a wrong rollback shows as 1e-2 and more.
"""
from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from runtime.engine import offered  # noqa: E402
from runtime.errors import BadRequest, EngineError  # noqa: E402
from runtime.reference import load  # noqa: E402
from runtime.reference.hybrid import ROLLBACK_WINDOW  # noqa: E402

TOL_FP32 = 1e-3
V = 128
TEXT = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=V,
            max_position_embeddings=512, rms_norm_eps=1e-5, moe_intermediate_size=32,
            shared_expert_intermediate_size=48, num_experts=6, num_experts_per_tok=2)


def _configs():
    t = transformers
    return {
        # the Hub's layout: multimodal checkpoint, 3 DeltaNet : 1 attention, grouped value heads, partial RoPE
        "conditional": (t.Qwen3_5MoeForConditionalGeneration, t.Qwen3_5MoeConfig(
            text_config=dict(**TEXT, num_hidden_layers=4, linear_conv_kernel_dim=4, linear_key_head_dim=16,
                             linear_value_head_dim=24, linear_num_key_heads=2, linear_num_value_heads=4,
                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                              "partial_rotary_factor": 0.25, "mrope_section": [2, 1, 1],
                                              "mrope_interleaved": True}),
            vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64))),
        # text-only export, its own layer order, one key head per value head, tied head, half the dims rotated
        "causal_lm": (t.Qwen3_5MoeForCausalLM, t.Qwen3_5MoeTextConfig(
            **TEXT, num_hidden_layers=5, linear_conv_kernel_dim=3, linear_key_head_dim=8, linear_value_head_dim=8,
            linear_num_key_heads=4, linear_num_value_heads=4, tie_word_embeddings=True,
            layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention", "linear_attention"],
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.5})),
    }


def make_model(name: str, folder, seed: int = 0):
    """Weights large enough that routing, gates and the recurrence matter; saved as safetensors."""
    cls, config = _configs()[name]
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(0.5, 4).log())
            elif pname.endswith("dt_bias"):
                p.copy_(0.5 * torch.randn_like(p))
            elif pname.endswith("linear_attn.norm.weight"):       # this norm multiplies by its weight
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif p.dim() == 1:                                      # the others by 1 + weight
                p.copy_(0.2 * torch.randn_like(p))
            else:
                p.normal_(0, 1.5 / p.shape[-1] ** 0.5)
    model.save_pretrained(folder, safe_serialization=True)
    return model


def oracle(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens]), use_cache=False).logits[0].float()


@pytest.fixture(scope="module", params=list(_configs()))
def pair(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    model = make_model(request.param, folder)
    engine, _ = load(folder, precision="float32")
    return request.param, model, engine


def _checker(name, ref):
    def check(got, lo, hi, what):
        assert got.shape == (hi - lo, V)
        diff = (got - ref[lo:hi]).abs().max().item()
        assert diff <= TOL_FP32, f"{name} {what}: max |logit diff| {diff:.2e} > {TOL_FP32}"
    return check


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_prefill_decode_verify_truncate_match_transformers(pair):
    name, model, engine = pair
    engine.reset()
    seq = _tokens(20, 1)
    ref = oracle(model, seq)
    assert ref.abs().max() > 1.0, "logits too small for the comparison to mean anything"
    check = _checker(name, ref)
    check(engine.forward(seq[:9]), 0, 9, "prefill")
    for i in range(9, 12):
        check(engine.forward([seq[i]]), i, i + 1, f"decode at {i}")
    check(engine.forward(seq[12:16]), 12, 16, "verify 4")
    assert engine.position == 16

    engine.truncate(13)                                   # reject the last 3 verified tokens
    other = seq[:13] + _tokens(5, 2)
    check = _checker(name, oracle(model, other))
    check(engine.forward(other[13:17]), 13, 17, "verify after truncate")
    check(engine.forward([other[17]]), 17, 18, "decode after truncate")

    engine.reset()
    check(engine.forward(other[:4]), 0, 4, "prefill after reset")


def test_long_prefill_across_chunks_then_decode(pair):
    """A prefill of two blocks of the chunked rule (64 + 6 tokens), then recurrent decode steps."""
    name, model, engine = pair
    engine.reset()
    seq = _tokens(74, 3)
    got = torch.cat([engine.forward(seq[:70])] + [engine.forward([t]) for t in seq[70:]])
    _checker(name, oracle(model, seq))(got, 0, 74, "long prefill and decode")


@pytest.mark.parametrize("prompt", [70, 20], ids=["after-unlogged-prefill", "inside-the-window"])
def test_verify_rolls_back_to_every_accepted_prefix(pair, prompt):
    """Verify K=5 drafts (6 rows), keep each prefix 0..6 of them in turn, and go on from there: the
    DeltaNet states are those of that prefix exactly (checked by what the next tokens see)."""
    name, model, engine = pair
    engine.reset()
    seq = _tokens(prompt + 6, 4)
    engine.forward(seq[:prompt])
    for keep in range(0, 7):
        engine.truncate(prompt)                           # back to before the verify window
        _checker(name, oracle(model, seq))(engine.forward(seq[prompt:]), prompt, prompt + 6, "verify")
        engine.truncate(prompt + keep)
        assert engine.position == prompt + keep
        after = seq[:prompt + keep] + _tokens(3, 10 + keep)
        check = _checker(name, oracle(model, after))
        check(engine.forward(after[prompt + keep:prompt + keep + 2]), prompt + keep, prompt + keep + 2,
              f"verify of 2 after keeping {keep}")
        check(engine.forward([after[-1]]), prompt + keep + 2, prompt + keep + 3, f"decode after keeping {keep}")


def test_single_token_steps_roll_back_like_a_drafter(pair):
    """K single-token forwards (a draft model's steps), then back to each earlier position."""
    name, model, engine = pair
    seq = _tokens(18, 5)
    for keep in (17, 14, 12, 10):
        engine.reset()
        engine.forward(seq[:10])
        for t in seq[10:18]:
            engine.forward([t])
        engine.truncate(keep)
        after = seq[:keep] + _tokens(2, 20 + keep)
        _checker(name, oracle(model, after))(engine.forward(after[keep:]), keep, keep + 2, f"after truncate to {keep}")


def test_truncate_before_the_checkpoint_replays_the_kept_tokens(pair):
    name, model, engine = pair
    engine.reset()
    seq = _tokens(ROLLBACK_WINDOW + 30, 6)
    engine.forward(seq[:ROLLBACK_WINDOW + 20])              # unlogged: the checkpoint moves to its end
    for t in seq[ROLLBACK_WINDOW + 20:ROLLBACK_WINDOW + 23]:
        engine.forward([t])
    engine.truncate(37)
    assert engine.position == 37
    after = seq[:37] + _tokens(3, 7)
    _checker(name, oracle(model, after))(engine.forward(after[37:]), 37, 40, "after replay")


def test_window_stays_bounded_and_reaches_back_a_window_over_many_decode_steps(pair):
    """Decode steps well past the window: at most two segments, each of at most the window's tokens, and
    a truncate back by the window's length is a recompute (no replay) that matches."""
    name, model, engine = pair
    engine.reset()
    seq = _tokens(3 * ROLLBACK_WINDOW, 8)
    engine.forward(seq[:8])
    for t in seq[8:3 * ROLLBACK_WINDOW - 2]:
        engine.forward([t])
        state = engine.cache
        assert len(state.segments) <= 2 and state.length - state.segments[-1].base <= ROLLBACK_WINDOW
        assert state.length - state.base >= min(state.length, ROLLBACK_WINDOW)
    n = engine.position - ROLLBACK_WINDOW
    engine.tokens[:n] = [-1] * n                 # a replay would now fail: the truncate must not use one
    engine.truncate(n)
    after = seq[:n] + _tokens(2, 9)
    _checker(name, oracle(model, after))(engine.forward(after[n:]), n, n + 2, "a window back after a long decode")


def test_bad_truncate_and_image_placeholder_are_refused(tmp_path):
    """An image placeholder in the input is refused, and the decoders never sample it (runtime/engine.offered):
    a model that picked it (a random one does) would have its next forward refused mid-answer."""
    make_model("conditional", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["image_token_id"] = 100                         # inside the tiny vocabulary
    (tmp_path / "config.json").write_text(json.dumps(config))
    engine, _ = load(tmp_path, precision="float32")
    logits = engine.forward([1, 2, 3])
    assert 100 in engine.refused_tokens and bool(torch.isfinite(logits).all())
    assert bool((offered(engine, logits)[:, 100] == float("-inf")).all())   # refused as input: never sampled
    assert bool(torch.isfinite(logits).all())                              # the engine's own logits untouched
    with pytest.raises(EngineError) as e:
        engine.truncate(4)
    assert type(e.value) is EngineError and "holds 3" in e.value.message
    with pytest.raises(BadRequest) as e:
        engine.forward([5, 100])
    assert "image" in e.value.message
    assert engine.position == 3                            # nothing of the refused forward went in


def test_speculative_decoding_leaves_the_cache_of_a_fresh_prefill(tmp_path):
    """Greedy speculation with an int8 copy of the same model as drafter (both hybrid: the target's
    verify windows and the drafter's single steps both roll back): every emitted token is the target's
    own greedy choice, and the cache after the rejections gives a fresh prefill's logits."""
    from runtime import sampling
    from runtime.options import DraftOptions, SamplingOptions
    from runtime.speculative import make_decoder
    make_model("conditional", tmp_path)
    target, _ = load(tmp_path, precision="float32")
    draft, _ = load(tmp_path, precision="int8")
    greedy = SamplingOptions(temperature=0.0)
    prompt = _tokens(12, 11)
    tokens = prompt + [sampling.sample(target.forward(prompt)[-1], prompt, greedy)]
    dec = make_decoder(target, DraftOptions(mode="model", draft_tokens=5, adaptive=False), greedy, draft_engine=draft)
    while len(tokens) - len(prompt) < 40:
        tokens += dec.step(tokens)
        assert target.position == len(tokens) - 1
    hist = dec.stats().acceptance_histogram
    assert sum(hist[:-1]) > 0 and dec.stats().accepted_tokens > 0, f"expected rejections and acceptances: {hist}"
    after_rollbacks = target.forward(tokens[-1:])[0]
    target.reset()
    fresh = target.forward(tokens)                                           # [T, V]
    assert (after_rollbacks - fresh[-1]).abs().max() <= TOL_FP32
    for i in range(len(prompt), len(tokens)):                                # each token the greedy choice
        row = fresh[i - 1]
        assert row[tokens[i]] >= row.max() - 1e-3, f"token {i} is not the target's greedy choice"


@pytest.mark.parametrize("t, chunk", [(1, 4), (7, 4), (64, 16), (150, 64)])
def test_chunked_delta_rule_equals_the_recurrent_one(t, chunk):
    """The prefill form against the token loop, from a nonzero state, with strong and weak decays and
    blocks that do not divide the sequence; the state passed in is left as it was."""
    from runtime.reference import deltanet
    g = torch.Generator().manual_seed(t)
    h, dk, dv = 3, 8, 5
    q = deltanet.l2norm(torch.randn(t, h, dk, generator=g)) * dk ** -0.5
    k = deltanet.l2norm(torch.randn(t, h, dk, generator=g))
    v = torch.randn(t, h, dv, generator=g)
    decay = -torch.rand(t, h, generator=g) * torch.tensor([0.01, 1.0, 8.0])
    beta = torch.rand(t, h, generator=g)
    state = torch.randn(h, dk, dv, generator=g)
    kept = state.clone()
    o1, s1 = deltanet.recurrent(q, k, v, decay, beta, state)
    o2, s2 = deltanet.chunked(q, k, v, decay, beta, state, chunk=chunk)
    assert (o1 - o2).abs().max() < 1e-5 and (s1 - s2).abs().max() < 1e-5
    assert torch.equal(state, kept)
