#!/usr/bin/env bash
# Issue "what the user runs is what we measure", on the H200 in one call (about 9 minutes at most).
# Assumes exllamav2's extension is ready and the Python deps importable (e.g. after
# `source .whl/preamble.sh`); run from the repository root. Writes JSON into bench/results/ and copies
# it, with a log, into $OUT.
#   1. synthesize q125-a11 at 3.0 bpw into /tmp/m/q125 (skipped when present)
#   2. the worker benchmark at a 24 GB budget: the first answer after load, five turns, plain decoding
#      and n-gram drafting side by side (a code edit that drafting should speed up, new text where
#      drafts rarely match)
#   3. loads at 24 GB under uniform routing, each deciding the CPU expert path from measured steps,
#      as many as the time left allows
set -u
OUT=${OUT:-/tmp/issue19-out}
MODEL=${MODEL:-/tmp/m/q125}
LIMIT=${LIMIT:-530}                       # seconds for the whole script
PY=${PYTHON:-python3}
mkdir -p "$OUT" bench/results
T0=$(date +%s)
left() { echo $(( LIMIT - ($(date +%s) - T0) )); }
log() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a "$OUT/gpu_issue19.log"; }
export MOEDESK_COMMIT=${MOEDESK_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
log "commit $MOEDESK_COMMIT; $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null)"

if [ ! -f "$MODEL/config.json" ]; then
    log "synth q125-a11 3.0 bpw -> $MODEL"
    rm -rf "$MODEL"
    timeout 240 $PY -m runtime.cli synth --shape q125-a11 --bpw 3.0 --out "$MODEL" 2>&1 | tail -2 | tee -a "$OUT/gpu_issue19.log"
fi
log "synth done ($(du -sh "$MODEL" 2>/dev/null | cut -f1))"

budget=$(( $(left) - 130 ))                # leave time for at least one placement load
[ "$budget" -lt 120 ] && budget=$(( $(left) - 10 ))
log "worker benchmark at 24 GB (at most $budget s)"
timeout "$budget" $PY -m runtime.cli bench-worker --model "$MODEL" --backend cuda --vram-budget 24 \
    --label q125-a11-24gb --max-tokens 160 --draft both --out bench/results 2>&1 | tee -a "$OUT/gpu_issue19.log"
log "worker benchmark: exit ${PIPESTATUS[0]}"

log "placement loads at 24 GB (uniform routing), $(left) s left"
if [ "$(left)" -gt 100 ]; then
    timeout $(( $(left) - 5 )) $PY -m bench.placement_loads --model "$MODEL" --label q125-a11 --bpw 3.0 \
        --vram-budget 24 --loads 5 --trials 2 --deadline-s $(( $(left) - 110 )) --out bench/results 2>&1 \
        | tee -a "$OUT/gpu_issue19.log"
fi
log "done"
cp bench/results/worker-q125-a11-24gb-*.json bench/results/placement-loads-q125-a11-*.json "$OUT"/ 2>/dev/null
ls -la "$OUT" | tee -a "$OUT/gpu_issue19.log"
