"""The per-expert repacking as it was before experts were unpacked in batches: the oracle that
runtime/experts/pack.py's batched path must match bit for bit (tests/test_pack_batched.py)."""
from __future__ import annotations

import math
from typing import Mapping, Optional, Sequence

import torch

from runtime.experts.pack import Exl2Codes, HostArena, PackedExperts, PackError, _row_table, _stored_bits


def unpack_exl2_v1(t: Mapping[str, torch.Tensor], name: str = "linear") -> Exl2Codes:
    """EXL2 tensors (q_weight, q_scale, q_scale_max, q_groups, q_invperm) -> codes and scales."""
    for key in ("q_weight", "q_scale", "q_scale_max", "q_groups", "q_invperm"):
        if key not in t:
            raise PackError(f"{name}: tensor {key} missing")
    qw = t["q_weight"].to(torch.int64) & 0xFFFFFFFF          # [Q, N] words as unsigned
    qs = t["q_scale"].to(torch.int64) & 0xFFFFFFFF           # [G0, N // 8]
    qsm = t["q_scale_max"]                                   # [G0] fp16
    groups = t["q_groups"].to(torch.int64).cpu().view(-1, 2) # [G0, 2] (bits, first qrow)
    invperm = t["q_invperm"].to(torch.int64)                 # [K]
    Q, N = qw.shape
    K = invperm.numel()
    G0 = groups.shape[0]
    if qs.shape != (G0, N // 8) or qsm.numel() != G0:
        raise PackError(f"{name}: q_scale {tuple(qs.shape)} / q_scale_max {tuple(qsm.shape)} "
                        f"do not match {G0} groups and {N} columns")
    word, shift, width, rows_per_group, max_bits = _row_table(groups, Q, K, name)
    dev = qw.device
    word, shift, width = word.to(dev), shift.to(dev)[:, None], width.to(dev)[:, None]   # [K], [K, 1]
    padded = torch.cat([qw, torch.zeros((1, N), dtype=torch.int64, device=dev)])
    pair = padded[word] | (padded[word + 1] << 32)           # [K, N] 64 bits from the row's first word
    q = (pair >> shift) & ((1 << width) - 1)
    codes = (q - (1 << (width - 1))).to(torch.int8)          # [K, N]

    # Scales per original group, then split every group into rows of one common size.
    nib = torch.arange(8, device=dev) * 4
    qs4 = ((qs[:, :, None] >> nib) & 15).reshape(G0, N)      # [G0, N]
    mx = t["q_scale_max"].to(torch.float16) * (1 / 256)     # fp16 roundings as exllamav2's dq_scale
    scale0 = (((qs4 + 1) ** 2).to(torch.float16) * mx[:, None]).to(torch.float32)
    group = math.gcd(*rows_per_group) if len(rows_per_group) > 1 else rows_per_group[0]
    reps = torch.tensor([r // group for r in rows_per_group], device=dev)
    scales = torch.repeat_interleave(scale0, reps, dim=0)    # [K // group, N]
    perm = torch.argsort(invperm)
    return Exl2Codes(codes=codes, scales=scales, group=group, perm=perm, max_bits=max_bits)


def _words_v1(u: torch.Tensor, bits: int) -> torch.Tensor:
    """int64 [K, N] unsigned codes of `bits` bits -> int32 [K // per, N], per = 32 // bits, LSB first."""
    per = 32 // bits
    K, N = u.shape
    shifts = (torch.arange(per, device=u.device) * bits).view(1, per, 1)
    words = (u.view(K // per, per, N) << shifts).sum(dim=1)  # < 2**32, fits int64
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words)
    return words.to(torch.int32)


def _pack_words_v1(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """int8 [K, N] signed codes -> int32 [K * bits // 32, N] (bits 3: low-2-bit plane, then high bit)."""
    u = codes.to(torch.int64) + (1 << (bits - 1))
    if bits == 3:
        return torch.cat([_words_v1(u & 3, 2), _words_v1(u >> 2, 1)])
    return _words_v1(u, bits)


def pack_experts_v1(experts: Sequence[Mapping[str, torch.Tensor]], name: str = "experts",
                 device: torch.device | str | None = None, host: Optional[HostArena] = None,
                 columns: Optional[Sequence[torch.Tensor]] = None) -> PackedExperts:
    """Stack one projection of every expert into the kernels' layout (see the module docstring).

    host: keep the codes in this page-locked host memory as `cold`, for offload; `qweight` is then
    that same host stack until offload gives it VRAM slots. columns: per expert, the old output
    column of each new one (`pack_layer`: gate and up in down's order), applied before the codes are
    packed and copied (words run along the input rows, so this equals permuting the packed stack)."""
    if not experts:
        raise PackError(f"{name}: no experts")
    first = unpack_exl2_v1(experts[0], f"{name}[0]")
    K, N = first.codes.shape
    units = [first]
    for e in range(1, len(experts)):
        u = unpack_exl2_v1(experts[e], f"{name}[{e}]")
        if u.codes.shape != (K, N):
            raise PackError(f"{name}[{e}]: shape {tuple(u.codes.shape)} differs from expert 0's {(K, N)}")
        units.append(u)
    bits = _stored_bits(max(u.max_bits for u in units))
    group = math.gcd(*[u.group for u in units])
    per = 32 if bits == 3 else 32 // bits
    if K % per or K % group:
        raise PackError(f"{name}: {K} input rows do not divide into words of {per} or groups of {group}")
    dev = torch.device(device) if device is not None else first.codes.device
    E = len(units)
    if host is not None:
        qweight = host.empty((E, K * bits // 32, N))
    else:
        qweight = torch.empty((E, K * bits // 32, N), dtype=torch.int32, device=dev)
    scales = torch.empty((E, K // group, N), dtype=torch.float16, device=dev)
    perm = torch.empty((E, K), dtype=torch.int32, device=dev)
    for e, u in enumerate(units):
        codes, sc = u.codes, u.scales
        if columns is not None:
            idx = columns[e].to(codes.device, torch.long)
            codes, sc = codes[:, idx], sc[:, idx]
        qweight[e] = _pack_words_v1(codes, bits).to(qweight.device)
        scales[e] = torch.repeat_interleave(sc, u.group // group, dim=0).to(dev, torch.float16)
        perm[e] = u.perm.to(dev, torch.int32)
    return PackedExperts(qweight=qweight, scales=scales, perm=perm, bits=bits, group=group,
                         in_features=K, out_features=N, cold=qweight if host is not None else None)
