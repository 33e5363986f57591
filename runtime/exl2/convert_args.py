"""The flags a conversion shares with a requantization (how it calibrates, where it runs) and their checking."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from runtime.options import CONVERT_CALIBRATION_ROWS, CONVERT_CALIBRATION_SEQ_LEN, CONVERT_MEASURE_MIN_TOKENS

from . import caldata
from .calibrate import DEFAULT_HESSIAN_BUDGET


def add_calibration_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of how a conversion calibrates and where it runs (convert and requantize share them)."""
    p.add_argument("--calibration", help="UTF-8 text file to calibrate on (default: exllamav2's standard calibration "
                                         "set, or a short public-domain English text where it is not installed)")
    p.add_argument("--measure", action=argparse.BooleanOptionalAction, default=None,
                   help="choose each linear's width by measured error to hit --bpw on average (default when the "
                        f"calibration has at least {CONVERT_MEASURE_MIN_TOKENS} tokens; --measure forces it on a "
                        "smaller one; --no-measure: every linear at --bpw, ~3x faster)")
    p.add_argument("--rows", type=int, default=CONVERT_CALIBRATION_ROWS,
                   help=f"calibration sequences (default {CONVERT_CALIBRATION_ROWS})")
    p.add_argument("--seq-len", type=int, default=CONVERT_CALIBRATION_SEQ_LEN,
                   help=f"tokens per calibration sequence (default {CONVERT_CALIBRATION_SEQ_LEN})")
    p.add_argument("--hessian-memory", type=float, default=None,
                   help="GiB a group of MoE experts holds at once (Hessians, inverses, the GPTQ loop: default on a GPU "
                        f"what it has free, on the CPU {DEFAULT_HESSIAN_BUDGET / 2**30:g}; does not change the result)")
    p.add_argument("--device", default="auto",
                   help="where layers, Hessians and GPTQ run: auto (default: where an interrupted conversion started, "
                        "else the GPU when one has room for a layer, else the CPU), cpu or cuda")
    p.add_argument("--threads", type=int, default=0,
                   help="CPU threads for the conversion (default 0: the physical cores less those other programs "
                        "keep busy, looked at again after each layer)")


def convert_kwargs(args: argparse.Namespace, prog: str, error: type[Exception]) -> dict:
    """convert.convert's keyword arguments from those flags, checked (error: the exception to raise), with the
    calibration text read (its source's note, where there is one, on stderr)."""
    if args.rows < 1 or args.seq_len < 8:
        raise error(f"--rows must be >= 1 and --seq-len >= 8, got {args.rows} and {args.seq_len}")
    if args.hessian_memory is not None and not args.hessian_memory > 0:
        raise error(f"--hessian-memory must be a positive number of GiB, got {args.hessian_memory}")
    if args.calibration:
        cal = Path(args.calibration)
        try:
            text, source = cal.read_text(encoding="utf-8"), cal.name
        except (OSError, UnicodeDecodeError) as e:
            raise error(f"{cal}: cannot read the calibration text ({e})") from e
    else:
        text, source, note = caldata.default_texts()
        if note:
            print(f"moedesk-cli {prog}: note: {note}", file=sys.stderr)
    return dict(calibration_text=text, calibration_source=source, rows=args.rows, seq_len=args.seq_len,
                measure=args.measure, device=args.device, threads=args.threads,
                hessian_budget=None if args.hessian_memory is None else int(args.hessian_memory * 2**30))
