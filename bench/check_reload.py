"""Does a model give the same answer each time it is loaded in one process? Loads compared block by block.

    python -m bench.check_reload MODEL_DIR [--loads 6] [--rows 24] [--seed 3] [--rechoose] [--graphs] [--poison]

Loads MODEL_DIR on the CUDA engine (all in VRAM) `--loads` times in one process, one after the other,
prefills the same random tokens each time, and prints the logits' relative error against the float32
reference (runtime/reference, on the GPU) and, from the second load on, the first block (exllamav2's
module list: attention, MoE/MLP, norms, head; inside an attention its norm and its q/k/v/o projections
where it calls them one by one) whose output differs from the first load's at all, and the first by more
than 1e-3 relative. With --rechoose, the expert kernels' launch shapes are timed again before every load
but the first (`shapes.CHOSEN` emptied, as in a fresh process). With --poison, before every load but the
first, most of the free VRAM is filled with NaN and handed back to torch's cache (where the next load's
tensors come from): a load that reads memory it never wrote then answers NaN.

Why: on the H200, the DBRX miniature (tests/gpu/test_mixtral_dbrx_gpu.py) came out 1.4-1.8e-2 from the
reference on every row in some loads and 0.15% in others, in the same process, on the same folder:
in one run its second load (graphs on or off), in another a load after the launch shapes were emptied;
the weights on the device (every tensor the engine's modules hold, summed) were identical between a
good and a bad load. A block that differs between loads says where the state lies.
"""
from __future__ import annotations

import argparse
import sys

import torch

from bench.check_reference import rel


SUBLAYERS = ("pre_layernorm", "q_proj", "k_proj", "v_proj", "o_proj", "post_attention_layernorm")


def _record(model, outs: list) -> None:
    """Wrap each of the model's modules so that its output (the residual stream after it) is recorded, and
    inside each the norm and projections exllamav2's unfused attention calls one by one (DBRX's clamped
    q/k/v run there), recorded before the module that holds them."""
    def wrap(obj, label: str):
        orig = obj.forward

        def forward(*a, **k):
            y = orig(*a, **k)
            outs.append((label, (y["hidden_states"] if isinstance(y, dict) else y).float().cpu()))
            return y
        obj.forward = forward

    for i, m in enumerate(model.modules):
        for sub in SUBLAYERS:
            if getattr(m, sub, None) is not None and hasattr(getattr(m, sub), "forward"):
                wrap(getattr(m, sub), f"module {i} ({type(m).__name__}).{sub}")
        wrap(m, f"module {i} ({type(m).__name__})")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--loads", type=int, default=6)
    ap.add_argument("--rows", type=int, default=24)
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--rechoose", action="store_true", help="time the expert kernels' launch shapes again per load")
    ap.add_argument("--graphs", action="store_true", help="decode graphs on (the prefill runs the layer loop alike)")
    ap.add_argument("--poison", action="store_true", help="fill the free VRAM with NaN before each later load")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 2
    from runtime import reference
    from runtime.backends import exl2
    from runtime.experts import shapes
    from runtime.options import LoadOptions
    ref = reference.load(args.model, LoadOptions(), lambda *a: None, precision="float32", device="cuda")[0]
    g = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(0, ref.info.vocab_size - 64, (args.rows,), generator=g).tolist()
    want = ref.forward(tokens)
    ref.close()
    first = None
    for load in range(args.loads):
        if load and args.rechoose:
            shapes.CHOSEN.clear()
        if load and args.poison:
            free = torch.cuda.mem_get_info()[0]
            torch.empty(int(free * 0.8) // 2, dtype=torch.float16, device="cuda").fill_(float("nan"))
            torch.cuda.synchronize()
        eng, _ = exl2.load(args.model, LoadOptions(), lambda *a: None, graphs=args.graphs)
        try:
            outs: list = []
            _record(eng.model, outs)
            eng.reset()
            line = (f"load {load}: logits vs float32 reference {rel(eng.forward(tokens), want):.4f} (prefill attention "
                    f"{eng.info.extra.get('prefill_attention')!r}, cuDNN SDPA {torch.backends.cuda.cudnn_sdp_enabled()})")
            if first is None:
                first = outs
            else:
                diffs = [(label, rel(b, a)) for (label, a), (_, b) in zip(first, outs)]
                moved = next(((label, d) for label, d in diffs if d != 0), None)          # NaN too
                off = next(((label, d) for label, d in diffs if not d <= 1e-3), None)
                line += "; every block bit for bit as in load 0" if moved is None else \
                    f"; first block not bit for bit as in load 0: {moved[0]} ({moved[1]:.2e})"
                if off is not None:
                    line += f"; first off by more than 1e-3: {off[0]} ({off[1]:.4f})"
            print(line, flush=True)
        finally:
            eng.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
