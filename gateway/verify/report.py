"""What `pd-gateway verify` prints: one table row per judged request, then one verdict line (the last line of
stdout, for scripts: `verify: PASS ...` or `verify: FAIL ...`); or the same as JSON."""

from __future__ import annotations

from typing import Any

from gateway.verify.run import Result

COLUMNS = ("request", "verdict", "judged by", "max |Δlogprob|", "plan/reason or control", "detail")


def lines(result: Result) -> list[str]:
    rows = [(v.name, _mark(v), v.how, "-" if v.max_abs is None else f"{v.max_abs:.4f}", v.note, v.detail)
            for v in result.verdicts]
    widths = [max(len(str(c)) for c in col) for col in zip(COLUMNS, *rows)]
    widths[-1] = 0                                   # the detail column is not padded
    out = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in [COLUMNS, *rows]]
    out.insert(1, "  ".join("-" * w for w in widths[:-1]) + "  ------")
    reuse = ", ".join(f"{plan} {n}" for plan, n in sorted(result.reuse.items())) or "none"
    out += ["", f"model {result.model}; baseline noise floor (max |Δlogprob| against itself) {result.noise_floor:.4f}; "
                f"later turns' plans: {reuse}"]
    out += [f"warning: {w}" for w in result.warnings] + [f"problem: {p}" for p in result.problems]
    out.append(verdict_line(result))
    return out


def verdict_line(result: Result) -> str:
    cases = [v for v in result.verdicts if not v.expect_wrong]
    controls = [v for v in result.verdicts if v.expect_wrong]
    caught = sum(v.as_expected for v in controls)
    return (f"verify: {'PASS' if result.passed else 'FAIL'} cases={len(cases)} "
            f"flagged={sum(v.status == 'flagged' for v in cases)} skipped={sum(v.status == 'skipped' for v in cases)} "
            f"controls_flagged={caught}/{len(controls)} noise_floor={result.noise_floor:.4f} "
            f"pinned_left={result.left_pinned}")


def to_dict(result: Result) -> dict[str, Any]:
    return {"verdict": "pass" if result.passed else "fail", "model": result.model,
            "noise_floor": round(result.noise_floor, 6), "verdicts": [v.as_dict() for v in result.verdicts],
            "conversations": result.conversations, "conversations_deleted": result.deleted,
            "control_handles_released": result.released, "later_turn_plans": result.reuse,
            "problems": result.problems, "warnings": result.warnings, "summary": verdict_line(result)}


def _mark(verdict: Any) -> str:
    if verdict.expect_wrong:
        return "caught" if verdict.as_expected else "MISSED"
    return {"pass": "ok", "flagged": "FLAGGED", "skipped": "skipped"}[verdict.status]
