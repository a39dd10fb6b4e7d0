"""Structured logs: the JSON format and the one line per turn."""

from __future__ import annotations

import json
import logging

from gateway import telemetry


def test_json_lines_carry_the_turn_fields():
    logger = logging.getLogger("test.telemetry")
    seen: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = seen.append
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        telemetry.log_turn(logger, request_id="r1", plan="reuse", reason="continuous", reused=96, computed=12)
    finally:
        logger.removeHandler(handler)
    record = seen[0]
    assert record.levelno == logging.INFO
    assert record.getMessage() == "turn request_id=r1 plan=reuse reason=continuous reused=96 computed=12"
    line = json.loads(telemetry.JsonFormatter().format(record))
    assert line["level"] == "info" and line["logger"] == "test.telemetry" and line["message"].startswith("turn ")
    assert (line["plan"], line["reason"], line["reused"], line["computed"]) == ("reuse", "continuous", 96, 12)
    assert line["time"].endswith("Z")


def test_setup_logging_replaces_only_its_own_handler():
    root = logging.getLogger()
    before, level = list(root.handlers), root.level
    try:
        telemetry.setup_logging("info", "json")
        telemetry.setup_logging("warning", "text")
        ours = [h for h in root.handlers if getattr(h, "pdgw", False)]
        assert len(ours) == 1 and not isinstance(ours[0].formatter, telemetry.JsonFormatter)
        assert [h for h in root.handlers if h not in ours] == [h for h in before if not getattr(h, "pdgw", False)]
    finally:
        root.handlers[:] = before
        root.setLevel(level)
