#!/bin/sh
# One vLLM engine of a P/D pair with the NIXL connector and bidirectional transfer (docs/protocol.md §1).
# Input, from the environment (deploy/pd.env plus the service's own):
#   PD_ROLE              prefill | decode
#   PD_ENGINE_ID         this engine's id in handles
#   PD_PORT              HTTP port
#   PDGW_TOKENIZER       the model (the gateway renders with the same id)
#   PDGW_DECODER_KV_BLOCKS_TTL_S, PD_KV_LEASE_DURATION_S, PD_BLOCK_SIZE, PD_MAX_MODEL_LEN, PD_GPU_MEMORY_UTILIZATION
# Extra arguments are passed on to `vllm serve`.
set -eu

case "$PD_ROLE" in
  prefill) role=kv_producer; policy=fail ;;  # vLLM 0.32 parks a declined read under recompute (docs/vllm-findings.md #8)
  decode)  role=kv_consumer; policy=fail ;;       # a failed read from P errors instead of silently recomputing
  *) echo "vllm-serve.sh: PD_ROLE must be prefill or decode, not '$PD_ROLE'" >&2; exit 2 ;;
esac

kv_config=$(printf '{"kv_connector":"NixlConnector","kv_role":"%s","engine_id":"%s","kv_load_failure_policy":"%s","kv_connector_extra_config":{"bidirectional_kv_xfer":true,"kv_lease_duration":%s,"decoder_kv_blocks_ttl":%s}}' \
  "$role" "$PD_ENGINE_ID" "$policy" "$PD_KV_LEASE_DURATION_S" "$PDGW_DECODER_KV_BLOCKS_TTL_S")

exec vllm serve "$PDGW_TOKENIZER" \
  --host 0.0.0.0 --port "$PD_PORT" \
  --block-size "$PD_BLOCK_SIZE" \
  --max-model-len "$PD_MAX_MODEL_LEN" \
  --gpu-memory-utilization "$PD_GPU_MEMORY_UTILIZATION" \
  --enable-prefix-caching \
  --kv-transfer-config "$kv_config" \
  "$@"
