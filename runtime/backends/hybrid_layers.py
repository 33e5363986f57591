"""Qwen3.5-MoE's layers for the hybrid engine, built from an EXL2 folder, on CUDA or on the CPU.

The same math as the CPU reference (runtime/reference/qwen35.py, deltanet.py), arranged for a GPU:
dense projections through `QuantLinear` (runtime/backends/quant_linear.py), routed experts through
our `ExpertLayer` (runtime/experts/layer.py, so the offload manager can place them), the shared
expert always resident, the residual stream in float32, the per-sequence state in `HybridCache`
(hybrid_state.py) updated in place.

- Gated DeltaNet: short causal convolution (state: the last K-1 inputs), then the delta rule: the
  recurrent form for forwards of up to `window` rows (decode, verify), which writes the states after
  each row into the cache's snapshot ring for rollback; the chunked form for longer ones (prefill).
  On CUDA with fla installed, fla's Triton kernels compute both (runtime/backends/gdn_kernels.py);
  the PyTorch forms here run elsewhere and are their oracle.
- Gated attention: q (with a per-head output gate), k, v; QK RMS norm; partial RoPE (the first R
  dims); the flat KV cache written at the rows' positions; o = attention * sigmoid(gate).
- MoE: the routed experts (fp32 out) plus sigmoid(shared_expert_gate) * shared expert.

`static=True` runs a short forward with every shape fixed: what a CUDA graph captures. Its attention
reads the cache's first `span` rows, L (the bucket of the last row's position, a multiple of 512
capped at the context: runtime/backends/exl2_graph.bucket), masked by position within them; so one
graph serves every position of its bucket and a step's cost follows the conversation, not the
context setting. Eager forwards slice the cache to its length instead.

T rows, H hidden, NH / KVH heads, D head dim, R rotated dims, HV value heads, dk / dv dims,
C = 2*HK*dk + HV*dv convolution channels, K kernel, S cache capacity.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from runtime import qwen35
from runtime.backends import gdn_kernels, quant_linear
from runtime.backends.hybrid_state import HybridCache
from runtime.errors import InvalidModel, UnsupportedArchitecture
from runtime.experts.layer import ExpertLayer
from runtime.experts.pack import HostArena, pack_layer
from runtime.modelfolder import ModelFolder
from runtime.reference import deltanet, rope
from runtime.tuning import Tuning

CHUNK = deltanet.CHUNK
# The attention kernels of a static forward (the one CUDA graphs capture): memory-efficient attention
# (fp32 scores, any mask) or the plain math. Not cuDNN's, which torch prefers on Hopper with recent
# cuDNN: it failed inside a captured graph on the H200 (runtime/backends/exl2_graph.py) and builds its
# execution plans (kernels compiled and loaded) on a new shape's first call; not flash, which takes no mask.
STATIC_ATTENTION = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
# The attention kernels of an eager forward (prefill chunks, the MTP head's rows): flash where no mask is
# needed (one row), else as a static forward. Not cuDNN's either: on the H200 it built a new execution plan
# for every attended length (~25 ms of host time per call, profiled: each MTP head run of a decode step
# paid it, as its attended length grows by one a step).
EAGER_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def delta_recurrent(q, k, v, g, beta, state: torch.Tensor, hist: Optional[torch.Tensor],
                    slots: Optional[torch.Tensor]) -> torch.Tensor:
    """The delta rule token by token on `state` [HV, dk, dv] float32, updated in place; the state after
    row t is written to hist[slots[t]] when `hist` is given. -> outputs [T, HV, dv] float32."""
    out = []
    s = state.clone()
    for t in range(q.shape[0]):
        s = s * g[t].exp()[:, None, None]
        read = torch.einsum("hk,hkv->hv", k[t], s)
        s = s + k[t, :, :, None] * ((v[t] - read) * beta[t, :, None])[:, None, :]
        out.append(torch.einsum("hk,hkv->hv", q[t], s))
        if hist is not None:
            hist.index_copy_(0, slots[t:t + 1], s[None])
    state.copy_(s)
    return torch.stack(out)


def delta_chunked(q, k, v, g, beta, state: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """runtime/reference/deltanet.chunked on any device; `state` updated in place."""
    outs, s, dev = [], state.clone(), q.device
    for c0 in range(0, q.shape[0], chunk):
        qc, kc, vc = (x[c0:c0 + chunk].transpose(0, 1) for x in (q, k, v))
        gc, bc = g[c0:c0 + chunk].t(), beta[c0:c0 + chunk].t()
        c = qc.shape[1]
        cum = gc.cumsum(-1)
        upper = torch.ones(c, c, dtype=torch.bool, device=dev).triu(1)
        decay = (cum[:, :, None] - cum[:, None, :]).masked_fill(upper, float("-inf")).exp()
        a = (kc @ kc.transpose(1, 2)) * decay * bc[:, :, None]
        system = a.tril(-1) + torch.eye(c, device=dev)
        rhs = torch.cat([vc * bc[..., None], kc * (bc * cum.exp())[..., None]], dim=-1)
        solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        u, w = solved[..., :vc.shape[-1]], solved[..., vc.shape[-1]:]
        writes = u - w @ s
        attn = (qc @ kc.transpose(1, 2)) * decay
        outs.append(((qc * cum.exp()[..., None]) @ s + attn @ writes).transpose(0, 1))
        last = cum[:, -1:]
        s = s * last.exp()[..., None] + (kc * (last - cum).exp()[..., None]).transpose(1, 2) @ writes
    state.copy_(s)
    return torch.cat(outs)


class DeltaNetLayer:
    def __init__(self, spec, index: int, proj, out, conv_weight, decay_scale, dt_bias, out_norm):
        self.spec, self.index = spec, index           # index among the DeltaNet layers
        self.proj, self.out = proj, out               # [C + HV*dv + 2*HV, H], [H, HV*dv]
        self.conv_weight = conv_weight                # [C, K] float32
        self.decay_scale, self.dt_bias = decay_scale, dt_bias      # [HV] float32
        self.out_norm = out_norm                      # [dv]

    def __call__(self, h: torch.Tensor, cache: HybridCache, logged: bool) -> torch.Tensor:
        s, i = self.spec, self.index
        c, vd, hv, hk, dk = s.conv_channels, s.lin_value_heads * s.lin_value_dim, s.lin_value_heads, \
            s.lin_key_heads, s.lin_key_dim
        t, km1 = h.shape[0], s.conv_kernel - 1
        proj = self.proj(h)
        mixed, z = proj[:, :c], proj[:, c:c + vd]
        b, a = proj[:, c + vd:c + vd + hv], proj[:, c + vd + hv:]
        beta = torch.sigmoid(b.float())
        g = self.decay_scale * F.softplus(a.float() + self.dt_bias)
        y, _ = deltanet.conv(mixed, cache.conv[i], self.conv_weight)
        full = torch.cat([cache.conv[i].to(mixed.dtype), mixed])                  # [K-1+T, C]
        if logged and km1:                   # the convolution state after each row: its last K-1 inputs
            wins = full.unfold(0, km1, 1)[1:].transpose(1, 2)                       # [T, K-1, C]
            cache.hist_conv[i].index_copy_(0, cache.slots[:t], wins.to(cache.conv.dtype))
        cache.conv[i].copy_(full[full.shape[0] - km1:])
        q = deltanet.l2norm(y[:, :hk * dk].reshape(t, hk, dk).float())
        k = deltanet.l2norm(y[:, hk * dk:2 * hk * dk].reshape(t, hk, dk).float())
        v = y[:, 2 * hk * dk:].reshape(t, hv, s.lin_value_dim).float()
        if gdn_kernels.available(v):        # fla's kernels: grouped heads and the scale inside them
            if logged:
                o = gdn_kernels.recurrent(q, k, v, g, beta, dk ** -0.5, cache.rec[i], cache.hist_rec[i], cache.slots)
            elif t <= deltanet.RECURRENT_MAX_TOKENS:
                o = gdn_kernels.recurrent(q, k, v, g, beta, dk ** -0.5, cache.rec[i])
            else:
                o = gdn_kernels.chunked(q, k, v, g, beta, dk ** -0.5, cache.rec[i], h.dtype)
            return self._finish(o, z, h.dtype)
        if hv != hk:
            q, k = q.repeat_interleave(hv // hk, dim=1), k.repeat_interleave(hv // hk, dim=1)
        q = q * dk ** -0.5
        if logged:
            o = delta_recurrent(q, k, v, g, beta, cache.rec[i], cache.hist_rec[i], cache.slots)
        elif t <= deltanet.RECURRENT_MAX_TOKENS:
            o = delta_recurrent(q, k, v, g, beta, cache.rec[i], None, None)
        else:
            o = delta_chunked(q, k, v, g, beta, cache.rec[i])
        return self._finish(o, z, h.dtype)

    def _finish(self, o: torch.Tensor, z: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
        """The rule's outputs [T, HV, dv] -> gated RMS norm -> the output projection [T, H]."""
        s, t = self.spec, o.shape[0]
        o = deltanet.gated_norm(o.to(dt), z.reshape(t, s.lin_value_heads, s.lin_value_dim), self.out_norm, s.eps)
        return self.out(o.reshape(t, s.lin_value_heads * s.lin_value_dim))


class AttentionLayer:
    def __init__(self, spec, index: int, proj, out, qk_norm: torch.Tensor):
        self.spec, self.index = spec, index           # index among the full-attention layers
        self.proj, self.out = proj, out               # [2*NH*D + 2*KVH*D, H], [H, NH*D]
        self.qk_norm = qk_norm                        # [2, D] (1 + weight)

    def __call__(self, h, cache: HybridCache, positions: torch.Tensor, cos, sin, end: int, span: Optional[int]):
        """span: a static forward's attended rows L (a Python int fixed per captured graph: the slices are
        views, the mask a kernel over L positions); None: eager, over the cache's first `end` rows."""
        s, j = self.spec, self.index
        static = span is not None
        t, d, nh, nkv, r = h.shape[0], s.head_dim, s.heads, s.kv_heads, s.rotary_dim
        qkv = self.proj(h)
        qg = qkv[:, :2 * nh * d].reshape(t, nh, 2 * d)
        gate = qg[..., d:].reshape(t, nh * d)
        q = F.rms_norm(qg[..., :d], (d,), self.qk_norm[0], s.eps)
        k = F.rms_norm(qkv[:, 2 * nh * d:(2 * nh + nkv) * d].reshape(t, nkv, d), (d,), self.qk_norm[1], s.eps)
        v = qkv[:, (2 * nh + nkv) * d:].reshape(t, nkv, d)
        c, sn = cos[positions][:, None], sin[positions][:, None]                 # [T, 1, R]
        q = torch.cat([rope.apply(q[..., :r], c, sn), q[..., r:]], dim=-1)
        k = torch.cat([rope.apply(k[..., :r], c, sn), k[..., r:]], dim=-1)
        cache.k[j].index_copy_(1, positions, k.transpose(0, 1).to(cache.k.dtype))
        cache.v[j].index_copy_(1, positions, v.transpose(0, 1).to(cache.v.dtype))
        length = span if static else end
        keys, values = cache.k[j:j + 1, :, :length], cache.v[j:j + 1, :, :length]
        groups = nh // nkv
        if static or t > 1:
            mask = torch.arange(length, device=h.device)[None, :] <= positions[:, None]     # [T, S]
            mask = mask.repeat(groups, 1)
        else:
            mask = None
        q = q.reshape(t, nkv, groups, d).permute(1, 2, 0, 3).reshape(1, nkv, groups * t, d)
        with sdpa_kernel(STATIC_ATTENTION if static else EAGER_ATTENTION):     # see the two lists' notes
            o = F.scaled_dot_product_attention(q.to(keys.dtype), keys, values, attn_mask=mask)
        o = o.view(nkv, groups, t, d).permute(2, 0, 1, 3).reshape(t, nh * d)
        return self.out(o.to(h.dtype) * torch.sigmoid(gate))


class MoeBlock:
    """Routed experts (ExpertLayer) plus the gated shared expert (always resident)."""

    def __init__(self, experts: ExpertLayer, shared_gate_up, shared_down, shared_gate):
        self.experts = experts
        self.shared_gate_up, self.shared_down, self.shared_gate = shared_gate_up, shared_down, shared_gate
        self.width = shared_down.in_features

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        """h [T, H] normed (activation dtype) -> [T, H] float32."""
        routed = self.experts(h.half() if h.is_cuda else h)                      # [T, H] float32
        gu = self.shared_gate_up(h)
        shared = self.shared_down(F.silu(gu[:, :self.width]) * gu[:, self.width:])
        return routed + torch.sigmoid(self.shared_gate(h).float()) * shared.float()


class HybridModel:
    def __init__(self, spec, blocks: list, embed, norm, head, cos, sin, dtype, device):
        self.spec, self.blocks = spec, blocks          # [(kind, attn_norm, mlp_norm, mixer, moe)]
        self.embed, self.norm, self.head = embed, norm, head
        self.cos, self.sin = cos, sin
        self.dtype, self.device = dtype, device

    def forward(self, tokens: torch.Tensor, cache: HybridCache, start: int, logged: bool, static: bool = False,
                last_only: bool = False, probe: Optional[Callable[[str], None]] = None,
                span: Optional[int] = None, keep: Optional[list] = None) -> torch.Tensor:
        """tokens [T] (device) at `start` -> logits [T or 1, V] float32; the cache's length is the caller's.
        logged: the cache's positions/slots buffers hold the rows' positions and snapshot slots.
        static: fixed shapes; the full-attention layers read the cache's first `span` rows (the bucket L
        of the last row's position: it must cover that row; the caller's to choose, hybrid_graphs.bucket).
        probe: called with a part's name after each part (hybrid_graphs: which part broke a capture).
        keep: a list that receives the final hidden states of every row [T, H] (after the final norm:
        what the head reads, and what the MTP head drafts from), even when only the last row's logits
        are returned."""
        s, t = self.spec, tokens.shape[0]
        end = start + t
        if static and not (span is not None and t <= span <= cache.capacity and logged):
            raise ValueError(f"a static forward of {t} rows needs the cache's positions buffer and an attended "
                             f"length span in {t}..{cache.capacity}, got {span}")
        probe = probe or (lambda label: None)
        positions = cache.positions[:t] if logged else torch.arange(start, end, device=self.device)
        x = F.embedding(tokens, self.embed).float()                               # [T, H] float32
        probe("the embedding")
        for i, (kind, attn_norm, mlp_norm, mixer, moe) in enumerate(self.blocks):
            h = F.rms_norm(x, (s.hidden,), attn_norm, s.eps).to(self.dtype)
            if kind == qwen35.FULL:
                x = x + mixer(h, cache, positions, self.cos, self.sin, end, span if static else None).float()
            else:
                x = x + mixer(h, cache, logged).float()
            probe(f"layer {i} ({'attention' if kind == qwen35.FULL else 'DeltaNet'})")
            h = F.rms_norm(x, (s.hidden,), mlp_norm, s.eps).to(self.dtype)
            x = x + moe(h)
            if moe.experts.offload is not None:          # the decode prefetch's prediction of the next layer
                moe.experts.after_residual(x.half() if x.is_cuda else x)
            probe(f"layer {i} (MoE)")
        if last_only and keep is None:
            x = x[-1:]
        x = F.rms_norm(x, (s.hidden,), self.norm, s.eps).to(self.dtype)
        if keep is not None:
            keep.append(x)
            x = x[-1:] if last_only else x
        out = self.head(x).float()
        probe("the head")
        return out

    def expert_layers(self) -> list[ExpertLayer]:
        return [b[4].experts for b in self.blocks]

    def linears(self) -> list:
        out = [self.head]
        for _, _, _, mixer, moe in self.blocks:
            out += [mixer.proj, mixer.out, moe.shared_gate_up, moe.shared_down, moe.shared_gate]
        return out

    def expert_bytes_per_token(self) -> int:
        """The routed experts' share of `nbytes_per_token`: top-k experts per layer (their routers not counted)."""
        return sum(moe.experts.bytes_per_token(1) - moe.experts.router_bytes() for _, _, _, _, moe in self.blocks)

    def nbytes_per_token(self) -> int:
        total = self.head.nbytes() + self.spec.hidden * self.embed.element_size()
        for _, _, _, mixer, moe in self.blocks:
            total += mixer.proj.nbytes() + mixer.out.nbytes() + moe.experts.bytes_per_token(1)
            total += moe.shared_gate_up.nbytes() + moe.shared_down.nbytes() + moe.shared_gate.nbytes()
        return total


def centred(folder: ModelFolder, name: str, device: torch.device) -> torch.Tensor:
    """A (1 + weight) norm of the float32 residual stream."""
    return (1.0 + folder.tensor(name).float()).to(device)


def attention_layer(folder: ModelFolder, a: str, spec, index: int, device: torch.device,
                    dtype: torch.dtype) -> AttentionLayer:
    """The gated attention under prefix `a` (`...layers.3.self_attn`, `mtp.layers.0.self_attn`), the
    `index`-th of its cache's attention layers."""
    h, nh, nkv, d = spec.hidden, spec.heads, spec.kv_heads, spec.head_dim
    qk = torch.stack([(1.0 + folder.tensor(f"{a}.{n}_norm.weight").float()) for n in "qk"]).to(device, dtype)
    return AttentionLayer(spec, index, quant_linear.build(folder, [f"{a}.q_proj", f"{a}.k_proj", f"{a}.v_proj"],
                                                          [2 * nh * d, nkv * d, nkv * d], device, dtype),
                          quant_linear.build(folder, [f"{a}.o_proj"], [h], device, dtype), qk)


def moe_block(folder: ModelFolder, mp: str, spec, mlp_norm: torch.Tensor, device: torch.device, dtype: torch.dtype,
              host: Optional[HostArena], on_host: Optional[Callable[[str, int], None]], where: str,
              tuning: Tuning = Tuning()) -> MoeBlock:
    """The routed experts (EXL2 only) and the shared expert under prefix `mp` (`...layers.3.mlp`). host:
    the experts' codes go to this page-locked arena (offload), `on_host(what, bytes)` hearing each stack;
    tuning: the expert kernels' launch shapes."""
    config, h = folder.config, spec.hidden
    ms, m = config["shared_expert_intermediate_size"], config["moe_intermediate_size"]

    def lin(prefixes, outs):
        return quant_linear.build(folder, prefixes, outs, device, dtype)

    def on_packed(name: str, pack) -> None:
        if host is not None and on_host is not None:
            on_host(f"experts of {mp}.{name}", pack.cold.numel() * 4)
    # gate and up packed in down's intermediate order (as pack + align_intermediate, without moving
    # every expert's codes to the device and back), on the device a batch of experts at a time
    packs = pack_layer(lambda name: [_expert_tensors(folder, f"{mp}.experts.{e}.{name}") for e in range(spec.experts)],
                       f"{mp}.experts", device=device, host=host, on_packed=on_packed)
    router = folder.linear(f"{mp}.gate", torch.float32).to(device)
    experts = ExpertLayer(router, *packs, spec.top_k, spec.norm_topk_prob, tuning.grouped, tuning.splitk)
    experts.norm_w = mlp_norm.half()
    moe = MoeBlock(experts, lin([f"{mp}.shared_expert.gate_proj", f"{mp}.shared_expert.up_proj"], [ms, ms]),
                   lin([f"{mp}.shared_expert.down_proj"], [h]), lin([f"{mp}.shared_expert_gate"], [1]))
    if (experts.w1.out_features < m) or moe.shared_down.in_features != ms:
        raise InvalidModel(folder.path, f"{where}: expert or shared expert widths do not match the config")
    return moe


def _expert_tensors(folder: ModelFolder, prefix: str) -> dict:
    if not folder.has(f"{prefix}.q_weight"):
        raise UnsupportedArchitecture(folder.path, f"{prefix} is not EXL2-quantized: the GPU engine runs EXL2 "
                                                   "experts only (the CPU reference engine runs this folder)")
    return folder.exl2_tensors(prefix)                 # exact scales included where stored


def load(folder: ModelFolder, spec, device: torch.device, dtype: torch.dtype, context: int,
         host: Optional[HostArena] = None, on_host: Optional[Callable[[str, int], None]] = None,
         progress: Callable[[int, int], None] = lambda done, total: None, tuning: Tuning = Tuning()) -> HybridModel:
    """Build every layer from the folder. host: the experts' codes go to this page-locked arena
    (offload; `on_host(what, bytes)` hears each stack, for the RAM ledger); tuning: the expert kernels'
    launch shapes."""
    config, p0 = folder.config, qwen35.prefix(folder.config)
    present = set(folder.info.shard_of)

    def lin(prefixes, outs):
        return quant_linear.build(folder, prefixes, outs, device, dtype)

    h = spec.hidden
    hv, vd, c = spec.lin_value_heads, spec.lin_value_heads * spec.lin_value_dim, spec.conv_channels
    blocks, full, linear = [], 0, 0
    for i, kind in enumerate(spec.kinds):
        p, mp = f"{p0}.layers.{i}", f"{p0}.layers.{i}.mlp"
        if qwen35.stacked_experts(config, present, i):
            raise UnsupportedArchitecture(folder.path, f"layer {i} stores its experts stacked (a bf16 release): "
                                                       "the GPU engine runs EXL2 folders only")
        if kind == qwen35.FULL:
            mixer = attention_layer(folder, f"{p}.self_attn", spec, full, device, dtype)
            full += 1
        else:
            a = f"{p}.linear_attn"
            mixer = DeltaNetLayer(
                spec, linear, lin([f"{a}.in_proj_qkv", f"{a}.in_proj_z", f"{a}.in_proj_b", f"{a}.in_proj_a"],
                                  [c, vd, hv, hv]), lin([f"{a}.out_proj"], [h]),
                folder.tensor(f"{a}.conv1d.weight").float()[:, 0].contiguous().to(device),
                (-folder.tensor(f"{a}.A_log").float().exp()).to(device),
                folder.tensor(f"{a}.dt_bias").float().to(device),
                folder.tensor(f"{a}.norm.weight").to(device, dtype))
            linear += 1
        mlp_norm = centred(folder, f"{p}.post_attention_layernorm.weight", device)
        moe = moe_block(folder, mp, spec, mlp_norm, device, dtype, host, on_host, f"layer {i}", tuning)
        blocks.append((kind, centred(folder, f"{p}.input_layernorm.weight", device), mlp_norm, mixer, moe))
        progress(i + 1, spec.layers + 1)
    embed = folder.tensor(f"{p0}.embed_tokens.weight").to(device, dtype)
    has_head = folder.has("lm_head.weight") or folder.has("lm_head.q_weight")
    head = lin(["lm_head"], [spec.vocab]) if has_head else quant_linear.DenseLinear(embed, dtype, device)
    cos, sin = rope.tables(spec.rope, spec.rotary_dim, context, torch.float32)
    # in the activation dtype, as the reference keeps them (angles computed in float32 first)
    model = HybridModel(spec, blocks, embed, centred(folder, f"{p0}.norm.weight", device), head, cos.to(device, dtype),
                        sin.to(device, dtype), dtype, device)
    progress(spec.layers + 1, spec.layers + 1)
    return model
