#!/usr/bin/env bash
# The integer CPU kernel on a GPU machine, in steps that a warm machine resumes: each call runs the steps not
# yet done (a marker under $ROOT/done says which are), at most LIMIT seconds (560 by default), and starts a
# step only when the time left is at least its estimate (the log says what waited). Steps, in order:
#   kernel   `python -m bench.cpu_experts` on this tree: q125-a11's experts at 2.5, 3.0 and 4.0 bpw, rows 1
#            and 4, teams of 1, 2 and TEAM threads (default the physical cores less two, the CPU path's
#            automatic limit), each row beside the read bandwidth of its team (bandwidth_fraction); then
#            3.0 bpw with the AVX2 path forced (--isa avx2). KERNEL=0 leaves it out.
#   synth    q125-a11 at 3.0 bpw (synthetic, ~45 GB under ROOT; ~35 s on the H200 machine)
#   before-cpu, after-cpu, before-auto, after-auto
#            `python -m bench.offload --budgets 24 --routing uniform` on that model at the commit before the
#            integer kernel (the fp32 one, in BEFORE) and at this tree, one right after the other so both meet
#            the machine in the same state: decode tokens/s and the CPU path's GB/s (cpu_gb_per_s) of each, in
#            its JSON and log line; per placement of PLACEMENTS (default "cpu auto": the CPU path forced, then
#            as placement picks it, which may be 'stream' where the CPU is the slower). TREES="after" runs
#            one tree. Each takes ~3 minutes (a load at 24 GB, calibration, decode with and without the CPU path).
#   BEFORE=DIR     a copy of the commit before the integer kernel (default .gpuwork/before-cpu-kernel:
#                  `mkdir -p DIR && git archive COMMIT | tar -x -C DIR`, carried in)
#   BEFORE_COMMIT  that commit, for the before runs' JSON (a git archive carries no git metadata)
# Assumes exllamav2's extension is ready and the Python deps importable (`source .whl/preamble.sh`); run
# from the repository root. JSON goes to bench/results/ of each tree; copies, with the log, into $OUT.
set -u
OUT=${OUT:-/tmp/cpu-kernel-out}
LIMIT=${LIMIT:-560}
ROOT=${ROOT:-/tmp/m-cpu-kernel}
PY=${PYTHON:-python3}
AFTER=$PWD
mkdir -p "$OUT" "$ROOT/done" bench/results
STEPS_LOG=$OUT/gpu_cpu_kernel.log
. "$(dirname "$0")/gpu_steps.sh"         # left, log, step, done_
STAMP=$(mktemp)                  # results written after this are this call's (the trees hold earlier ones)
fresh() { find "$1/bench/results" -maxdepth 1 -name "*$2*.json" -newer "$STAMP" -exec cp {} "$OUT"/ \; ; }
AFTER_COMMIT=${MOEDESK_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
CORES=$($PY -c "import psutil; print(psutil.cpu_count(logical=False))")
TEAM=${TEAM:-$(( CORES > 3 ? CORES - 2 : 1 ))}
MODEL=$ROOT/q125
log "$(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null); $CORES cores; $(uptime)"
log "NUMA: $(cat /sys/devices/system/node/online 2>/dev/null); CPU flags: $(grep -o 'avx512_vnni\|avx512bw\|avx2\|avx_vnni' /proc/cpuinfo | sort -u | tr '\n' ' ')"

if [ "${KERNEL:-1}" = 1 ] && step kernel 200; then
    MOEDESK_COMMIT=$AFTER_COMMIT timeout $(( $(left) - 30 )) $PY -m bench.cpu_experts --shapes q125-a11 \
        --formats exl2 --rows 1 4 --bits 2.5 3.0 4.0 --threads 1 2 "$TEAM" --pool-mb 2048 --calls 20 \
        --json "$OUT/cpu-experts-q125-$(date +%Y%m%d-%H%M).json" 2>&1 | tee -a "$STEPS_LOG"
    rc=${PIPESTATUS[0]}
    log "bench.cpu_experts --isa avx2 ($(left) s left)"
    MOEDESK_COMMIT=$AFTER_COMMIT timeout $(( $(left) - 30 )) $PY -m bench.cpu_experts --shapes q125-a11 \
        --formats exl2 --rows 1 4 --bits 3.0 --threads 1 "$TEAM" --pool-mb 2048 --calls 20 --isa avx2 \
        --json "$OUT/cpu-experts-q125-avx2-$(date +%Y%m%d-%H%M).json" 2>&1 | tee -a "$STEPS_LOG"
    rc2=${PIPESTATUS[0]}
    log "bench.cpu_experts: exit $rc, --isa avx2: exit $rc2"
    [ "$rc" = 0 ] && [ "$rc2" = 0 ] && done_ kernel
    cp "$OUT"/cpu-experts-q125-*.json bench/results/ 2>/dev/null
fi
[ -n "${TREES-before after}" ] || { log "done"; exit 0; }
if [ ! -f "$MODEL/README.md" ] && step synth 90; then     # synth writes README.md last: a whole folder
    rm -rf "$MODEL"
    timeout $(( $(left) - 5 )) $PY -m runtime.cli synth --shape q125-a11 --bpw 3.0 --out "$MODEL" 2>&1 | tail -1 \
        | tee -a "$STEPS_LOG"
    log "synth: exit ${PIPESTATUS[0]}, $(du -sh "$MODEL" 2>/dev/null | cut -f1)"
fi
run() {   # tree label commit placement: the offload benchmark at 24 GB from that tree
    local tree=$1 label=$2 pl=$4 rc
    (cd "$tree" && MOEDESK_COMMIT=$3 PYTHONPATH="$tree:${PYTHONPATH:-}" MOEDESK_HOME="$ROOT/home-$label" \
        timeout $(( $(left) - 10 )) $PY -m bench.offload --model "$MODEL" --label "q125-a11-$pl-$label" \
        --bpw 3.0 --budgets 24 --routing uniform --placement "$pl" --no-naive --decode 128 --prefetch-modes= \
        --note "integer CPU kernel check: $label, placement $pl" 2>&1 | tail -4; exit "${PIPESTATUS[0]}") \
        | tee -a "$STEPS_LOG"
    rc=${PIPESTATUS[0]}
    log "$label, placement $pl: exit $rc"
    fresh "$tree" "$pl-$label"
    [ "$rc" = 0 ]
}
BEFORE=${BEFORE:-.gpuwork/before-cpu-kernel}
for pl in ${PLACEMENTS:-cpu auto}; do
    for t in ${TREES-before after}; do
        [ -f "$MODEL/README.md" ] || { log "$t-$pl waits: no model yet (synth)"; break 2; }
        case $t in
            before) [ -f "$BEFORE/bench/offload.py" ] || { log "before: no copy of the commit before in $BEFORE"; continue; }
                    step "before-$pl" 240 && run "$(cd "$BEFORE" && pwd)" before "${BEFORE_COMMIT:?set BEFORE_COMMIT}" \
                        "$pl" && done_ "before-$pl" ;;
            after) step "after-$pl" 240 && run "$AFTER" after "$AFTER_COMMIT" "$pl" && done_ "after-$pl" ;;
            *) log "unknown tree $t" ;;
        esac
    done
done
log "done: $(ls "$ROOT/done" | tr '\n' ' ')"
