"""DBRX for the converter (convert.py): its blocks are calibrated through transformers' own `DbrxBlock`,
rebuilt so that the calibration sees what it handles for the other architectures, and written under the
names exllamav2 gives DBRX (modelfolder's DBRX table: what the engines read).

- `Wqkv` becomes three linears q, k and v over the same input (one Hessian, three GPTQ runs), as
  exllamav2 splits it; clip_qkv still clamps their joined output.
- The router's linear becomes a plain weight (`gate.weight`), kept fp16 as every router is.
- The stacked experts (`w1`, `v1`, `w2` of [E x width, hidden], used as x @ w2) become transformers'
  fused experts module (`gate_up_proj` [E, 2 x width, hidden], `down_proj` [E, hidden, width]): the
  module the calibration routes tokens to and quantizes per expert.

The checkpoint is read as the Hub and transformers store it (`transformer.blocks.N.*`, `transformer.wte`,
`transformer.norm_f`); the output is `model.layers.N.self_attn.q_proj`, `block_sparse_moe.gate`,
`block_sparse_moe.experts.E.w1/v1/w2` (w2 per expert as [hidden, width]), `input_layernorm`,
`post_attention_layernorm`, `model.embed_tokens`, `model.norm`.
"""
from __future__ import annotations

import re

import torch
from torch import nn

from runtime import modelfolder

ARCH = "DbrxForCausalLM"
EMBED, NORM = "transformer.wte.weight", "transformer.norm_f.weight"          # read
OUT_EMBED, OUT_NORM = "model.embed_tokens.weight", "model.norm.weight"         # written

_RENAMES = (                   # the rebuilt block's names -> exllamav2's, inside model.layers.N.; the router
    (r"\.norm_attn_norm\.norm_1\.", ".input_layernorm."),                # and experts as transformers names
    (r"\.norm_attn_norm\.norm_2\.", ".post_attention_layernorm."),        # them, then modelfolder's table
    (r"\.norm_attn_norm\.attn\.Wqkv\.([qkv])\b", r".self_attn.\1_proj"),
    (r"\.norm_attn_norm\.attn\.out_proj\b", ".self_attn.o_proj"),
    (r"\.ffn\.router\.gate\.", ".mlp.gate."),
    (r"\.ffn\.experts\.fused\.", ".mlp.experts."),
)


def stored_name(name: str) -> str:
    """A tensor of the rebuilt block (under `model.layers.N.`) -> its name in the EXL2 folder (the experts' and
    the router's from modelfolder.MOE_ARCHITECTURES, as the engines read them)."""
    for pattern, repl in _RENAMES:
        name = re.sub(pattern, repl, name)
    return modelfolder.stored_name(ARCH, name)


class _Qkv(nn.Module):
    def __init__(self, hidden: int, q: int, kv: int):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(hidden, n, bias=False) for n in (q, kv, kv))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.q(x), self.k(x), self.v(x)], dim=-1)


class _Weight(nn.Module):
    """A router's weight outside nn.Linear, so the converter keeps it as it is."""

    def __init__(self, rows: int, cols: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, cols))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight)


class _Router(nn.Module):
    def __init__(self, hidden: int, experts: int):
        super().__init__()
        self.gate = _Weight(experts, hidden)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.gate(hidden_states.view(-1, hidden_states.shape[-1]))


class _Experts(nn.Module):
    """DBRX's experts call on [B, T, hidden] through transformers' fused experts module on [B x T, hidden]."""

    def __init__(self, fused: nn.Module):
        super().__init__()
        self.fused = fused

    def forward(self, hidden_states, top_k_index, top_k_weights):
        flat = hidden_states.reshape(-1, hidden_states.shape[-1])
        return self.fused(flat, top_k_index, top_k_weights).view(hidden_states.shape)


def _sizes(cfg) -> tuple[int, int, int, int]:
    """(hidden, kv rows, expert width, experts)."""
    hidden = cfg.d_model
    return (hidden, cfg.attn_config.kv_n_heads * (hidden // cfg.n_heads), cfg.ffn_config.ffn_hidden_size,
            cfg.ffn_config.moe_num_experts)


def original_layout(config: dict) -> modelfolder.Layout:
    """The tensors a DBRX checkpoint stores as the Hub holds it (`transformer.*`, stacked experts), with the shapes
    its config (flattened and bounded by modelfolder.read_config) implies: checked before any block is built."""
    hidden, vocab, width, experts = (config[k] for k in ("hidden_size", "vocab_size", "intermediate_size",
                                                         "num_experts"))
    kv = modelfolder.kv_heads(config) * modelfolder.head_dim(config)
    plain: dict[str, tuple[int, ...]] = {EMBED: (vocab, hidden), NORM: (hidden,)}
    if not config.get("tie_word_embeddings", False):
        plain["lm_head.weight"] = (vocab, hidden)
    for i in range(config["num_hidden_layers"]):
        b = f"transformer.blocks.{i}."
        plain.update({f"{b}norm_attn_norm.norm_1.weight": (hidden,), f"{b}norm_attn_norm.norm_2.weight": (hidden,),
                      f"{b}norm_attn_norm.attn.Wqkv.weight": (hidden + 2 * kv, hidden),
                      f"{b}norm_attn_norm.attn.out_proj.weight": (hidden, hidden),
                      f"{b}ffn.router.layer.weight": (experts, hidden),
                      **{f"{b}ffn.experts.mlp.{w}": (experts * width, hidden) for w in ("w1", "v1", "w2")}})
    return modelfolder.Layout(plain, {})


def new_layer(cfg, i: int, ckpt, device: str, error: type[Exception]) -> nn.Module:
    """DbrxBlock i rebuilt as above, in float32 on `device`, filled from the checkpoint (load_layer)."""
    with torch.device("meta"):
        block = _rebuilt(cfg, i)
    block = block.to_empty(device=device).float().eval()
    load_layer(block, ckpt, cfg, i, error)
    return block


def _rebuilt(cfg, i: int) -> nn.Module:
    """transformers' DbrxBlock i with its Wqkv, router and experts replaced as the module docstring says."""
    from transformers import MixtralConfig
    from transformers.models.dbrx.modeling_dbrx import DbrxBlock
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts
    hidden, kv, width, experts = _sizes(cfg)
    act = (cfg.ffn_config.ffn_act_fn or {}).get("name", "silu")
    block = DbrxBlock(cfg, layer_idx=i)
    block.norm_attn_norm.attn.Wqkv = _Qkv(hidden, hidden, kv)
    block.ffn.router = _Router(hidden, experts)
    block.ffn.experts = _Experts(MixtralExperts(MixtralConfig(hidden_size=hidden, intermediate_size=width,
                                                              num_local_experts=experts, hidden_act=act)))
    return block


def load_layer(layer: nn.Module, ckpt, cfg, i: int, error: type[Exception]) -> None:
    """Fill the rebuilt block i from the checkpoint (`transformer.blocks.i.*`), one tensor at a time."""
    hidden, kv, width, experts = _sizes(cfg)
    src = f"transformer.blocks.{i}."

    def get(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        t = ckpt.get_raw(src + name)
        if tuple(t.shape) != shape:
            raise error(f"{ckpt.path}: {src + name} has shape {list(t.shape)}, the config implies {list(shape)}")
        return t

    attn, ffn = layer.norm_attn_norm, layer.ffn
    with torch.no_grad():
        attn.norm_1.weight.copy_(get("norm_attn_norm.norm_1.weight", (hidden,)))
        attn.norm_2.weight.copy_(get("norm_attn_norm.norm_2.weight", (hidden,)))
        q, k, v = get("norm_attn_norm.attn.Wqkv.weight", (hidden + 2 * kv, hidden)).split([hidden, kv, kv])
        for lin, w in zip((attn.attn.Wqkv.q, attn.attn.Wqkv.k, attn.attn.Wqkv.v), (q, k, v)):
            lin.weight.copy_(w)
        attn.attn.out_proj.weight.copy_(get("norm_attn_norm.attn.out_proj.weight", (hidden, hidden)))
        ffn.router.gate.weight.copy_(get("ffn.router.layer.weight", (experts, hidden)))
        fused = ffn.experts.fused
        w1, v1 = (get(f"ffn.experts.mlp.{p}", (experts * width, hidden)).view(experts, width, hidden)
                  for p in ("w1", "v1"))
        fused.gate_up_proj[:, :width].copy_(w1)
        fused.gate_up_proj[:, width:].copy_(v1)
        w2 = get("ffn.experts.mlp.w2", (experts * width, hidden)).view(experts, width, hidden)
        fused.down_proj.copy_(w2.transpose(1, 2))


def head_norm(cfg) -> nn.Module:
    """The final norm (norm_f): a LayerNorm without bias, as DbrxModel builds it."""
    return nn.LayerNorm(cfg.d_model, bias=False)
