"""GPU check of the decode graphs: graph forwards of 1, 2, 5, 9 rows vs the layer loop, logits and time.

The graphs are runtime/backends/exl2_graph.py; both run after the same prefix.

    python -m bench.check_graph --check MODEL_DIR
"""
from __future__ import annotations

import sys
import time

import torch

from bench.checks import check_main


def check(model_dir: str, rows=(1, 2, 5, 9), prefix: int = 40, repeats: int = 20) -> bool:
    """Graph forwards of T rows vs the layer loop after the same prefix: logits and time per forward."""
    from runtime.backends import exl2
    from runtime.options import LoadOptions, OffloadOptions
    eng, _ = exl2.load(model_dir, LoadOptions(offload=OffloadOptions(context_length=1024)), lambda *a: None)
    try:
        return _compare(eng, model_dir, rows, prefix, repeats)
    finally:
        eng.close()


def _compare(eng, model_dir: str, rows, prefix: int, repeats: int) -> bool:
    graphs = eng.graphs
    print(f"{model_dir}: {eng.info.num_layers} layers, graphs {'on' if graphs else 'OFF: nothing to compare'}")
    if graphs is None:
        return False
    g = torch.Generator().manual_seed(0)
    toks = torch.randint(0, eng.info.vocab_size, (prefix + max(rows),), generator=g).tolist()
    eng.forward(toks[:prefix])                                         # the layer loop (more than 9 rows)

    def timed(new: list[int]) -> tuple[torch.Tensor, float]:
        out = eng.forward(new).float()                                 # warm-up (capture), then timed
        eng.truncate(prefix)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(repeats):
            eng.forward(new)
            eng.truncate(prefix)
        torch.cuda.synchronize()
        return out, (time.perf_counter() - t0) / repeats

    ok = True
    for T in rows:
        new = toks[prefix:prefix + T]
        got, t_graph = timed(new)
        if eng.graphs is None or not any(t == T for _, t in graphs.captured()):
            print(f"T {T}: FAIL, no graph (the capture failed, the loop ran): {eng.graph_error}")
            return False
        eng.graphs = None                                              # the layer loop
        ref, t_loop = timed(new)
        eng.graphs = graphs
        err = ((got - ref).norm() / ref.norm()).item()
        good = err < 1e-2
        ok &= good
        print(f"T {T}: rel err {err:.1e} {'ok' if good else 'FAIL'} | graph {t_graph * 1e3:6.2f} ms, "
              f"loop {t_loop * 1e3:6.2f} ms per forward")
    return ok


def main(argv: list[str] | None = None) -> int:
    return check_main(argv, "python -m bench.check_graph", __doc__.split("\n")[0],
                      lambda ap: ap.add_argument("--check", metavar="MODEL_DIR",
                                                 help="EXL2 model: graph forwards of 1, 2, 5, 9 rows vs the layer loop"),
                      check)


if __name__ == "__main__":
    sys.exit(main())
