#!/usr/bin/env bash
# The GPU bench, end to end, from the repository root on a host with a GPU, vLLM >= 0.25 and NIXL:
#   bash bench/gpu/run.sh            # = model transport serve correctness ttft itl report stop
#   bash bench/gpu/run.sh serve ttft # only these steps, in this order
# Steps:
#   model        build the random-weight model (bench/gpu/make_model.py) into $MODEL unless it is there
#   transport    NIXL VRAM READ between two processes under several UCX settings -> $OUT/transport.json
#   serve        P, D, C and the gateway (bench/gpu/serve.sh); TRANSPORT=auto picks the fastest transport
#                that transport.json shows moving the bytes correctly
#   correctness  log-prob distance through the gateway, noise floor, controls -> $OUT/correctness.json
#   ttft         TTFT by history length in each mode (MODES) -> $OUT/ttft.json
#   itl          D's inter-token latency of running streams, alone and under local prefills -> $OUT/itl.json
#   load         the load bench (bench/gpu/load.py): many conversations at once through pd-gateway, stateless PD,
#                one and two co-located engines; needs `LOAD_ARMS=1` at serve (and ROUTER for vllm-router's arms)
#                -> $OUT/load/{load.json,load.md,load.png}; LOAD_POINTS, LOAD_DURATION_S, LOAD_THINK_SCALE,
#                LOAD_DRAIN_S (wait up to this long before each arm and point for D's KV to be free of old pins)
#   faults       faults under load (bench/gpu/loadfaults_deploy.py) through G4 (needs `LOAD_ARMS=1` at serve):
#                D killed (its process group, SIGKILL) and started again by $RUN/run_D.sh, then P the same, then D
#                at KV capacity (the long workload at twice D's KV with KV_GIB=14); C replays sampled turns
#                -> $OUT/faults/faults.json; FAULTS_DURATION_S (60: load per phase), FAULTS_CONCURRENCY (8),
#                FAULTS_CAPACITY_CONCURRENCY (32), FAULTS_AFTER_S (20: load once a killed engine is back),
#                FAULTS_THINK_SCALE (0.1), FAULTS_TURN_TIMEOUT_S (120: a turn past it is hung), FAULTS_KV_WAIT_S
#                (30), FAULTS_PHASES (d_killed,p_killed,d_at_capacity), FAULTS_BUDGET_S (560: the step's timeout)
#   report       bench/GPU-RESULTS.md and bench/gpu-results.png from $OUT
#   stop         end what serve started
# Environment: MODEL (/tmp/pdgw-bench-model), MODEL_SIZE (3b), OUT (bench/gpu-out), TRANSPORT (auto),
# LENGTHS (4000,8000,16000,32000), REPS (2), TTFT_BUDGET_S (420), MODES (all), SUFFIX_WORDS (300: turn 2's new
# user message), LOCAL_SIZES (256,1024), PY (python3: torch, transformers, matplotlib),
# and serve.sh's settings (VLLM_PY, GW_PY, VLLM_PATH, GW_PATH, KV_GIB, P_GPU, D_GPU, C_GPU, ...).
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
export MODEL=${MODEL:-/tmp/pdgw-bench-model}
OUT=${OUT:-$ROOT/bench/gpu-out}
PY=${PY:-python3}
mkdir -p "$OUT"
say() { echo "[$(date +%H:%M:%S)] $*"; }

step_model() {
  if [ -f "$MODEL/bench_model.json" ]; then say "model: $MODEL exists"; return; fi
  say "model: building ${MODEL_SIZE:-3b} into $MODEL"
  "$PY" "$HERE/make_model.py" "$MODEL" --size "${MODEL_SIZE:-3b}"
}

step_transport() {
  say "transport: NIXL VRAM READ under ${TRANSPORT_CONFIGS:-all configurations}"
  PYTHONPATH="${VLLM_PATH:-}" timeout 560 "$PY" "$HERE/transport.py" --out "$OUT" \
    ${TRANSPORT_CONFIGS:+--configs $TRANSPORT_CONFIGS}
}

pick_transport() {  # auto: the fastest configuration that moved the bytes, mapped to serve.sh's names
  [ "${TRANSPORT:-auto}" != auto ] && { echo "$TRANSPORT"; return; }
  "$PY" - "$OUT/transport.json" <<'PY'
import json, sys
try:
    rows = [r for r in json.load(open(sys.argv[1])) if r.get("ok") and r["name"] != "torch_ipc"]
except OSError:
    rows = []
names = {"ipc_get": "cuda_ipc", "ipc_get_tls": "cuda_ipc", "err_none": "err_none", "default": "tcp"}
rows = [r for r in rows if r["name"] in names]
print(names[max(rows, key=lambda r: r["gbps"] or 0)["name"]] if rows else "tcp")
PY
}

step_serve() {
  TRANSPORT=$(pick_transport)
  export TRANSPORT
  say "serve: TRANSPORT=$TRANSPORT"
  bash "$HERE/serve.sh" || exit 1
  "$PY" - "$OUT/env.json" <<PY
import json, subprocess, sys
def sh(c):
    try: return subprocess.run(c, shell=True, capture_output=True, text=True, timeout=30).stdout.strip()
    except Exception as e: return str(e)
env = {"gpu": sh("nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -1"),
       "vllm": sh("PYTHONPATH=${VLLM_PATH:-} ${VLLM_PY:-python3} -c 'import vllm; print(vllm.__version__)' 2>/dev/null | tail -1"),
       "transport": "$TRANSPORT",
       "model": json.load(open("$MODEL/bench_model.json"))}
json.dump(env, open(sys.argv[1], "w"), indent=1)
print(env)
PY
}

step_correctness() {
  say "correctness"
  timeout 900 "$PY" "$HERE/client.py" correctness --out "$OUT" --model-dir "$MODEL"
}

step_ttft() {
  say "ttft: lengths ${LENGTHS:-4000,8000,16000,32000}, reps ${REPS:-2}"
  timeout $(( ${TTFT_BUDGET_S:-420} + 240 )) "$PY" "$HERE/client.py" ttft --out "$OUT" --model-dir "$MODEL" \
    --lengths "${LENGTHS:-4000,8000,16000,32000}" --reps "${REPS:-2}" --budget-s "${TTFT_BUDGET_S:-420}" \
    ${MODES:+--modes $MODES} --suffix-words "${SUFFIX_WORDS:-300}"
}

step_itl() {
  say "itl: local prefills of ${LOCAL_SIZES:-256,1024} tokens"
  timeout 300 "$PY" "$HERE/client.py" itl --out "$OUT" --model-dir "$MODEL" --local-sizes "${LOCAL_SIZES:-256,1024}" \
    --reps "${ITL_REPS:-2}"
}

step_load() {
  local quick=${LOAD_QUICK:-0}
  local points=${LOAD_POINTS:-$([ "$quick" = 1 ] && echo chat:c16,long:c16,agent:c16 || echo chat:c8,chat:c32,chat:c128,long:c16,long:c32,agent:c16,agent:c32)}
  say "load: $points"
  local args=(--gateway http://127.0.0.1:8003 --coloc http://127.0.0.1:8300 --engines gateway=http://127.0.0.1:8100,http://127.0.0.1:8200
              --engines coloc=http://127.0.0.1:8300)
  if curl -sf -m 2 http://127.0.0.1:8010/health > /dev/null; then
    args+=(--stateless http://127.0.0.1:8010 --engines stateless=http://127.0.0.1:8100,http://127.0.0.1:8200)
  fi
  if curl -sf -m 2 http://127.0.0.1:8011/health > /dev/null; then
    args+=(--coloc2 http://127.0.0.1:8011 --engines coloc2=http://127.0.0.1:8301,http://127.0.0.1:8302)
  fi
  PYTHONPATH="${GW_PATH:+$GW_PATH:}$ROOT" timeout "${LOAD_BUDGET_S:-3000}" "$PY" "$HERE/load.py" "${args[@]}" \
    ${LOAD_ONLY:+--only $LOAD_ONLY} --drain-s "${LOAD_DRAIN_S:-0}" --points "$points" --duration-s "${LOAD_DURATION_S:-$([ "$quick" = 1 ] && echo 25 || echo 60)}" \
    --think-scale "${LOAD_THINK_SCALE:-$([ "$quick" = 1 ] && echo 0.1 || echo 1)}" --out "$OUT/load" \
    --title "load bench, H200 ($(date -u +%F))"
}

step_faults() {
  local run=${RUN:-/tmp/pdgw-gpu} pp=""
  say "faults: ${FAULTS_PHASES:-d_killed,p_killed,d_at_capacity}, ${FAULTS_DURATION_S:-60} s of load each"
  # The engines start again with the environment serve.sh gave them (its exports; run_P.sh / run_D.sh set only
  # their own) and the PYTHONPATH they had, not load.py's
  [ -n "${PYTHONPATH:-}" ] && printf -v pp 'PYTHONPATH=%q ' "$PYTHONPATH"
  local again="env -u PYTHONPATH ${pp}NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1"
  again+=" VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 VLLM_SERVER_DEV_MODE=1"
  again+=" VLLM_NIXL_SIDE_CHANNEL_HOST=127.0.0.1 setsid bash"
  local args=(--faults --gateway http://127.0.0.1:8003
              --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200
              --p-pidfile "$run/P.pid" --p-restart "$again $run/run_P.sh"
              --d-pidfile "$run/D.pid" --d-restart "$again $run/run_D.sh")
  curl -sf -m 2 http://127.0.0.1:8300/health > /dev/null && args+=(--coloc http://127.0.0.1:8300)
  PYTHONPATH="${GW_PATH:+$GW_PATH:}$ROOT" timeout "${FAULTS_BUDGET_S:-560}" "$PY" "$HERE/load.py" "${args[@]}" \
    --faults-phases "${FAULTS_PHASES:-d_killed,p_killed,d_at_capacity}" \
    --faults-duration-s "${FAULTS_DURATION_S:-60}" --faults-concurrency "${FAULTS_CONCURRENCY:-8}" \
    --faults-capacity-concurrency "${FAULTS_CAPACITY_CONCURRENCY:-32}" --faults-after-s "${FAULTS_AFTER_S:-20}" \
    --faults-kv-wait-s "${FAULTS_KV_WAIT_S:-30}" --think-scale "${FAULTS_THINK_SCALE:-0.1}" \
    --turn-timeout-s "${FAULTS_TURN_TIMEOUT_S:-120}" --out "$OUT/faults"
}

step_report() {
  "$PY" "$HERE/report.py" --results "$OUT" --md "${REPORT_MD:-$ROOT/bench/GPU-RESULTS.md}" ${LOCAL_RUN:+--local $LOCAL_RUN} \
    --png "${REPORT_PNG:-$ROOT/bench/gpu-results.png}"
}

step_stop() { bash "$HERE/serve.sh" stop; }

steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(model transport serve correctness ttft itl report stop)
for s in "${steps[@]}"; do
  declare -F "step_$s" > /dev/null || { echo "unknown step $s"; exit 2; }
  "step_$s"
done
