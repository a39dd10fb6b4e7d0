"""bench/gpu/bursts.py reads the gateway's own turn lines (telemetry.log_turn in its text format) and puts a
burst's first turns on one time line."""

from __future__ import annotations

import logging

from bench.gpu import bursts
from gateway.telemetry import TEXT_FORMAT, log_turn


def lines(turns: list[tuple[float, float, float, float]]) -> list[str]:
    """(ended, seconds, p_ms, d_first_ms) per first turn, as the gateway logs them."""
    out: list[str] = []
    fmt = logging.Formatter(TEXT_FORMAT)
    handler = logging.Handler()
    handler.emit = lambda record: out.append(fmt.format(record))   # type: ignore[method-assign]
    log = logging.getLogger("gateway.turn")
    log.addHandler(handler), log.setLevel(logging.INFO)
    ended_at = [turns[0][0]]
    stamp = logging.Filter()
    def at(record: logging.LogRecord) -> bool:     # the time stamp is `created`'s, its milliseconds `msecs`'
        record.created, record.msecs = ended_at[0], ended_at[0] % 1 * 1000
        return True
    stamp.filter = at   # type: ignore[method-assign]
    log.addFilter(stamp)
    try:
        for ended, seconds, p_ms, d_ms in turns:
            ended_at[0] = ended
            log_turn(log, request_id="r", plan="full", reason="first_turn", reused=0, computed=900,
                     seconds=seconds, p_ms=p_ms, d_first_ms=d_ms, own_ms=1.0)
        log_turn(log, request_id="r", plan="local", reason="short_suffix", reused=900, computed=9, seconds=0.1)
    finally:
        log.removeHandler(handler), log.removeFilter(stamp)
    return out


def test_a_burst_whose_first_tokens_wait_for_p_s_last_answer():
    t0 = 1_000_000.0
    # four first turns sent together: P answers 100, 200, 300, 400 ms in; D's first tokens all at 900 ms
    turns = [(t0 + 1.0, 1.0, 100.0 * i, 900.0 - 100.0 * i) for i in range(1, 5)]
    found = bursts.bursts(bursts.first_turns(lines(turns + [(t0 + 9.0, 0.2, 50.0, 50.0)])), 4, 0.3)
    assert len(found) == 1 and len(found[0]) == 4
    assert bursts.row(found[0]) == "| 4 | 100-400 | 900-900 | +500 to +500 | 650 |"
