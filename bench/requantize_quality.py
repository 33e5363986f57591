"""What requantizing without the bf16 checkpoint costs (moedesk-cli requantize), on the demo model.

    python -m bench.requantize_quality [--source-bpw 4] [--bpw 3] [--rows R] [--seq-len T] [--device cpu|cuda]
        [--out bench/results/] [--work DIR]

The demo (SmolLM2-135M-Instruct) is dense: its MLP projections stand for a MoE's experts (--linears mlp), the
attention for what requantize copies. One table, perplexity of the held-out text (bench.convert_quality's
evaluation):
- `source`: the demo converted from its bf16 weights at --source-bpw (a 4-bit build's stand-in);
- `requantized`: the source's MLPs quantized again at --bpw from the source's own (4-bit) weights, calibrated
  on the source's own activations, its attention copied;
- `requantized-from-bf16`: the same, from a source whose attention is the same 4-bit tensors but whose MLPs are
  the bf16 weights: what the bf16 download would have given at the same widths. The difference between these
  two is the cost of not having the bf16 weights;
- `direct`: every linear converted from bf16 at --bpw, for scale.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import shutil
import sys
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from bench.convert_quality import MODEL, demo_and_text, load_exl2_into, perplexity
from bench.engine import git_commit, machine
from runtime.options import CONVERT_CALIBRATION_ROWS, CONVERT_CALIBRATION_SEQ_LEN

MLP = re.compile(r"\.mlp\.(gate|up|down)_proj$")


def with_bf16_mlps(source: Path, hf_dir: Path, out: Path) -> Path:
    """A copy of the EXL2 folder `source` whose MLP linears are the bf16 checkpoint's weights (stored as fp16
    `.weight`, as a linear kept plain is) instead of their EXL2 tensors."""
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(source, out, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    tensors = {}
    for shard in sorted(source.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})
    with safe_open(str(hf_dir / "model.safetensors"), "pt") as f:
        for prefix in {k.rsplit(".", 1)[0] for k in tensors if k.endswith(".q_weight")}:
            if MLP.search(prefix):
                for part in [k for k in tensors if k.rsplit(".", 1)[0] == prefix]:
                    del tensors[part]
                tensors[f"{prefix}.weight"] = f.get_tensor(f"{prefix}.weight").to(torch.float16)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.requantize_quality", description=__doc__.split("\n\n")[0])
    p.add_argument("--source-bpw", type=float, default=4.0)
    p.add_argument("--bpw", type=float, default=3.0)
    p.add_argument("--rows", type=int, default=CONVERT_CALIBRATION_ROWS)
    p.add_argument("--seq-len", type=int, default=CONVERT_CALIBRATION_SEQ_LEN)
    p.add_argument("--device", default="cpu", help="where the conversions run (perplexities on the CPU)")
    p.add_argument("--work", default="bench/.requantize_quality")
    p.add_argument("--out", default="bench/results")
    args = p.parse_args(argv)

    from runtime.exl2.caldata import default_texts
    from runtime.exl2.convert import convert
    from runtime.exl2.requantize import requantize
    work = Path(args.work)
    hf_dir, model, tok, original, ids = demo_and_text(work)
    text, source_name, note = default_texts()
    common = dict(calibration_text=text, calibration_source=source_name, rows=args.rows, seq_len=args.seq_len,
                  say=lambda m: None, device=args.device)
    tag = f"r{args.rows}x{args.seq_len}-{args.device.split(':')[0]}"
    steps = {
        "source": (work / f"source-{args.source_bpw:g}-{tag}",
                   lambda out: convert(hf_dir, out, args.source_bpw, **common)),
        "requantized": (work / f"requantized-{args.source_bpw:g}-{args.bpw:g}-{tag}",
                        lambda out: requantize(work / f"source-{args.source_bpw:g}-{tag}", out, args.bpw,
                                               linears="mlp", **common)),
        "requantized-from-bf16": (work / f"requantized-bf16-{args.source_bpw:g}-{args.bpw:g}-{tag}",
                                  lambda out: requantize(with_bf16_mlps(work / f"source-{args.source_bpw:g}-{tag}",
                                                                        hf_dir, work / f"bf16-mlps-{tag}"),
                                                         out, args.bpw, linears="mlp", **common)),
        "direct": (work / f"direct-{args.bpw:g}-{tag}", lambda out: convert(hf_dir, out, args.bpw, **common)),
    }
    rows = [{"method": "unquantized", "perplexity": perplexity(model, ids), "stored_bpw": 16.0, "seconds": None}]
    for method, (folder, make) in steps.items():
        t0 = time.perf_counter()
        made = not folder.exists()
        if made:
            make(folder)
        stored_bpw, _ = load_exl2_into(model, original, folder)
        mlp_bits = _mlp_bits(folder)
        rows.append({"method": method, "perplexity": perplexity(model, ids), "stored_bpw": round(stored_bpw, 4),
                     "mlp_stored_bpw": round(mlp_bits, 4), "seconds": round(time.perf_counter() - t0, 1) if made else None})
        print(rows[-1], flush=True)
    model.load_state_dict(original)
    cost = rows[2]["perplexity"] / rows[3]["perplexity"] - 1
    date = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    result = {
        "bench": "requantize_quality", "date": date, "git_commit": git_commit(), "machine": machine(),
        "device": args.device, "model": MODEL, "bpw": args.bpw, "vram_budget_gb": None, "context": int(ids.numel()),
        "prompt_tokens": int(ids.numel()), "prefill_tps": None, "decode_tps": None, "ttft_s": None,
        "roofline_tps": None, "draft": None, "baseline": rows[3], "source_bpw": args.source_bpw,
        "calibration": {"text": source_name, "rows": args.rows, "seq_len": args.seq_len, "note": note},
        "table": rows, "perplexity_cost_of_no_bf16": round(cost, 4),
        "notes": "The demo is dense: its MLP projections (gate/up/down) stand for a MoE's experts (requantize "
                 "--linears mlp); attention, embeddings and norms are copied from the source. 'source' is our "
                 "converter's output from bf16 at source_bpw (a 4-bit build's stand-in). perplexity_cost_of_no_bf16 = "
                 "requantized / requantized-from-bf16 - 1: the same attention tensors and MLP widths, the MLPs "
                 "quantized from the 4-bit source's weights or from bf16. 'seconds': conversion time on this device "
                 "(null where an earlier run made the folder); measured allocation as the converter decides.",
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"requantize_quality-{re.sub(r'[^0-9]', '', date)[:12]}.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}: cost of requantizing without bf16 {cost:+.1%}")
    return 0


def _mlp_bits(folder: Path) -> float:
    """Stored bits per weight of the folder's MLP linears (in x padded out; the demo's widths are multiples of 32)."""
    from runtime.exl2 import format as fmt
    bits = weights = 0
    for shard in sorted(folder.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            for prefix in {k.rsplit(".", 1)[0] for k in f.keys() if k.endswith(".q_weight")}:
                if MLP.search(prefix):
                    q = {part: f.get_tensor(f"{prefix}.{part}") for part in fmt.REQUIRED_KEYS}
                    bits += fmt.stored_bits(q)
                    weights += q["q_invperm"].shape[0] * q["q_weight"].shape[1]
    return bits / max(weights, 1)


if __name__ == "__main__":
    sys.exit(main())
