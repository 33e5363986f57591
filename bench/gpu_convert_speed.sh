#!/usr/bin/env bash
# The batched converter's speed and quality on the GPU, in steps that a warm machine resumes
# (markers under $ROOT/done), each call at most LIMIT seconds (560 by default). STEPS picks which are tried, in
# this order (default "speed tests q125": the headline first):
#   speed    `python -m bench.convert_memory --shape qwen3.5-122b-a10b --layers 2 --vocab 32768 --device cuda
#            --vram-gb 24`: a random bf16 checkpoint of Qwen3.5-122B-A10B's real layer width (256 experts of
#            3072 x 1024, a Gated DeltaNet layer and a gated-attention layer; 10 GB on /tmp) converted on the GPU
#            with torch's memory capped at 24 GiB as on a 24 GB card, at the converter's defaults (32 x 512
#            calibration tokens, measured allocation, 3.0 bpw): per layer the seconds of each step and the peak
#            GPU memory, and the projection for the 48 layers, the MTP head and the head, beside the recorded
#            figure of the code before (--baseline: 1,592 s a layer, 21.2 h, q125-a11 on the H200). Its JSON is
#            rewritten after every layer, so a call cut by the limit keeps the layers it finished.
#   tests    tests/gpu/test_convert_gpu.py: the converter on CUDA against the CPU (Qwen3-MoE, Qwen3.5-MoE, every
#            budget) and the batched GPTQ of experts x widths on CUDA against the CPU's
#   q125     the speed step's benchmark at the q125-a11 shape (Qwen3-MoE, 128 experts of 4096 x 1536, one layer,
#            no cap): the shape the recorded figure was measured on, like for like
#   quality  the demo's perplexity table with our converter on CUDA (bench.convert_quality --device cuda --methods
#            rtn gptq) through bench/gpu_converter.sh, which assembles the demo's GGUF from two halves carried in
#            two calls (its header; needs the gguf wheel in .whl/): `SPLIT=1 bash bench/gpu_converter.sh` here
#            first, then a call carrying .gguf-parts/1 (no preamble: `STEPS=quality bash
#            bench/gpu_convert_speed.sh`), then one carrying .gguf-parts/2 and .whl (with the preamble, the same
#            command). Its work folder is $ROOT/converter: a call cut short resumes there.
# Assumes `source .whl/preamble.sh`; run from the repository root. JSON goes to bench/results/ and, with a log,
# to $OUT.
set -u
OUT=${OUT:-/tmp/convert-speed-out}
ROOT=${ROOT:-/tmp/convert-speed}
LIMIT=${LIMIT:-560}
PY=${PYTHON:-python3}
STEPS=${STEPS:-"speed tests q125"}
BASELINE=bench/results/convert-memory-q125-a11-cuda-20261204T0116.json
mkdir -p "$OUT" "$ROOT/done" bench/results
for d in ${DONE:-}; do touch "$ROOT/done/$d"; done
MARK=$(mktemp)
STEPS_LOG=$OUT/gpu_convert_speed.log
. "$(dirname "$0")/gpu_steps.sh"         # left, log, step, done_
export MOEDESK_COMMIT=${MOEDESK_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
log "commit $MOEDESK_COMMIT; $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null); steps $STEPS; $(df -h /tmp | tail -1)"

convert_memory() {      # step name, then bench.convert_memory's arguments
    local name=$1; shift
    timeout $(( $(left) - 10 )) $PY -m bench.convert_memory "$@" --device cuda --baseline "$BASELINE" 2>&1 \
        | grep -v "Token indices" | tail -20 | tee -a "$STEPS_LOG"
    local rc=${PIPESTATUS[0]}
    log "convert_memory $name: exit $rc"
    [ "$rc" = 0 ] && done_ "$name"
}

for s in $STEPS; do
    case "$s" in
    speed)
        step speed 300 && convert_memory speed --shape qwen3.5-122b-a10b --layers 2 --vocab 32768 --vram-gb 24 \
            --work "$ROOT/qwen35" --note "the GPU capped at 24 GiB (torch's per-process memory fraction)" ;;
    tests)
        if step tests 150; then
            timeout $(( $(left) - 10 )) $PY -m pytest tests/gpu/test_convert_gpu.py -q -p no:cacheprovider 2>&1 \
                | tail -8 | tee -a "$STEPS_LOG"
            [ "${PIPESTATUS[0]}" = 0 ] && done_ tests
        fi ;;
    q125)
        step q125 300 && convert_memory q125 --shape q125-a11 --layers 1 --vocab 32768 --work "$ROOT/q125" \
            --note "the recorded figure's shape, all 128 experts" ;;
    quality)
        if [ ! -f "$ROOT/done/quality" ]; then
            OUT=$OUT ROOT=$ROOT/converter LIMIT=$(left) METHODS="rtn gptq" \
                DONE="exllamav2-measure exllamav2-2.5 exllamav2-3 exllamav2-4 exllamav2-6 memory" \
                bash "$(dirname "$0")/gpu_converter.sh"
            [ -f "$ROOT/converter/done/quality" ] && done_ quality
        fi ;;
    *)
        log "unknown step $s (speed, tests, q125 or quality)"; exit 2 ;;
    esac
done
find bench/results -maxdepth 1 -name "convert*.json" -newer "$MARK" -exec cp {} "$OUT"/ \; 2>/dev/null
log "done: $(ls "$ROOT/done" | tr '\n' ' ')"
