"""Import of GPTQ-family builds into EXL2 (runtime/exl2/gptq_import.py) on tiny checkpoints written as GPTQModel,
AutoRound and AWQ document their packing (tests/gptq_fixtures.py):

- every imported linear against an independent dequantization: bit-exact through its exact scales
  (q_scale_exact) for trained (free fp16) scales, experts and attention, any group size, act order or not, v1 or
  v2 zero points, asymmetric builds at width 5; its q_scale / q_scale_max (what exllamav2's Q matrix reads) close;
  without exact scales (asymmetric builds at their own width, or `exact=False`) bit-exact where the build's scales
  are steps EXL2 can store, else within the error the import reports, which is the least a search over all 16
  steps of each group and column finds, to within 1%;
- the CPU engine's logits on the imported folder against transformers' fp32 model holding the build's own weights
  (the independent dequantization) and the imported 16-bit linears, at the reference engine's tolerance (1e-4);
  at its int8 precision within the CPU kernel's (3% of the largest logit: int8 activations);
- the CPU kernel's readers (the CPU engine's int8 linears and experts, the CPU expert store) hold the build's exact
  scales and compute with the build's own weights;
- the experts as the GPU engines pack them (runtime/experts/pack.py, here through the hybrid engine's load on
  the CPU) hold the build's weights bit for bit;
- an interrupted import resumes to the same folder; hostile quantization_config values and tensors are refused by
  name.
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")

from runtime import gptq_spec  # noqa: E402
from runtime.errors import InvalidModel, ModelFolderError, UnsupportedArchitecture  # noqa: E402
from runtime.exl2 import format as fmt  # noqa: E402
from runtime.exl2 import gptq_tensors as gt  # noqa: E402
from runtime.exl2.gptq_import import import_model  # noqa: E402
from runtime.exl2.gptq_source import ImportFailed  # noqa: E402
from runtime.modelfolder import EXL2_PARTS, ModelFolder, validate  # noqa: E402
from runtime.reference import load  # noqa: E402
from runtime.reference.qlinear import INT8_ACTIVATIONS_TOLERANCE  # noqa: E402
from tests.convert_fixtures import TEXT, tiny_checkpoint  # noqa: E402
from tests.gptq_fixtures import dequantize, gptq_folder  # noqa: E402
from tests.test_exl2_convert_qwen35 import one_thread  # noqa: E402,F401 (autouse: one torch thread)

TOL_FP32 = 1e-4                      # tests/test_reference_parity.py's
TOL_INT8 = INT8_ACTIVATIONS_TOLERANCE  # int8 activations, of the logits' largest


def _hf(tmp_path, arch: str, hidden: int = 64):
    if arch == "qwen35":
        from tests.test_exl2_convert_qwen35 import tiny_qwen35
        return tiny_qwen35(tmp_path / "hf", mtp=True)
    return tiny_checkpoint(tmp_path / "hf", arch, layers=2, hidden=hidden, head_dim=hidden // 4)


def _quiet(_msg):
    pass


def _attention(name: str) -> bool:
    """The experts and the attention projections: a build that quantized attention too (Qwen's own)."""
    return ".experts." in name or ".self_attn." in name


CASES = {   # id: (arch, hidden, fixture options, import options); "grid": scales on EXL2's steps
    "qwen3moe-gptq-g32": ("qwen3_moe", 64, dict(method="gptq", group_size=32), {}),
    "qwen3moe-gptqv2-g128-actorder": ("qwen3_moe", 128, dict(method="gptq", v2=True, group_size=128, desc_act=True),
                                      {}),
    "mixtral-autoround-g128": ("mixtral", 128, dict(method="auto-round", group_size=128), {}),
    "mixtral-gptq-g32-actorder": ("mixtral", 64, dict(method="gptq", group_size=32, desc_act=True), {}),
    "qwen35-gptq-g32": ("qwen35", 64, dict(method="gptq", group_size=32), {}),
    "qwen35-autoround-g32-actorder": ("qwen35", 64, dict(method="auto-round", group_size=32, desc_act=True), {}),
    "qwen3moe-attention-g128": ("qwen3_moe", 128, dict(method="gptq", group_size=128, which=_attention), {}),
    "qwen3moe-asymmetric": ("qwen3_moe", 64, dict(method="gptq", group_size=32, sym=False), {}),
    "qwen3moe-asymmetric-w5": ("qwen3_moe", 64, dict(method="gptq", group_size=32, sym=False), dict(width=5)),
    "mixtral-awq-g32": ("mixtral", 64, dict(method="awq", group_size=32, sym=False), {}),
    "mixtral-awq-g32-w5": ("mixtral", 64, dict(method="awq", group_size=32, sym=False), dict(width=5)),
    "qwen3moe-searched-grid": ("qwen3_moe", 64, dict(method="gptq", group_size=32, grid=True, which=_attention,
                                                     desc_act=True), dict(exact=False)),
    "qwen3moe-searched": ("qwen3_moe", 64, dict(method="gptq", group_size=32), dict(exact=False)),
}


def _with_exact(opts: dict, imp: dict) -> bool:
    """Whether the import writes exact scales: asked for (the default) and every code q - zero a code of the width
    (symmetric builds at any width, asymmetric ones above their bits)."""
    return imp.get("exact", True) and (opts.get("sym", True) or imp.get("width", 4) > 4)


def _check_linears(out, quantized, opts, imp) -> dict[str, float]:
    """Each imported linear against the fixture's own dequantization: equal where it has exact scales or the
    build's scales are EXL2 steps (`grid`); -> relative errors of the others. With exact scales, the weights of
    q_scale / q_scale_max alone (exllamav2's Q matrix) are close, not equal (the scales are not steps)."""
    folder = ModelFolder(out)
    packing = "awq" if opts["method"] == "awq" else "gptq"
    offset = 1 if packing == "gptq" and not opts.get("v2") else 0
    errors = {}
    for prefix, parts in quantized.items():
        rows = folder._shapes[prefix][0]
        want = dequantize(parts, 4, packing, offset, opts["group_size"], rows)
        got = folder.linear(prefix)
        assert folder.has(f"{prefix}.q_scale_exact") == _with_exact(opts, imp), prefix
        if _with_exact(opts, imp) or opts.get("grid"):
            assert torch.equal(got, want), f"{prefix}: not bit-exact"
        else:
            errors[prefix] = float((got - want).norm() / want.norm())
        if _with_exact(opts, imp) and not opts.get("grid"):
            steps = fmt.dequantize({k: folder.tensor(f"{prefix}.{k}") for k in EXL2_PARTS}, out_features=rows)
            assert 0 < float((steps - want).norm() / want.norm()) < 0.1, prefix
    return errors


@pytest.mark.parametrize("case", list(CASES))
def test_imported_linears_match_the_documented_dequantization(tmp_path, case):
    arch, hidden, opts, imp = CASES[case]
    quantized = gptq_folder(_hf(tmp_path, arch, hidden), tmp_path / "gptq", **opts)
    out = import_model(tmp_path / "gptq", tmp_path / "out", calibrate=False, say=_quiet, **imp)
    errors = _check_linears(out, quantized, opts, imp)
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    report = config["import"]
    assert report["linears"] == len(quantized) and config["exact_scales"] == imp.get("exact", True)
    assert report["bit_exact_linears"] == len(quantized) - len(errors)
    if not errors:
        assert report["relative_rms_error"] == 0
    else:   # lossy: the reported error is the measured one, a few percent of the weights (4-bit codes)
        assert max(errors.values()) == pytest.approx(report["worst"]["relative_rms"], rel=1e-3)
        assert 0.01 < max(errors.values()) < (0.12 if not opts.get("sym", True) else 0.07)


def _brute_force_error(w: torch.Tensor, scales: torch.Tensor, rows: int, width: int = 4) -> float:
    """The least squared error of any EXL2 encoding of w [N, K] (a symmetric build's weights, groups of `rows`)
    whose q_scale_max gives each group's largest scale exactly (the import's rule): every one of the 16 steps
    tried for each group and column."""
    half, total = 1 << (width - 1), 0.0
    wt = w.t()
    for g, g0 in enumerate(range(0, wt.shape[0], rows)):
        x = wt[g0:g0 + rows]
        mx = (scales[g].max() / 256).half()
        steps = fmt.group_steps(torch.arange(1, 17.).unsqueeze(1), (mx.float() * 256).half())      # [16, 1]
        errs = [(x - (torch.div(x, t).round().clamp(-half, half - 1) * t).half().float()).square().sum(0)
                for t in steps]
        total += float(torch.stack(errs).amin(0).sum())
    return total


def test_the_step_search_is_within_a_percent_of_trying_every_step(tmp_path):
    torch.manual_seed(3)
    from tests.gptq_fixtures import pack, quantize
    w = torch.randn(96, 256) * 0.02 * torch.exp(0.3 * torch.randn(96, 1))
    q = quantize(w, 4, 32, True, False, False, torch.Generator().manual_seed(0))
    parts = pack(q, 4, "gptq", True)
    spec = gptq_spec.GptqSpec("gptq", "gptq", 4, 32, True, False, 1, False)
    lin = gt.unpack(parts, spec, gptq_spec.expected(spec, 96, 256), "w")
    tensors, stats = gt.repack(lin, 4, "w")
    best = _brute_force_error(gt.dequantize(lin), lin.scales, 32)
    assert best * (1 - 1e-6) <= stats.sq_error <= 1.01 * best      # (float sums in another order)
    deq = fmt.dequantize(tensors, out_features=96)
    assert float((deq - gt.dequantize(lin)).square().sum()) == pytest.approx(stats.sq_error, rel=1e-5)


def test_exact_repack_of_trained_scales_is_the_builds_weights():
    """One linear with trained scales: bit-exact with exact scales (at its own width and wider), its nearest steps
    for other readers; bf16 scales exact too, float32 ones within fp16's rounding of the scale; a scale beyond
    fp16 refused by name."""
    from tests.gptq_fixtures import pack, quantize
    torch.manual_seed(4)
    w = torch.randn(96, 256) * 0.02 * torch.exp(0.3 * torch.randn(96, 1))
    q = quantize(w, 4, 32, True, False, False, torch.Generator().manual_seed(0))
    spec = gptq_spec.GptqSpec("gptq", "gptq", 4, 32, True, False, 1, False)
    lay = gptq_spec.expected(spec, 96, 256)
    parts = pack(q, 4, "gptq", True)
    lin = gt.unpack(parts, spec, lay, "w")
    for width in (4, 6):
        tensors, stats = gt.repack(lin, width, "w", exact=True)
        assert torch.equal(fmt.dequantize(tensors, out_features=96), gt.dequantize(lin)) and stats.exact == 1
        steps = fmt.dequantize({k: v for k, v in tensors.items() if k in fmt.REQUIRED_KEYS}, out_features=96)
        assert 0 < float((steps - gt.dequantize(lin)).norm() / gt.dequantize(lin).norm()) < 0.1
    bf16 = gt.unpack({**parts, "scales": parts["scales"].bfloat16()}, spec, lay, "w")
    tensors, stats = gt.repack(bf16, 4, "w", exact=True)
    assert torch.equal(fmt.dequantize(tensors, out_features=96), gt.dequantize(bf16)) and stats.exact == 1
    f32 = gt.unpack({**parts, "scales": parts["scales"].float() * 1.0001}, spec, lay, "w")
    tensors, stats = gt.repack(f32, 4, "w", exact=True)
    err = fmt.dequantize(tensors, out_features=96) - gt.dequantize(f32)
    assert stats.exact == 0 and 0 < float(err.abs().max()) <= 2 ** -10 * float(gt.dequantize(f32).abs().max())
    with pytest.raises(InvalidModel, match="w.scales: holds values that are not finite fp16 numbers"):
        gt.unpack({**parts, "scales": parts["scales"].float() * 1e9}, spec, lay, "w")


def _dequantized_copy(imported, hf, out, build: dict, opts: dict):
    """The 16-bit checkpoint `hf` with the build's quantized linears (`build`: their stored tensors) as the
    independent dequantization gives them, and every other weight the imported folder holds (the linears the import
    quantized from 16 bits dequantized): transformers' model of the build as the engine should run it."""
    folder = ModelFolder(imported)
    tensors = load_file(str(hf / "model.safetensors"))
    packing = "awq" if opts["method"] == "awq" else "gptq"
    offset = 1 if packing == "gptq" and not opts.get("v2") else 0
    for name in list(tensors):
        prefix = name[: -len(".weight")]
        if prefix in build:
            tensors[name] = dequantize(build[prefix], 4, packing, offset, opts["group_size"], tensors[name].shape[0])
        elif folder.has(name):
            tensors[name] = folder.tensor(name).float()
        elif name.endswith(".weight") and folder.has(f"{prefix}.q_weight"):
            tensors[name] = folder.linear(prefix)
    out.mkdir()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text((hf / "config.json").read_text())
    return out


@pytest.mark.parametrize("case, calibrate, precision", [("qwen3moe-gptq-g32", True, "float32"),
                                                        ("qwen3moe-gptqv2-g128-actorder", False, "float32"),
                                                        ("mixtral-gptq-g32-actorder", False, "float32"),
                                                        ("qwen35-autoround-g32-actorder", True, "float32"),
                                                        ("qwen3moe-attention-g128", False, "int8")])
def test_the_cpu_engine_on_an_import_matches_transformers(tmp_path, case, calibrate, precision):
    """float32: at the reference engine's tolerance; int8 (the CPU kernel reads the imported codes and exact scales,
    int8 activations): within the kernel's tolerance of the logits' scale (tests/test_qlinear.py's)."""
    arch, hidden, opts, _ = CASES[case]
    hf = _hf(tmp_path, arch, hidden)
    build = gptq_folder(hf, tmp_path / "gptq", **opts)
    out = import_model(tmp_path / "gptq", tmp_path / "out", calibrate=calibrate, calibration_text=TEXT, rows=4,
                       seq_len=64, say=_quiet)
    plain = _dequantized_copy(out, hf, tmp_path / "plain", build, opts)
    model = transformers.AutoModelForImageTextToText if arch == "qwen35" else transformers.AutoModelForCausalLM
    model = model.from_pretrained(plain, dtype=torch.float32).eval()
    seq = torch.randint(0, 300, (12,), generator=torch.Generator().manual_seed(7)).tolist()
    with torch.no_grad():
        ref = model(torch.tensor([seq])).logits[0].float()
    engine, _ = load(out, precision=precision)
    try:
        got = torch.cat([engine.forward(seq[:10]), engine.forward(seq[10:11]), engine.forward(seq[11:])])
    finally:
        engine.close()
    assert ref.abs().max() > 0.5, "logits too small for the comparison to mean anything"
    if precision == "float32":
        assert (got - ref).abs().max().item() <= TOL_FP32
    else:
        rel = (got - ref).abs().max().item() / ref.abs().max().item()
        assert rel <= TOL_INT8, f"int8: largest difference {rel:.4f} of the largest logit"


def _on_codes_grid(parts: list[dict], rows: int, gen: torch.Generator) -> torch.Tensor:
    """x [rows, K] that the CPU kernel's int8 rounding keeps for every projection of `parts` (EXL2 tensor sets of one
    input; one activation scale per group of codes): integers in -127..127 times 2**-6, 127 at an input of every
    group of every projection."""
    x = torch.randint(-127, 128, (rows, parts[0]["q_invperm"].numel()), generator=gen).float()
    for t in parts:
        first = torch.argsort(t["q_invperm"].long())[[g.first_row for g in fmt.read_layout(t)[2]]]
        x[:, first] = 127.0
    return x * 2.0 ** -6


def _kernel_holds_the_build(flat: dict, desc: torch.Tensor, folder, prefixes: list[str], build: dict) -> None:
    """Projections `prefixes` of one input as the CPU kernel stores them (flat buffers, desc [P, 8]): their scale
    stream is the import's exact scales, and on inputs int8 keeps the kernel's output is the float64 product with
    the build's own weights (scale * (q - zero) before fp16's rounding), up to float32 sums."""
    from runtime.cpu import experts as ce
    from tests.test_cpu_experts import packed_scales
    tensors = [folder.exl2_tensors(p) for p in prefixes]
    for d, t, p in zip(desc, tensors, prefixes):
        exact = t["q_scale_exact"]
        assert torch.equal(packed_scales(flat["sc"], d, exact.shape[1]), exact), f"{p}: not the build's scales"
    x = _on_codes_grid(tensors, 3, torch.Generator().manual_seed(len(prefixes)))
    want = torch.cat([dequantize(build[p], 4, "gptq", 1, 32, int(d[6]), fp16=False) for d, p in zip(desc, prefixes)])
    y = ce.load_kernel().linear_forward(x, flat["qw"], flat["sc"], flat["grp"], flat["perm"], desc)
    ref = x.double() @ want.T
    assert float((y.double() - ref).abs().max() / ref.abs().max()) < 2e-6, prefixes


def test_the_integer_kernel_computes_with_an_imports_exact_scales(tmp_path):
    """The CPU kernel's readers of an import (experts and attention quantized, act order): the CPU engine's int8
    precision (runtime/reference/weights.py, qlinear.py: attention, each expert) and the CPU expert store (its exl2
    format) pack the build's fp16 scales, and compute with the build's own weights."""
    from runtime.cpu import experts as ce
    from tests.test_cpu_experts import _kernel_or_skip
    _kernel_or_skip()
    build = gptq_folder(_hf(tmp_path, "qwen3_moe"), tmp_path / "gptq", method="gptq", group_size=32, desc_act=True,
                        which=_attention)
    out = import_model(tmp_path / "gptq", tmp_path / "out", calibrate=False, say=_quiet)
    folder = ModelFolder(out)
    engine, _ = load(out, precision="int8")
    try:
        layer, a, e = engine.weights.layers[1], "model.layers.1.self_attn", "model.layers.1.mlp.experts.2"
        for lin, prefixes in ((layer.qkv, [f"{a}.q_proj", f"{a}.k_proj", f"{a}.v_proj"]), (layer.o, [f"{a}.o_proj"]),
                              (layer.experts_gate_up[2], [f"{e}.gate_proj", f"{e}.up_proj"]),
                              (layer.experts_down[2], [f"{e}.down_proj"])):
            assert lin.kernel != "torch", prefixes
            _kernel_holds_the_build(lin.q.flat, lin.q.desc, folder, prefixes, build)
    finally:
        engine.close()
    store = ce.CpuExperts.from_exl2(ce.read_experts(folder, 1, [0, 2]), "exl2")
    desc = store._flat["desc"][1]
    _kernel_holds_the_build(store._flat, desc[:2], folder, [f"{e}.gate_proj", f"{e}.up_proj"], build)
    _kernel_holds_the_build(store._flat, desc[2:], folder, [f"{e}.down_proj"], build)


def test_the_hybrid_engine_packs_an_imports_experts_as_the_build_holds_them(tmp_path):
    """Qwen3.5's engine (here on the CPU) packs the experts with runtime/experts/pack.py, as on a GPU: every
    expert's packed weights are the build's, bit for bit, through their exact scales."""
    from runtime.backends import hybrid
    from runtime.options import LoadOptions, OffloadOptions
    from tests.gptq_fixtures import packed_layer_matches
    build = gptq_folder(_hf(tmp_path, "qwen35"), tmp_path / "gptq", method="auto-round", group_size=32, desc_act=True)
    out = import_model(tmp_path / "gptq", tmp_path / "out", calibrate=False, say=_quiet)
    engine, _ = hybrid.load(out, LoadOptions(offload=OffloadOptions(context_length=256)), device="cpu", window=2)
    try:
        folder, p0 = ModelFolder(out), "model.language_model.layers"
        for i, (_, _, _, _, moe) in enumerate(engine.model.blocks):
            x = moe.experts
            assert packed_layer_matches(x.w1, x.w3, x.w2, folder, f"{p0}.{i}.mlp.experts", build, 1, 32), i
    finally:
        engine.close()


def test_an_interrupted_import_resumes_to_the_same_folder(tmp_path):
    from tests.test_exl2_convert_qwen35 import _tensors
    hf = _hf(tmp_path, "qwen35")
    gptq_folder(hf, tmp_path / "gptq", group_size=32)
    kw = dict(calibrate=True, calibration_text=TEXT, rows=2, seq_len=32, say=_quiet)
    whole = import_model(tmp_path / "gptq", tmp_path / "whole", **kw)
    with pytest.raises(ImportFailed, match="stopped after layer 2 of 4"):
        import_model(tmp_path / "gptq", tmp_path / "q", stop_after_layers=2, **kw)
    said, seen = [], []
    import_model(tmp_path / "gptq", tmp_path / "q", **{**kw, "say": said.append},
                 progress=lambda done, total: seen.append((done, total)))
    assert said[0] == "resuming after layer 2 of 4" and seen == [(3, 4), (4, 4)]
    line = next(m for m in said if m.startswith("layer 3/4"))
    assert line.startswith("layer 3/4 imported, about ") and line.endswith(" left")
    a, b = _tensors(whole), _tensors(tmp_path / "q")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    qa = json.loads((whole / "config.json").read_text())["quantization_config"]
    assert qa == json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]


# ---------------------------------------------------------------------------------------------
# Refusals, by name

def _config_with(folder, **changes):
    """The folder's quantization_config with `changes` (None: the key removed)."""
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"].update(changes)
    config["quantization_config"] = {k: v for k, v in config["quantization_config"].items() if v is not None}
    (folder / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gptq")
    quantized = gptq_folder(tiny_checkpoint(tmp / "hf", "qwen3_moe", layers=1), tmp / "gptq", group_size=32)
    return tmp / "gptq", quantized


@pytest.mark.parametrize("changes, error, words", [
    ({"bits": 3}, UnsupportedArchitecture, "'quantization_config.bits' is 3: the import takes 4- or 8-bit codes"),
    ({"group_size": 0}, InvalidModel, "'quantization_config.group_size' is 0: must be -1"),
    ({"group_size": 48}, InvalidModel, "'quantization_config.group_size' is 48"),
    ({"quant_method": "fp8"}, UnsupportedArchitecture, "'quantization_config.quant_method' is 'fp8'"),
    ({"checkpoint_format": "marlin"}, UnsupportedArchitecture, "'quantization_config.checkpoint_format' is 'marlin'"),
    ({"pack_dtype": "int16"}, UnsupportedArchitecture, "'quantization_config.pack_dtype' is 'int16'"),
    ({"checkpoint_format": None, "format": "bitblas"}, UnsupportedArchitecture,
     "'quantization_config.format' is 'bitblas'"),
    ({"sym": "yes"}, InvalidModel, "'quantization_config.sym' is 'yes': must be true or false"),
    ({"group_size": 64}, InvalidModel, "qzeros' is I32[2, 8]; 4-bit codes of [64, 64] in 1 groups need I32[1, 8]"),
])
def test_hostile_quantization_config_values_are_refused_by_name(tmp_path, built, changes, error, words):
    import shutil
    folder = tmp_path / "gptq"
    shutil.copytree(built[0], folder)
    _config_with(folder, **changes)
    with pytest.raises(error) as e:
        validate(folder, gptq=True)
    assert words in str(e.value)
    with pytest.raises(ImportFailed, match=words.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")
                       .replace("(", r"\(").replace(")", r"\)")):
        import_model(folder, tmp_path / "out", calibrate=False, say=_quiet)


def _rewrite(folder, fn):
    tensors = load_file(str(folder / "model.safetensors"))
    fn(tensors)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def test_hostile_tensors_are_refused_by_name(tmp_path, built):
    import shutil
    e0 = "model.layers.0.mlp.experts.1.up_proj"
    for name, fn, words in [
        ("short", lambda t: t.__setitem__(f"{e0}.qweight", t[f"{e0}.qweight"][:4].clone()),
         f"'{e0}.qweight' is I32[4, 64]; 4-bit codes of [64, 64] in 2 groups need I32[8, 64]"),
        ("g_idx", lambda t: t[f"{e0}.g_idx"].__setitem__(5, 7), f"{e0}.g_idx: holds group 7, outside 0..1"),
        ("uneven", lambda t: t[f"{e0}.g_idx"].__setitem__(5, 1),
         f"{e0}.g_idx: group 0 holds 31 input rows: EXL2 groups hold multiples of 32 rows, so this act-order "
         f"layout cannot be represented"),
        ("g_idx-dtype", lambda t: t.__setitem__(f"{e0}.g_idx", t[f"{e0}.g_idx"].float()),
         f"'{e0}.g_idx' is F32[64]"),
    ]:
        folder = tmp_path / name
        shutil.copytree(built[0], folder)
        _rewrite(folder, fn)
        with pytest.raises(ImportFailed) as e:
            import_model(folder, tmp_path / f"out-{name}", calibrate=False, say=_quiet)
        assert words in str(e.value), name
        assert not (tmp_path / f"out-{name}").exists()


def test_huge_shapes_are_refused_before_anything_is_built(tmp_path, built):
    import shutil
    folder = tmp_path / "huge"
    shutil.copytree(built[0], folder)
    config = json.loads((folder / "config.json").read_text())
    config["moe_intermediate_size"] = 1 << 40
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ImportFailed, match="'moe_intermediate_size' must be a positive integer of at most"):
        import_model(folder, tmp_path / "out", calibrate=False, say=_quiet)


def test_a_plain_checkpoint_or_an_exl2_folder_is_pointed_elsewhere(tmp_path):
    hf = tiny_checkpoint(tmp_path / "hf", "qwen3_moe", layers=1)
    with pytest.raises(ImportFailed, match="no 'quantization_config': not a GPTQ-family build; quantize its 16-bit "
                                           "weights with moedesk-cli convert instead"):
        import_model(hf, tmp_path / "out", calibrate=False, say=_quiet)


def test_engines_refuse_a_gptq_folder_and_say_to_import_it(built):
    with pytest.raises(UnsupportedArchitecture, match=r"import it into EXL2 first \(moedesk-cli import FOLDER\)"):
        validate(built[0])
    with pytest.raises(ModelFolderError):
        load(built[0], precision="float32")


def test_the_cli_imports_a_folder_and_names_what_it_refuses(tmp_path, built, capsys):
    import shutil

    from runtime.cli import main
    assert main(["import", str(built[0]), "--out", str(tmp_path / "out"), "--no-calibrate", "--threads", "1"]) == 0
    assert "imported 12 quantized linears" in capsys.readouterr().out
    assert validate(tmp_path / "out").is_exl2
    bad = tmp_path / "bad"
    shutil.copytree(built[0], bad)
    _config_with(bad, bits=3)
    assert main(["import", str(bad), "--out", str(tmp_path / "out2"), "--no-calibrate", "--threads", "1"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("moedesk-cli import: ") and "'quantization_config.bits' is 3" in err[0]
