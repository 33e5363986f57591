"""Qwen3.5-MoE's multi-token-prediction head as a speculative draft on the CPU reference engine.

transformers drops the `mtp.*` tensors on load, so the head's oracle here is written from its published
description out of transformers' own Qwen3.5-MoE modules (its (1 + weight) RMS norm, a full-attention
decoder layer with the MoE, the rotary embedding) on a tiny random checkpoint made by transformers, with
a random head added to the folder. Speculation is then checked to stay exact whatever the head predicts:
greedy output equal to plain decoding (a random head: rejections; an "echo" head that predicts the token
just chosen: acceptances), the target's cache after rejections equal to a fresh prefill's, and sampled
output distributed as plain sampling (Pearson's chi-square, as tests/test_speculative_toy.py does for the
other drafts, the exact distribution enumerated over the top-k support).
"""
from __future__ import annotations

import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from runtime import sampling  # noqa: E402
from runtime.engine import offered  # noqa: E402
from runtime.options import DraftOptions, SamplingOptions  # noqa: E402
from runtime.reference import load  # noqa: E402
from runtime.speculative import make_decoder  # noqa: E402
from tests.test_qwen35_parity import TOL_FP32, _tokens, make_model, oracle  # noqa: E402
from tests.test_speculative_toy import SAMPLED, chi_square  # noqa: E402

MOD = "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe"


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny matrices: one thread is ~100x quicker than a team on a busy machine."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def load_engine(folder):
    engine, _ = load(folder, precision="float32")        # (sets the thread count)
    torch.set_num_threads(1)
    return engine
GREEDY = SamplingOptions(temperature=0.0)


def add_mtp(folder, model, seed: int = 1, echo: str = "") -> dict:
    """Write a random MTP head into the folder (the released layout: stacked experts). `echo` "hidden": a
    head whose output is the model's own normalised hidden state (fc passes the hidden half through, the
    layer adds nothing), so it predicts again the token the model just predicted; "embedding": fc passes the
    next token's embedding through, so the head is the bigram model lm_head(rms(embed(t)))."""
    from safetensors.torch import load_file, save_file
    mod = __import__(MOD, fromlist=["x"])
    text = model.config.text_config
    full = text.layer_types.index("full_attention")
    torch.manual_seed(seed)
    layer = mod.Qwen3_5MoeDecoderLayer(text, layer_idx=full).eval()
    h = text.hidden_size
    head = {f"layers.0.{k}": v.clone() for k, v in layer.state_dict().items()}
    for k, v in head.items():
        head[k] = 0.2 * torch.randn_like(v) if v.dim() == 1 else torch.randn_like(v) * 1.5 / v.shape[-1] ** 0.5
    head.update({f"{n}.weight": 0.2 * torch.randn(h) for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")})
    head["fc.weight"] = torch.randn(h, 2 * h) * 1.5 / (2 * h) ** 0.5
    if echo:
        pass_through = [torch.zeros(h, h), torch.eye(h)]
        head["fc.weight"] = torch.cat(pass_through if echo == "hidden" else pass_through[::-1], dim=1)
        for k in ("layers.0.self_attn.o_proj.weight", "layers.0.mlp.experts.down_proj",
                  "layers.0.mlp.shared_expert.down_proj.weight"):
            head[k] = torch.zeros_like(head[k])
        for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            head[f"{n}.weight"] = torch.zeros(h)
    tensors = load_file(str(folder / "model.safetensors"))
    tensors.update({f"mtp.{k}": v.contiguous() for k, v in head.items()})
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return head


def head_oracle(model, head: dict, hidden: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    """The head over rows i = 0..T-1 of (hidden[i], tokens[i]) at positions 0..T-1, causal: logits [T, V]."""
    mod = __import__(MOD, fromlist=["x"])
    text = model.config.text_config
    lm = model.model.language_model
    layer = mod.Qwen3_5MoeDecoderLayer(text, layer_idx=text.layer_types.index("full_attention")).eval()
    layer.load_state_dict({k[len("layers.0."):]: v for k, v in head.items() if k.startswith("layers.0.")})

    def norm(name, x):
        n = mod.Qwen3_5MoeRMSNorm(text.hidden_size, eps=text.rms_norm_eps)
        n.weight.data = head[f"{name}.weight"]
        return n(x)
    with torch.no_grad():
        e = norm("pre_fc_norm_embedding", lm.embed_tokens(torch.tensor([tokens])))
        x = torch.nn.functional.linear(torch.cat([e, norm("pre_fc_norm_hidden", hidden[None])], -1), head["fc.weight"])
        t = len(tokens)
        pos = torch.arange(t).view(1, 1, -1).expand(3, 1, -1)
        pe = mod.Qwen3_5MoeTextRotaryEmbedding(config=text)(x, pos)
        mask = torch.ones(t, t, dtype=torch.bool).tril()[None, None]
        x = layer(x, position_embeddings=pe, attention_mask=mask, position_ids=torch.arange(t)[None])
        return model.lm_head(norm("norm", x))[0].float()


def final_hidden(model, tokens: list[int]) -> torch.Tensor:
    """The model's hidden states after its final norm (what lm_head reads): [T, H]."""
    with torch.no_grad():
        return model.model.language_model(input_ids=torch.tensor([tokens]), use_cache=False).last_hidden_state[0]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mtp")
    model = make_model("conditional", folder)
    head = add_mtp(folder, model)
    return folder, model, head


def test_head_loads_and_its_drafts_match_the_oracle(built):
    """Each first draft reads slot n-1 = (h_{n-1}, t_n) over slots the forwards filled from the model's own
    hidden states; the second chains the head's output. Both against the oracle, in float32."""
    folder, model, head = built
    engine = load_engine(folder)
    assert engine.has_mtp
    engine.mtp_enable()
    seq = _tokens(14, 1)
    hidden = final_hidden(model, seq)
    want = head_oracle(model, head, hidden[:-1], seq[1:])               # slot i -> logits for t_{i+2}
    engine.forward(seq[:6])                                              # a prefill, then single steps
    for n in range(6, 13):
        rows: list[torch.Tensor] = []

        def choose(row):
            rows.append(row.clone())
            return int(row.argmax())
        drafts = engine.mtp_draft(seq[:n + 1], 2, choose)
        assert len(drafts) == 2 and drafts[0] == int(want[n - 1].argmax())
        assert (rows[0] - want[n - 1]).abs().max() <= TOL_FP32
        # the chained draft: slot n holds (m_{n-1}, d_1), m the head's own output for slot n-1
        chain_h = torch.cat([hidden[:n], _head_out(model, head, hidden[:n], seq[1:n + 1])[None]])
        chained = head_oracle(model, head, chain_h, seq[1:n + 1] + [drafts[0]])[-1]
        assert (rows[1] - chained).abs().max() <= TOL_FP32
        engine.forward([seq[n]])
    assert engine.position == 13


def _head_out(model, head, hidden, tokens):
    """The head's normalised output m for the last row (what the next draft reads as its hidden state)."""
    captured = {}
    handle = model.lm_head.register_forward_pre_hook(lambda _m, args: captured.setdefault("x", args[0]))
    try:
        head_oracle(model, head, hidden, tokens)
    finally:
        handle.remove()
    return captured["x"][0, -1]


def _greedy(engine, prompt, n, draft: DraftOptions | None):
    engine.reset()
    dec = make_decoder(engine, draft, GREEDY) if draft is not None else None
    tokens = prompt + [sampling.sample(offered(engine, engine.forward(prompt))[-1], prompt, GREEDY)]
    while len(tokens) - len(prompt) < n:
        if dec is None:                                # as the plain decoder samples (runtime/generate.py)
            tokens.append(sampling.sample(offered(engine, engine.forward(tokens[-1:]))[0], tokens, GREEDY))
        else:
            tokens += dec.step(tokens)
            assert engine.position == len(tokens) - 1
    return tokens[:len(prompt) + n], dec


@pytest.mark.parametrize("echo", ["", "hidden"], ids=["random-head", "echo-head"])
def test_greedy_mtp_speculation_equals_plain_decoding(tmp_path, echo):
    model = make_model("conditional", tmp_path)
    add_mtp(tmp_path, model, echo=echo)
    engine = load_engine(tmp_path)
    for prompt, k in ((_tokens(9, 2), 3), (_tokens(5, 3), 5)):
        want, _ = _greedy(engine, prompt, 40, None)
        got, dec = _greedy(engine, prompt, 40, DraftOptions(mode="mtp", draft_tokens=k, adaptive=False))
        assert got == want
        s = dec.stats()
        assert s.mode == "mtp" and s.drafted_tokens > 0
        if echo:                        # drafts repeat the last token: kept exactly where the model repeats it
            repeats = sum(a == b for a, b in zip(want[len(prompt):], want[len(prompt) + 1:]))
            assert s.accepted_tokens > 0 and repeats > 0
        # the cache after every rejection gives a fresh prefill's logits
        after = engine.forward(got[-1:])[0]
        assert (after - oracle(model, got)[-1]).abs().max() <= TOL_FP32


def test_head_switched_on_mid_conversation_catches_up(built):
    """The head off during the prefill (another draft mode before), on for the next step: its slots are
    rebuilt over the conversation and its draft is the oracle's."""
    folder, model, head = built
    engine = load_engine(folder)
    seq = _tokens(11, 4)
    engine.forward(seq[:10])
    rows = []
    engine.mtp_draft(seq, 1, lambda row: rows.append(row) or int(row.argmax()))
    want = head_oracle(model, head, final_hidden(model, seq)[:-1], seq[1:])
    assert (rows[0] - want[9]).abs().max() <= TOL_FP32 and engine.position == 10


def test_mtp_mode_needs_a_head(tmp_path):
    from runtime.generate import make_decoder as generate_decoder
    from runtime.errors import BadRequest
    make_model("conditional", tmp_path)
    engine = load_engine(tmp_path)
    assert not engine.has_mtp
    with pytest.raises(BadRequest) as e:
        generate_decoder(engine, GREEDY, None, DraftOptions(mode="mtp"))
    assert "no multi-token-prediction head" in e.value.message


def test_a_misshapen_head_is_named(tmp_path):
    from safetensors.torch import load_file, save_file
    from runtime.errors import ModelFolderError
    model = make_model("conditional", tmp_path)
    add_mtp(tmp_path, model)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["mtp.fc.weight"] = torch.zeros(64, 96)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelFolderError) as e:
        load_engine(tmp_path)
    assert "'mtp.fc.weight' has shape [64, 96], the config implies [64, 128]" in e.value.message


# --- sampling: the distribution of plain sampling ------------------------------------------------

PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]
N_TOKENS = 3
N_RUNS = 2000


def exact_distribution(engine, opts, prompt, n) -> dict[tuple[int, ...], float]:
    """P(first n sampled tokens) by enumeration over each step's support (top-k keeps it small)."""
    out: dict[tuple[int, ...], float] = {}

    def walk(tokens, prob, depth):
        if depth == n:
            out[tuple(tokens[len(prompt):])] = prob
            return
        engine.reset()
        p = sampling.probabilities(engine.forward(tokens)[-1], tokens, opts)
        for t in (p > 0).nonzero().flatten().tolist():
            walk(tokens + [t], prob * p[t].item(), depth + 1)
    walk(list(prompt), 1.0, 0)
    return out


def near_bigram(folder) -> None:
    """Damp every layer's output (and zero the final norm's weight): the model's prediction then depends
    mostly on the last token, which the "embedding" echo head predicts well (drafts get kept)."""
    from safetensors.torch import load_file, save_file
    tensors = load_file(str(folder / "model.safetensors"))
    for name, t in tensors.items():
        if name.startswith("model.language_model.") and name.endswith(("o_proj.weight", "out_proj.weight",
                                                                       "down_proj.weight", "experts.down_proj")):
            tensors[name] = t * 0.01
    tensors["model.language_model.norm.weight"] = torch.zeros_like(tensors["model.language_model.norm.weight"])
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def test_sampled_mtp_speculation_matches_plain_distribution(tmp_path):
    model = make_model("conditional", tmp_path)
    add_mtp(tmp_path, model, echo="embedding")
    near_bigram(tmp_path)
    engine = load_engine(tmp_path)
    expected = exact_distribution(engine, SAMPLED, PROMPT, N_TOKENS)
    assert math.isclose(sum(expected.values()), 1.0, rel_tol=1e-4)
    counts: dict[tuple, int] = {}
    drafted = accepted = 0
    engine.reset()
    dec0 = make_decoder(engine, DraftOptions(mode="mtp", draft_tokens=3, adaptive=False), SAMPLED)
    del dec0                                              # the head is on from here, as for a request
    engine.forward(PROMPT[:-1])
    for seed in range(N_RUNS):
        engine.truncate(len(PROMPT) - 1)                  # the prompt's cache, reused (a rollback)
        dec = make_decoder(engine, DraftOptions(mode="mtp", draft_tokens=3, adaptive=False), SAMPLED,
                           torch.Generator().manual_seed(seed))
        tokens = list(PROMPT)
        while len(tokens) - len(PROMPT) < N_TOKENS:
            tokens += dec.step(tokens)
        counts[tuple(tokens[len(PROMPT):len(PROMPT) + N_TOKENS])] = counts.get(
            tuple(tokens[len(PROMPT):len(PROMPT) + N_TOKENS]), 0) + 1
        drafted, accepted = drafted + dec.stats().drafted_tokens, accepted + dec.stats().accepted_tokens
    stat, critical = chi_square(counts, expected, N_RUNS)
    assert stat < critical, f"chi-square {stat:.1f} >= {critical:.1f}: MTP speculative sampling is biased"
    assert accepted > 0.3 * drafted, f"too few drafts kept ({accepted}/{drafted}) for the test to see the rule"




def test_synthetic_folder_has_a_quantized_head_that_drafts(tmp_path):
    """The synth writer's tiny-qwen3.5 carries the head (EXL2, experts per expert); it loads and its
    greedy speculation equals plain decoding."""
    from runtime.exl2 import synth
    from runtime.modelfolder import validate
    synth.write_synthetic("tiny-qwen3.5", 4.0, tmp_path / "m", seed=3)
    info = validate(tmp_path / "m")
    assert info.num_params == synth.param_counts(synth.get_shape("tiny-qwen3.5"))[0]   # the head is not counted
    engine = load_engine(tmp_path / "m")
    assert engine.has_mtp and engine.weights.mtp.fc.weight.shape == (256, 512)
    prompt = _tokens(7, 5)
    want, _ = _greedy(engine, prompt, 24, None)
    got, dec = _greedy(engine, prompt, 24, DraftOptions(mode="mtp", draft_tokens=4, adaptive=True))
    assert got == want and dec.stats().mode == "mtp"
