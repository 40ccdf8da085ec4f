# Shared by the e2e scripts (sourced): progress lines with timings, and
# waits that have a deadline and notice a process that died.
#
#   stage NAME CMD...          run CMD, print "[stage] NAME: done in N s"
#   wait_up WHAT SECS PIDFILE LOG CMD...
#                              until CMD succeeds; fails with WHAT, whether the
#                              process in PIDFILE died (and its log's tail), and
#                              the log to read, when SECS pass or it exits
#   spawn PIDFILE LOG CMD...   start CMD in its own session, pid into PIDFILE;
#                              fails at once when CMD does not exist

stage() {
  local name=$1 t0=$SECONDS; shift
  printf '[stage] %s ...\n' "$name" >&2
  "$@" || { local rc=$?; printf '[stage] %s: FAILED (exit %s) after %s s\n' "$name" "$rc" "$((SECONDS - t0))" >&2; return $rc; }
  printf '[stage] %s: done in %s s\n' "$name" "$((SECONDS - t0))" >&2
}

spawn() {
  local pidfile=$1 log=$2; shift 2
  if [ ! -x "$1" ] && ! command -v "$1" >/dev/null 2>&1; then
    printf 'error: cannot start %s: no such executable (was it built? see e2e/build-binaries)\n' "$1" >&2
    return 1
  fi
  mkdir -p "$(dirname "$pidfile")" "$(dirname "$log")"
  setsid "$@" >"$log" 2>&1 </dev/null &
  echo $! >"$pidfile"
}

wait_up() {
  local what=$1 secs=$2 pidfile=$3 log=$4; shift 4
  local deadline=$((SECONDS + secs)) pid=""
  [ -n "$pidfile" ] && [ -f "$pidfile" ] && pid=$(cat "$pidfile")
  until "$@" >/dev/null 2>&1; do
    if [ -n "$pid" ] && ! kill -0 "$pid" 2>/dev/null; then
      printf 'error: waiting for %s: process %s exited; last lines of %s:\n' "$what" "$pid" "$log" >&2
      tail -n 20 "$log" >&2 2>/dev/null || true
      return 1
    fi
    if [ $SECONDS -ge $deadline ]; then
      printf 'error: timed out after %s s waiting for %s%s; read %s\n' "$secs" "$what" \
        "${pid:+ (process $pid still running)}" "${log:-the logs}" >&2
      [ -n "$log" ] && tail -n 20 "$log" >&2 2>/dev/null
      return 1
    fi
    sleep 0.2
  done
}
