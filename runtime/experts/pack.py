"""EXL2 expert weights repacked into one uniform layout that the fused expert kernels read.

An EXL2 linear (see the format notes in runtime/exl2/) stores input rows in "packed order"
(activation order, `q_invperm`), in groups that each have their own bit width (2..8) and row count,
every column a little-endian bitstream of b-bit codes. The kernels want one width and one group
size per tensor, so at load each expert projection is rewritten, losslessly:

    code c = q - 2**(b-1)                      (signed, |c| <= 2**(b-1))
    stored u = c + 2**(S-1), S = 3 if every group has b <= 3, 4 if b <= 4, else 8
    S = 4 / 8: 8 / 4 codes per int32, LSB first.
    S = 3: two bit planes per expert, K // 16 words of the low 2 bits (16 codes per word) followed by
           K // 32 words of the high bit (32 codes per word): exactly 3 bits per weight.
    scale[g, n] = fp16((q_scale[g, n] + 1)**2) * fp16(q_scale_max[g] / 256)   (fp16, as exllamav2;
                                                                    groups split to one size)
                  or q_scale_exact[g, n] where the linear has it (exact fp16 scales, runtime/exl2/format.py)
    W^T[perm[k], n] = c[k, n] * scale[k // group, n]                 (perm = argsort(q_invperm))

Cost in bytes, honestly: 3-bit and 2-bit groups cost 3 bits (2-bit wastes a third), 4-bit 4 bits,
5/6-bit cost 8 bits; scales add 16 / group bits per weight.

Shapes: E experts, K input features (rows), N output features (columns), G = K // group.
Pure PyTorch, runs on any device; the unit tests check it against the EXL2 dequantizer on the CPU.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

import torch

from runtime.cpu_load import fix_thread_count
from runtime.experts.st_read import copy_into
from runtime.folder_check import EXL2_EXACT


class PackError(ValueError):
    """An EXL2 tensor set that cannot be repacked; the message names the tensor and the problem."""


@dataclass
class Exl2Codes:
    """One EXL2 linear unpacked: signed codes in packed row order, per-row-group scales, permutation."""
    codes: torch.Tensor        # int8 [K, N], c = q - 2**(b-1)
    scales: torch.Tensor       # float32 [G, N], one row per `group` rows of codes
    group: int                 # rows per scale row (uniform)
    perm: torch.Tensor         # int64 [K]: packed row k multiplies input feature perm[k]
    max_bits: int


@dataclass
class PackedExperts:
    """One projection (gate, up or down) of every expert of a layer, stacked for the kernels.

    The kernels find expert e's codes at `qweight`'s base + `woff[e]` int32 words: with every expert
    in `qweight` (no offload) `woff[e] = e * words_per_expert`. With offload, `cold` holds every
    expert's codes in pinned host memory (readable by GPU kernels at its own address), `qweight` is a
    VRAM stack of S hot slots, and `woff` points each expert at its slot or at its place in `cold`
    (runtime/offload/slots.py keeps the table). Scales and permutations stay on the device."""
    qweight: torch.Tensor      # int32 [S, K * bits // 32, N] (bits 3: two planes, see the module docstring), S = E without offload
    scales: torch.Tensor       # float16 [E, K // group, N]
    perm: torch.Tensor         # int32 [E, K]
    bits: int                  # stored bits per code: 3, 4 or 8
    group: int                 # rows per scale row
    in_features: int           # K
    out_features: int          # N
    woff: Optional[torch.Tensor] = None   # int64 [E] on the scales' device; default e * words_per_expert
    cold: Optional[torch.Tensor] = None   # int32 [E, K * bits // 32, N] in (pinned) host memory

    def __post_init__(self):
        if self.words_per_expert % 16:          # the kernels' WALIGN: table entries keep 64-byte alignment
            raise PackError(f"{self.words_per_expert} code words per expert is not a multiple of 16 "
                            f"(K {self.in_features}, N {self.out_features}, {self.bits} bits)")
        if self.woff is None:
            if self.qweight.shape[0] != self.num_experts:
                raise PackError(f"{self.qweight.shape[0]} code stacks for {self.num_experts} experts and no offset table")
            self.woff = torch.arange(self.num_experts, dtype=torch.int64, device=self.scales.device) * self.words_per_expert

    @property
    def num_experts(self) -> int:
        return self.scales.shape[0]

    @property
    def words_per_expert(self) -> int:
        return self.in_features * self.bits // 32 * self.out_features

    def codes(self, e: int) -> torch.Tensor:
        """Expert e's code words [K * bits // 32, N], wherever they live (the host copy holds all)."""
        if self.cold is not None:
            return self.cold[e]
        return self.qweight.view(-1)[int(self.woff[e]):][: self.words_per_expert].view(-1, self.out_features)

    def expert_bytes(self) -> int:
        """Bytes one expert's projection occupies (and a GEMV reads): codes, scales, permutation."""
        return self.words_per_expert * 4 + self.scales[0].numel() * 2 + self.perm[0].numel() * 4

    def code_bytes(self) -> int:
        """Bytes of one expert's codes: what offload keeps in host memory and moves over PCIe."""
        return self.words_per_expert * 4

    def nbytes(self) -> int:
        return self.expert_bytes() * self.num_experts


_ROW_TABLES: dict = {}


def _row_table(groups: torch.Tensor, Q: int, K: int, name: str):
    """Per packed row: first word, bit shift, width; plus rows per group. From q_groups [G0, 2].
    Experts of one projection share their layout, so tables are cached by it."""
    key = (tuple(groups.flatten().tolist()), Q, K)
    if key not in _ROW_TABLES:
        if len(_ROW_TABLES) > 64:
            _ROW_TABLES.clear()
        _ROW_TABLES[key] = _build_row_table(groups, Q, K, name)
    return _ROW_TABLES[key]


def _build_row_table(groups: torch.Tensor, Q: int, K: int, name: str):
    bits_l = groups[:, 0].tolist()
    starts = groups[:, 1].tolist() + [Q]
    if any(b not in (2, 3, 4, 5, 6, 8) for b in bits_l):
        raise PackError(f"{name}: unsupported bit widths {sorted(set(bits_l))}")
    word, shift, width, rows_per_group = [], [], [], []
    for g, b in enumerate(bits_l):
        q0, q1 = starts[g], starts[g + 1]
        if q1 <= q0 or ((q1 - q0) * 32) % b:
            raise PackError(f"{name}: group {g} spans qrows {q0}..{q1}, not whole {b}-bit rows")
        rows = (q1 - q0) * 32 // b
        bit = torch.arange(rows, dtype=torch.int64) * b
        word.append(q0 + bit // 32)
        shift.append(bit % 32)
        width.append(torch.full((rows,), b, dtype=torch.int64))
        rows_per_group.append(rows)
    if sum(rows_per_group) != K:
        raise PackError(f"{name}: groups hold {sum(rows_per_group)} rows, q_invperm has {K}")
    return torch.cat(word), torch.cat(shift), torch.cat(width), rows_per_group, max(bits_l)


def unpack_exl2(t: Mapping[str, torch.Tensor], name: str = "linear") -> Exl2Codes:
    """EXL2 tensors (q_weight, q_scale, q_scale_max, q_groups, q_invperm, optional q_scale_exact) -> codes and
    scales."""
    lay = _layout(t, name)
    parts = [t[k][None] for k in lay.unpacked]
    codes, scales, perm = _unpack_batch(*parts[:4], lay, *parts[4:])
    if lay.exact:
        _check_finite(_finite(scales), [name])
    return Exl2Codes(codes=codes[0], scales=scales[0], group=lay.group, perm=perm[0], max_bits=lay.max_bits)


def dequantize_codes(u: Exl2Codes) -> torch.Tensor:
    """Dense weight in HF orientation [N, K] (float32) from unpacked codes: the oracle for the kernels."""
    wt = u.codes.to(torch.float32) * torch.repeat_interleave(u.scales, u.group, dim=0)  # [K, N] packed order
    w_t = torch.empty_like(wt)
    w_t[u.perm] = wt
    return w_t.T.contiguous()


def _words(u: torch.Tensor, bits: int) -> torch.Tensor:
    """int64 [..., K, N] unsigned codes of `bits` bits -> int32 [..., K // per, N], per = 32 // bits, LSB first."""
    per = 32 // bits
    *lead, K, N = u.shape
    shifts = (torch.arange(per, device=u.device) * bits).view(per, 1)
    words = (u.view(*lead, K // per, per, N) << shifts).sum(dim=-2)  # < 2**32, fits int64
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words)
    return words.to(torch.int32)


def _unwords(words: torch.Tensor, bits: int, K: int) -> torch.Tensor:
    """Inverse of `_words`: int32 [K // per, N] -> int64 [K, N] unsigned codes."""
    per = 32 // bits
    w = words.to(torch.int64) & 0xFFFFFFFF
    shifts = (torch.arange(per, device=w.device) * bits).view(1, per, 1)
    return ((w[:, None, :] >> shifts) & ((1 << bits) - 1)).reshape(K, w.shape[-1])


def _pack_words(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """int8 [..., K, N] signed codes -> int32 [..., K * bits // 32, N] (bits 3: low-2-bit plane, then high bit)."""
    u = codes.to(torch.int64) + (1 << (bits - 1))
    if bits == 3:
        return torch.cat([_words(u & 3, 2), _words(u >> 2, 1)], dim=-2)
    return _words(u, bits)


def _unpack_words(words: torch.Tensor, bits: int, K: int) -> torch.Tensor:
    """int32 [K * bits // 32, N] -> int64 [K, N] unsigned codes."""
    if bits == 3:
        return _unwords(words[: K // 16], 2, K) | (_unwords(words[K // 16:], 1, K) << 2)
    return _unwords(words, bits, K)


def _stored_bits(max_bits: int) -> int:
    return 3 if max_bits <= 3 else 4 if max_bits <= 4 else 8


class HostArena:
    """Page-locked host memory for expert code stacks, carved from large blocks.

    Blocks come from torch's pinned allocator (cudaHostAlloc: under unified addressing GPU kernels
    read them at the host address itself). That allocator rounds every request up to a power of
    two, so stacks are not allocated one by one (a 3-bit expert stack would cost +70%): blocks of
    `block_bytes` (a power of two) hold many stacks, wasting only the end of the last block.
    Page-locking is slow (the H200's load log: ~2.7 s for each 4 GiB block, every fifth MoE layer,
    ~30 s of a 46 GB model's 100 s "Loading weights"): with `ahead` (a count; True is 1), that many
    blocks are page-locked on as many threads from the arena's creation on, and topped up as they are
    taken, while the current one fills; `finish` gives back those no stack used.
    Without CUDA (tests) the memory is ordinary."""

    ALIGN = 4096

    def __init__(self, block_bytes: int = 4 << 30, ahead: int = 0):
        if block_bytes & (block_bytes - 1):
            raise ValueError("block size must be a power of two")
        self.block_bytes = block_bytes
        self.blocks: list[torch.Tensor] = []
        self.used = 0                      # bytes taken from the last block
        self.ahead = int(ahead)
        self._next: deque = deque()        # the blocks being page-locked ahead (Futures), oldest first
        self._pool = None
        self._start_next()                 # the first block is ready by the time the first layer loads

    @property
    def reserved_bytes(self) -> int:
        return sum(b.numel() for b in self.blocks)

    @staticmethod
    def _allocate(size: int) -> torch.Tensor:
        return torch.empty(size, dtype=torch.uint8, pin_memory=torch.cuda.is_available())

    def _take_next(self, size: int) -> Optional[torch.Tensor]:
        """The oldest block page-locked ahead, if it is large enough (else dropped); None without one."""
        if not self._next:
            return None
        try:
            block = self._next.popleft().result()
        except (RuntimeError, MemoryError):       # short of memory ahead of need: allocated below, or said why
            return None
        return block if block.numel() >= size else None

    def _start_next(self) -> None:
        if not self.ahead:
            return
        if self._pool is None:
            import concurrent.futures as cf
            self._pool = cf.ThreadPoolExecutor(self.ahead, thread_name_prefix="pin-ahead")
        while len(self._next) < self.ahead:
            self._next.append(self._pool.submit(self._allocate, self.block_bytes))

    def empty(self, shape: tuple[int, ...]) -> torch.Tensor:
        """An int32 tensor of `shape` in page-locked host memory (uninitialised)."""
        n = math.prod(shape) * 4
        n_al = -(-n // self.ALIGN) * self.ALIGN
        if not self.blocks or self.used + n_al > self.blocks[-1].numel():
            size = max(self.block_bytes, 1 << (n_al - 1).bit_length())
            block = self._take_next(size)
            if block is None:
                try:
                    block = self._allocate(size)
                except RuntimeError as e:
                    raise MemoryError(f"could not page-lock {size / 2**30:.1f} GB more host memory for experts "
                                      f"({self.reserved_bytes / 2**30:.1f} GB so far): {e}; lower the RAM budget, "
                                      "close other programs, or raise the VRAM budget") from None
            self.blocks.append(block)
            self.used = 0
            self._start_next()
        t = self.blocks[-1][self.used:self.used + n].view(torch.int32).view(shape)
        self.used += n_al
        return t

    def finish(self) -> None:
        """The load is done: blocks page-locked ahead and never used go back to the system."""
        if self._next:
            while self._next:
                self._take_next(0)
            if torch.cuda.is_available() and hasattr(torch._C, "_host_emptyCache"):
                torch._C._host_emptyCache()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def release(self) -> None:
        """Forget the blocks (freed once no stack uses them) and return cached pinned memory to the system."""
        self.finish()
        self.blocks, self.used = [], 0
        if torch.cuda.is_available() and hasattr(torch._C, "_host_emptyCache"):
            torch._C._host_emptyCache()


CHUNK_ELEMENTS = 32 << 20      # codes unpacked at once (its int64 temporaries: 256 MiB each): a batch of
                               # experts, or a range of one expert's columns where it alone is larger
COPY_THREADS = 8               # threads gathering experts' tensors into one buffer (memory copies)
COPY_MIN_BYTES = 4 << 20       # ... in pieces of this size (smaller buffers: copied on the gathering thread)
UNPACKED = ("q_weight", "q_scale", "q_scale_max", "q_invperm")    # (+ q_scale_exact where the layout has it)
_POOLS: dict = {}


def _pool(name: str, threads: int):
    """A pool of threads that live as long as the process; each runs torch's CPU work on itself alone.
    The pool already splits the work, and a torch team grown on one of these threads (every core, during
    a load: cpu_load.on_cores) would stay docked with it for good, more OpenMP threads than CPUs, which
    makes every team, the CPU expert path's too, sleep at its barriers (cpu_load.on_cores says why)."""
    if name not in _POOLS:
        import concurrent.futures as cf
        _POOLS[name] = cf.ThreadPoolExecutor(threads, thread_name_prefix=name, initializer=fix_thread_count,
                                             initargs=(1,))
    return _POOLS[name]


@dataclass(frozen=True)
class _Layout:
    """One expert's tensor layout, checked, and its row table (from q_groups, read on the host)."""
    key: tuple                 # experts with equal keys unpack together
    K: int
    N: int
    table: tuple               # _row_table's (word, shift, width, rows_per_group, max_bits)
    exact: bool                # scales from q_scale_exact

    @property
    def unpacked(self) -> tuple[str, ...]:
        """The tensors `_unpack_batch` takes, in its order."""
        return (*UNPACKED, EXL2_EXACT) if self.exact else UNPACKED

    @property
    def max_bits(self) -> int:
        return self.table[4]

    @property
    def group(self) -> int:
        rows = self.table[3]
        return math.gcd(*rows) if len(rows) > 1 else rows[0]


def _layout(t: Mapping[str, torch.Tensor], name: str) -> _Layout:
    for key in ("q_weight", "q_scale", "q_scale_max", "q_groups", "q_invperm"):
        if key not in t:
            raise PackError(f"{name}: tensor {key} missing")
    Q, N = t["q_weight"].shape
    groups = t["q_groups"].to(torch.int64).cpu().view(-1, 2)   # [G0, 2] (bits, first qrow)
    K, G0 = t["q_invperm"].numel(), groups.shape[0]
    if tuple(t["q_scale"].shape) != (G0, N // 8) or t["q_scale_max"].numel() != G0:
        raise PackError(f"{name}: q_scale {tuple(t['q_scale'].shape)} / q_scale_max {tuple(t['q_scale_max'].shape)} "
                        f"do not match {G0} groups and {N} columns")
    exact = t.get(EXL2_EXACT)
    if exact is not None and (exact.dtype != torch.float16 or tuple(exact.shape) != (G0, N)):
        raise PackError(f"{name}: {EXL2_EXACT} is {exact.dtype} {tuple(exact.shape)}, not float16 {(G0, N)} (a scale "
                        f"per group and column)")
    table = _row_table(groups, Q, K, name)
    return _Layout((tuple(groups.flatten().tolist()), Q, N, K, exact is not None), K, N, table, exact is not None)


def _unpack_batch(qw: torch.Tensor, qs: torch.Tensor, qsm: torch.Tensor, invperm: torch.Tensor, lay: _Layout,
                  exact: Optional[torch.Tensor] = None):
    """`unpack_exl2` of B experts of one layout at once, where the tensors are: codes int8 [B, K, N],
    scales float32 [B, K // group, N], perm int64 [B, K]. In-place int64 steps (two [B, K, N] at most)."""
    return (_unpack_codes(qw, lay), *_unpack_scales(qs, qsm, invperm, lay, exact))


def _unpack_codes(qw: torch.Tensor, lay: _Layout) -> torch.Tensor:
    """The codes of B experts' words qw int32 [B, Q, n] (any n of their N columns: words run along the
    input rows) -> int8 [B, K, n]. Two int64 [B, K, n] temporaries at most, made in place."""
    word, shift, width, _, _ = lay.table
    B, Q, N = qw.shape
    dev = qw.device
    word, shift, width = word.to(dev), shift.to(dev)[:, None], width.to(dev)[:, None]   # [K], [K, 1]
    padded = torch.zeros((B, Q + 1, N), dtype=torch.int64, device=dev)
    padded[:, :Q] = qw
    padded &= 0xFFFFFFFF                                     # words as unsigned
    pair = padded[:, word + 1]                               # [B, K, N]: 64 bits from the row's first word
    pair <<= 32
    pair |= padded[:, word]
    del padded
    pair >>= shift
    pair &= (1 << width) - 1
    pair -= 1 << (width - 1)
    return pair.to(torch.int8)


def _unpack_scales(qs: torch.Tensor, qsm: torch.Tensor, invperm: torch.Tensor, lay: _Layout,
                   exact: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """B experts' scales float32 [B, K // group, N] (q_scale_exact [B, G0, N] where given) and input
    permutation int64 [B, K]."""
    B, G0 = qs.shape[0], qs.shape[1]
    dev = qs.device
    if exact is not None:
        scale0 = exact.to(torch.float32)
    else:
        nib = torch.arange(8, device=dev) * 4
        qs4 = (((qs.to(torch.int64) & 0xFFFFFFFF)[..., None] >> nib) & 15).reshape(B, G0, -1)
        mx = qsm.reshape(B, G0).to(torch.float16) * (1 / 256)   # fp16 roundings as exllamav2's dq_scale
        scale0 = (((qs4 + 1) ** 2).to(torch.float16) * mx[..., None]).to(torch.float32)
    reps = torch.tensor([r // lay.group for r in lay.table[3]], device=dev)
    scales = torch.repeat_interleave(scale0, reps, dim=1, output_size=lay.K // lay.group)   # no device wait
    return scales, torch.argsort(invperm.to(torch.int64), dim=-1)


def _copy(out: torch.Tensor, t: torch.Tensor) -> None:
    with torch.inference_mode():          # `out` may be an inference tensor (the module loads under that mode)
        copy_into(out, t)


def _copy_into(out: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """out[i] = tensors[i]: from the model's files where they are views of them (st_read.copy_into),
    large buffers in pieces of COPY_MIN_BYTES on a few threads (reads and copies let go of the GIL)."""
    if out.numel() * out.element_size() < COPY_MIN_BYTES:
        for o, t in zip(out, tensors):
            _copy(o, t)
        return
    step = max(1, COPY_MIN_BYTES // out.element_size())
    pieces = [(o.view(-1)[i:i + step], t.reshape(-1)[i:i + step])
              for o, t in zip(out, tensors) for i in range(0, o.numel(), step)]
    for f in [_pool("pack-copy", COPY_THREADS).submit(_copy, o, t) for o, t in pieces]:
        f.result()


def _check_finite(ok: torch.Tensor, names: Sequence[str]) -> None:
    """ok [B]: whether each of the experts `names` has finite exact scales; else a PackError naming the first that
    has not (one wait for the device)."""
    if not bool(ok.all()):
        raise PackError(f"{names[int((~ok).nonzero()[0])]}: {EXL2_EXACT} holds scales that are not finite numbers")


def _finite(scales: torch.Tensor) -> torch.Tensor:
    """[B, G, N] -> bool [B]: each expert's scales all finite (on their device, no wait)."""
    return torch.isfinite(scales).flatten(1).all(dim=1)


def _gather(experts: Sequence[Mapping[str, torch.Tensor]], dev: torch.device, keys: Sequence[str]) -> list[torch.Tensor]:
    """A batch's tensors `keys` (its layout's `unpacked`), each stacked in host memory (page-locked when `dev`
    is a GPU)."""
    out = []
    with torch.inference_mode():
        for k in keys:
            ts = [t[k].cpu() for t in experts]
            buf = torch.empty((len(ts), *ts[0].shape), dtype=ts[0].dtype, pin_memory=dev.type == "cuda")
            _copy_into(buf, ts)
            out.append(buf)
    return out


def _batches(lays: Sequence[_Layout], step: int) -> list[tuple[int, int]]:
    """Runs of at most `step` consecutive experts of one layout."""
    out, e0 = [], 0
    while e0 < len(lays):
        e1 = e0 + 1
        while e1 < len(lays) and e1 - e0 < step and lays[e1].key == lays[e0].key:
            e1 += 1
        out.append((e0, e1))
        e0 = e1
    return out


def pack_experts(experts: Sequence[Mapping[str, torch.Tensor]], name: str = "experts",
                 device: torch.device | str | None = None, host: Optional[HostArena] = None,
                 columns: Optional[Sequence[torch.Tensor]] = None) -> PackedExperts:
    """Stack one projection of every expert into the kernels' layout (see the module docstring).

    host: keep the codes in this page-locked host memory as `cold`, for offload; `qweight` is then
    that same host stack until offload gives it VRAM slots. columns: per expert, the old output
    column of each new one (`pack_layer`: gate and up in down's order), applied before the codes are
    packed and copied (words run along the input rows, so this equals permuting the packed stack).
    The tensors may be anywhere (host tensors over the model's files): experts of one layout are
    unpacked on `device` a batch at a time (CHUNK_ELEMENTS codes), each batch's codes copied at once; an
    expert with more codes than that (Mixtral-8x22B's: 100M) is unpacked a range of its columns at a
    time, so the temporaries stay within the budget a tight VRAM budget leaves the load."""
    if not experts:
        raise PackError(f"{name}: no experts")
    lays = [_layout(t, f"{name}[{e}]") for e, t in enumerate(experts)]
    K, N = lays[0].K, lays[0].N
    for e, lay in enumerate(lays):
        if (lay.K, lay.N) != (K, N):
            raise PackError(f"{name}[{e}]: shape {(lay.K, lay.N)} differs from expert 0's {(K, N)}")
    bits = _stored_bits(max(lay.max_bits for lay in lays))
    group = math.gcd(*[lay.group for lay in lays])
    per = 32 if bits == 3 else 32 // bits
    if K % per or K % group:
        raise PackError(f"{name}: {K} input rows do not divide into words of {per} or groups of {group}")
    dev = torch.device(device) if device is not None else experts[0]["q_weight"].device
    E = len(experts)
    if host is not None:
        qweight = host.empty((E, K * bits // 32, N))
    else:
        qweight = torch.empty((E, K * bits // 32, N), dtype=torch.int32, device=dev)
    scales = torch.empty((E, K // group, N), dtype=torch.float16, device=dev)
    perm = torch.empty((E, K), dtype=torch.int32, device=dev)
    batches = _batches(lays, max(1, CHUNK_ELEMENTS // (K * N)))
    # host tensors (views of the model's files): the next batch is gathered on a thread while this one
    # is unpacked; tensors already on `dev` are stacked there, on this thread's stream
    on_dev = all(t["q_weight"].device == dev for t in experts)
    ahead = None if on_dev else _pool("pack-gather", 1).submit(_gather, experts[:batches[0][1]], dev,
                                                                lays[0].unpacked)
    finite = torch.ones(E, dtype=torch.bool, device=dev) if any(lay.exact for lay in lays) else None
    for i, (e0, e1) in enumerate(batches):
        if on_dev:
            parts = [torch.stack([t[k] for t in experts[e0:e1]]) for k in lays[e0].unpacked]
        else:
            parts = [p.to(dev, non_blocking=True) for p in ahead.result()]
            if i + 1 < len(batches):
                e2 = batches[i + 1][1]
                ahead = _pool("pack-gather", 1).submit(_gather, experts[e1:e2], dev, lays[e1].unpacked)
        qw, Q = parts[0], parts[0].shape[1]
        sc, pm = _unpack_scales(*parts[1:4], lays[e0], *parts[4:])
        if lays[e0].exact:
            finite[e0:e1] = _finite(sc)
        idx = None
        if columns is not None:
            idx = torch.stack([columns[e].to(dev, torch.long) for e in range(e0, e1)])[:, None, :]   # [B, 1, N]
            sc = torch.gather(sc, 2, idx.expand(-1, sc.shape[1], -1))
        step = max(1, CHUNK_ELEMENTS // ((e1 - e0) * K))           # columns a piece: all of them but for huge experts
        for n0 in range(0, N, step):
            n1 = min(N, n0 + step)
            words = qw[:, :, n0:n1] if idx is None else torch.gather(qw, 2, idx[:, :, n0:n1].expand(-1, Q, -1))
            qweight[e0:e1, :, n0:n1].copy_(_pack_words(_unpack_codes(words, lays[e0]), bits))
        scales[e0:e1] = torch.repeat_interleave(sc, lays[e0].group // group, dim=1).to(dev, torch.float16)
        perm[e0:e1] = pm.to(dev, torch.int32)
    if finite is not None:                        # exact scales all finite: one wait, after the whole projection
        _check_finite(finite, [f"{name}[{e}]" for e in range(E)])
    return PackedExperts(qweight=qweight, scales=scales, perm=perm, bits=bits, group=group,
                         in_features=K, out_features=N, cold=qweight if host is not None else None)


def pack_layer(load, name: str = "experts", device: torch.device | str | None = None,
               host: Optional[HostArena] = None, on_packed=None) -> tuple[PackedExperts, PackedExperts, PackedExperts]:
    """Gate, up and down of a layer's experts packed, with the intermediate already in down's packed
    order: bit for bit what `pack_experts` three times and `align_intermediate` give, without
    align's round trip of every gate and up expert's codes from host memory to `device` and back
    (offload loads). load(projection) -> that projection's EXL2 tensors per expert ("down_proj",
    then "gate_proj", "up_proj": down first, for its permutations; one projection's tensors alive at
    a time). on_packed(projection, pack): after each (the caller's RAM ledger)."""
    w2 = pack_experts(load("down_proj"), f"{name}.down_proj", device=device, host=host)
    if on_packed is not None:
        on_packed("down_proj", w2)
    I = w2.in_features
    perms = w2.perm.long()
    packs = {}
    for proj in ("gate_proj", "up_proj"):
        tensors = load(proj)
        N = int(tensors[0]["q_weight"].shape[-1]) if tensors and "q_weight" in tensors[0] else I
        if N < I:
            raise PackError(f"{name}.{proj} has {N} columns, down takes {I}: they do not chain")
        pad = torch.arange(I, N, device=perms.device)
        cols = [torch.cat([perms[e], pad]) for e in range(w2.num_experts)]
        packs[proj] = pack_experts(tensors, f"{name}.{proj}", device=device, host=host, columns=cols)
        del tensors
        if on_packed is not None:
            on_packed(proj, packs[proj])
    w1, w3 = packs["gate_proj"], packs["up_proj"]
    if w3.out_features != w1.out_features:
        raise PackError(f"{name}: gate/up have {w1.out_features}/{w3.out_features} columns: they do not chain")
    w2.perm.copy_(torch.arange(I, dtype=w2.perm.dtype, device=w2.perm.device).expand_as(w2.perm))
    return w1, w3, w2


def dequantize_packed(p: PackedExperts, e: int) -> torch.Tensor:
    """Dense weight [N, K] (float32) of expert e from the packed layout: checks the packing itself."""
    u = _unpack_words(p.codes(e).to(p.scales.device), p.bits, p.in_features)   # [K, N]
    wt = (u - (1 << (p.bits - 1))).to(torch.float32)
    wt = wt * torch.repeat_interleave(p.scales[e].to(torch.float32), p.group, dim=0)
    w_t = torch.empty_like(wt)
    w_t[p.perm[e].long()] = wt
    return w_t.T.contiguous()


def intermediate_aligned(w2: PackedExperts) -> bool:
    """Whether down's packed rows are the intermediate in order (perm[e] = 0..I-1 for every expert)."""
    ident = torch.arange(w2.in_features, dtype=w2.perm.dtype, device=w2.perm.device)
    return bool((w2.perm == ident).all())


@torch.inference_mode()
def align_intermediate(w1: PackedExperts, w3: PackedExperts, w2: PackedExperts,
                       device: torch.device | str | None = None) -> None:
    """Put each expert's intermediate features in down's packed order, in place: gate and up columns
    n move to where down reads them (new column j = old column perm2[e][j]), and down's permutation
    becomes the identity. The expert computes the same function (the intermediate's order is
    internal to it); what changes is that a range of down's packed rows is a range of gate/up
    columns, so an expert can be cut into two parts computed in two places (runtime/cpu/path.py).

    Codes in host memory (`cold`) are permuted through `device` when given (a GPU: one expert
    at a time there and back), else where they are."""
    I, N = w2.in_features, w1.out_features
    if w3.out_features != N or N < I:
        raise PackError(f"gate/up have {N}/{w3.out_features} columns, down takes {I}: they do not chain")
    if intermediate_aligned(w2):
        return
    dev = torch.device(device) if device is not None else None
    pad = torch.arange(I, N, device=w2.perm.device)
    for e in range(w2.num_experts):
        idx = torch.cat([w2.perm[e].long(), pad])                              # [N] old column of new j
        for p in (w1, w3):
            p.scales[e] = p.scales[e][:, idx.to(p.scales.device)]
            codes = p.codes(e)                                                 # a view of its stack
            work = dev if dev is not None and codes.device != dev else codes.device
            codes.copy_(codes.to(work, non_blocking=True)[:, idx.to(work)])
    w2.perm.copy_(torch.arange(I, dtype=w2.perm.dtype, device=w2.perm.device).expand_as(w2.perm))

