"""The runtime's layout, read from its source with `ast` (nothing is imported): no benchmark or
diagnostic inside it, no import cycle among its modules, modules a reader can hold in mind."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RUNTIME = ROOT / "runtime"
MAX_LINES = 600


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def runtime_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(RUNTIME.rglob("*.py"))}


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


def import_graph() -> dict[str, set[str]]:
    """Runtime module -> the runtime modules it imports by name. A package's __init__ that runs
    because one of its modules is imported is not an edge: a package importing its own modules is
    the ordinary shape of a package, not a cycle."""
    mods = runtime_modules()
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


def test_no_import_cycle_among_runtime_modules():
    assert cycles(import_graph()) == []


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


def test_the_readmes_code_map_names_every_module():
    """README.md's "Code map" section names every module and script of runtime/, app/ and bench/ (by file
    name)."""
    text = (ROOT / "README.md").read_text()
    start = text.index("## Code map")
    section = text[start:text.index("\n## ", start + 1)]
    missing = []
    for top in ("runtime", "app", "bench"):
        for path in sorted([*(ROOT / top).rglob("*.py"), *(ROOT / top).rglob("*.sh")]):
            if path.name != "__init__.py" and "__pycache__" not in path.parts and f"`{path.name}`" not in section:
                missing.append(str(path.relative_to(ROOT)))
    assert not missing, f"README.md's code map does not name: {missing}"
