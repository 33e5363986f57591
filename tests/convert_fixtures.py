"""Tiny random Hugging Face checkpoints (safetensors + tokenizer) for the converter's tests."""
from __future__ import annotations

from pathlib import Path

import torch

from runtime.exl2.synth_tokenizer import write_tokenizer

VOCAB = 320
TEXT = " ".join(f"The {w} of the river ran past the {v} town at {n} in the morning." for n, (w, v) in
                enumerate([("water", "old"), ("sound", "quiet"), ("light", "small"), ("cold", "grey")] * 40))


def tiny_checkpoint(path: Path, arch: str = "llama", seed: int = 0, layers: int = 2, hidden: int = 64,
                    head_dim: int = 16, vocab: int = VOCAB, experts: int = 4, top_k: int = 2) -> Path:
    """A random-weight HF model folder of the given architecture (llama, qwen3, qwen3_moe, mixtral, dbrx), its
    tensors named as transformers saves them (as the Hub holds them: Mixtral's block_sparse_moe.experts.E.w1,
    DBRX's transformer.blocks.N with its fused Wqkv and stacked experts); 4 heads, 2 of keys and values."""
    import transformers as tf

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  tie_word_embeddings=False, head_dim=head_dim)
    moe = dict(num_experts_per_tok=top_k)
    if arch == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**common))
    elif arch == "qwen3":
        model = tf.Qwen3ForCausalLM(tf.Qwen3Config(**common))
    elif arch == "dbrx":             # a clip_qkv the random q/k/v (std ~0.16) reach; weights by their 1-norm
        model = tf.DbrxForCausalLM(tf.DbrxConfig(
            d_model=hidden, n_heads=4, n_layers=layers, vocab_size=vocab, max_seq_len=512, tie_word_embeddings=False,
            attn_config=dict(kv_n_heads=2, clip_qkv=0.3, rope_theta=500000.0),
            ffn_config=dict(ffn_hidden_size=hidden, moe_num_experts=experts, moe_top_k=top_k,
                            moe_normalize_expert_weights=1.0)))
    elif arch == "mixtral":
        model = tf.MixtralForCausalLM(tf.MixtralConfig(**common, num_local_experts=experts, **moe))
    else:
        model = tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(**common, num_experts=experts, moe_intermediate_size=hidden,
                                                         **moe))
    model.save_pretrained(path, safe_serialization=True)
    write_tokenizer(path, vocab, vocab - 8, 512)
    return path


def link_out(folder: Path, name: str, outside: Path) -> Path:
    """`folder/name` made a link to a file outside the folder (the file moved there, or a new one): -> that file."""
    secret = outside / f"secret-{name}"
    if (folder / name).exists():
        (folder / name).rename(secret)
    else:
        secret.write_text("{{ 'the contents of another file' }}")
    (folder / name).symlink_to(secret)
    return secret
