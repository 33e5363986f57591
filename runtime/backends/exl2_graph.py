"""A whole decode step (one token, batch 1, FP16 cache) captured as one CUDA graph per context bucket.

exllamav2's layer loop costs a host round trip per module (Python, argument checks, host-side
position bookkeeping), tens of microseconds each, ~100 modules per token. Here the step runs from
device-side state only:
- the position lives in a device tensor: RoPE reads it (exllamav2's `past_lens` with past_len = -1),
  and so does the attention;
- attention runs over the first L cache rows, L = the position rounded up to a bucket of `BUCKET`
  tokens, so one graph serves every position in its bucket. By default one Triton kernel (plus a
  small merge) writes the new K/V row and attends rows 0..pos (`runtime/backends/attention.py`);
  `MOEDESK_GRAPH_ATTN=bmm` selects two batched matmuls with `index_copy_` and a mask instead,
  `=sdpa` torch's fused attention with the same mask (where it agrees with bmm);
- MoE layers are `OwnMoE`, whose kernels read the routing on the device.
The embedding stays on the CPU (as exllamav2 keeps it); its row is copied into the graph's input.

Letters: S cache length, L attended length, Hq query heads, Hk KV heads, R = Hq // Hk, D head dim.
"""
from __future__ import annotations

import os

import torch

from runtime.backends.attention import decode_attention

BUCKET = 512
ATTENTION_KINDS = ("triton", "bmm", "sdpa")


class DecodeGraphs:
    def __init__(self, model, cache):
        from exllamav2.attn import ExLlamaV2Attention
        from exllamav2.ext import exllamav2_ext, none_tensor
        self.ext, self.none = exllamav2_ext, none_tensor
        self.Attention = ExLlamaV2Attention
        self.model = model
        self.cache = cache
        self.embed = model.modules[0]
        self.body = model.modules[1:]
        dev = cache.key_states[0].device
        self.device = dev
        cfg = model.config
        self.x_in = torch.zeros((1, 1, cfg.hidden_size), dtype=torch.float16, device=dev)
        self.pos32 = torch.zeros((1,), dtype=torch.int32, device=dev)
        self.pos64 = torch.zeros((1,), dtype=torch.int64, device=dev)
        self.arange = torch.arange(cache.max_seq_len, device=dev)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None
        self.stream = torch.cuda.Stream(device=dev)
        kind = os.environ.get("MOEDESK_GRAPH_ATTN", "triton")
        if kind not in ATTENTION_KINDS:
            raise ValueError(f"MOEDESK_GRAPH_ATTN={kind!r}: expected one of {', '.join(ATTENTION_KINDS)}")
        # SDPA inside a captured graph failed on the test machine (torch 2.11, cuDNN attention): opt-in only.
        if kind == "sdpa" and not self._pick_attention():
            kind = "bmm"
        self.attention = kind

    @classmethod
    def build_if_supported(cls, model, cache) -> "DecodeGraphs | None":
        """The graph path, or None where this model/cache/layout is not covered (the loop runs instead)."""
        from exllamav2 import ExLlamaV2Cache
        from exllamav2.attn import ExLlamaV2Attention
        from exllamav2.mlp import ExLlamaV2MLP
        from exllamav2.moe_mlp import ExLlamaV2MoEMLP
        from exllamav2.rmsnorm import ExLlamaV2RMSNorm
        from exllamav2.linear import ExLlamaV2Linear
        from runtime.experts.exl2_module import OwnMoE
        if type(cache) is not ExLlamaV2Cache or cache.batch_size != 1:
            return None
        for m in model.modules[1:]:
            if isinstance(m, ExLlamaV2Attention):
                if m.q_handle is None or m.sliding_window or model.config.attn_logit_softcapping:
                    return None
            elif isinstance(m, ExLlamaV2MoEMLP) and not isinstance(m, OwnMoE):
                return None                                  # stock MoE synchronises with the host
            elif not isinstance(m, (ExLlamaV2MLP, ExLlamaV2RMSNorm, ExLlamaV2Linear, OwnMoE)):
                return None
        return cls(model, cache)

    # -- the captured step ---------------------------------------------------------------------------

    def _attention(self, a, x: torch.Tensor, L: int, mask: torch.Tensor | None) -> torch.Tensor:
        Hq, Hk, D = a.num_attention_heads, a.num_key_value_heads, a.head_dim
        q = torch.empty((1, 1, Hq * D), dtype=torch.float16, device=x.device)
        k = torch.empty((1, 1, Hk * D), dtype=torch.float16, device=x.device)
        v = torch.empty((1, 1, Hk * D), dtype=torch.float16, device=x.device)
        ctx = self.model.get_device_context(a.device_idx)
        # Norm, Q/K/V projections, head norms, RoPE at position pos32 (past_len -1: read it on the device).
        self.ext.q_attn_forward_1(a.q_handle, x, 1, 1, -1, self.pos32, q, k, v,
                                  ctx.sin[a.rope_index], ctx.cos[a.rope_index], [], self.none)
        K = self.cache.key_states[a.layer_idx]                        # [1, S, Hk, D]
        V = self.cache.value_states[a.layer_idx]
        if self.attention == "triton":
            o = decode_attention(q, k, v, K, V, self.pos32, L, a.scaling)   # writes row pos of K, V
        else:
            K.index_copy_(1, self.pos64, k.view(1, 1, Hk, D))
            V.index_copy_(1, self.pos64, v.view(1, 1, Hk, D))
            attend = self._attn_sdpa if self.attention == "sdpa" else self._attn_bmm
            o = attend(q, K, V, L, mask, Hq, Hk, D, a.scaling)
        self.ext.q_attn_forward_2(a.q_handle, x, o, 1, 1, [], self.none)
        return x

    @staticmethod
    def _attn_bmm(q, K, V, L, mask, Hq, Hk, D, scale):
        """Two batched matmuls over the KV heads; mask: fp32 additive [L]."""
        Kl = K[0, :L].permute(1, 2, 0)                                 # [Hk, D, L] (a view)
        Vl = V[0, :L].permute(1, 0, 2)                                 # [Hk, L, D]
        s = torch.bmm(q.view(Hk, Hq // Hk, D), Kl).float()             # [Hk, R, L]
        p = torch.softmax(s * scale + mask, dim=-1).half()
        return torch.bmm(p, Vl).view(1, 1, Hq * D)                     # [1, 1, Hq*D]

    @staticmethod
    def _attn_sdpa(q, K, V, L, mask, Hq, Hk, D, scale):
        """One fused attention call (grouped-query heads, boolean mask over the L rows)."""
        import torch.nn.functional as F
        qh = q.view(1, Hq, 1, D)
        Kl = K[:, :L].transpose(1, 2)                                  # [1, Hk, L, D] (a view)
        Vl = V[:, :L].transpose(1, 2)
        o = F.scaled_dot_product_attention(qh, Kl, Vl, attn_mask=(mask == 0).view(1, 1, 1, L),
                                           scale=scale, enable_gqa=True)
        return o.reshape(1, 1, Hq * D)

    def _pick_attention(self) -> bool:
        """Use SDPA where this torch runs it with these shapes and it agrees with the bmm path."""
        a = next(m for m in self.body if isinstance(m, self.Attention))
        Hq, Hk, D, L = a.num_attention_heads, a.num_key_value_heads, a.head_dim, 64
        dev = self.device
        q = torch.randn(1, 1, Hq * D, device=dev, dtype=torch.float16)
        K = torch.randn(1, L, Hk, D, device=dev, dtype=torch.float16)
        V = torch.randn(1, L, Hk, D, device=dev, dtype=torch.float16)
        mask = torch.where(torch.arange(L, device=dev) <= 40, 0.0, float("-inf"))
        try:
            ref = self._attn_bmm(q, K, V, L, mask, Hq, Hk, D, a.scaling).float()
            got = self._attn_sdpa(q, K, V, L, mask, Hq, Hk, D, a.scaling).float()
            return bool(((got - ref).norm() / ref.norm()) < 5e-3)
        except Exception:
            return False

    def _mask(self, L: int) -> torch.Tensor | None:
        """fp32 additive [L] for the bmm/sdpa paths; the Triton kernel reads the position itself."""
        if self.attention == "triton":
            return None
        return torch.where(self.arange[:L] <= self.pos64, 0.0, float("-inf"))

    def _step(self, L: int) -> torch.Tensor:
        x = self.x_in.clone()
        mask = self._mask(L)
        for m in self.body:
            if isinstance(m, self.Attention):
                x = self._attention(m, x, L, mask)
            else:
                x = m.forward(x)
        return x.view(1, -1)                                           # [1, V'] logits

    def _capture(self, L: int):
        s = self.stream
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            out = self._step(L)                                        # warm-up: compiles, runs the real step
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        # "relaxed": calls that are unsafe but harmless during a capture (a library allocating its
        # workspace, a kernel module loaded lazily on first launch, another thread querying the
        # device) run instead of invalidating it. The first measured capture ran in the default
        # "global" mode; later ones failed there and in "thread_local" (see runtime/experts/NOTES.md).
        mode = os.environ.get("MOEDESK_CAPTURE_MODE", "relaxed")
        try:
            with torch.cuda.graph(g, pool=self.pool, stream=s, capture_error_mode=mode):
                out = self._step(L)
        except RuntimeError as e:
            culprit = self._find_capture_breaker(L, mode)
            raise RuntimeError(f"{e} [capture first invalidated by: {culprit}]") from None
        if self.pool is None:
            self.pool = g.pool()
        self.graphs[L] = (g, out)

    def _find_capture_breaker(self, L: int, mode: str) -> str:
        """After a failed capture: capture again, asking the driver after every module whether the
        capture is still valid, and name the first module that invalidated it."""
        import ctypes
        try:
            cu = ctypes.CDLL("libcuda.so.1")
        except OSError:
            return "unknown (libcuda not found)"
        s = self.stream
        culprit = "none found: the capture failed at its end"

        def status() -> int:                 # CUstreamCaptureStatus: 0 none, 1 active, 2 invalidated
            st = ctypes.c_int(0)
            cu.cuStreamIsCapturing(ctypes.c_void_p(s.cuda_stream), ctypes.byref(st))
            return st.value

        class Stop(Exception):
            pass

        x = self.x_in.clone()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(g, stream=s, capture_error_mode=mode):
                mask = self._mask(L)
                if status() == 2:
                    culprit = "the attention mask"
                    raise Stop
                for m in self.body:
                    x = self._attention(m, x, L, mask) if isinstance(m, self.Attention) else m.forward(x)
                    if status() == 2:
                        culprit = f"{type(m).__name__} {getattr(m, 'key', '?')}"
                        raise Stop
        except Exception:
            pass
        try:
            torch.cuda.synchronize()
        except Exception:
            pass
        return culprit

    @torch.inference_mode()
    def step(self, ids: torch.Tensor, position: int) -> torch.Tensor:
        """Run one token at `position`; the caller advances the cache position. Returns [1, V'] fp16,
        the graph's output buffer: valid until the next step."""
        from exllamav2.device import set_device_streams
        set_device_streams()                       # the stream exllamav2's own forward uses, in any thread
        emb = self.embed.forward(ids)                                  # [1, 1, H] on the CPU
        self.x_in.copy_(emb.view(1, 1, -1))
        self.pos32.fill_(position)
        if self.attention != "triton":
            self.pos64.fill_(position)                             # the index_copy_ and mask paths
        L = min(self.cache.max_seq_len, (position // BUCKET + 1) * BUCKET)
        if L not in self.graphs:
            self._capture(L)
        g, out = self.graphs[L]
        g.replay()
        return out

    def captured(self) -> list[int]:
        return sorted(self.graphs)
