"""Grammar-constrained sampling on the CUDA engine: a random-weight model still answers JSON valid for the schema.

`moe_2l` (Qwen3-30B-A3B shape, 2 layers, random weights) writes noise; under the request's grammar
(runtime/constrained.py: the mask computed on the CPU, applied to the GPU's logits row) every answer must
still be a JSON object of the schema, sampled and greedy, plain and with n-gram drafting (drafts the
grammar refuses are cut before the verify, the verified rows masked).
"""
from __future__ import annotations

import json

import pytest
import torch

from runtime import protocol as P
from runtime.constrained import steering_for
from runtime.generate import generate, make_decoder
from runtime.options import DraftOptions, LoadOptions, OffloadOptions, SamplingOptions
from runtime.tokenizer import Tokenizer

pytestmark = pytest.mark.gpu
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "size": {"enum": ["small", "large"]},
    "count": {"type": "integer", "minimum": 0, "maximum": 99},
    "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
    "required": ["name", "size", "count", "tags"], "additionalProperties": False}


@pytest.fixture(scope="module")
def engine(moe_2l):
    from runtime.backends import exl2
    eng = exl2.load(moe_2l, LoadOptions(offload=OffloadOptions(context_length=1024)), lambda *a: None)[0]
    yield eng
    eng.close()


@pytest.mark.parametrize("draft", [None, DraftOptions(mode="ngram", draft_tokens=4, adaptive=False)],
                         ids=["plain", "ngram"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_noise_model_answers_valid_json(engine, moe_2l, draft, temperature):
    tok = Tokenizer.from_folder(moe_2l)
    prompt = tok.encode("Describe a thing as JSON: ") or [0]
    for seed in range(3):
        sampling = SamplingOptions(temperature=temperature, top_p=1.0, top_k=0, seed=seed, max_tokens=400)
        gen = torch.Generator().manual_seed(seed)
        steer = steering_for(P.Generate("g", json_schema=SCHEMA), tok, engine.info.vocab_size, prompt, 0,
                             tok.tool_format())
        engine.reset()
        out = generate(engine, tok, prompt, sampling, generator=gen, steer=steer,
                       decoder=make_decoder(engine, sampling, gen, draft, None, steer))
        assert out.reason == "eos", (out.reason, out.text[-200:])
        got = json.loads(out.text)
        assert set(got) == {"name", "size", "count", "tags"} and len(got["name"]) <= 8
        assert got["size"] in ("small", "large") and 0 <= got["count"] <= 99
        assert len(got["tags"]) <= 3 and all(isinstance(t, bool) for t in got["tags"])
