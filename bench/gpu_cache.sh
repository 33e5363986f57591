#!/usr/bin/env bash
# Compiled GPU and CPU kernels kept from one H200 call to the next, so a call spends its minutes on tests
# and benchmarks rather than on compiling again what the last call compiled:
#   bench/gpu_cache.sh restore FILE   unpack FILE, or its parts FILE.00, FILE.01, ... (where they exist), into
#                                     Triton's cache and torch's extension root
#   bench/gpu_cache.sh save FILE      pack both into FILE (tar.xz), cut into parts FILE.00, FILE.01, ... of at
#                                     most PART_MB (15) each where it is larger: a file brought back from a call is
#                                     at most 16 MiB (the whole suite's kernels came to 16 MB, and were not saved)
# Triton's cache is TRITON_CACHE_DIR (default ~/.triton/cache; export it before both steps to use another),
# keyed by each kernel's source, its compile-time arguments and the GPU: a kernel changed since is compiled
# again, the rest are found. The torch extension root holds the CPU expert kernel (runtime/cpu/
# experts.py, built at the first load with the CPU path). Compiling is the suspected share of the GPU
# suite's slow cases (test_dense_gemv_gpu's took 23-34 s each, two of them under 1 s, on 2026-12-04,
# the suite's log committed at be03b0e): a run with the cache restored tells. MAX_MB (60) bounds the
# whole, as the carry into a call is bounded.
set -u
what=${1:?restore or save}
file=${2:?the archive file}
TRITON=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
PY=${PYTHON:-python3}
EXT=$($PY -c "from torch.utils.cpp_extension import get_default_build_root as r; print(r())" 2>/dev/null)
PART_MB=${PART_MB:-15}                  # a file brought back from a call is at most 16 MiB
MAX_MB=${MAX_MB:-60}                    # what is carried into a call is at most 64 MiB, all of it
case $what in
    restore)
        parts=("$file".[0-9][0-9])
        [ -f "${parts[0]}" ] || parts=()
        [ -f "$file" ] && parts=("$file")
        [ ${#parts[@]} -gt 0 ] || { echo "gpu_cache: no $file (nor parts of it), every kernel compiles"; exit 0; }
        mkdir -p "$TRITON" ${EXT:+"$EXT"}
        cat "${parts[@]}" | tar -xJf - -C / || exit 1
        echo "gpu_cache: restored $(find "$TRITON" -name '*.json' | wc -l) Triton files from ${#parts[@]} file(s)"
        ;;
    save)
        dirs=()
        [ -d "$TRITON" ] && dirs+=("${TRITON#/}")
        [ -n "$EXT" ] && for d in "$EXT"/moedesk-*; do [ -d "$d" ] && dirs+=("${d#/}"); done
        [ ${#dirs[@]} -gt 0 ] || { echo "gpu_cache: nothing to save"; exit 0; }
        mkdir -p "$(dirname "$file")"
        tmp=$file.part
        tar -cf - -C / "${dirs[@]}" | xz -T0 -6 > "$tmp" || { rm -f "$tmp"; exit 1; }
        mb=$(( $(stat -c %s "$tmp") / 1048576 ))
        if [ "$mb" -ge "$MAX_MB" ]; then
            echo "gpu_cache: $mb MB is over $MAX_MB MB: not saved"; rm -f "$tmp"; exit 0
        fi
        rm -f "$file" "$file".[0-9][0-9]
        if [ "$mb" -lt "$PART_MB" ]; then
            mv "$tmp" "$file"
        else
            split -b "${PART_MB}M" -d "$tmp" "$file." && rm -f "$tmp"
        fi
        echo "gpu_cache: saved $mb MB to $(ls "$file" "$file".[0-9][0-9] 2>/dev/null | tr '\n' ' ')"
        ;;
    *) echo "gpu_cache: restore or save, not $what"; exit 2 ;;
esac
