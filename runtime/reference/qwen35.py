"""Qwen3.5-MoE's text model on the CPU reference engine: spec, weights and the forward pass.

Layers (runtime/qwen35.py reads the folder): Gated DeltaNet ones (deltanet.py) keep a convolution and a
recurrent state per sequence (state.py); gated full-attention ones keep a KV cache. Every layer ends in
an MoE of routed experts (top-k of a softmax, renormalised) plus a shared expert scaled by
sigmoid(shared_expert_gate). The model's RMS norms multiply by (1 + weight): the 1 is added at load.

T new tokens, H hidden, NH query heads, KVH kv heads, D head dim, R rotated dims (partial RoPE),
HK / HV linear key / value heads, dk / dv their dims, C = 2*HK*dk + HV*dv convolution channels.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from runtime import qwen35
from runtime.modelfolder import ModelFolder
from runtime.reference import deltanet, model, rope
from runtime.reference.rope import RopeConfig
from runtime.reference.weights import PRECISIONS, Linear, _act_dtype


@dataclass(frozen=True)
class Spec:
    architecture: str
    hidden: int
    vocab: int
    layers: int
    kinds: tuple[str, ...]             # per layer: qwen35.LINEAR or qwen35.FULL
    heads: int
    kv_heads: int
    head_dim: int
    rotary_dim: int
    eps: float
    max_positions: int
    rope: RopeConfig
    experts: int
    top_k: int
    lin_key_heads: int
    lin_value_heads: int
    lin_key_dim: int
    lin_value_dim: int
    conv_kernel: int
    media_tokens: tuple[int, ...] = ()  # image / video placeholders of the multimodal checkpoint
    norm_topk_prob: bool = True        # read by model._moe, shared with Qwen3-MoE
    expert_norm_p: float = 1.0

    @classmethod
    def from_config(cls, config: dict, where: str) -> "Spec":
        """`config` as runtime/qwen35.read_config left it (flattened, defaults in, bounded)."""
        params = {**(config.get("rope_parameters") or {}), **(config.get("rope_scaling") or {})}
        params.pop("partial_rotary_factor", None)          # applied here: rotary_dim
        if (params.get("rope_type") or params.get("type")) == "mrope":   # text: one position for all sections
            params.pop("type", None)
            params["rope_type"] = "default"
        plain = {**config, "rope_parameters": params, "rope_scaling": None}
        media = tuple(config[k] for k in ("image_token_id", "video_token_id") if type(config.get(k)) is int)
        return cls(config["architectures"][0], config["hidden_size"], config["vocab_size"],
                   config["num_hidden_layers"], tuple(config["layer_types"]), config["num_attention_heads"],
                   config["num_key_value_heads"], config["head_dim"], qwen35.rotary_dim(config),
                   float(config.get("rms_norm_eps", 1e-6)), int(config["max_position_embeddings"]),
                   rope.rope_config(plain, where), config["num_experts"], config["num_experts_per_tok"],
                   config["linear_num_key_heads"], config["linear_num_value_heads"], config["linear_key_head_dim"],
                   config["linear_value_head_dim"], config["linear_conv_kernel_dim"], media)

    @property
    def conv_channels(self) -> int:
        return 2 * self.lin_key_heads * self.lin_key_dim + self.lin_value_heads * self.lin_value_dim

    @property
    def full_layers(self) -> int:
        return self.kinds.count(qwen35.FULL)


@dataclass
class Layer:
    kind: str
    attn_norm: torch.Tensor            # [H] (1 + weight)
    mlp_norm: torch.Tensor             # [H]
    proj: Linear                       # full: [2*NH*D + 2*KVH*D, H] q+gate, k, v; linear: [C + HV*dv + 2*HV, H]
    out: Linear                        # full: o_proj [H, NH*D]; linear: out_proj [H, HV*dv]
    router: torch.Tensor               # [E, H] float32
    experts_gate_up: list[Linear]      # E x [2I, H]
    experts_down: list[Linear]         # E x [H, I]
    shared_gate_up: Linear             # [2Is + 1, H]: the shared expert's gate and up, then its scalar gate
    shared_down: Linear                # [H, Is]
    qk_norm: Optional[torch.Tensor] = None      # full: [2, D] q_norm, k_norm (1 + weight)
    conv_weight: Optional[torch.Tensor] = None  # linear: [C, K] float32
    decay_scale: Optional[torch.Tensor] = None  # linear: -exp(A_log) [HV] float32
    dt_bias: Optional[torch.Tensor] = None      # linear: [HV] float32
    out_norm: Optional[torch.Tensor] = None     # linear: [dv] (weight as stored: this norm has no 1 +)


@dataclass
class Weights:
    embed: torch.Tensor                # [V, H]
    layers: list[Layer]
    norm: torch.Tensor                 # [H] (1 + weight)
    lm_head: Linear
    dtype: torch.dtype
    precision: str
    mtp: Optional[Any] = None          # mtp.MtpWeights: the multi-token-prediction head (mtp.load_weights)

    def nbytes_per_token(self, spec: Spec) -> int:
        """Weight bytes one decode step reads (the active experts only)."""
        total = self.lm_head.nbytes() + spec.hidden * self.embed.element_size()
        for layer in self.layers:
            e = layer.experts_gate_up[0].nbytes() + layer.experts_down[0].nbytes()
            total += (layer.proj.nbytes() + layer.out.nbytes() + layer.shared_gate_up.nbytes()
                      + layer.shared_down.nbytes() + layer.router.numel() * 4 + spec.top_k * e)
        return total


def load_weights(folder: ModelFolder, spec: Spec, precision: str,
                 progress: Callable[[int, int], None] = lambda done, total: None) -> Weights:
    """Read, dequantize and fuse every language-model weight; `progress(done, total)` after each layer."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r} is not one of {', '.join(PRECISIONS)}")
    dt, f32, p0 = _act_dtype(precision), torch.float32, qwen35.prefix(folder.config)

    def centred(name: str) -> torch.Tensor:        # the (1 + weight) RMS norms
        return (1.0 + folder.tensor(name).float()).to(dt)

    layers = []
    present = set(folder.info.shard_of)
    for i, kind in enumerate(spec.kinds):
        p = f"{p0}.layers.{i}"
        layers.append(build_layer(kind, p, spec, precision, lambda n: folder.linear(n, f32), folder.tensor,
                                  qwen35.stacked_experts(folder.config, present, i)))
        progress(i + 1, spec.layers + 1)
    embed = folder.tensor(f"{p0}.embed_tokens.weight")
    head = folder.linear("lm_head", f32) if folder.has("lm_head.weight") or folder.has("lm_head.q_weight") else embed
    weights = Weights(embed.to(dt).contiguous(), layers, centred(f"{p0}.norm.weight"),
                      Linear(head.to(f32), None, precision), dt, precision)
    progress(spec.layers + 1, spec.layers + 1)
    return weights


def build_layer(kind: str, p: str, spec: Spec, precision: str, linear: Callable[[str], torch.Tensor],
                tensor: Callable[[str], torch.Tensor], stacked: bool) -> Layer:
    """One decoder layer under prefix `p` (`model.language_model.layers.3`, `mtp.layers.0`): `linear(prefix)`
    gives a linear's weight [out, in] float32 (stored plain or quantized), `tensor(name)` a stored tensor."""
    dt, m = _act_dtype(precision), f"{p}.mlp"

    def fused(prefixes: list[str]) -> Linear:
        ws = [linear(q) for q in prefixes]
        return Linear(torch.cat(ws) if len(ws) > 1 else ws[0], None, precision)

    def centred(name: str) -> torch.Tensor:        # the (1 + weight) RMS norms
        return (1.0 + tensor(name).float()).to(dt)

    if stacked:
        gate_up, down = tensor(f"{m}.experts.gate_up_proj").float(), tensor(f"{m}.experts.down_proj").float()
        experts_gate_up = [Linear(gate_up[j], None, precision) for j in range(spec.experts)]
        experts_down = [Linear(down[j], None, precision) for j in range(spec.experts)]
    else:
        experts_gate_up = [fused([f"{m}.experts.{j}.gate_proj", f"{m}.experts.{j}.up_proj"]) for j in range(spec.experts)]
        experts_down = [fused([f"{m}.experts.{j}.down_proj"]) for j in range(spec.experts)]
    shared = (fused([f"{m}.shared_expert.gate_proj", f"{m}.shared_expert.up_proj", f"{m}.shared_expert_gate"]),
              fused([f"{m}.shared_expert.down_proj"]))
    norms = centred(f"{p}.input_layernorm.weight"), centred(f"{p}.post_attention_layernorm.weight")
    router = linear(f"{m}.gate").float().contiguous()
    if kind == qwen35.FULL:
        a = f"{p}.self_attn"
        return Layer(kind, *norms, fused([f"{a}.q_proj", f"{a}.k_proj", f"{a}.v_proj"]), fused([f"{a}.o_proj"]),
                     router, experts_gate_up, experts_down, *shared,
                     qk_norm=torch.stack([centred(f"{a}.q_norm.weight"), centred(f"{a}.k_norm.weight")]))
    a = f"{p}.linear_attn"
    return Layer(kind, *norms, fused([f"{a}.in_proj_qkv", f"{a}.in_proj_z", f"{a}.in_proj_b", f"{a}.in_proj_a"]),
                 fused([f"{a}.out_proj"]), router, experts_gate_up, experts_down, *shared,
                 conv_weight=tensor(f"{a}.conv1d.weight").float()[:, 0].contiguous(),
                 decay_scale=-tensor(f"{a}.A_log").float().exp(),
                 dt_bias=tensor(f"{a}.dt_bias").float(),
                 out_norm=tensor(f"{a}.norm.weight").to(dt))


# ----------------------------------------------------------------------------------------------
# The forward pass

def forward(w: Weights, spec: Spec, state, cos: torch.Tensor, sin: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """tokens [T] -> logits [T, V] float32, appended at state.length (state: state.HybridState); every
    DeltaNet layer's inputs to its recurrence are handed to `state.record` for rollback."""
    return w.lm_head(forward_hidden(w, spec, state, cos, sin, tokens)).float()


def forward_hidden(w: Weights, spec: Spec, state, cos: torch.Tensor, sin: torch.Tensor,
                   tokens: torch.Tensor) -> torch.Tensor:
    """`forward` up to the final norm: the hidden states [T, H] that lm_head (and the MTP head) read."""
    t, start = tokens.shape[0], state.length
    end = start + t
    x = F.embedding(tokens, w.embed)                                          # [T, H]
    rot = cos[start:end, None], sin[start:end, None]                          # [T, 1, R]
    mask = model._mask(start, end, 0, spec.heads // spec.kv_heads)
    full = linear = 0
    for layer in w.layers:
        x = layer_forward(layer, spec, state, full if layer.kind == qwen35.FULL else linear, x, rot, mask, start, end)
        full, linear = (full + 1, linear) if layer.kind == qwen35.FULL else (full, linear + 1)
    state.length = end
    return F.rms_norm(x, (spec.hidden,), w.norm, spec.eps)


def layer_forward(layer: Layer, spec: Spec, state, i: int, x: torch.Tensor, rot, mask, start: int,
                  end: int) -> torch.Tensor:
    """One decoder layer on the residual stream x [T, H]; `i` indexes the layer among those of its kind
    in `state` (state.kv for attention, state.conv / state.recurrent for DeltaNet)."""
    h = F.rms_norm(x, (spec.hidden,), layer.attn_norm, spec.eps)
    if layer.kind == qwen35.FULL:
        x = x + _attention(layer, spec, state, i, h, rot, mask, start, end)
    else:
        x = x + _linear_attention(layer, spec, state, i, h)
    h = F.rms_norm(x, (spec.hidden,), layer.mlp_norm, spec.eps)
    return x + _moe(layer, spec, h)


def _attention(layer: Layer, spec: Spec, state, i: int, h: torch.Tensor, rot, mask, start: int, end: int) -> torch.Tensor:
    """Gated attention: per head the q projection gives the query and a gate for its output; q and k are
    RMS-normalised per head, their first R dims rotated; o = attention * sigmoid(gate)."""
    t, d, nh, nkv, r = h.shape[0], spec.head_dim, spec.heads, spec.kv_heads, spec.rotary_dim
    qkv = layer.proj(h)
    qg = qkv[:, :2 * nh * d].view(t, nh, 2 * d)
    gate = qg[..., d:].reshape(t, nh * d)
    q = F.rms_norm(qg[..., :d], (d,), layer.qk_norm[0], spec.eps)
    k = F.rms_norm(qkv[:, 2 * nh * d:(2 * nh + nkv) * d].view(t, nkv, d), (d,), layer.qk_norm[1], spec.eps)
    q = torch.cat([rope.apply(q[..., :r], *rot), q[..., r:]], dim=-1)
    k = torch.cat([rope.apply(k[..., :r], *rot), k[..., r:]], dim=-1)
    cache = state.kv
    cache.k[i, :, start:end] = k.transpose(0, 1)
    cache.v[i, :, start:end] = qkv[:, (2 * nh + nkv) * d:].view(t, nkv, d).transpose(0, 1)
    q = q.reshape(t, nkv, nh // nkv, d).permute(1, 2, 0, 3).reshape(1, nkv, -1, d)   # [1, KVH, G*T, D]
    o = F.scaled_dot_product_attention(q, cache.k[i:i + 1, :, :end], cache.v[i:i + 1, :, :end], attn_mask=mask)
    o = o.view(nkv, nh // nkv, t, d).permute(2, 0, 1, 3).reshape(t, nh * d)
    return layer.out(o * torch.sigmoid(gate))


def _linear_attention(layer: Layer, spec: Spec, state, i: int, h: torch.Tensor) -> torch.Tensor:
    c, vd, hv = spec.conv_channels, spec.lin_value_heads * spec.lin_value_dim, spec.lin_value_heads
    proj = layer.proj(h)
    mixed, z = proj[:, :c], proj[:, c:c + vd]
    b, a = proj[:, c + vd:c + vd + hv], proj[:, c + vd + hv:]
    beta = torch.sigmoid(b.float())                                          # [T, HV]
    g = layer.decay_scale * F.softplus(a.float() + layer.dt_bias)            # log decay, <= 0
    conv_prev, recurrent = state.conv[i], state.recurrent[i]
    state.record(i, mixed, g, beta)
    o, state.conv[i], state.recurrent[i] = mix(layer, spec, mixed, g, beta, conv_prev, recurrent)
    o = deltanet.gated_norm(o.to(h.dtype), z.view(-1, hv, spec.lin_value_dim), layer.out_norm, spec.eps)
    return layer.out(o.reshape(-1, vd))


def mix(layer: Layer, spec: Spec, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
        conv_prev: torch.Tensor, recurrent: torch.Tensor):
    """The convolution and the delta rule over `mixed` [T, C] from the given states ->
    (outputs [T, HV, dv] float32, the next convolution state, the next recurrent state). Rollback runs
    it again over recorded inputs."""
    t, hk, hv, dk = mixed.shape[0], spec.lin_key_heads, spec.lin_value_heads, spec.lin_key_dim
    y, conv_next = deltanet.conv(mixed, conv_prev, layer.conv_weight)
    q = deltanet.l2norm(y[:, :hk * dk].view(t, hk, dk).float())
    k = deltanet.l2norm(y[:, hk * dk:2 * hk * dk].view(t, hk, dk).float())
    v = y[:, 2 * hk * dk:].view(t, hv, spec.lin_value_dim)
    if hv != hk:                                   # each key head serves hv/hk consecutive value heads
        q, k = q.repeat_interleave(hv // hk, dim=1), k.repeat_interleave(hv // hk, dim=1)
    o, recurrent_next = deltanet.delta_rule(q * dk ** -0.5, k, v, g, beta, recurrent)
    return o, conv_next, recurrent_next


def _moe(layer: Layer, spec: Spec, h: torch.Tensor) -> torch.Tensor:
    routed = model._moe(layer, spec, h)                                     # softmax, top-k, renormalised
    i = layer.shared_down.in_features
    gu = layer.shared_gate_up(h)                                            # [T, 2Is + 1]
    shared = layer.shared_down(F.silu(gu[:, :i]) * gu[:, i:2 * i])
    return routed + torch.sigmoid(gu[:, 2 * i:]) * shared
