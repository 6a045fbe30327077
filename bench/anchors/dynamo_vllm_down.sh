#!/usr/bin/env bash
# Stop exactly the process groups recorded by dynamo_vllm_up.sh in $RUN_DIR/pids (never by name):
# workers first, then the frontend; SIGTERM to each group, up to 20 s, then SIGKILL.
set -uo pipefail
ANCHOR_HOME="${ANCHOR_HOME:-/tmp/meshllm-anchor}"
RUN_DIR="${RUN_DIR:-$ANCHOR_HOME/run-dynvllm}"
[ -s "$RUN_DIR/pids" ] || { echo "nothing to stop ($RUN_DIR/pids empty or missing)"; exit 0; }
stop() {  # pgids...
  local g; for g in "$@"; do kill -TERM -- "-$g" 2>/dev/null || true; done
  for _ in $(seq 1 100); do
    local alive=0; for g in "$@"; do kill -0 -- "-$g" 2>/dev/null && alive=1; done
    [ $alive = 0 ] && return 0; sleep 0.2
  done
  for g in "$@"; do kill -0 -- "-$g" 2>/dev/null && { echo "SIGKILL group $g"; kill -KILL -- "-$g" 2>/dev/null || true; }; done
}
workers=(); fe=()
while read -r name pid; do case "$name" in frontend) fe+=("$pid");; *) workers+=("$pid");; esac; done < "$RUN_DIR/pids"
[ ${#workers[@]} -gt 0 ] && stop "${workers[@]}"
[ ${#fe[@]} -gt 0 ] && stop "${fe[@]}"
echo "stopped: $(tr '\n' ' ' < "$RUN_DIR/pids")"
mv "$RUN_DIR/pids" "$RUN_DIR/pids.stopped"
