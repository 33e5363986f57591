"""How fast the decode prefetch's copy kernel moves one expert from page-locked host memory into VRAM,
against DMA copies of the same bytes (GPU only; a measurement, not a test):

    python -m bench.prefetch_copy [--words 589824]

--words: int32 words per projection of one expert (589824: q125-a11 at 3 bpw, 2.36 MB). Prints the
kernel's time per expert (three projections) for several programs per projection, whether the page
holds the expert's codes, and the time of three `copy_` calls (the copy engines)."""
from __future__ import annotations

import argparse

import torch

from runtime.offload import prefetch as K
from bench.grouped import _time


def _time_us(fn, n: int = 50) -> float:
    return _time(fn, n) * 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--words", type=int, default=589824)
    ap.add_argument("--experts", type=int, default=32, help="experts in the host stacks")
    a = ap.parse_args(argv)
    W, E = a.words, a.experts
    cold = [torch.randint(-2 ** 31, 2 ** 31 - 1, (E, W), dtype=torch.int32).pin_memory() for _ in range(3)]
    qw = [torch.zeros(2, W, dtype=torch.int32, device="cuda") for _ in range(3)]
    page = [torch.zeros(W, dtype=torch.int32, device="cuda") for _ in range(3)]

    def words(x, base):
        return (x.data_ptr() - base.data_ptr()) // 4
    desc = torch.tensor([[words(cold[j], qw[0]), W, words(page[j], qw[0])] for j in range(3)], dtype=torch.int64,
                        device="cuda")
    copy = torch.tensor([7], dtype=torch.int32, device="cuda")
    nbytes = 3 * W * 4
    kept = K.PREFETCH_BLOCKS
    try:
        for nb in (16, 32, 64, 128):
            K.PREFETCH_BLOCKS = nb
            us = _time_us(lambda: K.prefetch_copy(qw[0], desc, copy, W))
            print(f"kernel copy, {nb} programs/projection: {us:.0f} us, {nbytes / us / 1e3:.1f} GB/s", flush=True)
    finally:
        K.PREFETCH_BLOCKS = kept
    print("copied right:", all(torch.equal(page[j].cpu(), cold[j][7]) for j in range(3)))
    us = _time_us(lambda: [page[j].copy_(cold[j][7], non_blocking=True) for j in range(3)])
    print(f"DMA copy_: {us:.0f} us, {nbytes / us / 1e3:.1f} GB/s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
