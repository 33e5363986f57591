"""Where does the CUDA engine leave the fp32 reference? The residual stream compared block by block.

    python -m runtime.backends.diag_reference MODEL_DIR [--rows 24] [--seed 3]

Prefills the same random tokens through the reference engine (float32, runtime/reference) and the
exl2 engine's layer loop, records the residual stream after every attention and every MLP/MoE block
on both sides, and prints each block's relative error per row: the first block where it jumps is
where the engines part. Needs CUDA (exllamav2); the reference side runs on the CPU.
"""
from __future__ import annotations

import argparse
import sys
from typing import Optional

import torch


def _rel_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-row ‖a − b‖ / ‖b‖ of two [T, H] tensors."""
    a, b = a.float().cpu(), b.float().cpu()
    return (a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-12)


def reference_trace(path, tokens: list[int]) -> tuple[list[torch.Tensor], torch.Tensor]:
    from runtime import reference
    from runtime.options import LoadOptions
    from runtime.reference import model
    ref = reference.load(path, LoadOptions(), lambda *a: None, precision="float32")[0]
    trace: list[torch.Tensor] = []
    with torch.inference_mode():
        logits = model.forward(ref.weights, ref.spec, ref.cache, ref.cos, ref.sin,
                               torch.tensor(tokens, dtype=torch.long), trace=trace)
    ref.close()
    return trace, logits


def engine_trace(path, tokens: list[int]) -> tuple[list[tuple[str, torch.Tensor]], torch.Tensor, str]:
    """The exl2 engine's layer loop (graphs off), each body module's output recorded."""
    from runtime.backends import exl2
    from runtime.options import LoadOptions, OffloadOptions
    eng = exl2.load(path, LoadOptions(offload=OffloadOptions(context_length=max(512, len(tokens)))),
                    lambda *a: None, graphs=False)[0]
    trace: list[tuple[str, torch.Tensor]] = []
    try:
        body = eng.model.modules[1:]
        for m in body:
            orig = m.forward

            def recording(*a, _orig=orig, _m=m, **k):
                out = _orig(*a, **k)
                trace.append((f"{type(_m).__name__} {getattr(_m, 'key', '')}", out.detach().float().cpu()))
                return out
            m.forward = recording
        logits = eng.forward(tokens).float().cpu()
        attention = eng.info.extra.get("prefill_attention", "?")
    finally:
        eng.close()
    return trace, logits, attention


def run(path, rows: int, seed: int) -> int:
    import json
    from pathlib import Path
    vocab = int(json.loads((Path(path) / "config.json").read_text())["vocab_size"])
    tokens = torch.randint(0, vocab, (rows,), generator=torch.Generator().manual_seed(seed)).tolist()
    ref_trace, ref_logits = reference_trace(path, tokens)
    eng_trace, eng_logits, attention = engine_trace(path, tokens)
    blocks = [(name, out) for name, out in eng_trace if out.shape[-1] == ref_trace[0].shape[-1]]
    print(f"{path}: {rows} rows, prefill attention: {attention}; {len(blocks)} engine blocks, "
          f"{len(ref_trace)} reference blocks")
    for i, (name, out) in enumerate(blocks[:len(ref_trace)]):
        e = _rel_rows(out.view(rows, -1), ref_trace[i])
        worst = torch.topk(e, min(3, rows))
        print(f"{i:3d} {name[:48]:48s} median {e.median():.1e}  worst rows "
              + " ".join(f"{int(r)}:{v:.1e}" for v, r in zip(worst.values, worst.indices)))
    e = _rel_rows(eng_logits.view(rows, -1)[:, :ref_logits.shape[-1]], ref_logits)
    print(f"logits: median {e.median():.1e}, max {e.max():.1e}")
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m runtime.backends.diag_reference",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("model", help="EXL2 model folder")
    ap.add_argument("--rows", type=int, default=24)
    ap.add_argument("--seed", type=int, default=3)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA (the exl2 engine runs on exllamav2)", file=sys.stderr)
        return 2
    return run(a.model, a.rows, a.seed)


if __name__ == "__main__":
    sys.exit(main())
