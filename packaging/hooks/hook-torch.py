# A lean hook for the CPU torch (used instead of the stock one when the bundle is built with the CPU
# torch; the spec keeps the stock hook for CUDA builds, which also need the nvidia-* libraries).
#
# The stock hook names every torch submodule as a hidden import and collects every non-Python file.
# Here the worker gets the torch modules its own imports reach, torch's shared libraries, and only the
# data torch reads at run time: no C++ headers, CMake files, test programs or bundled tools.
import os

from PyInstaller.utils.hooks import PY_DYLIB_PATTERNS, collect_data_files, collect_dynamic_libs, get_package_paths

# torch reads the source of some of its Python modules (TorchScript, inspect): keep .py beside .pyc.
module_collection_mode = "pyz+py"
warn_on_missing_hiddenimports = False

datas = collect_data_files("torch", excludes=[
    "**/*.h", "**/*.hpp", "**/*.cuh", "**/*.cpp", "**/*.c", "**/*.lib", "**/*.pyi", "**/*.cmake",
    "include/**", "share/**", "bin/**", "test/**", "testing/**", "_inductor/**", "utils/benchmark/**",
])
binaries = [(src, dst) for src, dst in
            collect_dynamic_libs("torch", search_patterns=PY_DYLIB_PATTERNS + ["*.so.*"])
            if "test" not in src.rsplit("/", 1)[-1] and "/bin/" not in src]
# `import torch` checks that its shared-memory helper exists (torch/bin/torch_shm_manager).
binaries.append((os.path.join(get_package_paths("torch")[1], "bin", "torch_shm_manager"), "torch/bin"))
# Libraries inside torch/lib must stay there (torch finds its dynamically opened libraries relative to
# its own files), so no top-level links to them.
bindepend_symlink_suppression = ["**/torch/lib/*.so*"]
