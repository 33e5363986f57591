"""A whole forward of T = 1..9 rows (the decode step: 1; a speculative verify of K drafts: K + 1;
batch 1, FP16 cache) captured as one CUDA graph per (context bucket, T), lazily on first use.

exllamav2's layer loop costs a host round trip per module (Python, argument checks, host-side
position bookkeeping), tens of microseconds each, ~100 modules per token. Here the step runs from
device-side state only:
- the position `pos` of the first row lives in a device tensor: RoPE reads it (exllamav2's
  `past_lens` with past_len = -1; row t gets position pos + t), and so does the attention;
- attention runs over the first L cache rows, L = the last row's position pos + T - 1 rounded up to
  a bucket of `BUCKET` tokens, so one graph serves every position in its bucket. One Triton kernel
  (plus a small merge) writes the T new K/V rows and attends, causally, rows 0..pos+t for row t
  (`runtime/backends/attention.py`; it replaced two batched matmuls with a mask at 2d85c67, which with the
  fp16 router and timed GEMV shapes took decode from 182.0 to 243.4 tok/s on the H200);
- attentions the one-launch prologue takes run it and o through the split-K GEMV (exl2_gemv.py);
- MoE layers are `OwnMoE`, whose kernels read the routing on the device (GEMV path up to 64
  (row, expert) pairs, the grouped path above: both free of host synchronisation).
The embedding stays on the CPU (as exllamav2 keeps it); its rows are copied into the graph's input.

The GPU check (graph vs layer loop, T = 1, 2, 5, 9): `python -m bench.check_graph --check MODEL_DIR`.

Letters: S cache length, L attended length, T rows, Hq query heads, Hk KV heads, R = Hq // Hk, D head dim.
"""
from __future__ import annotations


import torch

from runtime.backends.attention import MAX_QUERY_ROWS, decode_attention, variant
from runtime.experts.shapes import CAPTURE_MODE

BUCKET = 512
MAX_ROWS = 9                 # rows a graph covers: the decode step and a verify of up to 8 drafts
MAX_GRAPHS = 64              # captured graphs kept (least recently used dropped): 9 row counts x ~7 buckets
AHEAD_BUCKETS = 2            # buckets past the current one whose graphs are captured ahead of need


def bucket(position: int, rows: int, max_seq_len: int) -> int:
    """Attended length L for `rows` new rows from `position`: the last row's bucket end, capped at the cache."""
    return min(max_seq_len, ((position + rows - 1) // BUCKET + 1) * BUCKET)


def capture_position(L: int, rows: int, first_free: int, max_seq_len: int) -> int | None:
    """Where a graph of (L, rows) can be captured ahead of need without touching the cache's
    tokens: a position >= first_free whose step attends L rows (its warm-up run writes K/V rows
    there, past the cache's end, where the next forward overwrites them); None if no such position.
    The bucket starts at L - BUCKET, or for a capped L (a context not a multiple of BUCKET) at the
    multiple of BUCKET below it."""
    pos = max(first_free, (L - 1) // BUCKET * BUCKET)
    if pos + rows > min(L, max_seq_len) or bucket(pos, rows, max_seq_len) != L:
        return None
    return pos


def warm_plan(position: int, rows: int, max_seq_len: int, captured, ahead: int = AHEAD_BUCKETS,
              max_rows: int = MAX_ROWS) -> list[tuple[int, int]]:
    """The (L, T) graphs to capture ahead of need, most urgent first: one-row steps (decode) of the
    bucket at `position` and the `ahead` buckets after it, then verify rows 2..`rows` (drafting) of
    the same buckets, then the other row counts up to `max_rows` of the current bucket."""
    first = bucket(position, 1, max_seq_len)
    buckets = sorted({min(max_seq_len, first + i * BUCKET) for i in range(ahead + 1)})
    order = [(L, 1) for L in buckets]
    order += [(L, t) for L in buckets for t in range(2, min(rows, max_rows) + 1)]
    order += [(first, t) for t in range(2, max_rows + 1)]
    seen, plan = set(captured), []
    for L, t in order:
        if (L, t) not in seen and capture_position(L, t, position, max_seq_len) is not None:
            seen.add((L, t))
            plan.append((L, t))
    return plan


def answer_plan(position: int, max_new: int, rows: int, max_seq_len: int, captured,
                max_rows: int = MAX_ROWS) -> list[tuple[int, int]]:
    """The graphs an answer of up to `max_new` tokens from `position` can reach that are not captured
    yet: the decode step (and verify rows up to `rows`) of the bucket it starts in and of those it
    crosses into, at most AHEAD_BUCKETS after it. Captured before token 1 (`prepare_decode`): a request
    sent right after the last answer leaves no idle time for them, and a capture in the middle of an
    answer is a visible pause between two tokens."""
    first = bucket(position, 1, max_seq_len)
    last = bucket(min(max_seq_len - 1, position + max(1, max_new) - 1), 1, max_seq_len)
    ahead = min(AHEAD_BUCKETS, max(0, (last - 1) // BUCKET - (first - 1) // BUCKET))   # a capped last counts
    return warm_plan(position, rows, max_seq_len, captured, ahead=ahead, max_rows=min(rows, max_rows))


def bucket_lengths(max_seq_len: int) -> list[int]:
    """Every attended length L a graph can be captured for (the `bucket` of some position)."""
    return sorted({min(max_seq_len, k * BUCKET) for k in range(1, -(-max_seq_len // BUCKET) + 1)})


def attention_variants(max_seq_len: int, Hq: int, Hk: int, D: int, max_rows: int = MAX_ROWS,
                       block_n: int = 64) -> dict[tuple, tuple[int, int]]:
    """The distinct compile-time variants of decode_attention that graphs of 1..max_rows rows over a
    `max_seq_len`-token cache launch, each with one (L, T) that launches it (its smallest L). The chunk,
    the splits' padding and the one-launch case follow L, so buckets far apart compile apart. Row
    counts the kernel does not take (more than MAX_QUERY_ROWS query rows per KV head) are left out."""
    out: dict[tuple, tuple[int, int]] = {}
    for T in range(1, min(max_rows, MAX_QUERY_ROWS // max(1, Hq // Hk)) + 1):
        for L in bucket_lengths(max_seq_len):
            if T <= L:
                out.setdefault(variant(L, T, Hq, Hk, D, block_n), (L, T))
    return out


class DecodeGraphs:
    max_rows = MAX_ROWS          # forwards of 1..max_rows tokens replay a graph (lowered if a capture fails)

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
        self.x_in = torch.zeros((1, MAX_ROWS, cfg.hidden_size), dtype=torch.float16, device=dev)
        self.pos32 = torch.zeros((1,), dtype=torch.int32, device=dev)                  # first row's position
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}   # (L, T) ->
        self.pool = None
        self.stream = torch.cuda.Stream(device=dev)
        # Called with the MoE layer after an attention once its q/k/v projections are queued (the offload
        # manager's release_prefetch: runtime/offload/prefetch.py says why not before), or None.
        self.after_qkv = None
        from runtime.experts.exl2_module import OwnMoE
        self.moe_after = {i: n.experts for i, (m, n) in enumerate(zip(self.body, self.body[1:]))
                          if isinstance(m, self.Attention) and isinstance(n, OwnMoE) and n.experts is not None}
        self.attention = "triton"                                # (telemetry: the kernel the graphs attend with)

    @classmethod
    def build_if_supported(cls, model, cache) -> "DecodeGraphs | None":
        """The graph path, or None where this model/cache/layout is not covered (the loop runs instead)."""
        from exllamav2 import ExLlamaV2Cache
        from exllamav2.attn import ExLlamaV2Attention
        from exllamav2.mlp import ExLlamaV2MLP
        from exllamav2.moe_mlp import ExLlamaV2MoEMLP
        from exllamav2.rmsnorm import ExLlamaV2RMSNorm
        from exllamav2.linear import ExLlamaV2Linear
        from runtime.backends.exl2_arch import graph_modules
        from runtime.experts.exl2_module import OwnMoE
        if type(cache) is not ExLlamaV2Cache or cache.batch_size != 1:
            return None
        for m in model.modules[1:]:
            if isinstance(m, ExLlamaV2Attention):
                if m.q_handle is None or m.sliding_window or model.config.attn_logit_softcapping:
                    return None
            elif isinstance(m, ExLlamaV2MoEMLP):
                return None                                  # stock MoE synchronises with the host
            elif not isinstance(m, (ExLlamaV2MLP, ExLlamaV2RMSNorm, ExLlamaV2Linear, OwnMoE) + graph_modules()):
                return None
        return cls(model, cache)

    # -- the captured step ---------------------------------------------------------------------------

    def _attention(self, a, x: torch.Tensor, L: int, T: int, moe=None) -> torch.Tensor:
        Hq, Hk, D = a.num_attention_heads, a.num_key_value_heads, a.head_dim
        q = torch.empty((1, T, Hq * D), dtype=torch.float16, device=x.device)
        k = torch.empty((1, T, Hk * D), dtype=torch.float16, device=x.device)
        v = torch.empty((1, T, Hk * D), dtype=torch.float16, device=x.device)
        ctx = self.model.get_device_context(a.device_idx)
        # Norm, Q/K/V projections, head norms, RoPE at positions pos32 + t (past_len -1: read on the device);
        # an architecture that changes this prologue (DBRX's clip_qkv) brings its own (exl2_arch.install);
        # so does the one-launch prologue (exl2_gemv.install)
        own = getattr(a, "moedesk_qkv", None)
        if own is not None:
            own(x, T, self.pos32, q, k, v, ctx.sin[a.rope_index], ctx.cos[a.rope_index])
        else:
            self.ext.q_attn_forward_1(a.q_handle, x, 1, T, -1, self.pos32, q, k, v,
                                      ctx.sin[a.rope_index], ctx.cos[a.rope_index], [], self.none)
        if moe is not None and self.after_qkv is not None:
            self.after_qkv(moe)
        K = self.cache.key_states[a.layer_idx]                        # [1, S, Hk, D]
        V = self.cache.value_states[a.layer_idx]
        o = decode_attention(q, k, v, K, V, self.pos32, L, a.scaling)      # writes rows pos.. of K, V
        own_o = getattr(a, "moedesk_o", None)                         # the split-K GEMV (exl2_gemv.install)
        if own_o is not None:
            own_o(x, o, T)
        else:
            self.ext.q_attn_forward_2(a.q_handle, x, o, 1, T, [], self.none)
        return x

    def _step(self, L: int, T: int) -> torch.Tensor:
        x = self.x_in[:, :T].clone()                                   # [1, T, H]
        for i, m in enumerate(self.body):
            if isinstance(m, self.Attention):
                x = self._attention(m, x, L, T, self.moe_after.get(i))
            else:
                x = m.forward(x)
        return x.view(T, -1)                                           # [T, V'] logits

    def _routing_state(self) -> list[torch.Tensor]:
        """Device tensors a capture's warm-up run must leave as it found them: each MoE layer's routing
        counts (the statistics count the tokens answers route, not a warm-up's) and its forced picks'
        counter (benchmarks: a warm-up took sets the next real step then missed, so the picks after a
        capture depended on how many graphs had been captured)."""
        from runtime.experts.exl2_module import OwnMoE
        out = []
        for m in self.body:
            if isinstance(m, OwnMoE) and m.experts is not None:
                out.append(m.experts.counts)
                if m.experts.forced is not None:
                    out.append(m.experts.forced.step)
        return out

    def _capture(self, L: int, T: int):
        s = self.stream
        kept = self._routing_state()
        saved = [t.clone() for t in kept]
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            out = self._step(L, T)                                     # warm-up: compiles, runs the real step
        torch.cuda.current_stream().wait_stream(s)
        for t, was in zip(kept, saved):
            t.copy_(was)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        # "relaxed": calls that are unsafe but harmless during a capture (a library allocating its
        # workspace, a kernel module loaded lazily on first launch, another thread querying the
        # device) run instead of invalidating it. The first measured capture ran in the default
        # "global" mode; later ones failed there and in "thread_local" (docs/engine-notes.md).
        mode = CAPTURE_MODE
        try:
            with torch.cuda.graph(g, pool=self.pool, stream=s, capture_error_mode=mode):
                out = self._step(L, T)
        except RuntimeError as e:
            culprit = self._find_capture_breaker(L, T, mode)
            raise RuntimeError(f"{e} [capture of {T} rows first invalidated by: {culprit}]") from None
        if self.pool is None:
            self.pool = g.pool()
        self.graphs[(L, T)] = (g, out)

    def _find_capture_breaker(self, L: int, T: int, mode: str) -> str:
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

        x = self.x_in[:, :T].clone()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(g, stream=s, capture_error_mode=mode):
                for m in self.body:
                    x = self._attention(m, x, L, T) if isinstance(m, self.Attention) else m.forward(x)
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
        """Run ids [1, T] (T = 1..MAX_ROWS) at positions position..position+T-1, which must fit the cache;
        the caller advances the cache position. Returns [T, V'] fp16, the graph's output buffer: valid
        until the next step (graphs share one memory pool)."""
        from exllamav2.device import set_device_streams
        T = ids.shape[-1]
        if not 1 <= T <= MAX_ROWS or position < 0 or position + T > self.cache.max_seq_len:
            raise ValueError(f"decode graphs: {T} rows at position {position} (graphs cover 1..{MAX_ROWS} "
                             f"rows within the {self.cache.max_seq_len}-token cache)")
        set_device_streams()                       # the stream exllamav2's own forward uses, in any thread
        emb = self.embed.forward(ids)                                  # [1, T, H] on the CPU
        self.x_in[:, :T].copy_(emb.view(1, T, -1))
        self.pos32.fill_(position)
        L = bucket(position, T, self.cache.max_seq_len)
        key = (L, T)
        if key not in self.graphs:
            while len(self.graphs) >= MAX_GRAPHS:                      # the least recently used
                del self.graphs[next(iter(self.graphs))]
            self._capture(L, T)
        g, out = self.graphs[key] = self.graphs.pop(key)               # now the most recently used
        g.replay()
        return out

    @torch.inference_mode()
    def prepare(self, L: int, T: int, first_free: int) -> bool:
        """Capture the graph of (L, T) ahead of need (load, idle time), its warm-up run writing K/V
        rows past `first_free` only; False if it is captured already or cannot be reached from there."""
        from exllamav2.device import set_device_streams
        pos = capture_position(L, T, first_free, self.cache.max_seq_len)
        if (L, T) in self.graphs or pos is None or T > self.max_rows:
            return False
        set_device_streams()
        self.pos32.fill_(pos)
        while len(self.graphs) >= MAX_GRAPHS:
            del self.graphs[next(iter(self.graphs))]
        self._capture(L, T)
        return True

    @torch.inference_mode()
    def warm_attention(self, progress, rows: int | None = None) -> int:
        """At load, before any prompt: run the Triton attention once for each of its variants
        (`attention_variants`) of 1..`rows` rows (default: every row count a graph takes) so that none
        compiles in a capture right before an answer's first token (`answer_plan` captures the rows an
        answer runs: the engine passes its warm rows; other row counts may compile in idle time). On a
        machine's first load each variant is a Triton compile (a few at the default context). Runs at
        position 0 on the cache of the first attention layer of each head shape, whose rows 0..T-1 it
        writes and then restores; `pos32` is left alone (the kernel's variant does not depend on the
        cache length or the position). Returns the runs."""
        rows = self.max_rows if rows is None else max(1, min(rows, self.max_rows))
        heads = {}                                               # (Hq, Hk, D) -> its first layer
        for a in self.body:
            if isinstance(a, self.Attention):
                heads.setdefault((a.num_attention_heads, a.num_key_value_heads, a.head_dim), a)
        runs = [(a, L, T) for (Hq, Hk, D), a in heads.items()
                for L, T in attention_variants(self.cache.max_seq_len, Hq, Hk, D, rows).values()]
        if not runs:
            return 0
        n = len({L for _, L, _ in runs})
        caches = [(self.cache.key_states[a.layer_idx], self.cache.value_states[a.layer_idx]) for a in heads.values()]
        saved = [(K[:, :self.max_rows].clone(), V[:, :self.max_rows].clone()) for K, V in caches]
        pos = torch.zeros((1,), dtype=torch.int32, device=self.device)
        for i, (a, L, T) in enumerate(runs):
            progress("warmup", f"Compiling attention kernels for {n} context lengths", i, len(runs))
            Hq, Hk, D = a.num_attention_heads, a.num_key_value_heads, a.head_dim
            q = torch.zeros((1, T, Hq * D), dtype=torch.float16, device=self.device)
            k = torch.zeros((1, T, Hk * D), dtype=torch.float16, device=self.device)
            K, V = self.cache.key_states[a.layer_idx], self.cache.value_states[a.layer_idx]
            decode_attention(q, k, k.clone(), K, V, pos, L, a.scaling)    # writes rows 0..T-1 of K, V
        for (K, V), (k0, v0) in zip(caches, saved):
            K[:, :k0.shape[1]].copy_(k0)
            V[:, :v0.shape[1]].copy_(v0)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        progress("warmup", f"Compiling attention kernels for {n} context lengths", len(runs), len(runs))
        return len(runs)

    def captured(self) -> list[tuple[int, int]]:
        """The (bucket L, rows T) pairs captured so far."""
        return sorted(self.graphs)
