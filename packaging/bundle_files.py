"""Files the GPU bundle carries for Triton's first compile on a machine with no compiler or headers
(runtime/triton_cc.py): Python's headers where a frozen program's sysconfig looks for them, and Zig's C
compiler trimmed to what compiling for x86-64 Linux with glibc needs. Used by moedesk.spec; each
function returns PyInstaller (source, destination folder) pairs.
"""
from __future__ import annotations

import importlib.util
import os
import sys
import sysconfig
from pathlib import Path
from typing import Optional

# Zig's lib/ holds the C libraries and headers of every target it can build for; a compile for this
# platform needs its compiler_rt, std, include and the glibc/Linux headers. Left out (about 180 MB):
LIB_DROP = {"libcxx", "libcxxabi", "libtsan", "lldb", "docs", "build-web", "init"}
LIBC_DROP = {"darwin", "freebsd", "mingw", "musl", "netbsd", "openbsd", "wasi"}
LIBC_INCLUDE_KEEP = {"any-linux-any", "generic-glibc", "x86-linux-any", "x86-linux-gnu", "x86_64-linux-gnu"}


def python_headers(include: Optional[Path] = None) -> list[tuple[str, str]]:
    """Python's C headers (Python.h and its folders), for `include/pythonX.Y` inside the bundle: a
    frozen program's sysconfig names that folder under its own files."""
    include = Path(include or sysconfig.get_paths()["include"])
    if not (include / "Python.h").is_file():
        raise SystemExit(f"Python's headers are not at {include}: install the Python development package "
                         "of the Python that builds the bundle")
    dest_root = f"include/python{sys.version_info[0]}.{sys.version_info[1]}{getattr(sys, 'abiflags', '')}"
    out = []
    for folder, _, files in os.walk(include):
        rel = Path(folder).relative_to(include)
        out += [(str(Path(folder) / f), str(Path(dest_root) / rel)) for f in files if f.endswith(".h")]
    return out


def keep_zig_file(rel: Path) -> bool:
    """Whether a file of the ziglang package (path relative to it) goes into the bundle."""
    parts = rel.parts
    if not parts or parts[0] in ("__pycache__",) or rel.suffix in (".pyc",):
        return False
    if parts[0] != "lib" or len(parts) < 2:
        return True
    if parts[1] in LIB_DROP:
        return False
    if parts[1] == "libc" and len(parts) > 2:
        if parts[2] in LIBC_DROP:
            return False
        if parts[2] == "include" and len(parts) > 3 and parts[3] not in LIBC_INCLUDE_KEEP:
            return False
    return True


def zig_files(root: Optional[Path] = None) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(binaries, datas) of the installed ziglang package for `ziglang/` in the bundle; empty where it is
    not installed (the bundle then needs a system C compiler for Triton, and says so)."""
    if root is None:
        spec = importlib.util.find_spec("ziglang")
        if spec is None or not spec.submodule_search_locations:
            return [], []
        root = Path(list(spec.submodule_search_locations)[0])
    binaries, datas = [], []
    for folder, _, files in os.walk(root):
        for f in files:
            path = Path(folder) / f
            rel = path.relative_to(root)
            if not keep_zig_file(rel):
                continue
            dest = str(Path("ziglang") / rel.parent)
            (binaries if rel == Path("zig") or rel == Path("zig.exe") else datas).append((str(path), dest))
    return binaries, datas
