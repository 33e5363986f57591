# Sourced by the H200 scripts (gpu_*.sh): the time left of LIMIT since T0, a log line into $STEPS_LOG,
# and, for the scripts that run in steps a warm machine resumes (gpu_mixtral_dbrx.sh, gpu_converter.sh, gpu_gptq_import.sh), the step
# markers under $ROOT/done. Expects LIMIT and STEPS_LOG set (ROOT where step and done_ are used); sets T0.
# pack_profiles: the profiler tables under $OUT/prof into one archive.
T0=$(date +%s)
left() { echo $(( LIMIT - ($(date +%s) - T0) )); }
log() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a "$STEPS_LOG"; }
step() {            # name, seconds it needs at least: true when it is to run now
    [ -f "$ROOT/done/$1" ] && return 1
    [ "$(left)" -ge "$2" ] && { log "$1 ($(left) s left)"; return 0; }
    log "$1 waits: $(left) s left, it needs about $2"; return 1
}
done_() { mkdir -p "$ROOT/done" && touch "$ROOT/done/$1"; }
pack_profiles() {   # $OUT/prof (the profiler tables) into one $OUT/prof.tar.gz: a call brings back 8 files at most
    [ -d "$OUT/prof" ] && tar -czf "$OUT/prof.tar.gz" -C "$OUT" prof && rm -rf "$OUT/prof"
}
