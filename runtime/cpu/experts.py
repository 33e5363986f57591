"""Cold experts computed on the CPU: CPU-friendly copies of a layer's EXL2 experts and their forward.

Letters: T rows (1..8: decode, or verifying a few drafted tokens), H hidden, I expert width,
A experts per token, E experts in the store, K / N input / output features of one projection.

    y[t] = sum_a w[t, a] · down_e(silu(gate_e(x[t])) * up_e(x[t])),   e = ids[t, a]

At batch 1 this is bound by the bytes read from RAM, so the format is the lever. Formats (bytes per
weight read, before scales):
  "bf16"  2     dense bf16, torch's CPU matmul (oneDNN)
  "int8"  1     weight-only int8, one bf16 scale per output row (torch._weight_int8pack_mm); requantized
  "int4"  0.5   torch's CPU int4 groupwise path, in EXL2's packed row order so its groups line up with
                EXL2's: 2/3/4-bit codes are kept (scales rounded to bf16), 5/6/8-bit groups requantized
  "exl2"  b/8   the EXL2 codes themselves (3-bit stays 3-bit), repacked losslessly into column tiles
                and read by a small C++ kernel (runtime/cpu/csrc/exl2_cpu.cpp)
Every expert used by several of the T rows is read once for all of them. The torch formats loop over
experts in Python; the exl2 kernel does the whole layer in one call with the GIL released.
`CpuExpertRunner` runs forwards on a dedicated thread so the caller (the GPU's stream) overlaps.
"""
from __future__ import annotations

import concurrent.futures as cf
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

import torch
import torch.nn.functional as F

from runtime import tuning
from runtime.exl2 import format as fmt

FORMATS = ("bf16", "int8", "int4", "exl2")
PROJS = ("gate", "up", "down")
MAX_ROWS = 8
ExpertTensors = Mapping[str, Mapping[str, torch.Tensor]]   # {"gate"|"up"|"down": EXL2 tensor dict}


class CpuExpertsError(ValueError):
    """A store that cannot be built or a call it cannot serve; the message names what and where."""


@dataclass
class ExpertWeights:
    """One expert in one CPU format: its tensors and the bytes a forward reads from them."""
    format: str
    tensors: dict[str, torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def clone(self) -> "ExpertWeights":
        return ExpertWeights(self.format, {k: v.clone() for k, v in self.tensors.items()})


def _shapes(expert: ExpertTensors, name: str) -> tuple[int, int]:
    missing = [p for p in PROJS if p not in expert]
    if missing:
        raise CpuExpertsError(f"{name}: missing projections {missing} (need gate, up, down)")
    h = expert["gate"]["q_invperm"].shape[0]
    i = expert["down"]["q_invperm"].shape[0]
    if expert["up"]["q_invperm"].shape[0] != h:
        raise CpuExpertsError(f"{name}: gate takes {h} inputs but up takes {expert['up']['q_invperm'].shape[0]}")
    return h, i


def _layout(t: Mapping[str, torch.Tensor], name: str):
    """-> (in_features, padded N, groups, perm [K] int64 with packed row k = input feature perm[k])."""
    k, n, groups = fmt.read_layout(t, name)
    return k, n, groups, torch.argsort(t["q_invperm"].to(torch.int64))


# ---------------------------------------------------------------------------------------------
# Conversion of one expert

def _to_exl2(t: Mapping[str, torch.Tensor], out: int, name: str) -> dict[str, torch.Tensor]:
    """Lossless: q_weight cut into tiles of 16 columns [N/16, Q, 16] (the kernel's order of the bits of each
    chunk of 32 rows, csrc/qdot.cpp), fp16 scales [N/16, G, 16]."""
    k, n, groups, perm = _layout(t, name)
    qw = t["q_weight"].contiguous()
    q = qw.shape[0]
    sc = fmt.group_scales(t, name=name)                                  # [G, N] fp16 (what step_sizes spreads)
    grp = torch.tensor([[g.bits, g.first_qrow, g.first_row, g.rows] for g in groups], dtype=torch.int32)
    tiles = qw.view(q, n // 16, 16).permute(1, 0, 2).contiguous()
    load_kernel().to_planes(tiles, grp)                                  # the kernel's order of the same bits
    return {
        "qw": tiles,
        "sc": sc.view(len(groups), n // 16, 16).permute(1, 0, 2).contiguous(),
        "grp": grp,
        "perm": perm.to(torch.int32),
        "shape": torch.tensor([k, out, q], dtype=torch.int64),           # K, N (logical), Q
    }


def _int4_group(groups, k: int) -> int:
    for gs in (128, 64, 32):
        if k % gs == 0 and all(g.rows % gs == 0 for g in groups):
            return gs
    raise CpuExpertsError(f"EXL2 groups of {[g.rows for g in groups]} rows fit no int4 group size (32/64/128)")


def _to_int4(t: Mapping[str, torch.Tensor], out: int, name: str) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]:
    """-> (packed int4 [N, K/2] uint8, scales_and_zeros bf16 [K/gs, N, 2], group size, perm) in packed order.
    torch's CPU int4 kernel is fast only for bf16 (fp16 and fp32 run ~30x slower), so scales are bf16."""
    k, n, groups, perm = _layout(t, name)
    w = fmt.dequantize(t, out_features=out, name=name)[:, perm]         # [N, K] packed order
    step = fmt.step_sizes(t, name=name)[:out][:, perm]                  # [N, K]
    gs = _int4_group(groups, k)
    bits = torch.repeat_interleave(torch.tensor([g.bits for g in groups]), torch.tensor([g.rows for g in groups]))
    step = step * torch.pow(2.0, (bits - 4).clamp(min=0)).float()      # wider codes: coarser int4 steps
    s = step[:, ::gs].to(torch.bfloat16)                                 # [N, K/gs] (fp16 exact; bf16 rounds)
    q = (w / s.float().repeat_interleave(gs, dim=1)).round().clamp(-8, 7) + 8
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 8 if k % 128 == 0 else 2)
    sz = torch.stack([s.t(), torch.zeros_like(s.t())], dim=2).contiguous()   # [K/gs, N, 2]
    return packed, sz, gs, perm


def convert_expert(expert: ExpertTensors, format: str, name: str = "expert") -> ExpertWeights:
    """EXL2 gate/up/down of one expert -> ExpertWeights in `format`."""
    if format not in FORMATS:
        raise CpuExpertsError(f"{name}: unknown CPU expert format {format!r}; choose one of {FORMATS}")
    h, i = _shapes(expert, name)
    outs = {"gate": i, "up": i, "down": h}
    if format == "exl2":
        parts = {p: _to_exl2(expert[p], outs[p], f"{name}.{p}") for p in PROJS}
        return ExpertWeights("exl2", {f"{p}.{k}": v for p, d in parts.items() for k, v in d.items()})
    if format == "int4":
        tensors = {}
        for p in PROJS:                                  # each projection has its own input order
            packed, sz, gs, perm = _to_int4(expert[p], outs[p], f"{name}.{p}")
            tensors |= {p: packed, p + "_sz": sz, p + "_perm": perm, p + "_gs": torch.tensor(gs)}
        return ExpertWeights("int4", tensors)
    w = {p: fmt.dequantize(expert[p], out_features=outs[p], name=f"{name}.{p}") for p in PROJS}
    gu = torch.cat([w["gate"], w["up"]])                                 # [2I, H]
    if format == "bf16":
        return ExpertWeights("bf16", {"gu": gu.bfloat16(), "down": w["down"].bfloat16()})
    tensors = {}
    for key, m in (("gu", gu), ("down", w["down"])):                   # int8, one scale per row
        s = (m.abs().amax(dim=1) / 127).clamp(min=1e-12)
        tensors[key] = (m / s[:, None]).round().clamp(-127, 127).to(torch.int8)
        tensors[key + "_s"] = s.bfloat16()
    return ExpertWeights("int8", tensors)


def spread(t: torch.Tensor) -> torch.Tensor:
    """`t` (new, not yet written) with its pages interleaved over the NUMA nodes where the machine has
    several (the kernel's interleave_pages): a team on every socket then reads every memory controller."""
    k = load_kernel()
    if k.numa_nodes() > 1:
        k.interleave_pages(t)
    return t


def flatten(parts: Sequence[Mapping[str, torch.Tensor]]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Projections as _to_exl2 gives them -> flat buffers qw int32, sc fp16, grp int32 [*, 4], perm int32
    (one allocation each) and desc int64 [P, 8], the offsets of projection p: (qw, sc, grp, G, perm, K, N, Q)."""
    desc, off = [], [0, 0, 0, 0]
    for t in parts:
        k, n, q = t["shape"].tolist()
        desc.append([off[0], off[1], off[2], t["grp"].shape[0], off[3], k, n, q])
        off = [off[0] + t["qw"].numel(), off[1] + t["sc"].numel(), off[2] + t["grp"].shape[0], off[3] + t["perm"].numel()]
    flat = {"qw": spread(torch.empty(off[0], dtype=torch.int32)), "sc": spread(torch.empty(off[1], dtype=torch.float16)),
            "grp": torch.empty((off[2], 4), dtype=torch.int32), "perm": torch.empty(off[3], dtype=torch.int32)}
    for d, t in zip(desc, parts):
        for key, o in (("qw", d[0]), ("sc", d[1]), ("grp", d[2]), ("perm", d[4])):
            src = t[key] if key == "grp" else t[key].reshape(-1)
            flat[key][o:o + src.shape[0]] = src
    return flat, torch.tensor(desc, dtype=torch.int64)


def read_experts(folder, layer: int, experts: Sequence[int]) -> list[dict[str, dict[str, torch.Tensor]]]:
    """EXL2 tensors of some experts of one layer of a ModelFolder (Qwen3-MoE names), for from_exl2."""
    out = []
    for e in experts:
        prefix = f"model.layers.{layer}.mlp.experts.{e}"
        if not folder.has(f"{prefix}.gate_proj.q_weight"):
            raise CpuExpertsError(f"{prefix}: no EXL2 expert tensors in the model folder (layer {layer} "
                                  f"is not MoE, expert {e} does not exist, or the experts are not EXL2)")
        out.append({p: folder.exl2_tensors(f"{prefix}.{p}_proj") for p in PROJS})
    return out


def stored_expert_bytes(expert: ExpertTensors) -> int:
    """Bytes of one expert as EXL2 stores it: the denominator of PathCosts.cpu_bytes_ratio."""
    return sum(fmt.stored_bits(expert[p]) for p in PROJS) // 8


# ---------------------------------------------------------------------------------------------
# The kernel extension

_EXT = None
_EXT_ERROR: str | None = None
_EXT_LOCK = threading.Lock()          # one build at a time (the load's background build, then its user)


def kernel_loaded() -> bool:
    """The C++ kernel is built and imported in this process (or its build failed: no wait left)."""
    return _EXT is not None or _EXT_ERROR is not None


def build_kernel_in_background() -> None:
    """Start building the C++ kernel on a thread (a compiler run the first time on a machine, about
    half a minute; then torch's build cache): a load starts it before reading the weights, which
    take longer, so that placing the experts later finds it built. Errors are kept for `load_kernel`."""
    if kernel_loaded():
        return

    def build() -> None:
        try:
            load_kernel()
        except CpuExpertsError:
            pass
    threading.Thread(target=build, name="cpu-expert-kernel-build", daemon=True).start()


def kernel_folder(name: str) -> Path:
    """Where the kernel `name` is built: under torch's extension root, one folder per Python and torch build
    (a module built against another torch must not be imported) and per checkout of the sources (`name`-<digest
    of csrc/'s path>): the build's commands name the sources by their path, so two checkouts sharing a folder
    rebuilt it in turn, half a minute of compiler each time, whenever their loads alternated."""
    import hashlib
    import sys

    from torch.utils.cpp_extension import get_default_build_root
    py = f"py{sys.version_info[0]}{sys.version_info[1]}"
    where = hashlib.sha256(str(CSRC.resolve()).encode()).hexdigest()[:8]
    return Path(get_default_build_root()) / f"moedesk-{py}-torch{torch.__version__}" / f"{name}-{where}"


def load_kernel():
    """Build (once, cached by torch) and import the C++ kernel; raises CpuExpertsError saying why not."""
    if _EXT is not None:                  # built: no lock (called before every forward with the CPU path)
        return _EXT
    with _EXT_LOCK:
        return _load_kernel()


def _load_kernel():
    global _EXT, _EXT_ERROR
    if _EXT is None and _EXT_ERROR is None:
        from runtime.gpu_setup import compiler_advice, find_compiler
        if find_compiler() is None:
            _EXT_ERROR = "no C++ compiler on PATH (or in CXX). " + compiler_advice()
        else:
            try:
                from torch.utils.cpp_extension import load
                from runtime.build_lock import one_build
                folder = kernel_folder(KERNEL_NAME)
                with one_build(folder):                          # (a stopped earlier build left no wait behind)
                    _EXT = load(name=KERNEL_NAME, sources=[str(CSRC / f) for f in SOURCES],
                                build_directory=str(folder), verbose=False, extra_cflags=kernel_cflags(),
                                extra_ldflags=["-fopenmp"])
            except Exception as e:                          # compiler errors, missing headers
                _EXT_ERROR = f"building the EXL2 CPU kernel failed: {str(e).strip()[-2000:]}"
            if _EXT is not None:
                _set_isa(_EXT, tuning.current().cpu_kernel_isa)
    if _EXT is None:
        raise CpuExpertsError(_EXT_ERROR)
    return _EXT


CSRC = Path(__file__).parent / "csrc"
# The module's name and build folder: not the fp32 kernel's (moedesk_exl2_cpu), so that a checkout of an older
# commit (a before/after comparison) keeps its own build instead of rebuilding over this one.
KERNEL_NAME = "moedesk_cpu_kernels"
SOURCES = ("exl2_cpu.cpp", "qdot.cpp", "attention.cpp")       # and the headers they include


def kernel_cflags() -> list[str]:
    """The kernel's compiler flags: no -march (the x86-64 baseline; the vector paths carry their own target
    attributes and are chosen at run time), and a digest of every file under csrc/, which torch's build
    cache then keys on (it hashes the listed sources, not the headers they include)."""
    import hashlib
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in sorted(CSRC.iterdir()) if p.is_file())).hexdigest()
    return ["-O3", "-ffp-contract=fast", "-std=c++17", "-fopenmp", f"-DMOEDESK_CSRC={digest[:16]}"]


def _set_isa(ext, name: str) -> None:
    """Take the vector path `name` (tuning's cpu_kernel_isa: auto, or a lower one forced); a path this CPU
    cannot run is an error that says what it runs."""
    if not ext.set_isa(name):
        global _EXT, _EXT_ERROR
        _EXT, _EXT_ERROR = None, (f"MOEDESK_CPU_KERNEL_ISA={name}: this CPU runs {ext.isa_supported()} at best "
                                  f"(avx512_vnni > avx2 > scalar)")


def kernel_unavailable_reason() -> str | None:
    try:
        load_kernel()
        return None
    except CpuExpertsError as e:
        return str(e)


# ---------------------------------------------------------------------------------------------
# The store

@dataclass
class CpuExperts:
    """The cold experts of one layer in one CPU format. `experts[e]` is store index e."""
    format: str
    hidden: int
    inter: int
    experts: list[ExpertWeights]
    _flat: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)

    @classmethod
    def from_exl2(cls, experts: Sequence[ExpertTensors], format: str, name: str = "layer") -> "CpuExperts":
        if not experts:
            raise CpuExpertsError(f"{name}: no experts given")
        shapes = {_shapes(e, f"{name}.experts.{i}") for i, e in enumerate(experts)}
        if len(shapes) != 1:
            raise CpuExpertsError(f"{name}: experts disagree on (hidden, width): {sorted(shapes)}")
        (h, i), = shapes
        conv = [convert_expert(e, format, f"{name}.experts.{j}") for j, e in enumerate(experts)]
        return cls(format, h, i, conv)

    @classmethod
    def from_flat(cls, hidden: int, inter: int, flat: Mapping[str, torch.Tensor],
                  name: str = "layer") -> "CpuExperts":
        """An exl2 store over ready flat buffers laid out as `_flatten` lays them: qw int32, sc fp16,
        grp int32 [*, 4], perm int32, desc int64 [E, 3, 8] (runtime/cpu/path.cpu_store)."""
        want = {"qw": torch.int32, "sc": torch.float16, "grp": torch.int32, "perm": torch.int32, "desc": torch.int64}
        for key, dtype in want.items():
            t = flat.get(key)
            if t is None or t.dtype != dtype or not t.is_contiguous() or t.device.type != "cpu":
                raise CpuExpertsError(f"{name}: flat buffer {key!r} must be a contiguous CPU {dtype} tensor, got "
                                      f"{None if t is None else (t.dtype, t.device.type, t.is_contiguous())}")
        desc = flat["desc"]
        if desc.dim() != 3 or desc.shape[1:] != (3, 8) or desc.shape[0] == 0:
            raise CpuExpertsError(f"{name}: desc must be [E >= 1, 3, 8], got {list(desc.shape)}")
        experts = [ExpertWeights("exl2", {f"{p}.shape": desc[e, j, 5:8] for j, p in enumerate(PROJS)})
                   for e in range(desc.shape[0])]
        store = cls("exl2", hidden, inter, experts, dict(flat))
        store._expert_bytes = store._flat_bytes()
        return store

    def __post_init__(self):
        if self.format == "exl2" and not self._flat:
            self._flatten()

    def _flat_bytes(self) -> int:
        return (sum(v.numel() * v.element_size() for k, v in self._flat.items() if k != "desc")
                // len(self.experts))

    def _flatten(self) -> None:
        """Copy every expert's tiles into flat buffers (one allocation each) with a descriptor table
        [E, 3, 8] of per expert and projection offsets."""
        parts = [{k.split(".", 1)[1]: v for k, v in ew.tensors.items() if k.startswith(p + ".")}
                 for ew in self.experts for p in PROJS]
        flat, desc = flatten(parts)
        self._flat = flat | {"desc": desc.view(-1, 3, 8)}
        self.experts = [ExpertWeights("exl2", {k: v for k, v in ew.tensors.items() if k.endswith(".shape")})
                        for ew in self.experts]                  # the flat copy is the one kept
        self._expert_bytes = self._flat_bytes()

    @property
    def num_experts(self) -> int:
        return len(self.experts)

    def expert_bytes(self) -> int:
        """Bytes one expert's forward reads (weights and scales)."""
        if self.format == "exl2":
            return self._expert_bytes
        return self.experts[0].nbytes

    def bits_per_weight(self) -> float:
        return self.expert_bytes() * 8 / (3 * self.hidden * self.inter)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, H] (any float), ids int64 [T, A] store indices, weights [T, A] -> float32 [T, H]."""
        if x.dim() != 2 or x.shape[1] != self.hidden or not 1 <= x.shape[0] <= MAX_ROWS:
            raise CpuExpertsError(f"x: expected [T, {self.hidden}] with T in 1..{MAX_ROWS}, got {list(x.shape)}")
        if ids.shape != weights.shape or ids.dim() != 2 or ids.shape[0] != x.shape[0]:
            raise CpuExpertsError(f"ids {list(ids.shape)} and weights {list(weights.shape)} must both be [T, A] "
                                  f"with T = {x.shape[0]}")
        ids = ids.to(torch.int64)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_experts):
            raise CpuExpertsError(f"ids: values must be store indices in 0..{self.num_experts - 1}, "
                                  f"got {int(ids.min())}..{int(ids.max())}")
        if self.format == "exl2":
            f = self._flat
            return load_kernel().experts_forward(x.float().contiguous(), ids.contiguous(),
                                                 weights.float().contiguous(), f["qw"], f["sc"], f["grp"],
                                                 f["perm"], f["desc"])
        y = torch.zeros(x.shape, dtype=torch.float32)
        flat_ids, flat_w = ids.reshape(-1), weights.float().reshape(-1)
        rows_of = torch.arange(x.shape[0]).repeat_interleave(ids.shape[1])
        for e in torch.unique(flat_ids).tolist():            # each expert read once for all its rows
            sel = flat_ids == e
            rows, w = rows_of[sel], flat_w[sel]
            o = self._expert(self.experts[e].tensors, x[rows])
            y.index_add_(0, rows, o.float() * w[:, None])
        return y

    def _expert(self, t: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        i = self.inter
        if self.format == "bf16":
            gu = x.bfloat16() @ t["gu"].T                                       # [R, 2I]
            return (F.silu(gu[:, :i]) * gu[:, i:]) @ t["down"].T
        if self.format == "int8":
            gu = torch.ops.aten._weight_int8pack_mm(x.bfloat16(), t["gu"], t["gu_s"])
            h = F.silu(gu[:, :i]) * gu[:, i:]
            return torch.ops.aten._weight_int8pack_mm(h, t["down"], t["down_s"])
        def mm(v: torch.Tensor, p: str) -> torch.Tensor:                        # int4, packed row order
            return torch.ops.aten._weight_int4pack_mm_for_cpu(v[:, t[p + "_perm"]].bfloat16(), t[p],
                                                              int(t[p + "_gs"]), t[p + "_sz"]).float()
        return mm(F.silu(mm(x, "gate")) * mm(x, "up"), "down")


def reference_forward(dense: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], x: torch.Tensor,
                      ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Oracle in float64 from dequantized weights: dense[e] = (gate [I, H], up [I, H], down [H, I])."""
    y = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for a in range(ids.shape[1]):
            g, u, d = (m.double() for m in dense[int(ids[t, a])])
            xt = x[t].double()
            y[t] += float(weights[t, a]) * (d @ (F.silu(g @ xt) * (u @ xt)))
    return y


class CpuExpertRunner:
    """One dedicated thread for CPU expert work: `submit` returns a Future, the caller goes on (GPU work)."""

    def __init__(self, threads: int | None = None):
        self._threads = threads
        self._pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="cpu-experts",
                                           initializer=self._init)

    def _init(self) -> None:
        if self._threads:
            from runtime.cpu_load import fix_thread_count
            fix_thread_count(self._threads)

    def submit(self, store: CpuExperts, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> cf.Future:
        return self._pool.submit(store.forward, x, ids, weights)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
