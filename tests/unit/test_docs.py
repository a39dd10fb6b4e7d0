"""The README and docs/ stay true to the code: every setting in the configuration table (flag and variable),
every metric in the metrics table, every reason code in the metrics table and in troubleshooting.md, and the
two set-up commands exist."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec
import pytest

from gateway.config import ENV_PREFIX, FILE_ONLY, Settings
from gateway.telemetry import Metrics
from gateway.turns.reuse.plan import Reason

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
FIELDS = {f.name for f in msgspec.structs.fields(Settings)}


def section(text: str, heading: str) -> str:
    start = text.index(f"\n## {heading}")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def table_rows(text: str) -> list[list[str]]:
    rows = [line.strip().strip("|").split("|") for line in text.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in row] for row in rows[2:]]


def test_configuration_table_lists_every_setting_once():
    rows = table_rows(section(README, "Configuration"))
    flags = [re.match(r"`(?:--)?([a-z_-]+)", row[0]).group(1).replace("-", "_") for row in rows]
    assert sorted(flags) == sorted(FIELDS)
    for flag, row in zip(flags, rows, strict=True):
        if flag in FILE_ONLY:        # no flag, no variable: the row says so
            assert row[0].startswith(f"`{flag}`") and row[1] == "(settings file only)"
        else:
            assert row[0].startswith(f"`--{flag.replace('_', '-')}") and row[1] == f"`{ENV_PREFIX}{flag.upper()}`"


def exported_metrics() -> set[str]:
    names = set()
    for line in Metrics().render().decode().splitlines():
        if line.startswith("# TYPE "):
            names.add(line.split()[2])          # counters already end in _total here
    return names


def test_metrics_table_lists_every_metric():
    documented = {re.match(r"`(pdgw_\w+)`", row[0]).group(1) for row in table_rows(section(README, "Metrics"))}
    assert documented == exported_metrics()


@pytest.mark.parametrize("reason", [r.value for r in Reason])
def test_every_reason_is_documented(reason):
    assert f"`{reason}`" in section(README, "Metrics")
    assert f"\n## `{reason}`\n" in (ROOT / "docs/troubleshooting.md").read_text()


def test_the_two_set_up_commands_exist():
    assert "scripts/demo" in README and "scripts/test" in README
    for script in ("scripts/demo", "scripts/test", "scripts/bootstrap"):
        assert (ROOT / script).stat().st_mode & 0o111, f"{script} is not executable"


def test_docs_links_resolve():
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#]+)\)", doc.read_text()):
            if "://" not in target:
                assert (doc.parent / target).exists(), f"{doc.name}: {target}"


# One answer on kv_load_failure_policy: `fail` on P and D. Sentences that recommend `recompute` for P (the
# forms the docs once used): vLLM 0.32 never answers a read P declines under it (docs/protocol.md §1).
_RECOMPUTE_ON_P = [
    re.compile(r"\b(use|set|recommends?|recommended|prefer)\s+`?(kv_load_failure_policy:?\s*)?\"?recompute\"?`?"
               r"\s+(on|for)\s+(the\s+)?(P|prefill)\b", re.I),
    re.compile(r"\bP's\s+recommended\s+`?kv_load_failure_policy:?\s*recompute", re.I),
    re.compile(r"\"kv_role\"\s*:\s*\"kv_producer\"[^}]*\"kv_load_failure_policy\"\s*:\s*\"recompute\"", re.I),
]


def recommends_recompute_on_p(text: str) -> bool:
    flat = " ".join(text.split())
    return any(pattern.search(flat) for pattern in _RECOMPUTE_ON_P)


@pytest.mark.parametrize("sentence", [
    "expired handles under `kv_load_failure_policy: fail` (use `recompute` on P), side-channel addresses",
    "With P's recommended `kv_load_failure_policy:\nrecompute` that read becomes a local prefill",
    "PROTOCOL.md §1 recommends `recompute` on P; on vLLM 0.32 a declined read",
    """--kv-transfer-config '{"kv_connector":"NixlConnector","kv_role":"kv_producer","engine_id":"p",
    "kv_load_failure_policy":"recompute"}'""",
])
def test_the_policy_check_catches_a_recommendation_of_recompute_on_p(sentence):
    assert recommends_recompute_on_p(sentence)


def test_no_doc_recommends_recompute_on_p():
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "deploy").glob("*"))]
    offenders = [doc.name for doc in docs if doc.is_file() and recommends_recompute_on_p(doc.read_text())]
    assert offenders == []
    for doc in ("deployment.md", "protocol.md"):
        assert re.search(r"`fail` on (\*\*)?both", (ROOT / "docs" / doc).read_text()), doc


def test_protocol_keeps_the_section_numbers_code_cites():
    headings = re.findall(r"^## (\d)\. ", (ROOT / "docs/protocol.md").read_text(), re.M)
    assert headings == [str(n) for n in range(1, 10)]


def test_first_hour_notes():
    """What a new user tripped over (issue 12): the multi-turn benchmark's flag, Compose v2."""
    assert "--send-conversation-id" in README and "--send-conversation-id" in (ROOT / "docs/deployment.md").read_text()
    assert "Compose v2" in section(README, "Docker Compose")
