"""The dense projections of the hybrid engine behind one small interface, `QuantLinear`.

A `QuantLinear` is y = x @ W.T for one or several stored linears whose outputs are concatenated (a
fused projection: Qwen3.5's in_proj_qkv, in_proj_z, in_proj_b and in_proj_a are one call). Two
implementations of the EXL2 case, one per device:

- `CudaExl2Linear`: exllamav2's quantized matmul (`exllamav2_ext.gemm_half_q_half` on a Q matrix made
  by `exllamav2.ext.make_q_matrix`, as `ExLlamaV2Linear.load` makes it): fp16 in, fp16 out. Large row
  counts dequantize into `temp_dq` and use cuBLAS inside the extension, in slices of `max_dq_rows`.
  Imports exllamav2 when built (CUDA machines only).
- `CpuExl2Linear`: the same tensors dequantized once (runtime/exl2/format.py, exactly the values
  exllamav2 reconstructs) into one dense matrix, in the engine's activation dtype.

Plain (fp16 / bf16 / fp32) stored weights (Qwen3.5's shared_expert_gate) are `DenseLinear` on either
device. `build` picks by device and storage. Nothing here reads a device value on the host, so a
forward through these is graph-capturable on CUDA.

T rows, K input features, N output features.
"""
from __future__ import annotations

from typing import Protocol, Sequence

import torch

from runtime.errors import EngineError, InvalidModel
from runtime.modelfolder import EXL2_PARTS, ModelFolder

# Largest dequantized slice (elements) a CUDA Q matrix uses for many-row inputs (exllamav2's max_dq_size).
MAX_DQ_ELEMENTS = 32 << 20


class QuantLinear(Protocol):
    in_features: int
    out_features: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, K] -> [T, N] in the activation dtype."""

    def nbytes(self) -> int:
        """Weight bytes one forward reads."""


class DenseLinear:
    """A plain weight [N, K] kept in the activation dtype."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype, device: torch.device):
        self.weight = weight.to(device=device, dtype=dtype).contiguous()
        self.out_features, self.in_features = self.weight.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.weight.dtype) @ self.weight.T

    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()


class ConcatLinear:
    """Stored linears of both kinds fused by the caller: each run of one kind one projection, the
    outputs concatenated (a Qwen3.5 DeltaNet layer's in_proj_qkv and in_proj_z quantized, its gates
    in_proj_b and in_proj_a kept in fp16 by our converter). `parts` for settle_autotune."""

    def __init__(self, parts: Sequence):
        self.parts = list(parts)
        self.in_features = self.parts[0].in_features
        self.out_features = sum(p.out_features for p in self.parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)

    def nbytes(self) -> int:
        return sum(p.nbytes() for p in self.parts)


class CpuExl2Linear(DenseLinear):
    """EXL2 tensors dequantized once (exllamav2's fp16 values), outputs of the parts concatenated."""

    def __init__(self, parts: Sequence[dict], outs: Sequence[int], names: Sequence[str], dtype: torch.dtype):
        from runtime.exl2.format import Exl2FormatError, dequantize
        ws = []
        for t, out, name in zip(parts, outs, names):
            try:
                ws.append(dequantize(t, torch.float32, out_features=out, name=name))
            except Exl2FormatError as e:
                raise InvalidModel(name, f"invalid EXL2 tensors: {e}") from None
        super().__init__(torch.cat(ws) if len(ws) > 1 else ws[0], dtype, torch.device("cpu"))
        self.stored_bytes = sum(sum(v.numel() * v.element_size() for v in t.values()) for t in parts)

    def nbytes(self) -> int:
        return self.stored_bytes


class CudaExl2Linear:
    """exllamav2's quantized GEMM, one Q matrix per stored part, outputs concatenated."""

    def __init__(self, parts: Sequence[dict], outs: Sequence[int], names: Sequence[str], device: torch.device):
        from exllamav2.ext import exllamav2_ext, make_q_matrix
        self.ext = exllamav2_ext
        self.handles, self.widths, self.outs, self._keep = [], [], list(outs), []
        self.in_features = None
        self.stored_bytes = 0
        # one dequantization scratch for every Q matrix of the device (they run one after another on one
        # stream), as exllamav2's device context shares its scratch; each matrix uses at most
        # max_dq_rows * N <= MAX_DQ_ELEMENTS of it
        self.temp_dq = _scratch(device)
        for t, out, name in zip(parts, outs, names):
            check_exl2(t, name)                  # exllamav2's kernels trust the group table and the shapes
            w = {k: v.to(device) for k, v in t.items()}
            k_in, n = w["q_invperm"].shape[0], w["q_weight"].shape[1]
            if self.in_features is None:
                self.in_features = k_in
            elif k_in != self.in_features:
                raise InvalidModel(name, f"takes {k_in} inputs, the projection it is fused with {self.in_features}")
            if not 0 < out <= n:
                raise InvalidModel(name, f"{out} output features but {n} stored columns")
            w["q_perm"] = torch.argsort(w["q_invperm"]).to(torch.int)
            self.stored_bytes += sum(v.numel() * v.element_size() for v in t.values())
            self.handles.append(make_q_matrix(w, self.temp_dq, max_dq_rows=MAX_DQ_ELEMENTS // n))
            self._keep.append(w)                 # the Q matrix points into these tensors
            self.widths.append(n)
        self.out_features = sum(self.outs)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.half().contiguous()
        ys = []
        for handle, n, out in zip(self.handles, self.widths, self.outs):
            y = torch.empty((x.shape[0], n), dtype=torch.float16, device=x.device)
            self.ext.gemm_half_q_half(x, handle, y, False)
            ys.append(y if out == n else y[:, :out])
        return ys[0] if len(ys) == 1 else torch.cat(ys, dim=1)

    def nbytes(self) -> int:
        return self.stored_bytes

    def shapes(self) -> list[tuple[int, int, object]]:
        return [(self.in_features, n, h) for h, n in zip(self.handles, self.widths)]


_SCRATCH: dict[torch.device, torch.Tensor] = {}


def check_exl2(parts: dict, name: str) -> None:
    """An EXL2 tensor set whole and consistent (runtime/exl2/format.read_layout: dtypes, group table,
    scales per column, a true permutation), else InvalidModel naming it: a folder's bytes are untrusted,
    and exllamav2's kernels index by them unchecked."""
    from runtime.exl2.format import Exl2FormatError, read_layout
    try:
        read_layout(parts, name)
    except Exl2FormatError as e:
        raise InvalidModel(name, f"invalid EXL2 tensors: {e}") from None


def _scratch(device: torch.device) -> torch.Tensor:
    if device not in _SCRATCH:
        _SCRATCH[device] = torch.empty(MAX_DQ_ELEMENTS, dtype=torch.float16, device=device)
    return _SCRATCH[device]


def settle_autotune(linears: Sequence) -> int:
    """Run exllamav2's GEMM past its autotuning (it times its first calls of each shape with a host
    synchronisation: that must not happen inside an answer or a graph capture) for every distinct
    (K, N) of these projections at 1..AUTOTUNE_ROWS rows; returns the number of shapes settled."""
    from runtime.backends.exl2_kernels import AUTOTUNE_CALLS, AUTOTUNE_ROWS
    seen: dict[tuple[int, int], object] = {}
    ext = None
    linears = [p for lin in linears for p in getattr(lin, "parts", [lin])]      # ConcatLinear's parts
    for lin in linears:
        if isinstance(lin, CudaExl2Linear):
            ext = lin.ext
            for k, n, handle in lin.shapes():
                seen.setdefault((k, n), (handle, lin.temp_dq.device))
    for (k, n), (handle, dev) in seen.items():
        for r in range(1, AUTOTUNE_ROWS + 1):
            a = torch.zeros((r, k), dtype=torch.float16, device=dev)
            c = torch.empty((r, n), dtype=torch.float16, device=dev)
            for _ in range(AUTOTUNE_CALLS):
                ext.gemm_half_q_half(a, handle, c, False)
    if seen:
        torch.cuda.synchronize()
    return len(seen)


def is_exl2(folder: ModelFolder, prefix: str) -> bool:
    return folder.has(f"{prefix}.q_weight")


def exl2_parts(folder: ModelFolder, prefix: str) -> dict:
    """A dense linear's EXL2 tensors without its exact scales (q_scale_exact) where it has them: exllamav2's Q
    matrix reads only q_scale / q_scale_max, and the split-K GEMV in front of it and the CPU's dequantized copy
    compute what it computes, so that every row count and device gives the same weights."""
    return {part: folder.tensor(f"{prefix}.{part}") for part in EXL2_PARTS}


def build(folder: ModelFolder, prefixes: Sequence[str], outs: Sequence[int], device: torch.device,
          dtype: torch.dtype) -> QuantLinear:
    """One projection over the stored linears `prefixes` (their output widths `outs`), concatenated.
    All EXL2 -> the device's EXL2 implementation; all plain -> `DenseLinear`; a mix -> `ConcatLinear`
    over each run of one kind (our converter keeps a DeltaNet layer's small gates in fp16)."""
    exl2 = [is_exl2(folder, p) for p in prefixes]
    if any(exl2) and not all(exl2):
        runs: list[tuple[list[str], list[int]]] = []
        for i, (p, o) in enumerate(zip(prefixes, outs)):
            if i == 0 or exl2[i] != exl2[i - 1]:
                runs.append(([], []))
            runs[-1][0].append(p)
            runs[-1][1].append(o)
        return ConcatLinear([build(folder, ps, os_, device, dtype) for ps, os_ in runs])
    if all(exl2):
        parts = [exl2_parts(folder, p) for p in prefixes]
        if device.type == "cuda":
            return CudaExl2Linear(parts, outs, prefixes, device)
        return CpuExl2Linear(parts, outs, [f"{folder.path}: {p}" for p in prefixes], dtype)
    ws = [folder.tensor(f"{p}.weight").float() for p in prefixes]
    return DenseLinear(torch.cat(ws) if len(ws) > 1 else ws[0], dtype, device)


def check_width(lin: QuantLinear, out: int, inp: int, where: str) -> None:
    if (lin.out_features, lin.in_features) != (out, inp):
        raise EngineError(f"{where}: projection is [{lin.out_features}, {lin.in_features}], the model needs "
                          f"[{out}, {inp}]")


