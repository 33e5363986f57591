"""The dequantizing tiles every expert and dense kernel shares (Triton helpers, inlined into the kernels).

A tile is K-rows x BN-columns of one expert's (or one dense linear's) packed codes (runtime/experts/pack.py),
read from wherever its offset table points (a VRAM slot, a staging page, pinned host memory), centred and
scaled. `last_slice` and `take_sums` finish a split-K launch in itself (runtime/experts/shapes.py says how).
Letters: K/N a kernel's input/output features, BK x BN a tile.
"""
import triton
import triton.language as tl

# Every entry of an expert offset table (PackedExperts.woff) is a multiple of this many int32 words
# (runtime/offload/slots.py checks it), so the code loads stay 128-bit vectors.
WALIGN: tl.constexpr = tl.constexpr(16)


@triton.jit
def _codes_tile(qw_ptr, base, k0, offs_n, mask_n, K: tl.constexpr, N: tl.constexpr, BITS: tl.constexpr,
                BK: tl.constexpr, BN: tl.constexpr):
    """Rows k0..k0+BK (packed order) x columns offs_n of an expert's codes: int32 [BK, BN], 0 .. 2^BITS - 1.
    They start `base` int32 words after qw_ptr (the expert's entry in the offset table: a VRAM slot or host
    memory)."""
    if BITS == 3:
        # two planes (runtime/experts/pack.py): K/16 words of low 2-bit pairs, then K/32 of high bits
        lo_rows = k0 // 16 + tl.arange(0, BK // 16)
        lo = tl.load(qw_ptr + base + lo_rows[:, None] * N + offs_n[None, :], mask=mask_n[None, :], other=0)
        u = tl.reshape((lo[:, None, :] >> (tl.arange(0, 16) * 2)[None, :, None]) & 3, (BK, BN))
        if BK >= 64:
            hi_rows = K // 16 + k0 // 32 + tl.arange(0, BK // 32)
            hi = tl.load(qw_ptr + base + hi_rows[:, None] * N + offs_n[None, :], mask=mask_n[None, :], other=0)
            u |= tl.reshape(((hi[:, None, :] >> tl.arange(0, 32)[None, :, None]) & 1) << 2, (BK, BN))
        else:                                   # one word row: gather it per code row
            kk = k0 + tl.arange(0, BK)
            hi = tl.load(qw_ptr + base + (K // 16 + kk // 32)[:, None] * N + offs_n[None, :],
                         mask=mask_n[None, :], other=0)
            u |= ((hi >> (kk % 32)[:, None]) & 1) << 2
    else:
        PER: tl.constexpr = 32 // BITS
        rows_w = k0 // PER + tl.arange(0, BK // PER)
        words = tl.load(qw_ptr + base + rows_w[:, None] * N + offs_n[None, :], mask=mask_n[None, :], other=0)
        shifts = tl.arange(0, PER) * BITS
        u = (words[:, None, :] >> shifts[None, :, None]) & ((1 << BITS) - 1)     # [BK/PER, PER, BN]
        u = tl.reshape(u, (BK, BN))
    return u


@triton.jit
def _scale_row(sc_ptr, e, k0, offs_n, mask_n, K: tl.constexpr, N: tl.constexpr, GROUP: tl.constexpr):
    """Expert e's scales of the group holding row k0, columns offs_n: float16 [BN]."""
    return tl.load(sc_ptr + e * (K // GROUP) * N + (k0 // GROUP) * N + offs_n, mask=mask_n, other=0.0)


@triton.jit
def _dequant_tile(qw_ptr, base, sc_ptr, e, k0, offs_n, mask_n, K: tl.constexpr, N: tl.constexpr,
                  BITS: tl.constexpr, GROUP: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr):
    """Rows k0..k0+BK (packed order) x columns offs_n of expert e, centred and scaled: float32 [BK, BN]
    (`_codes_tile`). A tile lies within one scale group (GROUP a multiple of BK) or spans whole groups (BK
    a multiple of GROUP, both powers of two)."""
    u = _codes_tile(qw_ptr, base, k0, offs_n, mask_n, K, N, BITS, BK, BN)
    if BK > GROUP:                              # several scale groups in the tile (grouped kernels)
        NG: tl.constexpr = BK // GROUP
        g_rows = k0 // GROUP + tl.arange(0, NG)
        s = tl.load(sc_ptr + e * (K // GROUP) * N + g_rows[:, None] * N + offs_n[None, :],
                    mask=mask_n[None, :], other=0.0)
        w = tl.reshape((u - (1 << (BITS - 1))).to(tl.float32), (NG, GROUP, BN)) * s.to(tl.float32)[:, None, :]
        return tl.reshape(w, (BK, BN))
    s = _scale_row(sc_ptr, e, k0, offs_n, mask_n, K, N, GROUP)
    return (u - (1 << (BITS - 1))).to(tl.float32) * s.to(tl.float32)[None, :]


@triton.jit
def _tile_dot(v, qw_ptr, base, sc_ptr, e, k0, offs_n, mask_n, K: tl.constexpr, N: tl.constexpr, BITS: tl.constexpr,
              GROUP: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr):
    """v float32 [BK] times the tile of rows k0..k0+BK (every weight centred and scaled): float32 [BN]."""
    w = _dequant_tile(qw_ptr, base, sc_ptr, e, k0, offs_n, mask_n, K, N, BITS, GROUP, BK, BN)
    return tl.sum(v[:, None] * w, axis=0)


@triton.jit
def silu_h(gate_ptr, up_ptr, idx):
    """h = SiLU(gate) * up of the gate/up output's entries idx (a pair's gate and up rows), rounded to fp16 as
    the tensor-core path rounds it, as float32: down's input."""
    g = tl.load(gate_ptr + idx)
    u = tl.load(up_ptr + idx)
    return (g / (1.0 + tl.exp(-g)) * u).to(tl.float16).to(tl.float32)


# A split-K launch finishing in itself (`linear_gemv._linear_splitk`'s FINISH, qkv_prologue.py, decode.py): each program
# adds its sums into a float32 workspace (acq_rel atomics: visible before it counts), then `last_slice`; the last
# takes them whole (`take_sums`) and, after its stores, sets the counter back to zero (there, not sooner: on sm_90
# a reset inside `last_slice` gave qkv_prologue's 16-row shapes a stack frame). Both are zero between launches.
@triton.jit
def last_slice(c_ptr, SLICES):
    """Count this program's slice at c_ptr once its adds are issued: True for the last of SLICES (every other
    one has added)."""
    tl.debug_barrier()                                    # every thread's adds issued before the count
    return tl.atomic_add(c_ptr, 1) == SLICES - 1


@triton.jit
def take_sums(wptrs, like, mask):
    """The sums at wptrs (shaped as `like`), read where they were added, and the workspace set back to zero."""
    total = tl.atomic_add(wptrs, tl.zeros_like(like), mask=mask)
    tl.store(wptrs, tl.zeros_like(like), mask=mask)
    return total
