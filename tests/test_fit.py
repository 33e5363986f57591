"""The fit estimator against figures computed by hand for the real Qwen3-MoE configs."""
import pytest

from app.hub.fit import FitError, ModelShape, Verdict, estimate_fit

GiB = 1024 ** 3

# config.json of Qwen/Qwen3-30B-A3B (the fields the estimate reads)
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 2048, "num_hidden_layers": 48,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144,
    "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8, "vocab_size": 151936,
    "tie_word_embeddings": False, "max_position_embeddings": 40960,
}
# config.json of Qwen/Qwen3-235B-A22B
QWEN3_235B_A22B = {
    "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 4096, "num_hidden_layers": 94,
    "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 12288,
    "moe_intermediate_size": 1536, "num_experts": 128, "num_experts_per_tok": 8, "vocab_size": 151936,
    "tie_word_embeddings": False, "max_position_embeddings": 40960,
}


def test_parameter_counts_match_the_published_totals():
    # 30B-A3B per layer: q 2048*4096 = 8,388,608; k, v 2048*512 = 1,048,576 each; o 8,388,608
    #   -> attention 18,874,368; norms 2*2048 + 2*128 = 4,352; router 2048*128 = 262,144;
    #   experts 128 * 3 * 2048 * 768 = 603,979,776.  x48 layers, + embeddings and head 151936*2048 each
    #   (311,164,928) + final norm 2048 = 30,532,122,624 (published: 30.5B).
    s = ModelShape.from_config(QWEN3_30B_A3B)
    assert s.attention_params() == 18_874_368 * 48 == 905_969_664
    assert s.norm_params() == 4_352 * 48 + 2048 == 210_944
    assert s.router_params() == 262_144 * 48 == 12_582_912
    assert s.expert_params() == 603_979_776 * 48 == 28_991_029_248
    assert s.total_params() == 30_532_122_624
    # 235B-A22B per layer: q 4096*8192 = 33,554,432; k, v 4096*512 = 2,097,152; o 33,554,432 -> 71,303,168;
    #   norms 2*4096 + 256 = 8,448; router 4096*128 = 524,288; experts 128*3*4096*1536 = 2,415,919,104.
    #   x94, + 2 * 151936*4096 (622,329,856 each) + 4096 = 235,093,634,560 (published: 235B).
    b = ModelShape.from_config(QWEN3_235B_A22B)
    assert b.attention_params() == 6_702_497_792
    assert b.expert_params() == 227_096_395_776
    assert b.total_params() == 235_093_634_560


def test_qwen3_30b_a3b_at_4bpw():
    s = ModelShape.from_config(QWEN3_30B_A3B)
    # GPU fixed, 4.0 bpw, head 6 bits, 32768 tokens of fp16 cache:
    #   attention 905,969,664 * 0.5          =   452,984,832
    #   norms + router (210,944 + 12,582,912) * 2 = 25,587,712
    #   head 311,164,928 * 6/8               =   233,373,696
    #   KV 2*48*4*128*32768 = 1,610,612,736 elements * 2 = 3,221,225,472
    #   margin                               = 1,000,000,000
    #   total                                = 4,933,171,712
    # experts 28,991,029,248 * 0.5 = 14,495,514,624
    est = estimate_fit(s, 4.0, 32768, "fp16", vram_bytes=24 * GiB, ram_bytes=32 * GiB, head_bits=6)
    assert est.gpu_fixed_bytes == pytest.approx(4_933_171_712)
    assert est.expert_bytes == pytest.approx(14_495_514_624)
    assert est.kv_bytes == pytest.approx(3_221_225_472)
    assert est.verdict is Verdict.FITS_VRAM          # 19.43 GB <= 25.77 GB
    assert est.text == "fits in VRAM"
    # 12 GiB = 12,884,901,888: experts get 7,951,730,176, so 6,543,784,448 go to RAM
    est = estimate_fit(s, 4.0, 32768, "fp16", vram_bytes=12 * GiB, ram_bytes=32 * GiB, head_bits=6)
    assert est.verdict is Verdict.FITS_OFFLOAD
    assert est.experts_in_ram_bytes == pytest.approx(6_543_784_448)
    assert est.text == "fits with expert offload — 6.1 GiB of experts in RAM"
    assert "KV cache 3.0 GiB" in est.assumptions


def test_qwen3_235b_a22b_at_3bpw_q4_cache():
    b = ModelShape.from_config(QWEN3_235B_A22B)
    # GPU fixed, 3.0 bpw, head 6, 32768 tokens of q4 cache (0.5 + 2/32 = 0.5625 bytes per element):
    #   attention 6,702,497,792 * 3/8        = 2,513,436,672
    #   norms + router (798,208 + 49,283,072) * 2 = 100,162,560
    #   head 622,329,856 * 6/8               =   466,747,392
    #   KV 2*94*4*128*32768 = 3,154,116,608 * 0.5625 = 1,774,190,592
    #   margin                               = 1,000,000,000
    #   total                                = 5,854,537,216
    # experts 227,096,395,776 * 3/8 = 85,161,148,416; RAM fixed = embeddings 1,244,659,712 + 4e9 reserve
    est = estimate_fit(b, 3.0, 32768, "q4", vram_bytes=24 * GiB, ram_bytes=128 * GiB, head_bits=6)
    assert est.gpu_fixed_bytes == pytest.approx(5_854_537_216)
    assert est.expert_bytes == pytest.approx(85_161_148_416)
    # 24 GiB = 25,769,803,776 -> 19,915,266,560 for experts -> 65,245,881,856 in RAM; RAM needs 70,490,541,568
    assert est.verdict is Verdict.FITS_OFFLOAD
    assert est.experts_in_ram_bytes == pytest.approx(65_245_881_856)
    assert est.text == "fits with expert offload — 60.8 GiB of experts in RAM"
    # 64 GiB RAM = 68,719,476,736 < 70,490,541,568: short by 1,771,064,832
    est = estimate_fit(b, 3.0, 32768, "q4", vram_bytes=24 * GiB, ram_bytes=64 * GiB, head_bits=6)
    assert est.verdict is Verdict.DOES_NOT_FIT
    assert est.ram_short_bytes == pytest.approx(1_771_064_832)
    assert est.text == "does not fit — needs 1.6 GiB more RAM"
    # 4 GiB VRAM = 4,294,967,296 < 5,854,537,216: 1,559,569,920 short; all experts (85.2 GB) to RAM
    est = estimate_fit(b, 3.0, 32768, "q4", vram_bytes=4 * GiB, ram_bytes=256 * GiB, head_bits=6)
    assert est.verdict is Verdict.DOES_NOT_FIT
    assert est.vram_short_bytes == pytest.approx(1_559_569_920)
    assert est.text == "does not fit — needs 1.5 GiB more VRAM"


def test_dense_model_cannot_offload():
    dense = {"architectures": ["LlamaForCausalLM"], "hidden_size": 576, "num_hidden_layers": 30,
             "num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536,
             "vocab_size": 49152, "tie_word_embeddings": True}
    s = ModelShape.from_config(dense)
    assert s.total_params() == 134_515_008      # SmolLM2-135M
    assert estimate_fit(s, 8.0, 2048, "fp16", 8 * GiB, 16 * GiB).verdict is Verdict.FITS_VRAM
    est = estimate_fit(s, 8.0, 2048, "fp16", 0, 16 * GiB)
    assert est.verdict is Verdict.DOES_NOT_FIT and "more VRAM" in est.text


def test_bad_inputs_name_the_field():
    with pytest.raises(FitError, match="num_hidden_layers"):
        ModelShape.from_config({k: v for k, v in QWEN3_30B_A3B.items() if k != "num_hidden_layers"})
    s = ModelShape.from_config(QWEN3_30B_A3B)
    with pytest.raises(FitError, match="KV cache type"):
        estimate_fit(s, 4.0, 4096, "q3", 1, 1)
    with pytest.raises(FitError, match="bits per weight"):
        estimate_fit(s, 0.5, 4096, "fp16", 1, 1)


# config.json of mistralai/Mixtral-8x22B-Instruct-v0.1 (intermediate_size is one expert's width) and of
# databricks/dbrx-instruct (sizes nested in attn_config / ffn_config)
MIXTRAL_8X22B = {
    "architectures": ["MixtralForCausalLM"], "hidden_size": 6144, "num_hidden_layers": 56, "num_attention_heads": 48,
    "num_key_value_heads": 8, "intermediate_size": 16384, "num_local_experts": 8, "num_experts_per_tok": 2,
    "vocab_size": 32768, "tie_word_embeddings": False, "max_position_embeddings": 65536,
}
DBRX_INSTRUCT = {
    "architectures": ["DbrxForCausalLM"], "d_model": 6144, "n_layers": 40, "n_heads": 48, "vocab_size": 100352,
    "max_seq_len": 32768, "attn_config": {"kv_n_heads": 8, "clip_qkv": 8, "rope_theta": 500000},
    "ffn_config": {"ffn_hidden_size": 10752, "moe_num_experts": 16, "moe_top_k": 4}, "tie_word_embeddings": False,
}


@pytest.mark.parametrize("config, total, active", [(MIXTRAL_8X22B, 141e9, 39e9), (DBRX_INSTRUCT, 132e9, 36e9)])
def test_mixtral_and_dbrx_counts_and_verdicts(config, total, active):
    s = ModelShape.from_config(config)
    # Mixtral per layer: attention 6144*(6144*2 + 1024*2) = 88,080,384; experts 8*3*6144*16384 = 2,415,919,104
    # DBRX per layer: the same attention; experts 16*3*6144*10752 = 3,170,893,824
    experts = 8 * 3 * 6144 * 16384 * 56 if s.experts == 8 else 16 * 3 * 6144 * 10752 * 40
    assert s.expert_params() == experts and s.attention_params() == 88_080_384 * s.layers
    assert s.total_params() == pytest.approx(total, rel=0.005)             # published: 141B and 132B
    idle = s.expert_params() * (s.experts - s.experts_per_token) // s.experts
    assert s.total_params() - idle == pytest.approx(active, rel=0.015)    # published: 39B and 36B active
    est = estimate_fit(s, 3.0, 8192, "fp16", vram_bytes=24 * GiB, ram_bytes=64 * GiB, head_bits=6)
    assert est.verdict is Verdict.FITS_OFFLOAD
    assert estimate_fit(s, 3.0, 8192, "fp16", vram_bytes=140 * GiB, ram_bytes=64 * GiB).verdict is Verdict.FITS_VRAM
