#!/usr/bin/env bash
# The batched converter's speed and quality on the GPU, in steps that a warm machine resumes.
#
# Usage, from the repository root on a GPU machine where `source .whl/preamble.sh` was done:
#   OUT=/tmp/convert-speed-out bash bench/gpu_convert_speed.sh speed     # the headline figure: one H100, <= ~5 min
#   OUT=/tmp/convert-speed-out bash bench/gpu_convert_speed.sh [STEP...] # default: speed tests attention q125
#   bash bench/gpu_convert_speed.sh -n speed      # prints the commands a step would run, runs nothing
#   bash bench/gpu_convert_speed.sh --help        # this header
#   OUT=/tmp/x bash bench/gpu_convert_speed.sh check   # no GPU: the speed step's path on the CPU at a tiny shape
# $OUT (default /tmp/convert-speed-out) gets each step's JSON as it is written, and the log gpu_convert_speed.log;
# the GPU's JSON are copied into bench/results/ at the end. Steps done are marked under $ROOT/done (default
# /tmp/convert-speed) and skipped by the next call on a warm machine (DONE="a b" marks steps done by hand); each
# call stops its steps at LIMIT seconds (530 by default: under 10 minutes with the preamble's minute). The steps
# (STEPS="..." picks them too):
#   speed      the headline figure in one call: `python -m bench.convert_memory --shape qwen3.5-122b-a10b --layers 1
#              --deltanet-only --vocab 32768 --device cuda --vram-gb 24`: a random bf16 checkpoint of one Gated
#              DeltaNet layer of Qwen3.5-122B-A10B at its real width (256 experts of 3072 x 1024; the kind of 36 of
#              its 48 layers) and the head at a vocabulary of 32,768 (5 GB on /tmp), converted on the GPU with
#              torch's memory capped at 24 GiB as on a 24 GB card, at the converter's defaults (32 x 512
#              calibration tokens, measured allocation, 3.0 bpw): the layer's seconds per step and peak GPU
#              memory, and the projection for the 48 layers, the MTP head and the head (the 12 attention layers
#              and the MTP head counted at the DeltaNet layer's time), beside the recorded figure of the code
#              before (--baseline: 1,592 s a layer, 21.2 h, q125-a11 on the H200). Target: <= ~220 s a layer,
#              <= 3 h projected. Time: writing the checkpoint ~30 s (the H200 wrote q125-a11's 1.1 GB cut in 7.6 s;
#              this one's 5 GB are mostly copies of 16 drawn experts), loading and the calibration set ~15 s, the
#              layer itself (not measured on a GPU yet: at the target <= 220 s), the head and assembly ~10 s
#              (11.5 s for q125-a11's 32768 x 4096 head at the code before): ~1 min plus the layer, <= ~5 min at
#              the target. Its JSON is written into $OUT after the layer and again at the end, so a call cut by
#              the limit keeps the layer.
#   tests      tests/gpu/test_convert_gpu.py: the converter on CUDA against the CPU (Qwen3-MoE, Qwen3.5-MoE, every
#              budget) and the batched GPTQ of experts x widths on CUDA against the CPU's (needs 150 s left)
#   attention  as speed with the gated-attention layer instead (`--layers 1` without --deltanet-only): the other
#              kind's time, for the 12 attention layers and the MTP head (as long as speed)
#   q125       the same benchmark at the q125-a11 shape (Qwen3-MoE, 128 experts of 4096 x 1536, one layer, no
#              cap): the shape the recorded figure was measured on, like for like (as long as speed, or longer)
#   quality    the demo's perplexity table with our converter on CUDA (bench.convert_quality --device cuda --methods
#              rtn gptq) through bench/gpu_converter.sh, which assembles the demo's GGUF from two halves carried in
#              two calls (its header; needs the gguf wheel in .whl/): `SPLIT=1 bash bench/gpu_converter.sh` here
#              first, then a call carrying .gguf-parts/1 (no preamble: `bash
#              bench/gpu_convert_speed.sh quality`), then one carrying .gguf-parts/2 and .whl (with the preamble, the same
#              command). Its work folder is $ROOT/converter: a call cut short resumes there.
#   check      no GPU needed: the speed step's command on the CPU at tiny-qwen3.5 (one DeltaNet layer, 8 experts,
#              ~10 s on 2 cores), to try the script, the JSON under $OUT and the projection without a GPU; its
#              JSON stays in $OUT
set -u
usage() { sed -n '2,/^set -u$/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }
DRY=0
ARGS=()
for a in "$@"; do
    case "$a" in
    -h|--help) usage; exit 0 ;;
    -n|--dry-run) DRY=1 ;;
    speed|tests|attention|q125|quality|check) ARGS+=("$a") ;;
    *) echo "gpu_convert_speed.sh: unknown step or option '$a' (steps: speed tests attention q125 quality check;" \
            "options: -n, --help)" >&2; exit 2 ;;
    esac
done
OUT=${OUT:-/tmp/convert-speed-out}
ROOT=${ROOT:-/tmp/convert-speed}
LIMIT=${LIMIT:-530}
PY=${PYTHON:-python}
command -v "$PY" >/dev/null 2>&1 || PY=python3
if [ ${#ARGS[@]} -gt 0 ]; then STEPS="${ARGS[*]}"; else STEPS=${STEPS:-"speed tests attention q125"}; fi
for s in $STEPS; do
    case "$s" in speed|tests|attention|q125|quality|check) ;;
    *) echo "gpu_convert_speed.sh: unknown step '$s' in STEPS (speed tests attention q125 quality check)" >&2; exit 2 ;;
    esac
done
BASELINE=bench/results/convert-memory-q125-a11-cuda-20261204T0116.json
mkdir -p "$OUT" "$ROOT/done" bench/results
for d in ${DONE:-}; do touch "$ROOT/done/$d"; done
MARK=$(mktemp)
STEPS_LOG=$OUT/gpu_convert_speed.log
. "$(dirname "$0")/gpu_steps.sh"         # left, log, step, done_
export MOEDESK_COMMIT=${MOEDESK_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
log "commit $MOEDESK_COMMIT; $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null || echo no GPU); steps $STEPS; $(df -h /tmp | tail -1)"

convert_memory() {      # step name, then bench.convert_memory's arguments (a --device among them wins over cuda)
    local name=$1; shift
    local cmd=($PY -m bench.convert_memory --device cuda --baseline "$BASELINE" --out "$OUT" "$@")
    if [ "$DRY" = 1 ]; then log "would run: $(printf "%q " "${cmd[@]}")"; return 0; fi
    timeout -k 5 $(( $(left) - 10 )) "${cmd[@]}" 2>&1 | grep --line-buffered -v "Token indices" | tee -a "$STEPS_LOG"
    local rc=${PIPESTATUS[0]}
    log "convert_memory $name: exit $rc"
    [ "$rc" = 0 ] && done_ "$name"
}
CAP="the GPU capped at 24 GiB (torch's per-process memory fraction)"

for s in $STEPS; do
    case "$s" in
    speed)
        step speed 300 && convert_memory speed --shape qwen3.5-122b-a10b --layers 1 --deltanet-only --vocab 32768 \
            --vram-gb 24 --work "$ROOT/qwen35-deltanet" --note "$CAP" ;;
    attention)
        step attention 300 && convert_memory attention --shape qwen3.5-122b-a10b --layers 1 --vocab 32768 \
            --vram-gb 24 --work "$ROOT/qwen35-attention" --note "$CAP" ;;
    check)      # not marked done: a check is run again each time it is asked for
        step check 60 && convert_memory check --shape tiny-qwen3.5 --layers 1 --deltanet-only --experts 8 \
            --vocab 512 --rows 2 --seq-len 32 --device cpu --vram-gb 24 --work "$ROOT/tiny-check" \
            --note "the script's own check on the CPU" && rm -f "$ROOT/done/check" ;;
    tests)
        if [ "$DRY" = 1 ]; then log "would run: $PY -m pytest tests/gpu/test_convert_gpu.py -q -p no:cacheprovider"
        elif step tests 150; then
            timeout $(( $(left) - 10 )) $PY -m pytest tests/gpu/test_convert_gpu.py -q -p no:cacheprovider 2>&1 \
                | tail -8 | tee -a "$STEPS_LOG"
            [ "${PIPESTATUS[0]}" = 0 ] && done_ tests
        fi ;;
    q125)
        step q125 300 && convert_memory q125 --shape q125-a11 --layers 1 --vocab 32768 --work "$ROOT/q125" \
            --note "the recorded figure's shape, all 128 experts" ;;
    quality)
        if [ "$DRY" = 1 ]; then log "would run: bash bench/gpu_converter.sh (METHODS='rtn gptq', ROOT=$ROOT/converter)"
        elif [ ! -f "$ROOT/done/quality" ]; then
            OUT=$OUT ROOT=$ROOT/converter LIMIT=$(left) METHODS="rtn gptq" \
                DONE="exllamav2-measure exllamav2-2.5 exllamav2-3 exllamav2-4 exllamav2-6 memory" \
                bash "$(dirname "$0")/gpu_converter.sh"
            [ -f "$ROOT/converter/done/quality" ] && done_ quality
        fi ;;
    esac
done
# the GPU's results into the tree (the CPU check's stay in $OUT)
find "$OUT" -maxdepth 1 -name "convert-memory-*-cuda-*.json" -newer "$MARK" -exec cp {} bench/results/ \; 2>/dev/null
find bench/results -maxdepth 1 -name "convert_quality*.json" -newer "$MARK" -exec cp {} "$OUT"/ \; 2>/dev/null
for f in $(find "$OUT" -maxdepth 1 -name "convert-memory-*.json" -newer "$MARK" 2>/dev/null); do
    $PY - "$f" <<'PYEOF' | tee -a "$STEPS_LOG"
import json, sys
r = json.load(open(sys.argv[1]))
p, peak = r["projection"], max((x.get("peak_cuda_bytes") or 0) for x in r["layers"])
print(f"{sys.argv[1]}: {r['model']} on {r['device']}, complete {r['complete']}: "
      f"{[round(x['seconds'], 1) for x in r['layers']]} s a converted layer, {p['seconds_per_layer']} s a full layer, "
      f"{p['model_hours']} h projected (baseline {(r.get('baseline') or {}).get('model_hours')} h), "
      f"peak GPU {peak / 2**30:.2f} GiB")
PYEOF
done
rm -f "$MARK"
log "done: $(ls "$ROOT/done" | tr '\n' ' ')"
