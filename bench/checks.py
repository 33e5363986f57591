"""The command line of the GPU self-checks (`python -m bench.check_attention --check`, ...)."""
from __future__ import annotations

import argparse
import sys
from typing import Any, Callable, Optional


def check_main(argv: Optional[list[str]], prog: str, description: str,
               add_check: Callable[[argparse.ArgumentParser], Any], run: Callable[[Any], bool],
               no_cuda_hint: str = "") -> int:
    """Parse `--check`, refuse without CUDA, run the check: exit status 0 ok, 1 a check failed, 2 usage."""
    import torch
    ap = argparse.ArgumentParser(prog=prog, description=description)
    add_check(ap)
    args = ap.parse_args(argv)
    if not args.check:
        ap.print_help()
        return 2
    if not torch.cuda.is_available():
        print("--check needs CUDA" + (f" ({no_cuda_hint})" if no_cuda_hint else ""), file=sys.stderr)
        return 2
    return 0 if run(args.check) else 1
