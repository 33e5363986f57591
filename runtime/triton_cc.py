"""A C compiler for Triton's launchers, where the machine has none.

Triton (the GPU engine's MoE, router and attention kernels) compiles two small C extension modules at
first use on a machine: its CUDA utilities and, per kernel signature, a launcher. It runs `$CC`, else
gcc, else clang, with Python's headers (sysconfig's include folder) on the include path, and caches the
result. A desktop user with only an NVIDIA driver has no compiler; the GPU bundle and the `gpu` extra
ship Zig's C compiler (the `ziglang` package: clang and the C libraries' headers in one download), and
`prepare` points CC at it where nothing else would be found. The GPU bundle ships Python's headers in
the folder a frozen program's sysconfig names.

Nothing here imports torch or Triton.
"""
from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Callable, MutableMapping, Optional

from runtime import tuning
from runtime.errors import KernelBuildFailed

IS_WINDOWS = sys.platform == "win32"
Which = Callable[[str], Optional[str]]


def system_compiler(env: Optional[MutableMapping[str, str]] = None, which: Which = shutil.which) -> Optional[str]:
    """The compiler Triton would find by itself: CC, else gcc, else clang (None: none)."""
    env = tuning.environment() if env is None else env
    if env.get("CC"):
        return env["CC"]
    return which("gcc") or which("clang")


def find_zig(frozen_root: Optional[Path] = None) -> Optional[Path]:
    """Zig's executable: the GPU bundle's (`ziglang/zig` beside the frozen program's files), else the
    installed `ziglang` package's."""
    if frozen_root is None and getattr(sys, "frozen", False):
        frozen_root = Path(getattr(sys, "_MEIPASS", Path(sys.executable).parent))
    candidates = []
    if frozen_root is not None:
        candidates.append(Path(frozen_root) / "ziglang")
    spec = importlib.util.find_spec("ziglang") if frozen_root is None else None
    if spec is not None and spec.submodule_search_locations:
        candidates += [Path(p) for p in spec.submodule_search_locations]
    for folder in candidates:
        exe = folder / ("zig.exe" if IS_WINDOWS else "zig")
        if exe.is_file() and os.access(exe, os.X_OK):
            return exe
    return None


def write_wrapper(zig: Path, folder: Path) -> Path:
    """`folder/cc`: a one-line script running `zig cc` with its arguments (Triton takes CC as one
    program, not a command line). Rewritten only when it names another zig (the bundle moved)."""
    folder.mkdir(parents=True, exist_ok=True)
    wrapper = folder / "cc"
    text = f"#!/bin/sh\nexec {shlex.quote(str(zig))} cc \"$@\"\n"
    try:
        if wrapper.read_text(encoding="utf-8") == text and os.access(wrapper, os.X_OK):
            return wrapper
    except OSError:
        pass
    tmp = folder / f".cc.{os.getpid()}"
    tmp.write_text(text, encoding="utf-8")
    tmp.chmod(0o755)
    os.replace(tmp, wrapper)
    return wrapper


def prepare(cache_dir: Path, env: Optional[MutableMapping[str, str]] = None, which: Which = shutil.which,
            zig: Optional[Path] = None) -> Optional[str]:
    """Before Triton's first compile in this process: where it would find no compiler and a Zig is at
    hand, CC names a wrapper (in `cache_dir`) that runs `zig cc`. Returns the compiler Triton will use
    (None: none, `advice` says what to install). Windows: Triton's own build carries its compiler."""
    if IS_WINDOWS:
        return None
    env = env if env is not None else tuning.environment()   # the process's own: CC is written there
    found = system_compiler(env, which)
    if found:
        return found
    zig = zig or find_zig()
    if zig is None:
        return None
    wrapper = write_wrapper(zig, cache_dir / "triton-cc")
    env["CC"] = str(wrapper)
    return str(wrapper)


def python_headers() -> Path:
    """Where Triton looks for Python.h: sysconfig's include folder, in the scheme Triton asks for."""
    scheme = sysconfig.get_default_scheme()
    if scheme == "posix_local":
        scheme = "posix_prefix"
    return Path(sysconfig.get_paths(scheme=scheme)["include"])


def headers_advice(headers: Optional[Path] = None) -> str:
    """What to do where Python's headers are missing (empty where Python.h is there)."""
    headers = headers or python_headers()
    if (headers / "Python.h").is_file():
        return ""
    if getattr(sys, "frozen", False):
        return ("This MoE Desk bundle lacks Python's headers (include/ in its folder), which the GPU kernels' "
                "first build needs: download the bundle again, or report it.")
    return (f"Python's headers are missing ({headers / 'Python.h'}): install your distribution's Python "
            f"development package (e.g. `sudo apt install python{sys.version_info[0]}.{sys.version_info[1]}-dev`).")


def advice(env: Optional[MutableMapping[str, str]] = None, which: Which = shutil.which,
           zig: Optional[Path] = None, headers: Optional[Path] = None, os_release: Optional[str] = None) -> str:
    """What a user must install before Triton's first compile can run here (empty: nothing).
    os_release: /etc/os-release's text (default: read), which names the compiler package."""
    if IS_WINDOWS:
        return ""
    parts = []
    if not system_compiler(env, which) and (zig or find_zig()) is None:
        parts.append("Triton, which runs the GPU engine's MoE kernels, needs a C compiler at first use. "
                     + compiler_advice(os_release))
    missing = headers_advice(headers)
    if missing:
        parts.append(missing)
    return " ".join(p.strip() for p in parts)


def launcher_failure(exc: BaseException) -> Optional[KernelBuildFailed]:
    """Triton's failure to compile its launcher, in words (None: `exc` is something else)."""
    text = str(exc)
    if isinstance(exc, RuntimeError) and "Failed to find C compiler" in text:
        return KernelBuildFailed("The GPU engine's kernels need a C compiler at their first use, and none was "
                                 "found. " + compiler_advice(), text)
    cmd = getattr(exc, "cmd", None)
    if isinstance(exc, subprocess.CalledProcessError) and isinstance(cmd, (list, tuple)) and "-shared" in cmd \
            and any(str(a).endswith(".c") for a in cmd):
        more = headers_advice()
        return KernelBuildFailed(f"The GPU engine's kernels could not be prepared: Triton's launcher did not "
                                 f"compile with {Path(str(cmd[0])).name}. " + (more or "See the details."),
                                 " ".join(str(a) for a in cmd))
    return None


# Distribution family (os-release ID / ID_LIKE) -> the package and command that install a C++ compiler.
COMPILER_PACKAGES = (
    (("debian", "ubuntu"), "build-essential", "sudo apt install build-essential"),
    (("fedora", "rhel", "centos"), "gcc-c++", "sudo dnf install gcc-c++"),
    (("opensuse", "suse"), "gcc-c++", "sudo zypper install gcc-c++"),
    (("arch",), "base-devel", "sudo pacman -S --needed base-devel"),
    (("alpine",), "build-base", "sudo apk add build-base"),
)


def compiler_advice(os_release: Optional[str] = None) -> str:
    """What to install for a C++ compiler on this distribution (from /etc/os-release's text)."""
    if IS_WINDOWS:
        return ("Install Visual Studio Build Tools with \"Desktop development with C++\", "
                "then start MoE Desk again.")
    if os_release is None:
        try:
            os_release = Path("/etc/os-release").read_text(encoding="utf-8")
        except OSError:
            os_release = ""
    fields = dict(re.findall(r'^(\w+)=["\']?([^"\'\n]*)', os_release, re.M))
    ids = [fields.get("ID", "")] + fields.get("ID_LIKE", "").split()
    for family, package, command in COMPILER_PACKAGES:
        if any(i.startswith(f) for i in ids for f in family if i):
            return f"Install a C++ compiler (package {package}: `{command}`), then start MoE Desk again."
    return "Install a C++ compiler (g++ from your distribution's packages), then start MoE Desk again."
