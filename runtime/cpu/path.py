"""The CPU path for cold experts in a decode step (one row): part of a layer's cold experts computed
by the CPU from host RAM while the GPU reads the rest over PCIe.

Per offloaded layer, a `CpuPath` owns CPU-format copies (runtime/cpu/experts.py, format exl2)
of the experts it may compute, a device mask `skip` (uint8 [E]: 1 = the CPU computes this expert's
part), the cut (`width` given: the CPU's part of such an expert is its first `cut` intermediate
features, the copies holding `width` of them, the GPU's kernels computing the rest; whole experts
otherwise) and page-locked buffers at fixed addresses. One step, all on the compute stream (so all of
it is captured into the decode step's CUDA graph):

    router ─ x, ids, w, mask -> pinned (one kernel) ─ submit ─ GPU kernels (skip mask, cut) ─ wait ─ y += y_cpu (read in place)
                                                     └──── worker thread: the owned experts' part ────┘

`submit` and `wait` (csrc/exl2_cpu.cpp) come in two kinds, chosen once per process (`doorbell.signal_kind`):
- "memops" (the default where the driver takes them and a captured graph replays them): the stream
  writes the layer's doorbell value into page-locked memory (cuStreamWriteValue32; its memory barrier
  orders the inputs written before it), and after its kernels writes the same value into `arrive` and waits
  for the worker's `done` word (cuStreamWaitValue32, polled by the GPU), then clears it. A persistent
  worker thread polls the doorbell, and counts whether `arrive` came before it was done (the balance
  the manager moves the cut by).
- "hostfunc": host nodes (cuLaunchHostFunc) calling moedesk_cpu_submit / moedesk_cpu_wait: submit
  hands the context to the worker and returns at once, wait holds the stream until it is done. Each
  host node is a round trip through the driver's callback thread: at q125-a11's 24 GB budget on the
  H200, four per layer cost ~9 ms of a 33.6 ms step (docs/engine-notes.md).
Either way the GPU's kernels and the CPU's work overlap on one stream, whatever the driver does with
graph branches, and the worker runs plain C over the pointers in `HostCtx`: no CUDA call, no Python.
The mask itself travels with the step (copied from `skip`, a device tensor written in stream order),
so a change of ownership between steps reaches the GPU and the CPU at the same step.

Which experts a layer's CPU owns and the first cut: runtime/offload/placement.plan_cpu_split; the cut
moves between steps (`set_cut`, runtime/offload/cpu_share.CpuShare.rebalance). What the copies cost in
host RAM is reserved on the RAM ledger. Letters: E experts, H hidden, A experts per token.
"""
from __future__ import annotations

import ctypes
import math
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from runtime import cpu_load
from runtime.budget import MemoryBudget
from runtime.cpu import doorbell as cpu_signal
from runtime.cpu import experts as ce
from runtime.cpu.doorbell import _call_host, launch_host_func, signal_kind
from runtime.experts.decode import CUT_ALIGN
from runtime.experts.pack import PackedExperts, intermediate_aligned
from runtime.inference_mode import inference_mode_methods

MAX_ROWS = 1          # decode only: verify rows and prefill keep the GPU paths
WHOLE = 1 << 30       # the GPU kernels' cut for whole experts: past any expert's width


class HostCtx(ctypes.Structure):
    """Mirror of MoedeskCpuCtx in csrc/exl2_cpu.cpp (same order, same types)."""
    _fields_ = [("x", ctypes.c_void_p), ("ids", ctypes.c_void_p), ("weights", ctypes.c_void_p),
                ("owned", ctypes.c_void_p), ("store_index", ctypes.c_void_p), ("qw", ctypes.c_void_p),
                ("sc", ctypes.c_void_p), ("grp", ctypes.c_void_p), ("perm", ctypes.c_void_p),
                ("desc", ctypes.c_void_p), ("y", ctypes.c_void_p),
                ("H", ctypes.c_int64), ("E", ctypes.c_int64), ("store_experts", ctypes.c_int64),
                ("T", ctypes.c_int32), ("A", ctypes.c_int32), ("x_fp16", ctypes.c_int32),
                ("ids_int64", ctypes.c_int32), ("threads", ctypes.c_int32), ("status", ctypes.c_int32),
                ("cut", ctypes.c_int32), ("pad", ctypes.c_int32),
                ("ns_total", ctypes.c_uint64), ("calls", ctypes.c_uint64), ("pairs", ctypes.c_uint64),
                ("submitted", ctypes.c_uint64), ("done", ctypes.c_uint64), ("t_submit", ctypes.c_uint64),
                ("ns_wake", ctypes.c_uint64), ("ns_gpu", ctypes.c_uint64), ("ns_stall", ctypes.c_uint64),
                ("cpu_first", ctypes.c_uint64), ("gpu_first", ctypes.c_uint64), ("ns_cpu_idle", ctypes.c_uint64)]


HOST_STATUS = {1: "an owned expert is not in the CPU store", 2: "expert shapes do not chain with x"}


def host_entries():
    """(kernel module, address of moedesk_cpu_submit, of moedesk_cpu_wait); raises CpuExpertsError when
    the kernel cannot be built."""
    k = ce.load_kernel()
    if k.host_ctx_size() != ctypes.sizeof(HostCtx):
        raise ce.CpuExpertsError(f"the CPU kernel's context is {k.host_ctx_size()} bytes, its Python mirror "
                                 f"{ctypes.sizeof(HostCtx)}: csrc/exl2_cpu.cpp and cpu_path.HostCtx disagree")
    return k, int(k.submit_entry_address()), int(k.wait_entry_address())


RESERVED_CORES = 2


def resolve_threads(threads: int, others: Optional[float] = None) -> int:
    """0 = automatic: the physical cores (psutil) less RESERVED_CORES and less the CPUs other programs keep
    busy (`others`, cpu_load.choose_threads), at least 1; else `threads`.

    Two cores stay free during a decode step: the thread feeding the GPU spins in its
    synchronisation, and with host nodes ("hostfunc") the driver's callback thread spins in
    moedesk_cpu_wait. With the doorbell that second core is idle; a team of 15 measured 34.7 tok/s
    against 33.5 for 14 in one run (within its noise), so the count stays. More busy threads than cores stall
    the team at each of its barriers for a scheduler time slice: on the 16-core H200 machine a team
    of 16 beside those two computed at 0.55 GB/s instead of the 51 GB/s the same kernel reads alone."""
    if threads < 0:
        raise ValueError(f"cpu_threads {threads}: must be 0 (automatic) or more")
    if threads:
        return threads
    # A core another program keeps busy stalls the team the same way: it is left out too (measured now,
    # at load, over cpu_load.MIN_WINDOW_S).
    return cpu_load.choose_threads(max(1, cpu_load.physical_cores() - RESERVED_CORES), others)


# -- CPU-format copies from the packed layout ------------------------------------------------------

@dataclass(frozen=True)
class _Proj:
    """One projection as the CPU copy holds it: the whole expert, or its first `width` intermediate
    features (gate/up: their first columns; down: its first packed rows, the intermediate in down's
    order, pack.align_intermediate)."""
    pack: PackedExperts
    name: str
    K: int                  # input rows kept
    N: int                  # output columns kept
    group: int              # rows per scale row in the copy (down when cut: a divisor of the cut step)
    out: int                # logical outputs (desc)

    def codes(self, e: int) -> torch.Tensor:
        """Expert e's code words [K * bits / 32, N] (CPU), in pack.py's layout for K rows."""
        p = self.pack
        c = p.codes(e)
        if self.N < p.out_features:
            c = c[:, :self.N]
        if self.K < p.in_features:
            if p.bits == 3:       # two planes: low pairs (K/16 words), then high bits (K/32)
                c = torch.cat([c[:self.K // 16], c[p.in_features // 16:p.in_features // 16 + self.K // 32]])
            else:
                c = c[:self.K * p.bits // 32]
        return c.cpu().contiguous()

    def scales(self, ids: torch.Tensor) -> torch.Tensor:
        """fp16 [S, K / group, N] of experts `ids`."""
        p = self.pack
        s = p.scales[ids.to(p.scales.device)][:, : -(-self.K // p.group), :self.N].cpu()
        return torch.repeat_interleave(s, p.group // self.group, dim=1)[:, :self.K // self.group]


def _projections(packs: Sequence[PackedExperts], name: str, width: Optional[int] = None) -> list[_Proj]:
    """Gate, up, down as the CPU copies hold them (width: the first `width` intermediate features
    only, a multiple of CUT_ALIGN), checked against the CPU kernel's tiles."""
    align = CUT_ALIGN
    w1, w3, w2 = packs
    H, I = w1.in_features, w2.in_features
    if width is None:
        out = [_Proj(w1, f"{name}.gate", H, w1.out_features, w1.group, I),
               _Proj(w3, f"{name}.up", H, w3.out_features, w3.group, I),
               _Proj(w2, f"{name}.down", I, w2.out_features, w2.group, H)]
    else:
        if width <= 0 or width % align or width > I:
            raise ValueError(f"{name}: CPU copies of {width} intermediate rows; want a multiple of {align} "
                             f"in {align}..{I}")
        if not intermediate_aligned(w2):
            raise ValueError(f"{name}: experts cut between CPU and GPU need the intermediate in down's order "
                             "(pack.align_intermediate)")
        out = [_Proj(w1, f"{name}.gate", H, width, w1.group, width),
               _Proj(w3, f"{name}.up", H, width, w3.group, width),
               _Proj(w2, f"{name}.down", width, w2.out_features, math.gcd(w2.group, align), H)]
    for p in out:
        if p.group % 32 or p.N % 16:
            raise ce.CpuExpertsError(f"{p.name}: groups of {p.group} rows / {p.N} columns do not fit "
                                     "the CPU kernel (groups of whole 32 rows, columns in tiles of 16)")
    return out


def cpu_expert_bytes(packs: Sequence[PackedExperts], width: Optional[int] = None) -> int:
    """Bytes of one expert's CPU copy (codes, scales, groups, permutations): what a forward reads."""
    total = 0
    for p in _projections(packs, "expert", width):
        G = p.K // p.group
        total += p.K * p.pack.bits // 32 * p.N * 4 + G * p.N * 2 + G * 4 * 4 + p.K * 4
    return total


def cpu_copies_bytes(packs: Sequence[PackedExperts], n: int, width: Optional[int] = None) -> int:
    """What the CPU copies of `n` experts of a layer hold (`CpuPath.nbytes`, on the RAM ledger)."""
    return n * (cpu_expert_bytes(packs, width) + 3 * 8 * 8)                  # + desc rows


def cpu_store(packs: Sequence[PackedExperts], stored: Sequence[int], name: str = "layer",
              width: Optional[int] = None) -> ce.CpuExperts:
    """CPU copies of experts `stored` (store index j = stored[j]) of one layer, in the layout that
    CpuExperts' exl2 store flattens to (per expert, what its conversion of the EXL2 tensors builds), written straight
    into the store's flat buffers: one allocation per buffer, codes retiled by the C++ kernel in one
    call per projection (threads over experts and tiles), scales and permutations one copy each.
    width: copies of the first `width` intermediate features only (`_projections`).

    Per expert j the buffers hold gate, up, down one after the other; qw [S, Wq], sc [S, Ws], grp
    [S, Gt, 4], perm [S, Kt] are flattened, desc [S, 3, 8] holds the offsets."""
    # the retiling runs on every core, whatever the process started with, on a thread whose torch team
    # ends with it (cpu_load.on_cores: a team left grown slows the CPU path's own)
    return cpu_load.on_cores(cpu_load.physical_cores(), _cpu_store, packs, stored, name, width)


def _cpu_store(packs: Sequence[PackedExperts], stored: Sequence[int], name: str,
               width: Optional[int]) -> ce.CpuExperts:
    projs = _projections(packs, name, width)
    S, kernel = len(stored), ce.load_kernel()
    if S == 0:
        raise ce.CpuExpertsError(f"{name}: no experts to copy")
    Q = [p.K * p.pack.bits // 32 for p in projs]
    G = [p.K // p.group for p in projs]
    N = [p.N for p in projs]
    K = [p.K for p in projs]
    per = [sum(q * n for q, n in zip(Q, N)), sum(g * n for g, n in zip(G, N)), sum(G), sum(K)]
    qw = ce.spread(torch.empty((S, per[0]), dtype=torch.int32))            # over the NUMA nodes, if several
    sc = ce.spread(torch.empty((S, per[1]), dtype=torch.float16))
    grp = torch.empty((S, per[2], 4), dtype=torch.int32)
    perm = torch.empty((S, per[3]), dtype=torch.int32)
    desc = torch.empty((S, 3, 8), dtype=torch.int64)
    base = torch.arange(S, dtype=torch.int64)[:, None] * torch.tensor([per[0], per[1], per[2], 0, per[3], 0, 0, 0])
    experts = [int(e) for e in stored]
    ids = torch.tensor(experts, dtype=torch.int64)
    o = [0, 0, 0, 0]                                                            # qw, sc, grp, perm
    for j, (p, q, g, n, k) in enumerate(zip(projs, Q, G, N, K)):
        bits = p.pack.bits
        kernel.pack_tiles_into([p.codes(e) for e in experts], bits, k, qw[:, o[0]:o[0] + q * n])
        sc[:, o[1]:o[1] + g * n].view(S, n // 16, g, 16).copy_(                # [S, N/16, G, 16]
            p.scales(ids).view(S, g, n // 16, 16).permute(0, 2, 1, 3))
        grp[:, o[2]:o[2] + g] = torch.tensor([[bits, i * p.group * bits // 32, i * p.group, p.group]
                                              for i in range(g)], dtype=torch.int32)
        perm[:, o[3]:o[3] + k] = p.pack.perm[ids.to(p.pack.perm.device)][:, :k].cpu()
        desc[:, j] = base + torch.tensor([o[0], o[1], o[2], g, o[3], k, p.out, q])
        o = [o[0] + q * n, o[1] + g * n, o[2] + g, o[3] + k]
    flat = {"qw": qw.view(-1), "sc": sc.view(-1), "grp": grp.view(-1, 4), "perm": perm.view(-1), "desc": desc}
    return ce.CpuExperts.from_flat(packs[0].in_features, projs[2].K, flat, name)


# -- one layer ------------------------------------------------------------------------------------

@inference_mode_methods
class CpuPath:
    """The CPU side of one offloaded layer: stored experts, ownership, buffers, the host node's context."""

    def __init__(self, packs: Sequence[PackedExperts], stored: Sequence[int], top_k: int, threads: int,
                 name: str = "layer", ram: Optional[MemoryBudget] = None, device=None,
                 width: Optional[int] = None):
        """width: the copies hold each expert's first `width` intermediate features (a multiple of
        CUT_ALIGN): the CPU computes that part of every owned pick (up to `set_cut`) and the
        GPU the rest. None: whole experts, each owned pick computed by the CPU alone."""
        w1 = packs[0]
        self.E, self.H, self.top_k, self.name = w1.num_experts, w1.in_features, top_k, name
        self.stored = sorted(int(e) for e in stored)
        if not self.stored or len(set(self.stored)) != len(self.stored) or not all(
                0 <= e < self.E for e in self.stored):
            raise ValueError(f"{name}: CPU experts {list(stored)[:8]}...: need distinct ids in 0..{self.E - 1}")
        self.kernel, self.submit_fn, self.wait_fn = host_entries()
        self._base = (0, 0, 0)                 # the counters at `restart_counts` (the load's warm-up left out)
        self.ram, self.ram_key = ram, f"CPU copies of {name}'s experts"
        self.I = I = packs[2].in_features
        self.width = I if width is None else int(width)
        self.nbytes = cpu_copies_bytes(packs, len(self.stored), width)
        if ram is not None:                    # on the ledger before gigabytes are allocated
            ram.reserve(self.ram_key, self.nbytes, "lower the CPU expert share (placement 'stream'), "
                        "raise the RAM budget, or close other programs")
        try:                                   # a failure past the reservation gives it back
            self.store = cpu_store(packs, self.stored, name, width)
            self.device = torch.device(device) if device is not None else w1.scales.device
            pin = dict(pin_memory=self.device.type == "cuda")
            A, H, E = top_k, self.H, self.E
            self.x = torch.zeros((MAX_ROWS, H), dtype=torch.float16, **pin)      # pinned, fixed addresses
            self.ids = torch.zeros((MAX_ROWS, A), dtype=torch.int32, **pin)
            self.w = torch.zeros((MAX_ROWS, A), dtype=torch.float32, **pin)
            self.owned = torch.zeros(E, dtype=torch.uint8, **pin)
            self.y = torch.zeros((MAX_ROWS, H), dtype=torch.float32, **pin)
            self.store_index = torch.full((E,), -1, dtype=torch.int32)
            self.store_index[self.stored] = torch.arange(len(self.stored), dtype=torch.int32)
            self.skip = torch.zeros(E, dtype=torch.uint8, device=self.device)   # experts the CPU may compute
            # Balanced split (set_share): per step, the experts of `skip` the CPU computes for this token,
            # at most its share of the token's cold picks (device.cpu_share_mask); None: all of `skip`.
            self.share: Optional[int] = None
            self.step_mask = torch.zeros(E, dtype=torch.uint8, device=self.device)
            # The cut (set_cut): intermediate rows of an owned pick the CPU computes, the GPU the rest;
            # on the device for the GPU's kernels, in the context for the worker. Whole experts: a cut
            # past any width on the device, 0 (all) in the context.
            self.cut = self.width if width is not None else None
            self.cut_dev = torch.full((1,), self.cut or WHOLE, dtype=torch.int32, device=self.device)
            self.owned_set: set[int] = set()
            f = self.store._flat
            self.ctx = HostCtx(
                x=self.x.data_ptr(), ids=self.ids.data_ptr(), weights=self.w.data_ptr(),
                owned=self.owned.data_ptr(), store_index=self.store_index.data_ptr(), qw=f["qw"].data_ptr(),
                sc=f["sc"].data_ptr(), grp=f["grp"].data_ptr(), perm=f["perm"].data_ptr(),
                desc=f["desc"].data_ptr(), y=self.y.data_ptr(), H=H, E=E, store_experts=len(self.stored),
                T=MAX_ROWS, A=A, x_fp16=1, ids_int64=0, threads=resolve_threads(threads), cut=self.cut or 0)
            self.ctx_addr = ctypes.addressof(self.ctx)
            self.signal, _ = signal_kind(self.device)
            self.slot = self.kernel.register_slot(self.ctx_addr) if self.signal == "memops" else 0
        except BaseException:
            self.close()
            raise

    # -- ownership (between steps, in stream order) ------------------------------------------------

    def own(self, e: int, on: bool) -> None:
        """Let the CPU compute expert e (it must be stored) or give it back to the GPU. A device write on
        the current stream: steps queued before it keep the old split on both sides."""
        if on and int(self.store_index[e]) < 0:
            raise ValueError(f"{self.name}: expert {e} has no CPU copy")
        if on == (e in self.owned_set):
            return
        self.skip[e:e + 1].fill_(1 if on else 0)
        if on:
            self.owned_set.add(e)
        else:
            self.owned_set.discard(e)
        if self.device.type != "cuda":
            self.owned.copy_(self.skip)

    def set_share(self, share: Optional[float]) -> None:
        """Balanced split: the CPU takes at most `share` (0..1) of each token's cold picks, from the
        experts it owns; None: every owned pick (the static split)."""
        from runtime.cpu.device import SHARE_DEN
        if share is not None and not 0.0 <= share <= 1.0:
            raise ValueError(f"{self.name}: CPU share {share} outside 0..1")
        self.share = None if share is None else int(round(share * SHARE_DEN))

    def set_cut(self, rows: int) -> None:
        """Experts cut between CPU and GPU: the CPU computes the first `rows` intermediate features
        of each owned pick (a multiple of CUT_ALIGN, 1..width). The device value is written
        in stream order, the worker's at once: call it with no step queued (the stream synchronised)."""
        align = CUT_ALIGN
        if self.cut is None:
            raise ValueError(f"{self.name}: the CPU copies are whole experts; there is no cut to move")
        if rows <= 0 or rows > self.width or rows % align:
            raise ValueError(f"{self.name}: cut {rows}: want a multiple of {align} in {align}..{self.width}")
        self.cut = int(rows)
        self.cut_dev.fill_(self.cut)
        self.ctx.cut = self.cut

    def cpu_part(self) -> float:
        """The part of an owned pick's expert the CPU computes (1.0: whole experts)."""
        return 1.0 if self.cut is None else self.cut / self.I

    def pick_bytes(self) -> int:
        """Bytes the CPU reads for one owned pick at the current cut."""
        b = self.store.expert_bytes()
        return b if self.cut is None else b * self.cut // self.width

    def balance(self) -> tuple[int, int, int]:
        """(CPU first, GPU first, ns the worker waited for the GPU when it was first), counted by the
        worker over the steps so far (doorbell signalling only; zeros otherwise)."""
        c = self.ctx
        return int(c.cpu_first), int(c.gpu_first), int(c.ns_cpu_idle)

    def stores(self, e: int) -> bool:
        return 0 <= e < self.E and int(self.store_index[e]) >= 0

    # -- a decode step ------------------------------------------------------------------------------

    def launch(self, stream: "torch.cuda.Stream", x: torch.Tensor, ids: torch.Tensor,
               w: torch.Tensor, resident: Optional[torch.Tensor] = None,
               owned: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Hand the CPU part of this layer to the worker for x fp16 [1, H], ids int32 [1, A], w fp32
        [1, A] (device tensors written on `stream`, the current stream): the GPU kernels queued next run
        while the CPU computes; `join` collects the result. Returns the mask and the cut the GPU
        kernels take (layer.experts_forward); with a share set, `resident` (int32 [E], 1 = in a VRAM
        slot) says which picks are cold. owned: this step's mask instead of `skip` (uint8 [E] on the
        device: the decode prefetch's, without the experts it copied into VRAM for this layer)."""
        if x.shape != self.x.shape or ids.shape != self.ids.shape or w.shape != self.w.shape:
            raise ValueError(f"{self.name}: CPU path takes x {list(self.x.shape)}, ids {list(self.ids.shape)}, "
                             f"w {list(self.w.shape)}; got {list(x.shape)}, {list(ids.shape)}, {list(w.shape)}")
        mask = self.skip if owned is None else owned
        if self.share is not None:
            if resident is None:
                raise ValueError(f"{self.name}: a balanced split needs the layer's resident mask")
            from runtime.cpu.device import cpu_share_mask
            mask = cpu_share_mask(ids, mask, resident, self.share, self.step_mask)
        from runtime.cpu.device import cpu_inputs
        cpu_inputs(x, ids, w, mask, self.x, self.ids, self.w, self.owned)   # one launch into pinned memory
        if self.slot:
            cpu_signal.doorbell().ring(stream, self.slot)
        else:
            launch_host_func(stream, self.submit_fn, self.ctx_addr)
        return mask, self.cut_dev

    def join(self, stream: "torch.cuda.Stream", y: torch.Tensor) -> torch.Tensor:
        """y fp32 [1, H] (the GPU's part, on `stream`) += the CPU's part, once the worker is done."""
        if self.slot:
            cpu_signal.doorbell().wait(stream, self.slot)
        else:
            launch_host_func(stream, self.wait_fn, self.ctx_addr)
        from runtime.cpu.device import add_from_host
        return add_from_host(y, self.y)                       # read in place over PCIe, one launch

    def run_host(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """The host functions called directly on CPU tensors (tests, the throughput measurement):
        the same C entries (submit, then wait) the CUDA graph calls, through their addresses."""
        self.x.copy_(x)
        self.ids.copy_(ids)
        self.w.copy_(w)
        self.owned.copy_(self.skip.cpu())
        _call_host(self.submit_fn, self.ctx_addr)          # the worker thread, as in a decode step
        _call_host(self.wait_fn, self.ctx_addr)
        if self.ctx.status:
            raise ce.CpuExpertsError(f"{self.name}: {HOST_STATUS.get(self.ctx.status, self.ctx.status)}")
        return self.y.clone()

    # -- telemetry, release ---------------------------------------------------------------------------

    def counters(self) -> tuple[int, int, int, int]:
        """(nanoseconds, calls, pairs, status) since `restart_counts` (or the start): host memory, read
        without a synchronisation."""
        c, (ns, calls, pairs) = self.ctx, self._base
        return int(c.ns_total) - ns, int(c.calls) - calls, int(c.pairs) - pairs, int(c.status)

    def restart_counts(self) -> None:
        """Count from zero again, as the layer's hits and pairs do after the load's warm-up (the
        telemetry subtracts the CPU's pairs from the layer's misses: counted since different moments,
        the PCIe figure came out low, or below zero)."""
        c = self.ctx
        self._base = (int(c.ns_total), int(c.calls), int(c.pairs))

    def timeline(self) -> dict[str, int]:
        """Nanoseconds summed over the steps so far (host memory, read without a synchronisation):
        wake, from submit until the worker starts; gpu, from submit until wait is called (the GPU's
        own kernels for the layer, plus the host nodes' latency); stall, the stream held in wait for
        the CPU. gpu + stall against the worker's own time tells how well the two overlap. Host nodes
        only ("hostfunc"): with the doorbell no host code runs at submit or wait ({})."""
        c = self.ctx
        if self.slot:
            return {}
        return {"wake": int(c.ns_wake), "gpu": int(c.ns_gpu), "stall": int(c.ns_stall)}

    def close(self) -> None:
        if getattr(self, "slot", 0):
            self.kernel.release_slot(self.slot)
            self.slot = 0
        if self.ram is not None:
            self.ram.release(self.ram_key)
            self.ram = None


# -- measured throughput ---------------------------------------------------------------------------

PCIE_GUESS = 25e9              # bytes/s, planning without a GPU (tests): a PCIe 4.0 x16 link
_PCIE: dict[str, float] = {}


def pcie_bytes_per_s(src: torch.Tensor, dst: torch.Tensor, repeats: int = 5) -> float:
    """Pinned host-to-device copy rate (about the rate at which the kernels read cold experts in
    place), measured once per process and device by copying `src` (pinned) into `dst` (device
    scratch: nothing may be queued that reads it), at most 64 MB."""
    key = str(dst.device)
    if key not in _PCIE:
        n = min(src.numel() * src.element_size(), dst.numel() * dst.element_size(), 64 << 20)
        s, d = src.reshape(-1).view(torch.uint8)[:n], dst.reshape(-1).view(torch.uint8)[:n]
        d.copy_(s, non_blocking=True)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            d.copy_(s, non_blocking=True)
        end.record()
        end.synchronize()
        _PCIE[key] = repeats * n / (start.elapsed_time(end) / 1e3)
    return _PCIE[key]


_THROUGHPUT: dict[tuple, float] = {}


# An automatic team is the fewest threads whose measured rate is within this much of the best candidate's:
# past that, more threads buy no bytes (the memory is the limit) but wait at each call's barriers and take
# cores from the thread feeding the GPU and from other programs.
TEAM_SLACK = 0.05


def sized_team(packs: Sequence[PackedExperts], experts: Sequence[int], top_k: int, limit: int,
               measure=None) -> tuple[int, dict[int, float]]:
    """The CPU path's team sized from the bytes per second it reaches on this machine (cpu_bytes_per_s,
    or `measure` with its arguments), not from the core count: of `limit` threads (the cores left free,
    resolve_threads), and halving down to 1, the fewest within TEAM_SLACK of the best. -> (threads,
    {threads: bytes per second measured})."""
    measure = measure or cpu_bytes_per_s
    counts = sorted({max(1, limit >> i) for i in range(max(1, limit).bit_length())})
    rates = {t: measure(packs, experts, top_k, t) for t in counts}
    best = max(rates.values())
    return min(t for t, r in rates.items() if r >= (1 - TEAM_SLACK) * best), rates


MEASURE_CAP_S = 2.0            # the CPU rate's warm-up, and its timed calls, each stop after this long


def cpu_bytes_per_s(packs: Sequence[PackedExperts], experts: Sequence[int], top_k: int, threads: int,
                    max_bytes: int = 256 << 20, repeats: int = 2, cap_s: float = MEASURE_CAP_S) -> float:
    """Bytes per second the host function reads on this machine at one row, measured once per process
    (and shape, widths, threads) on copies of `experts` (enough of them, up to `max_bytes`, to walk
    memory rather than cache), `top_k` experts a call; the warm-up and the timed calls each stop
    after `cap_s` seconds (a slow or busy machine: fewer calls, the same rate). The kernel is built
    before (`ce.load_kernel`, its own load stage): its first build is no part of the rate's time."""
    w1, w3, w2 = packs
    key = (w1.in_features, w2.in_features, w1.bits, w3.bits, w2.bits, w1.group, top_k, resolve_threads(threads))
    if key in _THROUGHPUT:
        return _THROUGHPUT[key]
    per = cpu_expert_bytes(packs)
    n = max(1, min(len(experts), max_bytes // max(per, 1)))
    cp = CpuPath(packs, list(experts)[:n], min(top_k, n), threads, "throughput probe", device="cpu")
    for e in cp.stored:
        cp.own(e, True)
    A = cp.top_k
    x = torch.randn(1, cp.H).half()
    w = torch.full((1, A), 1.0 / A)
    calls = [torch.tensor([cp.stored[i:i + A]], dtype=torch.int32) for i in range(0, n - A + 1, A)] or [
        torch.tensor([cp.stored[:A]], dtype=torch.int32)]
    t0 = time.perf_counter()
    for ids in calls:                                   # warm-up: pages, thread team
        cp.run_host(x, ids, w)
        if time.perf_counter() - t0 > cap_s:
            break
    done, t0 = 0, time.perf_counter()
    for ids in [ids for _ in range(repeats) for ids in calls]:
        cp.run_host(x, ids, w)
        done += 1
        if time.perf_counter() - t0 > cap_s:
            break
    dt = time.perf_counter() - t0
    bps = done * A * cp.store.expert_bytes() / max(dt, 1e-9)
    _THROUGHPUT[key] = bps
    return bps
