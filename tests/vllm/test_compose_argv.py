"""The compose `vllm` profile's engine commands, parsed by vLLM's own `vllm serve` parser (issue 38): what
deploy/vllm-serve.sh builds from compose.yaml and deploy/pd.env is a command line vLLM 0.32 accepts, with the
KV-transfer config it means. No GPU and no engine: the parser alone, in the tier's vLLM environment."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.unit.test_deploy import vllm_argv

pytestmark = pytest.mark.vllm

PARSE = """
import json, sys
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
argv = json.loads(sys.argv[1])
args = make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", argv[1], *argv[2:]])
kv = args.kv_transfer_config
print(json.dumps({"model": args.model, "port": args.port, "block_size": args.block_size,
                  "connector": kv.kv_connector, "role": kv.kv_role, "engine_id": kv.engine_id}))
"""


@pytest.mark.parametrize(("name", "role"), [("prefill", "kv_producer"), ("decode", "kv_consumer")])
def test_vllm_accepts_the_engine_command(vllm_python, tmp_path, name, role):
    argv = vllm_argv(name, tmp_path)
    assert argv[0] == "serve"
    done = subprocess.run([vllm_python, "-c", PARSE, json.dumps(argv)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    parsed = json.loads(done.stdout.strip().splitlines()[-1])
    assert parsed["model"] == argv[1] and parsed["connector"] == "NixlConnector" and parsed["role"] == role
    assert parsed["engine_id"] == f"{name}-0" and str(parsed["port"]) == argv[argv.index("--port") + 1]
