#!/usr/bin/env bash
# The integer CPU kernel on a GPU machine in one call (at most LIMIT seconds, 560 by default):
#   kernel   `python -m bench.cpu_experts` on this tree: q125-a11's experts at 2.5, 3.0 and 4.0 bpw, rows 1
#            and 4, teams of 1, 2 and TEAM threads (default the physical cores less two, the CPU path's
#            automatic limit), each row beside the read bandwidth of its team; then 3.0 bpw with the AVX2 path
#            forced (--isa avx2). KERNEL=0 leaves it out.
#   offload  `python -m bench.offload --budgets 24 --routing uniform` on q125-a11 3.0 bpw (synthetic, written
#            under MODELS once, ~45 GB), at the commit before the integer kernel (the fp32 one) and at this
#            tree, taking turns (before, after) so both meet the machine in the same state: decode tokens/s and
#            the CPU path's GB/s (cpu_gb_per_s) of each, placement PLACEMENTS (default auto; "auto cpu" also
#            forces the CPU path).
#   BEFORE=DIR   a checkout of the commit before (e.g. `git archive <commit> | tar -x -C DIR`, carried in)
#   BEFORE_COMMIT  that commit, for the before runs' JSON
#   TREES="before after"  which commits run the offload benchmark (default both, in that order)
# Assumes exllamav2's extension is ready and the Python deps importable (`source .whl/preamble.sh`); run
# from the repository root. JSON goes to bench/results/ of each tree; copies, with a log, into $OUT.
set -u
OUT=${OUT:-/tmp/issue57-out}
LIMIT=${LIMIT:-560}
M=${MODELS:-/tmp/m57}
PY=${PYTHON:-python3}
AFTER=$PWD
mkdir -p "$OUT" "$M" bench/results
STEPS_LOG=$OUT/gpu_issue57.log
. "$(dirname "$0")/gpu_steps.sh"         # T0, left, log
STAMP=$(mktemp)                  # results written after this are this run's (the trees hold earlier ones)
fresh() { find "$1/bench/results" -maxdepth 1 -name "*$2*.json" -newer "$STAMP" -exec cp {} "$OUT"/ \; ; }
AFTER_COMMIT=${MOEDESK_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
CORES=$($PY -c "import psutil; print(psutil.cpu_count(logical=False))")
TEAM=${TEAM:-$(( CORES > 3 ? CORES - 2 : 1 ))}
log "$(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null); $CORES cores; $(uptime)"
log "NUMA: $(cat /sys/devices/system/node/online 2>/dev/null); CPU flags: $(grep -o 'avx512_vnni\|avx512bw\|avx2\|avx_vnni' /proc/cpuinfo | sort -u | tr '\n' ' ')"
if [ "${KERNEL:-1}" = 1 ]; then
    log "bench.cpu_experts: teams 1 2 $TEAM ($(left) s left)"
    MOEDESK_COMMIT=$AFTER_COMMIT timeout $(( $(left) - 30 )) $PY -m bench.cpu_experts --shapes q125-a11 \
        --formats exl2 --rows 1 4 --bits 2.5 3.0 4.0 --threads 1 2 "$TEAM" --pool-mb 2048 --calls 20 \
        --json "$OUT/cpu-experts-q125-$(date +%Y%m%d-%H%M).json" 2>&1 | tee -a "$STEPS_LOG"
    log "bench.cpu_experts --isa avx2 ($(left) s left)"
    MOEDESK_COMMIT=$AFTER_COMMIT timeout $(( $(left) - 30 )) $PY -m bench.cpu_experts --shapes q125-a11 \
        --formats exl2 --rows 1 4 --bits 3.0 --threads 1 "$TEAM" --pool-mb 2048 --calls 20 --isa avx2 \
        --json "$OUT/cpu-experts-q125-avx2-$(date +%Y%m%d-%H%M).json" 2>&1 | tee -a "$STEPS_LOG"
    cp "$OUT"/cpu-experts-q125-*.json bench/results/ 2>/dev/null
fi
[ "${TREES:-before after}" = "" ] && { log "done"; exit 0; }
[ -f "$M/q125/config.json" ] || $PY -m runtime.cli synth --shape q125-a11 --bpw 3.0 --out "$M/q125" | tail -1
run() {   # tree label commit: the offload benchmark at 24 GB from that tree
    local tree=$1 label=$2 pl
    export MOEDESK_COMMIT=$3
    for pl in ${PLACEMENTS:-auto}; do
        [ "$(left)" -gt 60 ] || { log "$label: no time left for the offload run, placement $pl"; continue; }
        log "$label: offload at 24 GB, placement $pl ($(left) s left)"
        (cd "$tree" && PYTHONPATH="$tree:${PYTHONPATH:-}" MOEDESK_HOME="$M/home-$label" timeout $(( $(left) - 10 )) \
            $PY -m bench.offload --model "$M/q125" --label "q125-a11-$pl-$label" --bpw 3.0 --budgets 24 \
            --routing uniform --placement "$pl" --no-naive --decode 128 --prefetch-modes= \
            --note "integer CPU kernel check: $label, placement $pl" 2>&1 | tail -4) | tee -a "$STEPS_LOG"
    done
    fresh "$tree" "$label"
}
for t in ${TREES:-before after}; do
    case $t in
        before) run "$(cd "${BEFORE:?set BEFORE to a checkout of the commit before the integer kernel}" && pwd)" \
                    before "${BEFORE_COMMIT:?set BEFORE_COMMIT}" ;;
        after) run "$AFTER" after "$AFTER_COMMIT" ;;
        *) log "unknown tree $t" ;;
    esac
done
log "done"
