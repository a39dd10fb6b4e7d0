# The vLLM engine image of the compose `vllm` profile: the official vLLM image plus the gateway's stream plugin
# (plugins/vllm-pdgw-stream, docs/vllm-stream-plugin.md), so a streamed D leg hands back D's handle on its final
# chunk and the turn after a streamed one reuses D's KV. Built from the repository root (compose does):
#   docker build -f deploy/vllm.Dockerfile --build-arg VLLM_IMAGE=vllm/vllm-openai:v0.32.0 -t pd-vllm:local .
ARG VLLM_IMAGE=vllm/vllm-openai:v0.32.0
FROM ${VLLM_IMAGE}

COPY plugins/vllm-pdgw-stream /opt/pdgw/vllm-pdgw-stream
# The official image installs its Python packages with uv into the system environment: the plugin goes there too,
# without dependencies (it has none, and vLLM's own must not move). The check fails the build when vLLM would not
# find the entry point it loads general plugins by.
RUN uv pip install --system --no-deps /opt/pdgw/vllm-pdgw-stream \
    && python3 -c "from importlib.metadata import entry_points; import pdgw_vllm_stream; \
assert [e for e in entry_points(group='vllm.general_plugins') if e.name == 'pdgw_stream'], 'plugin not registered'"

COPY deploy/vllm-serve.sh /deploy/vllm-serve.sh
ENTRYPOINT ["/bin/sh", "/deploy/vllm-serve.sh"]
