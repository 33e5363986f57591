"""GPU setup: find a CUDA toolchain, build exllamav2's CUDA extension once, keep it in the user cache.

exllamav2 from PyPI compiles its extension (`exllamav2_ext`) at first import through
torch.utils.cpp_extension, which needs CUDA_HOME (nvcc, the CUDA headers, libcudart), ninja and a C++
compiler. A built `exllamav2_ext` module found on sys.path is imported instead. This module

- finds a toolchain: a system CUDA toolkit (CUDA_HOME / CUDA_PATH, nvcc on PATH, /usr/local/cuda) of
  torch's CUDA major version, else NVIDIA's PyPI wheels (`pip install moedesk[gpu]`: nvcc, crt, cccl and
  nvvm of `cuda-toolkit`, in site-packages as nvidia/cu13/... or nvidia/cuda_nvcc/...), for which it
  assembles a CUDA_HOME of links (bin, include, nvvm, lib64 with the unversioned libcudart.so);
- builds once, per cache key (exllamav2 version, torch version, CUDA version, GPU architectures), into
  <user cache>/kernels/<key>/ (torch's TORCH_EXTENSIONS_DIR), in a child process whose ninja `[n/m]`
  lines are the progress; a failure leaves failed.log there with the compiler's last lines;
- before the worker imports exllamav2 (`prepare_import`), puts the cached module on sys.path, or, when
  there is none, points exllamav2's own JIT build at the toolchain and the cache (the fallback).

Torch-free except inside the child (`_child`): the GUI imports it to decide what the welcome screen says.
`moedesk-cli setup-gpu` (runtime/setup_gpu.py) is its command line.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping, Optional, Sequence

from runtime import paths
from runtime import triton_cc
from runtime import tuning
from runtime.triton_cc import COMPILER_PACKAGES, compiler_advice  # noqa: F401  (the build's advice too)

EXT = "exllamav2_ext"
TAIL_LINES = 25                              # compiler lines kept with a failure
BUNDLE_ARCH_LIST = "8.0;8.6;8.9;9.0;12.0"    # the GPU bundle's prebuilt architectures (Ampere..Blackwell)
IS_WINDOWS = os.name == "nt"
WINDOWS_TOOLKIT = ("On Windows the kernels are built with the CUDA toolkit of PyTorch's CUDA version (its installer "
                   "sets CUDA_PATH) and Visual Studio Build Tools; or use the GPU installer, which ships them built.")
NVCC = "nvcc.exe" if IS_WINDOWS else "nvcc"


class KernelBuildError(RuntimeError):
    """The extension did not build. `message` says what to do; `detail` holds the compiler's last lines."""

    def __init__(self, message: str, detail: str = ""):
        super().__init__(message)
        self.message = message
        self.detail = detail


# ---------------------------------------------------------------- what is installed (no torch import)

@dataclass(frozen=True)
class TorchInfo:
    version: str
    cuda: Optional[str]          # torch.version.cuda: "13.0", or None for the CPU build

    @property
    def cuda_major(self) -> Optional[int]:
        return int(self.cuda.split(".")[0]) if self.cuda else None


def torch_info(package_dir: Optional[Path] = None) -> Optional[TorchInfo]:
    """torch's version and CUDA version, read from torch/version.py without importing torch."""
    if package_dir is None:
        spec = importlib.util.find_spec("torch")
        if spec is None or not spec.submodule_search_locations:
            return None
        package_dir = Path(list(spec.submodule_search_locations)[0])
    try:
        text = (package_dir / "version.py").read_text(encoding="utf-8")
    except OSError:
        return None

    def field(name: str) -> Optional[str]:
        m = re.search(rf"^{name}\s*(?::[^=\n]+)?=\s*(?:'([^']*)'|\"([^\"]*)\"|None)", text, re.M)
        return (m.group(1) or m.group(2)) if m and (m.group(1) or m.group(2)) else None

    version = field("__version__")
    return TorchInfo(version, field("cuda")) if version else None


def package_version(name: str) -> Optional[str]:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def gpu_archs() -> list[str]:
    """Compute capabilities ("8.6", ...) of the NVIDIA GPUs: through torch where the worker has it
    imported, else NVML (the GUI, the CLI), else nvidia-smi. Empty without a GPU or driver."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        caps = {torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
        return sorted(f"{a}.{b}" for a, b in caps)
    try:
        import pynvml
        pynvml.nvmlInit()
    except Exception:
        return smi_archs()
    try:
        caps = {pynvml.nvmlDeviceGetCudaComputeCapability(pynvml.nvmlDeviceGetHandleByIndex(i))
                for i in range(pynvml.nvmlDeviceGetCount())}
        return sorted(f"{a}.{b}" for a, b in caps)
    finally:
        pynvml.nvmlShutdown()


def smi_archs() -> list[str]:
    """Compute capabilities from `nvidia-smi` (where NVML's Python binding is missing)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return sorted({line.strip() for line in out.splitlines() if re.fullmatch(r"\d+\.\d+", line.strip())})


def nvidia_driver_present(proc: Path = Path("/proc/driver/nvidia/version")) -> bool:
    """An NVIDIA driver is installed (what `make run` asks before installing the GPU dependencies)."""
    return proc.exists() or shutil.which("nvidia-smi") is not None


# ---------------------------------------------------------------- toolchain

@dataclass(frozen=True)
class Toolchain:
    kind: str                    # "system" (a CUDA toolkit) or "wheels" (NVIDIA's PyPI packages)
    home: Path                   # the system toolkit, or the wheels' folder(s): see cuda_home()
    version: Optional[str]       # "13.0.88"
    roots: tuple[Path, ...] = ()  # wheels only: folders holding bin/, include/, lib/, nvvm/

    @property
    def major(self) -> Optional[int]:
        return int(self.version.split(".")[0]) if self.version else None

    def describe(self) -> str:
        what = "CUDA toolkit" if self.kind == "system" else "CUDA compiler from NVIDIA's Python packages"
        return f"{what} {self.version or '(version unknown)'} at {self.home}"


def system_toolkits(env: Mapping[str, str] = tuning.environment(), which: Callable[[str], Optional[str]] = shutil.which,
                    default: Path = Path("/usr/local/cuda")) -> list[Path]:
    """Toolkit folders with bin/nvcc, in torch's order of preference: CUDA_HOME, CUDA_PATH, nvcc on PATH,
    the default install folder."""
    found: list[Path] = []
    nvcc = which("nvcc")
    for cand in (env.get("CUDA_HOME"), env.get("CUDA_PATH"),
                 str(Path(nvcc).resolve().parent.parent) if nvcc else None, str(default)):
        if cand and (Path(cand) / "bin" / NVCC).is_file() and Path(cand) not in found:
            found.append(Path(cand))
    return found


def toolkit_version(home: Path) -> Optional[str]:
    """A toolkit's CUDA version: version.json (CUDA 11.1+), else `nvcc --version`."""
    try:
        return json.loads((home / "version.json").read_text(encoding="utf-8"))["cuda"]["version"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    try:
        out = subprocess.run([str(home / "bin" / NVCC), "--version"], capture_output=True, text=True,
                             timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"release [\d.]+, V([\d.]+)", out)
    return m.group(1) if m else None


def wheel_toolchain(search: Iterable[str] = tuple(sys.path)) -> Optional[Toolchain]:
    """NVIDIA's PyPI toolchain in an import folder: CUDA 13's packages share nvidia/cu13/; CUDA 12's have
    one folder each (nvidia/cuda_nvcc/, nvidia/cuda_runtime/, nvidia/cublas/, ...)."""
    folders = [Path(entry or ".") / "nvidia" for entry in search]
    for nv in folders:
        if not nv.is_dir():
            continue
        for sub in sorted(nv.glob("cu[0-9]*"), reverse=True):               # nvidia/cu13
            if (sub / "bin" / NVCC).is_file():
                version = package_version("nvidia-cuda-nvcc") or f"{sub.name[2:]}.0"
                # the same tree in other import folders (torch's runtime wheels) adds headers and libraries
                more = tuple(o / sub.name for o in folders if o != nv and (o / sub.name).is_dir())
                return Toolchain("wheels", sub, version, (sub, *more))
        if (nv / "cuda_nvcc" / "bin" / NVCC).is_file():                      # CUDA 12 naming
            others = sorted(p for p in nv.iterdir() if p.is_dir() and p.name != "cuda_nvcc"
                            and ((p / "include").is_dir() or (p / "lib").is_dir()))
            version = package_version("nvidia-cuda-nvcc-cu12") or "12.0"
            return Toolchain("wheels", nv, version, (nv / "cuda_nvcc", *others))
    return None


@dataclass(frozen=True)
class ToolchainChoice:
    toolchain: Optional[Toolchain]
    note: str = ""               # why nothing (or something unexpected) was chosen


def choose_toolchain(cuda_major: Optional[int], systems: Sequence[Toolchain],
                     wheels: Optional[Toolchain]) -> ToolchainChoice:
    """A system toolkit of torch's CUDA major version, else the wheels of that version. torch refuses
    to build with another major version, so a mismatched toolkit is named, not used."""
    for tc in systems:
        if tc.major == cuda_major:
            return ToolchainChoice(tc)
    if wheels is not None and wheels.major == cuda_major:
        return ToolchainChoice(wheels)
    others = [tc.describe() for tc in (*systems, *([wheels] if wheels else []))]
    note = (f"Found {'; '.join(others)}, but this PyTorch was built with CUDA {cuda_major}."
            if others else "No CUDA compiler (nvcc) found.")
    return ToolchainChoice(None, note)


def find_toolchain(torch: Optional[TorchInfo] = None) -> ToolchainChoice:
    """MOEDESK_CUDA_TOOLCHAIN=wheels (or =system) leaves the other kind out."""
    torch = torch or torch_info()
    only = tuning.cuda_toolchain()
    systems = [] if only == "wheels" else [Toolchain("system", h, toolkit_version(h)) for h in system_toolkits()]
    wheels = None if only == "system" or IS_WINDOWS else wheel_toolchain()   # Windows: a toolkit only, for now
    return choose_toolchain(torch.cuda_major if torch else None, systems, wheels)


def assemble_cuda_home(tc: Toolchain, dest: Path) -> Path:
    """The CUDA_HOME torch's build needs, for a toolchain: a system toolkit is one already; for the wheels,
    `dest` gets bin/, include/, nvvm/ and lib64/ merged from the wheels' folders as links (first wins),
    plus lib64/libcudart.so, the unversioned name the linker's -lcudart looks for."""
    if tc.kind == "system":
        return tc.home
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    for sub, target in (("bin", "bin"), ("include", "include"), ("nvvm", "nvvm"), ("lib", "lib64")):
        out = tmp / target
        out.mkdir(parents=True, exist_ok=True)
        for root in tc.roots:
            if (root / sub).is_dir():
                for item in sorted((root / sub).iterdir()):
                    if not (out / item.name).exists():
                        (out / item.name).symlink_to(item.resolve())
    lib = tmp / "lib64"
    if not (lib / "libcudart.so").exists():
        versioned = sorted(lib.glob("libcudart.so.*"))
        if versioned:
            (lib / "libcudart.so").symlink_to(versioned[0].resolve())
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return dest


def missing_pieces(cuda_home: Path) -> list[str]:
    """What torch's build looks for and this CUDA_HOME lacks (each a path relative to it)."""
    need = [f"bin/{NVCC}", "include/cuda_runtime.h"]
    if not IS_WINDOWS:
        need.append("lib64/libcudart.so" if (cuda_home / "lib64").is_dir() else "lib/libcudart.so")
    return [n for n in need if not (cuda_home / n).exists()]


def ninja_dir() -> Optional[Path]:
    """The folder of a ninja executable: on PATH, or PyPI's `ninja` package (its script is not on PATH when
    the venv's Python runs without the venv being activated)."""
    found = shutil.which("ninja")
    if found:
        return Path(found).parent
    try:
        import ninja
    except ImportError:
        return None
    return Path(ninja.BIN_DIR) if getattr(ninja, "BIN_DIR", "") else None      # "" where it found none


def find_compiler(env: Mapping[str, str] = tuning.environment(),
                  which: Callable[[str], Optional[str]] = shutil.which) -> Optional[str]:
    """The C++ compiler torch's builds run: CXX, else `c++` (`cl` on Windows)."""
    return which(env.get("CXX") or ("cl" if IS_WINDOWS else "c++"))


def triton_advice(env: Mapping[str, str] = tuning.environment(),
                  which: Callable[[str], Optional[str]] = shutil.which) -> str:
    """Triton (the GPU engine's MoE and attention kernels) compiles a small C launcher at first use with
    CC, gcc, clang or a shipped Zig (runtime/triton_cc.py), against Python's headers: what to install
    where that cannot run (empty when it can)."""
    return triton_cc.advice(dict(env), which)


# ---------------------------------------------------------------- the cache

def arch_list(archs: Sequence[str]) -> str:
    """TORCH_CUDA_ARCH_LIST for these compute capabilities."""
    return ";".join(sorted(set(archs), key=lambda a: tuple(int(x) for x in a.split("."))))


def cache_key(exl2_version: str, torch: TorchInfo, archs: Sequence[str]) -> str:
    """One build per (exllamav2, torch, CUDA, architectures): a folder name."""
    sms = "-".join("sm" + a.replace(".", "") for a in arch_list(archs).split(";"))
    return f"exllamav2-{exl2_version}_torch-{torch.version}_cu{(torch.cuda or 'none').replace('.', '')}_{sms}"


def kernels_root() -> Path:
    return paths.cache_dir() / "kernels"


def built_module(build_dir: Path) -> Optional[Path]:
    """The built extension module in a build folder (<key>/exllamav2_ext/exllamav2_ext.so), if any."""
    ext_dir = build_dir / EXT
    hits = sorted(ext_dir.glob(f"{EXT}*.pyd" if IS_WINDOWS else f"{EXT}*.so")) if ext_dir.is_dir() else []
    return hits[0] if hits else None


def build_running(build_dir: Path) -> bool:
    """A build of this key is running now: building.pid names a live process, and that process is a build
    child (`-m runtime.gpu_setup --child`). A file left by a build whose parent was stopped may name, after
    a restart, another program that got the number: that one is not building."""
    try:
        pid = int((build_dir / "building.pid").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    import psutil
    try:
        command = psutil.Process(pid).cmdline()
    except (psutil.Error, OSError):                 # gone, or another user's
        return False
    return "runtime.gpu_setup" in command and "--child" in command


def prebuilt_importable() -> bool:
    """exllamav2_ext is importable as it is (a prebuilt wheel, or the GPU bundle's copy)."""
    return importlib.util.find_spec(EXT) is not None


@dataclass(frozen=True)
class KernelStatus:
    """What the GPU engine's kernels need on this machine: `state` is one of
    prebuilt | cached | building | buildable | failed | no_gpu | cpu_torch | no_exllamav2 | no_toolchain |
    no_compiler | no_ninja."""
    state: str
    title: str
    advice: str = ""
    build_dir: Optional[Path] = None
    toolchain: Optional[Toolchain] = None
    log_tail: str = ""

    @property
    def ready(self) -> bool:
        return self.state in ("prebuilt", "cached")


def kernel_status(archs: Optional[Sequence[str]] = None) -> KernelStatus:
    """Decide, without building or importing torch, where the GPU kernels stand."""
    archs = gpu_archs() if archs is None else list(archs)
    if not archs:
        return KernelStatus("no_gpu", "No NVIDIA GPU: the GPU kernels are not needed.")
    if prebuilt_importable():
        return KernelStatus("prebuilt", "GPU kernels: prebuilt, nothing to build.", triton_advice())
    torch, exl2 = torch_info(), package_version("exllamav2")
    if torch is None or torch.cuda is None:
        return KernelStatus("cpu_torch", "This install has the CPU build of PyTorch.",
                            "The GPU engine needs PyTorch's CUDA build (the default on Linux: "
                            "`pip install --force-reinstall torch`).")
    if exl2 is None:
        return KernelStatus("no_exllamav2", "exllamav2 is not installed.", "Install MoE Desk again: pip install moedesk.")
    build_dir = kernels_root() / cache_key(exl2, torch, archs)
    if built_module(build_dir):
        return KernelStatus("cached", "GPU kernels: built for this GPU.", triton_advice(), build_dir)
    choice = find_toolchain(torch)
    if build_running(build_dir):
        return KernelStatus("building", "GPU kernels: being built now, one time.",
                            "MoE Desk runs on the CPU until they are ready.", build_dir, choice.toolchain)
    failed = build_dir / "failed.log"
    if failed.is_file():
        tail = "\n".join(failed.read_text(encoding="utf-8", errors="replace").splitlines()[-TAIL_LINES:])
        return KernelStatus("failed", "Building the GPU kernels failed last time; MoE Desk works on the CPU.",
                            failure_advice(tail, choice.toolchain),
                            build_dir, choice.toolchain, tail)
    if choice.toolchain is None:
        return KernelStatus("no_toolchain", choice.note, WINDOWS_TOOLKIT if IS_WINDOWS else
                            "Install MoE Desk's GPU dependencies (no CUDA toolkit needed): "
                            "pip install 'moedesk[gpu]', or run `make run` from a checkout.", build_dir)
    if not IS_WINDOWS and find_compiler() is None:          # exllamav2 finds Visual Studio's cl.exe itself
        return KernelStatus("no_compiler", "No C++ compiler found: the GPU kernels cannot be built.",
                            compiler_advice(), build_dir, choice.toolchain)
    if ninja_dir() is None:
        return KernelStatus("no_ninja", "ninja (the build tool) is missing.", "pip install ninja", build_dir,
                            choice.toolchain)
    return KernelStatus("buildable", f"GPU kernels: built once on this machine with the {choice.toolchain.describe()}.",
                        "No CUDA toolkit needed." if choice.toolchain.kind == "wheels" else "",
                        build_dir, choice.toolchain)


# ---------------------------------------------------------------- the build

PROGRESS = re.compile(r"^\[(\d+)/(\d+)\]")


def parse_progress(line: str) -> Optional[tuple[int, int]]:
    """ninja's `[done/total] command` line as (done, total)."""
    m = PROGRESS.match(line)
    return (int(m.group(1)), int(m.group(2))) if m else None


def failure_advice(log_tail: str, toolchain: Optional[Toolchain]) -> str:
    """What to do about a failed build, from the compiler's last lines."""
    low = log_tail.lower()
    if "unsupported gnu version" in low or "unsupported host compiler" in low:
        return ("Your C++ compiler is newer than this CUDA compiler supports: install an older gcc and name "
                "it in CC (e.g. CC=/usr/bin/gcc-13: torch hands it to nvcc as -ccbin), then run `moedesk-cli setup-gpu`.")
    if re.search(r"(?:^|[\s/])(?:c\+\+|g\+\+|gcc|cl)(?:\.exe)?: (?:command )?not found", low, re.M) or \
            "failed to preprocess host compiler properties" in low:
        return compiler_advice()
    if toolchain is None:
        return "Install MoE Desk's GPU dependencies: pip install 'moedesk[gpu]'."
    return (f"It used the {toolchain.describe()}. Check the lines below; `moedesk-cli setup-gpu` "
            "tries again and prints the whole log.")


def failure_message(lines: Sequence[str], toolchain: Optional[Toolchain]) -> KernelBuildError:
    tail = "\n".join([l for l in lines if l.strip()][-TAIL_LINES:])
    return KernelBuildError("Could not build the GPU kernels (exllamav2's CUDA extension). "
                            + failure_advice(tail, toolchain), tail)


def cuda_home_for(tc: Toolchain) -> Path:
    """The toolchain's CUDA_HOME: the system toolkit, or the wheels' links under the kernel cache."""
    return assemble_cuda_home(tc, kernels_root() / f"cuda-home-{tc.version}")


def nvcc_archs(home: Path) -> set[str]:
    """The architectures this nvcc compiles for ("8.0", "12.0", ...), from `nvcc --list-gpu-arch`."""
    try:
        out = subprocess.run([str(home / "bin" / NVCC), "--list-gpu-arch"], capture_output=True, text=True,
                             timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return set()
    return {f"{int(m) // 10}.{int(m) % 10}" for m in re.findall(r"^compute_(\d+)$", out, re.M)}


def build_environment(home: Path, build_dir: Path, archs: Sequence[str],
                      base: Mapping[str, str] = tuning.environment()) -> dict[str, str]:
    """The environment of a build (or of exllamav2's own JIT build): CUDA_HOME, ninja on PATH, the cache as
    TORCH_EXTENSIONS_DIR, the architectures."""
    env = dict(base)
    env["CUDA_HOME"] = str(home)
    env.pop("CUDA_PATH", None)
    extra = [str(home / "bin")] + ([str(ninja_dir())] if ninja_dir() else [])
    env["PATH"] = os.pathsep.join(extra + [env.get("PATH", "")])
    env["TORCH_EXTENSIONS_DIR"] = str(build_dir)
    env["TORCH_CUDA_ARCH_LIST"] = arch_list(archs)
    return env


ProgressFn = Callable[[int, int, str], None]


def build(progress: ProgressFn = lambda done, total, line: None, archs: Optional[Sequence[str]] = None,
          echo: Callable[[str], None] = lambda line: None) -> tuple[Path, float]:
    """Build the extension for `archs` (default: this machine's GPUs) into the cache; returns the module's
    path and the seconds it took. Raises KernelBuildError with what to do and the compiler's last lines."""
    archs = list(archs) if archs else gpu_archs()
    torch, exl2 = torch_info(), package_version("exllamav2")
    if not archs:
        raise KernelBuildError("No NVIDIA GPU found; give the architectures to build for (--arch-list).")
    if torch is None or torch.cuda is None or exl2 is None:
        raise KernelBuildError("The GPU build needs PyTorch's CUDA build and exllamav2 installed.")
    if getattr(sys, "frozen", False):
        raise KernelBuildError("This bundle cannot build GPU kernels; the GPU bundle ships them prebuilt.")
    cached = built_module(kernels_root() / cache_key(exl2, torch, archs))
    if cached is not None:                      # built before for exactly these: nothing to compile
        return cached, 0.0
    choice = find_toolchain(torch)
    if choice.toolchain is None:
        raise KernelBuildError(choice.note + " Install MoE Desk's GPU dependencies: pip install 'moedesk[gpu]'.")
    if not IS_WINDOWS and find_compiler() is None:
        raise KernelBuildError("No C++ compiler found. " + compiler_advice())
    home = cuda_home_for(choice.toolchain)
    lacking = missing_pieces(home)
    if lacking:
        raise KernelBuildError(f"The {choice.toolchain.describe()} lacks {', '.join(lacking)}: "
                               "install the complete GPU dependencies: pip install 'moedesk[gpu]'.")
    supported = nvcc_archs(home)
    if supported and any(a not in supported for a in archs):
        echo(f"Left out (this nvcc cannot compile for them): {', '.join(a for a in archs if a not in supported)}")
        archs = [a for a in archs if a in supported]
        if not archs:
            raise KernelBuildError(f"This nvcc compiles for {arch_list(supported)} only.")
    build_dir = kernels_root() / cache_key(exl2, torch, archs)
    build_dir.mkdir(parents=True, exist_ok=True)
    env = build_environment(home, build_dir, archs)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parent.parent)]
                                        + [p for p in [env.get("PYTHONPATH")] if p])
    echo(f"Building exllamav2's CUDA extension for {env['TORCH_CUDA_ARCH_LIST']} "
         f"with the {choice.toolchain.describe()} into {build_dir}")
    t0 = time.perf_counter()
    lines: list[str] = []
    log = build_dir / "build.log"
    with open(log, "w", encoding="utf-8") as out:
        proc = subprocess.Popen([sys.executable, "-m", "runtime.gpu_setup", "--child", str(build_dir / EXT)], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                encoding="utf-8", errors="replace")
        (build_dir / "building.pid").write_text(str(proc.pid), encoding="utf-8")
        for line in proc.stdout:
            line = line.rstrip("\n")
            out.write(line + "\n")
            lines.append(line)
            del lines[:-200]
            echo(line)
            step = parse_progress(line)
            if step:
                progress(step[0], step[1], line)
        code = proc.wait()
        (build_dir / "building.pid").unlink(missing_ok=True)
    module = built_module(build_dir)
    if code != 0 or module is None:
        shutil.copyfile(log, build_dir / "failed.log")
        raise failure_message(lines, choice.toolchain)
    (build_dir / "failed.log").unlink(missing_ok=True)
    return module, time.perf_counter() - t0


def _child(folder: Path) -> int:
    """In the build's own process: exllamav2's JIT build in `folder` (its build lock held: a stopped
    earlier build's baton is no wait), with torch's verbose output (ninja's lines)."""
    import torch.utils.cpp_extension as cpp_extension

    from runtime.build_lock import one_build
    load = cpp_extension.load

    def verbose_load(*args, **kwargs):
        kwargs["verbose"] = True
        return load(*args, **kwargs)

    cpp_extension.load = verbose_load        # exllamav2.ext calls it at import, with verbose=False
    try:
        with one_build(folder):          # a dead build's baton removed is said once, by one_build's warning
            import exllamav2.ext
    except Exception as e:       # the compiler's output is above; a traceback would push it out of the tail
        last = [line for line in str(e).splitlines() if line.strip()][-1:] or [""]
        print(f"error: {type(e).__name__}: {last[0]}", flush=True)
        return 1
    print(f"built: {exllamav2.ext.exllamav2_ext.__file__}", flush=True)
    return 0


def prepare_import(archs: Optional[Sequence[str]] = None) -> tuple[bool, Optional[Path]]:
    """Before the worker imports exllamav2: (True, None) when a built extension will be imported (prebuilt,
    or this machine's cached build, put on sys.path); else exllamav2's own JIT build is pointed at the cache
    and the toolchain, and will build at import (the slow fallback): (False, the folder it builds in, whose
    lock the importer holds: runtime/build_lock.py), the folder None where no toolchain was found."""
    if prebuilt_importable():
        return True, None
    status = kernel_status(archs)
    if status.state == "cached":
        sys.path.insert(0, str(status.build_dir / EXT))
        return True, None
    if status.build_dir is not None and status.toolchain is not None:
        status.build_dir.mkdir(parents=True, exist_ok=True)
        env = build_environment(cuda_home_for(status.toolchain), status.build_dir, archs or gpu_archs())
        for name in ("CUDA_HOME", "PATH", "TORCH_EXTENSIONS_DIR", "TORCH_CUDA_ARCH_LIST"):
            os.environ[name] = env[name]
        os.environ.pop("CUDA_PATH", None)
        cpp_extension = sys.modules.get("torch.utils.cpp_extension")
        if cpp_extension is not None:       # imported already (the CPU expert kernel): it read CUDA_HOME then
            cpp_extension.CUDA_HOME = env["CUDA_HOME"]
        return False, status.build_dir / EXT
    return False, None


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"] and len(sys.argv) == 3:     # the build's own process, started by build()
        sys.exit(_child(Path(sys.argv[2])))
    sys.exit("usage: moedesk-cli setup-gpu [--check] [--arch-list LIST] [--json]")
