"""Give NIXL backends extra creation parameters from the environment, for engines that create their NIXL agent
themselves (vLLM's NixlConnector passes only `num_threads`).

    PYTHONPATH=bench/gpu/nixl_params PDGW_NIXL_UCX_PARAMS=ucx_error_handling_mode=none vllm serve ...

PDGW_NIXL_<BACKEND>_PARAMS is `key=value[,key=value]`; it is merged over what the caller passes. Why this
exists: NIXL's UCX backend defaults to `ucx_error_handling_mode=peer`, under which UCX may not wire up over
shared memory (no peer-failure handling there), so two processes on one host talk over TCP even when the GPU
could copy between them with CUDA IPC. Nothing is imported or changed unless such a variable is set; the
patch is applied when the NIXL bindings are first imported, not at interpreter start.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

_PREFIX, _SUFFIX = "PDGW_NIXL_", "_PARAMS"
_MODULES = ("nixl_cu13._api", "nixl_cu12._api", "nixl._api")


def _extra_params() -> dict[str, dict[str, str]]:
    out: dict[str, dict[str, str]] = {}
    for name, value in os.environ.items():
        if name.startswith(_PREFIX) and name.endswith(_SUFFIX) and value.strip():
            backend = name[len(_PREFIX):-len(_SUFFIX)]
            pairs = (item.split("=", 1) for item in value.split(",") if "=" in item)
            out[backend] = {k.strip(): v.strip() for k, v in pairs}
    return out


def _patch(module, extra: dict[str, dict[str, str]]) -> None:
    agent = getattr(module, "nixl_agent", None)
    if agent is None or getattr(agent, "_pdgw_patched", False):
        return
    original = agent.create_backend

    def create_backend(self, backend, initParams=None):  # noqa: N803 (NIXL's own name)
        params = {**(initParams or {}), **extra.get(backend.upper(), {})}
        print(f"[pdgw nixl_params] {backend} backend params {params}", file=sys.stderr, flush=True)
        return original(self, backend, params)

    agent.create_backend = create_backend
    agent._pdgw_patched = True


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, extra: dict[str, dict[str, str]]):
        self.extra = extra

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in _MODULES:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        loader, extra = spec.loader, self.extra

        class _Loader(importlib.abc.Loader):
            def create_module(self, spec):
                return loader.create_module(spec)

            def exec_module(self, module):
                loader.exec_module(module)
                _patch(module, extra)

        spec.loader = _Loader()
        return spec


_EXTRA = _extra_params()
if _EXTRA:
    sys.meta_path.insert(0, _Finder(_EXTRA))
