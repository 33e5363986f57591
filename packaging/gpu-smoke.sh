#!/usr/bin/env bash
# The GPU path with no CUDA toolkit, end to end, on a machine with an NVIDIA GPU, a CUDA torch and exllamav2
# (and no network). Run from the repository root:
#
#   packaging/gpu-smoke.sh [WHEELS_DIR] [build|chat|bundle|all]     (log: $OUT/gpu-smoke-STAGE.log, else build/)
#
# 1. build:  hides every system nvcc (PATH, CUDA_HOME/CUDA_PATH, MOEDESK_CUDA_TOOLCHAIN=wheels), installs
#            NVIDIA's toolchain wheels (or a trimmed copy, see gpu-toolchain-pack.sh) and ninja from WHEELS_DIR
#            into a folder put on PYTHONPATH, and times `moedesk-cli setup-gpu` (this GPU's architecture).
# 2. chat:   writes a small synthetic Qwen3-MoE and asks `moedesk-cli chat --backend cuda` one question.
# 3. bundle: builds the GPU bundle with PyInstaller around the kernels from step 1 and runs its
#            `--smoke-test` on the synthetic model (the GPU engine), still with no nvcc anywhere; reports the
#            bundle's size, its start-up and first-token times.
# Every stage says PASS or FAIL in the log; the exit status is that of the first failing stage.
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS=${1:-build/gpu-carry}
STAGES=${2:-all}
PY=${PYTHON:-python3}
LOGDIR=${OUT:-build}
mkdir -p "$LOGDIR" build
LOG="$LOGDIR/gpu-smoke-$STAGES.log"
: > "$LOG"
say() { echo "$*" | tee -a "$LOG"; }
run() { say "\$ $*"; "$@" 2>&1 | tee -a "$LOG"; return "${PIPESTATUS[0]}"; }
# The demo model to ship in the bundle: the machine's imported one, if any (asked before MOEDESK_HOME moves).
DEMO=$("$PY" -c "from runtime import paths; print(paths.resolve_model(paths.DEMO_ALIAS))" 2>/dev/null || true)
export MOEDESK_HOME=$PWD/build/gpu-smoke-home                      # its own cache (no earlier build) and models
# PYTHONPATH keeps its folders except any holding a built exllamav2_ext: this run must build its own.
KEEP=$(echo "${PYTHONPATH:-}" | tr ':' '\n' | while read -r d; do
  [ -n "$d" ] && ! ls "$d"/exllamav2_ext* >/dev/null 2>&1 && echo "$d"; done | paste -sd: -)
export PYTHONPATH="$PWD/build/gpu-toolchain:$PWD${KEEP:+:$KEEP}"
export MOEDESK_CUDA_TOOLCHAIN=wheels
unset CUDA_HOME CUDA_PATH
PATH=$(echo "$PATH" | tr ':' '\n' | while read -r d; do [ -n "$d" ] && [ ! -x "$d/nvcc" ] && echo "$d"; done | paste -sd: -)
export PATH="$PWD/build/gpu-toolchain/bin:$PATH"                 # ninja's script, installed with --target
say "gpu-smoke $(date -u +%FT%TZ) $(git rev-parse --short HEAD 2>/dev/null)"
say "nvcc on PATH: $(command -v nvcc || echo none)"
run nvidia-smi --query-gpu=name,driver_version,compute_cap --format=csv,noheader
run "$PY" -c "
import importlib.util as u, sys, torch
print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)
print('prebuilt exllamav2_ext importable:', u.find_spec('exllamav2_ext') is not None, '(must be False)')
print('PySide6:', u.find_spec('PySide6') is not None, ' PyInstaller:', u.find_spec('PyInstaller') is not None)"
FAILED=0
stage() { say "== $1: $2"; [ "$2" = PASS ] || { [ "$FAILED" != 0 ] || FAILED=$3; }; }
want() { [ "$STAGES" = all ] || [ "$STAGES" = "$1" ]; }

toolchain() {
  # Toolchain wheels (or their trimmed archive) go into their own folder, like a venv's site-packages.
  rm -rf build/gpu-toolchain && mkdir -p build/gpu-toolchain
  if ls "$WHEELS"/*.tar.xz >/dev/null 2>&1; then
    for a in "$WHEELS"/*.tar.xz; do run tar -C build/gpu-toolchain -xJf "$a"; done
  fi
  # one pip call: with --target, a second call would skip the nvidia/ folder the first one made
  WHLS=$(ls "$WHEELS"/nvidia_*.whl "$WHEELS"/ninja-*.whl 2>/dev/null || true)
  [ -z "$WHLS" ] || run "$PY" -m pip install -q --no-index --no-deps --target build/gpu-toolchain $WHLS
  command -v ninja >/dev/null || "$PY" -c "import ninja" 2>/dev/null || say "ninja missing: carry ninja-1.13.2"
}

if want build; then
  toolchain
  run "$PY" -m runtime.cli setup-gpu --check
  T0=$(date +%s)
  run "$PY" -m runtime.cli setup-gpu --verbose
  # PASS only when the cache now holds this GPU's build (setup-gpu also exits 0 where nothing is to be done)
  if "$PY" -m runtime.cli setup-gpu --check --json | tee -a "$LOG" | grep -q '"state": "cached"'; then
    stage build PASS; else stage build FAIL 1; fi
  say "build seconds: $(( $(date +%s) - T0 ))"
fi

MODEL=build/gpu-smoke-model
if want chat || want bundle; then
  [ -f "$MODEL/config.json" ] || run "$PY" -m runtime.cli synth --shape tiny-moe --bpw 4.0 --out "$MODEL"
fi
if want chat; then
  if run "$PY" -m runtime.cli chat --model "$MODEL" --backend cuda --max-tokens 16 --temperature 0 --json \
       "Hello from a machine without nvcc"; then stage chat PASS; else stage chat FAIL 2; fi
fi

if want bundle; then
  [ -d build/gpu-toolchain/nvidia ] || toolchain                 # a fresh machine: the bundle builds the kernels
  "$PY" -c "import PyInstaller" 2>/dev/null || run "$PY" -m pip install -q --no-index --find-links "$WHEELS" pyinstaller
  T0=$(date +%s)
  ARCH=$("$PY" -c "from runtime.gpu_setup import arch_list, gpu_archs; print(arch_list(gpu_archs()))")
  if [ -f "$DEMO/config.json" ]; then export MOEDESK_BUNDLE_DEMO=$DEMO
  else export MOEDESK_BUNDLE_DEMO=$PWD/$MODEL; say "no imported demo model here: the bundle carries the synthetic one"; fi
  if [ -z "$ARCH" ]; then
    say "no GPU architecture found (NVML, nvidia-smi)"; stage bundle FAIL 3
  elif run env TORCH_CUDA_ARCH_LIST="$ARCH" PYTHON="$PY" packaging/build-linux.sh --gpu --no-tarball; then
    say "bundle seconds: $(( $(date +%s) - T0 )) (kernels for $ARCH only, to keep this run short)"
    run du -sh dist/moedesk
    find dist/moedesk -name 'exllamav2_ext*' -o -name 'libcudart*' -o -name 'libtorch_cuda*' | tee -a "$LOG"
    # The bundle runs with no toolchain at all: no PYTHONPATH, no wheels, no nvcc, and as a new user would:
    # Triton's cache and the user's folders empty, so its launchers are compiled here, by the machine's C
    # compiler or the bundled Zig.
    FRESH=$(mktemp -d)
    (cd "$FRESH" && env -u PYTHONPATH -u MOEDESK_CUDA_TOOLCHAIN -u TRITON_CACHE_DIR HOME="$FRESH" \
       XDG_CACHE_HOME="$FRESH/.cache" MOEDESK_HOME="$MOEDESK_HOME" \
       "$OLDPWD/dist/moedesk/moedesk" --smoke-test "Hello" --model "$OLDPWD/$MODEL") > build/bundle-smoke.log 2>&1
    tee -a "$LOG" < build/bundle-smoke.log
    if grep -q "on the cuda engine" build/bundle-smoke.log && grep -q "smoke: answered" build/bundle-smoke.log; then
      stage bundle PASS
    else stage bundle FAIL 3; fi
    # Again with no program on PATH at all (no gcc, cc or clang): the bundled Zig compiles Triton's launchers.
    FRESH=$(mktemp -d)
    (cd "$FRESH" && env -u PYTHONPATH -u MOEDESK_CUDA_TOOLCHAIN -u TRITON_CACHE_DIR -u CC HOME="$FRESH" \
       XDG_CACHE_HOME="$FRESH/.cache" MOEDESK_HOME="$MOEDESK_HOME" PATH=/nonexistent \
       "$OLDPWD/dist/moedesk/moedesk" --smoke-test "Hello" --model "$OLDPWD/$MODEL") > build/bundle-smoke-nocc.log 2>&1
    tee -a "$LOG" < build/bundle-smoke-nocc.log
    if grep -q "on the cuda engine" build/bundle-smoke-nocc.log && grep -q "smoke: answered" build/bundle-smoke-nocc.log; then
      stage "bundle without a C compiler" PASS
    else stage "bundle without a C compiler" FAIL 3; fi
  else stage bundle FAIL 3; fi
fi
say "gpu-smoke done: exit $FAILED"
exit "$FAILED"
