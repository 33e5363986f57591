"""Self-check of the fused expert kernels against the plain-PyTorch oracle, on random EXL2 experts.

    python -m bench.check_experts [--device cuda] [--experts 16] [--rows 1,2,4,5,8,9,40]

Runs on the GPU, or on the CPU under Triton's interpreter (TRITON_INTERPRET=1, slow: keep it small).
Prints one line per row count: relative error ‖kernel - oracle‖ / ‖oracle‖, and exits non-zero
when any exceeds the tolerance.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass

import torch

from runtime.exl2 import format as exl2
from runtime.experts.layer import ExpertLayer, experts_reference, route
from runtime.experts.pack import HostArena, pack_experts
from runtime.reference.qlinear import INT8_ACTIVATIONS_TOLERANCE

TOLERANCE = 2e-3     # fp16 operands (x, h, tile weights in the dot path) with fp32 accumulation
HOST_TOLERANCE = INT8_ACTIVATIONS_TOLERANCE  # the CPU path's host function: the integer kernel's int8 activations


@dataclass
class CheckResult:
    rows: int
    path: str
    rel_err: float


PERMS = ("each", "expert", "layer")


def with_exact_scales(t: dict, gen: torch.Generator) -> dict:
    """EXL2 tensors `t` with exact scales (q_scale_exact, as the GPTQ import writes for experts): each group and
    column's step times a random factor in 0.8..1.2, off EXL2's 16 steps per group."""
    _, n, groups = exl2.read_layout(t)
    first = torch.argsort(t["q_invperm"].long())[[g.first_row for g in groups]]     # an input row of each group
    scale = exl2.step_sizes(t)[:, first].t() * (0.8 + 0.4 * torch.rand(len(groups), n, generator=gen))
    return {**t, "q_scale_exact": scale.half()}


def random_layer(E: int, H: int, I: int, top_k: int, bits, device: str, seed: int = 0,
                 bits_prop=None, group_size=32, host_codes: bool = False, perms: str = "each",
                 exact: bool = False) -> ExpertLayer:
    """A random EXL2 expert layer: E experts, hidden H, intermediate I, `bits` per weight, the codes
    in VRAM (or in pinned host pages with `host_codes`). The one copy: the tests build their layers
    with it too (the runtime never imports bench/). perms: the input orders of gate and up: "each"
    its own, "expert" one per expert (as our converter writes them), "layer" one for all (as
    exllamav2's converter writes them). exact: every other expert with exact scales (`with_exact_scales`)."""
    if perms not in PERMS:
        raise ValueError(f"perms: one of {', '.join(PERMS)}, got {perms!r}")
    g = torch.Generator().manual_seed(seed)
    one = torch.randperm(H, generator=g) if perms == "layer" else None
    gate_perms: list = []

    def q(out, inp, s, perm=None):
        w = torch.randn(out, inp, generator=g) * (1.0 / inp ** 0.5)
        perm = torch.randperm(inp, generator=g) if perm is None else perm
        if out == I and len(gate_perms) < E:
            gate_perms.append(perm)
        t = exl2.quantize(w, bits, group_size, perm=perm, bits_prop=bits_prop, name=f"expert{s}")
        return with_exact_scales(t, g) if exact and s % 2 == 0 else t

    host = HostArena(1 << 20) if host_codes else None
    w1 = pack_experts([q(I, H, e, one) for e in range(E)], "gate", device, host)
    up = {"each": [None] * E, "expert": gate_perms, "layer": [one] * E}[perms]
    w3 = pack_experts([q(I, H, e, up[e]) for e in range(E)], "up", device, host)
    w2 = pack_experts([q(H, I, e) for e in range(E)], "down", device, host)
    gate = torch.randn(E, H, generator=g).to(device)
    return ExpertLayer(gate, w1, w3, w2, top_k)


def align_by_torch(ids: torch.Tensor, num_experts: int, bm: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The prefill's sort into blocks as the torch ops the one launch (grouped.align) replaced computed it: a
    scatter-add for the counts, a stable argsort, cumulative sums, a searchsorted for the blocks' experts. The
    oracle the kernel is held to, bit for bit."""
    from runtime.experts.grouped import align_blocks
    P, dev = ids.numel(), ids.device
    nblocks = align_blocks(P, num_experts, bm)
    ids = ids.long()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(0, ids, torch.ones_like(ids))
    nb = (counts + bm - 1) // bm
    cum_nb = torch.cumsum(nb, 0)
    order = torch.argsort(ids, stable=True)
    se = ids[order]
    rank = torch.arange(P, device=dev) - (torch.cumsum(counts, 0) - counts)[se]
    pairs = torch.full((nblocks * bm,), P, dtype=torch.int32, device=dev)
    pairs[(cum_nb - nb)[se] * bm + rank] = order.to(torch.int32)
    bexp = torch.searchsorted(cum_nb, torch.arange(nblocks, device=dev), right=True)
    return pairs, torch.where(bexp < num_experts, bexp, -1).to(torch.int32)


def check_routing(layer: ExpertLayer, rows: int, device: str, seed: int = 2) -> CheckResult:
    """Fused router + top-k against torch (softmax, topk, renormalise): same experts wherever the
    k-th and (k+1)-th probabilities are not within 1e-5 (a near tie may go either way), and the
    largest weight difference as the error."""
    from runtime.experts.routing import route_fused
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, layer.gate_w.shape[1], generator=g).half().to(device)
    counts = torch.zeros(layer.num_experts, dtype=torch.int32, device=device)
    ids, w = route_fused(x, layer.gate_w, layer.top_k, counts)
    r = route(x, layer.gate_w, layer.top_k)
    probs = torch.softmax(x.float() @ layer.gate_w.float().T, -1).sort(-1, descending=True).values
    probs = torch.nn.functional.pad(probs, (0, 1))          # top_k may equal the expert count
    clear = (probs[:, layer.top_k - 1] - probs[:, layer.top_k]) > 1e-5
    same = (ids.long().sort(-1).values == r.ids.sort(-1).values).all(-1)
    if not bool(same[clear].all()) or int(counts.sum()) != rows * layer.top_k:
        return CheckResult(rows, "routing", float("inf"))
    return CheckResult(rows, "routing", (w[clear] - r.weights[clear]).abs().max().item() if clear.any() else 0.0)


def kernel_paths(rows: int, top_k: int) -> list[tuple[bool, str]]:
    """(union_reads, name) of every kernel path `experts_forward` takes for this many rows: few rows
    run the split-K GEMVs and, as verify rows of offloaded layers do, the grouped kernels."""
    from runtime.experts.decode import GEMV_MAX_PAIRS
    if rows * top_k > GEMV_MAX_PAIRS:
        return [(False, "grouped")]
    return [(False, "splitk")] + ([(True, "grouped(union)")] if rows > 1 else [])


def check(layer: ExpertLayer, rows: list[int], device: str, seed: int = 1,
          residual: bool = False) -> list[CheckResult]:
    """Each row count through every kernel path, the grouped kernels reading the input as the layer's
    permutations allow (grouped.input_order), in the launch shapes MOEDESK_GROUPED and MOEDESK_SPLITK ask for
    (runtime/tuning.py; default the timed ones). residual:
    the split-K path also with a residual to add into (`decode.experts_finish`: the down kernel's last slice
    adds it, as layers all in VRAM decode), checked as (out - residual) against the oracle."""
    from runtime.experts.decode import experts_finish
    from runtime.experts.grouped import input_order
    from runtime.experts.layer import experts_forward
    from runtime.tuning import Tuning
    t = Tuning.from_environment()
    grouped, splitk = t.grouped, t.splitk
    order = input_order(layer.w1, layer.w3, layer.w2)
    g = torch.Generator().manual_seed(seed)
    H = layer.gate_w.shape[1]
    out = [check_routing(layer, max(rows), device)]
    for T in rows:
        x = torch.randn(T, H, generator=g).half().to(device)
        r = route(x, layer.gate_w, layer.top_k)
        ref = experts_reference(x, r, layer.w1, layer.w3, layer.w2)
        for union, path in kernel_paths(T, layer.top_k):
            y = experts_forward(x, r.ids, r.weights, layer.w1, layer.w3, layer.w2, union_reads=union, order=order,
                                grouped=grouped, splitk=splitk)
            out.append(CheckResult(T, path, ((y - ref).norm() / ref.norm()).item()))
            if residual and path == "splitk":
                res = (torch.randn(T, H, generator=g) * 0.1).half().to(device)
                z = experts_finish(x, r.ids, r.weights, layer.w1, layer.w3, layer.w2, res, order.ordered_down, splitk)
                assert z.dtype == torch.float16 and z.shape == res.shape, (z.dtype, z.shape)
                out.append(CheckResult(T, "splitk+res", ((z.float() - res.float() - ref).norm() / ref.norm()).item()))
            if order.ordered_down or path.startswith("grouped") and (order.shared is not None or order.per_expert):
                # the same sums as the per-tile gathers (the split-K GEMVs: down reading gate/up's output in runs)
                y0 = experts_forward(x, r.ids, r.weights, layer.w1, layer.w3, layer.w2, union_reads=union,
                                     grouped=grouped, splitk=splitk)
                out.append(CheckResult(T, path + " vs gathered", ((y - y0).norm() / y0.norm()).item()))
    return out


def check_offload(E: int, H: int, I: int, top_k: int, bits, rows: list[int], device: str,
                  bits_prop=None, group_size: int = 32) -> list[CheckResult]:
    """The kernels with about half the experts cold (host memory, read in place or staged for many
    rows) against the same layer all resident: `rel_err` is the largest difference
    relative to the largest output."""
    from runtime.budget import MemoryBudget
    from runtime.experts.layer import experts_forward
    from runtime.offload.manager import OffloadManager
    import dataclasses
    ref = random_layer(E, H, I, top_k, bits, device, bits_prop=bits_prop, group_size=group_size)
    host = HostArena(1 << 20)

    def to_host(p):
        codes = host.empty(tuple(p.qweight.shape))
        codes.copy_(p.qweight)
        return dataclasses.replace(p, qweight=codes, cold=codes, woff=None)
    off = ExpertLayer(ref.gate_w, to_host(ref.w1), to_host(ref.w3), to_host(ref.w2), top_k)
    mgr = OffloadManager([off], MemoryBudget(1 << 50))
    lo = mgr.layers[0]
    mgr.apply([list(range(0, E, 2))])
    if not 0 < len(lo.expert_slot) < E:
        return [CheckResult(0, f"placement: {len(lo.expert_slot)} of {E} resident", float("inf"))]
    g = torch.Generator().manual_seed(5)
    out = []
    for stage in (False, True):
        mgr.staging.min_pairs = 1 if stage else 1 << 30
        for T in rows:
            x = torch.randn(T, H, generator=g).half().to(device)
            r = route(x, ref.gate_w, top_k)
            for union, name in kernel_paths(T, top_k):
                want = experts_forward(x, r.ids, r.weights, ref.w1, ref.w3, ref.w2, union_reads=union)
                got = experts_forward(x, r.ids, r.weights, *mgr.hooks.before(lo, T, r.ids), union_reads=union)
                mgr.hooks.after(lo)
                path = name + ("+staged" if stage else "+in place")
                out.append(CheckResult(T, path, ((got - want).abs().max() / want.abs().max()).item()))
    return out


def check_skip(E: int, H: int, I: int, top_k: int, bits, rows: list[int], device: str,
               bits_prop=None, group_size: int = 32, seed: int = 3) -> list[CheckResult]:
    """The split-K kernels with a skip mask (the CPU path's experts left out, whole or up to a cut)
    plus those parts computed apart (by the CPU path's host function when its kernel builds, else,
    for whole experts, the oracle) against the kernels without a mask. The layer is first put in
    down's intermediate order (pack.align_intermediate), checked against the layer before.
    `rel_err`: largest difference relative to the largest output."""
    from runtime.experts.decode import CUT_ALIGN, GEMV_MAX_PAIRS
    from runtime.experts.grouped import input_order
    from runtime.experts.layer import experts_forward
    from runtime.experts.pack import align_intermediate
    from runtime.tuning import Tuning
    align, splitk = CUT_ALIGN, Tuning.from_environment().splitk
    rows = [T for T in rows if T * top_k <= GEMV_MAX_PAIRS]        # the mask is for the split-K GEMVs
    layer = random_layer(E, H, I, top_k, bits, device, bits_prop=bits_prop, group_size=group_size)
    g = torch.Generator().manual_seed(seed)
    out = []
    x = torch.randn(max(rows), H, generator=g).half().to(device)
    r = route(x, layer.gate_w, top_k)
    before = experts_forward(x, r.ids, r.weights, layer.w1, layer.w3, layer.w2)
    align_intermediate(layer.w1, layer.w3, layer.w2)
    order = input_order(layer.w1, layer.w3, layer.w2)             # down in order: read in runs below
    after = experts_forward(x, r.ids, r.weights, layer.w1, layer.w3, layer.w2)
    out.append(CheckResult(max(rows), "aligned intermediate", ((after - before).abs().max() / before.abs().max()).item()))
    cuts = [None] + list(range(align, I, align))               # None: whole experts
    for cut in cuts:
        cpu = None
        try:
            from runtime.cpu.path import WHOLE, CpuPath
            cpu = CpuPath((layer.w1, layer.w3, layer.w2), list(range(E)), top_k, threads=1, device="cpu",
                          width=cut) if device == "cpu" else None
        except ValueError:
            cpu = None
        cut_t = torch.tensor([cut or WHOLE], dtype=torch.int32, device=device)
        for T in rows:
            if cut is not None and (cpu is None or T != 1):
                continue                                             # a cut's part: the host function only
            for masked in ([], list(range(0, E, 2)), list(range(E))):
                skip = torch.zeros(E, dtype=torch.uint8)
                skip[masked] = 1
                x = torch.randn(T, H, generator=g).half().to(device)
                r = route(x, layer.gate_w, top_k)
                want = experts_forward(x, r.ids, r.weights, layer.w1, layer.w3, layer.w2)
                got = experts_forward(x, r.ids, r.weights, layer.w1, layer.w3, layer.w2, skip=skip.to(device),
                                      cut=cut_t, order=order, splitk=splitk)
                keep = skip.to(device)[r.ids].float()
                if cpu is not None and T == 1:
                    for e in range(E):
                        cpu.own(e, e in masked)
                    apart, how = cpu.run_host(x, r.ids.to(torch.int32), r.weights), "cpu host"
                else:
                    apart, how = experts_reference(x, dataclasses.replace(r, weights=r.weights * keep),
                                                   layer.w1, layer.w3, layer.w2), "oracle"
                err = ((got + apart.to(got.device) - want).abs().max() / want.abs().max()).item()
                what = "whole" if cut is None else f"cut {cut}/{I}"
                out.append(CheckResult(T, f"skip {len(masked)}/{E} {what}+{how}", err))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--inter", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--bits", default="4")
    ap.add_argument("--rows", default="1,2,4,5,8,9,40")
    ap.add_argument("--group", type=int, default=32, help="rows per scale group")
    ap.add_argument("--offload", action="store_true",
                    help="compare half the experts cold (host memory) with all resident, exactly")
    ap.add_argument("--perms", choices=PERMS, default="each",
                    help="input orders of gate and up: each its own, one per expert, or one per layer")
    ap.add_argument("--aligned", action="store_true",
                    help="the intermediate in down's order first (pack.align_intermediate: down reads h in runs)")
    ap.add_argument("--skip", action="store_true",
                    help="split-K kernels with a skip mask + the skipped experts computed apart vs no mask")
    ap.add_argument("--residual", action="store_true",
                    help="the split-K path also adding into a residual (decode.experts_finish: in the down kernel)")
    ap.add_argument("--exact", action="store_true",
                    help="every other expert with exact scales (q_scale_exact, as imported GPTQ experts have them)")
    a = ap.parse_args(argv)
    bits = [int(b) for b in a.bits.split(",")]
    props = None if len(bits) == 1 else [1 / len(bits)] * len(bits)
    if a.skip:
        bad = 0
        for r in check_skip(a.experts, a.hidden, a.inter, a.top_k, bits if props else bits[0],
                            [int(x) for x in a.rows.split(",")], a.device, props, a.group):
            ok = r.rel_err < (HOST_TOLERANCE if r.path.endswith("cpu host") else TOLERANCE)
            bad += not ok
            print(f"rows {r.rows:4d}  {r.path:22s}  max diff {r.rel_err:.2e}  {'ok' if ok else 'FAIL'}")
        return 1 if bad else 0
    if a.offload:
        # On the CPU (the interpreter) both runs add in the same order: equal bit for bit. On the GPU
        # the split-K atomics add in any order: equal to fp32 rounding of the sums.
        tol = 0.0 if a.device == "cpu" else 1e-5
        bad = 0
        for r in check_offload(a.experts, a.hidden, a.inter, a.top_k, bits if props else bits[0],
                               [int(x) for x in a.rows.split(",")], a.device, props, a.group):
            ok = r.rel_err <= tol
            bad += not ok
            print(f"rows {r.rows:4d}  {r.path:18s}  max diff {r.rel_err:.2e}  {'ok' if ok else 'FAIL'}")
        return 1 if bad else 0
    layer = random_layer(a.experts, a.hidden, a.inter, a.top_k, bits if props else bits[0], a.device,
                         bits_prop=props, group_size=a.group, perms=a.perms, exact=a.exact)
    if a.aligned:
        from runtime.experts.pack import align_intermediate
        align_intermediate(layer.w1, layer.w3, layer.w2)
    from runtime.experts.grouped import input_order
    o = input_order(layer.w1, layer.w3, layer.w2)
    print("input order:", "one per layer" if o.shared is not None else "one per expert" if o.per_expert else "each its own",
          "| down reads h", "in runs" if o.ordered_down else "through its permutation")
    bad = 0
    for r in check(layer, [int(x) for x in a.rows.split(",")], a.device, residual=a.residual):
        ok = r.rel_err < TOLERANCE
        bad += not ok
        print(f"rows {r.rows:4d}  {r.path:8s}  rel err {r.rel_err:.2e}  {'ok' if ok else 'FAIL'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
