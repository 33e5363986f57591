#!/usr/bin/env bash
# Mixtral and DBRX on the CUDA engine, on the H200 in one call (at most LIMIT seconds, 540 by default).
# Assumes exllamav2's extension is ready and the Python deps importable (e.g. after
# `source .whl/preamble.sh`); run from the repository root. Writes JSON into bench/results/ and copies
# it, with a log, into $OUT. Each step runs only if the time left allows it (the log says what was left out):
#   1. the GPU tests of both architectures (TESTS=0 leaves them out; at most TEST_S seconds): against
#      the CPU reference (2 layers of the real shapes, and the miniatures), offload's cold paths
#      against all in VRAM (4 layers); their models are written under /tmp and removed after
#   2. synthesize mixtral-8x22b at 3.0 bpw (~53 GB on disk; q125-a11's 45 GB took ~35 s on this machine)
#   3. the offload benchmark on ONE load: all in VRAM (a 130 GB budget), then a 24 GB budget; the naive
#      baseline at each budget in the same run
#   4. the model removed (the disk holds one such model), dbrx at 3.0 bpw synthesized (~50 GB), the
#      offload benchmark at 24 GB with the naive baseline
#   5. one question through `moedesk-cli chat` at 24 GB with n-gram drafting, while time is left
# One call rarely holds all of it (a fresh machine compiles Triton's kernels first): the log says what
# was left out; a second call runs the rest, e.g. TESTS=0 MIXTRAL=0 for DBRX alone.
# Host memory: at 24 GB the experts' codes (~53 GB) are page-locked, plus the CPU path's copies.
set -u
OUT=${OUT:-/tmp/issue22-out}
ROOT=${ROOT:-/tmp/m22}
LIMIT=${LIMIT:-540}
TEST_S=${TEST_S:-240}
TESTS=${TESTS:-1}
MIXTRAL=${MIXTRAL:-1}                    # 0: leave the mixtral-8x22b benchmark out
DBRX=${DBRX:-1}                          # 0: leave the dbrx benchmark out
PY=${PYTHON:-python3}
mkdir -p "$OUT" bench/results "$ROOT"
T0=$(date +%s)
left() { echo $(( LIMIT - ($(date +%s) - T0) )); }
log() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a "$OUT/gpu_issue22.log"; }
export MOEDESK_COMMIT=${MOEDESK_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
export MOEDESK_HOME=${MOEDESK_HOME:-$ROOT/home}
log "commit $MOEDESK_COMMIT; $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null)"
log "disk: $(df -h "$ROOT" | tail -1); memory: $(free -g | awk '/Mem/ {print $2 " GB, " $7 " GB available"}')"

if [ "$TESTS" = 1 ]; then
    log "GPU tests (at most $TEST_S s)"
    MOEDESK_GPU_REPORT="$OUT/gpu_tests.jsonl" timeout "$TEST_S" $PY -m pytest tests/gpu/test_mixtral_dbrx_gpu.py \
        -q -rA --basetemp="$ROOT/pytest" 2>&1 | tail -40 | tee -a "$OUT/gpu_issue22.log"
    log "GPU tests: exit ${PIPESTATUS[0]} (124: out of time)"
    rm -rf "$ROOT/pytest"
fi

bench_offload() {   # model dir, label, budgets
    local model=$1 label=$2 budgets=$3
    timeout $(( $(left) - 10 )) $PY -m bench.offload --model "$model" --label "$label" --bpw 3.0 \
        --budgets "$budgets" --context 4096 --prompt 1024 --decode 64 --naive-decode 8 --calibrate 64 \
        --prefetch-modes "" --placement auto --out bench/results 2>&1 | tee -a "$OUT/gpu_issue22.log"
    log "offload benchmark $label: exit ${PIPESTATUS[0]}"
    local f
    f=$(ls -t bench/results/offload-"$label"-*.json 2>/dev/null | head -1)
    [ -n "$f" ] && cp "$f" "$OUT"/ && log "JSON: $f"
}

synth() {           # shape, dir
    if [ ! -f "$2/config.json" ]; then
        rm -rf "$2"
        log "synth $1 3.0 bpw -> $2"
        timeout $(( $(left) - 10 )) $PY -m runtime.cli synth --shape "$1" --bpw 3.0 --out "$2" 2>&1 | tail -2 \
            | tee -a "$OUT/gpu_issue22.log"
        log "synth $1: exit ${PIPESTATUS[0]}, $(du -sh "$2" | cut -f1)"
    fi
}

chat() {            # dir
    log "chat through a worker at 24 GB with n-gram drafting"
    timeout $(( $(left) - 5 )) $PY -m runtime.cli chat --model "$1" --backend cuda --vram-budget 24 --draft ngram \
        --max-tokens 32 --temperature 0 "Name three colours." 2>&1 | tail -5 | tee -a "$OUT/gpu_issue22.log"
    log "chat: exit ${PIPESTATUS[0]}"
}

M=$ROOT/mixtral-8x22b-3.0
D=$ROOT/dbrx-3.0
if [ "$MIXTRAL" = 1 ] && [ "$(left)" -gt 300 ]; then
    synth mixtral-8x22b "$M"
    log "offload benchmark mixtral-8x22b: all in VRAM (130 GB), then 24 GB; $(left) s left"
    [ -f "$M/config.json" ] && bench_offload "$M" mixtral-8x22b 130,24
else
    log "mixtral-8x22b left out: $(left) s left"
fi
if [ "$DBRX" = 1 ] && [ "$(left)" -gt 200 ]; then
    rm -rf "$M"
    synth dbrx "$D"
    log "offload benchmark dbrx at 24 GB; $(left) s left"
    [ -f "$D/config.json" ] && bench_offload "$D" dbrx 24
else
    log "dbrx left out: $(left) s left"
fi
if [ "$(left)" -gt 100 ]; then
    if [ -f "$D/config.json" ]; then chat "$D"; elif [ -f "$M/config.json" ]; then chat "$M"; fi
fi
log "done"
ls -la "$OUT" | tee -a "$OUT/gpu_issue22.log"
