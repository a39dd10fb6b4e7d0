#!/usr/bin/env bash
# The project's lent GPU host (one H200, 16 cores, Python 3.12 with torch, no package registry, 64 MiB of files
# and 10 minutes per command): two commands, from the repository root, after `bash ../shared/gpu/pack.sh` here
# (which writes the git-ignored .gpu/p1 and .gpu/p2):
#   1. with .gpu/p1 carried:  bash bench/gpu/host.sh install   NIXL + wheels into /tmp, the model built meanwhile
#   2. with .gpu/p2 carried:  bash bench/gpu/host.sh run STEP...   vLLM 0.25.0 unpacked, then bench/gpu/run.sh's
#                             steps (default: serve ttft itl stop) with the host's paths; results in $OUT
#                             (the load bench: `bash bench/gpu/host.sh router` beside `pack.sh` puts vllm-router's
#                             wheel in .gpu/p2/router; `LOAD_ARMS=1 ... run serve load stop` then has all four arms)
# Settings for `run` are run.sh's and serve.sh's (TRANSPORT, BLOCK_SIZE, LENGTHS, MODES, SUFFIX_WORDS, ...);
# defaults here: TRANSPORT=cuda_ipc_peer BLOCK_SIZE=128 (bench/GPU-RESULTS.md: the fast setting).
set -u
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${OUT:-/tmp/out}
export MODEL=${MODEL:-/tmp/pdgw-bench-model}
mkdir -p "$OUT" /tmp/site /tmp/gwsite /tmp/carry /tmp/logs
t0=$(date +%s)
say() { echo "[$(( $(date +%s) - t0 ))s] $*"; }
pip_into() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$@" 2>&1 \
  | grep -v -i warning | tail -3; }

install() {
  nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader
  say "python $(python3 -V 2>&1), $(nproc) cores"
  cp .gpu/p1/vllm.tar.xz.aa /tmp/carry/          # a later command's files may replace .gpu/
  tar -xJf .gpu/p1/nixl.tar.xz -C /tmp/site
  pip_into /tmp/site .gpu/p1/whl/v/*.whl
  pip_into /tmp/gwsite .gpu/p1/whl/g/*.whl
  pip_into /tmp/gwsite .gpu/p1/whl/v/pyzmq-*.whl        # the gateway's KV-events subscriber (engines/kv_events.py)
  rm -rf /tmp/stubs && cp -r .gpu/p1/kit/stubs /tmp/stubs
  PYTHONPATH=/tmp/gwsite:$ROOT python3 -c "import gateway.app; print('gateway imports')" 2>&1 | tail -1
  rm -f /tmp/model.done
  setsid bash -c "python3 $ROOT/bench/gpu/make_model.py $MODEL > /tmp/logs/make_model.log 2>&1; \
    echo \$? > /tmp/model.done" < /dev/null > /dev/null 2>&1 &
  say "install done; the model builds in the background"
}

run() {
  if [ ! -f /tmp/site/vllm/__init__.py ]; then
    cat /tmp/carry/vllm.tar.xz.aa .gpu/p2/vllm.tar.xz.ab | xz -d -T0 | tar -xf - -C /tmp/site || { say "vLLM unpack failed"; exit 1; }
    pip_into /tmp/site .gpu/p2/spare/*.whl
  fi
  for _ in $(seq 1 150); do [ -f /tmp/model.done ] && break; sleep 1; done
  say "vLLM unpacked; model rc=$(cat /tmp/model.done 2>/dev/null || echo missing)"
  if ls .gpu/p2/router/*.whl > /dev/null 2>&1; then      # vllm-router for the load bench's arms
    mkdir -p /tmp/router && pip_into /tmp/router .gpu/p2/router/*.whl
    printf '#!/usr/bin/env bash\nPYTHONPATH=/tmp/router:/tmp/site exec python3 -c %q "$@"\n' \
      'import sys; from vllm_router.launch_router import main; sys.argv[0] = "vllm-router"; sys.exit(main())' \
      > /tmp/vllm-router && chmod +x /tmp/vllm-router
    export ROUTER=/tmp/vllm-router
    say "vllm-router: $(/tmp/vllm-router --help 2>&1 | head -1 | cut -c1-80)"
  fi
  export VLLM_PATH=/tmp/site:/tmp/stubs GW_PATH=/tmp/gwsite VLLM_USE_FLASHINFER_SAMPLER=0 OUT
  export TRANSPORT=${TRANSPORT:-cuda_ipc_peer} BLOCK_SIZE=${BLOCK_SIZE:-128}
  local steps=("$@")
  [ ${#steps[@]} -eq 0 ] && steps=(serve ttft itl stop)
  bash "$ROOT/bench/gpu/run.sh" "${steps[@]}"
  tar -czf "$OUT/logs.tgz" -C /tmp/pdgw-gpu . 2>/dev/null     # one file: a command returns at most 8
  say "run done"
}

router() {  # here, after pack.sh: vllm-router's wheel and the imports its launcher needs that the host lacks
  mkdir -p .gpu/p2/router && cp bench/host/wheels/vllm_router-*.whl bench/host/wheels/orjson-*.whl .gpu/p2/router/
  du -sh .gpu/p2
}

case ${1:-} in
  install) install;;
  router) router;;
  run) shift; run "$@";;
  *) echo "usage: bash bench/gpu/host.sh install | run [STEP...] | router"; exit 2;;
esac
