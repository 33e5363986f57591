"""A C compiler for Triton's launchers where the machine has none (runtime/triton_cc.py), and the GPU
bundle's files for it (packaging/bundle_files.py). On the H200 the GPU bundle, run with a fresh Triton
cache and no compiler on PATH, failed its first load with Triton's "Failed to find C compiler"."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from runtime import protocol as P
from runtime import triton_cc
from runtime.worker_errors import error_event

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "packaging"))
import bundle_files  # noqa: E402

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="Triton's compiler search is the Linux one")


def fake_zig(folder: Path) -> Path:
    """A stand-in `zig` that prints its arguments (the wrapper's contract is only to pass them on)."""
    folder.mkdir(parents=True, exist_ok=True)
    zig = folder / "zig"
    zig.write_text("#!/bin/sh\necho \"zig $*\"\n", encoding="utf-8")
    zig.chmod(0o755)
    return zig


def test_a_machine_compiler_is_left_to_triton(tmp_path):
    env = {}
    assert triton_cc.prepare(tmp_path, env, {"gcc": "/usr/bin/gcc"}.get, zig=fake_zig(tmp_path / "z")) == "/usr/bin/gcc"
    assert "CC" not in env and not (tmp_path / "triton-cc").exists()
    env = {"CC": "clang-19"}
    assert triton_cc.prepare(tmp_path, env, lambda n: None, zig=fake_zig(tmp_path / "z")) == "clang-19"
    assert env == {"CC": "clang-19"}


def test_without_a_compiler_cc_runs_the_shipped_zig_with_the_same_arguments(tmp_path):
    zig = fake_zig(tmp_path / "bundle dir" / "ziglang")              # a space in the path: quoted
    env = {}
    cc = triton_cc.prepare(tmp_path / "cache", env, lambda n: None, zig=zig)
    assert env["CC"] == cc == str(tmp_path / "cache" / "triton-cc" / "cc")
    out = subprocess.run([cc, "main.c", "-O3", "-shared", "-o", "x y.so"], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "zig cc main.c -O3 -shared -o x y.so"
    # a moved bundle: the wrapper names the new zig
    moved = fake_zig(tmp_path / "moved" / "ziglang")
    triton_cc.prepare(tmp_path / "cache", {}, lambda n: None, zig=moved)
    assert str(moved) in Path(cc).read_text(encoding="utf-8")


def test_no_compiler_and_no_zig_leaves_cc_unset_and_advice_names_a_package(tmp_path, monkeypatch):
    monkeypatch.setattr(triton_cc, "find_zig", lambda frozen_root=None: None)
    env = {}
    assert triton_cc.prepare(tmp_path, env, lambda n: None) is None and env == {}
    words = triton_cc.advice(env, lambda n: None, os_release='ID=ubuntu\nID_LIKE=debian\n')
    assert "C compiler" in words and "build-essential" in words
    assert triton_cc.advice(env, lambda n: None, zig=fake_zig(tmp_path / "z")) == ""     # a zig is a compiler


def test_find_zig_in_a_frozen_bundle(tmp_path):
    assert triton_cc.find_zig(frozen_root=tmp_path) is None
    zig = fake_zig(tmp_path / "ziglang")
    assert triton_cc.find_zig(frozen_root=tmp_path) == zig


def test_missing_python_headers_are_named(tmp_path):
    assert "Python.h" in triton_cc.headers_advice(tmp_path)
    (tmp_path / "Python.h").write_text("", encoding="utf-8")
    assert triton_cc.headers_advice(tmp_path) == ""
    assert "headers" in triton_cc.advice({"CC": "gcc"}, lambda n: None, headers=tmp_path / "nowhere")


def test_tritons_launcher_failures_reach_the_user_as_kernel_build_failed():
    ev = error_event(RuntimeError("Failed to find C compiler. Please specify via CC environment variable or set "
                                  "triton.knobs.build.impl."))
    assert ev.code == P.ErrorCode.KERNEL_BUILD_FAILED.value and "C compiler" in ev.message
    ev = error_event(subprocess.CalledProcessError(1, ["/usr/bin/gcc", "/tmp/x/main.c", "-O3", "-shared", "-fPIC",
                                                       "-o", "/tmp/x/launcher.so", "-lcuda"]))
    assert ev.code == P.ErrorCode.KERNEL_BUILD_FAILED.value and "gcc" in ev.message and "-lcuda" in ev.detail
    assert error_event(subprocess.CalledProcessError(1, ["git", "status"])).code == P.ErrorCode.INTERNAL.value
    assert error_event(RuntimeError("something else")).code == P.ErrorCode.INTERNAL.value


def test_the_bundle_ships_pythons_headers_where_frozen_sysconfig_looks(tmp_path):
    (tmp_path / "cpython").mkdir()
    for name in ("Python.h", "pyconfig.h", "cpython/object.h"):
        (tmp_path / name).write_text("", encoding="utf-8")
    (tmp_path / "README").write_text("", encoding="utf-8")
    got = sorted(bundle_files.python_headers(tmp_path))
    root = f"include/python{sys.version_info[0]}.{sys.version_info[1]}{getattr(sys, 'abiflags', '')}"
    assert [(Path(s).name, d) for s, d in got] == [("Python.h", root), ("object.h", f"{root}/cpython"),
                                                   ("pyconfig.h", root)]
    with pytest.raises(SystemExit, match="Python's headers"):
        bundle_files.python_headers(tmp_path / "cpython")


def test_the_bundled_zig_keeps_this_platforms_c_pieces_only(tmp_path):
    keep = ["zig", "__init__.py", "lib/std/std.zig", "lib/compiler_rt/x.zig", "lib/include/stddef.h",
            "lib/libc/glibc/abilists", "lib/libc/include/generic-glibc/stdio.h", "lib/libc/include/x86-linux-gnu/a.h",
            "lib/libc/include/any-linux-any/linux/types.h", "lib/zig.h"]
    drop = ["lib/libcxx/include/vector", "lib/libc/mingw/crt.c", "lib/libc/include/aarch64-linux-gnu/a.h",
            "lib/libc/musl/src/x.c", "lib/libtsan/t.cpp", "__pycache__/__init__.cpython-311.pyc"]
    for rel in keep + drop:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("", encoding="utf-8")
    binaries, datas = bundle_files.zig_files(tmp_path)
    assert binaries == [(str(tmp_path / "zig"), "ziglang")]
    shipped = {str(Path(s).relative_to(tmp_path)) for s, _ in datas}
    assert shipped == set(keep) - {"zig"}
    assert all(d == str(Path("ziglang") / Path(s).relative_to(tmp_path).parent) for s, d in datas)
