"""Near ties in a reference engine's router, for tests that compare an engine with it on synthetic weights.

Where the k-th and (k+1)-th router logits of a row nearly tie, the engine's rounding (fp16 activations)
may pick the other expert: that row then differs by a few 1e-2, a different choice rather than an error
(seen: the DBRX miniature's gaps of 0.2% of a standard deviation, a Qwen3.5 miniature's of 0.02%)."""
from __future__ import annotations

import torch


def logit_view(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Router logits [T, E] -> the top-k experts (int64 [T, k], sorted), the k-th minus (k+1)-th logit
    (float32 [T]) and the logits' standard deviation over rows and experts."""
    top = torch.topk(logits, top_k + 1, dim=-1)
    return top.indices[:, :-1].sort(dim=-1).values, top.values[:, -2] - top.values[:, -1], float(logits.std())


def router_view(layer, spec, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    """A reference MoE layer's router on its input h [T, H]: `logit_view` of its logits."""
    return logit_view(torch.nn.functional.linear(h.float(), layer.router), spec.top_k)


def router_gaps(ref, module, tokens) -> torch.Tensor:
    """[layers, rows] float32: for each MoE layer and row of a forward of `tokens` from an empty cache, the
    reference's k-th minus (k+1)-th router logit over the standard deviation of that layer's logits.
    `module` holds the reference's `_moe(layer, spec, h)` (runtime.reference.model, or .qwen35)."""
    moe, gaps = module._moe, []

    def recording(layer, spec, h):
        _, gap, spread = router_view(layer, spec, h)
        gaps.append((gap / spread).cpu())
        return moe(layer, spec, h)
    module._moe = recording
    try:
        ref.reset()
        ref.forward(tokens)
    finally:
        module._moe = moe
        ref.reset()
    return torch.stack(gaps)
