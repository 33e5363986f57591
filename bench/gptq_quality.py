"""What the import of a GPTQ build costs in quality, on real text: the demo model (SmolLM2-135M-Instruct) as a
4-bit GPTQ build, and that build imported into EXL2, by perplexity.

    python -m bench.gptq_quality [--group-size 32] [--widths 4 5 6 8] [--work DIR] [--out bench/results/]

1. The demo GGUF exported as a 16-bit folder (bench/convert_quality.export_demo); every decoder linear written as
   a symmetric 4-bit GPTQ v1 build (bench/gptq_build.py: GPTQ's scale and zero rules, rounded to nearest; the
   embeddings, tied to the head, stay 16-bit).
2. The build imported (`moedesk-cli import`'s code; nothing is left in 16 bits to calibrate) at its own width,
   with exact scales: read as the project's readers read it (q_scale_exact: the CPU engine, the GPU experts) and
   as exllamav2's own Q matrix reads it on a GPU (q_scale / q_scale_max alone: the nearest steps; the demo is a
   dense model, all of whose linears that matrix reads, as it reads an MoE's attention). Then, for comparison, as
   the import was before exact scales (`exact=False`: the steps searched, the codes rounded again) at each width.
3. Perplexity of bench/data/heldout_english.txt (convert_quality's text and evaluation) for the 16-bit model,
   the build as it computes (fp16(scale * (q - zero))) and each import, with its error against the build's
   weights (relative RMS, and the squared error over the build's own rounding noise).
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


def _build_state(original: dict, quantized: dict, group_size: int) -> tuple[dict, float]:
    """The model's weights as the build computes them (the import's own reader, runtime/exl2/gptq_tensors.py), and
    the build's own rounding noise (rows x scale^2 / 12 per group and column, summed)."""
    from runtime import gptq_spec
    from runtime.exl2 import gptq_tensors as gt
    spec = gptq_spec.GptqSpec("gptq", "gptq", 4, group_size, True, False, 1, False)
    state, noise = dict(original), 0.0
    for prefix, parts in quantized.items():
        out, inp = original[f"{prefix}.weight"].shape
        lay = gptq_spec.expected(spec, out, inp)
        lin = gt.unpack(parts, spec, lay, prefix)
        state[f"{prefix}.weight"] = gt.dequantize(lin)
        rows = torch.bincount(lin.group, minlength=lin.scales.shape[0]).double()       # a short last group too
        noise += float((lin.scales.double().square() * rows[:, None] / 12).sum())
    return state, noise


def _row(label: str, model, ids, built: dict, noise: float, names) -> dict:
    """Perplexity of the model as loaded, and its quantized linears' error against the build's weights."""
    state = model.state_dict()
    err = sum(float((state[n].double() - built[n].double()).square().sum()) for n in names)
    ref = sum(float(built[n].double().square().sum()) for n in names)
    return {"model": label, "perplexity": round(perplexity(model, ids), 3),
            "relative_rms_error": round((err / ref) ** 0.5, 6), "added_noise": round(err / noise, 4)}


def _imported(model, original: dict, ids, build: Path, out: Path, built: dict, noise: float, names, **kw) -> list:
    """The build imported into `out` (`import_model`'s keywords), its rows: as our readers read it and, with exact
    scales, as exllamav2's Q matrix does."""
    from runtime.exl2.gptq_import import import_model
    shutil.rmtree(out, ignore_errors=True)
    import_model(build, out, calibrate=False, say=lambda m: None, **kw)
    report = json.loads((out / "config.json").read_text())["quantization_config"]["import"]
    width = kw.get("width") or 4
    rows = []
    readers = ((True, f"imported at {width} bits, exact scales"), (False, "  the same, read by exllamav2 (steps)")) \
        if kw.get("exact", True) else ((True, f"imported at {width} bits, steps searched (before)"),)
    for exact, label in readers:
        stored, _ = load_exl2_into(model, original, out, exact=exact)
        rows.append({**_row(label, model, ids, built, noise, names), "stored_bpw": round(stored, 3),
                     "bit_exact_linears": report["bit_exact_linears"] if exact else 0, "linears": report["linears"]})
        print(rows[-1], flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gptq_quality", description=__doc__.split("\n\n")[0])
    p.add_argument("--group-size", type=int, default=32)
    p.add_argument("--widths", type=int, nargs="+", default=[4, 5, 6, 8])
    p.add_argument("--work", default="bench/.gptq_quality", help="scratch folder (HF export, build, imports)")
    p.add_argument("--out", default="bench/results")
    args = p.parse_args(argv)

    work = Path(args.work)
    hf_dir, build = work / "hf", work / f"gptq-g{args.group_size}"
    hf_dir.mkdir(parents=True, exist_ok=True)
    model, tok = export_demo(hf_dir)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    ids = tok(HELDOUT.read_text(), return_tensors="pt")["input_ids"][0]
    shutil.rmtree(build, ignore_errors=True)
    quantized = gptq_folder(hf_dir, build, group_size=args.group_size,
                            which=lambda n: n.startswith("model.layers.") and n.endswith("_proj.weight"))
    names = [f"{prefix}.weight" for prefix in quantized]
    rows = [{"model": "16-bit (the demo GGUF)", "perplexity": round(perplexity(model, ids), 3)}]
    built, noise = _build_state(original, quantized, args.group_size)
    model.load_state_dict(built)
    rows.append({"model": f"GPTQ build, 4-bit g{args.group_size} (as it computes)",
                 "perplexity": round(perplexity(model, ids), 3)})
    rows += _imported(model, original, ids, build, work / "import-exact", built, noise, names)
    for width in args.widths:
        rows += _imported(model, original, ids, build, work / f"import-w{width}", built, noise, names, width=width,
                          exact=False)
    date = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    result = {"bench": "gptq_quality", "date": date, "git_commit": git_commit(), "machine": machine(),
              "device": "cpu", "model": MODEL, "text": HELDOUT.name, "tokens": int(ids.numel()), "rows": rows,
              "notes": ["the build is GPTQ's storage with round-to-nearest codes (no calibration): the import's "
                        "cost is what is measured, against the build as it computes",
                        "relative_rms_error, added_noise: the imported linears' error against the build's weights; "
                        "added_noise over the build's own rounding noise (rows x scale^2 / 12 per group and column)",
                        "read by exllamav2 (steps): the same folder with q_scale / q_scale_max alone, as exllamav2's "
                        "own Q matrix reads it on a GPU (it reads a dense model's linears, an MoE's attention)"]}
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"gptq_quality-{re.sub(r'[^0-9]', '', date)[:12]}-g{args.group_size}.json"
    path.write_text(json.dumps(result, indent=2))
    for r in rows:
        print(f"{r['model']:<48} {r['perplexity']:>9}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
