"""Import of GPTQ-family builds into EXL2 (runtime/exl2/gptq_import.py) on tiny checkpoints written as GPTQModel,
AutoRound and AWQ document their packing (tests/gptq_fixtures.py):

- every imported linear against an independent dequantization: bit-exact where the build's scales are steps EXL2
  can store (any group size, act order or not, v1 or v2 zero points), else within the error the import reports,
  which is the least a search over all 16 steps of each group and column finds, to within 1%;
- the CPU engine's logits on the imported folder against transformers' fp32 model holding the imported folder's
  dequantized weights, at the reference engine's tolerance (1e-4);
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
from runtime.modelfolder import ModelFolder, validate  # noqa: E402
from runtime.reference import load  # noqa: E402
from tests.convert_fixtures import TEXT, tiny_checkpoint  # noqa: E402
from tests.gptq_fixtures import dequantize, gptq_folder  # noqa: E402
from tests.test_exl2_convert_qwen35 import one_thread  # noqa: E402,F401 (autouse: one torch thread)

TOL_FP32 = 1e-4                      # tests/test_reference_parity.py's


def _hf(tmp_path, arch: str, hidden: int = 64):
    if arch == "qwen35":
        from tests.test_exl2_convert_qwen35 import tiny_qwen35
        return tiny_qwen35(tmp_path / "hf", mtp=True)
    return tiny_checkpoint(tmp_path / "hf", arch, layers=2, hidden=hidden, head_dim=hidden // 4)


def _quiet(_msg):
    pass


CASES = {   # id: (arch, hidden, fixture options); "grid": scales EXL2 can store, so the import is bit-exact
    "qwen3moe-gptq-g32": ("qwen3_moe", 64, dict(method="gptq", group_size=32, grid=True)),
    "qwen3moe-gptqv2-g128-actorder": ("qwen3_moe", 128, dict(method="gptq", v2=True, group_size=128, desc_act=True,
                                                             grid=True)),
    "mixtral-autoround-g128": ("mixtral", 128, dict(method="auto-round", group_size=128, grid=True)),
    "mixtral-gptq-g32-actorder": ("mixtral", 64, dict(method="gptq", group_size=32, desc_act=True, grid=True)),
    "qwen35-gptq-g32": ("qwen35", 64, dict(method="gptq", group_size=32, grid=True)),
    "qwen35-autoround-g32-actorder": ("qwen35", 64, dict(method="auto-round", group_size=32, desc_act=True,
                                                         grid=True)),
    "qwen3moe-gptq-g32-trained-scales": ("qwen3_moe", 64, dict(method="gptq", group_size=32)),
    "qwen3moe-gptq-asymmetric": ("qwen3_moe", 64, dict(method="gptq", group_size=32, sym=False)),
    "mixtral-awq-g32": ("mixtral", 64, dict(method="awq", group_size=32, sym=False)),
}


def _check_linears(out, quantized, opts) -> list[float]:
    """Each imported linear against the fixture's own dequantization: equal where `grid`; -> relative errors."""
    folder = ModelFolder(out)
    packing = "awq" if opts["method"] == "awq" else "gptq"
    offset = 1 if packing == "gptq" and not opts.get("v2") else 0
    errors = []
    for prefix, parts in quantized.items():
        rows = folder._shapes[prefix][0]
        want = dequantize(parts, 4, packing, offset, opts["group_size"], rows)
        got = folder.linear(prefix)
        if opts.get("grid"):
            assert torch.equal(got, want), f"{prefix}: not bit-exact"
        errors.append(float((got - want).norm() / want.norm()))
    return errors


@pytest.mark.parametrize("case", list(CASES))
def test_imported_linears_match_the_documented_dequantization(tmp_path, case):
    arch, hidden, opts = CASES[case]
    quantized = gptq_folder(_hf(tmp_path, arch, hidden), tmp_path / "gptq", **opts)
    out = import_model(tmp_path / "gptq", tmp_path / "out", calibrate=False, say=_quiet)
    errors = _check_linears(out, quantized, opts)
    report = json.loads((out / "config.json").read_text())["quantization_config"]["import"]
    assert report["linears"] == len(quantized)
    if opts.get("grid"):
        assert report["bit_exact_linears"] == len(quantized) and report["relative_rms_error"] == 0
    else:   # lossy: the reported error is the measured one, a few percent of the weights (4-bit codes)
        assert report["bit_exact_linears"] == 0
        assert max(errors) == pytest.approx(report["worst"]["relative_rms"], rel=1e-3)
        assert 0.01 < report["relative_rms_error"] < (0.12 if not opts.get("sym", True) else 0.07)


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


def _dequantized_copy(imported, hf, out):
    """The 16-bit checkpoint `hf` with every weight the imported folder holds replaced by its value there
    (EXL2 linears dequantized): transformers' model of exactly what the engine runs."""
    folder = ModelFolder(imported)
    tensors = load_file(str(hf / "model.safetensors"))
    for name in list(tensors):
        prefix = name[: -len(".weight")]
        if folder.has(name):
            tensors[name] = folder.tensor(name).float()
        elif name.endswith(".weight") and folder.has(f"{prefix}.q_weight"):
            tensors[name] = folder.linear(prefix)
    out.mkdir()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text((hf / "config.json").read_text())
    return out


@pytest.mark.parametrize("case, calibrate", [("qwen3moe-gptq-g32-trained-scales", True),
                                             ("mixtral-gptq-g32-actorder", False),
                                             ("qwen35-autoround-g32-actorder", True)])
def test_the_cpu_engine_on_an_import_matches_transformers(tmp_path, case, calibrate):
    arch, hidden, opts = CASES[case]
    hf = _hf(tmp_path, arch, hidden)
    gptq_folder(hf, tmp_path / "gptq", **opts)
    out = import_model(tmp_path / "gptq", tmp_path / "out", calibrate=calibrate, calibration_text=TEXT, rows=4,
                       seq_len=64, say=_quiet)
    plain = _dequantized_copy(out, hf, tmp_path / "plain")
    model = transformers.AutoModelForImageTextToText if arch == "qwen35" else transformers.AutoModelForCausalLM
    model = model.from_pretrained(plain, dtype=torch.float32).eval()
    seq = torch.randint(0, 300, (12,), generator=torch.Generator().manual_seed(7)).tolist()
    with torch.no_grad():
        ref = model(torch.tensor([seq])).logits[0].float()
    engine, _ = load(out, precision="float32")
    try:
        got = torch.cat([engine.forward(seq[:10]), engine.forward(seq[10:11]), engine.forward(seq[11:])])
    finally:
        engine.close()
    assert ref.abs().max() > 0.5, "logits too small for the comparison to mean anything"
    assert (got - ref).abs().max().item() <= TOL_FP32


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
