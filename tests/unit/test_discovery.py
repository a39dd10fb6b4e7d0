"""dns:// pool entries followed round by round (engines/discovery.py), with a scripted resolver and the real pools
and registry: who joins and leaves, what a failed look keeps, how discovered engines are named, what is logged.
The wire (a real nameserver, the simulators) is tests/e2e/test_discovery.py's."""

from __future__ import annotations

import logging

import pytest

from gateway.engines.discovery import EngineDiscovery
from gateway.engines.registry import EngineRegistry
from gateway.telemetry import Metrics

NAME = "dns://pdgw-decode.ns.svc:8200"
TIMEOUT = "no answer within 2 s"


class ScriptedResolver:
    """Each look at a host takes its next scripted answer: addresses, or why there is none."""

    def __init__(self, answers: dict[str, list[frozenset[str] | str]]) -> None:
        self.answers = answers

    async def addresses(self, host: str) -> frozenset[str] | str:
        return self.answers[host].pop(0)


class NoProbes:
    """The health loop's place in the registry: every engine answers."""

    async def check_all(self) -> None:
        return None


def addresses(*ips: str) -> frozenset[str]:
    return frozenset(ips)


async def started(answers: list[frozenset[str] | str], names: dict[str, str] | None = None,
                  prefix: str = "") -> tuple[EngineDiscovery, EngineRegistry]:
    discovery = EngineDiscovery(ScriptedResolver({"pdgw-decode.ns.svc": answers}), interval_s=0.0)
    await discovery.follow(["http://p0:8100"], ["http://d-fixed:8200", NAME])
    prefill, decode = (discovery.pool(role, names or {}, prefix) for role in ("prefill", "decode"))
    return discovery, EngineRegistry(prefill, decode, NoProbes(), Metrics())


async def one_round(discovery: EngineDiscovery, registry: EngineRegistry) -> set[str]:
    before = {role: set(discovery.wanted(role)) for role in ("prefill", "decode")}
    await discovery._look(list(discovery.followed.values()))
    await discovery._apply(registry, before)
    return set(registry.pools["decode"].engines)


ROUNDS = [      # each later look's answer → D's pool after it (the fixed URL always stays)
    ([addresses("10.0.0.1", "10.0.0.2")], {"10.0.0.1", "10.0.0.2"}),                 # a pod joins
    ([addresses("10.0.0.2")], {"10.0.0.2"}),                                           # a pod leaves
    ([TIMEOUT], {"10.0.0.1"}),                                                         # no answer: kept
    (["All nameservers failed to answer the query"], {"10.0.0.1"}),                    # SERVFAIL: kept
    ([TIMEOUT, addresses("10.0.0.3")], {"10.0.0.3"}),                                  # ... until an answer
    ([addresses()], set()),                                                            # NXDOMAIN / no A: none
]


@pytest.mark.parametrize(("later", "found"), ROUNDS)
async def test_each_look_makes_the_pool_what_the_name_answers(later, found):
    discovery, registry = await started([addresses("10.0.0.1"), *later])
    assert set(registry.pools["decode"].engines) == {"http://d-fixed:8200", "http://10.0.0.1:8200"}
    for _ in later:
        pool = await one_round(discovery, registry)
    assert pool == {"http://d-fixed:8200"} | {f"http://{ip}:8200" for ip in found}
    assert set(registry.pools["prefill"].engines) == {"http://p0:8100"}


async def test_an_engine_the_admin_api_added_outlives_a_change_a_reload_does_not():
    discovery, registry = await started([addresses("10.0.0.1"), addresses("10.0.0.2"), addresses("10.0.0.2")])
    await registry.add("decode", "http://d-admin:8200")
    assert "http://d-admin:8200" in await one_round(discovery, registry)
    await discovery.reload(registry, ["http://p0:8100"], [NAME])
    assert set(registry.pools["decode"].engines) == {"http://10.0.0.2:8200"}


async def test_discovered_engines_are_named_by_address_unless_engine_names_says():
    discovery, registry = await started([addresses("10.0.0.1"), addresses("10.0.0.1", "10.0.0.2")],
                                        names={"http://10.0.0.2:8200": "d-big"}, prefix="m.")
    await one_round(discovery, registry)
    named = {url: e.name for url, e in registry.pools["decode"].engines.items()}
    assert named == {"http://d-fixed:8200": "m.decode-0", "http://10.0.0.1:8200": "m.decode-10.0.0.1",
                     "http://10.0.0.2:8200": "d-big"}


async def test_a_failing_name_is_logged_once_per_change(caplog):
    discovery, registry = await started([addresses("10.0.0.1"), TIMEOUT, TIMEOUT, TIMEOUT,
                                         addresses("10.0.0.1"), addresses("10.0.0.1")])
    caplog.clear()          # the first answer's line
    with caplog.at_level(logging.INFO, logger="gateway.discovery"):
        for _ in range(5):
            await one_round(discovery, registry)
    said = [r.getMessage() for r in caplog.records if r.name == "gateway.discovery"]
    assert said == [f"{NAME}: {TIMEOUT}; keeping its 1 engine(s) of the last answer", f"{NAME}: 10.0.0.1"]
