#!/usr/bin/env bash
# Qwen3.5-MoE on its own GPU engine (runtime/backends/hybrid.py), on the H200 in one call (at most LIMIT
# seconds, 570 by default). Assumes exllamav2's extension is ready and the Python deps importable (e.g.
# after `source .whl/preamble.sh`: fla-core and einops among them); run from the repository root. Writes
# JSON into bench/results/ and copies it, with a log, into $OUT. Each step runs only if the time left
# allows it (the log says what was left out); switch steps off to run the rest in a later call:
#   1. TESTS=1: the GPU tests of the engine (GROUP c of bench/gpu_suite.sh: fla's kernels, the engine
#      against the CPU, decode graphs with and without offload, the MTP head), at most TEST_S seconds
#   2. synthesize qwen3.5-122b-a10b at 3.0 bpw (~49 GB on disk) once under $ROOT
#   3. OFFLOAD=1: the offload benchmark: first all in VRAM (a load of its own: a 2048-token prompt's time to
#      first token, decode, its roofline, decode without graphs as its baseline), then at BUDGETS GB (24 by
#      default; BUDGETS="" measures the all-in-VRAM load alone), uniform
#      routing, the trace-driven routing beside it on the same load, the 2048-token prompt's time to first
#      token, the naive baseline in the same run; the app's placement ("auto": the CPU expert path timed
#      against streaming, both recorded). PROFILE=1: each load's decode step profiled too (16 steps: the
#      kernels' time, launches a token, the GPU's busy fraction), the tables back as $OUT/prof.tar.gz
#   4. WORKER=1: the worker benchmark all in VRAM, plain decoding and MTP drafting side by side
#      (`bench-worker --draft mtp`: the way a user meets it, the first answer included)
#   5. WORKER24=1: the same at a 24 GB budget (MTP's verify cost with offload: its answers' verify rows
#      and times)
#   6. VERIFY=1: the verify cost at 24 GB (`bench-spec --what verify --vram-budget 24 --draft mtp`: loaded as
#      the app loads it for MTP drafting, head and rollback window; a target forward over K+1 rows, K = 0..8,
#      against the one-row step, with the union of experts each forward reads)
#   7. CHAT=1: one question through `moedesk-cli chat` at 24 GB with MTP drafting
# A fresh machine compiles Triton's and fla's kernels on first use: one call rarely holds all of it.
set -u
OUT=${OUT:-/tmp/gpu-qwen35-out}
ROOT=${ROOT:-/tmp/m-qwen35}
LIMIT=${LIMIT:-570}
TEST_S=${TEST_S:-560}
TESTS=${TESTS:-1}
OFFLOAD=${OFFLOAD:-1}
WORKER=${WORKER:-1}
WORKER24=${WORKER24:-1}
VERIFY=${VERIFY:-1}
CHAT=${CHAT:-1}
TRACE=${TRACE:-qwen3-30b-a3b}            # bench/routing_traces.PROFILES: none is published for 256 experts
PY=${PYTHON:-python3}
mkdir -p "$OUT" bench/results "$ROOT"
STEPS_LOG=$OUT/gpu_qwen35.log
. "$(dirname "$0")/gpu_steps.sh"         # T0, left, log
export MOEDESK_COMMIT=${MOEDESK_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
export MOEDESK_HOME=${MOEDESK_HOME:-$ROOT/home}
log "commit $MOEDESK_COMMIT; $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null)"
log "disk: $(df -h "$ROOT" | tail -1); memory: $(free -g | awk '/Mem/ {print $2 " GB, " $7 " GB available"}')"
STAMP=$(date +%s)

copy_new() {        # results of this call only (the tree's bench/results holds earlier runs)
    find bench/results -maxdepth 1 -name "$1" -newermt "@$STAMP" -exec cp {} "$OUT"/ \; -exec echo "JSON: {}" \; \
        | tee -a "$OUT/gpu_qwen35.log"
}

if [ "$TESTS" = 1 ]; then
    log "GPU tests, group c (at most $TEST_S s)"
    GROUP=c LIMIT="$TEST_S" OUT="$OUT" bash bench/gpu_suite.sh 2>&1 | tail -60 | tee -a "$OUT/gpu_qwen35.log"
    log "GPU tests: exit ${PIPESTATUS[0]}"
fi

M=$ROOT/qwen3.5-122b-a10b-3.0
if [ "$OFFLOAD$WORKER$WORKER24$VERIFY$CHAT" != 00000 ] && [ ! -f "$M/config.json" ] && [ "$(left)" -gt 200 ]; then
    rm -rf "$M"
    log "synth qwen3.5-122b-a10b 3.0 bpw -> $M"
    timeout $(( $(left) - 10 )) $PY -m runtime.cli synth --shape qwen3.5-122b-a10b --bpw 3.0 --out "$M" 2>&1 | tail -2 \
        | tee -a "$OUT/gpu_qwen35.log"
    log "synth: exit ${PIPESTATUS[0]}, $(du -sh "$M" | cut -f1)"
fi

if [ "$OFFLOAD" = 1 ] && [ -f "$M/config.json" ] && [ "$(left)" -gt 240 ]; then
    log "offload benchmark all in VRAM, then at ${BUDGETS-24} GB, uniform routing (trace $TRACE beside it);" \
        "$(left) s left"
    timeout $(( $(left) - 10 )) $PY -m bench.offload --model "$M" --label qwen3.5-122b-a10b --bpw 3.0 \
        --budgets "${BUDGETS-24}" \
        --context 4096 --prompt 2048 --decode 64 --naive-decode 8 --calibrate 64 --routing uniform \
        --other-routing "trace" --trace-profile "$TRACE" --prefetch-modes "" --placement auto --all-in-vram \
        ${PROFILE:+--profile "$OUT/prof"} --out bench/results 2>&1 | tee -a "$OUT/gpu_qwen35.log"
    log "offload benchmark: exit ${PIPESTATUS[0]}"
    copy_new "offload-qwen3.5-122b-a10b-*.json"
else
    log "offload benchmark left out ($(left) s left)"
fi

worker() {          # label, extra flags
    local label=$1; shift
    log "worker benchmark $label, plain and MTP drafting; $(left) s left"
    timeout $(( $(left) - 10 )) $PY -m bench.worker --model "$M" --backend cuda --draft mtp --turns 2 \
        --max-tokens 96 --label "qwen3.5-122b-a10b-$label" --out bench/results "$@" 2>&1 \
        | tee -a "$OUT/gpu_qwen35.log"
    log "worker benchmark $label: exit ${PIPESTATUS[0]}"
    copy_new "worker-qwen3.5-122b-a10b-$label-*.json"
}
if [ "$WORKER" = 1 ] && [ -f "$M/config.json" ] && [ "$(left)" -gt 200 ]; then worker vram; fi
if [ "$WORKER24" = 1 ] && [ -f "$M/config.json" ] && [ "$(left)" -gt 200 ]; then worker 24gb --vram-budget 24; fi

if [ "$VERIFY" = 1 ] && [ -f "$M/config.json" ] && [ "$(left)" -gt 200 ]; then
    log "verify cost at 24 GB; $(left) s left"
    timeout $(( $(left) - 10 )) $PY -m runtime.cli bench-spec --model "$M" --backend cuda --what verify \
        --vram-budget 24 --context 2048 --draft mtp --label qwen3.5-122b-a10b-24gb --out bench/results 2>&1 \
        | tee -a "$OUT/gpu_qwen35.log"
    log "verify cost: exit ${PIPESTATUS[0]}"
    copy_new "spec-verify-cost-qwen3.5-122b-a10b-24gb-*.json"
fi

if [ "$CHAT" = 1 ] && [ -f "$M/config.json" ] && [ "$(left)" -gt 120 ]; then
    log "chat through a worker at 24 GB with MTP drafting"
    timeout $(( $(left) - 5 )) $PY -m runtime.cli chat --model "$M" --backend cuda --vram-budget 24 --draft mtp \
        --max-tokens 32 --temperature 0 "Name three colours." 2>&1 | tail -5 | tee -a "$OUT/gpu_qwen35.log"
    log "chat: exit ${PIPESTATUS[0]}"
fi
pack_profiles
log "done"
ls -la "$OUT" | tee -a "$OUT/gpu_qwen35.log"
