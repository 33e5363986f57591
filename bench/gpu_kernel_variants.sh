#!/usr/bin/env bash
# Kernel variants on the H200 (the prefill kernels' input orders, the engine's switches), in one call
# of at most LIMIT seconds (420 by default):
#   grouped  `python -m bench.grouped` on one MoE layer of each SHAPES (default qwen3-30b-a3b, mixtral-8x22b,
#            dbrx), ROWS rows (default 512 2048): the same layer read through the permutations per tile (as
#            before) and in its one input order (the Hub's files), a few launch shapes each; JSON per shape
#   tests    the grouped kernels' GPU test in each order (tests/gpu/test_exl2_engine.py -k input_order) and the
#            one-launch MoE entry's (tests/gpu/test_route_normed_gpu.py)
#   prologue PROLOGUE=1 (default): attention's decode prologue three ways, one layer at 4 and 3 bits
#            (`python -m bench.check_dense_gemv --check --prologue`), and its GPU test at real size
#   engine   `python -m bench.cuda --baseline none --profile` on qwen3-30b-a3b at 4.0 bpw (written here, ~16 GB):
#            prefill of 512 and 4096 tokens, time to first token, decode, kernels per token and the GPU's busy
#            fraction (ENGINE=0 leaves it out); once per VARIANTS entry, LABEL:VAR=VALUE[,VAR=VALUE...] (default:
#            fused, the MoE block's norm and routing in three launches; one-launch, every one-launch switch below
#            at once (qkv-normed's and finish's); normed, the norm and routing in one (MOEDESK_ROUTE=normed,
#            runtime/experts/route_normed.py); dense, attention's q/k/v/o through our split-K GEMV
#            (MOEDESK_DENSE_GEMV=1, runtime/experts/linear_gemv.py); dense-normed, both; align, the prefill's
#            pairs sorted in one launch, MOEDESK_ALIGN=kernel, runtime/experts/align_kernel.py; rows, the MoE
#            GEMVs' tiles summed by rows of code words, MOEDESK_GEMV_SUMS=rows, runtime/experts/gemv_rows.py;
#            qkv-normed, attention's prologue in one launch and the MoE block's routing in one,
#            MOEDESK_QKV_FUSED=1,MOEDESK_ROUTE=normed, runtime/experts/qkv_prologue.py; finish, the decode experts
#            in two launches, the residual added by down's, MOEDESK_MOE_FINISH=1, runtime/experts/moe_finish.py),
#            in the list's order.
#   q125     Q125=1: the same on q125-a11 at 3.0 bpw all in VRAM (~50 GB written here), VARIANTS_Q125 (default:
#            fused and one-launch), decode only (prompt 512). SHAPES="" leaves the grouped step out. The profiles go into
#            $OUT/prof.tar.gz (one file: the call brings back 8 at most).
# Assumes exllamav2's extension is ready and the Python deps importable (`source .whl/preamble.sh`); run from
# the repository root. JSON goes into bench/results/ and, with a log, into $OUT.
set -u
OUT=${OUT:-/tmp/gpu-kernel-variants-out}
LIMIT=${LIMIT:-420}
ROOT=${ROOT:-/tmp/m-variants}
PY=${PYTHON:-python3}
SHAPES=${SHAPES-"qwen3-30b-a3b mixtral-8x22b dbrx"}   # set and empty: no grouped step
ROWS=${ROWS:-"512 2048"}
VARIANTS=${VARIANTS:-"fused:MOEDESK_ROUTE=fused one-launch:MOEDESK_QKV_FUSED=1,MOEDESK_ROUTE=normed,MOEDESK_MOE_FINISH=1
normed:MOEDESK_ROUTE=normed qkv-normed:MOEDESK_QKV_FUSED=1,MOEDESK_ROUTE=normed finish:MOEDESK_MOE_FINISH=1
dense:MOEDESK_DENSE_GEMV=1 dense-normed:MOEDESK_DENSE_GEMV=1,MOEDESK_ROUTE=normed align:MOEDESK_ALIGN=kernel
rows:MOEDESK_GEMV_SUMS=rows"}
VARIANTS_Q125=${VARIANTS_Q125:-"fused:MOEDESK_ROUTE=fused one-launch:MOEDESK_QKV_FUSED=1,MOEDESK_ROUTE=normed,MOEDESK_MOE_FINISH=1"}
CONFIGS=${CONFIGS:-"16,64,64,64,4,0 16,64,128,64,8,0 16,64,128,64,8,3 16,128,128,64,8,3"}
mkdir -p "$OUT" "$ROOT" bench/results
STEPS_LOG=$OUT/gpu_kernel_variants.log
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
            --configs $CONFIGS --json "$f" 2>&1 | tee -a "$OUT/gpu_kernel_variants.log"
        log "grouped $shape $rows rows: exit ${PIPESTATUS[0]}"
        [ -f "$f" ] && cp "$f" "$OUT"/
    done
done
if [ "$(left)" -ge 90 ]; then
    timeout $(( $(left) - 20 )) $PY -m pytest tests/gpu/test_route_normed_gpu.py -rA -p no:cacheprovider \
        "tests/gpu/test_exl2_engine.py::test_grouped_kernels_in_the_layers_input_order_at_real_size" 2>&1 \
        | grep -E "PASSED|FAILED|ERROR|passed|failed|Error" | tail -8 | tee -a "$OUT/gpu_kernel_variants.log"
fi
if [ "${PROLOGUE:-1}" = 1 ] && [ "$(left)" -ge 120 ]; then
    timeout $(( $(left) - 60 )) $PY -m bench.check_dense_gemv --check --bits 4,3 --prologue 2>&1 \
        | tee -a "$OUT/gpu_kernel_variants.log"
    log "check_dense_gemv --prologue: exit ${PIPESTATUS[0]}"
    timeout $(( $(left) - 30 )) $PY -m pytest -m gpu -rA -p no:cacheprovider \
        "tests/gpu/test_dense_gemv_gpu.py::test_one_launch_prologue_at_real_size_eager_and_in_a_graph" 2>&1 \
        | grep -E "PASSED|FAILED|ERROR|passed|failed|Error" | tail -6 | tee -a "$OUT/gpu_kernel_variants.log"
fi
engine() {          # model dir, label, bpw, prompts, variants: bench.cuda once per variant
    local dir=$1 label=$2 bpw=$3 prompts=$4 v name envs
    for v in $5; do
        name=${v%%:*}
        envs=${v#*:}
        [ "$(left)" -ge 100 ] || { log "bench.cuda $label $name waits: $(left) s left"; continue; }
        # shellcheck disable=SC2046
        env $(echo "$envs" | tr ',' ' ') timeout $(( $(left) - 10 )) $PY -m bench.cuda --model "$dir" \
            --label "$label-$name" --bpw "$bpw" --prompts "$prompts" --decode 128 --baseline none \
            --profile "$OUT/prof" --note "kernel variant: $envs" 2>&1 | tail -6 | tee -a "$OUT/gpu_kernel_variants.log"
        log "bench.cuda $label $name ($envs): exit ${PIPESTATUS[0]}"
    done
}
if [ "${ENGINE:-1}" = 1 ] && [ "$(left)" -ge 150 ]; then
    [ -f "$ROOT/q30b/README.md" ] || $PY -m runtime.cli synth --shape qwen3-30b-a3b --bpw 4.0 --out "$ROOT/q30b" \
        | tail -1
    engine "$ROOT/q30b" qwen3-30b-a3b 4.0 512,4096 "$VARIANTS"
fi
if [ "${Q125:-0}" = 1 ] && [ "$(left)" -ge 200 ]; then
    [ -f "$ROOT/q125/README.md" ] || $PY -m runtime.cli synth --shape q125-a11 --bpw 3.0 --out "$ROOT/q125" | tail -1
    engine "$ROOT/q125" q125-a11 3.0 512 "$VARIANTS_Q125"
fi
find bench/results -maxdepth 1 -name "cuda-*.json" -newer "$MARK" -exec cp {} "$OUT"/ \; 2>/dev/null
pack_profiles
log "done"
