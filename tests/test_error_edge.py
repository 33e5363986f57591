"""The runtime raises domain exceptions (runtime/errors.py); the worker's edge alone gives them wire codes."""
import ast
import inspect
from pathlib import Path

import pytest

from runtime import errors as E
from runtime import protocol as P
from runtime.worker_errors import CODES, code_for, error_event

ROOT = Path(__file__).resolve().parent.parent
# The modules that may speak the wire: the worker's edge, the client side, the protocol itself.
PROTOCOL_USERS = {"runtime/protocol.py", "runtime/worker.py", "runtime/worker_errors.py", "runtime/client.py",
                  "runtime/chat_cli.py"}


def protocol_imports(path: Path, root: Path = ROOT) -> list[int]:
    """Lines of `path` that import runtime.protocol, at module level or inside a function."""
    package = path.relative_to(root).parent.parts
    lines = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            if any(a.name == "runtime.protocol" or a.name.startswith("runtime.protocol.") for a in node.names):
                lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:                       # relative: resolve against the file's package
                base = package[:len(package) - node.level + 1]
                module = ".".join([*base, module] if module else base)
            if module == "runtime.protocol" or (module == "runtime" and any(a.name == "protocol" for a in node.names)):
                lines.append(node.lineno)
    return lines


def test_only_the_edge_and_the_client_import_the_protocol():
    offenders = {}
    for path in sorted((ROOT / "runtime").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel not in PROTOCOL_USERS and protocol_imports(path):
            offenders[rel] = protocol_imports(path)
    assert offenders == {}, f"runtime modules importing runtime.protocol (raise runtime.errors instead): {offenders}"


def test_the_scan_sees_every_form_of_the_import(tmp_path):
    forms = ["import runtime.protocol", "from runtime import protocol as P", "from runtime.protocol import ErrorCode",
             "def f():\n    from runtime.protocol import Error\n", "from .protocol import Error",
             "from .. import protocol"]
    for i, text in enumerate(forms):
        where = tmp_path / "runtime" / ("sub" if ".." in text else "") / f"m{i}.py"
        where.parent.mkdir(parents=True, exist_ok=True)
        where.write_text(text + "\n")
        assert protocol_imports(where, tmp_path), text
    clean = tmp_path / "runtime" / "clean.py"
    clean.write_text("from runtime import options\nfrom runtime.errors import EngineError\n# runtime.protocol\n")
    assert protocol_imports(clean, tmp_path) == []


@pytest.mark.parametrize("exc, code", [
    (E.EngineError("a bug"), "internal"),
    (E.BadRequest("the prompt is empty"), "bad_field"),
    (E.NoModel("the engine was closed"), "no_model"),
    (E.Cancelled("x: rendering was cancelled"), "bad_field"),
    (E.CudaUnavailable("no GPU"), "cuda_unavailable"),
    (E.KernelBuildFailed("nvcc failed", "log"), "kernel_build_failed"),
    (E.OutOfMemory("no room", needed_bytes=2, free_bytes=1), "out_of_memory"),
    (E.ContextOverflow("too long", tokens=9, limit=8), "context_overflow"),
    (E.ModelNotFound("/m", "no such model folder"), "model_not_found"),
    (E.InvalidModel("/m/config.json", "missing"), "model_invalid"),
    (E.UnsupportedArchitecture("/m/config.json", "architecture 'X' is not supported"), "unsupported_architecture"),
    (E.TemplateError("/m/chat_template.jinja", "chat template is broken: x"), "model_invalid"),
    (E.TemplateRefused("/m/chat_template.jinja", "the chat template refused the messages: x"), "bad_field"),
])
def test_each_failure_has_its_wire_code_and_words(exc, code):
    event = error_event(exc, "r1")
    assert (event.code, event.message, event.detail, event.request_id) == (code, exc.message, exc.detail, "r1")
    assert P.decode_event(P.encode(event)) == event


def test_every_runtime_failure_class_has_a_deliberate_code():
    classes = {c for _, c in inspect.getmembers(E, inspect.isclass) if issubclass(c, E.EngineError)}
    # a class may inherit its code (TemplateError is an InvalidModel), but only from a class listed
    assert {c for c in classes if not any(b in CODES for b in c.__mro__)} == set()
    assert set(CODES) <= classes
    assert code_for(type("Unlisted", (E.BadRequest,), {})("x")) is P.ErrorCode.BAD_FIELD


def test_data_travels_with_the_failure():
    e = E.InvalidModel("/m/model.safetensors", "truncated")
    assert (e.file, e.problem, e.message) == ("/m/model.safetensors", "truncated", "/m/model.safetensors: truncated")
    oom = E.OutOfMemory("no room", needed_bytes=10, free_bytes=4)
    assert (oom.needed_bytes, oom.free_bytes) == (10, 4)
    over = E.ContextOverflow("too long", tokens=300, limit=256)
    assert (over.tokens, over.limit) == (300, 256)


def test_failures_that_are_not_the_runtimes_own():
    try:
        raise MemoryError()
    except MemoryError as e:
        event = error_event(e, "r")
    assert (event.code, event.message) == ("out_of_memory", "host memory ran out") and "MemoryError" in event.detail
    event = error_event(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert event.code == "out_of_memory" and event.message.startswith("RuntimeError: CUDA out of memory")
    event = error_event(KeyError("x"))
    assert (event.code, event.message, event.request_id) == ("internal", "KeyError: 'x'", None)
