# Sourced by the H200 scripts that run in steps a warm machine resumes (gpu_issue22.sh, gpu_issue23.sh):
# the time left of LIMIT since T0, a log line into $STEPS_LOG, and the step markers under $ROOT/done.
# Expects LIMIT, ROOT and STEPS_LOG set; sets T0.
T0=$(date +%s)
mkdir -p "$ROOT/done"
left() { echo $(( LIMIT - ($(date +%s) - T0) )); }
log() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a "$STEPS_LOG"; }
step() {            # name, seconds it needs at least: true when it is to run now
    [ -f "$ROOT/done/$1" ] && return 1
    [ "$(left)" -ge "$2" ] && { log "$1 ($(left) s left)"; return 0; }
    log "$1 waits: $(left) s left, it needs about $2"; return 1
}
done_() { touch "$ROOT/done/$1"; }
