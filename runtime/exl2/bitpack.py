"""Bit packing of EXL2 tensors: b-bit codes into int32 words, LSB first, down each column.

Legend: R input rows (in packed order), N output columns, C chunks of 32 rows, b bits per code.

A chunk of 32 rows of one column is a 32*b-bit little-endian bitstream cut into b uint32 words:
row i occupies bits [i*b, i*b + b) of the stream, so for b in {3, 5, 6} some codes straddle two
words. 4-bit scales are packed the same way along a row (8 per word, first column in the low
nibble). Words are stored as int32 (two's complement of the uint32 pattern).

Work is done in int64 on blocks of columns so temporaries stay bounded for wide matrices, on the device the
codes are on (a GPU packs a batch of matrices side by side as one wide one: few launches, bigger blocks).
"""
from __future__ import annotations

import torch

_COL_BLOCK_ELEMS = {"cpu": 1 << 22, "cuda": 1 << 25}     # int64 temporaries per block: 32 MiB, 256 MiB on a GPU


def _col_blocks(n_cols: int, rows: int, device: torch.device):
    step = max(32, _COL_BLOCK_ELEMS.get(device.type, 1 << 22) // max(1, rows))
    for c0 in range(0, n_cols, step):
        yield c0, min(n_cols, c0 + step)


def _row_positions(bits: int) -> list[tuple[int, int, bool]]:
    """(word, shift, spills into the next word) of each of the 32 rows of a chunk."""
    return [((i * bits) >> 5, (i * bits) & 31, (i * bits) % 32 + bits > 32) for i in range(32)]


def pack_codes(codes: torch.Tensor, bits: int, offset: int = 0) -> torch.Tensor:
    """codes [R, N] (integer-valued, 0 <= code + offset < 2**bits, R a multiple of 32) -> words [R*bits/32, N]
    int32 of code + offset (offset: added block by block, so narrow centred codes need no wide copy first)."""
    rows, cols = codes.shape
    assert rows % 32 == 0, "rows must be a multiple of 32"
    out = torch.empty((rows // 32 * bits, cols), dtype=torch.int32, device=codes.device)
    for c0, c1 in _col_blocks(cols, rows, codes.device):
        c = (codes[:, c0:c1].to(torch.int64) + offset).view(rows // 32, 32, c1 - c0)    # [C, 32, n]
        words = torch.zeros((rows // 32, bits, c1 - c0), dtype=torch.int64, device=codes.device)   # [C, b, n]
        for i, (w, s, spills) in enumerate(_row_positions(bits)):             # 32 bit positions, not rows
            words[:, w] |= c[:, i] << s
            if spills:
                words[:, w + 1] |= c[:, i] >> (32 - s)
        # keep the low 32 bits; int64 -> int32 conversion wraps to the same bit pattern
        out[:, c0:c1] = (words & 0xFFFFFFFF).view(-1, c1 - c0).to(torch.int32)
    return out


def unpack_codes(words: torch.Tensor, bits: int) -> torch.Tensor:
    """words [R*bits/32, N] int32 -> codes [R, N] int64 (inverse of pack_codes)."""
    qrows, cols = words.shape
    assert qrows % bits == 0, "packed rows must be a multiple of the bit width"
    chunks = qrows // bits
    mask = (1 << bits) - 1
    out = torch.empty((chunks, 32, cols), dtype=torch.int64, device=words.device)   # [C, 32, N]
    for c0, c1 in _col_blocks(cols, chunks * 32, words.device):
        w = (words[:, c0:c1].to(torch.int64) & 0xFFFFFFFF).view(chunks, bits, c1 - c0)   # [C, b, n]
        for i, (wi, s, spills) in enumerate(_row_positions(bits)):
            v = w[:, wi] >> s
            if spills:
                v = v | (w[:, wi + 1] << (32 - s))
            out[:, i, c0:c1] = v & mask
    return out.view(chunks * 32, cols)


def pack_scales(qscale: torch.Tensor) -> torch.Tensor:
    """qscale [G, N] in 1..16 (N a multiple of 8) -> [G, N/8] int32 of 4-bit fields holding qscale-1."""
    g, n = qscale.shape
    nib = (qscale.to(torch.int64) - 1).view(g, n // 8, 8)
    shifts = torch.arange(8, dtype=torch.int64, device=qscale.device) * 4
    return ((nib << shifts).sum(dim=2) & 0xFFFFFFFF).to(torch.int32)


def unpack_scales(packed: torch.Tensor) -> torch.Tensor:
    """[G, N/8] int32 -> qscale [G, N] int64 in 1..16 (inverse of pack_scales)."""
    g, n8 = packed.shape
    shifts = torch.arange(8, dtype=torch.int64, device=packed.device) * 4
    nib = ((packed.to(torch.int64) & 0xFFFFFFFF).unsqueeze(2) >> shifts) & 0xF
    return nib.view(g, n8 * 8) + 1
