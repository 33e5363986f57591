"""runtime.gpu_setup's decisions, on fake folder layouts: which CUDA toolchain, the CUDA_HOME assembled from
NVIDIA's wheels, the cache key, the kernel state the welcome screen shows, messages and progress parsing."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from runtime import gpu_setup as g
from runtime.errors import KernelBuildFailed

TORCH_13 = g.TorchInfo("2.11.0", "13.0")


def touch(path: Path, text: str = "") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def system_toolkit(root: Path, version: str) -> Path:
    touch(root / "bin" / "nvcc")
    touch(root / "version.json", json.dumps({"cuda": {"name": "CUDA SDK", "version": version}}))
    touch(root / "include" / "cuda_runtime.h")
    touch(root / "lib64" / "libcudart.so")
    return root


def cu13_wheels(site: Path) -> Path:
    """What `pip install cuda-toolkit[nvcc,crt,cccl,nvvm,cudart]==13.0.2` puts in site-packages."""
    cu = site / "nvidia" / "cu13"
    for rel in ("bin/nvcc", "bin/nvcc.profile", "bin/ptxas", "bin/cudafe++", "nvvm/bin/cicc",
                "include/cuda_runtime.h", "include/crt/host_config.h", "include/cccl/cuda/std/version",
                "lib/libcudart.so.13"):
        touch(cu / rel)
    return cu


def cu12_wheels(site: Path) -> Path:
    nv = site / "nvidia"
    for rel in ("cuda_nvcc/bin/nvcc", "cuda_nvcc/nvvm/bin/cicc", "cuda_nvcc/include/crt/host_config.h",
                "cuda_runtime/include/cuda_runtime.h", "cuda_runtime/lib/libcudart.so.12",
                "cublas/include/cublas_v2.h", "cublas/lib/libcublas.so.12"):
        touch(nv / rel)
    return nv


def test_torch_version_is_read_without_importing_torch(tmp_path):
    touch(tmp_path / "version.py", "from typing import Optional\n__version__ = '2.11.0+cu130'\n"
                                   "debug = False\ncuda: Optional[str] = '13.0'\nhip: Optional[str] = None\n")
    assert g.torch_info(tmp_path) == g.TorchInfo("2.11.0+cu130", "13.0")
    assert g.torch_info(tmp_path).cuda_major == 13
    touch(tmp_path / "version.py", "__version__ = '2.13.0+cpu'\ncuda: Optional[str] = None\n")
    assert g.torch_info(tmp_path) == g.TorchInfo("2.13.0+cpu", None)
    assert g.torch_info(tmp_path / "absent") is None


def test_system_toolkits_in_torchs_order(tmp_path):
    home = system_toolkit(tmp_path / "cuda-12.8", "12.8.93")
    on_path = system_toolkit(tmp_path / "opt" / "cuda", "13.0.88")
    default = system_toolkit(tmp_path / "usr-local-cuda", "13.0.88")
    found = g.system_toolkits({"CUDA_HOME": str(home)}, lambda n: str(on_path / "bin" / "nvcc"), default)
    assert found == [home, on_path.resolve(), default]
    assert g.system_toolkits({}, lambda n: None, tmp_path / "nowhere") == []
    assert g.toolkit_version(home) == "12.8.93"


def test_wheel_layouts_cuda13_and_cuda12(tmp_path):
    cu = cu13_wheels(tmp_path / "site13")
    tc = g.wheel_toolchain([str(tmp_path / "empty"), str(tmp_path / "site13")])
    assert tc.kind == "wheels" and tc.roots == (cu,) and tc.major == 13
    nv = cu12_wheels(tmp_path / "site12")
    tc12 = g.wheel_toolchain([str(tmp_path / "site12")])
    assert tc12.major == 12 and tc12.roots[0] == nv / "cuda_nvcc"
    assert set(tc12.roots[1:]) == {nv / "cuda_runtime", nv / "cublas"}
    assert g.wheel_toolchain([str(tmp_path / "empty")]) is None
    torch_site = tmp_path / "torch-site"                      # torch's own cu13 wheels: headers, no nvcc
    touch(torch_site / "nvidia" / "cu13" / "include" / "cublas_v2.h")
    merged = g.wheel_toolchain([str(tmp_path / "site13"), str(torch_site)])
    assert merged.roots == (cu, torch_site / "nvidia" / "cu13")
    assert (g.assemble_cuda_home(merged, tmp_path / "home") / "include" / "cublas_v2.h").exists()


def test_the_toolchain_kind_can_be_forced(tmp_path, monkeypatch):
    home = system_toolkit(tmp_path / "cuda", "13.0.88")
    cu = cu13_wheels(tmp_path / "site")
    monkeypatch.setattr(g, "system_toolkits", lambda: [home])
    monkeypatch.setattr(g, "wheel_toolchain", lambda: g.Toolchain("wheels", cu, "13.0.88", (cu,)))
    assert g.find_toolchain(TORCH_13).toolchain.kind == "system"
    monkeypatch.setenv("MOEDESK_CUDA_TOOLCHAIN", "wheels")
    assert g.find_toolchain(TORCH_13).toolchain.kind == "wheels"


def test_choice_prefers_a_matching_system_toolkit_then_wheels(tmp_path):
    sys13 = g.Toolchain("system", tmp_path / "cuda13", "13.0.88")
    sys12 = g.Toolchain("system", tmp_path / "cuda12", "12.8.93")
    wheels = g.Toolchain("wheels", tmp_path / "nvidia" / "cu13", "13.0.88", (tmp_path,))
    assert g.choose_toolchain(13, [sys12, sys13], wheels).toolchain is sys13
    assert g.choose_toolchain(13, [sys12], wheels).toolchain is wheels          # wrong major: wheels
    none = g.choose_toolchain(13, [sys12], None)
    assert none.toolchain is None and "12.8.93" in none.note and "CUDA 13" in none.note
    assert "No CUDA compiler" in g.choose_toolchain(13, [], None).note


@pytest.mark.skipif(os.name == "nt", reason="the wheels' CUDA_HOME is assembled from links on Linux")
@pytest.mark.parametrize("layout", [cu13_wheels, cu12_wheels])
def test_cuda_home_assembled_from_wheels_has_what_torch_needs(tmp_path, layout):
    layout(tmp_path / "site")
    tc = g.wheel_toolchain([str(tmp_path / "site")])
    raw = tc.roots[0] if tc.major == 13 else tc.roots[1]      # as installed: no lib64, no libcudart.so
    assert g.missing_pieces(raw)
    home = g.assemble_cuda_home(tc, tmp_path / "cache" / "cuda-home")
    assert g.missing_pieces(home) == []
    assert (home / "lib64" / "libcudart.so").resolve().name.startswith("libcudart.so.1")
    assert (home / "nvvm" / "bin" / "cicc").exists()
    again = g.assemble_cuda_home(tc, tmp_path / "cache" / "cuda-home")    # rebuilt in place, no error
    assert again == home and not (home.parent / "cuda-home.tmp").exists()


def test_system_toolkit_is_its_own_cuda_home(tmp_path):
    home = system_toolkit(tmp_path / "cuda", "13.0.88")
    assert g.assemble_cuda_home(g.Toolchain("system", home, "13.0.88"), tmp_path / "x") == home
    assert not (tmp_path / "x").exists()


def test_cache_key_names_every_input():
    key = g.cache_key("0.3.2", g.TorchInfo("2.11.0+cu130", "13.0"), ["9.0", "8.6", "9.0"])
    assert key == "exllamav2-0.3.2_torch-2.11.0+cu130_cu130_sm86-sm90"
    assert g.cache_key("0.3.2", g.TorchInfo("2.12.0", "13.0"), ["9.0"]) != g.cache_key("0.3.2", TORCH_13, ["9.0"])
    assert g.arch_list(["12.0", "8.0", "9.0"]) == "8.0;9.0;12.0"


@pytest.mark.parametrize("release, package", [
    ('NAME="Ubuntu"\nID=ubuntu\nID_LIKE=debian\n', "build-essential"),
    ("ID=debian\n", "build-essential"),
    ('ID="linuxmint"\nID_LIKE="ubuntu debian"\n', "build-essential"),
    ('ID=fedora\n', "gcc-c++"),
    ('ID="rocky"\nID_LIKE="rhel centos fedora"\n', "gcc-c++"),
    ('ID="opensuse-tumbleweed"\nID_LIKE="opensuse suse"\n', "gcc-c++"),
    ("ID=arch\n", "base-devel"),
    ("ID=manjaro\nID_LIKE=arch\n", "base-devel"),
    ("ID=alpine\n", "build-base"),
])
def test_compiler_advice_names_the_distributions_package(release, package):
    assert f"package {package}:" in g.compiler_advice(release)


def test_compiler_advice_for_an_unknown_distribution():
    assert "g++" in g.compiler_advice("ID=plan9\n") and "package " not in g.compiler_advice("")


def test_nvcc_architectures_are_read_from_its_list(tmp_path):
    nvcc = touch(tmp_path / "bin" / "nvcc", "#!/bin/sh\nprintf 'compute_75\\ncompute_80\\ncompute_90\\ncompute_120\\n'\n")
    nvcc.chmod(0o755)
    assert g.nvcc_archs(tmp_path) == {"7.5", "8.0", "9.0", "12.0"}
    assert g.nvcc_archs(tmp_path / "none") == set()


def test_the_compiler_is_the_one_torch_runs():
    which = {"c++": "/usr/bin/c++", "clang++": "/usr/bin/clang++"}.get
    assert g.find_compiler({}, which) == "/usr/bin/c++"
    assert g.find_compiler({"CXX": "clang++"}, which) == "/usr/bin/clang++"
    assert g.find_compiler({}, {"g++": "/usr/bin/g++"}.get) is None          # torch calls c++, not g++


def test_gpu_architectures_from_nvidia_smi_without_nvml(tmp_path, monkeypatch):
    import pynvml

    def no_nvml():
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
    monkeypatch.setattr(pynvml, "nvmlInit", no_nvml)
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    smi = touch(tmp_path / "nvidia-smi", "#!/bin/sh\nprintf '9.0\\n9.0\\n8.6\\n'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert g.gpu_archs() == ["8.6", "9.0"]
    monkeypatch.setenv("PATH", str(tmp_path / "none"))
    assert g.gpu_archs() == []


def test_triton_needs_a_c_compiler_at_first_use():
    assert g.triton_advice({}, {"gcc": "/usr/bin/gcc"}.get) == ""
    assert g.triton_advice({"CC": "cc"}, lambda n: None) == ""
    assert "C compiler" in g.triton_advice({}, lambda n: None)


def test_ninja_progress_lines():
    assert g.parse_progress("[3/47] /usr/local/cuda/bin/nvcc --generate-dependencies-with-compile ...") == (3, 47)
    assert g.parse_progress("[47/47] c++ ext_bindings.o ... -shared -o exllamav2_ext.so") == (47, 47)
    assert g.parse_progress("Building extension module exllamav2_ext...") is None
    assert g.parse_progress("  [3/47] indented is not ninja") is None


def test_failure_message_keeps_the_compilers_last_lines_and_says_what_to_do(tmp_path):
    tc = g.Toolchain("wheels", tmp_path, "13.0.88", (tmp_path,))
    lines = [f"line {i}" for i in range(100)] + ["", "error: identifier \"foo\" is undefined"]
    err = g.failure_message(lines, tc)
    tail = err.detail.splitlines()
    assert len(tail) == g.TAIL_LINES and tail[-1].endswith("is undefined") and tail[0] == "line 76"
    assert err.message.startswith("Could not build the GPU kernels") and "13.0.88" in err.message
    gcc = g.failure_message(["#error -- unsupported GNU version! gcc versions later than 14 are not supported!"], tc)
    assert "CC=/usr/bin/gcc-13" in gcc.message
    no_cxx = g.failure_message(["/bin/sh: 1: c++: not found"], tc)
    assert "C++ compiler" in no_cxx.message


@pytest.fixture
def machine(tmp_path, monkeypatch):
    """A GPU machine with torch 2.11 (CUDA 13.0), exllamav2 0.3.2 and no prebuilt extension."""
    monkeypatch.setattr(g, "torch_info", lambda package_dir=None: TORCH_13)
    monkeypatch.setattr(g, "package_version", lambda n: {"exllamav2": "0.3.2"}.get(n))
    monkeypatch.setattr(g, "prebuilt_importable", lambda: False)
    monkeypatch.setattr(g, "system_toolkits", lambda: [])
    monkeypatch.setattr(g, "find_compiler", lambda: "/usr/bin/c++")
    monkeypatch.setattr(g, "ninja_dir", lambda: tmp_path)
    monkeypatch.setattr(g, "wheel_toolchain", lambda: None)
    return tmp_path


def test_kernel_states(machine, monkeypatch):
    assert g.kernel_status([]).state == "no_gpu"
    st = g.kernel_status(["8.9"])
    assert st.state == "no_toolchain" and "moedesk[gpu]" in st.advice
    cu13_wheels(machine / "site")
    monkeypatch.setattr(g, "wheel_toolchain", lambda: g.Toolchain("wheels", machine / "site" / "nvidia" / "cu13",
                                                                    "13.0.88", (machine / "site" / "nvidia" / "cu13",)))
    st = g.kernel_status(["8.9"])
    assert st.state == "buildable" and st.advice == "No CUDA toolkit needed."
    assert st.build_dir == g.kernels_root() / "exllamav2-0.3.2_torch-2.11.0_cu130_sm89"
    monkeypatch.setattr(g, "find_compiler", lambda: None)
    assert g.kernel_status(["8.9"]).state == "no_compiler"
    monkeypatch.setattr(g, "find_compiler", lambda: "/usr/bin/c++")
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "-m", "runtime.gpu_setup",
                              "--child", str(st.build_dir / "exllamav2_ext")])      # a build child, as ps sees it
    try:
        touch(st.build_dir / "building.pid", str(child.pid))
        assert g.kernel_status(["8.9"]).state == "building"
    finally:
        child.kill()
        child.wait()
    assert g.kernel_status(["8.9"]).state == "buildable"                   # the build died
    (st.build_dir / "building.pid").write_text(str(os.getpid()))           # its number, taken by another program
    assert g.kernel_status(["8.9"]).state == "buildable"
    (st.build_dir / "building.pid").write_text("999999999")
    assert g.kernel_status(["8.9"]).state == "buildable"
    touch(st.build_dir / "failed.log", "\n".join(f"l{i}" for i in range(40)) + "\nfatal error: x.h: No such file\n")
    failed = g.kernel_status(["8.9"])
    assert failed.state == "failed" and failed.log_tail.endswith("No such file") and "CPU" in failed.title
    touch(st.build_dir / "exllamav2_ext" / "exllamav2_ext.so")
    monkeypatch.setattr(g, "triton_advice", lambda: "")
    assert g.kernel_status(["8.9"]).state == "cached" and g.kernel_status(["8.9"]).ready
    assert g.kernel_status(["9.0"]).state == "failed" or g.kernel_status(["9.0"]).state == "buildable"
    monkeypatch.setattr(g, "prebuilt_importable", lambda: True)
    assert g.kernel_status(["8.9"]).state == "prebuilt"


def test_prepare_import_puts_the_cached_build_first_on_sys_path(machine, monkeypatch):
    build_dir = g.kernels_root() / g.cache_key("0.3.2", TORCH_13, ["9.0"])
    touch(build_dir / "exllamav2_ext" / "exllamav2_ext.so")
    monkeypatch.setattr(sys, "path", list(sys.path))
    assert g.prepare_import(["9.0"]) == (True, None)
    assert sys.path[0] == str(build_dir / "exllamav2_ext")


@pytest.mark.skipif(os.name == "nt", reason="Linux toolchain layout")
def test_prepare_import_points_the_fallback_jit_build_at_the_cache(machine, monkeypatch):
    cu = cu13_wheels(machine / "site")
    monkeypatch.setattr(g, "wheel_toolchain", lambda: g.Toolchain("wheels", cu, "13.0.88", (cu,)))
    for name in ("CUDA_HOME", "CUDA_PATH", "PATH", "TORCH_EXTENSIONS_DIR", "TORCH_CUDA_ARCH_LIST"):
        monkeypatch.setenv(name, "was-set")
    build_dir = g.kernels_root() / g.cache_key("0.3.2", TORCH_13, ["9.0"])
    assert g.prepare_import(["9.0"]) == (False, build_dir / "exllamav2_ext")
    assert os.environ["TORCH_EXTENSIONS_DIR"] == str(build_dir)
    home = g.kernels_root() / "cuda-home-13.0.88"
    assert os.environ["CUDA_HOME"] == str(home) and "CUDA_PATH" not in os.environ and not g.missing_pieces(home)
    assert os.environ["PATH"].split(os.pathsep)[:2] == [str(home / "bin"), str(machine)]
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == "9.0"


@pytest.mark.skipif(os.name == "nt", reason="Linux toolchain layout")
def test_a_failed_build_leaves_its_log_and_raises_with_the_last_lines(machine, monkeypatch):
    """The real child process runs exllamav2's build with a toolchain whose nvcc is a stub: torch (the CPU
    build here) refuses, and the failure comes back as the compiler's last lines, kept in failed.log."""
    cu = cu13_wheels(machine / "site")
    monkeypatch.setattr(g, "wheel_toolchain", lambda: g.Toolchain("wheels", cu, "13.0.88", (cu,)))
    build_dir = g.kernels_root() / g.cache_key("0.3.2", TORCH_13, ["9.0"])
    touch(build_dir / "exllamav2_ext" / "lock")          # torch's baton from a build stopped midway: no wait
    seen = []
    with pytest.raises(g.KernelBuildError) as info:
        g.build(lambda d, t, line: seen.append((d, t)), ["9.0"])
    assert (build_dir / "build.log").read_text().count("stopped before it finished") == 1   # said once
    assert info.value.message.startswith("Could not build the GPU kernels") and info.value.detail
    assert info.value.detail.splitlines()[-1] in (build_dir / "failed.log").read_text()
    assert not (build_dir / "building.pid").exists()
    assert g.kernel_status(["9.0"]).state == "failed"


def test_a_build_for_architectures_already_cached_needs_no_toolchain(machine, capsys):
    """make bundle-gpu asks for an explicit architecture list: a cached build of exactly those is shipped
    as it is, with no compiler on the machine (wheel_toolchain and system_toolkits find nothing here)."""
    from runtime import cli
    module = g.kernels_root() / g.cache_key("0.3.2", TORCH_13, ["9.0"]) / "exllamav2_ext" / "exllamav2_ext.so"
    touch(module)
    assert g.build(archs=["9.0"]) == (module, 0.0)
    assert cli.main(["setup-gpu", "--arch-list", "9.0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1]) == {"event": "done", "module": str(module), "seconds": 0.0}
    with pytest.raises(g.KernelBuildError):
        g.build(archs=["8.9"])                  # not cached, and nothing to build it with


def test_setup_gpu_check_says_what_would_happen(machine, capsys):
    from runtime import cli
    assert cli.main(["setup-gpu", "--check", "--arch-list", "8.6", "--json"]) == 0
    event = json.loads(capsys.readouterr().out.splitlines()[0])
    assert event["event"] == "status" and event["state"] == "no_toolchain"


def test_the_cuda_backend_imports_the_cached_build_and_reports_a_failed_fallback(machine, monkeypatch):
    """exl2.build_kernels: a cached build loads ("Loading GPU kernels"); without one, exllamav2's own JIT
    build runs at import, and its failure becomes kernel_build_failed with the last lines, kept in failed.log."""
    import types

    from runtime.backends import exl2
    from runtime.errors import EngineError
    monkeypatch.setattr(g, "gpu_archs", lambda: ["9.0"])
    build_dir = g.kernels_root() / g.cache_key("0.3.2", TORCH_13, ["9.0"])
    touch(build_dir / "exllamav2_ext" / "exllamav2_ext.so")
    monkeypatch.setattr(sys, "path", list(sys.path))
    package = types.ModuleType("exllamav2")                  # exllamav2 itself is never imported here
    package.__path__ = []
    monkeypatch.setitem(sys.modules, "exllamav2", package)
    monkeypatch.setitem(sys.modules, "exllamav2.ext", types.SimpleNamespace(exllamav2_ext=object()))
    steps = []
    exl2.build_kernels(lambda stage, text, done, total: steps.append(text))
    assert steps[0] == "Loading GPU kernels" and steps[-1].startswith("GPU kernels ready")
    assert sys.path[0] == str(build_dir / "exllamav2_ext")

    (build_dir / "exllamav2_ext" / "exllamav2_ext.so").unlink()
    cu = cu13_wheels(machine / "site")
    monkeypatch.setattr(g, "wheel_toolchain", lambda: g.Toolchain("wheels", cu, "13.0.88", (cu,)))
    monkeypatch.setenv("PATH", os.environ["PATH"])
    for name in ("CUDA_HOME", "TORCH_EXTENSIONS_DIR", "TORCH_CUDA_ARCH_LIST"):
        monkeypatch.delenv(name, raising=False)

    class FailingExt(types.ModuleType):
        def __getattr__(self, name):
            raise RuntimeError("Error building extension 'exllamav2_ext'\nq_gemm.cu(12): error: boom")
    monkeypatch.setitem(sys.modules, "exllamav2.ext", FailingExt("exllamav2.ext"))
    touch(build_dir / "exllamav2_ext" / "lock")          # torch's baton, left by a build stopped midway
    steps.clear()
    with pytest.raises(EngineError) as info:
        exl2.build_kernels(lambda stage, text, done, total: steps.append(text))
    assert not (build_dir / "exllamav2_ext" / "lock").exists()       # the import ran under the build lock
    assert steps == ["Building GPU kernels, one time"]
    assert isinstance(info.value, KernelBuildFailed) and info.value.detail.endswith("error: boom")
    assert os.environ["TORCH_EXTENSIONS_DIR"] == str(build_dir)
    assert g.kernel_status(["9.0"]).state == "failed"


def test_auto_stays_on_the_cpu_while_the_kernels_build(monkeypatch):
    from runtime import loader
    monkeypatch.setattr(loader, "cuda_device", lambda: "NVIDIA H200")
    state = {"s": "building"}
    monkeypatch.setattr(g, "kernel_status", lambda archs=None: g.KernelStatus(state["s"], ""))
    choice = loader.choose_backend("auto")
    assert choice.backend == "cpu" and "being built" in choice.note
    assert loader.choose_backend("cuda").backend == "cuda"        # asked for: waits for (or runs) the build
    state["s"] = "cached"
    assert loader.choose_backend("auto").backend == "cuda"


def test_a_package_missing_beside_exllamav2_is_named_not_blamed_on_the_toolchain(machine, monkeypatch):
    """The GPU bundle once left Pillow out: importing exllamav2 failed with ModuleNotFoundError('PIL'), and the
    engine said to install the CUDA toolchain. It names the missing package instead."""
    import builtins

    from runtime.backends import exl2
    from runtime.errors import EngineError
    monkeypatch.setattr(g, "gpu_archs", lambda: ["9.0"])
    monkeypatch.delitem(sys.modules, "exllamav2.ext", raising=False)
    real_import = builtins.__import__

    def no_pil(name, *args, **kwargs):
        if name == "exllamav2.ext":
            raise ModuleNotFoundError("No module named 'PIL'", name="PIL")
        return real_import(name, *args, **kwargs)
    monkeypatch.setattr(builtins, "__import__", no_pil)
    with pytest.raises(EngineError) as info:
        exl2.build_kernels(lambda *a: None)
    assert "'PIL'" in info.value.message and "toolchain" not in info.value.message
    assert "nvcc" not in info.value.message and "gpu]" not in info.value.message
