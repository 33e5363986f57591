"""Bit packing of EXL2 tensors: b-bit codes into int32 words, LSB first, down each column.

Legend: R input rows (in packed order), N output columns, C chunks of 32 rows, b bits per code.

A chunk of 32 rows of one column is a 32*b-bit little-endian bitstream cut into b uint32 words:
row i occupies bits [i*b, i*b + b) of the stream, so for b in {3, 5, 6} some codes straddle two
words. 4-bit scales are packed the same way along a row (8 per word, first column in the low
nibble). Words are stored as int32 (two's complement of the uint32 pattern).

Work is done in int64 on blocks of columns so temporaries stay bounded for wide matrices.
"""
from __future__ import annotations

import torch

_COL_BLOCK_ELEMS = 1 << 22          # int64 temporaries per block: about 32 MiB


def _col_blocks(n_cols: int, rows: int):
    step = max(32, _COL_BLOCK_ELEMS // max(1, rows))
    for c0 in range(0, n_cols, step):
        yield c0, min(n_cols, c0 + step)


def _row_positions(bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Word index and bit shift of each of the 32 rows of a chunk."""
    pos = torch.arange(32, dtype=torch.int64) * bits
    return pos >> 5, pos & 31


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """uint32 patterns held in int64 -> int32 with the same bits."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _to_uint(words: torch.Tensor) -> torch.Tensor:
    """int32 words -> their uint32 patterns in int64."""
    return words.to(torch.int64) & 0xFFFFFFFF


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [R, N] (0 <= code < 2**bits, R a multiple of 32) -> words [R*bits/32, N] int32."""
    rows, cols = codes.shape
    assert rows % 32 == 0, "rows must be a multiple of 32"
    word_idx, shift = _row_positions(bits)
    nxt = (word_idx + 1).clamp(max=bits - 1)
    out = torch.empty((rows // 32 * bits, cols), dtype=torch.int32)
    for c0, c1 in _col_blocks(cols, rows):
        c = codes[:, c0:c1].to(torch.int64).view(rows // 32, 32, c1 - c0)        # [C, 32, n]
        lo = (c << shift.view(1, 32, 1)) & 0xFFFFFFFF
        hi = c >> (32 - shift).view(1, 32, 1)       # the part spilling into the next word (0 if none)
        words = torch.zeros((rows // 32, bits, c1 - c0), dtype=torch.int64)   # [C, b, n]
        words.index_add_(1, word_idx, lo)           # codes never overlap: add == or
        words.index_add_(1, nxt, hi)
        out[:, c0:c1] = _to_int32(words.view(-1, c1 - c0))
    return out


def unpack_codes(words: torch.Tensor, bits: int) -> torch.Tensor:
    """words [R*bits/32, N] int32 -> codes [R, N] int64 (inverse of pack_codes)."""
    qrows, cols = words.shape
    assert qrows % bits == 0, "packed rows must be a multiple of the bit width"
    chunks = qrows // bits
    word_idx, shift = _row_positions(bits)
    nxt = (word_idx + 1).clamp(max=bits - 1)
    spans = (shift + bits > 32).view(1, 32, 1)
    mask = (1 << bits) - 1
    out = torch.empty((chunks * 32, cols), dtype=torch.int64)
    for c0, c1 in _col_blocks(cols, chunks * 32):
        w = _to_uint(words[:, c0:c1]).view(chunks, bits, c1 - c0)               # [C, b, n]
        lo = w.index_select(1, word_idx) >> shift.view(1, 32, 1)
        hi = (w.index_select(1, nxt) << (32 - shift).view(1, 32, 1)) * spans
        out[:, c0:c1] = ((lo | hi) & mask).view(-1, c1 - c0)
    return out


def pack_scales(qscale: torch.Tensor) -> torch.Tensor:
    """qscale [G, N] in 1..16 (N a multiple of 8) -> [G, N/8] int32 of 4-bit fields holding qscale-1."""
    g, n = qscale.shape
    nib = (qscale.to(torch.int64) - 1).view(g, n // 8, 8)
    shifts = torch.arange(8, dtype=torch.int64) * 4
    return _to_int32((nib << shifts).sum(dim=2))


def unpack_scales(packed: torch.Tensor) -> torch.Tensor:
    """[G, N/8] int32 -> qscale [G, N] int64 in 1..16 (inverse of pack_scales)."""
    g, n8 = packed.shape
    shifts = torch.arange(8, dtype=torch.int64) * 4
    nib = (_to_uint(packed).unsqueeze(2) >> shifts) & 0xF
    return nib.view(g, n8 * 8) + 1
