"""The load bench's figures: one row per arm and point, the ratios against the co-located arms and stateless PD,
the `gpuload:` summary line, a markdown section and a PNG (TTFT and ITL against concurrency, a line per arm).

Goodput counts turns that meet the SLO: later turns TTFT <= 300 ms, first turns TTFT <= 2 s (their whole prompt is
new), and the turn's own ITL p99 <= 50 ms. A later turn is served from D's KV when the gateway planned `local`,
`reuse` or `partial` with reused tokens (the X-PD-* headers).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from bench.loadgen import percentile as pct

LATER_TTFT_SLO_S, FIRST_TTFT_SLO_S, ITL_SLO_S = 0.300, 2.0, 0.050
GATEWAY, STATELESS, COLOC, COLOC2 = "gateway", "stateless", "coloc", "coloc2"
LABELS = {GATEWAY: "pd-gateway (defaults)", STATELESS: "stateless PD (vllm-router)",
          COLOC: "one engine, KV of P+D", COLOC2: "two engines (vllm-router cache_aware)"}
FROM_D = ("local", "reuse", "partial")


def good(t) -> bool:
    slo = LATER_TTFT_SLO_S if t.later else FIRST_TTFT_SLO_S
    return t.ok and t.ttft_s <= slo and pct(t.gaps, 99) <= ITL_SLO_S


def row(turns: list, wall_s: float) -> dict[str, Any]:
    """One arm at one point."""
    ok = [t for t in turns if t.ok]
    first, later = [t.ttft_s for t in ok if not t.later], [t.ttft_s for t in ok if t.later]
    gaps = [g for t in ok for g in t.gaps]
    later_ok = [t for t in ok if t.later]
    from_d = [t for t in later_ok if t.plan in FROM_D and t.reused > 0]
    ms = 1e3
    return {
        "turns": len(ok), "firsts": len(first), "errors": len(turns) - len(ok),
        "first_p50": pct(first, 50) * ms, "first_p90": pct(first, 90) * ms, "first_p99": pct(first, 99) * ms,
        "later_p50": pct(later, 50) * ms, "later_p90": pct(later, 90) * ms, "later_p99": pct(later, 99) * ms,
        "itl_p50": pct(gaps, 50) * ms, "itl_p99": pct(gaps, 99) * ms,
        "tokens_per_s": sum(t.output_tokens for t in ok) / wall_s if wall_s else 0.0,
        "turns_per_s": len(ok) / wall_s if wall_s else 0.0,
        "goodput": sum(good(t) for t in turns) / wall_s if wall_s else 0.0,
        "reuse": len(from_d) / len(later_ok) if later_ok else 0.0,
        "plans": dict(Counter(f"{t.plan}/{t.reason}" for t in later_ok if t.plan).most_common()),
        "first_plans": dict(Counter(f"{t.plan}/{t.reason}" for t in ok if not t.later and t.plan).most_common()),
        "error_kinds": dict(Counter(t.error[:60] for t in turns if not t.ok).most_common(5)),
        "wall_s": wall_s,
    }


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def ratios(arms: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """The gateway against the better co-located arm and against stateless PD, at one point."""
    gw = arms.get(GATEWAY)
    colocs = [arms[a] for a in (COLOC, COLOC2) if a in arms and arms[a]["turns"]]
    if not gw or not colocs:
        return {}
    out = {"later_p50_vs_coloc": _ratio(gw["later_p50"], min(c["later_p50"] for c in colocs)),
           "later_p99_vs_coloc": _ratio(gw["later_p99"], min(c["later_p99"] for c in colocs)),
           "first_p50_vs_coloc": _ratio(gw["first_p50"], min(c["first_p50"] for c in colocs)),
           "itl_p99_vs_coloc": _ratio(gw["itl_p99"], min(c["itl_p99"] for c in colocs)),
           "goodput_vs_coloc": _ratio(gw["goodput"], max(c["goodput"] for c in colocs))}
    if STATELESS in arms:
        out["goodput_vs_stateless"] = _ratio(gw["goodput"], arms[STATELESS]["goodput"])
        out["later_p50_vs_stateless"] = _ratio(gw["later_p50"], arms[STATELESS]["later_p50"])
    return out


def summary_line(points: list[dict[str, Any]], flagged: int) -> str:
    """`gpuload:` (../shared/DESIGN.md): the worst point for each ratio, the gateway's reuse over all points."""
    rs = [p["ratios"] for p in points if p.get("ratios")]

    def worst(key: str, low_is_bad: bool = False) -> str:
        vals = [r[key] for r in rs if r.get(key) is not None]
        if not vals:
            return "na"
        return f"{(min(vals) if low_is_bad else max(vals)):.3f}"

    gws = [p["arms"][GATEWAY] for p in points if GATEWAY in p["arms"]]
    later = sum(g["turns"] - g["firsts"] for g in gws)
    reused = sum(g["reuse"] * (g["turns"] - g["firsts"]) for g in gws)
    errors = sum(a["errors"] for p in points for a in p["arms"].values())
    return (f"gpuload: later_p50_vs_coloc={worst('later_p50_vs_coloc')} "
            f"later_p99_vs_coloc={worst('later_p99_vs_coloc')} itl_p99_vs_coloc={worst('itl_p99_vs_coloc')} "
            f"goodput_vs_coloc={worst('goodput_vs_coloc', True)} "
            f"goodput_vs_stateless={worst('goodput_vs_stateless', True)} "
            f"reuse={reused / later if later else 0:.3f} errors={errors} flagged={flagged}")


def markdown(result: dict[str, Any]) -> list[str]:
    lines = []
    for p in result["points"]:
        lines += [f"**{p['point']}** ({p['note']})", "",
                  "| arm | first TTFT p50 / p99 ms | later TTFT p50 / p90 / p99 ms | ITL p50 / p99 ms | tokens/s | "
                  "turns/s | goodput/s | reuse | errors | engines | later plans |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for arm, a in p["arms"].items():
            plans = ", ".join(f"{k} {v}" for k, v in list(a["plans"].items())[:4]) or "-"
            eng = ", ".join(f"{k} {v:g}" for k, v in a.get("engines", {}).items() if v) or "-"
            lines.append(
                f"| {LABELS.get(arm, arm)} | {a['first_p50']:.0f} / {a['first_p99']:.0f} | {a['later_p50']:.0f} / "
                f"{a['later_p90']:.0f} / {a['later_p99']:.0f} | {a['itl_p50']:.1f} / {a['itl_p99']:.1f} | "
                f"{a['tokens_per_s']:.0f} | {a['turns_per_s']:.2f} | {a['goodput']:.2f} | "
                f"{a['reuse']:.0%} | {a['errors']} | {eng} | {plans} |")
        if p.get("ratios"):
            lines += ["", "ratios: " + ", ".join(f"{k} {v:.2f}" for k, v in p["ratios"].items() if v is not None)]
        lines.append("")
    return lines


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = sorted({p["workload"] for p in result["points"] if p["concurrency"]})
    if not workloads:
        return
    fig, axes = plt.subplots(2, len(workloads), figsize=(5 * len(workloads), 7), squeeze=False)
    for col, wl in enumerate(workloads):
        pts = sorted((p for p in result["points"] if p["workload"] == wl and p["concurrency"]),
                     key=lambda p: p["concurrency"])
        for arm in LABELS:
            xs = [p["concurrency"] for p in pts if arm in p["arms"]]
            if not xs:
                continue
            ys = [p["arms"][arm] for p in pts if arm in p["arms"]]
            line, = axes[0][col].plot(xs, [a["later_p50"] for a in ys], marker="o", label=LABELS[arm])
            axes[0][col].plot(xs, [a["later_p99"] for a in ys], ls="--", color=line.get_color())
            axes[1][col].plot(xs, [a["itl_p99"] for a in ys], marker="o", color=line.get_color())
        axes[0][col].set_title(f"{wl}: later-turn TTFT (p50 solid, p99 dashed)")
        axes[0][col].set_ylabel("ms")
        axes[1][col].set_title(f"{wl}: ITL p99")
        axes[1][col].set_ylabel("ms")
        axes[1][col].set_xlabel("conversations at once")
        for ax in (axes[0][col], axes[1][col]):
            ax.set_xscale("log", base=2)
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(result.get("title", "load bench"))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
