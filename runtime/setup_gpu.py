"""`moedesk-cli setup-gpu`: build the GPU engine's kernels once (runtime.gpu_setup), or say why not.

    moedesk-cli setup-gpu [--check] [--arch-list "8.6;9.0"] [--json] [--verbose]

Without --arch-list it builds for this machine's GPUs into the user cache, where the CUDA engine imports it;
with it (the GPU bundle), for those architectures. --json prints one event per line for the welcome screen:
status, progress (ninja's [n/m]), then done (module, seconds) or failed (message, detail). Exit 0 when the
kernels are ready or nothing is to be done (no GPU), 1 when the build failed or cannot run.
"""
from __future__ import annotations

import json
import sys

from runtime import gpu_setup as g


def add_arguments(p) -> None:
    p.add_argument("--check", action="store_true", help="only say what would happen; build nothing")
    p.add_argument("--arch-list", help='architectures to build for, e.g. "8.6;9.0" (default: this machine\'s GPUs)')
    p.add_argument("--json", action="store_true", help="one JSON object per line (for the app)")
    p.add_argument("--verbose", action="store_true", help="print the whole compiler output")


def run(args) -> int:
    def emit(**event) -> None:
        print(json.dumps(event), flush=True)

    archs = args.arch_list.replace(",", ";").replace(" ", ";").split(";") if args.arch_list else None
    archs = [a for a in archs if a] if archs else None
    status = g.kernel_status(archs)
    if args.json:
        emit(event="status", state=status.state, title=status.title, advice=status.advice)
    else:
        print(status.title + (f" {status.advice}" if status.advice else ""))
    if args.check or (status.ready and not archs) or status.state in ("no_gpu", "cpu_torch", "no_exllamav2"):
        return 1 if status.state == "failed" else 0
    def progress(done: int, total: int, line: str) -> None:
        if args.json:
            emit(event="progress", done=done, total=total)
        elif not args.verbose:
            print(f"\r  compiling {done}/{total}", end="", flush=True)

    def echo(line: str) -> None:
        if args.verbose and not args.json:
            print(line, flush=True)
    try:
        module, seconds = g.build(progress, archs, echo)
    except g.KernelBuildError as e:
        if args.json:
            emit(event="failed", message=e.message, detail=e.detail)
        else:
            print(f"\n{e.message}\n{e.detail}", file=sys.stderr)
        return 1
    if args.json:
        emit(event="done", module=str(module), seconds=round(seconds, 1))
    else:
        print(f"\nGPU kernels built in {seconds:.0f} s: {module}")
    return 0
