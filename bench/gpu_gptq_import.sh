#!/usr/bin/env bash
# The import's GPU figures in steps that a warm machine resumes (markers under $ROOT/done), each call at
# most LIMIT seconds (540 by default):
#   tests       tests/gpu/test_gptq_import_gpu.py: the repack on CUDA byte for byte the CPU's, a calibrated
#               Qwen3.5-MoE import on CUDA
#   rtn         python -m bench.gptq_import --layers $LAYERS --no-calibrate: a synthetic GPTQ build of
#               Qwen3.5-122B-A10B cut to LAYERS layers (experts 4-bit g32, the rest fp16; ~1.5 GB a layer, 3 GB of
#               embeddings and head), imported with its 16-bit linears rounded to nearest: the repack alone
#   calibrated  the same build (kept in $ROOT/work) imported with the converter's calibration and GPTQ of the
#               16-bit linears (the default of moedesk-cli import)
# Each JSON projects the whole 48-layer import (time, peak RSS, disk) from the layers done. The disk holds the
# LAYERS-layer build and one import of it (~2 x (1.5 LAYERS + 3) GB); the whole model's build and import would need
# ~130 GB, more than the machine has: hence the cut.
# Assumes `source .whl/preamble.sh`; run from the repository root. JSON goes to bench/results/ and, with a log, to $OUT.
set -u
OUT=${OUT:-/tmp/gpu-gptq-import-out}
ROOT=${ROOT:-/tmp/m-gptq-import}
LIMIT=${LIMIT:-540}
LAYERS=${LAYERS:-4}
PY=${PYTHON:-python3}
mkdir -p "$OUT" "$ROOT/done" bench/results
for d in ${DONE:-}; do touch "$ROOT/done/$d"; done
MARK=$(mktemp)
STEPS_LOG=$OUT/gpu_gptq_import.log
. "$(dirname "$0")/gpu_steps.sh"
export MOEDESK_COMMIT=${MOEDESK_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
log "commit $MOEDESK_COMMIT; $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null); $(df -h /tmp | tail -1)"

if step tests 120; then
    timeout $(( $(left) - 10 )) $PY -m pytest tests/gpu/test_gptq_import_gpu.py -q -p no:cacheprovider 2>&1 \
        | tail -5 | tee -a "$STEPS_LOG"
    [ "${PIPESTATUS[0]}" = 0 ] && done_ tests
fi
for mode in rtn calibrated; do
    flag=$([ $mode = rtn ] && echo --no-calibrate || echo --calibrate)
    if step $mode 240; then
        timeout $(( $(left) - 10 )) $PY -m bench.gptq_import --layers "$LAYERS" $flag --device cuda \
            --work "$ROOT/work" --out bench/results 2>&1 | grep -v "^\[transformers\]" | tail -12 | tee -a "$STEPS_LOG"
        [ "${PIPESTATUS[0]}" = 0 ] && done_ $mode
    fi
done
find bench/results -name 'gptq-import-*.json' -newer "$MARK" -exec cp {} "$OUT/" \;
log "done: $(ls "$ROOT/done" | tr '\n' ' ')"
