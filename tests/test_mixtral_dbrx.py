"""Mixtral and DBRX end to end on the CPU: the synthetic shapes' configs are the released models', tiny
EXL2 folders of both validate, load in the reference engine, carry their real chat template (rendered
through the sandboxed template path) and answer through the worker process."""
from __future__ import annotations

import json

import pytest

from runtime import protocol as P
from runtime.client import WorkerClient, new_id
from runtime.errors import BadRequest
from runtime.exl2 import synth
from runtime.exl2.shapes import SHAPES, get_shape, hf_config, param_counts
from runtime.modelfolder import validate
from runtime.options import SamplingOptions
from runtime.tokenizer import Tokenizer

TINY = {"tiny-mixtral": "MixtralForCausalLM", "tiny-dbrx": "DbrxForCausalLM"}
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("archs")
    for name in TINY:
        synth.write_synthetic(name, 4.0, root / name, seed=2)
    return {name: root / name for name in TINY}


@pytest.mark.parametrize("name, total, active", [("mixtral-8x22b", 140.6e9, 39.2e9), ("dbrx", 131.6e9, 36.5e9)])
def test_big_shapes_count_the_model_cards_parameters(name, total, active):
    got_total, got_active = param_counts(SHAPES[name])
    assert abs(got_total - total) < 0.1e9 and abs(got_active - active) < 0.1e9


def test_big_shapes_write_the_released_configs(tmp_path):
    m = hf_config(SHAPES["mixtral-8x22b"])
    assert (m["hidden_size"], m["intermediate_size"], m["num_hidden_layers"], m["num_attention_heads"],
            m["num_key_value_heads"], m["num_local_experts"], m["num_experts_per_tok"], m["vocab_size"],
            m["rope_theta"], m["max_position_embeddings"], m["sliding_window"]) == \
           (6144, 16384, 56, 48, 8, 8, 2, 32768, 1000000.0, 65536, None)
    d = hf_config(SHAPES["dbrx"])
    assert (d["d_model"], d["n_layers"], d["n_heads"], d["vocab_size"], d["max_seq_len"],
            d["attn_config"]["kv_n_heads"], d["attn_config"]["clip_qkv"], d["attn_config"]["rope_theta"], d["ffn_config"]["ffn_hidden_size"],
            d["ffn_config"]["moe_num_experts"], d["ffn_config"]["moe_top_k"]) == \
           (6144, 40, 48, 100352, 32768, 8, 8.0, 500000.0, 10752, 16, 4)


@pytest.mark.parametrize("name", list(TINY))
def test_tiny_folders_validate_with_their_counts(folders, name):
    info = validate(folders[name])
    shape = get_shape(name)
    assert info.architecture == TINY[name] and info.is_exl2
    assert (info.num_experts, info.experts_per_token) == (shape.experts, shape.experts_per_token)
    assert (info.num_params, info.active_params) == param_counts(shape)


def test_mixtral_template_renders_inst(folders):
    tok = Tokenizer.from_folder(folders["tiny-mixtral"])
    text = tok.render_chat(CONVERSATION)
    assert text == "<s>[INST] Hi[/INST] Hello.</s>[INST] Be brief.\n\nName a colour.[/INST]"
    ids = tok.encode(text)
    assert ids[0] == get_shape("tiny-mixtral").first_special + 1                 # <s>, a special token
    assert tok.decode(ids) == " Hi Hello. Be brief.\n\nName a colour."


def test_dbrx_template_renders_chatml(folders):
    tok = Tokenizer.from_folder(folders["tiny-dbrx"])
    assert tok.render_chat(CONVERSATION) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello."
        "<|im_end|>\n<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\n")


def test_mixtral_template_refuses_roles_out_of_turn(folders):
    from runtime.errors import EngineError
    tok = Tokenizer.from_folder(folders["tiny-mixtral"])
    with pytest.raises(EngineError) as e:
        tok.render_chat([{"role": "assistant", "content": "x"}])
    assert isinstance(e.value, BadRequest) and "alternate" in e.value.message


@pytest.mark.parametrize("name", list(TINY))
def test_tiny_folders_answer_through_the_worker(folders, name):
    with WorkerClient() as w:
        loaded = w.load(str(folders[name]))
        assert loaded.backend == "cpu" and loaded.vocab_size == get_shape(name).vocab
        rid = new_id("t")
        req = P.Generate(request_id=rid, messages=(P.ChatMessage("user", "Hi"),),
                         sampling=SamplingOptions(temperature=0.0, max_tokens=6))
        finished = None
        for ev in w.generate(req, timeout=120):
            if isinstance(ev, P.Error):
                raise P.exception_for(ev)
            if isinstance(ev, P.Finished):
                finished = ev
    assert finished is not None and 0 < finished.stats.generated_tokens <= 6
    assert json.loads((folders[name] / "config.json").read_text())["architectures"] == [TINY[name]]


@pytest.mark.parametrize("name", TINY)
def test_the_reference_routed_to_given_picks(folders, name):
    """The GPU comparisons hand the float32 reference an engine's picks (tests/gpu/routing_replay.py): its
    own picks given back change nothing (the weights it reports are theirs, one per pick, and its routers
    would have picked them); other picks change the answer (the first layer's router, whose input no pick
    precedes, still picks as before); a list of picks for fewer layers than the model has is refused."""
    import torch
    from runtime import reference
    from runtime.options import LoadOptions
    from tests.gpu.routing_replay import reference_forward, reference_picks
    ref = reference.load(folders[name], LoadOptions(), lambda *a: None, precision="float32")[0]
    try:
        toks = torch.randint(0, ref.info.vocab_size - 64, (12,), generator=torch.Generator().manual_seed(1)).tolist()
        own = reference_picks(ref, toks)
        plain = ref.forward(toks)
        ref.reset()
        given = [(torch.tensor(layer, dtype=torch.int32), None) for layer in own]
        weights: list = []
        routers: list = []
        same = reference_forward(ref, toks, given, weights, routers)
        assert (same - plain).abs().max() <= 1e-5 * plain.abs().max()
        A = len(own[0][0])
        assert len(weights) == len(own) and all(w.shape == (len(toks), A) and (w > 0).all() for w in weights)
        # what its routers would pick under the given picks: its own, since those were its own
        assert [r.own.tolist() for r in routers] == own
        assert all(r.gap.shape == (len(toks),) and (r.gap >= 0).all() and r.spread > 0 for r in routers)
        ref.reset()
        E = ref.info.num_experts
        other = [(torch.tensor([[(e + 1) % E for e in row] for row in layer], dtype=torch.int32), None) for layer in own]
        routers = []
        moved = reference_forward(ref, toks, other, routers=routers)
        assert (moved - plain).abs().max() > 1e-2 * plain.abs().max()
        assert routers[0].own.tolist() == own[0]        # the first layer's input does not depend on picks
        ref.reset()
        with pytest.raises(AssertionError, match="MoE layers"):
            reference_forward(ref, toks, given[:1])
    finally:
        ref.close()
