#!/usr/bin/env bash
# The converter's speed on the GPU (issue 54): one step per call, each at most LIMIT seconds (560 by default).
#   speed    (default) `python -m bench.convert_memory --shape qwen3.5-122b-a10b --layers 2 --vocab 32768
#            --device cuda --vram-gb 24`: a random bf16 checkpoint of Qwen3.5-122B-A10B's real layer width (256
#            experts of 3072 x 1024, a Gated DeltaNet layer and a gated-attention layer, the MTP head left out),
#            converted on the GPU with its memory capped at 24 GiB as on a 24 GB card, at the converter's defaults
#            (32 x 512 calibration tokens, measured allocation, 3.0 bpw); per layer the seconds of each step and the
#            peak GPU memory, and the projection for the 48 layers, the MTP head and the head, beside the recorded
#            figure of the code before (--baseline: 1,592 s a layer, 21.2 h, q125-a11 on the H200)
#   q125     the same for the q125-a11 shape (Qwen3-MoE, 128 experts of 4096 x 1536, one layer; no cap): the
#            shape the recorded figure was measured on, for a like-for-like before and after
#   quality  the demo's perplexity table (bench.convert_quality --device cuda --methods rtn gptq) through
#            bench/gpu_issue23.sh, which first needs the demo's GGUF carried in two halves (see its header:
#            `SPLIT=1 bash bench/gpu_issue23.sh` here, then carry .gguf23/1 and .gguf23/2 in two calls)
# STEP=speed|q125|quality. Assumes `source .whl/preamble.sh`; run from the repository root. JSON goes to
# bench/results/ and, with a log, to $OUT.
set -u
OUT=${OUT:-/tmp/convert-speed-out}
LIMIT=${LIMIT:-560}
PY=${PYTHON:-python3}
STEP=${STEP:-speed}
BASELINE=bench/results/convert-memory-q125-a11-cuda-20261204T0116.json
mkdir -p "$OUT" bench/results
MARK=$(mktemp)
STEPS_LOG=$OUT/gpu_convert_speed.log
. "$(dirname "$0")/gpu_steps.sh"         # left, log
export MOEDESK_COMMIT=${MOEDESK_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
log "commit $MOEDESK_COMMIT; $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null); step $STEP"

case "$STEP" in
speed)
    timeout $(( $(left) - 5 )) $PY -m bench.convert_memory --shape qwen3.5-122b-a10b --layers 2 --vocab 32768 \
        --device cuda --vram-gb 24 --work /tmp/convert54 --baseline "$BASELINE" \
        --note "issue 54: the GPU capped at 24 GiB (torch's per-process memory fraction)" 2>&1 \
        | grep -v "Token indices" | tail -20 | tee -a "$STEPS_LOG"
    log "convert_memory qwen3.5: exit ${PIPESTATUS[0]}" ;;
q125)
    timeout $(( $(left) - 5 )) $PY -m bench.convert_memory --shape q125-a11 --layers 1 --vocab 32768 \
        --device cuda --work /tmp/convert54-q125 --baseline "$BASELINE" \
        --note "issue 54: the recorded figure's shape, all 128 experts" 2>&1 \
        | grep -v "Token indices" | tail -20 | tee -a "$STEPS_LOG"
    log "convert_memory q125-a11: exit ${PIPESTATUS[0]}" ;;
quality)
    OUT=$OUT LIMIT=$(left) METHODS="rtn gptq" \
        DONE="exllamav2-measure exllamav2-2.5 exllamav2-3 exllamav2-4 exllamav2-6 memory" \
        bash "$(dirname "$0")/gpu_issue23.sh" ;;
*)
    log "unknown STEP=$STEP (speed, q125 or quality)"; exit 2 ;;
esac
find bench/results -maxdepth 1 -name "convert*.json" -newer "$MARK" -exec cp {} "$OUT"/ \; 2>/dev/null
log "done"
