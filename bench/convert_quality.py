"""Perplexity of the demo model (SmolLM2-135M-Instruct) quantized to EXL2 by round-to-nearest and by the
calibrated converter, at several bits per weight, against the unquantized model: one table, same text,
same evaluation code.

    python -m bench.convert_quality [--bpw 2.5 3 4 6] [--rows R] [--seq-len T] [--damp D] [--no-measure]
        [--out bench/results/] [--work DIR]

The calibrated conversions use the converter's default calibration (exllamav2's standard set where it is
installed, caldata.py) and group size; 'stored_bpw' is what the decoder's quantized linears take on disk (codes,
scales, group table, permutation), the measure exllamav2's -b targets and the converter's --bpw now
means (round-to-nearest's bpw still counts code bits: its 'stored_bpw' is higher).

Every model is evaluated the same way: its EXL2 linears are dequantized (format.dequantize, exactly as
exllamav2 reconstructs them) into the transformers model read from the demo GGUF, which then computes
the perplexity of bench/data/heldout_english.txt (public domain; not the calibration text) in one
window. exllamav2's own converter needs CUDA; its column is filled by `--exllamav2-dir`, pointing at
folders `<DIR>/<bpw>` that its convert.py wrote from the same HF folder (see README, "Converter").
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import re
import sys
import time
from pathlib import Path

import torch
from safetensors import safe_open

from bench.engine import git_commit, machine
from runtime.exl2.gptq import DEFAULT_DAMP
from runtime.options import CONVERT_CALIBRATION_ROWS, CONVERT_CALIBRATION_SEQ_LEN, CONVERT_GROUP_SIZE

HELDOUT = Path(__file__).parent / "data" / "heldout_english.txt"
MODEL = "SmolLM2-135M-Instruct"


def export_demo(hf_dir: Path):
    """The demo GGUF as an HF safetensors folder (what `convert` reads); -> (model, tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from runtime.demo import find_gguf, hf_config
    gguf = find_gguf()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    if not (hf_dir / "config.json").is_file():
        from safetensors.torch import save_file
        config = hf_config(model)
        tied = config.get("tie_word_embeddings", False)
        save_file({k: v.clone().contiguous() for k, v in model.state_dict().items()
                   if not (tied and k == "lm_head.weight")}, str(hf_dir / "model.safetensors"))
        (hf_dir / "config.json").write_text(json.dumps(hf_config(model), indent=2))
        tok.save_pretrained(hf_dir)
    return model, tok


def demo_and_text(work: Path):
    """The demo exported under work/hf -> (that folder, the model, its unquantized state, the held-out ids)."""
    hf_dir = work / "hf"
    hf_dir.mkdir(parents=True, exist_ok=True)
    model, tok = export_demo(hf_dir)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    return hf_dir, model, tok, original, tok(HELDOUT.read_text(), return_tensors="pt")["input_ids"][0]


def perplexity(model, ids: torch.Tensor) -> float:
    with torch.no_grad():
        logits = model(ids.unsqueeze(0)).logits[0, :-1].float()
    return math.exp(torch.nn.functional.cross_entropy(logits, ids[1:]).item())


def load_exl2_into(model, original: dict, folder: Path, exact: bool = True) -> tuple[float, float | None]:
    """Put an EXL2 folder's dequantized linears (and fp16 tensors) into the transformers model; -> the
    decoder's quantized linears' stored bits per weight (codes, scales, groups, permutation, exact scales where
    stored: what exllamav2's -b and our --bpw count) and lm_head's (None where it is not quantized: tied to the
    embeddings, as our converter leaves the demo's; exllamav2's quantizes it at -hb even then). exact: the
    linears' exact scales (q_scale_exact) taken where stored, as our readers do; False: q_scale / q_scale_max
    only, as exllamav2's own Q matrix reads them."""
    from runtime.exl2 import format as fmt
    stored = {}
    for shard in sorted(folder.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            stored.update({k: f.get_tensor(k) for k in f.keys()})
    state, bits, weights, head = {}, 0, 0, None
    if "lm_head.q_weight" in stored and model.lm_head.weight is model.get_input_embeddings().weight:
        # a head quantized apart from the embeddings it was tied to: the model computes with both, as
        # exllamav2 does (loaded tied, the dequantized head would overwrite the embeddings too)
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    for name, ref in original.items():
        prefix = name[: -len(".weight")]
        if f"{prefix}.q_weight" in stored:
            q = {k: stored[f"{prefix}.{k}"] for k in (*fmt.REQUIRED_KEYS, fmt.EXL2_EXACT) if f"{prefix}.{k}" in stored}
            state[name] = fmt.dequantize(q if exact else {k: q[k] for k in fmt.REQUIRED_KEYS}, out_features=ref.shape[0])
            if prefix == "lm_head":
                head = fmt.stored_bits(q) / ref.numel()
            else:
                bits, weights = bits + fmt.stored_bits(q), weights + ref.numel()
        elif name in stored:
            state[name] = stored[name].float()
        else:
            state[name] = ref                  # tied lm_head
    model.load_state_dict(state)
    return bits / max(weights, 1), head


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.convert_quality", description=__doc__.split("\n\n")[0])
    p.add_argument("--bpw", type=float, nargs="+", default=[2.5, 3.0, 4.0, 6.0])
    p.add_argument("--rows", type=int, default=CONVERT_CALIBRATION_ROWS, help="calibration sequences")
    p.add_argument("--seq-len", type=int, default=CONVERT_CALIBRATION_SEQ_LEN, help="tokens per calibration sequence")
    p.add_argument("--damp", type=float, default=DEFAULT_DAMP, help="GPTQ damping (fraction of H's mean diagonal)")
    p.add_argument("--measure", action=argparse.BooleanOptionalAction, default=True,
                   help="measured bit allocation, also on a calibration below CONVERT_MEASURE_MIN_TOKENS "
                        "(convert falls back to uniform widths there); --no-measure: every linear at --bpw")
    p.add_argument("--work", default="bench/.convert_quality", help="scratch folder (HF export, models)")
    p.add_argument("--exllamav2-dir", help="folders <DIR>/<bpw> written by exllamav2's convert.py")
    p.add_argument("--methods", nargs="+", choices=("rtn", "gptq", "exllamav2"), default=None,
                   help="which columns to measure beside the unquantized model (default: all; exllamav2's needs "
                   "--exllamav2-dir): a GPU call with time for exllamav2's column alone leaves ours to the CPU")
    p.add_argument("--device", default="cpu", help="where our converter runs its layers and GPTQ (cpu or cuda); "
                   "the perplexities are computed on the CPU either way")
    p.add_argument("--out", default="bench/results")
    args = p.parse_args(argv)
    methods = tuple(args.methods or ("rtn", "gptq") + (("exllamav2",) if args.exllamav2_dir else ()))
    if "exllamav2" in methods and not args.exllamav2_dir:
        p.error("--methods exllamav2 needs --exllamav2-dir (the folders exllamav2's converter wrote)")

    from runtime.exl2.caldata import default_texts
    from runtime.exl2.convert import calibration_ids, convert
    from runtime.exl2.writer import quantize_model
    from runtime.demo import hf_config
    work = Path(args.work)
    hf_dir, model, tok, original, ids = demo_and_text(work)
    cal_texts, cal_name, note = default_texts()
    if note:
        print(f"note: {note}", flush=True)
    cal_rows = calibration_ids(tok, cal_texts, args.rows, args.seq_len, cal_name).shape[0]
    date = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"convert_quality-{re.sub(r'[^0-9]', '', date)[:12]}.json"

    def write(rows: list[dict]) -> None:
        """The result so far (written after every row: a long CPU run keeps what it measured)."""
        result = {
            "date": date, "git_commit": git_commit(),
            "machine": machine(), "device": args.device, "model": MODEL, "bpw": args.bpw, "vram_budget_gb": None,
            "context": int(ids.numel()), "prompt_tokens": int(ids.numel()), "prefill_tps": None, "decode_tps": None,
            "ttft_s": None, "roofline_tps": None, "draft": None, "baseline": rows[0],
            "eval_text": HELDOUT.name, "calibration": {"text": cal_name, "sources": sorted(cal_texts),
                                                       "tokens": cal_rows * args.seq_len, "rows": cal_rows,
                                                       "seq_len": args.seq_len, "damp": args.damp,
                                                       "group_size": CONVERT_GROUP_SIZE,
                                                       "measured_allocation": args.measure},
            "methods": list(methods), "table": rows,
            "notes": ("Perplexity of the held-out text in one window, every model evaluated by the same code "
                      "(EXL2 linears dequantized into the transformers model). 'seconds': conversion time on this "
                      "device (on a CPU: shared with other work; null where an earlier run converted the model, the part left when it resumed one). rtn = round-to-nearest (writer.quantize_model), gptq = "
                      "moedesk-cli convert (GPTQ, act-order, scales searched per group, "
                      + ("measured" if args.measure else "uniform") + " widths; its bpw counts every stored bit, "
                      "as exllamav2's -b, while rtn's counts code bits; calibration in 'calibration'). "
                      + ("exllamav2's column: its own convert_exl2 at -b bpw, -hb 6, from the same HF folder."
                         if "exllamav2" in methods else "exllamav2's own converter needs CUDA and was not run here; "
                         "its column is missing.")),
        }
        path.write_text(json.dumps(result, indent=2))

    run_tag = (f"r{args.rows}x{args.seq_len}-d{args.damp:g}-g{CONVERT_GROUP_SIZE}-stored"
               + ("-m" if args.measure else "-u") + ("" if args.device == "cpu" else "-" + args.device.split(":")[0]))
    rows = [{"method": "unquantized", "bpw": 16.0, "perplexity": perplexity(model, ids), "seconds": None}]
    print(rows[-1], flush=True)
    write(rows)
    for bpw in args.bpw:
        for method in methods:
            folder = work / (f"rtn-{bpw:g}" if method == "rtn" else f"{method}-{bpw:g}-{run_tag}")
            t0, made = time.perf_counter(), method != "exllamav2" and not folder.exists()
            if method == "rtn" and not folder.exists():
                quantize_model(original, hf_config(model), bpw, 6, folder)
            elif method == "gptq" and not folder.exists():
                convert(hf_dir, folder, bpw, calibration_text=cal_texts, calibration_source=cal_name, rows=args.rows,
                        seq_len=args.seq_len, damp=args.damp, measure=args.measure, say=lambda m: None,
                        device=args.device)
            elif method == "exllamav2":
                folder = Path(args.exllamav2_dir) / f"{bpw:g}"
            seconds = round(time.perf_counter() - t0, 1)
            stored_bpw, head_bpw = load_exl2_into(model, original, folder)
            rows.append({"method": method, "bpw": bpw, "stored_bpw": round(stored_bpw, 4),
                         "head_stored_bpw": None if head_bpw is None else round(head_bpw, 4),
                         "perplexity": perplexity(model, ids),
                         "seconds": seconds if made else None})     # None: converted by an earlier run
            print(rows[-1], flush=True)
            write(rows)
    model.load_state_dict(original)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
