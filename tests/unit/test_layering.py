"""Imports flow one way (STYLE.md): api → turns → engines, store; the simulator imports nothing of the gateway;
verify (a client of a deployment) knows only the engines' wire protocol. Inside turns/ too: intake → reuse → legs →
state → the flat modules that run a turn, each importing only those before it (docs/architecture.md)."""

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
LEAVES = {"errors", "config", "urls", "telemetry", "tracing"}
# turns/ sub-package → the turns sub-packages it may import (besides itself), and the gateway packages
TURNS_ORDER = ["intake", "reuse", "legs", "state", "run"]
TURNS_PACKAGES = {"intake": {"store"}, "reuse": {"engines", "store"}, "legs": {"engines", "store"},
                  "state": {"engines", "store"}, "run": {"engines", "store"}}
# top-level modules → gateway packages and modules they may import (besides the leaves)
TOP_LEVEL = {
    "__main__": {"cli"},
    "cli": {"app", "serving", "connections", "startup", "demo", "store", "sim", "api", "verify", "workers"},
    "app": {"api", "engines", "store", "turns", "assembly"},               # wires everything but the simulator
    "assembly": {"api", "turns", "engines", "store", "startup"},          # one model's part
    "startup": {"engines", "store", "turns", "startup_findings"},
    "startup_findings": {"engines", "turns"},
    "serving": {"connections"},
    "workers": {"serving"},                                               # serve --workers N's supervisor
    "connections": set(),
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


def turns_modules():
    for path in sorted((ROOT / "turns").rglob("*.py")):
        parts = path.relative_to(ROOT / "turns").parts
        room = parts[0] if len(parts) > 1 else None        # None: a flat module that runs the turn
        yield pytest.param(room, path, id=str(path.relative_to(ROOT)))


@pytest.mark.parametrize(("room", "path"), list(turns_modules()))
def test_turns_rooms_follow_their_order(room, path):
    allowed = set(TURNS_ORDER) if room is None else set(TURNS_ORDER[:TURNS_ORDER.index(room) + 1])
    for name in imports(path):
        parts = name.split(".")
        if parts[:2] != ["gateway", "turns"]:
            if room is not None and parts[0] == "gateway" and len(parts) > 1:
                assert parts[1] in TURNS_PACKAGES[room] | LEAVES | {"turns"}, f"turns/{room} imports {name}"
            continue
        target = parts[2] if len(parts) > 2 else ""
        if room is not None:        # a room imports no flat module, and only the rooms before it
            assert target in allowed, f"turns/{room}/{path.name} imports {name}"


def test_turns_rooms_are_all_ordered_and_few_modules_stay_flat():
    rooms = {p.name for p in (ROOT / "turns").iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert rooms == set(TURNS_ORDER)
    assert len([p for p in (ROOT / "turns").glob("*.py") if p.stem != "__init__"]) <= 4
    for room in rooms:
        doc = ast.get_docstring(ast.parse((ROOT / "turns" / room / "__init__.py").read_text()))
        assert doc and "imports" in doc, f"turns/{room}/__init__.py says what it holds and may import"


def test_no_class_over_200_lines_no_module_over_400():
    for path in ROOT.rglob("*.py"):
        text = path.read_text()
        assert len(text.splitlines()) <= 400, f"{path.relative_to(ROOT)} has {len(text.splitlines())} lines"
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                assert node.end_lineno - node.lineno < 200, f"{path.relative_to(ROOT)}: {node.name}"


def test_no_two_modules_share_a_name():
    """A name says what a module holds: the simulator's and the gateway's too (`sim/engine_core.py`, not a second
    `engine.py`), so a traceback or a grep names one file."""
    seen: dict[str, list[str]] = {}
    for path in ROOT.rglob("*.py"):
        if path.stem != "__init__":
            seen.setdefault(path.stem, []).append(str(path.relative_to(ROOT)))
    assert {name: paths for name, paths in seen.items() if len(paths) > 1} == {}


def submodules_imported(path: Path, known) -> set[str]:
    """`from gateway.turns.reuse import plan`: the module `plan`, not only the package."""
    return {f"{node.module}.{a.name}" for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0
            for a in node.names if f"{node.module}.{a.name}" in known}


def _module_of(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_no_import_circle_between_gateway_modules():
    """TYPE_CHECKING imports included: a circle there is one a refactor trips over."""
    known = {_module_of(p): p for p in ROOT.rglob("*.py")}
    graph = {}
    for module, path in known.items():
        targets = set()
        for name in imports(path) | submodules_imported(path, known):
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module and not module.startswith(name + "."):   # a package's own __init__
                targets.add(name)
        graph[module] = targets
    done, on_path = set(), []

    def visit(module):
        if module in on_path:
            raise AssertionError(" -> ".join(on_path[on_path.index(module):] + [module]))
        if module in done:
            return
        on_path.append(module)
        for target in graph[module]:
            visit(target)
        on_path.pop()
        done.add(module)

    for module in sorted(graph):
        visit(module)


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
    assert {u for u in users if not u.startswith("sim/")} <= {"turns/intake/render.py"}


@pytest.mark.parametrize("leaf", sorted(LEAVES))
def test_leaf_modules_import_no_gateway_module_but_leaves(leaf):
    assert not [n for n in imports(ROOT / f"{leaf}.py")
                if n.startswith("gateway") and n.removeprefix("gateway.") not in LEAVES]


# The seams (issue 39): what crosses them goes through one module on each side.
SEAMS = {
    "gateway.turns.runner": {"api/turn_entry.py", "assembly.py"},  # every API's turn goes through run_turn
    "gateway.turns.reuse.push_plans": {"turns/run/push_leg.py"},  # push mode's plans: its protocol object only
    "gateway.turns.reuse.pairing": {"turns/run/push_leg.py"},
    "gateway.turns.run.push_leg": {"turns/run/transfer_protocol.py"},   # chosen at assembly (protocol_for)
}


@pytest.mark.parametrize("module", sorted(SEAMS))
def test_a_seam_is_crossed_only_where_it_is_meant_to_be(module):
    own = module.removeprefix("gateway.").replace(".", "/") + ".py"
    users = {rel for p in ROOT.rglob("*.py") if (rel := p.relative_to(ROOT).as_posix()) != own
             and module in imports(p) | submodules_imported(p, {module})}
    assert users <= SEAMS[module], f"{module} is imported by {sorted(users - SEAMS[module])}"
