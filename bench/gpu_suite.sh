#!/usr/bin/env bash
# The GPU test suite (tests/gpu, marker gpu) in one call of at most LIMIT seconds (540 by default), its
# results kept in $OUT as it goes, so a kill leaves every finished file's results and the running
# file's tests up to the kill.
# Assumes exllamav2's extension is ready and the Python deps importable (e.g. after
# `source .whl/preamble.sh`); run from the repository root:
#   OUT=DIR bench/gpu_suite.sh                      # every file, in the order below
#   OUT=DIR GROUP=a bench/gpu_suite.sh              # GROUP_A's files; GROUP=b, c and d the others
#   OUT=DIR FILES="test_exl2_engine.py:200 test_offload_gpu.py" bench/gpu_suite.sh
#   OUT=DIR GROUP=shared LANES=3 bench/gpu_suite.sh  # the files that may share the GPU, 3 at a time (not 4:
#                   on the H200's 16 cores four lanes ran most files to their limits, their CPU work starved)
#   OUT=DIR GROUP=solo bench/gpu_suite.sh           # the SOLO files, one at a time
# One pytest process per file, one file at a time (the out-of-memory test fills the GPU; the warm-up and
# load-measures tests time gaps), cheap and broad files first. LANES=N (N > 1) runs the files that may share the GPU
# in N processes side by side (most of a file's time is loads, synthetic models and the Python between small
# kernels, and the H200's 141 GB hold several files' models and float32 references), then the SOLO files alone
# (default: those three, and the routing prior's worker chats, which timed out on oversubscribed cores: before
# the thread limit below; test_offload_gpu was solo too until its comparisons shared expert picks); each file's
# log is kept whole. Each file runs under its own
# limit (FILE:SECONDS, the defaults below; never past what is left of LIMIT): SIGINT at the limit, so pytest
# writes its summary and JUnit XML, SIGKILL 20 s later. pytest-timeout fails a test that runs past TEST_S (a
# traceback instead of silence). Synthetic models are written once for the whole run under $WORK/models
# (MOEDESK_GPU_MODELS) and removed at the end (KEEP_MODELS=1 keeps them). Each file's process gets a
# MOEDESK_HOME of its own (module-scoped fixtures load before the tests' own homes are set): no lane reads
# routing statistics another wrote. Lanes share the CPU's cores too (OMP_NUM_THREADS, below).
# Comparisons that run beside other processes must share expert picks (tests/gpu/routing_replay.py): the GPU's
# kernels do not sum in the same order run to run, so a router's near tie may part between two runs (what the
# H200 showed, in lanes and alone, in the suite's logs of 2026-12-03 and -04). A file's failure under lanes is confirmed
# alone (FILES=...) before it is called a bug.
# A warning in machine.txt and the output where fewer than MIN_DISK_GB (30) are free under $WORK.
# Files in $OUT (at most 6):
#   summary.txt     one line per file: passed/failed/skipped/errors/not run (of those collected), its
#                   seconds, and whether its limit stopped it; "not run" for a file no time was left for
#   pytest.log      every file's pytest output (-v: one line per test as it ends; -rA summary)
#   tests.jsonl     one JSON line per test (bench/gpu_suite_results.py): file, test, outcome, seconds, message
#   gpu_report.jsonl  the tests' measured figures (MOEDESK_GPU_REPORT)
#   machine.txt     commit, GPU, driver, memory, disk at the start
set -u
OUT=${OUT:?set OUT to the folder for the results}
LIMIT=${LIMIT:-540}                       # seconds for the whole script
TEST_S=${TEST_S:-300}                     # pytest-timeout: one test at most
PY=${PYTHON:-python3}
WORK=${WORK:-$(mktemp -d -t gpu-suite.XXXXXX)}
# file:seconds, cheap and broad first. Each limit is about 1.5-2 x the file's time on the H200 alone (the suite's
# logs of 2026-12-01 to -04, in git history); a file gets less when the earlier ones overran (a file the call had no time left for
# is listed "not run"; run it with FILES). The whole suite takes more than one call: GROUP=a, b, c and d split it
# into calls of about 8 minutes each, one file at a time; FILES (file or file:seconds) overrides both. Group c's
# Qwen3.5 engine file goes first: fla's file may be left for a second call (FILES=test_gdn_fla_gpu.py).
GROUP_A="test_reference_gpu.py:60 test_exl2_gpu.py:90 test_layer_hooks_gpu.py:45 test_convert_gpu.py:120
test_load_repack_gpu.py:60 test_exl2_engine.py:480 test_out_of_memory_gpu.py:60 test_speculative_gpu.py:120
test_warmup_gpu.py:300 test_route_normed_gpu.py:150"
GROUP_B="test_offload_gpu.py:360 test_mixtral_dbrx_gpu.py:480"
GROUP_C="test_qwen35_hybrid_gpu.py:540 test_gdn_fla_gpu.py:150"
GROUP_D="test_load_measures_gpu.py:150 test_route_prior_gpu.py:180 test_attention_gemv_gpu.py:480 test_roofline_gpu.py:150
test_constrained_gpu.py:120 test_gptq_import_gpu.py:240"
LANES=${LANES:-1}
# CPU threads of each file's torch (synthetic models, float32 references): the cores shared among the lanes.
# At 16 each, 4 lanes on 16 cores made a Qwen3.5 real-width synthesis run past 300 s (oversubscribed).
THREADS=$(( $(nproc) / LANES )); [ "$THREADS" -lt 1 ] && THREADS=1
SOLO=${SOLO:-"test_out_of_memory_gpu.py test_warmup_gpu.py test_load_measures_gpu.py test_route_prior_gpu.py"}
SOLO=$(echo $SOLO)                        # one line, single spaces: solo() matches " name "
ALL="$GROUP_A $GROUP_B $GROUP_C $GROUP_D"
limit_of() { local l=${1#*:}; [ "$l" = "$1" ] && l=120; echo "$l"; }     # file[:seconds] -> seconds
solo() { case " $SOLO " in *" ${1%%:*} "*) return 0 ;; esac; return 1; }    # file[:seconds] in SOLO
only() {            # shared|solo: ALL's entries whose file is not / is in SOLO
    local e
    for e in $ALL; do
        if solo "$e"; then [ "$1" = solo ] && echo "$e"; else [ "$1" = shared ] && echo "$e"; fi
    done | tr '\n' ' '
}
case ${GROUP:-all} in
    a) DEFAULT_FILES=$GROUP_A ;;
    b) DEFAULT_FILES=$GROUP_B ;;
    c) DEFAULT_FILES=$GROUP_C ;;
    d) DEFAULT_FILES=$GROUP_D ;;
    shared) DEFAULT_FILES=$(only shared) ;;
    solo) DEFAULT_FILES=$(only solo) ;;
    *) DEFAULT_FILES=$ALL ;;
esac
FILES=${FILES:-$DEFAULT_FILES}
mkdir -p "$OUT" "$WORK"
export MOEDESK_GPU_MODELS=${MOEDESK_GPU_MODELS:-$WORK/models}
export MOEDESK_GPU_REPORT="$OUT/gpu_report.jsonl"
export MOEDESK_COMMIT=${MOEDESK_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
T0=$(date +%s)
left() { echo $(( LIMIT - ($(date +%s) - T0) )); }
say() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a "$OUT/pytest.log"; }
{
    echo "commit $MOEDESK_COMMIT"
    nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader 2>&1
    free -g | awk '/Mem/ {print "host memory " $2 " GB, " $7 " GB available"}'
    df -h "$WORK" | tail -1 | awk '{print "disk " $4 " free"}'
    nproc | sed 's/^/cores /'
} > "$OUT/machine.txt"
# The files' synthetic models and float32 references take tens of GB of disk at once in lanes: on a machine
# whose disk still held a benchmark's models (63 of 64 GB), whole files failed with "No space left on device".
free_gb=$(df -Pk "$WORK" | awk 'NR == 2 {print int($4 / 1048576)}')
if [ "${free_gb:-0}" -lt "${MIN_DISK_GB:-30}" ]; then
    echo "WARNING: $free_gb GB of disk free under $WORK (fewer than ${MIN_DISK_GB:-30}):" \
        "files may fail for want of space" | tee -a "$OUT/machine.txt"
fi
: > "$OUT/summary.txt"

run_file() {        # file[:seconds] basetemp: one pytest process for the file, under its limit
    local entry=$1 base=$2 file limit rest tlimit xml flog t rc secs p f s e n nr how cmd
    file=${entry%%:*}
    limit=$(limit_of "$entry")
    rest=$(left)
    [ "$limit" -gt $(( rest - 25 )) ] && limit=$(( rest - 25 ))      # room for the kill and the summary
    if [ "$limit" -lt 20 ]; then
        echo "$file: not run ($rest s left of $LIMIT)" | tee -a "$OUT/summary.txt" | tee -a "$OUT/pytest.log"
        return
    fi
    tlimit=$TEST_S
    [ "$tlimit" -gt $(( limit - 5 )) ] && tlimit=$(( limit - 5 ))
    say "== $file (limit $limit s, a test at most $tlimit s)"
    xml="$WORK/${file%.py}.xml"
    flog="$WORK/${file%.py}.log"
    rm -f "$xml"
    t=$(date +%s)
    cmd=(env MOEDESK_HOME="$base-home" OMP_NUM_THREADS="$THREADS"
         timeout -s INT -k 20 "$limit" $PY -u -m pytest "tests/gpu/$file" -m gpu -v
         -rA -p no:cacheprovider --timeout="$tlimit" --junitxml="$xml" --basetemp="$base" -o junit_family=xunit2)
    if [ "$LANES" -gt 1 ]; then     # lanes write their files' logs whole, one after another
        "${cmd[@]}" > "$flog" 2>&1
        rc=$?
        cat "$flog" >> "$OUT/pytest.log"
    else
        "${cmd[@]}" 2>&1 | tee "$flog" >> "$OUT/pytest.log"
        rc=${PIPESTATUS[0]}
    fi
    secs=$(( $(date +%s) - t ))
    rm -rf "$base" "$base-home"
    read -r p f s e n <<< "$($PY -m bench.gpu_suite_results "$flog" "$xml" "$file" "$OUT/tests.jsonl" \
        2>>"$OUT/pytest.log" || echo "? ? ? ? 0")"
    [ "$n" != 0 ] && nr=", $n not run" || nr=""
    case $rc in
        0|1) how="" ;;
        5) how=", no test selected" ;;
        124|130|137) how=", stopped at its $limit s limit (rc $rc)" ;;
        *) how=", pytest exit $rc" ;;
    esac
    echo "$file: $p passed, $f failed, $s skipped, $e errors$nr in $secs s$how" | tee -a "$OUT/summary.txt" \
        | tee -a "$OUT/pytest.log"
}

if [ "$LANES" -gt 1 ]; then
    # Files that may share the GPU go into LANES queues, longest limit first onto the queue with the least
    # seconds so far; the lanes run side by side, then the SOLO files one at a time with the GPU to
    # themselves (the out-of-memory test fills the GPU; the warm-up and load-measures tests time gaps).
    declare -a lane_files lane_secs
    for ((i = 0; i < LANES; i++)); do lane_files[i]=""; lane_secs[i]=0; done
    solo_run=""
    longest_first=$(for e in $FILES; do echo "$(limit_of "$e") $e"; done | sort -rn | cut -d' ' -f2)
    for entry in $longest_first; do
        solo "$entry" && { solo_run="$solo_run $entry"; continue; }
        best=0
        for ((i = 1; i < LANES; i++)); do [ "${lane_secs[i]}" -lt "${lane_secs[best]}" ] && best=$i; done
        lane_files[best]="${lane_files[best]} $entry"
        lane_secs[best]=$(( lane_secs[best] + $(limit_of "$entry") ))
    done
    for ((i = 0; i < LANES; i++)); do
        say "lane $i:${lane_files[i]:- (none)}"
        ( for entry in ${lane_files[i]}; do run_file "$entry" "$WORK/pytest-lane$i"; done ) &
    done
    wait
    [ -n "$solo_run" ] && say "alone:$solo_run"
    for entry in $solo_run; do run_file "$entry" "$WORK/pytest"; done
else
    for entry in $FILES; do run_file "$entry" "$WORK/pytest"; done
fi

[ "${KEEP_MODELS:-0}" = 1 ] || rm -rf "$MOEDESK_GPU_MODELS"
say "done in $(( $(date +%s) - T0 )) s"
echo "---- summary ($(( $(date +%s) - T0 )) s of $LIMIT)"
cat "$OUT/summary.txt"
