"""The reference engine's weights: read from a model folder, dequantized, fused for a lean decode step.

Fusions (done once at load): q/k/v into one [Q+2K, H] matrix, gate/up into one [2I, H] matrix (per
expert for MoE). Storage precision is chosen per load: "float32" (parity with transformers),
"bfloat16" (half the bytes per token) or "int8" (integer codes and int8 activations through the CPU
kernel, qlinear.py: an EXL2 folder's own codes and scales, its exact scales where a linear has them (an imported
GPTQ build's), plain weights as 8-bit codes per group; bfloat16
activations between the projections).

H hidden, V vocab, I intermediate, E experts, D head dim, Q = heads*D, K = kv heads*D.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from runtime.modelfolder import (MOE_ARCHITECTURES, QK_NORM_ARCHITECTURES, ModelFolder, head_dim, is_moe_layer,
                                 kv_heads)
from runtime.errors import UnsupportedArchitecture
from runtime.reference import qlinear
from runtime.reference.rope import RopeConfig, rope_config

PRECISIONS = ("float32", "bfloat16", "int8")


@dataclass(frozen=True)
class Spec:
    """The numbers of a model that the forward pass needs, from config.json."""
    architecture: str
    hidden: int
    vocab: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    qk_norm: bool
    max_positions: int
    rope: RopeConfig
    experts: int
    top_k: int
    norm_topk_prob: bool
    sliding_window: int = 0                # keys a query sees at most (0: all); Mixtral's config may set one
    layer_norm: bool = False               # DBRX: bias-free LayerNorm where the others use RMSNorm
    clip_qkv: float = 0.0                  # DBRX: q, k and v clamped to [-clip, clip] (0: not)
    expert_norm_p: float = 1.0             # the p of the p-norm that renormalises top-k weights (DBRX's own p)

    @classmethod
    def from_config(cls, config: dict, where: str) -> "Spec":
        arch = config["architectures"][0]
        moe = arch in MOE_ARCHITECTURES
        if arch == "DbrxForCausalLM":
            return cls._dbrx(config, where)
        if config.get("hidden_act", "silu") != "silu":
            raise UnsupportedArchitecture(where,
                                          f"activation {config['hidden_act']!r} is not supported (only silu)")
        return cls(arch, config["hidden_size"], config["vocab_size"], config["num_hidden_layers"],
                   config["num_attention_heads"], kv_heads(config), head_dim(config),
                   float(config.get("rms_norm_eps", 1e-6)), arch in QK_NORM_ARCHITECTURES,
                   int(config.get("max_position_embeddings") or 2048), rope_config(config, where),
                   config["num_experts"] if moe else 0, config["num_experts_per_tok"] if moe else 0,
                   # Mixtral's softmax over the top-k logits is the top-k probabilities renormalised
                   arch == "MixtralForCausalLM" or bool(config.get("norm_topk_prob", False)),
                   (config.get("sliding_window") or 0) if arch == "MixtralForCausalLM" else 0)

    @classmethod
    def _dbrx(cls, config: dict, where: str) -> "Spec":
        """DBRX (its config flattened by the model folder): LayerNorm (eps 1e-5), clip_qkv, top-k weights
        divided by their p-norm when ffn_config.moe_normalize_expert_weights sets p (1 in the releases)."""
        p = (config.get("ffn_config") or {}).get("moe_normalize_expert_weights", 1.0)
        return cls("DbrxForCausalLM", config["hidden_size"], config["vocab_size"], config["num_hidden_layers"],
                   config["num_attention_heads"], kv_heads(config), head_dim(config), 1e-5, False,
                   int(config.get("max_position_embeddings") or 2048), rope_config(config, where),
                   config["num_experts"], config["num_experts_per_tok"], p is not None, layer_norm=True,
                   clip_qkv=float(config.get("clip_qkv") or 0.0), expert_norm_p=float(p or 1.0))


class Linear:
    """y = x @ W.T (+ b). W stored as float ("float32", "bfloat16"); for "int8", as integer codes read by the
    CPU kernel (qlinear.QLinear: an EXL2 linear's own codes when `exl2` gives its tensors, else 8-bit codes
    per group of inputs), int8 activations; where that kernel cannot be built (no C++ compiler), as int8
    codes [out, in] with one scale per row, torch's int8 kernel."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor], precision: str,
                 exl2: Optional[tuple[list, list[int]]] = None):
        """exl2: (EXL2 tensor sets, out features) of the projections `weight` was dequantized from."""
        self.bias = None if bias is None else bias.to(_act_dtype(precision))
        self.in_features = weight.shape[1]               # kept: the int8 kernel's linear holds no float weight
        self.q = None
        self._norm: Optional[tuple[torch.Tensor, torch.Tensor]] = None     # (norm weight, its float32 copy)
        if precision == "int8" and (ext := qlinear.kernel()) is not None:
            from runtime.cpu.experts import CpuExpertsError
            try:
                self.q = qlinear.QLinear.from_exl2(*exl2, self.bias, ext) if exl2 else None
            except CpuExpertsError:                         # groups the kernel cannot take: requantized
                self.q = None
            self.q = self.q or qlinear.QLinear.from_float(weight, self.bias, ext)
            self.weight = self.scale = None
        elif precision == "int8":
            scale = (weight.abs().amax(dim=1) / 127).clamp(min=1e-12)            # [out]
            self.weight = torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
            self.scale = scale.to(torch.bfloat16)
        else:
            self.weight = weight.to(_act_dtype(precision)).contiguous()
            self.scale = None

    # torch's int8 kernel (no C++ compiler here): above this many rows (prefill) dequantizing to bf16 and
    # using the bf16 GEMM is faster than torch's int8 kernel, which streams the weights once per few rows.
    INT8_KERNEL_MAX_ROWS = 32

    # torch's int8 kernel reads past the row for inputs not a multiple of 16 wide (a segfault, measured
    # on torch 2.x CPU); such shapes (tiny or hostile configs) take the dequantizing path instead.
    INT8_KERNEL_WIDTH = 16

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.q is not None:
            return self.q(x)
        if self.scale is None:
            return F.linear(x, self.weight, self.bias)
        if x.shape[0] > self.INT8_KERNEL_MAX_ROWS or x.shape[-1] % self.INT8_KERNEL_WIDTH:
            return F.linear(x, self.weight.to(x.dtype) * self.scale[:, None], self.bias)
        y = torch._weight_int8pack_mm(x, self.weight, self.scale)
        return y if self.bias is None else y + self.bias

    def normed(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """self(rms_norm(x) * weight): in the CPU kernel's call where there is one (no torch operation)."""
        if self.q is None:
            return self(F.rms_norm(x, (x.shape[-1],), weight, eps))
        if self._norm is None or self._norm[0] is not weight:
            self._norm = (weight, weight.float().contiguous())
        return self.q(x, norm=self._norm[1], eps=eps)

    def add_to(self, residual: torch.Tensor, x: torch.Tensor, silu_mul: bool = False) -> torch.Tensor:
        """residual + self(x), or self(silu(gate) * up) of x = [gate | up]; the CPU kernel adds into
        `residual` in place (a tensor of the forward's own) and returns it."""
        if self.q is None:
            if silu_mul:
                gate, up = x.chunk(2, dim=-1)
                x = F.silu(gate) * up
            return residual + self(x)
        return self.q(x, act="silu_mul" if silu_mul else "none", residual=residual)

    @property
    def kernel(self) -> str:
        """What computes it: the CPU kernel's vector path, or torch."""
        return self.q.ext.isa() if self.q is not None else "torch"

    def nbytes(self) -> int:
        if self.q is not None:
            return self.q.nbytes()
        return self.weight.numel() * self.weight.element_size() + (0 if self.scale is None else self.scale.numel() * 2)


@dataclass
class Layer:
    attn_norm: torch.Tensor                # [H]
    qkv: Linear                            # [Q+2K, H]
    o: Linear                              # [H, Q]
    qk_norm: Optional[torch.Tensor]        # [heads+kv_heads, D]: q_norm repeated per head, then k_norm (Qwen3)
    mlp_norm: torch.Tensor                 # [H]
    gate_up: Optional[Linear]              # [2I, H] dense MLP
    down: Optional[Linear]                 # [H, I]
    router: Optional[torch.Tensor] = None  # [E, H] float32 (MoE layers)
    experts_gate_up: Optional[list[Linear]] = None   # E x [2I, H]
    experts_down: Optional[list[Linear]] = None      # E x [H, I]

    @functools.cached_property
    def qk_norm_f32(self) -> Optional[torch.Tensor]:
        """qk_norm as the CPU kernel's attention takes it."""
        return None if self.qk_norm is None else self.qk_norm.float().contiguous()


@dataclass
class Weights:
    embed: torch.Tensor                    # [V, H]
    layers: list[Layer]
    norm: torch.Tensor                     # [H]
    lm_head: Linear                        # [V, H]
    dtype: torch.dtype                     # activations
    precision: str

    def nbytes_per_token(self, spec: Spec) -> int:
        """Weight bytes one decode step reads (only the active experts of MoE layers)."""
        total = self.lm_head.nbytes() + self.embed.shape[1] * self.embed.element_size()
        for layer in self.layers:
            total += layer.qkv.nbytes() + layer.o.nbytes()
            if layer.gate_up is not None:
                total += layer.gate_up.nbytes() + layer.down.nbytes()
            else:
                e = layer.experts_gate_up[0].nbytes() + layer.experts_down[0].nbytes()
                total += layer.router.numel() * 4 + spec.top_k * e
        return total


def _act_dtype(precision: str) -> torch.dtype:
    return torch.float32 if precision == "float32" else torch.bfloat16


def load_weights(folder: ModelFolder, spec: Spec, precision: str,
                 progress: Callable[[int, int], None] = lambda done, total: None, device="cpu") -> Weights:
    """Read, dequantize and fuse every weight. `progress(done, total)` after each layer. device: where the
    weights are dequantized and kept ("cpu", or "cuda" for float32/bfloat16: the same values, dequantized there)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r} is not one of {', '.join(PRECISIONS)}")
    if precision == "int8" and torch.device(device).type != "cpu":
        raise ValueError(f"precision 'int8' runs on the CPU only, not on {device}")
    dt = _act_dtype(precision)
    f32 = torch.float32

    def tensor(name: str) -> torch.Tensor:
        return folder.tensor(name).to(device)

    def exl2(prefixes: list[str], ws: list[torch.Tensor]) -> Optional[tuple[list, list[int]]]:
        """The EXL2 tensor sets of the projections (the integer kernel keeps their codes, and their exact scales
        where they have them), or None."""
        if precision != "int8" or not all(folder.has(f"{p}.q_weight") for p in prefixes):
            return None
        return [folder.exl2_tensors(p) for p in prefixes], [w.shape[0] for w in ws]

    def fused(prefixes: list[str]) -> Linear:
        ws = [folder.linear(p, f32, device) for p in prefixes]
        bs = [None if (b := folder.bias(p, f32)) is None else b.to(device) for p in prefixes]
        bias = None if all(b is None for b in bs) else \
            torch.cat([b if b is not None else w.new_zeros(w.shape[0]) for w, b in zip(ws, bs)])
        return Linear(torch.cat(ws) if len(ws) > 1 else ws[0], bias, precision, exl2(prefixes, ws))

    layers = []
    for i in range(spec.layers):
        p = f"model.layers.{i}"
        a = f"{p}.self_attn"
        qk_norm = None
        if spec.qk_norm:
            qk_norm = torch.cat([tensor(f"{a}.q_norm.weight").to(dt)[None].expand(spec.heads, -1),
                                 tensor(f"{a}.k_norm.weight").to(dt)[None].expand(spec.kv_heads, -1)])
        layer = Layer(tensor(f"{p}.input_layernorm.weight").to(dt),
                      fused([f"{a}.q_proj", f"{a}.k_proj", f"{a}.v_proj"]), fused([f"{a}.o_proj"]), qk_norm,
                      tensor(f"{p}.post_attention_layernorm.weight").to(dt), None, None)
        if is_moe_layer(folder.config, i):
            names = MOE_ARCHITECTURES[spec.architecture]
            e = f"{p}.{names.experts}"
            layer.router = folder.linear(f"{p}.{names.router}", f32, device).contiguous()
            layer.experts_gate_up = [fused([f"{e}.{j}.{names.gate}", f"{e}.{j}.{names.up}"])
                                     for j in range(spec.experts)]
            layer.experts_down = [fused([f"{e}.{j}.{names.down}"]) for j in range(spec.experts)]
        else:
            layer.gate_up = fused([f"{p}.mlp.gate_proj", f"{p}.mlp.up_proj"])
            layer.down = fused([f"{p}.mlp.down_proj"])
        layers.append(layer)
        progress(i + 1, spec.layers + 1)
    embed = tensor("model.embed_tokens.weight")
    head = folder.linear("lm_head", f32, device) if folder.has("lm_head.weight") or folder.has("lm_head.q_weight") \
        else embed
    head_exl2 = exl2(["lm_head"], [head]) if head is not embed else None
    weights = Weights(embed.to(dt).contiguous(), layers, tensor("model.norm.weight").to(dt),
                      Linear(head.to(f32), None, precision, head_exl2), dt, precision)
    progress(spec.layers + 1, spec.layers + 1)
    return weights
