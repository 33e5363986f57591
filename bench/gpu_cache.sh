#!/usr/bin/env bash
# Compiled GPU and CPU kernels kept from one H200 call to the next, so a call spends its minutes on tests
# and benchmarks rather than on compiling again what the last call compiled:
#   bench/gpu_cache.sh restore FILE   unpack FILE (if it exists) into Triton's cache and torch's extension root
#   bench/gpu_cache.sh save FILE      pack both into FILE (tar.xz), unless it would be larger than MAX_MB
# Triton's cache is TRITON_CACHE_DIR (default ~/.triton/cache; export it before both steps to use another),
# keyed by each kernel's source, its compile-time arguments and the GPU: a kernel changed since is compiled
# again, the rest are found. The torch extension root holds the CPU expert kernel (runtime/experts/
# cpu_experts.py, built at the first load with the CPU path). Compiling is the suspected share of the GPU
# suite's slow cases (test_dense_gemv_gpu's took 23-34 s each, two of them under 1 s, on 2026-12-04:
# bench/results/gpu-tests-20261204-suite.log): a run with the cache restored tells.
set -u
what=${1:?restore or save}
file=${2:?the archive file}
TRITON=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
PY=${PYTHON:-python3}
EXT=$($PY -c "from torch.utils.cpp_extension import get_default_build_root as r; print(r())" 2>/dev/null)
MAX_MB=${MAX_MB:-15}                    # a file brought back from a call is at most 16 MiB
case $what in
    restore)
        [ -f "$file" ] || { echo "gpu_cache: no $file, every kernel compiles"; exit 0; }
        mkdir -p "$TRITON" ${EXT:+"$EXT"}
        tar -xJf "$file" -C / || exit 1
        echo "gpu_cache: restored $(find "$TRITON" -name '*.json' | wc -l) Triton files from $file"
        ;;
    save)
        dirs=()
        [ -d "$TRITON" ] && dirs+=("${TRITON#/}")
        [ -n "$EXT" ] && for d in "$EXT"/moedesk-*; do [ -d "$d" ] && dirs+=("${d#/}"); done
        [ ${#dirs[@]} -gt 0 ] || { echo "gpu_cache: nothing to save"; exit 0; }
        tmp=$file.part
        tar -cf - -C / "${dirs[@]}" | xz -T0 -6 > "$tmp" || { rm -f "$tmp"; exit 1; }
        mb=$(( $(stat -c %s "$tmp") / 1048576 ))
        if [ "$mb" -ge "$MAX_MB" ]; then
            echo "gpu_cache: $mb MB is over $MAX_MB MB: not saved"; rm -f "$tmp"; exit 0
        fi
        mv "$tmp" "$file" && echo "gpu_cache: saved $(du -h "$file" | cut -f1) to $file"
        ;;
    *) echo "gpu_cache: restore or save, not $what"; exit 2 ;;
esac
