"""Where does the CUDA engine leave the fp32 reference? The residual stream compared block by block.

    python -m bench.check_reference MODEL_DIR [--rows 24] [--past 0] [--seed 3] [--device cpu] [--layer0]

Prefills the same random tokens through the reference engine (float32, runtime/reference) and the
exl2 engine's layer loop, records the residual stream after every attention and every MLP/MoE block
on both sides, and prints each block's relative error per row: the first block where it jumps is
where the engines part. With --past N, both engines first take N other tokens, and the traced
forward is a decode (--rows 1) or a verify (--rows 2..9) after them, as the engine meets it while
speculating; its router's picks are compared too (a pick that differs where the reference's k-th and
(k+1)-th logits nearly tie is rounding, not a fault). With --layer0, the first attention block is taken apart instead: exllamav2's
weights, norm weights and RoPE tables against the reference's, then its queries after each step
(this found exllamav2 mean-centring Qwen3's head norms). Needs CUDA (exllamav2); the reference side
runs on the CPU.
"""
from __future__ import annotations

import argparse
import sys
from typing import Optional

import torch


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖ over whole tensors (any device, any float type)."""
    return _rel_rows(a.reshape(1, -1), b.reshape(1, -1)).item()


def _rel_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-row ‖a − b‖ / ‖b‖ of two [T, H] tensors."""
    a, b = a.float().cpu(), b.float().cpu()
    return (a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-12)


def reference_trace(path, tokens: list[int], past: int = 0, device: str = "cpu"
                    ) -> tuple[list[torch.Tensor], torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """The reference's residual stream after each block for tokens[past:] (tokens[:past] taken first),
    its logits, and each MoE layer's (picks [T, A], gap [T]: its k-th minus (k+1)-th router logit)."""
    from runtime import reference
    from runtime.options import LoadOptions
    from runtime.reference import model
    ref = reference.load(path, LoadOptions(), lambda *a: None, precision="float32", device=device)[0]
    trace: list[torch.Tensor] = []
    picks: list[tuple[torch.Tensor, torch.Tensor]] = []
    moe = model._moe

    def recording(layer, spec, h):
        top = torch.topk(torch.nn.functional.linear(h.float(), layer.router), spec.top_k + 1, dim=-1)
        picks.append((top.indices[:, :-1].sort(dim=-1).values.cpu(), (top.values[:, -2] - top.values[:, -1]).cpu()))
        return moe(layer, spec, h)
    model._moe = recording
    try:
        with torch.inference_mode():
            dev = ref.weights.embed.device
            if past:
                model.forward(ref.weights, ref.spec, ref.cache, ref.cos, ref.sin,
                              torch.tensor(tokens[:past], dtype=torch.long, device=dev))
                picks.clear()
            logits = model.forward(ref.weights, ref.spec, ref.cache, ref.cos, ref.sin,
                                   torch.tensor(tokens[past:], dtype=torch.long, device=dev), trace=trace)
    finally:
        model._moe = moe
        ref.close()
    return [t.cpu() for t in trace], logits.cpu(), picks


def engine_trace(path, tokens: list[int], past: int = 0
                 ) -> tuple[list[tuple[str, torch.Tensor]], torch.Tensor, str, list[torch.Tensor]]:
    """The exl2 engine's layer loop (graphs off), each body module's output recorded for tokens[past:]
    (tokens[:past] taken first, unrecorded); and each MoE layer's picks [T, A] (sorted)."""
    from runtime.backends import exl2
    from runtime.options import LoadOptions, OffloadOptions
    eng = exl2.load(path, LoadOptions(offload=OffloadOptions(context_length=max(512, len(tokens)))),
                    lambda *a: None, graphs=False)[0]
    trace: list[tuple[str, torch.Tensor]] = []
    picks: list[torch.Tensor] = []
    try:
        if past:
            eng.forward(tokens[:past])
        body = eng.model.modules[1:]
        for m in body:
            orig = m.forward

            def recording(*a, _orig=orig, _m=m, **k):
                out = _orig(*a, **k)
                trace.append((f"{type(_m).__name__} {getattr(_m, 'key', '')}", out.detach().float().cpu()))
                ids = getattr(getattr(_m, "experts", None), "_ids", None)      # our MoE layer's last picks
                if ids is not None:
                    picks.append(ids.sort(dim=-1).values.cpu())
                return out
            m.forward = recording
        logits = eng.forward(tokens[past:]).float().cpu()
        attention = eng.info.extra.get("prefill_attention", "?")
    finally:
        eng.close()
    return trace, logits, attention, picks


def run(path, rows: int, seed: int, past: int = 0, device: str = "cpu") -> int:
    import json
    from pathlib import Path
    vocab = int(json.loads((Path(path) / "config.json").read_text())["vocab_size"])
    tokens = torch.randint(0, vocab - 64, (past + rows,), generator=torch.Generator().manual_seed(seed)).tolist()
    ref_trace, ref_logits, ref_picks = reference_trace(path, tokens, past, device)
    eng_trace, eng_logits, attention, eng_picks = engine_trace(path, tokens, past)
    blocks = [(name, out) for name, out in eng_trace if out.shape[-1] == ref_trace[0].shape[-1]]
    print(f"{path}: {rows} rows after {past}, prefill attention: {attention}; {len(blocks)} engine blocks, "
          f"{len(ref_trace)} reference blocks")
    for i, ((want, gap), got) in enumerate(zip(ref_picks, eng_picks)):
        differ = (want != got.to(want.dtype)).any(dim=-1).nonzero().flatten().tolist()
        print(f"MoE layer {i}: picks differ in rows {differ or 'none'}; the reference's smallest k-th/(k+1)-th "
              f"logit gaps: " + " ".join(f"{int(r)}:{v:.1e}" for v, r in zip(*torch.topk(-gap, min(3, rows)))
                                        ).replace(":-", ":"))
    for i, (name, out) in enumerate(blocks[:len(ref_trace)]):
        got = out.view(rows, -1)
        e = _rel_rows(got, ref_trace[i])
        worst = torch.topk(e, min(3, rows))
        bad = ~torch.isfinite(got)
        print(f"{i:3d} {name[:48]:48s} median {e.median():.1e}  worst rows "
              + " ".join(f"{int(r)}:{v:.1e}" for v, r in zip(worst.values, worst.indices))
              + f"  max |x| {got.abs().max():.3g} (reference {ref_trace[i].abs().max():.3g})"
              + (f", {int(bad.sum())} values not finite (rows {bad.any(dim=-1).nonzero().flatten().tolist()})"
                 if bad.any() else ""))
    got = eng_logits.view(rows, -1)[:, :ref_logits.shape[-1]]
    e = _rel_rows(got, ref_logits)
    print(f"logits: median {e.median():.1e}, max {e.max():.1e}; not finite: {(~torch.isfinite(got)).sum().item()}")
    return 0


def layer0(path, rows: int, seed: int) -> int:
    """Layer 0's attention, exllamav2 against the reference, piece by piece (relative errors)."""
    import torch.nn.functional as F
    from exllamav2.attn import ExLlamaV2Attention
    from exllamav2.attn_params import Params
    from runtime import reference
    from runtime.backends import exl2
    from runtime.options import LoadOptions, OffloadOptions
    from runtime.reference import model

    ref = reference.load(path, LoadOptions(), lambda *a: None, precision="float32")[0]
    eng = exl2.load(path, LoadOptions(offload=OffloadOptions(context_length=max(512, rows))),
                    lambda *a: None, graphs=False)[0]
    try:
        spec, w0 = ref.spec, ref.weights.layers[0]
        nh, nkv, d, T = spec.heads, spec.kv_heads, spec.head_dim, rows
        att = next(m for m in eng.model.modules if isinstance(m, ExLlamaV2Attention))
        W = w0.qkv.weight.float()
        ours = {"q": W[:nh * d], "k": W[nh * d:(nh + nkv) * d], "v": W[(nh + nkv) * d:], "o": w0.o.weight.float()}
        for name, lin in (("q", att.q_proj), ("k", att.k_proj), ("v", att.v_proj), ("o", att.o_proj)):
            print(f"weight {name}_proj: {rel(lin.get_weight_tensor_dq().T, ours[name]):.1e}")
        print(f"attention norm weight: {rel(att.pre_layernorm.weight, w0.attn_norm):.1e}")
        if att.q_norm is not None:
            print(f"head norm weights: q {rel(att.q_norm.weight, w0.qk_norm[:nh]):.1e}, "
                  f"k {rel(att.k_norm.weight, w0.qk_norm[nh:]):.1e} (exllamav2 head norm: "
                  f"{att.archparams.headnorm})")
        ctx = eng.model.get_device_context(att.device_idx, scratch=False)
        cos = ctx.cos[att.rope_index].reshape(-1, d)[:T]
        print(f"RoPE tables: cos {rel(cos, ref.cos.reshape(-1, d)[:T]):.1e}, "
              f"sin {rel(ctx.sin[att.rope_index].reshape(-1, d)[:T], ref.sin.reshape(-1, d)[:T]):.1e}")
        toks = torch.randint(0, spec.vocab, (T,), generator=torch.Generator().manual_seed(seed))
        x = F.embedding(toks, ref.weights.embed).float()                                   # [T, H]
        h = F.rms_norm(x, (spec.hidden,), w0.attn_norm, spec.eps)
        mask = (torch.arange(T)[None, :] <= torch.arange(T)[:, None]).repeat(nh // nkv, 1)
        cache = model.KVCache(spec, T, torch.float32)
        want = x + model._attention(w0, spec, cache, 0, h, (ref.cos[:T, None], ref.sin[:T, None]), mask, 0, T)
        xg = x.half().cuda()[None]
        with torch.inference_mode():
            post = att.pre_layernorm.forward(xg.clone())
            q = att.q_proj.forward(post).view(1, T, nh, d)
            print(f"after the attention norm: {rel(post[0], h):.1e}; q_proj: {rel(q[0].reshape(T, -1), h @ ours['q'].T):.1e}")
            q_ref = (h @ ours["q"].T).view(T, nh, d)
            if att.q_norm is not None:
                q_ref = F.rms_norm(q_ref, (d,), None, spec.eps) * w0.qk_norm[:nh]
                print(f"queries after the head norm: {rel(att.q_norm.forward(q.clone())[0], q_ref):.1e}")
            out = att.forward(xg.clone(), cache=None, attn_params=Params(1, T, 0), past_len=0)[0]
        per_row = (out.float().cpu() - want).norm(dim=-1) / want.norm(dim=-1)
        print(f"attention block, {T} rows: {rel(out, want):.1e} (rows: "
              + " ".join(f"{e:.0e}" for e in per_row.tolist()) + ")")
    finally:
        eng.close()
        ref.close()
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.check_reference",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("model", help="EXL2 model folder")
    ap.add_argument("--rows", type=int, default=24)
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--past", type=int, default=0, help="tokens taken before the traced ones (a decode or verify)")
    ap.add_argument("--device", default="cpu", help="where the float32 reference runs (cuda: seconds at real width)")
    ap.add_argument("--layer0", action="store_true", help="take layer 0's attention apart instead")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA (the exl2 engine runs on exllamav2)", file=sys.stderr)
        return 2
    return layer0(a.model, a.rows, a.seed) if a.layer0 else run(a.model, a.rows, a.seed, a.past, a.device)


if __name__ == "__main__":
    sys.exit(main())
