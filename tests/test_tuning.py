"""runtime/tuning.py: the typed engine tuning read from the environment, and the rule that no other
module of runtime/ or app/ reads the environment."""
from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from runtime import tuning
from runtime.tuning import Grouped, Tuning, TuningError

ROOT = Path(__file__).resolve().parent.parent
READER = ROOT / "runtime" / "tuning.py"


def test_an_empty_environment_gives_the_defaults():
    t = Tuning.from_environment({})
    assert t == Tuning()
    assert (t.gemv_max_pairs, t.cut_align, t.grouped, t.splitk) == (64, 64, Grouped(), None)
    assert (t.cpu_split, t.cpu_balance, t.auto_cpu_path, t.lend_staging, t.prefetch_pages) == ("cut", 1.5, True, True, 1)
    assert (t.route, t.moe_add, t.graph_attn, t.capture_mode, t.graphs, t.warmup) == \
        ("fused", "fused", "triton", "relaxed", True, True)
    assert Tuning.from_environment({"MOEDESK_CUT_ALIGN": "", "MOEDESK_GROUPED": ""}) == Tuning()   # empty: unset


def test_each_variable_sets_its_field():
    env = {"MOEDESK_GEMV_MAX_PAIRS": "32", "MOEDESK_GROUPED": "32,32,64,128,8,2", "MOEDESK_SPLITK": "128x2",
           "MOEDESK_GEMV_SUMS": "columns",
           "MOEDESK_CUT_ALIGN": "32", "MOEDESK_CPU_SIGNAL": "hostfunc", "MOEDESK_CPU_KERNEL_ISA": "avx2",
           "MOEDESK_AUTO_CPU_PATH": "0", "MOEDESK_CPU_SPLIT": "experts", "MOEDESK_CPU_BALANCE": "0",
           "MOEDESK_LEND_STAGING": "0", "MOEDESK_PREFETCH": "2", "MOEDESK_ROUTE_PRIOR": "0", "MOEDESK_PIN_AHEAD": "3",
           "MOEDESK_ROUTE": "torch", "MOEDESK_ALIGN": "kernel", "MOEDESK_MOE_ADD": "plain",
           "MOEDESK_MOE_FINISH": "1",
           "MOEDESK_VERIFY_READS": "rows",
           "MOEDESK_GRAPH_ATTN": "bmm", "MOEDESK_CAPTURE_MODE": "global", "MOEDESK_PREFILL_ATTN": "matmul",
           "MOEDESK_DENSE_GEMV": "1", "MOEDESK_QKV_FUSED": "1", "MOEDESK_NO_GRAPHS": "1", "MOEDESK_NO_WARMUP": "", "MOEDESK_TEMPLATE_TIMEOUT_S": "0.5"}
    t = Tuning.from_environment(env)
    assert t == Tuning(gemv_max_pairs=32, grouped=Grouped(32, 32, 64, 128, 8, 2), splitk=(128, 2), gemv_sums="columns",
                       cut_align=32,
                       cpu_signal="hostfunc", cpu_kernel_isa="avx2", auto_cpu_path=False, cpu_split="experts",
                       cpu_balance=0.0, lend_staging=False, prefetch_pages=2, route_prior=False, pin_ahead=3,
                       route="torch", align="kernel", moe_add="plain", moe_finish=True, verify_reads="rows",
                       graph_attn="bmm", capture_mode="global", prefill_attn="matmul", dense_gemv=True, qkv_fused=True,
                       graphs=False,
                       warmup=False, template_timeout_s=0.5)
    named = {env for env, _, _ in t.describe()}
    assert named == set(env), "every field is read from one variable, and the test sets each"


@pytest.mark.parametrize("name,value,says", [
    ("MOEDESK_CUT_ALIGN", "48", "one of 32, 64, 128"),
    ("MOEDESK_GEMV_SUMS", "words", "one of weights, columns, rows"),
    ("MOEDESK_PIN_AHEAD", "5", "0 to 4"),
    ("MOEDESK_CUT_ALIGN", "sixty", "one of 32, 64, 128"),
    ("MOEDESK_PREFETCH", "9", "0 to 8"),
    ("MOEDESK_PREFETCH", "-1", "0 to 8"),
    ("MOEDESK_GEMV_MAX_PAIRS", "0", "1 to 65536"),
    ("MOEDESK_CPU_BALANCE", "0.5", "at least 1"),
    ("MOEDESK_CPU_BALANCE", "yes", "a number"),
    ("MOEDESK_CPU_SPLIT", "halves", "one of cut, experts"),
    ("MOEDESK_CPU_SIGNAL", "doorbell", "one of auto, memops, hostfunc"),
    ("MOEDESK_AUTO_CPU_PATH", "maybe", "want 1 (on) or 0 (off)"),
    ("MOEDESK_GRAPH_ATTN", "flash", "one of triton, bmm, sdpa"),
    ("MOEDESK_ROUTE", "torchy", "one of fused, normed, torch"),
    ("MOEDESK_GROUPED", "16,64", "six integers"),
    ("MOEDESK_GROUPED", "16,64,48,32,4,0", "not a power of two"),
    ("MOEDESK_SPLITK", "64", "BNxKSPLIT"),
    ("MOEDESK_CPU_KERNEL_ISA", "avx9", "one of auto, avx512_vnni, avx2, scalar"),
    ("MOEDESK_TEMPLATE_TIMEOUT_S", "0", "0.001 to 3600"),
])
def test_a_bad_value_names_the_variable_and_what_it_allows(name, value, says):
    with pytest.raises(TuningError) as e:
        Tuning.from_environment({name: value})
    assert str(e.value).startswith(f"{name}={value!r}: ") and says in str(e.value)


def test_every_field_has_a_variable_a_description_and_its_type():
    hints = Tuning.__annotations__
    for f in dataclasses.fields(Tuning):
        assert f.metadata["env"].startswith("MOEDESK_") and f.metadata["help"], f.name
        assert f.name in hints
    assert len({f.metadata["env"] for f in dataclasses.fields(Tuning)}) == len(dataclasses.fields(Tuning))


def test_use_installs_a_tuning_for_a_block_only():
    before = tuning.current()
    with tuning.use(Tuning(cut_align=32)) as t:
        assert tuning.current() is t
        from runtime.experts import kernels
        assert kernels.CUT_ALIGN == 32 and kernels.cut_align() == 32
        assert tuning.with_changes(prefetch_pages=0) == Tuning(cut_align=32, prefetch_pages=0)
    assert tuning.current() is before
    with pytest.raises(dataclasses.FrozenInstanceError):
        before.cut_align = 32                                    # type: ignore[misc]


def test_the_worker_refuses_a_bad_tuning_at_start_and_says_which():
    from runtime.client import worker_command, worker_env
    env = worker_env()
    env["MOEDESK_PREFETCH"] = "lots"
    r = subprocess.run(worker_command(), env=env, input="", capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "MOEDESK_PREFETCH='lots': want a whole number, 0 to 8" in r.stderr


def test_the_other_variables_have_accessors(monkeypatch, tmp_path):
    monkeypatch.setenv("MOEDESK_HOME", str(tmp_path))
    monkeypatch.setenv("MOEDESK_MODELS", str(tmp_path / "m"))
    monkeypatch.setenv("MOEDESK_CUDA_TOOLCHAIN", "wheels")
    monkeypatch.setenv("MOEDESK_API_KEY", "k")
    monkeypatch.setenv("MOEDESK_COMMIT", "abc123")
    assert (tuning.home(), tuning.models_folder(), tuning.cuda_toolchain()) == (tmp_path, tmp_path / "m", "wheels")
    assert (tuning.api_key(), tuning.commit()) == ("k", "abc123")
    monkeypatch.setenv("MOEDESK_CUDA_TOOLCHAIN", "conda")
    with pytest.raises(TuningError, match="MOEDESK_CUDA_TOOLCHAIN='conda': want wheels or system"):
        tuning.cuda_toolchain()


# -- only runtime/tuning.py reads the environment -----------------------------------------------------

READ_METHODS = {"get", "items", "keys", "values", "copy", "setdefault", "__getitem__", "__contains__"}


def environment_reads(source: str, filename: str = "<source>") -> list[int]:
    """Lines that read the process environment: os.getenv, os.environ.get/items/..., os.environ[...]
    read, `in os.environ`, and os.environ handed on as a value (a default argument, an argument) where
    it is not copied with dict(...) into a child process's environment. Writes (os.environ[k] = v,
    pop, update, del) are not reads."""
    tree = ast.parse(source, filename)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    environ_names = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == "os"
                     for a in n.names if a.name == "environ"}
    getenv_names = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == "os"
                    for a in n.names if a.name == "getenv"}
    lines = []
    for node in ast.walk(tree):
        is_environ = ((isinstance(node, ast.Attribute) and node.attr in ("environ", "environb")
                       and isinstance(node.value, ast.Name) and node.value.id == "os")
                      or (isinstance(node, ast.Name) and node.id in environ_names))
        is_getenv = ((isinstance(node, ast.Attribute) and node.attr in ("getenv", "getenvb")
                      and isinstance(node.value, ast.Name) and node.value.id == "os")
                     or (isinstance(node, ast.Name) and node.id in getenv_names and isinstance(node.ctx, ast.Load)))
        if is_getenv:
            lines.append(node.lineno)
        if not is_environ:
            continue
        up = parents.get(node)
        if isinstance(up, ast.Attribute):
            if up.attr in ("pop", "update", "clear"):
                continue
            lines.append(node.lineno)                       # .get, .items, ... or anything else
        elif isinstance(up, ast.Subscript):
            if not isinstance(up.ctx, ast.Load):
                continue                                    # os.environ[k] = v, del os.environ[k]
            lines.append(node.lineno)
        else:
            copied = up
            while copied is not None and not isinstance(copied, (ast.stmt, ast.Call)):
                copied = parents.get(copied)
            if isinstance(copied, ast.Call) and isinstance(copied.func, ast.Name) and copied.func.id == "dict":
                continue                                    # dict(os.environ ...): a child process's environment
            lines.append(node.lineno)
    return sorted(lines)


def test_only_the_tuning_module_reads_the_environment():
    offenders = []
    for top in ("runtime", "app"):
        for path in sorted((ROOT / top).rglob("*.py")):
            if path == READER:
                continue
            offenders += [f"{path.relative_to(ROOT)}:{n}" for n in environment_reads(path.read_text(), str(path))]
    assert offenders == [], "read the environment through runtime/tuning.py instead: " + ", ".join(offenders)


@pytest.mark.parametrize("source,lines", [
    ("import os\nx = os.environ.get('A')\ny = os.getenv('B')\n", [2, 3]),
    ("import os\nx = os.environ['A']\nif 'B' in os.environ:\n    pass\n", [2, 3]),
    ("from os import environ, getenv\nx = environ.get('A')\ny = getenv('B')\n", [2, 3]),
    ("import os\ndef f(env=os.environ):\n    return env.get('A')\n", [2]),
    ("import os\nfor k, v in os.environ.items():\n    pass\n", [2]),
    ("import os\nos.environ['A'] = '1'\nos.environ.pop('B', None)\ndel os.environ['C']\n", []),
    ("import os\nenv = dict(os.environ, A='1')\nenv2 = dict(os.environ if True else {})\n", []),
])
def test_the_scan_tells_reads_from_writes_and_child_environments(source, lines):
    assert environment_reads(source) == lines


def test_the_scan_finds_what_the_modules_read_before_the_tuning_module():
    """The reads the tuning module replaced, in the shapes they had."""
    old = ("import os\nGEMV = int(os.environ.get('MOEDESK_GEMV_MAX_PAIRS', 64))\n"
           "G = Grouped.parse(os.environ['MOEDESK_GROUPED']) if os.environ.get('MOEDESK_GROUPED') else Grouped()\n")
    assert environment_reads(old) == [2, 3, 3]


def test_tuning_reads_no_module_global_of_the_engine():
    """Pure Python: the GUI imports it without torch."""
    r = subprocess.run([sys.executable, "-c", "import sys, runtime.tuning; print('torch' in sys.modules)"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "False", r.stderr


def test_the_cpu_path_cuts_in_steps_of_the_installed_tuning():
    """The CPU copies' width is checked against Tuning.cut_align when asked, not a value frozen at import."""
    pytest.importorskip("triton")
    from bench.check_experts import random_layer
    from runtime.experts.cpu_path import cpu_expert_bytes
    from runtime.experts.pack import align_intermediate
    layer = random_layer(4, 64, 128, 2, 4, "cpu", group_size=32)
    align_intermediate(layer.w1, layer.w3, layer.w2)
    packs = (layer.w1, layer.w3, layer.w2)
    with tuning.use(Tuning(cut_align=64)):
        with pytest.raises(ValueError, match="want a multiple of 64 in 64..128"):
            cpu_expert_bytes(packs, 96)
    with tuning.use(Tuning(cut_align=32)):
        assert 0 < cpu_expert_bytes(packs, 96) < cpu_expert_bytes(packs, 128)


def test_offloaded_layers_read_a_verifys_experts_once_unless_the_tuning_says_per_row():
    from runtime.experts.layer import union_reads
    assert union_reads(5, "stream") and not union_reads(1, "stream") and not union_reads(5, "vram")
    with tuning.use(Tuning(verify_reads="rows")):
        assert not union_reads(5, "stream")
    assert union_reads(5, "stream")
