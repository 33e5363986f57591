"""Static cost of the decode expert kernels: the split-K GEMVs (`_gate_up_splitk`, `_down_splitk`) compiled for a
GPU on any machine, no GPU needed (Triton's own ptxas and cuobjdump), and their K loop's machine instructions
counted per weight.

    python -m bench.kernel_sass [--shape mixtral-8x22b] [--bits 3] [--group 128] [--arch 90]
        [--bn 64] [--ksplit 4] [--warps 4] [--finish] [--prologue] [--json OUT]

--finish adds the two-launch experts' kernels (runtime/experts/decode.py) at the same constants; --prologue
attention's one-launch prologue (runtime/experts/qkv_prologue.py, one row, heads of the shape's head size) and
`_linear_splitk` over q at the same tile.

Why: a GEMV that reads its weights far below the HBM's rate while the GPU is busy is bound by issuing
instructions, not by memory. Each of an SM's four schedulers issues at most one warp instruction per clock,
so a loop of L instructions over W weights per thread per pass costs L / W thread-instructions per weight, and
the kernel cannot beat SMs x 4 x 32 x clock / (L / W) weights per second, however fast the memory. The
Mixtral-8x22B decode step on the H200 (3 bits; bench/results/offload-mixtral-8x22b-130gb-*-profile.txt) spent
14.6 of its 18.2 ms of kernels in these two GEMVs, reading 12.7 GB of expert weights: 0.87 TB/s of a 4.3 TB/s
HBM. This tool shows the reason without a GPU, and tells a kernel change's effect on that bound before any
device time is spent on it.

Per kernel: the loop's instructions, the weights each thread handles per pass (BK x BN, gate and up both for
the first kernel, over the warps' threads), instructions per weight, barriers per pass (layout changes through
shared memory), and the loop's most frequent instructions. The K tile is what the engine uses: the scale
group, at most 128 rows. Launch shapes (BN, KSPLIT, warps) are timed on the GPU at load; give the ones to study.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from typing import Optional, Sequence

KERNELS = ("gate_up", "down", "gate_up_finish", "down_finish", "qkv_prologue", "linear")
_POINTERS = {
    "gate_up": {"x_ptr": "*fp16", "ids_ptr": "*i32", "skip_ptr": "*u8", "cut_ptr": "*i32", "q1": "*i32",
                "o1": "*i64", "s1": "*fp16", "p1": "*i32", "q3": "*i32", "o3": "*i64", "s3": "*fp16",
                "p3": "*i32", "gu_ptr": "*fp32", "P": "i32"},
    "down": {"gu_ptr": "*fp32", "ids_ptr": "*i32", "skip_ptr": "*u8", "cut_ptr": "*i32", "rw_ptr": "*fp32",
             "q2": "*i32", "o2": "*i64", "s2": "*fp16", "p2": "*i32", "out_ptr": "*fp32", "P": "i32"},
}
# the other kernels' runtime arguments that are not fp16 pointers (compile_jit)
_TYPES = {"ids_ptr": "*i32", "q1": "*i32", "q2": "*i32", "q3": "*i32", "p1": "*i32", "p2": "*i32", "p3": "*i32",
          "o1": "*i64", "o2": "*i64", "o3": "*i64", "ws_ptr": "*fp32", "cnt_ptr": "*i32", "rw_ptr": "*fp32",
          "P": "i32", "eps": "fp32", "qeps": "fp32", "keps": "fp32", "pos_ptr": "*i32", "T": "i32", "qns": "i32",
          "kns": "i32", "q_ptr": "*i32", "p_ptr": "*i32", "LDO": "i32", "COL0": "i32"}
# one SASS instruction line: /*0a90*/ [@P0 |@!P1 ] OPCODE[.MODIFIERS] operands ;
_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[0-9T]\s+)?([A-Z][A-Z0-9_]*)[^;]*;")
_BRANCH = re.compile(r"BRA\s+(?:`\(\.L_x_\d+\)|0x([0-9a-f]+))")


@dataclass
class LoopCost:
    kernel: str
    K: int
    N: int
    bits: int
    bk: int
    bn: int
    ksplit: int
    warps: int
    loop_instructions: int
    weights_per_thread: int
    instructions_per_weight: float
    barriers_per_pass: int
    top: dict


def _tools() -> str:
    """Triton's bundled cuobjdump (it disassembles), once it and ptxas (it compiles) are found; a clear error
    without them."""
    import triton
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    cuobjdump = os.path.join(bin_dir, "cuobjdump")
    if not os.path.exists(cuobjdump) or not os.path.exists(os.path.join(bin_dir, "ptxas")):
        raise RuntimeError(f"Triton's NVIDIA tools (ptxas, cuobjdump) are not in {bin_dir}: this Triton "
                           "cannot compile for an NVIDIA GPU here")
    return cuobjdump


def compile_kernel(kernel: str, K: int, N: int, bits: int, group: int, bk: int, bn: int, ksplit: int,
                   warps: int, arch: int) -> bytes:
    """The cubin of one split-K kernel for these constants (no skip mask; down reads gate/up in order). The
    two-launch experts' kernels (runtime/experts/decode.py) take the same constants; "linear" is
    `_linear_splitk` at one row, N columns, K cut, finishing in its launch."""
    from runtime.experts import decode
    if kernel in ("gate_up_finish", "down_finish", "linear"):
        from runtime.experts import linear_gemv
        const = {"gate_up_finish": dict(K=K, N=N, A=1, BITS1=bits, G1=group, BITS3=bits, G3=group, BK=bk, BN=bn,
                                        KSPLIT=ksplit),
                 "down_finish": dict(K=K, N=N, HS=K, NOUT=N, A=1, BITS=bits, G=group, BK=bk, BN=bn, KSPLIT=ksplit,
                                     ORDERED=True),
                 "linear": dict(K=K, N=N, NOUT=N, BITS=bits, G=group, BK=bk, BN=bn, BT=1, KSPLIT=ksplit, DOT=True,
                                ADD=False, FINISH=ksplit > 1)}[kernel]
        fn = {"gate_up_finish": decode._gate_up_finish, "down_finish": decode._down_finish,
              "linear": linear_gemv._linear_splitk}[kernel]
        return compile_jit(fn, _TYPES, const, warps, arch)
    if kernel == "gate_up":
        fn = decode._gate_up_splitk
        const = dict(K=K, N=N, A=1, BITS1=bits, G1=group, BITS3=bits, G3=group, BK=bk, BN=bn, KSPLIT=ksplit,
                     SKIP=False)
    elif kernel == "down":
        fn = decode._down_splitk
        const = dict(K=K, N=N, HS=K, NOUT=N, A=1, BITS=bits, G=group, BK=bk, BN=bn, KSPLIT=ksplit, SKIP=False,
                     ORDERED=True)
    else:
        raise ValueError(f"kernel: one of {', '.join(KERNELS)}, got {kernel!r}")
    return compile_jit(fn, _POINTERS[kernel], const, warps, arch)


def compiled(fn, types: dict, const: dict, warps: int, arch: int):
    """Any of the project's Triton kernels compiled (Triton's CompiledKernel: its cubin in .asm, the dynamic
    shared memory it asks for in .metadata.shared): `types` the Triton types of its runtime arguments (those
    not named: "*fp16"), `const` its constexprs."""
    _tools()                                   # ptxas, or the clear error before Triton's own
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    names = fn.arg_names
    sig = {n: "constexpr" if n in const else types.get(n, "*fp16") for n in names}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()})
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps})


def compile_jit(fn, types: dict, const: dict, warps: int, arch: int) -> bytes:
    """The cubin of any of the project's Triton kernels (`compiled`)."""
    return compiled(fn, types, const, warps, arch).asm["cubin"]


def resource_usage(cubin: bytes) -> dict[str, int]:
    """Registers, stack, shared and local (spilled) memory of the cubin's kernel, as cuobjdump reports them."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([_tools(), "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", out)
    if not found:
        raise RuntimeError(f"cuobjdump -res-usage: no resource line in {out!r}")
    return dict(zip(("registers", "stack", "shared", "local"), map(int, found.groups())))


def disassemble(cubin: bytes) -> list[tuple[int, str, str]]:
    """(address, opcode, line) of every instruction in the cubin."""
    cuobjdump = _tools()
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    return [(int(m.group(1), 16), m.group(2), m.group(0)) for m in _INSTRUCTION.finditer(out)]


def main_loop(code: list[tuple[int, str, str]], passes: int) -> list[tuple[int, str, str]]:
    """The longest backward branch's body: the K loop (the only loop of these kernels) of `passes` passes."""
    best: list = []
    for addr, op, line in code:
        m = _BRANCH.search(line) if op == "BRA" else None
        if m and m.group(1) is not None and int(m.group(1), 16) < addr:
            body = [c for c in code if int(m.group(1), 16) <= c[0] <= addr]
            if len(body) > len(best):
                best = body
    if not best:
        raise RuntimeError(f"no loop in the kernel's machine code: the compiler unrolled its "
                           f"{passes} pass{'es' if passes != 1 else ''} (K / (K tile x KSPLIT)); a shape with a longer "
                           "K or a larger KSPLIT keeps the loop")
    return best


def loop_cost(kernel: str, K: int, N: int, bits: int, group: int, bn: int, ksplit: int, warps: int,
              arch: int = 90) -> LoopCost:
    bk = min(128, group)
    if K % (bk * ksplit):
        raise ValueError(f"{kernel}: K {K} is not a whole number of {ksplit} slices of {bk}-row tiles")
    body = main_loop(disassemble(compile_kernel(kernel, K, N, bits, group, bk, bn, ksplit, warps, arch)),
                     K // (bk * ksplit))
    return _cost(kernel, K, N, bits, bk, bn, ksplit, warps, body)


def _cost(kernel: str, K: int, N: int, bits: int, bk: int, bn: int, ksplit: int, warps: int,
          body: list) -> LoopCost:
    ops = collections.Counter(op for _, op, _ in body)
    weights = (2 if kernel.startswith("gate_up") else 1) * bk * bn // (32 * warps)
    return LoopCost(kernel, K, N, bits, bk, bn, ksplit, warps, len(body), weights, len(body) / weights,
                    ops["BAR"], dict(ops.most_common(10)))


def prologue_cost(shape: str, bits: int, group: int, ksplit: int, warps: int, arch: int = 90) -> list[LoopCost]:
    """Attention's one-launch prologue (runtime/experts/qkv_prologue.py, one row, every part at `bits`) and
    `_linear_splitk` over q alone at the same tile (a head of columns): the K loop of each, per weight."""
    from runtime.exl2.shapes import SHAPES
    from runtime.experts.qkv_prologue import XB, _qkv_prologue
    s = SHAPES[shape]
    K, D, bk = s.hidden, s.head_dim, min(128, group)
    if K % (bk * ksplit):
        raise ValueError(f"qkv_prologue: K {K} is not a whole number of {ksplit} slices of {bk}-row tiles")
    nq, nkv = s.heads * D, s.kv_heads * D
    const = dict(K=K, HQ=s.heads, HK=s.kv_heads, D=D, N1=nq, BITS1=bits, G1=group, N2=nkv, BITS2=bits, G2=group,
                 N3=nkv, BITS3=bits, G3=group, BK=bk, BT=1, KSPLIT=ksplit, DOT=True, HEADNORM=True, ROPE=True, XB=XB)
    passes = K // (bk * ksplit)
    body = main_loop(disassemble(compile_jit(_qkv_prologue, _TYPES, const, warps, arch)), passes)
    linear = main_loop(disassemble(compile_kernel("linear", K, nq, bits, group, bk, D, ksplit, warps, arch)), passes)
    return [_cost("qkv_prologue", K, nq + 2 * nkv, bits, bk, D, ksplit, warps, body),
            _cost("linear", K, nq, bits, bk, D, ksplit, warps, linear)]


def run(shape: str, bits: int, group: int, bn: int, ksplit: int, warps: int, arch: int,
        finish: bool = False) -> list[LoopCost]:
    """The split-K GEMVs' K loops at the shape's expert widths; finish: the two-launch experts' kernels beside."""
    from runtime.exl2.shapes import SHAPES
    s = SHAPES[shape]
    if not s.is_moe:
        raise ValueError(f"shape {shape!r} is not an MoE shape")
    h, i = s.hidden, s.expert_intermediate
    out = [loop_cost("gate_up", h, i, bits, group, bn, ksplit, warps, arch),
           loop_cost("down", i, h, bits, group, bn, ksplit, warps, arch)]
    if finish:
        out += [loop_cost("gate_up_finish", h, i, bits, group, bn, ksplit, warps, arch),
                loop_cost("down_finish", i, h, bits, group, bn, ksplit, warps, arch)]
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    from runtime.exl2.shapes import SHAPES
    p = argparse.ArgumentParser(prog="python -m bench.kernel_sass", description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="mixtral-8x22b")
    p.add_argument("--bits", type=int, default=3, choices=(2, 3, 4, 8), help="stored bits per code")
    p.add_argument("--group", type=int, default=128, help="rows per scale group (the K tile: at most 128 of them)")
    p.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: H100/H200)")
    p.add_argument("--bn", type=int, default=64)
    p.add_argument("--ksplit", type=int, default=4)
    p.add_argument("--warps", type=int, default=4)
    p.add_argument("--finish", action="store_true",
                   help="also the two-launch experts' kernels (runtime/experts/decode.py)")
    p.add_argument("--prologue", action="store_true",
                   help="also attention's one-launch prologue and _linear_splitk over q")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if a.shape not in SHAPES or not SHAPES[a.shape].is_moe:
        p.error(f"unknown MoE shape {a.shape!r}; choose from {sorted(k for k, s in SHAPES.items() if s.is_moe)}")
    try:
        res = run(a.shape, a.bits, a.group, a.bn, a.ksplit, a.warps, a.arch, a.finish)
        if a.prologue:
            res += prologue_cost(a.shape, a.bits, a.group, a.ksplit, a.warps, a.arch)
    except (RuntimeError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"# {a.shape}, {a.bits}-bit codes, groups of {a.group}, sm_{a.arch}, BN {a.bn}, KSPLIT {a.ksplit}, "
          f"{a.warps} warps")
    for r in res:
        top = ", ".join(f"{k} {v}" for k, v in r.top.items())
        print(f"{r.kernel:14s} K {r.K:6d} N {r.N:6d}: {r.loop_instructions} instructions per pass over "
              f"{r.weights_per_thread} weights per thread = {r.instructions_per_weight:.2f} per weight; "
              f"{r.barriers_per_pass} barriers per pass; {top}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"shape": a.shape, "arch": a.arch, "results": [asdict(r) for r in res]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
