"""bench.kernel_sass: the decode expert kernels compiled for an H200 on this machine (no GPU), their K loop found
in the machine code and its instructions counted per weight."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("triton")
kernel_sass = pytest.importorskip("bench.kernel_sass")


@pytest.fixture(autouse=True)
def _tools_or_skip(monkeypatch):
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    try:
        kernel_sass._tools()
    except RuntimeError as e:
        pytest.skip(str(e))


@pytest.mark.parametrize("bits", [3, 4])
def test_the_k_loop_of_both_gemvs_is_found_and_counted_per_weight(bits):
    gate_up, down = kernel_sass.run("qwen3-30b-a3b", bits, 128, bn=64, ksplit=1, warps=4, arch=90)
    assert (gate_up.kernel, gate_up.K, gate_up.N, down.kernel, down.K, down.N) == ("gate_up", 2048, 768, "down", 768, 2048)
    assert gate_up.weights_per_thread == 2 * 128 * 64 // 128 and down.weights_per_thread == 128 * 64 // 128
    for r in (gate_up, down):
        # every weight is unpacked, scaled and multiplied in the loop: several instructions each, not hundreds
        assert 3 < r.instructions_per_weight < 60, r
        assert r.loop_instructions == round(r.instructions_per_weight * r.weights_per_thread)
        assert sum(r.top.values()) <= r.loop_instructions and ("SHF" in r.top or "LOP3" in r.top)


def test_main_prints_and_writes_the_figures_and_refuses_what_does_not_fit(tmp_path, capsys):
    out = tmp_path / "sass.json"
    assert kernel_sass.main(["--shape", "qwen3-30b-a3b", "--bits", "4", "--ksplit", "1", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "gate_up" in text and "down" in text and "per weight" in text
    assert [r["kernel"] for r in json.loads(out.read_text())["results"]] == ["gate_up", "down"]
    assert kernel_sass.main(["--shape", "qwen3-30b-a3b", "--ksplit", "5"]) == 1
    assert "not a whole number of 5 slices" in capsys.readouterr().err
    assert kernel_sass.main(["--shape", "tiny-dbrx", "--ksplit", "1"]) == 1      # down: K 128, one pass
    assert "the compiler unrolled its 1 pass (K / (K tile x KSPLIT))" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        kernel_sass.main(["--shape", "qwen3-0.6b"])
    assert "unknown MoE shape" in capsys.readouterr().err


@pytest.mark.parametrize("bits,ksplit", [(4, 1), (4, 4), (3, 2)])
def test_the_two_launch_moe_kernels_compile_with_nothing_spilled(bits, ksplit):
    """runtime/experts/decode.py's two-launch kernels (the decode of layers all in VRAM) compiled for sm_90 at
    Qwen3-30B-A3B's expert shapes: what the interpreter does not check; nothing spilled to local memory and no
    larger a stack frame than the three-launch split-K kernels beside them."""
    from runtime.experts import decode
    gate_up = dict(K=2048, N=768, A=8, BITS1=bits, G1=128, BITS3=bits, G3=128, BK=128, BN=64, KSPLIT=ksplit)
    down = dict(K=768, N=2048, HS=768, NOUT=2048, A=8, BITS=bits, G=128, BK=128, BN=64, KSPLIT=ksplit, ORDERED=True)
    for fn, name, const in ((decode._gate_up_finish, "gate_up", gate_up), (decode._down_finish, "down", down)):
        usage = kernel_sass.resource_usage(kernel_sass.compile_jit(fn, kernel_sass._TYPES, const, 4, 90))
        old = getattr(decode, f"_{name}_splitk")
        was = kernel_sass.resource_usage(kernel_sass.compile_jit(old, kernel_sass._POINTERS[name],
                                                                 dict(const, SKIP=False), 4, 90))
        assert 0 < usage["registers"] <= 255 and usage["local"] == 0, (fn, usage)
        assert usage["stack"] <= was["stack"], (fn, usage, was)


@pytest.mark.parametrize("experts", [128, 256, 512])
def test_the_sort_compiles_for_the_expert_counts_of_real_models(experts):
    """grouped._align_count and _align_place (the prefill's sort into blocks) compiled for sm_90 at 128
    (Qwen3-30B-A3B), 256 (Qwen3.5-122B-A10B) and 512 experts: the shared memory each asks for fits a program's
    (227 KB on the H100) and nothing spills."""
    from runtime.experts import grouped
    ints = {"ids_ptr": "*i32", "hist_ptr": "*i32", "pairs_ptr": "*i32", "bexp_ptr": "*i32", "P": "i32", "R": "i32",
            "NB": "i32", "NP": "i32", "SPAN": "i32", "PSPAN": "i32", "BSPAN": "i32"}
    for fn, const in ((grouped._align_count, dict(BE=experts, CH=grouped.CHUNK)),
                      (grouped._align_place, dict(E=experts, BE=experts, BM=64, CH=grouped.CHUNK, BC=32, BB=64))):
        kernel = kernel_sass.compiled(fn, {n: t for n, t in ints.items() if n in fn.arg_names}, const, 8, 90)
        usage = kernel_sass.resource_usage(kernel.asm["cubin"])
        assert kernel.metadata.shared <= 227 * 1024 and usage["local"] == 0, (fn, kernel.metadata.shared, usage)


def test_the_one_launch_kernels_are_counted_beside_the_ones_they_stand_for(capsys):
    """`--finish` adds the two-launch experts' kernels, `--prologue` attention's one-launch prologue and
    `_linear_splitk` over q: their K loops found and counted per weight, in the same ranges as the GEMVs'."""
    assert kernel_sass.main(["--shape", "qwen3-30b-a3b", "--bits", "4", "--ksplit", "2", "--finish",
                             "--prologue"]) == 0
    lines = [line.split()[0] for line in capsys.readouterr().out.splitlines() if " per weight" in line]
    assert lines == ["gate_up", "down", "gate_up_finish", "down_finish", "qkv_prologue", "linear"], lines
    for r in kernel_sass.run("qwen3-30b-a3b", 3, 128, bn=64, ksplit=2, warps=4, arch=90, finish=True)[2:] + \
            kernel_sass.prologue_cost("qwen3-30b-a3b", 3, 128, ksplit=2, warps=4):
        assert 3 < r.instructions_per_weight < 60, r
