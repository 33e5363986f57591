"""The reference engine on the real demo model: the default (int8) weights keep its answer."""
from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from runtime.options import LoadOptions
from runtime.reference import DEFAULT_PRECISION, load

PROMPT = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
          "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")


def greedy(engine, ids: list[int], end: int, limit: int = 16) -> list[int]:
    nxt = int(engine.forward(ids)[-1].argmax())
    out = [nxt]
    while nxt != end and len(out) < limit:
        nxt = int(engine.forward([nxt])[0].argmax())
        out.append(nxt)
    return out


@pytest.mark.slow
def test_demo_answers_paris_at_default_and_full_precision(demo_model):
    tok = Tokenizer.from_file(str(demo_model / "tokenizer.json"))
    ids = tok.encode(PROMPT, add_special_tokens=False).ids
    end = tok.token_to_id("<|im_end|>")
    answers = {}
    for precision in (DEFAULT_PRECISION, "float32"):
        engine, _ = load(demo_model, LoadOptions(), precision=precision)
        answers[precision] = tok.decode(greedy(engine, ids, end))
        engine.close()
    assert "The capital of France is Paris" in answers["float32"], answers
    assert answers[DEFAULT_PRECISION] == answers["float32"], answers
