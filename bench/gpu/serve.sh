#!/usr/bin/env bash
# Start the GPU bench's processes, each in its own session (setsid), logs and pid files in $RUN:
#   P  vLLM kv_producer  :8100 (NIXL side channel :5600)      D  vLLM kv_consumer :8200 (:5700)
#   C  vLLM alone (no connector, prefix caching on) :8300     G  pd-gateway :8000 in front of P and D
#   G2 a second pd-gateway :8001 in front of the same P and D, with the cost plan (`--reuse-policy cost`);
#      G reads D's KV on every continuous turn (`--reuse-policy always`); both with the local path off, so
#      their later turns take the P path;
#   G3 a third, :8002, with the product's defaults (the cost plan and the local path: D alone computes a short
#      suffix); all find conversations by session id only, so the stateless modes (no session id) stay stateless
# and wait until all four answer /health. `bash bench/gpu/serve.sh stop` ends them (by their pid files).
# LOAD_ARMS=1 adds the load bench's arms (bench/gpu/load.py): C gets C_KV_GIB (default twice KV_GIB: the KV of P
# and D together); C1 :8301 and C2 :8302, co-located engines of KV_GIB each; G4 :8003, pd-gateway with its
# defaults (sessions and prefix lookup); and with ROUTER (the command that runs vllm-router) R1 :8010, vllm-router's
# PD mode over P and D (stateless PD), and R2 :8011, vllm-router's cache_aware routing over C1 and C2.
# KV_EVENTS=1: P and D publish their prefix caches' changes (vLLM --kv-events-config, ZMQ on :5557 and :5558) and
# G4 subscribes (--kv-events); an engine that fails to start with the publisher is started again without it.
# G4_FLAGS: more flags for G4 (e.g. --local-first-turns). COLOC2=0: no C1, C2, R2 (a GPU of 80 GB: the coloc2 arm
# left out).
#
#   MODEL=/path/to/model bash bench/gpu/serve.sh
# Settings (environment):
#   MODEL        the model folder (bench/gpu/make_model.py writes one)                         (required)
#   TRANSPORT    how NIXL moves KV between P and D:                                            (default: tcp)
#                  tcp       NIXL's defaults (UCX error handling `peer`: wire-up and, on one GPU, data over TCP)
#                  err_none  NIXL backend parameter ucx_error_handling_mode=none (shared-memory wire-up)
#                  cuda_ipc  err_none + UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y: UCX may READ the peer's VRAM with
#                            CUDA IPC even where NVML reports no NVLink (one GPU; many VMs)
#                  cuda_ipc_peer  only UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y: data over CUDA IPC, NIXL's default
#                            error handling (peer failures detected) and wire-up over TCP; no shim needed
#   P_GPU D_GPU C_GPU  CUDA_VISIBLE_DEVICES of each engine (default 0: all on one GPU)
#   BLOCK_SIZE (vLLM default: 16 on CUDA; larger blocks mean fewer, larger NIXL descriptors)
#   KV_GIB (20), GPU_UTIL (each engine's KV + 10 GiB of the GPU), MAX_LEN (36864), TTL_S (120: D's decoder_kv_blocks_ttl)
#   KV_MODE      pull (NixlConnector, bidirectional) or push (NixlPushConnector; the gateways find the mode)
#   VLLM_PY / GW_PY   the Python of vLLM / of the gateway (python3); VLLM_PATH / GW_PATH: PYTHONPATH for each
#   RUN (/tmp/pdgw-gpu)   logs and pid files
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
RUN=${RUN:-/tmp/pdgw-gpu}
mkdir -p "$RUN"
declare -A EVENTS_PORT=([P]=5557 [D]=5558)
declare -A PORT=([P]=8100 [D]=8200 [C]=8300 [C1]=8301 [C2]=8302 [G]=8000 [G2]=8001 [G3]=8002 [G4]=8003
                 [R1]=8010 [R2]=8011)

if [ "${1:-}" = stop ]; then
  for n in G G2 G3 G4 R1 R2 P D C C1 C2; do [ -f "$RUN/$n.pid" ] && kill "$(cat "$RUN/$n.pid")" 2>/dev/null && echo "stopped $n"; done
  exit 0
fi
: "${MODEL:?set MODEL to the model folder}"
VLLM_PY=${VLLM_PY:-python3}; GW_PY=${GW_PY:-python3}
TTL_S=${TTL_S:-120}
# Required on hosts whose GPUs others share (NVLink multicast off), harmless elsewhere.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
export VLLM_SERVER_DEV_MODE=1 VLLM_NIXL_SIDE_CHANNEL_HOST=127.0.0.1

transport_env() {  # the lines a P or D start script exports for $TRANSPORT
  case ${TRANSPORT:-tcp} in
    tcp) ;;
    err_none) echo "export PYTHONPATH=$HERE/nixl_params\${PYTHONPATH:+:\$PYTHONPATH} PDGW_NIXL_UCX_PARAMS=ucx_error_handling_mode=none";;
    cuda_ipc) echo "export PYTHONPATH=$HERE/nixl_params\${PYTHONPATH:+:\$PYTHONPATH} PDGW_NIXL_UCX_PARAMS=ucx_error_handling_mode=none"
              echo "export UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y";;
    cuda_ipc_peer) echo "export UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y";;
    *) echo "unknown TRANSPORT=$TRANSPORT" >&2; exit 2;;
  esac
}

kv_config() {  # role engine_id; KV_MODE=push: vLLM's NixlPushConnector (P writes into D; no D->P reads)
  if [ "${KV_MODE:-pull}" = push ]; then
    printf '{"kv_connector":"NixlPushConnector","kv_role":"%s","engine_id":"%s","kv_buffer_device":"cuda",' "$1" "$2"
    printf '"kv_load_failure_policy":"fail","kv_connector_extra_config":{"decoder_kv_blocks_ttl":%s}}' "$TTL_S"
    return
  fi
  printf '{"kv_connector":"NixlConnector","kv_role":"%s","engine_id":"%s","kv_buffer_device":"cuda",' "$1" "$2"
  printf '"kv_load_failure_policy":"fail","kv_connector_extra_config":{"bidirectional_kv_xfer":true,'
  printf '"decoder_kv_blocks_ttl":%s}}' "$TTL_S"
}

gpu_util() {  # kv_gib gpu: vLLM refuses to start unless the GPU's free memory is at least this share of it, and with
  # --kv-cache-memory-bytes the share sizes nothing else: ask for what the engine takes (KV, weights, activations:
  # KV + 10 GiB), so that one restarted beside the others starts (the H200's faults step, LOAD_ARMS=1: 0.25 asked
  # 35 GiB with 27.5 free, and D did not come back)
  local total_mib
  total_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i "$2" 2>/dev/null | head -1)
  [ -n "$total_mib" ] || { echo 0.25; return; }
  python3 -c "import math; print(min(0.9, math.ceil(($1 + 10) * 1024 / $total_mib * 100) / 100))"
}

start_engine() {  # name gpu side_port role engine_id [kv_gib]
  local name=$1 port=${PORT[$1]} kv_gib=${6:-${KV_GIB:-20}}
  if curl -sf -m 2 "http://127.0.0.1:$port/health" > /dev/null; then echo "$name already up"; return; fi
  local cmd=("$VLLM_PY" -m vllm.entrypoints.openai.api_server --model "$MODEL" --served-model-name pdgw-bench
             --host 127.0.0.1 --port "$port" --enforce-eager --max-model-len "${MAX_LEN:-36864}"
             --gpu-memory-utilization "${GPU_UTIL:-$(gpu_util "$kv_gib" "$2")}" --kv-cache-memory-bytes $(( kv_gib << 30 ))
             --disable-uvicorn-access-log ${BLOCK_SIZE:+--block-size $BLOCK_SIZE})
  [ -n "$4" ] && cmd+=(--kv-transfer-config "$(kv_config "$4" "$5")")
  if [ -n "$4" ] && [ "${KV_EVENTS:-0}" = 1 ] && [ ! -f "$RUN/$name.no_events" ]; then
    cmd+=(--kv-events-config "{\"enable_kv_cache_events\":true,\"publisher\":\"zmq\",\"endpoint\":\"tcp://*:${EVENTS_PORT[$name]}\",\"topic\":\"kv\"}")
  fi
  { echo "#!/usr/bin/env bash"
    echo "echo \$\$ > $RUN/$name.pid"
    echo "export CUDA_VISIBLE_DEVICES=$2 ${VLLM_PATH:+PYTHONPATH=$VLLM_PATH}"
    if [ -n "$4" ]; then transport_env; echo "export VLLM_NIXL_SIDE_CHANNEL_PORT=$3"; fi
    printf 'exec '; printf '%q ' "${cmd[@]}"; echo
  } > "$RUN/run_$name.sh"
  setsid bash "$RUN/run_$name.sh" < /dev/null > "$RUN/$name.log" 2>&1 &
}

t0=$(date +%s)
start_engine P "${P_GPU:-0}" 5600 kv_producer prefill-0
start_engine D "${D_GPU:-0}" 5700 kv_consumer decode-0
ENGINES="P D C"
if [ "${LOAD_ARMS:-0}" = 1 ]; then
  start_engine C "${C_GPU:-0}" "" "" "" "${C_KV_GIB:-$(( 2 * ${KV_GIB:-20} ))}"
  if [ "${COLOC2:-1}" = 1 ]; then
    start_engine C1 "${C_GPU:-0}" "" "" ""
    start_engine C2 "${C_GPU:-0}" "" "" ""
    ENGINES="P D C C1 C2"
  fi
else
  start_engine C "${C_GPU:-0}" "" "" ""
fi
echo "engines starting (TRANSPORT=${TRANSPORT:-tcp}); logs in $RUN"
want=${ENGINES// /}
for i in $(seq 1 180); do
  up=""; for n in $ENGINES; do curl -sf -m 2 "http://127.0.0.1:${PORT[$n]}/health" > /dev/null && up="$up$n"; done
  [ "$up" = "$want" ] && break
  for n in $ENGINES; do
    if [ -f "$RUN/$n.pid" ] && ! kill -0 "$(cat "$RUN/$n.pid")" 2>/dev/null; then
      echo "ENGINE $n EXITED"; tail -40 "$RUN/$n.log"
      if [ "${KV_EVENTS:-0}" = 1 ] && [ -n "${EVENTS_PORT[$n]:-}" ] && [ ! -f "$RUN/$n.no_events" ]; then
        echo "starting $n again without its KV-events publisher"; cp "$RUN/$n.log" "$RUN/$n.events-failed.log"
        touch "$RUN/$n.no_events"; rm -f "$RUN/$n.pid"
        if [ "$n" = P ]; then start_engine P "${P_GPU:-0}" 5600 kv_producer prefill-0
        else start_engine D "${D_GPU:-0}" 5700 kv_consumer decode-0; fi
        continue
      fi
      exit 1
    fi
  done
  sleep 2
done
echo "[$(( $(date +%s) - t0 ))s] engines up: $up"
[ "$up" = "$want" ] || { for n in $ENGINES; do echo "== $n"; tail -20 "$RUN/$n.log"; done; exit 1; }

start_gateway() {  # name reuse_policy [flags...]
  local port=${PORT[$1]} name=$1 policy=$2
  shift 2
  curl -sf -m 2 "http://127.0.0.1:$port/health" > /dev/null && return
  ( cd "$ROOT" && export PYTHONPATH="${GW_PATH:+$GW_PATH:}$ROOT"
    setsid "$GW_PY" -m gateway serve --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 \
      --tokenizer "$MODEL" --host 127.0.0.1 --port "$port" --decoder-kv-blocks-ttl-s "$TTL_S" \
      --health-interval-s 2 --reuse-policy "$policy" --conversation-lookup session "$@" < /dev/null \
      > "$RUN/$name.log" 2>&1 & echo $! > "$RUN/$name.pid" )
}
start_gateway G always --local-prefill-max-tokens 0
start_gateway G2 cost --local-prefill-max-tokens 0
start_gateway G3 cost
GATEWAYS="G G2 G3"
if [ "${LOAD_ARMS:-0}" = 1 ]; then
  events=()
  for n in P D; do
    [ "${KV_EVENTS:-0}" = 1 ] && [ ! -f "$RUN/$n.no_events" ] && \
      events+=(--kv-events "http://127.0.0.1:${PORT[$n]}=tcp://127.0.0.1:${EVENTS_PORT[$n]}")
  done
  # shellcheck disable=SC2086  # G4_FLAGS: more flags for G4, word-split (e.g. G4_FLAGS=--local-first-turns)
  start_gateway G4 cost --conversation-lookup both --admin-key "${ADMIN_KEY:-pdgw-bench-admin}" "${events[@]}" ${G4_FLAGS:-}
  GATEWAYS="$GATEWAYS G4"
  start_router() {  # name args...
    local name=$1; shift
    setsid $ROUTER "$@" --host 127.0.0.1 --port "${PORT[$name]}" --log-level warning \
      --max-concurrent-requests 4096 --disable-retries --prometheus-host 127.0.0.1 \
      --prometheus-port $(( ${PORT[$name]} + 100 )) < /dev/null > "$RUN/$name.log" 2>&1 &
    echo $! > "$RUN/$name.pid"
  }
  if [ -n "${ROUTER:-}" ]; then
    start_router R1 --vllm-pd-disaggregation --policy round_robin --prefill http://127.0.0.1:8100 \
      --decode http://127.0.0.1:8200
    GATEWAYS="$GATEWAYS R1"
    if [ "${COLOC2:-1}" = 1 ]; then
      start_router R2 --policy cache_aware --worker-urls http://127.0.0.1:8301 http://127.0.0.1:8302
      GATEWAYS="$GATEWAYS R2"
    fi
  fi
fi
for n in $GATEWAYS; do
  for i in $(seq 1 60); do curl -sf -m 2 "http://127.0.0.1:${PORT[$n]}/health" > /dev/null && break; sleep 1; done
  echo "[$(( $(date +%s) - t0 ))s] gateway $n: $(curl -s -m 2 "http://127.0.0.1:${PORT[$n]}/health")"
done
( cd "$ROOT" && PYTHONPATH="${GW_PATH:+$GW_PATH:}$ROOT" timeout 60 "$GW_PY" -m gateway check \
    --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --tokenizer "$MODEL" \
    --decoder-kv-blocks-ttl-s "$TTL_S" ) > "$RUN/check.txt" 2>&1
echo "pd-gateway check rc=$?: $(tail -3 "$RUN/check.txt" | tr '\n' ' ' | cut -c1-300)"
grep -h "pdgw nixl_params" "$RUN/P.log" "$RUN/D.log" 2>/dev/null | sort | uniq -c | head -4
