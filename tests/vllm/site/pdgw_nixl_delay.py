"""Give NIXL's progress thread a poll delay (installed into the `vllm` tier's venv only, by scripts/vllm-env).

NIXL's Python API creates its agent with `pthrDelay = 0`: the progress thread polls without pause, so every
idle vLLM server spins a core, and on a 2-core machine a P/D pair starves itself. With
`NIXL_PTHR_DELAY_US=N` set, the agent config gets `pthrDelay = N` microseconds just before the agent is
created. Without the variable nothing happens. Loaded at interpreter start by `pdgw_nixl_delay.pth`; it
imports nothing of NIXL itself, it only waits for NIXL's binding module to be imported.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

ENV = "NIXL_PTHR_DELAY_US"


def _patch(bindings, delay_us: int) -> None:
    create = bindings.nixlAgent

    def agent(name, config):
        config.pthrDelay = delay_us
        return create(name, config)

    bindings.nixlAgent = agent


class _OnImport(importlib.abc.MetaPathFinder):
    """Patches `nixl_cuXX._bindings` right after it is loaded, then steps aside."""

    def __init__(self, delay_us: int) -> None:
        self.delay_us = delay_us

    def find_spec(self, fullname, path, target=None):
        if not (fullname.startswith("nixl_cu") and fullname.endswith("._bindings")):
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            _patch(module, self.delay_us)

        spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    delay = os.environ.get(ENV, "").strip()
    if delay:
        sys.meta_path.insert(0, _OnImport(int(delay)))


install()
