#!/usr/bin/env bash
# The speed of two commits side by side on the GPU in one call (at most LIMIT seconds, 540 by default): the
# offload benchmark at 24 GB (q125-a11 3.0 bpw, uniform routing, placement auto) and the all-in-VRAM
# benchmark (qwen3-30b-a3b 4.0 bpw, no stock baseline), each at the commit before a change and at this
# tree, taking turns (before, after) so that both meet the machine in the same state.
#   BEFORE=DIR   a checkout of the commit before (e.g. `git archive COMMIT | tar -x -C DIR`, carried in)
#   BEFORE_COMMIT  that commit, for the before runs' JSON (a git archive carries none, and the after tree's
#                MOEDESK_COMMIT would name the before runs too)
#   PLACEMENTS="auto cpu"  the offload runs' placements, each at both commits (default auto); "cpu" forces
#                the CPU expert path, to compare its speed alone
#   VRAM=0       leave out the all-in-VRAM runs; OFFLOAD=0 leave out the offload runs
#   CUDA_FLAGS   the all-in-VRAM runs' prompts and decode (default --prompts 512 --decode 256; the table of the
#                engine's defaults, docs/engine-notes.md, was measured with --prompts 512,4096 --decode 128)
#   TREES="before after"  which commits run (default both, in that order)
#   OFFLOAD_FLAGS  extra flags of the offload runs (default --prefetch-modes=: the decode prefetch's
#                modes are not measured again one by one, which saves about 20 s a run)
#   OMP=0        leave out the first step, `python -m bench.omp_teams` on this tree: whether an OpenMP
#                team left docked slows the CPU expert kernel on this machine (the suspected cause of
#                the CPU path's slowdown), its JSON into $OUT
# Assumes exllamav2's extension is ready and the Python deps importable (`source .whl/preamble.sh`); run
# from the repository root. JSON goes to bench/results/ of each tree; copies, with a log, into $OUT.
set -u
OUT=${OUT:-/tmp/gpu-speed-check-out}
LIMIT=${LIMIT:-540}
M=${MODELS:-/tmp/m-speed}
PY=${PYTHON:-python3}
BEFORE=${BEFORE:?set BEFORE to a checkout of the commit before the change}
BEFORE_COMMIT=${BEFORE_COMMIT:?set BEFORE_COMMIT to the commit BEFORE holds}
BEFORE=$(cd "$BEFORE" && pwd) || exit 2            # absolute: each run changes into its tree
AFTER=$PWD
mkdir -p "$OUT" "$M"
STEPS_LOG=$OUT/gpu_speed_check.log
. "$(dirname "$0")/gpu_steps.sh"         # T0, left, log
STAMP=$(mktemp)                  # results written after this are this run's (the trees hold earlier ones)
fresh() { find "$1/bench/results" -maxdepth 1 -name "*$2*.json" -newer "$STAMP" -exec cp {} "$OUT"/ \; ; }
log "$(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null); before: $BEFORE"
[ "${OFFLOAD:-1}" = 0 ] || [ -f "$M/q125/config.json" ] || $PY -m runtime.cli synth --shape q125-a11 --bpw 3.0 --out "$M/q125" | tail -1
[ "${VRAM:-1}" = 0 ] || [ -f "$M/q30b/config.json" ] || $PY -m runtime.cli synth --shape qwen3-30b-a3b --bpw 4.0 --out "$M/q30b" | tail -1
AFTER_COMMIT=${MOEDESK_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
if [ "${OMP:-1}" = 1 ]; then
    log "OpenMP teams and the CPU expert kernel (bench.omp_teams)"
    MOEDESK_COMMIT=$AFTER_COMMIT timeout 120 $PY -m bench.omp_teams --json "$OUT/omp-teams.json" 2>&1 \
        | tee -a "$OUT/gpu_speed_check.log"
fi
run() {   # tree label commit: one offload run at 24 GB and one all-in-VRAM run, from that tree
    local tree=$1 label=$2
    export MOEDESK_COMMIT=$3
    [ "${OFFLOAD:-1}" = 0 ] || for pl in ${PLACEMENTS:-auto}; do
    [ "$(left)" -gt 60 ] || { log "$label: no time left for the offload run, placement $pl"; continue; }
    log "$label: offload at 24 GB, placement $pl ($(left) s left)"
    (cd "$tree" && PYTHONPATH="$tree:${PYTHONPATH:-}" MOEDESK_HOME="$M/home-$label" timeout $(( $(left) - 10 )) \
        $PY -m bench.offload --model "$M/q125" --label "q125-a11-$pl-$label" --bpw 3.0 --budgets 24 --routing uniform \
        --placement $pl --no-naive --decode 128 ${OFFLOAD_FLAGS---prefetch-modes=} --note "speed check: $label, placement $pl" 2>&1 | tail -4) \
        | tee -a "$OUT/gpu_speed_check.log"
    done
    [ "${VRAM:-1}" = 0 ] && { fresh "$tree" "$label"; return; }
    [ "$(left)" -gt 60 ] || { log "$label: no time left for the all-in-VRAM run"
                              fresh "$tree" "$label"; return; }
    log "$label: all in VRAM ($(left) s left)"
    (cd "$tree" && PYTHONPATH="$tree:${PYTHONPATH:-}" MOEDESK_HOME="$M/home-$label" timeout $(( $(left) - 10 )) \
        $PY -m bench.cuda --model "$M/q30b" --label "qwen3-30b-a3b-$label" --bpw 4.0 --baseline none \
        ${CUDA_FLAGS:---prompts 512 --decode 256} 2>&1 | tail -4) | tee -a "$OUT/gpu_speed_check.log"
    fresh "$tree" "$label"
}
for t in ${TREES:-before after}; do
    case $t in
        before) run "$BEFORE" before "$BEFORE_COMMIT" ;;
        after) run "$AFTER" after "$AFTER_COMMIT" ;;
        *) log "unknown tree $t" ;;
    esac
done
log "done"
