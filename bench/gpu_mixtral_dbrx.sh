#!/usr/bin/env bash
# Mixtral and DBRX on the CUDA engine, on the H200, in steps that a warm machine resumes: each call runs
# the steps not yet done (a marker under $ROOT/done says which are), at most LIMIT seconds (540 by default),
# and starts a step only when the time left is at least that step's estimate (the log says what waited).
# Assumes exllamav2's extension is ready and the Python deps importable (e.g. after
# `source .whl/preamble.sh`); run from the repository root. JSON goes into bench/results/ and, with a log,
# into $OUT. Steps, in order:
#   tests          the GPU tests of both architectures (TESTS=0 leaves them out; at most TEST_S seconds, 420 by
#                  default: the first run took 300 s for 5 of the 8; SIGINT at the limit, so pytest reports):
#                  against the CPU reference (2 layers of the real shapes, and the miniatures), offload's
#                  cold paths against all in VRAM (4 layers); their models are written under $ROOT
#   mixtral-synth  mixtral-8x22b at 3.0 bpw (~53 GB on disk; q125-a11's 45 GB took ~35 s on this machine);
#                  SYNTH_ONLY=1 runs this step alone and returns (e.g. in the background of the preamble)
#   mixtral-bench  the offload benchmark on ONE load: all in VRAM (a 130 GB budget), then a 24 GB budget,
#                  the naive baseline at each in the same run; a 2K-token prompt for the time to first token
#   mixtral-chat   one question through `moedesk-cli chat` (a worker process, placement as the app picks it)
#                  at 24 GB with n-gram drafting; the worker's events as JSON lines (load, answer, stats)
#   dbrx-synth, dbrx-bench (24 GB), dbrx-chat: the same for dbrx (~50 GB; the other model is removed
#                  before either is written, the disk holds one)
# DIAG=1 first runs `python -m bench.check_reference` on two-layer models of both real shapes (as the GPU
# tests write them; DBRX with a clip_qkv of 1.0) after a 27-token prefix: the residual stream block by
# block and the router's picks for a decode (1 row) and a verify (2 rows), against the float32 reference.
# RELOAD=1 first loads the DBRX miniature (two layers, clip_qkv 0.25, as the GPU tests write it) six times in one
# process with `python -m bench.check_reload --rechoose`: each load's error and the first block that differs from
# the first load's.
# MIXTRAL_BUDGETS=24 measures Mixtral at 24 GB only; MIXTRAL_BENCH_S is the least time the step starts with (300 by
# default). On the H200 that run took more than 248 s: load 133 s, calibration 18 s, choosing the expert path 74 s,
# then killed before its decode figures; give it 420 s and a call of its own (after the synth's ~65 s).
# PROFILE=DIR writes a profiler table of 16 decode steps per budget there (bench.offload --profile): which kernels
# the decode time goes to, for what bounds a figure.
# MIXTRAL=0 or DBRX=0 leaves that model's steps out; DONE="mixtral-bench dbrx-bench" counts those steps as
# done (a fresh machine has no markers: steps an earlier session's machine finished). Host memory: at 24 GB the experts' codes (~50 GB) are
# page-locked, plus the CPU path's copies.
set -u
OUT=${OUT:-/tmp/gpu-mixtral-dbrx-out}
ROOT=${ROOT:-/tmp/m-mixtral-dbrx}
LIMIT=${LIMIT:-540}
TEST_S=${TEST_S:-420}
PY=${PYTHON:-python3}
mkdir -p "$OUT" bench/results "$ROOT/done"
for s in ${DONE:-}; do touch "$ROOT/done/$s"; done
STEPS_LOG=$OUT/gpu_mixtral_dbrx.log
. "$(dirname "$0")/gpu_steps.sh"         # left, log, step, done_
export MOEDESK_COMMIT=${MOEDESK_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
export MOEDESK_HOME=${MOEDESK_HOME:-$ROOT/home}
M=$ROOT/mixtral-8x22b-3.0
D=$ROOT/dbrx-3.0

have() { [ -f "$1/README.md" ]; }       # a synthetic folder written whole (synth writes README.md last)

synth() {           # shape, dir
    rm -rf "$M" "$D"
    timeout $(( $(left) - 5 )) $PY -m runtime.cli synth --shape "$1" --bpw 3.0 --out "$2" 2>&1 | tail -2 \
        | tee -a "$OUT/gpu_mixtral_dbrx.log"
    local rc=${PIPESTATUS[0]}
    log "synth $1: exit $rc, $(du -sh "$2" 2>/dev/null | cut -f1)"
    [ "$rc" = 0 ]
}

bench_offload() {   # model dir, label, budgets
    local model=$1 label=$2 budgets=$3
    timeout $(( $(left) - 5 )) $PY -m bench.offload --model "$model" --label "$label" --bpw 3.0 \
        --budgets "$budgets" --context 4096 --prompt 2048 --decode 64 --naive-decode 8 --calibrate 64 \
        --prefetch-modes "" --placement auto ${PROFILE:+--profile "$PROFILE"} --out bench/results 2>&1 \
        | tee -a "$OUT/gpu_mixtral_dbrx.log"
    local rc=${PIPESTATUS[0]} f
    log "offload benchmark $label: exit $rc"
    f=$(ls -t bench/results/offload-"$label"-*.json 2>/dev/null | head -1)
    [ -n "$f" ] && cp "$f" "$OUT"/ && log "JSON: $f"
    [ "$rc" = 0 ]
}

chat() {            # dir, label
    timeout $(( $(left) - 5 )) $PY -m runtime.cli chat --model "$1" --backend cuda --vram-budget 24 --draft ngram \
        --max-tokens 48 --temperature 0 --json "Name three colours." > "$OUT/chat-$2.jsonl" 2> "$OUT/chat-$2.err"
    local rc=$?
    grep -E '"type": ?"(ready|loaded|finished|error)"' "$OUT/chat-$2.jsonl" | cut -c1-1500 | tee -a "$OUT/gpu_mixtral_dbrx.log"
    tail -3 "$OUT/chat-$2.err" | tee -a "$OUT/gpu_mixtral_dbrx.log"
    log "chat $2: exit $rc"
    [ "$rc" = 0 ]
}

if [ "${SYNTH_ONLY:-0}" = 1 ]; then
    [ "${MIXTRAL:-1}" = 1 ] && ! have "$M" && step mixtral-synth 60 && synth mixtral-8x22b "$M"
    exit 0
fi
log "commit $MOEDESK_COMMIT; $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null)"
log "disk: $(df -h "$ROOT" | tail -1); memory: $(free -g | awk '/Mem/ {print $2 " GB, " $7 " GB available"}')"
if [ "${DIAG:-0}" = 1 ] && step diag 90; then
    for shape in mixtral-8x22b dbrx; do
        d=$ROOT/diag-$shape
        [ -f "$d/config.json" ] || $PY -c "
import json, sys
from pathlib import Path
from runtime.exl2 import synth
out = Path(sys.argv[2])
synth.write_synthetic(sys.argv[1], 3.0, out, layers=2, seed=1)
cfg = json.loads((out / 'config.json').read_text())
if 'attn_config' in cfg:
    cfg['attn_config']['clip_qkv'] = 1.0
(out / 'config.json').write_text(json.dumps(cfg, indent=2))" "$shape" "$d" 2>&1 | tail -2
        for rows in 1 2; do
            timeout $(( $(left) - 5 )) $PY -m bench.check_reference "$d" --past 27 --rows $rows --device cuda 2>&1 \
                | tail -12 | tee -a "$OUT/gpu_mixtral_dbrx.log"
        done
        rm -rf "$d"
    done
    done_ diag
fi
if [ "${RELOAD:-0}" = 1 ] && step reload 150; then
    d=$ROOT/reload-tiny-dbrx
    [ -f "$d/README.md" ] || $PY -c "
import sys
from pathlib import Path
sys.path.insert(0, 'tests/gpu')
from test_mixtral_dbrx_gpu import _synth
_synth('tiny-dbrx', 2, Path(sys.argv[1]))" "$d" 2>&1 | tail -2
    timeout $(( $(left) - 5 )) $PY -m bench.check_reload "$d" --rechoose --loads 6 2>&1 | tail -12 \
        | tee -a "$OUT/gpu_mixtral_dbrx.log"
    done_ reload
fi
if [ "${TESTS:-1}" = 1 ] && step tests 120; then
    MOEDESK_GPU_MODELS="$ROOT/gpu-models" MOEDESK_GPU_REPORT="$OUT/gpu_tests.jsonl" \
        timeout -s INT -k 20 "$(( TEST_S < $(left) ? TEST_S : $(left) ))" $PY -m pytest tests/gpu/test_mixtral_dbrx_gpu.py \
        -v -rA -p no:cacheprovider --basetemp="$ROOT/pytest" > "$OUT/gpu_tests.log" 2>&1
    rc=$?
    grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/gpu_tests.log" | tail -24 | tee -a "$OUT/gpu_mixtral_dbrx.log"
    log "GPU tests: exit $rc (124: out of time)"
    [ "$rc" = 0 ] && done_ tests
    rm -rf "$ROOT/pytest" "$ROOT/gpu-models"
fi
if [ "${MIXTRAL:-1}" = 1 ]; then
    [ -f "$ROOT/done/mixtral-bench" ] && [ -f "$ROOT/done/mixtral-chat" ] || have "$M" \
        || { step mixtral-synth 60 && synth mixtral-8x22b "$M"; }
    have "$M" && step mixtral-bench "${MIXTRAL_BENCH_S:-300}" && bench_offload "$M" mixtral-8x22b "${MIXTRAL_BUDGETS:-130,24}" \
        && done_ mixtral-bench
    have "$M" && step mixtral-chat 150 && chat "$M" mixtral-8x22b && done_ mixtral-chat
fi
if [ "${DBRX:-1}" = 1 ] && { [ "${MIXTRAL:-1}" = 0 ] || [ -f "$ROOT/done/mixtral-chat" ]; }; then
    [ -f "$ROOT/done/dbrx-bench" ] && [ -f "$ROOT/done/dbrx-chat" ] || have "$D" \
        || { step dbrx-synth 60 && synth dbrx "$D"; }
    have "$D" && step dbrx-bench 220 && bench_offload "$D" dbrx 24 && done_ dbrx-bench
    have "$D" && step dbrx-chat 150 && chat "$D" dbrx && done_ dbrx-chat
fi
log "done: $(ls "$ROOT/done" | tr '\n' ' ')"
