#!/usr/bin/env bash
# The prefill kernels' input orders on the H200, in one call of at most LIMIT seconds (420 by default):
#   grouped  `python -m bench.grouped` on one MoE layer of each SHAPES (default qwen3-30b-a3b, mixtral-8x22b,
#            dbrx), ROWS rows (default 512 2048): the same layer read through the permutations per tile (as
#            before) and in its one input order (the Hub's files), a few launch shapes each; JSON per shape
#   tests    the grouped kernels' GPU test in each order (tests/gpu/test_exl2_engine.py -k input_order) and the
#            one-launch MoE entry's (tests/gpu/test_route_normed_gpu.py)
#   engine   `python -m bench.cuda --baseline none` on qwen3-30b-a3b at 4.0 bpw (written here, ~16 GB):
#            prefill of 512 and 4096 tokens, time to first token, decode, kernels per token (ENGINE=0 leaves
#            it out); once per ROUTES (default "fused normed": the MoE block's norm and routing in three
#            launches, then in one, runtime/experts/route_normed.py). SHAPES="" leaves the grouped step out.
# Assumes exllamav2's extension is ready and the Python deps importable (`source .whl/preamble.sh`); run from
# the repository root. JSON goes into bench/results/ and, with a log, into $OUT.
set -u
OUT=${OUT:-/tmp/issue25-out}
LIMIT=${LIMIT:-420}
ROOT=${ROOT:-/tmp/m25}
PY=${PYTHON:-python3}
SHAPES=${SHAPES-"qwen3-30b-a3b mixtral-8x22b dbrx"}   # set and empty: no grouped step
ROWS=${ROWS:-"512 2048"}
ROUTES=${ROUTES:-"fused normed"}           # the engine step once per MOEDESK_ROUTE, in this order
CONFIGS=${CONFIGS:-"16,64,64,64,4,0 16,64,128,64,8,0 16,64,128,64,8,3 16,128,128,64,8,3"}
mkdir -p "$OUT" "$ROOT" bench/results
STEPS_LOG=$OUT/gpu_issue25.log
. "$(dirname "$0")/gpu_steps.sh"         # T0, left, log
MARK=$(mktemp)                   # results written after this are this run's
export MOEDESK_COMMIT=${MOEDESK_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
export MOEDESK_HOME=${MOEDESK_HOME:-$ROOT/home}
STAMP=$(date +%Y%m%d-%H%M%S)
log "commit $MOEDESK_COMMIT; $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null)"
for shape in $SHAPES; do
    for rows in $ROWS; do
        [ "$(left)" -ge 60 ] || { log "grouped $shape $rows rows waits: $(left) s left"; continue; }
        f=bench/results/grouped-orders-$shape-$rows-$STAMP.json
        # shellcheck disable=SC2086
        timeout $(( $(left) - 30 )) $PY -m bench.grouped --shape "$shape" --rows "$rows" --orders gathered layer \
            --configs $CONFIGS --json "$f" 2>&1 | tee -a "$OUT/gpu_issue25.log"
        log "grouped $shape $rows rows: exit ${PIPESTATUS[0]}"
        [ -f "$f" ] && cp "$f" "$OUT"/
    done
done
if [ "$(left)" -ge 90 ]; then
    timeout $(( $(left) - 20 )) $PY -m pytest tests/gpu/test_route_normed_gpu.py -rA -p no:cacheprovider \
        "tests/gpu/test_exl2_engine.py::test_grouped_kernels_in_the_layers_input_order_at_real_size" 2>&1 \
        | grep -E "PASSED|FAILED|ERROR|passed|failed|Error" | tail -8 | tee -a "$OUT/gpu_issue25.log"
fi
if [ "${ENGINE:-1}" = 1 ] && [ "$(left)" -ge 150 ]; then
    [ -f "$ROOT/q30b/README.md" ] || $PY -m runtime.cli synth --shape qwen3-30b-a3b --bpw 4.0 --out "$ROOT/q30b" | tail -1
    for route in $ROUTES; do
        [ "$(left)" -ge 100 ] || { log "bench.cuda route $route waits: $(left) s left"; continue; }
        MOEDESK_ROUTE=$route timeout $(( $(left) - 10 )) $PY -m bench.cuda --model "$ROOT/q30b" \
            --label qwen3-30b-a3b --bpw 4.0 --prompts 512,4096 --decode 128 --baseline none \
            --note "issue 25: route $route" 2>&1 | tail -20 | tee -a "$OUT/gpu_issue25.log"
        log "bench.cuda route $route: exit ${PIPESTATUS[0]}"
    done
    find bench/results -maxdepth 1 -name "cuda-qwen3-30b-a3b*.json" -newer "$MARK" -exec cp {} "$OUT"/ \; 2>/dev/null
fi
log "done"
