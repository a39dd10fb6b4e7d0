# One image for every pd-gateway process: the gateway (`serve`), the simulated engines (`sim`), `migrate`,
# `check`. Real vLLM engines run the official vllm/vllm-openai image plus the stream plugin (deploy/vllm.Dockerfile,
# compose.yaml profile vllm).
FROM python:3.12-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HOME=/models

WORKDIR /app
COPY pyproject.toml README.md ./
COPY gateway ./gateway
COPY migrations ./migrations
# Editable install: `pd-gateway migrate` finds migrations/ next to the package.
RUN pip install -e '.[tracing]' \
    && useradd --create-home --uid 10001 pdgw \
    && mkdir -p /models && chown pdgw /models
USER pdgw

EXPOSE 8000
ENTRYPOINT ["pd-gateway"]
CMD ["serve", "--help"]
