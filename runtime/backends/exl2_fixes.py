"""Corrections to exllamav2 0.3.2, each with what was wrong and how it was found.

- Qwen3's query/key head norms: exllamav2 mean-centres them (LayerNorm); Qwen3 uses RMSNorm.
- Attention over several rows without flash-attn or xformers: its SDPA branch is not causal.
  `causal_sdpa_attention` wraps it; `prefill_attention_is_causal` checks the result on a small
  problem (runtime/backends/exl2.py `choose_prefill_attention` decides what runs).
"""
from __future__ import annotations

import torch


def rms_head_norms(config) -> bool:
    """Make exllamav2 normalise Qwen3's query/key heads with RMSNorm, as Qwen3 does; True if changed.

    exllamav2 0.3.2 registers Qwen3 and Qwen3-MoE with `use_qk_norm` but leaves its architecture
    default `headnorm = "layernorm"` (only Gemma 3 sets "rmsnorm"), so every head was mean-centred
    before scaling: on the H200, layer 0's queries differed from the fp32 reference by 13% while
    the q/k/v/o weights, norm weights and RoPE tables agreed to fp16 rounding."""
    lm = config.arch.lm
    if config.architecture in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM") and lm.headnorm != "rmsnorm":
        lm.headnorm = "rmsnorm"
        return True
    return False


def causal_sdpa_attention(original):
    """exllamav2's `ExLlamaV2Attention._attn_torch`, with the SDPA branch made causal.

    Without flash-attn and xformers, exllamav2 0.3.2 runs attention for more than one row in
    `_attn_torch`. Its SDPA branch picks the mask with `if layer in block_diag_layers or causal:`
    and so, for ordinary causal attention, passes `get_block_diag_mask()`, which is None without
    packed sequences: SDPA then attends to every row, the future included. Prefill and multi-row
    verify were silently non-causal (the first rows of a prompt saw the whole prompt). This wrapper
    handles the ordinary case (causal, no input mask, no sliding window, no soft-capping) with
    SDPA and a lower-right causal bias, and leaves every other case to exllamav2."""
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right

    def _attn_torch(self, batch_size, q_len, q_states, k_states, v_states, attn_params, cfg, causal=True):
        if (not causal or q_len == 1 or cfg.no_sdpa or cfg.attn_logit_softcapping or self.sliding_window
                or getattr(attn_params, "paged", False) or not attn_params.is_causal()
                or self.layer_idx in attn_params.block_diag_layers):
            return original(self, batch_size, q_len, q_states, k_states, v_states, attn_params, cfg, causal)
        q, k, v = (t.transpose(1, 2) for t in (q_states, k_states, v_states))     # [B, heads, rows, D]
        groups = q.shape[1] // k.shape[1]
        if groups > 1:                  # kv head j serves query heads j*groups .. j*groups + groups-1
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, causal_lower_right(q_len, k.shape[2]), scale=self.scaling)
        return out.transpose(1, 2).reshape(batch_size, q_len, q.shape[1] * q.shape[3])

    _attn_torch.wraps_exllamav2 = original
    return _attn_torch


def prefill_attention_is_causal(attn_torch, config, head_dim: int = 128) -> bool:
    """Run `attn_torch` (an `_attn_torch` as above) on small problems, a fresh prompt and rows
    appended to a cache, against softmax with an explicit causal mask, in float32."""
    from types import SimpleNamespace
    from exllamav2.attn_params import Params
    g = torch.Generator(device="cuda").manual_seed(0)
    heads, kv_heads = 8, 2
    fake = SimpleNamespace(scaling=head_dim ** -0.5, sliding_window=0, layer_idx=0,
                           num_key_value_groups=heads // kv_heads)
    fake.repeat_kv = lambda x, n: x if n == 1 else x.repeat_interleave(n, dim=1)
    for q_len, kv_len in ((24, 24), (5, 29)):
        q = torch.randn(1, q_len, heads, head_dim, device="cuda", dtype=torch.float16, generator=g)
        k, v = (torch.randn(1, kv_len, kv_heads, head_dim, device="cuda", dtype=torch.float16, generator=g)
                for _ in range(2))
        params = Params(1, q_len, kv_len - q_len)
        got = attn_torch(fake, 1, q_len, q, k, v, params, config).float().view(q_len, heads, head_dim)
        qf, kf, vf = q[0].float().transpose(0, 1), k[0].float().transpose(0, 1), v[0].float().transpose(0, 1)
        kf, vf = kf.repeat_interleave(heads // kv_heads, 0), vf.repeat_interleave(heads // kv_heads, 0)
        allowed = (torch.arange(kv_len, device="cuda")[None, :]
                   <= torch.arange(q_len, device="cuda")[:, None] + (kv_len - q_len))
        s = (qf @ kf.transpose(-1, -2)) * head_dim ** -0.5
        ref = (torch.softmax(s.masked_fill(~allowed, float("-inf")), dim=-1) @ vf).transpose(0, 1)
        if ((got - ref).norm() / ref.norm()).item() > 1e-2:
            return False
    return True
