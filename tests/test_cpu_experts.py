"""CPU expert store: every format against the dequantized EXL2 reference, T = 1..8 rows."""
from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch

from runtime.cpu import experts as ce
from runtime.exl2 import format as fmt
from runtime.reference.qlinear import INT8_ACTIVATIONS_TOLERANCE

H, I, E, A = 256, 128, 6, 3
# Relative max error vs the float64 forward of the fp16-dequantized weights (max |y - ref| / max |ref|):
# bf16 and int8 round weights and activations (bf16: 8 bits of mantissa, int8: one scale per row);
# int4 keeps 2/3/4-bit codes but rounds scales and activations to bf16; exl2 reads the codes exactly and
# multiplies them with int8 activations (one scale per group of each row's inputs, csrc/qdot.cpp): its
# error is the activations' rounding, as the int8 format's (test_exl2_kernel_is_exact_on_integer_activations:
# none besides).
TOL = {"bf16": 2e-2, "int8": INT8_ACTIVATIONS_TOLERANCE, "int4": 2e-2, "exl2": INT8_ACTIVATIONS_TOLERANCE}
ISAS = ("scalar", "avx2", "avx512_vnni")          # the kernel's vector paths, lowest first


def _expert(gen: torch.Generator, bits) -> dict:
    def lin(o, i):
        w = torch.randn(o, i, generator=gen) * 0.05
        return fmt.quantize(w, bits, 64, perm=torch.randperm(i, generator=gen))
    return {"gate": lin(I, H), "up": lin(I, H), "down": lin(H, I)}


def _dense(experts, exact: bool = False):
    out = []
    for e in experts:
        mats = []
        for p, o in (("gate", I), ("up", I), ("down", H)):
            w = fmt.dequantize(e[p], torch.float64, out_features=o)
            if exact:                                   # code * scale without the fp16 rounding
                step = fmt.step_sizes(e[p])[:o].double()
                w = torch.round(w / step) * step
            mats.append(w)
        out.append(tuple(mats))
    return out


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Small matrices: on a shared CI box, a thread team costs more than it gains (barrier waits)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def layer():
    gen = torch.Generator().manual_seed(7)
    experts = [_expert(gen, 3) for _ in range(E)]
    return experts, _dense(experts), _dense(experts, exact=True)


def _kernel_or_skip():
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler on this machine: the exl2 CPU kernel cannot be built")
    ce.load_kernel()                                    # a failing build fails the test


def _routing(gen, T):
    x = torch.randn(T, H, generator=gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:A] for _ in range(T)])
    w = torch.softmax(torch.randn(T, A, generator=gen), dim=1)
    return x, ids, w


def _rel(y, ref):
    return float((y.double() - ref).abs().max() / ref.abs().max())


@pytest.mark.parametrize("format", ce.FORMATS)
def test_format_matches_reference(layer, format):
    if format == "exl2":
        _kernel_or_skip()
    experts, dense, _ = layer
    store = ce.CpuExperts.from_exl2(experts, format)
    gen = torch.Generator().manual_seed(1)
    for T in range(1, 9):
        x, ids, w = _routing(gen, T)
        y = store.forward(x, ids, w)
        assert y.dtype == torch.float32 and y.shape == (T, H)
        assert _rel(y, ce.reference_forward(dense, x, ids, w)) < TOL[format], (format, T)


def _isas():
    """The vector paths this CPU runs (the lower ones forced through set_isa)."""
    return ISAS[:ISAS.index(ce.load_kernel().isa_supported()) + 1]


@pytest.fixture
def isa_restored():
    yield
    ce.load_kernel().set_isa("auto")


def _on_grid(perm: torch.Tensor, groups, rows: int, gen) -> torch.Tensor:
    """x [rows, K] that int8 rounding keeps: per group of packed rows, integers in -127..127 (one of them
    127) times a power of two; packed row k is input feature perm[k]."""
    x = torch.empty(rows, perm.shape[0])
    for g in groups:
        q = torch.randint(-127, 128, (rows, g.rows), generator=gen).float()
        q[:, 0] = 127.0
        scale = 2.0 ** int(torch.randint(-9, -2, (1,), generator=gen))
        x[:, perm[g.first_row:g.first_row + g.rows].long()] = q * scale
    return x


def _exact(t, out: int) -> torch.Tensor:
    """code * scale in float64, without the fp16 rounding of their product."""
    step = fmt.step_sizes(t)[:out].double()
    return torch.round(fmt.dequantize(t, torch.float64, out_features=out) / step) * step


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8, [8, 6], [6, 5], [4, 3, 2]])
def test_exl2_kernel_is_exact_on_integer_activations(bits, isa_restored):
    """Inputs that int8 rounding keeps: every width, on every vector path this CPU runs, equals the float64
    product of the codes and scales (up to float32 sums); two projections of one input side by side."""
    _kernel_or_skip()
    k = ce.load_kernel()
    gen = torch.Generator().manual_seed(5)
    K, outs = 256, (48, 32)
    perm = torch.randperm(K, generator=gen)                  # one input order: one grid for both
    tensors = [fmt.quantize(torch.randn(o, K, generator=gen) * 0.05, bits, 64, perm=perm) for o in outs]
    parts = [ce._to_exl2(t, o, f"p{i}") for i, (t, o) in enumerate(zip(tensors, outs))]
    flat, desc = ce.flatten(parts)
    x = _on_grid(parts[0]["perm"], fmt.read_layout(tensors[0])[2], 5, gen)
    ref = x.double() @ torch.cat([_exact(t, o) for t, o in zip(tensors, outs)]).T
    for isa in _isas():
        assert k.set_isa(isa) and k.isa() == isa
        y = k.linear_forward(x, flat["qw"], flat["sc"], flat["grp"], flat["perm"], desc)
        assert y.shape == (5, sum(outs)) and _rel(y, ref) < 2e-6, isa


def test_exact_scales_are_what_the_store_computes_with(tmp_path):
    """Experts with exact scales (q_scale_exact, as the GPTQ import writes them): the exl2 store's codes times those
    scales, not the steps of q_scale / q_scale_max; read from a model folder with them too."""
    from bench.check_experts import with_exact_scales
    gen = torch.Generator().manual_seed(11)
    experts = [{p: with_exact_scales(t, gen) for p, t in _expert(gen, 4).items()} for _ in range(E)]
    steps = [{p: {k: v for k, v in t.items() if k != "q_scale_exact"} for p, t in e.items()} for e in experts]
    assert _dense(experts)[0][0].shape == (I, H) and not torch.equal(_dense(experts)[0][0], _dense(steps)[0][0])
    x, ids, w = _routing(torch.Generator().manual_seed(3), 4)
    store = ce.CpuExperts.from_exl2(experts, "bf16")
    assert _rel(store.forward(x, ids, w), ce.reference_forward(_dense(experts), x, ids, w)) < TOL["bf16"]
    _kernel_or_skip()
    store = ce.CpuExperts.from_exl2(experts, "exl2")
    assert _rel(store.forward(x, ids, w), ce.reference_forward(_dense(experts), x, ids, w)) < TOL["exl2"]
    for e, p in ((e, p) for e in range(E) for p in ce.PROJS):
        exact = experts[e][p]["q_scale_exact"]
        assert torch.equal(packed_scales(store._flat["sc"], store._flat["desc"][e, ce.PROJS.index(p)], exact.shape[1]),
                           exact), (e, p)


def packed_scales(sc: torch.Tensor, desc: torch.Tensor, n: int) -> torch.Tensor:
    """The scales of one projection in the kernel's flat stream `sc` ([N/16, G, 16] from desc[1], G = desc[3]),
    as [G, n] (n: its columns as stored, padded)."""
    g, o = int(desc[3]), int(desc[1])
    return sc[o:o + g * n].view(n // 16, g, 16).permute(1, 0, 2).reshape(g, n)


@pytest.mark.parametrize("bits", [[8, 6], [6, 5], [5, 4], [4, 3, 2], 2, 3])
def test_exl2_kernel_every_width_on_every_path(bits, isa_restored):
    _kernel_or_skip()
    gen = torch.Generator().manual_seed(3)
    experts = [_expert(gen, bits) for _ in range(2)]
    store = ce.CpuExperts.from_exl2(experts, "exl2")
    x = torch.randn(4, H, generator=gen)
    ids = torch.tensor([[0, 1], [1, 0], [1, 1], [0, 0]])     # shared and repeated experts
    w = torch.rand(4, 2, generator=gen)
    ref = ce.reference_forward(_dense(experts, exact=True), x, ids, w)
    got = {}
    for isa in _isas():
        ce.load_kernel().set_isa(isa)
        got[isa] = store.forward(x, ids, w)
        assert _rel(got[isa], ref) < TOL["exl2"], isa
    for isa, y in got.items():                  # the same integer sums: the paths differ by float32 rounding
        assert _rel(y, got["scalar"].double()) < 1e-5, isa


def test_a_path_is_forced_by_the_environment_and_a_missing_one_refused():
    """MOEDESK_CPU_KERNEL_ISA in a fresh process (the AVX2 path on a machine with VNNI); a path this CPU
    cannot run is an error that says what it runs; a bad name is refused."""
    import os
    import subprocess
    import sys
    _kernel_or_skip()
    code = ("from runtime.cpu import experts as ce\n"
            "why = ce.kernel_unavailable_reason()\n"
            "print(ce.load_kernel().isa() if why is None else why)")
    for isa in _isas():
        env = dict(os.environ, MOEDESK_CPU_KERNEL_ISA=isa)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0 and out.stdout.strip() == isa, out.stderr[-2000:]
    missing = [i for i in ISAS if i not in _isas()]
    if missing:
        env = dict(os.environ, MOEDESK_CPU_KERNEL_ISA=missing[0])
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
        assert f"MOEDESK_CPU_KERNEL_ISA={missing[0]}: this CPU runs" in out.stdout
    assert ce.load_kernel().set_isa("auto") and ce.load_kernel().isa() == _isas()[-1]
    with pytest.raises(RuntimeError, match="isa: auto, avx512_vnni, avx2 or scalar"):
        ce.load_kernel().set_isa("avx9")


def test_bytes_per_weight(layer):
    experts, _, _ = layer
    bpw = {f: ce.CpuExperts.from_exl2(experts[:1], f).bits_per_weight() for f in ("bf16", "int8", "int4")}
    assert bpw["bf16"] == 16 and 8 < bpw["int8"] < 8.2 and 4 < bpw["int4"] < 5
    if ce.kernel_unavailable_reason() is None:
        assert 3 < ce.CpuExperts.from_exl2(experts[:1], "exl2").bits_per_weight() < 3.5


def test_bad_inputs(layer):
    experts, _, _ = layer
    store = ce.CpuExperts.from_exl2(experts, "bf16")
    x = torch.randn(2, H)
    with pytest.raises(ce.CpuExpertsError, match="store indices"):
        store.forward(x, torch.tensor([[0], [E]]), torch.ones(2, 1))
    with pytest.raises(ce.CpuExpertsError, match="T in 1..8"):
        store.forward(torch.randn(9, H), torch.zeros(9, 1, dtype=torch.long), torch.ones(9, 1))
    with pytest.raises(ce.CpuExpertsError, match=r"\[T, 256\]"):
        store.forward(torch.randn(2, H + 1), torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1))
    with pytest.raises(ce.CpuExpertsError, match="unknown CPU expert format"):
        ce.CpuExperts.from_exl2(experts, "fp8")
    with pytest.raises(ce.CpuExpertsError, match="missing projections"):
        ce.CpuExperts.from_exl2([{"gate": experts[0]["gate"]}], "bf16")


def test_runner_overlaps_on_its_own_thread(layer):
    experts, _, _ = layer
    fmt_ = "exl2" if ce.kernel_unavailable_reason() is None else "int8"
    store = ce.CpuExperts.from_exl2(experts, fmt_)
    x, ids, w = _routing(torch.Generator().manual_seed(4), 2)
    runner = ce.CpuExpertRunner(threads=1)
    try:
        fut = runner.submit(store, x, ids, w)
        assert torch.equal(fut.result(timeout=60), store.forward(x, ids, w))
    finally:
        runner.close()


def test_bench_runs_on_a_tiny_shape(tmp_path):
    from bench import cpu_experts as bench_cpu
    formats = ce.FORMATS if ce.kernel_unavailable_reason() is None else ("bf16", "int8", "int4")
    rows = bench_cpu.run_bench(["tiny-moe"], formats, rows=(1, 2), pool_mb=1, calls=2, threads=1)
    assert [(r.format, r.rows) for r in rows] == [(f, t) for f in formats for t in (1, 2)]
    for r in rows:
        assert r.gb_per_s > 0 and r.ms_per_call > 0 and r.ms_per_token_layer == pytest.approx(r.ms_per_call / r.rows)
        assert r.pcie_gb_per_s is None and "PCIe" not in bench_cpu.format_row(r)
    beside = dataclasses.replace(rows[0], pcie_gb_per_s=52.8)
    assert bench_cpu.format_row(beside).endswith("PCIe copies beside it  52.8 GB/s")
    assert bench_cpu.main(["--shapes", "tiny-moe", "--formats", "int8", "--rows", "1", "--calls", "1",
                           "--pool-mb", "1", "--threads", "1", "--json", str(tmp_path / "b.json")]) == 0
    assert '"format": "int8"' in (tmp_path / "b.json").read_text()


def test_bench_measures_read_bandwidth_per_team_and_the_kernels_share_of_it(tmp_path):
    """Several widths and team sizes in one run; per row the read bandwidth of its team, measured just
    before it, and the kernel's fraction of it; the JSON names the vector path taken (forced: avx2)."""
    import json
    from bench import cpu_experts as bench_cpu
    _kernel_or_skip()
    out = tmp_path / "b.json"
    try:
        assert bench_cpu.main(["--shapes", "tiny-moe", "--formats", "exl2", "--rows", "1", "4", "--bits", "2.5", "4.0",
                               "--calls", "2", "--pool-mb", "1", "--threads", "1", "2", "--read-mb", "16",
                               "--isa", "avx2", "--json", str(out)]) == 0
    finally:
        ce.load_kernel().set_isa("auto")
    data = json.loads(out.read_text())
    assert data["isa"] == "avx2" and data["machine"]["numa_nodes"] >= 1 and set(data["machine"]["read_gbps"]) == {"1", "2"}
    assert data["machine"]["load_average"] and data["machine"]["load_average_end"] and data["git_commit"]
    rows = data["results"]
    assert [(r["bits"], r["threads"], r["rows"]) for r in rows] == [(b, t, n) for b in (2.5, 4.0) for t in (1, 2) for n in (1, 4)]
    for r in rows:
        assert r["kernel"] == "avx2" and r["read_gbps"] > 0
        assert r["bandwidth_fraction"] == pytest.approx(r["gb_per_s"] / r["read_gbps"])
        assert r["gb_per_s_per_thread"] == pytest.approx(r["gb_per_s"] / r["threads"])
    with pytest.raises(ValueError, match="not an MoE shape"):
        bench_cpu.run_bench(["tiny-dense"], ("int8",))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without a CUDA device")
def test_bench_pcie_load_without_a_gpu_says_so(capsys):
    from bench import cpu_experts as bench_cpu
    with pytest.raises(SystemExit):
        bench_cpu.main(["--shapes", "tiny-moe", "--formats", "int8", "--pcie-load"])
    assert "--pcie-load needs a CUDA device" in capsys.readouterr().err


def test_experts_from_a_model_folder(tmp_path):
    from runtime.exl2 import synth
    from runtime.modelfolder import ModelFolder
    synth.write_synthetic("tiny-moe", 3.0, tmp_path / "m", layers=1)
    folder = ModelFolder(tmp_path / "m")
    store = ce.CpuExperts.from_exl2(ce.read_experts(folder, 0, [3, 5]), "int8")
    assert (store.hidden, store.inter, store.num_experts) == (256, 128, 2)
    ref = folder.linear("model.layers.0.mlp.experts.5.down_proj")
    x, ids, w = torch.randn(1, 256), torch.tensor([[1]]), torch.ones(1, 1)
    dense = [tuple(folder.linear(f"model.layers.0.mlp.experts.{e}.{p}_proj") for p in ce.PROJS) for e in (3, 5)]
    assert torch.equal(dense[1][2], ref)
    assert _rel(store.forward(x, ids, w), ce.reference_forward(dense, x, ids, w)) < TOL["int8"]
    with pytest.raises(ce.CpuExpertsError, match="expert 99"):
        ce.read_experts(folder, 0, [99])


def test_experts_from_an_import_carry_their_exact_scales(tmp_path):
    from runtime.exl2.gptq_import import import_model
    from runtime.modelfolder import ModelFolder
    from tests.convert_fixtures import tiny_checkpoint
    from tests.gptq_fixtures import dequantize, gptq_folder
    build = gptq_folder(tiny_checkpoint(tmp_path / "hf", "qwen3_moe", layers=1), tmp_path / "gptq", group_size=32)
    import_model(tmp_path / "gptq", tmp_path / "out", calibrate=False, say=lambda m: None)
    expert = ce.read_experts(ModelFolder(tmp_path / "out"), 0, [2])[0]
    assert all("q_scale_exact" in t for t in expert.values())
    down = build["model.layers.0.mlp.experts.2.down_proj"]
    assert torch.equal(fmt.dequantize(expert["down"], out_features=64), dequantize(down, 4, "gptq", 1, 32, 64))
