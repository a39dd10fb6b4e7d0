"""Imports flow one way (STYLE.md): api → turns → engines, store; the simulator imports nothing of the gateway;
verify (a client of a deployment) knows only the engines' wire protocol."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "gateway"

# package → gateway packages it may import (besides itself and the shared leaf modules)
ALLOWED = {
    "api": {"turns"},
    "turns": {"engines", "store"},
    "engines": set(),
    "store": set(),
    "sim": set(),
    "verify": {"engines"},          # the KV-handle protocol and the /metrics reader, for its controls
}
LEAVES = {"errors", "config", "telemetry", "tracing"}
# top-level modules → gateway packages and modules they may import (besides the leaves)
TOP_LEVEL = {
    "__main__": {"cli"},
    "cli": {"app", "serving", "startup", "demo", "store", "sim", "api", "verify"},   # commands: each its own
    "app": {"api", "turns", "engines", "store", "startup"},                # wires everything but the simulator
    "startup": {"engines", "store", "turns"},
    "serving": set(),
    "processes": set(),
    "demo": {"processes"},
}
FOREIGN_BANS = {  # third-party modules a package must not touch
    "api": {"redis", "aiohttp", "httpx", "transformers"},
    "turns": {"litestar", "redis"},
    "engines": {"litestar", "redis", "transformers"},
    "store": {"litestar", "aiohttp", "httpx", "transformers"},
    "verify": {"litestar", "redis", "transformers"},
}


def imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def modules():
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT).parts
        if len(parts) > 1 and parts[0] in ALLOWED:
            yield pytest.param(parts[0], path, id=str(path.relative_to(ROOT)))


@pytest.mark.parametrize(("package", "path"), list(modules()))
def test_imports_follow_the_arrows(package, path):
    for name in imports(path):
        top, _, rest = name.partition(".")
        if top == "gateway":
            target = rest.split(".")[0]
            if package == "sim":
                assert target == "sim", f"{path.name}: the simulator must not import gateway.{target}"
            else:
                assert target in ALLOWED[package] | LEAVES | {package}, f"{path.name} imports gateway.{target}"
        assert top not in FOREIGN_BANS.get(package, set()), f"{path.name} imports {top}"


def test_every_top_level_module_is_covered():
    assert {p.stem for p in ROOT.glob("*.py")} - {"__init__"} == set(TOP_LEVEL) | LEAVES


@pytest.mark.parametrize("module", sorted(TOP_LEVEL))
def test_top_level_modules_follow_the_arrows(module):
    for name in imports(ROOT / f"{module}.py"):
        top, _, rest = name.partition(".")
        if top == "gateway" and rest:
            target = rest.split(".")[0]
            assert target in TOP_LEVEL[module] | LEAVES, f"{module}.py imports gateway.{target}"


def test_transformers_only_in_render_and_sim():
    users = {p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*.py")
             if any(n.split(".")[0] == "transformers" for n in imports(p))}
    assert {u for u in users if not u.startswith("sim/")} <= {"turns/render.py"}


@pytest.mark.parametrize("leaf", sorted(LEAVES))
def test_leaf_modules_import_no_gateway_module(leaf):
    assert not [n for n in imports(ROOT / f"{leaf}.py") if n.startswith("gateway")]
