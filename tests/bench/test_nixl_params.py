"""bench/gpu/nixl_params: NIXL backend parameters from the environment, for agents vLLM creates itself."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SHIM = Path(__file__).resolve().parents[2] / "bench" / "gpu" / "nixl_params"
FAKE_API = '''
class nixl_agent:                       # what matters of NIXL's: __init__ creates its backends itself
    def __init__(self):
        self.create_backend("UCX", {"num_threads": "4"})
    def create_backend(self, backend, initParams={}):
        self.got = (backend, dict(initParams))
'''


@pytest.mark.parametrize(("env", "expected"), [
    ({"PDGW_NIXL_UCX_PARAMS": "ucx_error_handling_mode=none"},
     {"num_threads": "4", "ucx_error_handling_mode": "none"}),
    ({"PDGW_NIXL_UCX_PARAMS": "ucx_error_handling_mode=none, num_threads=8"},
     {"num_threads": "8", "ucx_error_handling_mode": "none"}),
    ({"PDGW_NIXL_OBJ_PARAMS": "bucket=x"}, {"num_threads": "4"}),       # another backend's: UCX untouched
    ({}, {"num_threads": "4"}),                                         # nothing set: nothing patched
])
def test_backend_params_are_merged_when_the_bindings_are_imported(tmp_path, env, expected):
    (tmp_path / "nixl_cu13").mkdir()
    (tmp_path / "nixl_cu13" / "__init__.py").write_text("")
    (tmp_path / "nixl_cu13" / "_api.py").write_text(FAKE_API)
    code = "import nixl_cu13._api as api; print(api.nixl_agent().got)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{SHIM}:{tmp_path}", **env})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(("UCX", expected))
