"""bench/gpu/bursts.py reads the gateway's own turn lines (telemetry.log_turn in its text format) and puts a
burst's first turns on one time line."""

from __future__ import annotations

import logging

from bench.gpu import bursts
from gateway.telemetry import TEXT_FORMAT, log_turn


class _Capture(logging.Handler):
    """Formats each record as the gateway's text log does, stamped with the time the test gives."""

    def __init__(self) -> None:
        super().__init__()
        self.fmt, self.at, self.lines = logging.Formatter(TEXT_FORMAT), 0.0, []

    def emit(self, record: logging.LogRecord) -> None:
        record.created, record.msecs = self.at, self.at % 1 * 1000     # asctime reads both
        self.lines.append(self.fmt.format(record))


def lines(turns: list[tuple[float, float, float, float]]) -> list[str]:
    """(ended, seconds, p_ms, d_first_ms) per first turn, as the gateway logs them."""
    log, capture = logging.getLogger("gateway.turn"), _Capture()
    level = log.level
    log.addHandler(capture), log.setLevel(logging.INFO)
    try:
        for ended, seconds, p_ms, d_ms in turns:
            capture.at = ended
            log_turn(log, request_id="r", plan="full", reason="first_turn", reused=0, computed=900,
                     seconds=seconds, p_ms=p_ms, d_first_ms=d_ms, own_ms=1.0)
        log_turn(log, request_id="r", plan="local", reason="short_suffix", reused=900, computed=9, seconds=0.1)
    finally:
        log.removeHandler(capture), log.setLevel(level)
    return capture.lines


def test_a_burst_whose_first_tokens_wait_for_p_s_last_answer():
    t0 = 1_000_000.0
    # four first turns sent together: P answers 100, 200, 300, 400 ms in; D's first tokens all at 900 ms
    turns = [(t0 + 1.0, 1.0, 100.0 * i, 900.0 - 100.0 * i) for i in range(1, 5)]
    found = bursts.bursts(bursts.first_turns(lines(turns + [(t0 + 9.0, 0.2, 50.0, 50.0)])), 4, 0.3)
    assert len(found) == 1 and len(found[0]) == 4
    assert bursts.row(found[0]) == "| 4 | 100-400 | 900-900 | +500 to +500 | 650 |"
