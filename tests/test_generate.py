"""The generation loop against a scripted engine: stop conditions, cancel, prefill chunks, cache reuse."""
from __future__ import annotations

import pytest
import torch

from runtime.engine import Engine, ModelInfo
from runtime.errors import ContextOverflow, EngineError
from runtime.generate import PlainDecoder, generate
from runtime.options import SamplingOptions
from runtime.tokenizer import REPLACEMENT, Tokenizer
from test_tokenizer import _byte_level_tokenizer, _folder

GREEDY = SamplingOptions(temperature=0.0, max_tokens=1000)
ANSWER = "Hello, wörld! 日本🙂 STOP and a tail that must not appear."


class ScriptedEngine(Engine):
    """Test double: at absolute position i (i >= prompt_len - 1) predicts script[i - prompt_len + 1]."""

    backend = "cpu"

    def __init__(self, script: list[int], prompt_len: int, vocab: int, context: int = 4096):
        self.info = ModelInfo("scripted", "-", "LlamaForCausalLM", vocab, context, 1)
        self.script, self.prompt_len, self.vocab = script, prompt_len, vocab
        self.cache: list[int] = []
        self.calls: list[int] = []          # tokens per forward call
        self.truncations: list[int] = []

    def forward(self, tokens):
        assert len(self.cache) + len(tokens) <= self.info.context_length, "cache overrun"
        start = len(self.cache)
        self.cache.extend(tokens)
        self.calls.append(len(tokens))
        logits = torch.full((len(tokens), self.vocab), -10.0)                # [T, V]
        for row in range(len(tokens)):
            k = start + row - self.prompt_len + 1
            logits[row, self.script[min(max(k, 0), len(self.script) - 1)]] = 10.0
        return logits

    def truncate(self, length):
        self.truncations.append(length)
        del self.cache[length:]

    @property
    def position(self):
        return len(self.cache)


class MultiTokenDecoder:
    """Stands in for a speculative decoder: returns up to 3 tokens per step, honouring the cache contract."""

    def __init__(self, engine, opts):
        self.engine, self.opts, self.steps = engine, opts, 0

    def step(self, tokens, max_new=None):
        self.steps += 1
        new = []
        for _ in range(min(3, max_new or 3)):
            logits = self.engine.forward((tokens + new)[-1:])
            new.append(int(torch.argmax(logits[-1])))
        self.engine.truncate(len(tokens) + len(new) - 1)
        return new

    def stats(self):
        return None


@pytest.fixture
def tok(tmp_path) -> Tokenizer:
    return Tokenizer.from_folder(_folder(tmp_path, _byte_level_tokenizer(), {"eos_token": "<|end|>"}))


def _setup(tok, answer=ANSWER, prompt_text="Q: say it\nA:", context=4096):
    prompt = tok.encode(prompt_text)
    eos = tok._tok.token_to_id("<|end|>")
    script = tok.encode(answer) + [eos]
    return ScriptedEngine(script, len(prompt), tok.vocab_size, context), prompt, script


def _run(engine, tok, prompt, opts=GREEDY, **kw):
    deltas = []
    res = generate(engine, tok, prompt, opts, on_text=lambda t, n: deltas.append((t, n)), **kw)
    return res, deltas


def test_generates_until_eos_with_stats(tok):
    engine, prompt, script = _setup(tok)
    res, deltas = _run(engine, tok, prompt)
    assert res.reason == "eos"
    assert res.text == ANSWER == "".join(t for t, _ in deltas)
    assert res.tokens == script
    assert sum(n for _, n in deltas) == len(script) - 1        # every token but the end token is in a delta
    assert all(REPLACEMENT not in t for t, _ in deltas)
    s = res.stats
    assert (s.prompt_tokens, s.generated_tokens) == (len(prompt), len(script))
    assert s.ttft_s > 0 and s.prefill_tps > 0 and s.decode_tps > 0 and s.total_s >= s.ttft_s
    # Cache contract: everything but the last token.
    assert engine.cache == prompt + script[:-1] == res.cache_tokens


def test_every_token_is_reported_as_it_comes_even_while_its_text_is_held_back(tok):
    """A run of tokens whose text stays incomplete (a synthetic model's random bytes: the whole answer held
    back until its end) still reaches the client one delta per token, so its arrival times measure
    decoding: the worker benchmark had no decode figure for such an answer and its first token late."""
    engine, prompt, script = _setup(tok, answer="日本語🙂")
    res, deltas = _run(engine, tok, prompt)
    assert res.text == "日本語🙂" == "".join(t for t, _ in deltas)
    assert [n for _, n in deltas] == [1] * (len(script) - 1)       # one delta per token but the end token
    assert any(t == "" for t, _ in deltas) and all(REPLACEMENT not in t for t, _ in deltas)


def test_stop_string_ends_answer_and_is_never_emitted(tok):
    engine, prompt, _ = _setup(tok)
    res, deltas = _run(engine, tok, prompt, SamplingOptions(temperature=0.0, stop=("STOP",)))
    assert res.reason == "stop_string"
    assert res.text == "Hello, wörld! 日本🙂 "
    assert "S" not in "".join(t for t, _ in deltas)


def test_max_tokens(tok):
    engine, prompt, script = _setup(tok)
    res, _ = _run(engine, tok, prompt, SamplingOptions(temperature=0.0, max_tokens=5))
    assert res.reason == "length" and res.tokens == script[:5]
    assert res.text == tok.decode(script[:5]).rstrip(REPLACEMENT)


def test_context_full_and_overflow(tok):
    engine, prompt, script = _setup(tok, context=0)
    engine.info.context_length = len(prompt) + 4
    res, _ = _run(engine, tok, prompt)
    assert res.reason == "length" and len(res.tokens) == 4 and len(engine.cache) <= engine.info.context_length
    engine2, prompt2, _ = _setup(tok)
    engine2.info.context_length = len(prompt2)
    with pytest.raises(EngineError) as e:
        _run(engine2, tok, prompt2)
    assert isinstance(e.value, ContextOverflow)


def test_cancel_takes_effect_within_one_step(tok):
    engine, prompt, _ = _setup(tok, answer="x" * 500)
    steps = []

    def on_step(live):
        steps.append(live.generated_tokens)

    cancel_after = 10
    res = generate(engine, tok, prompt, GREEDY, on_step=on_step,
                   should_stop=lambda: bool(steps) and steps[-1] >= cancel_after)
    assert res.reason == "cancelled"
    assert len(res.tokens) == cancel_after
    assert len(engine.calls) == 1 + (cancel_after - 1)          # prefill + one forward per further token


def test_cancel_during_prefill(tok):
    engine, prompt, _ = _setup(tok, prompt_text="long prompt " * 50)
    calls = []
    res = generate(engine, tok, prompt, GREEDY, prefill_chunk=16, on_step=lambda live: calls.append(1),
                   should_stop=lambda: len(calls) >= 2)
    assert res.reason == "cancelled" and res.tokens == [] and res.stats.generated_tokens == 0
    assert engine.calls == [16, 16] and res.cache_tokens == prompt[:32]


def test_prefill_is_chunked(tok):
    engine, prompt, _ = _setup(tok, prompt_text="abc " * 100)
    _run(engine, tok, prompt, SamplingOptions(temperature=0.0, max_tokens=2), prefill_chunk=64)
    n = len(prompt)
    assert engine.calls[: (n + 63) // 64] == [64] * (n // 64) + ([n % 64] if n % 64 else [])


def test_next_turn_reuses_the_cache(tok):
    engine, prompt, script = _setup(tok)
    first, _ = _run(engine, tok, prompt)
    follow = prompt + first.tokens + tok.encode(" more")
    engine.prompt_len = len(follow)
    engine.calls.clear()
    second, _ = _run(engine, tok, follow, cached=first.cache_tokens)
    assert engine.calls[0] == len(follow) - len(first.cache_tokens)   # only the new tokens are prefilled
    assert second.text == ANSWER


@pytest.mark.parametrize("make_prompt", [lambda p: p[:3] + [50, 51, 52],     # diverges early
                                         lambda p: p,                        # the same prompt again
                                         lambda p: p[:-2]])                  # a prefix of the cache
def test_other_prompts_are_prefilled_from_scratch(tok, make_prompt):
    engine, prompt, _ = _setup(tok)
    first, _ = _run(engine, tok, prompt, SamplingOptions(temperature=0.0, max_tokens=3))
    other = make_prompt(prompt)
    engine.prompt_len = len(other)
    engine.calls.clear()
    _run(engine, tok, other, SamplingOptions(temperature=0.0, max_tokens=3), cached=first.cache_tokens)
    assert engine.truncations[-1] == 0 and engine.calls[0] == len(other)


def test_multi_token_decoder_gives_same_text_and_keeps_cache_contract(tok):
    engine, prompt, script = _setup(tok)
    plain, _ = _run(engine, tok, prompt)
    engine2, _, _ = _setup(tok)
    res, _ = _run(engine2, tok, prompt, decoder=MultiTokenDecoder(engine2, GREEDY))
    assert res.text == plain.text and res.reason == "eos"
    # Stopped mid-step: the cache holds the sequence including the extra tokens but the last.
    assert engine2.cache == res.cache_tokens
    assert res.cache_tokens[: len(prompt) + len(script) - 1] == prompt + script[:-1]


def test_ignore_eos_runs_to_max_tokens(tok):
    engine, prompt, script = _setup(tok)
    res, _ = _run(engine, tok, prompt, SamplingOptions(temperature=0.0, max_tokens=len(script) + 7), ignore_eos=True)
    assert res.reason == "length" and len(res.tokens) == len(script) + 7


def test_sampling_with_seed_is_reproducible(tok):
    engine, prompt, _ = _setup(tok)
    opts = SamplingOptions(temperature=1.0, top_k=0, top_p=1.0, max_tokens=3, seed=123)
    a, _ = _run(engine, tok, prompt, opts)
    engine.truncate(0)
    b, _ = _run(engine, tok, prompt, opts)
    assert a.tokens == b.tokens


def test_empty_prompt_is_refused(tok):
    engine, _, _ = _setup(tok)
    with pytest.raises(EngineError, match="empty"):
        generate(engine, tok, [], GREEDY)


def test_plain_decoder_contract(tok):
    engine, prompt, script = _setup(tok)
    engine.forward(prompt)
    tokens = prompt + [script[0]]
    new = PlainDecoder(engine, GREEDY, None).step(tokens)
    assert new == [script[1]] and engine.cache == tokens + new[:-1]


def test_a_token_the_engine_refuses_as_input_is_never_sampled_nor_drawn():
    """An engine that refuses some ids as input (Qwen3.5's image and video placeholders): the decoders
    sample around them even where the model puts them first, its own logits stay as they were, and the
    random streams trials and benchmarks feed it never hold them."""
    from runtime.engine import offered, random_tokens
    engine = ScriptedEngine([7, 7, 7], prompt_len=2, vocab=16)
    engine.refused_tokens = (7, 3)
    logits = engine.forward([1, 2])
    assert int(logits[-1].argmax()) == 7 and int(offered(engine, logits)[-1].argmax()) != 7
    assert bool(torch.isfinite(logits).all())                                   # not changed in place
    tok = PlainDecoder(engine, GREEDY, None).step([1, 2, 5])[0]
    assert tok not in (7, 3)
    drawn = random_tokens(engine, 4000, torch.Generator().manual_seed(0))
    assert set(drawn) == set(range(16)) - {3, 7}                                # every other id, uniformly
    assert max(drawn.count(t) for t in set(drawn)) < 2 * min(drawn.count(t) for t in set(drawn))
    plain = ScriptedEngine([7], prompt_len=1, vocab=16)
    assert offered(plain, logits) is logits
    assert random_tokens(plain, 5, torch.Generator().manual_seed(1)) == \
        torch.randint(0, 16, (5,), generator=torch.Generator().manual_seed(1)).tolist()
