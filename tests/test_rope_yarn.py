"""YaRN rope scaling: runtime/reference/rope.py against transformers' rotary embeddings, and the CUDA engine's
tables (exllamav2's, replaced by ours in runtime/backends/exl2_arch.py) from the same function, on the CPU."""
from __future__ import annotations

import types

import pytest
import torch

transformers = pytest.importorskip("transformers")

from runtime.backends import exl2_arch  # noqa: E402
from runtime.errors import InvalidModel  # noqa: E402
from runtime.reference import rope  # noqa: E402

QWEN3 = dict(hidden_size=256, num_attention_heads=2, num_key_value_heads=1, head_dim=128, rope_theta=1000000.0,
             max_position_embeddings=131072, vocab_size=64, intermediate_size=64, num_hidden_layers=1)
YARN = {   # Qwen3's documented long-context setting, and the fields YaRN's other users set
    "qwen3-4x": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    "old-spelling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    "attention-factor": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096,
                         "attention_factor": 1.3},
    "mscale": {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0,
               "mscale_all_dim": 0.707, "beta_fast": 16, "beta_slow": 2},
    "untruncated": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 8192,
                    "truncate": False},
    "no-original": {"rope_type": "yarn", "factor": 4.0},
}


def _transformers(scaling: dict, **over):
    config = transformers.Qwen3Config(**{**QWEN3, **over}, rope_scaling=dict(scaling))
    return transformers.models.qwen3.modeling_qwen3.Qwen3RotaryEmbedding(config=config)


@pytest.mark.parametrize("name", list(YARN))
def test_yarn_matches_transformers(name):
    ref = _transformers(YARN[name])
    ours = rope.rope_config({**QWEN3, "rope_scaling": YARN[name]}, "config.json")
    assert ours.rope_type == "yarn"
    assert torch.allclose(rope.inv_freq(ours, 128), ref.inv_freq, rtol=1e-6, atol=0)
    assert rope.attention_factor(ours) == pytest.approx(ref.attention_scaling, rel=1e-9)
    pos = torch.tensor([[0, 1, 7, 1000, 40000, 131071]])
    cos_ref, sin_ref = ref(torch.zeros(1, 1, 128), pos)
    cos, sin = rope.tables(ours, 128, 131072, torch.float32)
    assert torch.allclose(cos[pos[0]], cos_ref[0], atol=2e-4) and torch.allclose(sin[pos[0]], sin_ref[0], atol=2e-4)


def test_yarn_of_a_partial_rotation_matches_transformers():
    """Qwen3.5's gated attention rotates a quarter of each head: YaRN over those dimensions only."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048,
               "partial_rotary_factor": 0.25}
    config = transformers.Qwen3Config(**QWEN3, rope_scaling=dict(scaling))
    ref_freq, ref_scale = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    ours = rope.rope_config({**QWEN3, "rope_scaling": {k: v for k, v in scaling.items()
                                                        if k != "partial_rotary_factor"}}, "config.json")
    assert torch.allclose(rope.inv_freq(ours, 32), ref_freq, rtol=1e-6, atol=0)
    assert rope.attention_factor(ours) == pytest.approx(ref_scale)


def test_yarn_fields_are_checked_by_name():
    with pytest.raises(InvalidModel, match="'rope_scaling.beta_fast' must be a number above 0"):
        rope.rope_config({**QWEN3, "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "beta_fast": -1}}, "c")
    with pytest.raises(InvalidModel, match="'rope_scaling.truncate' must be true or false"):
        rope.rope_config({**QWEN3, "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "truncate": "no"}}, "c")
    with pytest.raises(InvalidModel, match="'rope_scaling.factor' is missing"):
        rope.rope_config({**QWEN3, "rope_scaling": {"rope_type": "yarn"}}, "c")


def test_the_cuda_engines_tables_come_from_the_shared_function():
    config = {"architectures": ["Qwen3MoeForCausalLM"], **QWEN3, "num_experts": 4, "num_experts_per_tok": 2,
              "moe_intermediate_size": 32, "rope_scaling": YARN["qwen3-4x"]}
    p = exl2_arch.plan(config)
    sin, cos = exl2_arch.rope_tables(p, 4096)
    ref_cos, ref_sin = rope.tables(p.rope, 128, 4096, torch.float32)
    assert sin.shape == (1, 1, 4096, 128) and sin.dtype == torch.float16
    assert torch.equal(sin[0, 0], ref_sin.half()) and torch.equal(cos[0, 0], ref_cos.half())
    assert cos[0, 0, 0, 0].item() == pytest.approx(0.1 * torch.log(torch.tensor(4.0)).item() + 1, abs=1e-3)

    class Context:                        # exllamav2's device context, as far as the patch reads it
        def __init__(self, model):
            self.model, self.sin, self.cos = model, None, None

        def prepare_sincos(self):         # exllamav2's own tables: anything else
            self.sin, self.cos = [torch.zeros(1, 1, 4096, 128).half()], [torch.ones(1, 1, 4096, 128).half()]

    exl2_arch.own_rope_tables(Context)
    exl2_arch.own_rope_tables(Context)                       # once only
    model = types.SimpleNamespace(moedesk_arch=p, config=types.SimpleNamespace(max_seq_len=4096))
    ctx = Context(model)
    ctx.prepare_sincos()
    assert torch.equal(ctx.sin[0], sin) and torch.equal(ctx.cos[0], cos)
    plain = Context(types.SimpleNamespace(config=types.SimpleNamespace(max_seq_len=4096)))
    plain.prepare_sincos()                                   # a model without a plan keeps exllamav2's
    assert plain.sin[0].abs().max() == 0


def test_unknown_rope_types_are_refused_by_the_cuda_engine_as_by_the_cpu_engine():
    from runtime.errors import UnsupportedArchitecture
    config = {"architectures": ["Qwen3ForCausalLM"], **QWEN3, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}
    with pytest.raises(UnsupportedArchitecture, match="rope type 'dynamic' is not supported"):
        exl2_arch.plan(config)
