"""What the import of a GPTQ build costs in quality, on real text: the demo model (SmolLM2-135M-Instruct) as a
4-bit GPTQ build, and that build imported into EXL2 at several widths, by perplexity.

    python -m bench.gptq_quality [--group-size 32] [--widths 4 5 6 8] [--work DIR] [--out bench/results/]

1. The demo GGUF exported as a 16-bit folder (bench/convert_quality.export_demo); every decoder linear written as
   a symmetric 4-bit GPTQ v1 build (bench/gptq_build.py: GPTQ's scale and zero rules, rounded to nearest; the
   embeddings, tied to the head, stay 16-bit).
2. The build imported (`moedesk-cli import`'s code) at each width; nothing is left in 16 bits to calibrate.
3. Perplexity of bench/data/heldout_english.txt (convert_quality's text and evaluation) for the 16-bit model,
   the build as it computes (fp16(scale * (q - zero))) and each import, with the import's own error report.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import shutil
import sys
from pathlib import Path

import torch

from bench.convert_quality import HELDOUT, MODEL, export_demo, load_exl2_into, perplexity
from bench.engine import git_commit, machine
from bench.gptq_build import gptq_folder


def _build_state(original: dict, quantized: dict, group_size: int) -> dict:
    """The model's weights as the build computes them (the import's own reader, runtime/exl2/gptq_tensors.py)."""
    from runtime import gptq_spec
    from runtime.exl2 import gptq_tensors as gt
    spec = gptq_spec.GptqSpec("gptq", "gptq", 4, group_size, True, False, 1, False)
    state = dict(original)
    for prefix, parts in quantized.items():
        out, inp = original[f"{prefix}.weight"].shape
        lin = gt.unpack(parts, spec, gptq_spec.expected(spec, out, inp), prefix)
        state[f"{prefix}.weight"] = gt.dequantize(lin)
    return state


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gptq_quality", description=__doc__.split("\n\n")[0])
    p.add_argument("--group-size", type=int, default=32)
    p.add_argument("--widths", type=int, nargs="+", default=[4, 5, 6, 8])
    p.add_argument("--work", default="bench/.gptq_quality", help="scratch folder (HF export, build, imports)")
    p.add_argument("--out", default="bench/results")
    args = p.parse_args(argv)

    from runtime.exl2.gptq_import import import_model
    work = Path(args.work)
    hf_dir, build = work / "hf", work / f"gptq-g{args.group_size}"
    hf_dir.mkdir(parents=True, exist_ok=True)
    model, tok = export_demo(hf_dir)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    ids = tok(HELDOUT.read_text(), return_tensors="pt")["input_ids"][0]
    shutil.rmtree(build, ignore_errors=True)
    quantized = gptq_folder(hf_dir, build, group_size=args.group_size,
                            which=lambda n: n.startswith("model.layers.") and n.endswith("_proj.weight"))
    rows = [{"model": "16-bit (the demo GGUF)", "perplexity": round(perplexity(model, ids), 3)}]
    model.load_state_dict(_build_state(original, quantized, args.group_size))
    rows.append({"model": f"GPTQ build, 4-bit g{args.group_size} (as it computes)",
                 "perplexity": round(perplexity(model, ids), 3)})
    for width in args.widths:
        out = work / f"import-w{width}"
        shutil.rmtree(out, ignore_errors=True)
        import_model(build, out, calibrate=False, width=width, say=lambda m: None)
        stored, _ = load_exl2_into(model, original, out)
        report = json.loads((out / "config.json").read_text())["quantization_config"]["import"]
        rows.append({"model": f"imported at {width} bits", "perplexity": round(perplexity(model, ids), 3),
                     "stored_bpw": round(stored, 3), "relative_rms_error": report["relative_rms_error"],
                     "added_noise": report["added_noise"], "bit_exact_linears": report["bit_exact_linears"],
                     "linears": report["linears"]})
        print(rows[-1], flush=True)
    date = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    result = {"bench": "gptq_quality", "date": date, "git_commit": git_commit(), "machine": machine(),
              "device": "cpu", "model": MODEL, "text": HELDOUT.name, "tokens": int(ids.numel()), "rows": rows,
              "notes": ["the build is GPTQ's storage with round-to-nearest codes (no calibration): the import's "
                        "cost is what is measured, against the build as it computes",
                        "added_noise: the import's squared error over the build's own rounding noise "
                        "(rows x scale^2 / 12 per group and column)"]}
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"gptq_quality-{re.sub(r'[^0-9]', '', date)[:12]}-g{args.group_size}.json"
    path.write_text(json.dumps(result, indent=2))
    for r in rows:
        print(f"{r['model']:<44} {r['perplexity']:>9}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
