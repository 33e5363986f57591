"""The repository's layout, read from its source with `ast` (nothing is imported): no benchmark or
diagnostic inside the runtime, no import cycle anywhere (runtime/, app/, bench/, tests/, packaging/),
runtime modules and functions a reader can hold in mind, and a code map (docs/code-map.md) that names every file by
its path."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RUNTIME = ROOT / "runtime"
PACKAGES = ("runtime", "app", "bench", "tests", "packaging")   # every folder of Python in the repository
MAPPED = ("runtime", "app", "bench")                           # the code map's folders
CODE_MAP = ROOT / "docs" / "code-map.md"
MAX_LINES = 600
MAX_FUNCTION_LINES = 80


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def runtime_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(RUNTIME.rglob("*.py"))}


def repository_modules() -> dict[str, Path]:
    return {module_name(p): p for top in PACKAGES for p in sorted((ROOT / top).rglob("*.py"))
            if "__pycache__" not in p.parts}


def imported_names(path: Path, name: str, modules: set[str]) -> list[tuple[str, int]]:
    """Every module an import statement anywhere in the file names (module level, inside functions
    or classes, under `if TYPE_CHECKING`), relative imports resolved, with its line. `from pkg import
    x` names pkg.x where that is one of `modules`, else pkg (x a class, function or constant of it)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - (node.level - 1)] + ([base] if base else []))
            found += [(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base, node.lineno)
                      for a in node.names]
    return found


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the modules of `mods` it imports by name. A package's __init__ that runs because one
    of its modules is imported is not an edge: a package importing its own modules is the ordinary
    shape of a package, not a cycle."""
    return {name: {t for t, _ in imported_names(path, name, set(mods)) if t in mods and t != name}
            for name, path in mods.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_benchmark_or_diagnostic_module_in_the_runtime():
    named = [n for n, p in runtime_modules().items() if p.stem.startswith(("bench", "check", "diag"))]
    assert named == [], f"benchmarks and diagnostics belong in bench/, not the runtime: {named}"


def test_the_runtime_never_imports_the_benchmarks():
    """`moedesk-cli bench` names its module as a string (runtime/cli.py imports it lazily); no import
    statement in the runtime reaches bench/, which an installed bundle does not carry."""
    mods = runtime_modules()
    offenders = [f"{name}:{line} imports {target}" for name, path in mods.items()
                 for target, line in imported_names(path, name, set(mods)) if target.split(".")[0] in ("bench", "tests")]
    assert offenders == []


def test_no_import_cycle_anywhere_in_the_repository():
    """Module-level and function-level imports alike: a lazy import that closes a circle still ties
    the modules into one knot a reader must hold at once."""
    assert cycles(import_graph(repository_modules())) == []


def test_the_repository_graph_sees_app_and_bench():
    """The check reaches past runtime/: app/main imports app/firstrun (inside main()), and the
    benchmarks import the roofline."""
    graph = import_graph(repository_modules())
    assert "app.firstrun" in graph["app.main"] and "bench.roofline" in graph["bench.engine"]


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_imports_are_resolved_relative_and_inside_functions(tmp_path):
    pkg = tmp_path / "runtime" / "sub"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    src = pkg / "m.py"
    src.write_text("from . import other\nfrom ..top import X\n\ndef f():\n    import runtime.late\n")
    names = {t for t, _ in imported_names(src, "runtime.sub.m", {"runtime.sub.other", "runtime.top"})}
    assert names == {"runtime.sub.other", "runtime.top", "runtime.late"}


def line_counts() -> dict[str, int]:
    return {name: len(path.read_text().splitlines()) for name, path in runtime_modules().items()}


def test_every_runtime_module_within_the_limit():
    """A module a reader can hold in mind: split by idea before one grows past MAX_LINES."""
    over = {name: n for name, n in line_counts().items() if n > MAX_LINES}
    assert over == {}


def function_lengths(path: Path) -> dict[str, int]:
    """Lines of every function and method in the file (from its `def` to its last line), by qualified name."""
    out: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out[prefix + child.name] = child.end_lineno - child.lineno + 1
                visit(child, prefix + child.name + ".")
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".")
    visit(ast.parse(path.read_text(), str(path)), "")
    return out


def test_every_runtime_function_within_the_limit():
    """A function a reader can follow in one look: split by step before one grows past MAX_FUNCTION_LINES."""
    over = {f"{name}:{fn}": n for name, path in runtime_modules().items()
            for fn, n in function_lengths(path).items() if n > MAX_FUNCTION_LINES}
    assert over == {}


def test_function_lengths_count_from_def_to_the_last_line(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("def f():\n    x = 1\n\n    return x\n\n\nclass C:\n    def g(self):\n        def h():\n"
                   "            pass\n        return h\n")
    assert function_lengths(src) == {"f": 4, "C.g": 4, "C.g.h": 2}


def mapped_files() -> list[str]:
    """Every module and script of runtime/, app/ and bench/ (and the runtime's C++ source), as its path
    from the repository root."""
    return sorted(str(p.relative_to(ROOT)) for top in MAPPED for pattern in ("*.py", "*.sh", "*.cpp")
                  for p in (ROOT / top).rglob(pattern)
                  if p.name != "__init__.py" and "__pycache__" not in p.parts)


def map_paths(text: str) -> set[str]:
    """The paths a map names: every `code span` that is a path under one of the mapped folders."""
    spans = re.findall(r"`([^`\n]+)`", text)
    return {s for s in spans if s.startswith(tuple(f"{top}/" for top in MAPPED)) and " " not in s}


def test_the_code_map_names_every_file_by_its_path():
    """docs/code-map.md names each file by its path (25 files share 12 names: `engine.py` alone says
    nothing), and names no file that is gone."""
    named = map_paths(CODE_MAP.read_text())
    missing = [p for p in mapped_files() if p not in named]
    assert not missing, f"docs/code-map.md does not name: {missing}"
    gone = sorted(p for p in named if not p.endswith("/") and not (ROOT / p).exists())
    assert not gone, f"docs/code-map.md names files that do not exist: {gone}"


def test_a_file_named_only_by_its_name_is_missing():
    text = "- `runtime/worker.py`: commands in; `engine.py`, `app/` and `runtime/reference/engine.py`\n"
    assert map_paths(text) == {"runtime/worker.py", "app/", "runtime/reference/engine.py"}


def test_the_readme_maps_every_package_and_links_the_full_map():
    """README.md's short "Code map" names every package folder (`runtime/experts/`) and links
    docs/code-map.md, where every file is."""
    text = (ROOT / "README.md").read_text()
    start = text.index("## Code map")
    section = text[start:text.index("\n## ", start + 1)]
    packages = sorted(f"{p.parent.relative_to(ROOT)}/" for top in MAPPED for p in (ROOT / top).rglob("__init__.py"))
    missing = [p for p in packages if f"`{p}`" not in section]
    assert not missing, f"README.md's code map does not name the packages: {missing}"
    assert "(docs/code-map.md)" in section
