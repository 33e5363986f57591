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
    assert (t.grouped, t.splitk, t.lend_staging, t.route_prior, t.pin_ahead, t.warmup) == \
        (Grouped(), None, True, True, 1, True)
    assert Tuning.from_environment({"MOEDESK_PIN_AHEAD": "", "MOEDESK_GROUPED": ""}) == Tuning()   # empty: unset


def test_what_is_left_is_launch_shapes_load_steps_and_what_won_somewhere():
    """The switches between implementations of the same math were measured and cut (the one-launch set, the
    one-launch sort, the tile sums, the dense GEMV, the attention and routing variants, the CPU split and
    signal, ...): what is left names launch shapes, load steps, and lending (which lost in two runs of
    four). A variable that named a cut switch is no longer read."""
    assert [f.name for f in dataclasses.fields(Tuning)] == [
        "grouped", "splitk", "cpu_kernel_isa", "lend_staging", "route_prior", "pin_ahead", "warmup",
        "template_timeout_s"]
    gone = {"MOEDESK_QKV_FUSED": "0", "MOEDESK_ROUTE": "torch", "MOEDESK_MOE_FINISH": "0", "MOEDESK_ALIGN": "torch",
            "MOEDESK_DENSE_GEMV": "1", "MOEDESK_GEMV_SUMS": "rows", "MOEDESK_GRAPH_ATTN": "bmm",
            "MOEDESK_CPU_SPLIT": "experts", "MOEDESK_CPU_SIGNAL": "hostfunc", "MOEDESK_PREFETCH": "0"}
    assert Tuning.from_environment(gone) == Tuning()


def test_each_variable_sets_its_field():
    env = {"MOEDESK_GROUPED": "32,32,64,128,8,2", "MOEDESK_SPLITK": "128x2", "MOEDESK_CPU_KERNEL_ISA": "avx2",
           "MOEDESK_LEND_STAGING": "0", "MOEDESK_ROUTE_PRIOR": "0", "MOEDESK_PIN_AHEAD": "3",
           "MOEDESK_NO_WARMUP": "", "MOEDESK_TEMPLATE_TIMEOUT_S": "0.5"}
    t = Tuning.from_environment(env)
    assert t == Tuning(grouped=Grouped(32, 32, 64, 128, 8, 2), splitk=(128, 2), cpu_kernel_isa="avx2",
                       lend_staging=False, route_prior=False, pin_ahead=3, warmup=False, template_timeout_s=0.5)
    named = {env for env, _, _ in t.describe()}
    assert named == set(env), "every field is read from one variable, and the test sets each"


@pytest.mark.parametrize("name,value,says", [
    ("MOEDESK_PIN_AHEAD", "5", "0 to 4"),
    ("MOEDESK_PIN_AHEAD", "many", "a whole number"),
    ("MOEDESK_LEND_STAGING", "maybe", "want 1 (on) or 0 (off)"),
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
    with tuning.use(Tuning(pin_ahead=2)) as t:
        assert tuning.current() is t
        assert tuning.with_changes(lend_staging=False) == Tuning(pin_ahead=2, lend_staging=False)
    assert tuning.current() is before
    with pytest.raises(dataclasses.FrozenInstanceError):
        before.pin_ahead = 2                                     # type: ignore[misc]


def test_the_worker_refuses_a_bad_tuning_at_start_and_says_which():
    from runtime.client import worker_command, worker_env
    env = worker_env()
    env["MOEDESK_PIN_AHEAD"] = "lots"
    r = subprocess.run(worker_command(), env=env, input="", capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "MOEDESK_PIN_AHEAD='lots': want a whole number, 0 to 4" in r.stderr


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


def test_the_engine_reads_no_tuning_global_inside_its_modules():
    """The engine's tuning is read once at load (an engine's `load`, from `current()` under another name) and
    handed to constructors: no module of the engine calls `tuning.current()` (a captured CUDA graph keeps what
    it saw). The process-wide reads left are the chat template's timeout and the CPU kernel's build flags."""
    allowed = {"runtime/chat_template.py", "runtime/cpu/experts.py", "runtime/cpu/experts.py"}
    offenders = []
    for path in sorted((ROOT / "runtime").rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        if path == READER or rel in allowed:
            continue
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "current" \
                    and isinstance(node.func.value, ast.Name) and node.func.value.id in ("tuning", "_tuning"):
                offenders.append(f"{rel}:{node.lineno}")
    assert offenders == []


def test_offloaded_layers_read_a_verifys_experts_once():
    from runtime.experts.layer import union_reads
    assert union_reads(5, "stream") and not union_reads(1, "stream") and not union_reads(5, "vram")
