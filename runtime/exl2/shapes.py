"""Model shapes for synthetic models: the real models' config.json, tensor list and parameter counts.

No torch here: the shapes table and parameter counts are plain arithmetic.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from runtime.modelfolder import MOE_ARCHITECTURES, QK_NORM_ARCHITECTURES

QWEN_VOCAB = 151936
QWEN_FIRST_SPECIAL = 151643          # <|endoftext|>; then <|im_start|>, <|im_end|>, ...
QWEN35 = "Qwen3_5MoeForConditionalGeneration"


@dataclass(frozen=True)
class Shape:
    name: str
    architecture: str                # "Qwen3MoeForCausalLM" | "Qwen3ForCausalLM" | "LlamaForCausalLM" | Mixtral | Dbrx
    like: str                        # the real model whose shape this is
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int                # dense MLP width (MoE configs carry it too)
    vocab: int = QWEN_VOCAB
    experts: int = 0
    experts_per_token: int = 0
    expert_intermediate: int = 0
    tie_embeddings: bool = False
    max_position: int = 40960
    rope_theta: float = 1000000.0
    norm_eps: float = 1e-06
    clip_qkv: float = 0.0            # DBRX
    chat: str = "chatml"             # the tokenizer's specials and chat template: "chatml" | "mistral"
    # Qwen3.5-MoE's hybrid layers (0: not hybrid)
    full_attention_interval: int = 0  # every n-th layer is gated full attention, the others Gated DeltaNet
    linear_key_heads: int = 0
    linear_value_heads: int = 0
    linear_key_dim: int = 0
    linear_value_dim: int = 0
    conv_kernel: int = 4
    shared_intermediate: int = 0     # the shared expert's width
    partial_rotary: float = 1.0
    special_base: int = 0            # id of <|endoftext|> when the vocabulary is not Qwen3's (0: the default)

    @property
    def is_llama(self) -> bool:
        return self.architecture == "LlamaForCausalLM"

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @property
    def first_special(self) -> int:
        """Id of <|endoftext|>: Qwen's own for the real vocabulary, the last 32 ids for tiny ones."""
        if self.special_base:
            return self.special_base
        return QWEN_FIRST_SPECIAL if self.vocab == QWEN_VOCAB else self.vocab - 32

    @property
    def is_hybrid(self) -> bool:
        return self.full_attention_interval > 0

    def with_layers(self, layers: int | None) -> "Shape":
        if layers is None:
            return self
        if layers < 1:
            raise ValueError(f"--layers must be at least 1, got {layers}")
        from dataclasses import replace
        return replace(self, layers=layers)


SHAPES: dict[str, Shape] = {s.name: s for s in (
    Shape("tiny-moe", "Qwen3MoeForCausalLM", "a miniature Qwen3-MoE (tests)", layers=2, hidden=256, heads=4,
          kv_heads=2, head_dim=64, intermediate=512, vocab=1024, experts=16, experts_per_token=4,
          expert_intermediate=128, max_position=4096),
    Shape("tiny-dense", "Qwen3ForCausalLM", "a miniature Qwen3 (tests)", layers=2, hidden=256, heads=4,
          kv_heads=2, head_dim=64, intermediate=512, vocab=1024, tie_embeddings=True, max_position=4096),
    Shape("qwen3-30b-a3b", "Qwen3MoeForCausalLM", "Qwen/Qwen3-30B-A3B", layers=48, hidden=2048, heads=32,
          kv_heads=4, head_dim=128, intermediate=6144, experts=128, experts_per_token=8, expert_intermediate=768),
    Shape("q125-a11", "Qwen3MoeForCausalLM", "a Qwen3-MoE of ~121B total / ~11B active parameters", layers=48,
          hidden=4096, heads=64, kv_heads=4, head_dim=128, intermediate=12288, experts=128, experts_per_token=8,
          expert_intermediate=1536),
    Shape("qwen3-0.6b", "Qwen3ForCausalLM", "Qwen/Qwen3-0.6B (dense draft model)", layers=28, hidden=1024,
          heads=16, kv_heads=8, head_dim=128, intermediate=3072, tie_embeddings=True),
    # config.json of mistralai/Mixtral-8x22B-Instruct-v0.1 (as the model card's repository holds it):
    # 141B parameters, 39B active; intermediate_size is one expert's width
    Shape("mixtral-8x22b", "MixtralForCausalLM", "mistralai/Mixtral-8x22B-Instruct-v0.1", layers=56, hidden=6144,
          heads=48, kv_heads=8, head_dim=128, intermediate=16384, vocab=32768, experts=8, experts_per_token=2,
          expert_intermediate=16384, max_position=65536, norm_eps=1e-05, chat="mistral"),
    Shape("tiny-mixtral", "MixtralForCausalLM", "a miniature Mixtral (tests)", layers=2, hidden=256, heads=4,
          kv_heads=2, head_dim=64, intermediate=128, vocab=1024, experts=8, experts_per_token=2,
          expert_intermediate=128, max_position=4096, norm_eps=1e-05, chat="mistral"),
    # config.json of databricks/dbrx-instruct (d_model, n_heads, n_layers, attn_config, ffn_config): 132B
    # parameters, 36B active; the tiktoken-based vocabulary of 100352 ids
    Shape("dbrx", "DbrxForCausalLM", "databricks/dbrx-instruct", layers=40, hidden=6144, heads=48, kv_heads=8,
          head_dim=128, intermediate=10752, vocab=100352, experts=16, experts_per_token=4, expert_intermediate=10752,
          max_position=32768, rope_theta=500000.0, norm_eps=1e-05, clip_qkv=8.0),
    Shape("tiny-dbrx", "DbrxForCausalLM", "a miniature DBRX (tests)", layers=2, hidden=256, heads=4, kv_heads=2,
          head_dim=64, intermediate=128, vocab=1024, experts=16, experts_per_token=4, expert_intermediate=128,
          max_position=4096, rope_theta=500000.0, norm_eps=1e-05, clip_qkv=8.0),
    # config.json of Qwen/Qwen3.5-122B-A10B (its text_config): 48 layers, 3 Gated DeltaNet : 1 gated attention,
    # 256 experts (top-8) + a shared expert; ~122B parameters, ~10B active (vision tower not written; the MTP head
    # is written, not counted)
    Shape("qwen3.5-122b-a10b", QWEN35, "Qwen/Qwen3.5-122B-A10B", layers=48, hidden=3072, heads=32, kv_heads=2,
          head_dim=256, intermediate=0, vocab=248320, experts=256, experts_per_token=8, expert_intermediate=1024,
          max_position=262144, rope_theta=10000000.0, full_attention_interval=4, linear_key_heads=16,
          linear_value_heads=64, linear_key_dim=128, linear_value_dim=128, shared_intermediate=1024,
          partial_rotary=0.25, special_base=248044),
    Shape("tiny-qwen3.5", QWEN35, "a miniature Qwen3.5-MoE (tests)", layers=4, hidden=256, heads=4, kv_heads=2,
          head_dim=64, intermediate=0, vocab=1024, experts=16, experts_per_token=4, expert_intermediate=128,
          max_position=4096, rope_theta=10000000.0, full_attention_interval=4, linear_key_heads=4,
          linear_value_heads=32, linear_key_dim=32, linear_value_dim=32, shared_intermediate=128,
          partial_rotary=0.25),
    Shape("smollm2-135m", "LlamaForCausalLM", "HuggingFaceTB/SmolLM2-135M-Instruct (Llama, the demo model's shape)",
          layers=30, hidden=576, heads=9, kv_heads=3, head_dim=64, intermediate=1536, vocab=49152,
          tie_embeddings=True, max_position=8192, rope_theta=100000.0),
)}


def get_shape(name: str) -> Shape:
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; known: {', '.join(SHAPES)}")
    return SHAPES[name]


def hf_config(s: Shape) -> dict:
    """config.json as the real Qwen3 / Qwen3-MoE / Llama / Mixtral / DBRX releases write it."""
    if s.architecture == "DbrxForCausalLM":
        return _dbrx_config(s)
    if s.architecture == "MixtralForCausalLM":
        return _mixtral_config(s)
    if s.is_hybrid:
        return _qwen35_config(s)
    cfg = {
        "architectures": [s.architecture],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": s.first_special,
        "eos_token_id": s.first_special + 2,
        "head_dim": s.head_dim,
        "hidden_act": "silu",
        "hidden_size": s.hidden,
        "initializer_range": 0.02,
        "intermediate_size": s.intermediate,
        "max_position_embeddings": s.max_position,
        "max_window_layers": s.layers,
        "model_type": "llama" if s.is_llama else "qwen3_moe" if s.is_moe else "qwen3",
        "num_attention_heads": s.heads,
        "num_hidden_layers": s.layers,
        "num_key_value_heads": s.kv_heads,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": s.rope_theta,
        "sliding_window": None,
        "tie_word_embeddings": s.tie_embeddings,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.51.0",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": s.vocab,
    }
    if s.is_moe:
        cfg.update({
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "moe_intermediate_size": s.expert_intermediate,
            "norm_topk_prob": True,
            "num_experts": s.experts,
            "num_experts_per_tok": s.experts_per_token,
            "output_router_logits": False,
            "router_aux_loss_coef": 0.001,
        })
    return dict(sorted(cfg.items()))


def _mixtral_config(s: Shape) -> dict:
    return {"architectures": [s.architecture], "attention_dropout": 0.0, "bos_token_id": s.first_special + 1,
            "eos_token_id": s.first_special + 2, "hidden_act": "silu", "hidden_size": s.hidden,
            "initializer_range": 0.02, "intermediate_size": s.expert_intermediate,
            "max_position_embeddings": s.max_position, "model_type": "mixtral", "num_attention_heads": s.heads,
            "num_experts_per_tok": s.experts_per_token, "num_hidden_layers": s.layers,
            "num_key_value_heads": s.kv_heads, "num_local_experts": s.experts, "output_router_logits": False,
            "rms_norm_eps": s.norm_eps, "rope_theta": s.rope_theta, "router_aux_loss_coef": 0.001,
            "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
            "transformers_version": "4.38.0", "use_cache": True, "vocab_size": s.vocab}


def _dbrx_config(s: Shape) -> dict:
    return {"architectures": [s.architecture],
            "attn_config": {"clip_qkv": s.clip_qkv, "kv_n_heads": s.kv_heads, "model_type": "",
                            "rope_theta": s.rope_theta},
            "d_model": s.hidden, "emb_pdrop": 0.0,
            "ffn_config": {"ffn_act_fn": {"name": "silu"}, "ffn_hidden_size": s.expert_intermediate, "model_type": "",
                           "moe_jitter_eps": 0, "moe_loss_weight": 0.05, "moe_normalize_expert_weights": 1,
                           "moe_num_experts": s.experts, "moe_top_k": s.experts_per_token},
            "initializer_range": 0.02, "max_seq_len": s.max_position, "model_type": "dbrx", "n_heads": s.heads,
            "n_layers": s.layers, "output_router_logits": False, "resid_pdrop": 0.0, "router_aux_loss_coef": 0.05,
            "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.38.2",
            "use_cache": True, "vocab_size": s.vocab}


def _layer_types(s: Shape) -> list[str]:
    every = s.full_attention_interval
    return ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(s.layers)]


def _qwen35_config(s: Shape) -> dict:
    """The multimodal checkpoint's config with its text_config (no vision_config: no vision tower is written)."""
    text = {"attention_bias": False, "attention_dropout": 0.0, "bos_token_id": s.first_special + 1,
            "eos_token_id": s.first_special + 2, "full_attention_interval": s.full_attention_interval,
            "head_dim": s.head_dim, "hidden_act": "silu", "hidden_size": s.hidden, "initializer_range": 0.02,
            "layer_types": _layer_types(s), "linear_conv_kernel_dim": s.conv_kernel,
            "linear_key_head_dim": s.linear_key_dim, "linear_num_key_heads": s.linear_key_heads,
            "linear_num_value_heads": s.linear_value_heads, "linear_value_head_dim": s.linear_value_dim,
            "max_position_embeddings": s.max_position, "model_type": "qwen3_5_moe_text",
            "moe_intermediate_size": s.expert_intermediate, "mtp_num_hidden_layers": 1,
            "num_attention_heads": s.heads, "num_experts": s.experts, "num_experts_per_tok": s.experts_per_token,
            "num_hidden_layers": s.layers, "num_key_value_heads": s.kv_heads, "rms_norm_eps": s.norm_eps,
            "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10], "rope_type": "default",
                                "rope_theta": s.rope_theta, "partial_rotary_factor": s.partial_rotary},
            "router_aux_loss_coef": 0.001, "shared_expert_intermediate_size": s.shared_intermediate,
            "tie_word_embeddings": False, "use_cache": True, "vocab_size": s.vocab}
    media = {} if s.vocab <= s.first_special + 13 else {"image_token_id": s.first_special + 12,
                                                         "video_token_id": s.first_special + 13}
    return {"architectures": [s.architecture], "model_type": "qwen3_5_moe", "text_config": text,
            "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.57.0.dev0", **media}


def _qwen35_tensors(s: Shape) -> Iterator["TensorSpec"]:
    """The language model's tensors under model.language_model. (experts per expert, as EXL2 stores them)."""
    h, q, kv, p0 = s.hidden, s.heads * s.head_dim, s.kv_heads * s.head_dim, "model.language_model"
    conv = 2 * s.linear_key_heads * s.linear_key_dim + s.linear_value_heads * s.linear_value_dim
    vd, hv = s.linear_value_heads * s.linear_value_dim, s.linear_value_heads
    yield TensorSpec(f"{p0}.embed_tokens.weight", (s.vocab, h), "embed")
    for i, kind in enumerate(_layer_types(s)):
        p = f"{p0}.layers.{i}"
        if kind == "full_attention":
            for proj, shape in (("q_proj", (2 * q, h)), ("k_proj", (kv, h)), ("v_proj", (kv, h)), ("o_proj", (h, q))):
                yield TensorSpec(f"{p}.self_attn.{proj}", shape, "linear", proj)
            yield TensorSpec(f"{p}.self_attn.q_norm.weight", (s.head_dim,), "centred_norm")
            yield TensorSpec(f"{p}.self_attn.k_norm.weight", (s.head_dim,), "centred_norm")
        else:
            a = f"{p}.linear_attn"
            for proj, shape in (("in_proj_qkv", (conv, h)), ("in_proj_z", (vd, h)), ("in_proj_b", (hv, h)),
                                ("in_proj_a", (hv, h)), ("out_proj", (h, vd))):
                yield TensorSpec(f"{a}.{proj}", shape, "linear", proj)
            yield TensorSpec(f"{a}.conv1d.weight", (conv, 1, s.conv_kernel), "router")
            yield TensorSpec(f"{a}.A_log", (hv,), "centred_norm")          # decay rate exp(0) = 1
            yield TensorSpec(f"{a}.dt_bias", (hv,), "norm")
            yield TensorSpec(f"{a}.norm.weight", (s.linear_value_dim,), "norm")
        yield from _qwen35_moe_tensors(s, p)
    yield TensorSpec(f"{p0}.norm.weight", (h,), "centred_norm")
    yield TensorSpec("lm_head", (s.vocab, h), "head")
    yield from _qwen35_mtp_tensors(s)


def _qwen35_mtp_tensors(s: Shape) -> Iterator["TensorSpec"]:
    """The multi-token-prediction head under mtp. (runtime/qwen35.mtp_layout): norms, fc, one gated
    attention layer with the MoE."""
    h, q, kv, p = s.hidden, s.heads * s.head_dim, s.kv_heads * s.head_dim, "mtp.layers.0"
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        yield TensorSpec(f"mtp.{norm}.weight", (h,), "centred_norm")
    yield TensorSpec("mtp.fc", (h, 2 * h), "linear", "mtp.fc")
    for proj, shape in (("q_proj", (2 * q, h)), ("k_proj", (kv, h)), ("v_proj", (kv, h)), ("o_proj", (h, q))):
        yield TensorSpec(f"{p}.self_attn.{proj}", shape, "linear", proj)
    yield TensorSpec(f"{p}.self_attn.q_norm.weight", (s.head_dim,), "centred_norm")
    yield TensorSpec(f"{p}.self_attn.k_norm.weight", (s.head_dim,), "centred_norm")
    yield from _qwen35_moe_tensors(s, p)


def _qwen35_moe_tensors(s: Shape, p: str) -> Iterator["TensorSpec"]:
    """A Qwen3.5 layer's MoE (router, shared expert and its gate, routed experts) and its two norms."""
    h, m, ms = s.hidden, s.expert_intermediate, s.shared_intermediate
    yield TensorSpec(f"{p}.mlp.gate.weight", (s.experts, h), "router")
    yield TensorSpec(f"{p}.mlp.shared_expert_gate.weight", (1, h), "router")
    for proj, shape in (("gate_proj", (ms, h)), ("up_proj", (ms, h)), ("down_proj", (h, ms))):
        yield TensorSpec(f"{p}.mlp.shared_expert.{proj}", shape, "linear", f"shared.{proj}")
    for e in range(s.experts):
        for proj, shape in (("gate_proj", (m, h)), ("up_proj", (m, h)), ("down_proj", (h, m))):
            yield TensorSpec(f"{p}.mlp.experts.{e}.{proj}", shape, "linear", f"expert.{proj}")
    yield TensorSpec(f"{p}.input_layernorm.weight", (h,), "centred_norm")
    yield TensorSpec(f"{p}.post_attention_layernorm.weight", (h,), "centred_norm")


@dataclass(frozen=True)
class TensorSpec:
    name: str                  # full tensor name (".weight") or linear prefix (quantized)
    shape: tuple[int, ...]     # HF shape [out, in] for linears
    kind: str                  # "linear" | "head" | "embed" | "norm" | "centred_norm" (stored 0: used as 1 + w) | "router"
    role: str = ""             # what a linear is, for reusing generated tensors: "q_proj", "expert.up_proj"...


def tensors(s: Shape) -> Iterator[TensorSpec]:
    """Every tensor of the model, in checkpoint order."""
    if s.is_hybrid:
        yield from _qwen35_tensors(s)
        return
    h, q, kv = s.hidden, s.heads * s.head_dim, s.kv_heads * s.head_dim
    yield TensorSpec("model.embed_tokens.weight", (s.vocab, h), "embed")
    for i in range(s.layers):
        p = f"model.layers.{i}"
        for proj, shape in (("q_proj", (q, h)), ("k_proj", (kv, h)), ("v_proj", (kv, h)), ("o_proj", (h, q))):
            yield TensorSpec(f"{p}.self_attn.{proj}", shape, "linear", proj)
        if s.architecture in QK_NORM_ARCHITECTURES:          # Qwen3's per-head query/key norms
            yield TensorSpec(f"{p}.self_attn.q_norm.weight", (s.head_dim,), "norm")
            yield TensorSpec(f"{p}.self_attn.k_norm.weight", (s.head_dim,), "norm")
        if s.is_moe:
            names = MOE_ARCHITECTURES[s.architecture]      # Mixtral and DBRX as exllamav2 names them
            yield TensorSpec(f"{p}.{names.router}.weight", (s.experts, h), "router")
            e_int = s.expert_intermediate
            for e in range(s.experts):
                for proj, shape in ((names.gate, (e_int, h)), (names.up, (e_int, h)), (names.down, (h, e_int))):
                    yield TensorSpec(f"{p}.{names.experts}.{e}.{proj}", shape, "linear", f"expert.{proj}")
        else:
            for proj, shape in (("gate_proj", (s.intermediate, h)), ("up_proj", (s.intermediate, h)),
                                ("down_proj", (h, s.intermediate))):
                yield TensorSpec(f"{p}.mlp.{proj}", shape, "linear", proj)
        yield TensorSpec(f"{p}.input_layernorm.weight", (h,), "norm")
        yield TensorSpec(f"{p}.post_attention_layernorm.weight", (h,), "norm")
    yield TensorSpec("model.norm.weight", (h,), "norm")
    if not s.tie_embeddings:
        yield TensorSpec("lm_head", (s.vocab, h), "head")


def param_counts(s: Shape) -> tuple[int, int]:
    """(total, active per token) parameters; active counts the embeddings, head, attention, router and
    top-k experts, as model cards do (Qwen3-30B-A3B: 30.5B / 3.3B)."""
    total = active = 0
    for t in tensors(s):
        if t.name.startswith("mtp."):              # the MTP head is a draft, not counted (as model cards do)
            continue
        n = 1
        for d in t.shape:
            n *= d
        total += n
        is_expert = ".experts." in t.name
        if not is_expert or int(t.name.split(".experts.")[1].split(".")[0]) < s.experts_per_token:
            active += n
    return total, active
