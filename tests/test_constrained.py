"""Constrained sampling (runtime/constrained.py): the grammar holds for every token, with plain and speculative
decoding alike, and speculation under a grammar stays exact; penalties, logit bias and logprobs.

The toy model is tests/test_speculative_toy.py's Markov engine (6 tokens) with a 6-token vocabulary for
llguidance: a, b, c, d, ab and an end-of-sequence token. The grammar `[ab]*c` refuses d everywhere and
ends the answer after c, so unmasked sampling would break it at once. The statistical test is the toy
test's chi-square against the exact distribution, here of plain sampling under the grammar's masks.
"""
from __future__ import annotations

import itertools
import re

import pytest
import torch

from runtime import protocol as P
from runtime import sampling
from runtime.constrained import Constraint, Steering, steering_for
from runtime.errors import BadRequest
from runtime.options import DraftOptions, SamplingOptions
from runtime.sampling import choose
from runtime.speculative import core, make_decoder
from tests.test_speculative_toy import MarkovEngine, chi_square, start

TOKENS = [b"a", b"b", b"c", b"d", b"ab", b"<eos>"]
EOS = 5
GRAMMAR = "start: /[ab]*c/\n"
SAMPLED = SamplingOptions(temperature=0.9, top_k=5, top_p=0.95, repetition_penalty=1.1)
GREEDY = SamplingOptions(temperature=0.0)


class ToyTokenizer:
    """What llguidance's TokenizerWrapper reads: each token's bytes and the end-of-sequence id."""
    tokens = TOKENS
    eos_token_id = EOS
    bos_token_id = None
    special_token_ids = [EOS]

    def __call__(self, text):
        return [TOKENS.index(bytes([b])) for b in text]


def toy_constraint() -> Constraint:
    from llguidance import LLMatcher, LLTokenizer, TokenizerWrapper
    gtok = LLTokenizer(TokenizerWrapper(ToyTokenizer()))
    return Constraint(LLMatcher(gtok, LLMatcher.grammar_from_lark(GRAMMAR), log_level=0), len(TOKENS))


def text_of(tokens) -> str:
    return b"".join(TOKENS[t] for t in tokens if t != EOS).decode()


def generate(target, opts, prompt, seed, draft=None, drafter=None, limit=12):
    """Tokens until end-of-sequence (or `limit`), every one through the grammar."""
    steer = Steering(toy_constraint())
    gen = torch.Generator().manual_seed(seed)
    start(target, prompt)
    tokens = list(prompt)
    dec = make_decoder(target, draft, opts, gen, draft_engine=drafter, steer=steer) if draft else None
    while len(tokens) - len(prompt) < limit and tokens[-1] != EOS:
        if dec is None:
            tokens.append(choose(target.forward(tokens[-1:])[0], tokens, opts, gen, steer))
        else:
            tokens += dec.step(tokens)
    out = tokens[len(prompt):]
    return out[:out.index(EOS) + 1] if EOS in out else out


@pytest.mark.parametrize("mode", ["off", "ngram", "model"])
@pytest.mark.parametrize("opts", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_every_answer_follows_the_grammar(mode, opts):
    target = MarkovEngine(0)
    drafter = MarkovEngine(1, base=target, noise=0.8) if mode == "model" else None
    draft = DraftOptions(mode=mode, draft_tokens=3, adaptive=False) if mode != "off" else None
    for seed in range(40):
        out = generate(target, opts, [3, 3, 2, 3, 3], seed, draft, drafter, limit=40)
        assert out[-1] == EOS and re.fullmatch(r"[ab]*c", text_of(out)), (seed, out)


def test_without_the_grammar_the_toy_model_breaks_it():
    """The test above can fail: plain sampling from the same model writes d's."""
    target = MarkovEngine(0)
    gen = torch.Generator().manual_seed(0)
    start(target, [3, 3])
    tokens = [3, 3]
    for _ in range(30):
        tokens.append(sampling.sample(target.forward(tokens[-1:])[0], tokens, SAMPLED, gen))
    assert 3 in tokens[2:]


def masked_distribution(target, opts, prompt, n) -> dict:
    """P(first n tokens) of plain sampling under the grammar, by enumeration."""
    out = {}
    for seq in itertools.product(range(len(TOKENS)), repeat=n):
        c, tokens, prob = toy_constraint(), list(prompt), 1.0
        for t in seq:
            prev = tokens[-2] if len(tokens) > 1 else 0
            if tokens[-1] == EOS and len(tokens) > len(prompt):
                break                                   # the answer ended: nothing after end-of-sequence
            row = c.mask(target.table[prev, tokens[-1]])
            prob *= sampling.probabilities(row, tokens, opts)[t].item()
            if prob == 0:
                break
            c.advance(t)
            tokens.append(t)
        if prob > 0 and len(tokens) - len(prompt) == n:
            out[seq] = prob
    return out


@pytest.mark.parametrize("mode", ["model", "ngram"])
def test_speculation_under_a_grammar_samples_the_constrained_distribution(mode):
    target = MarkovEngine(0)
    drafter = MarkovEngine(1, base=target, noise=0.8) if mode == "model" else None
    draft = DraftOptions(mode=mode, draft_tokens=3, adaptive=False)
    prompt, runs = [0, 1, 0, 1, 0, 1, 0], 2000
    counts: dict = {}
    for seed in range(runs):
        seq = tuple(generate(target, SAMPLED, prompt, seed, draft, drafter, limit=3)[:3])
        if len(seq) == 3:
            counts[seq] = counts.get(seq, 0) + 1
    expected = masked_distribution(target, SAMPLED, prompt, 3)
    total = sum(counts.values())
    expected = {s: p / sum(expected.values()) for s, p in expected.items()}      # answers of 3+ tokens
    stat, critical = chi_square(counts, expected, total)
    assert stat < critical, f"chi-square {stat:.1f} >= {critical:.1f}: constrained speculation is biased"


def test_drafts_the_grammar_refuses_are_cut_before_the_verify():
    class Lookup:
        mode = "ngram"

        def propose(self, tokens, k):
            return core.Proposal([0, 3, 1][:k])          # a, then d (refused), then b

        def rollback(self, length):
            pass
    target = MarkovEngine(2)
    start(target, [0, 1])
    steer = Steering(toy_constraint())
    result = core.speculative_step(target, Lookup(), [0, 1], 3, GREEDY, torch.Generator(), steer)
    assert result.rows <= 2 and 3 not in result.new          # one draft verified at most, d never taken
    assert re.fullmatch(r"[ab]*c?", text_of(result.new))


def test_greedy_speculation_under_a_grammar_equals_plain():
    target = MarkovEngine(3)
    drafter = MarkovEngine(4, base=target, noise=0.5)
    for prompt in ([0, 1], [1, 1, 0, 1, 1, 0]):
        want = generate(target, GREEDY, prompt, 0, limit=40)
        for mode in ("model", "ngram"):
            got = generate(target, GREEDY, prompt, 0, DraftOptions(mode=mode, draft_tokens=4, adaptive=False),
                           drafter if mode == "model" else None, limit=40)
            assert got == want, mode


# --- penalties, bias, logprobs ----------------------------------------------------------------------

def test_penalties_bias_and_logprobs():
    raw = torch.tensor([1.0, 2.0, 3.0, 0.5])
    steer = Steering(presence=0.5, frequency=0.25, bias={0: 10.0}, prompt_len=2, top_logprobs=2)
    history = [2, 2, 1, 1, 3]                                     # the answer: 1, 1, 3 (the prompt's 2s don't count)
    row = steer.row(raw, history)
    assert row.tolist() == pytest.approx([11.0, 2.0 - 0.5 - 0.5, 3.0, 0.5 - 0.5 - 0.25])
    assert raw.tolist() == [1.0, 2.0, 3.0, 0.5]                  # the engine's row is left alone
    steer.took(raw, 1)
    lp = torch.log_softmax(raw, 0)
    token, value, top = steer.records[0]
    assert token == 1 and value == pytest.approx(lp[1].item())
    assert [t for t, _ in top] == [2, 1] and top[0][1] == pytest.approx(lp[2].item())


def test_a_bias_of_minus_100_bans_a_token_under_sampling():
    target = MarkovEngine(0)
    steer = Steering(bias={t: -100.0 for t in (0, 1)})
    gen = torch.Generator().manual_seed(0)
    start(target, [2, 2])
    tokens = [2, 2]
    for _ in range(50):
        tokens.append(choose(target.forward(tokens[-1:])[0], tokens, SAMPLED, gen, steer))
    assert not {0, 1} & set(tokens[2:])


# --- requests: schemas, prefixes, refusals (the demo model's tokenizer) ---------------------------------

@pytest.fixture(scope="module")
def demo_tokenizer(demo_model):
    from runtime.tokenizer import Tokenizer
    return Tokenizer.from_folder(demo_model)


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}


def test_a_request_continues_its_grammar_from_the_answer_so_far(demo_tokenizer):
    tok = demo_tokenizer
    begun = tok.encode('{"a": ')
    prompt = tok.encode("Q") + begun
    steer = steering_for(P.Generate("r", json_schema=SCHEMA), tok, tok.vocab_size, prompt, len(begun), "generic")
    allowed = steer.constraint.allowed(torch.device("cpu"))
    assert allowed[tok.encode("7")[0]] and not allowed[tok.encode('"')[0]]     # a number comes next
    assert steer.prompt_len == len(prompt) - len(begun)                        # penalties count the prefix
    with pytest.raises(BadRequest, match="does not follow"):
        steering_for(P.Generate("r", json_schema=SCHEMA), tok, tok.vocab_size, tok.encode("Q[1]"), 3, "generic")


def test_refusals_name_the_part(demo_tokenizer):
    tok = demo_tokenizer
    with pytest.raises(BadRequest, match="json_schema: the grammar library cannot use it: .*not"):
        steering_for(P.Generate("r", json_schema={"type": "object", "not": {"type": "null"}}), tok, tok.vocab_size,
                     [1], 0, "generic")
    with pytest.raises(BadRequest, match="logit_bias: '999999' is not a token id"):
        steering_for(P.Generate("r", penalties=P.Penalties(logit_bias={"999999": 1.0})), tok, tok.vocab_size,
                     [1], 0, "generic")
    assert steering_for(P.Generate("r"), tok, tok.vocab_size, [1], 0, "generic") is None
