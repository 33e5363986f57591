#!/usr/bin/env bash
# What the user runs, measured as the app runs it: the worker benchmark, the warm-up and routing-prior GPU
# tests and repeated loads at a 24 GB budget, on the H200 in one call (about 9 minutes at most).
# Assumes exllamav2's extension is ready and the Python deps importable (e.g. after
# `source .whl/preamble.sh`); run from the repository root. Writes JSON into bench/results/ and copies
# it, with a log, into $OUT.
#   1. synthesize q125-a11 at 3.0 bpw into /tmp/m/q125 (skipped when present; ~35 s)
#   2. the worker benchmark at a 24 GB budget on ONE load (~250 s on a fresh machine, where Triton
#      compiles every kernel): five user turns, each answered with plain decoding and with n-gram
#      drafting taking turns in one conversation (the first answer after load plain); its JSON is
#      written after every answer and holds the load's stages with their wall time. The model's saved
#      routing statistics are removed first, so the load is its first: the routing prior is measured
#      ("Placing experts: from a calibration prompt" in the stages)
#   2b. the same at temperature 1 for two turns (the synthetic model's sampled text: drafts rarely match)
#   3. the warm-up and routing-prior GPU tests (~150 s): idle captures leave the cached K/V rows bit
#      for bit; a first load places by the prior and its first answer hits as the steady state
#   4. loads at 24 GB under uniform routing with the time left, each placed from uniform statistics;
#      the first times both expert paths under uniform routing (saved apart from the model's own
#      routing), the later ones reuse its decision; each with its stages' wall time
# ONLY=placement: steps 1 and 4 alone (five loads in about 6 minutes on the H200; LIMIT=590)
set -u
OUT=${OUT:-/tmp/gpu-app-path-out}
MODEL=${MODEL:-/tmp/m/q125}
LIMIT=${LIMIT:-560}                       # seconds for the whole script
PY=${PYTHON:-python3}
mkdir -p "$OUT" bench/results
STEPS_LOG=$OUT/gpu_app_path.log
. "$(dirname "$0")/gpu_steps.sh"         # T0, left, log
STAMP=$(mktemp); trap 'rm -f "$STAMP"' EXIT
newest() { find bench/results -maxdepth 1 -name "$1" -newer "$STAMP" -printf '%T@ %p\n' 2>/dev/null | sort -nr | head -1 | cut -d' ' -f2; }   # this run's only
export MOEDESK_COMMIT=${MOEDESK_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
log "commit $MOEDESK_COMMIT; $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null)"
log "Triton cache: $(ls "${TRITON_CACHE_DIR:-$HOME/.triton/cache}" 2>/dev/null | wc -l) kernels"

if [ ! -f "$MODEL/config.json" ]; then
    log "synth q125-a11 3.0 bpw -> $MODEL"
    rm -rf "$MODEL"
    timeout 240 $PY -m runtime.cli synth --shape q125-a11 --bpw 3.0 --out "$MODEL" 2>&1 | tail -2 | tee -a "$OUT/gpu_app_path.log"
fi
log "synth done"

if [ "${ONLY:-}" != placement ]; then
STATS=$($PY -c "import sys; from pathlib import Path; from runtime.offload.routing_stats import stats_path; \
from runtime.paths import cache_dir; print(stats_path(cache_dir(), Path(sys.argv[1])))" "$MODEL")
rm -f "$STATS" && log "routing statistics of the model removed: the worker's load is its first"
budget=$(( $(left) - 160 ))                # the GPU tests after it; the JSON is on disk after every answer
log "worker benchmark at 24 GB, both draft modes on one load (at most $budget s)"
timeout "$budget" $PY -m runtime.cli bench-worker --model "$MODEL" --backend cuda --vram-budget 24 \
    --label q125-a11-24gb --max-tokens 160 --draft both --out bench/results 2>&1 | tee -a "$OUT/gpu_app_path.log"
log "worker benchmark: exit ${PIPESTATUS[0]}"
W=$(newest "worker-q125-a11-24gb-NVIDIA*.json")
log "worker JSON: ${W:-none}"
[ -n "$W" ] && cp "$W" "$OUT"/
[ -n "$W" ] && log "routing prior at load: $(grep -o 'from a calibration prompt' "$W" | wc -l) mention(s) in the load's stages"

if [ "$(left)" -gt 190 ]; then              # text where drafts rarely match: sampled at temperature 1
    log "worker benchmark at 24 GB, sampled (drafts rarely match), two turns"
    timeout $(( $(left) - 150 )) $PY -m runtime.cli bench-worker --model "$MODEL" --backend cuda --vram-budget 24 \
        --label q125-a11-24gb-t1 --max-tokens 160 --draft both --turns 2 --temperature 1.0 --out bench/results 2>&1 \
        | tail -12 | tee -a "$OUT/gpu_app_path.log"
    W=$(newest "worker-q125-a11-24gb-t1-*.json")
    [ -n "$W" ] && cp "$W" "$OUT"/
fi

if [ "$(left)" -gt 70 ]; then
    log "GPU warm-up and routing-prior tests"
    MOEDESK_GPU_REPORT="$OUT/route_prior.jsonl" timeout $(( $(left) - 5 )) $PY -m pytest \
        tests/gpu/test_warmup_gpu.py tests/gpu/test_route_prior_gpu.py -q -s 2>&1 | tail -20 \
        | tee -a "$OUT/gpu_app_path.log"
fi

fi

log "placement loads at 24 GB (uniform routing), $(left) s left"
if [ "$(left)" -gt 150 ]; then
    timeout $(( $(left) - 5 )) $PY -m bench.placement_loads --model "$MODEL" --label q125-a11 --bpw 3.0 \
        --vram-budget 24 --loads 5 --deadline-s $(( $(left) - 15 )) --out bench/results 2>&1 \
        | tee -a "$OUT/gpu_app_path.log"
    P=$(newest "placement-loads-q125-a11-*.json")
    log "placement JSON: ${P:-none}"
    [ -n "$P" ] && cp "$P" "$OUT"/
fi
log "done"
ls -la "$OUT" | tee -a "$OUT/gpu_app_path.log"
