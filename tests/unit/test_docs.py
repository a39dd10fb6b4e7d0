"""The README and docs/ stay true to the code: every setting in the configuration table (flag and variable),
every metric in the metrics table, every reason code in the metrics table and in troubleshooting.md, and the
two set-up commands exist."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec
import pytest

from gateway.config import ENV_PREFIX, Settings
from gateway.telemetry import Metrics
from gateway.turns.plan import Reason

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
    flags = [re.match(r"`--([a-z-]+)", row[0]).group(1).replace("-", "_") for row in rows]
    assert sorted(flags) == sorted(FIELDS)
    for flag, row in zip(flags, rows, strict=True):
        assert row[1] == f"`{ENV_PREFIX}{flag.upper()}`"


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
