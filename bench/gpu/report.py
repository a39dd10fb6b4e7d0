#!/usr/bin/env python3
"""Write bench/GPU-RESULTS.md (tables) and a PNG from what the GPU bench measured.

    python3 bench/gpu/report.py --results DIR [--md bench/GPU-RESULTS.md] [--png bench/gpu-ttft.png]

DIR holds any of transport.json, correctness.json, ttft.json (client.py, transport.py) and env.json (what the
run script recorded about the host). The PNG needs matplotlib; without it only the Markdown is written.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from gateway.verify import distance as lp  # noqa: E402

MODE_ORDER = ["local", "reuse_warmP", "reuse_coldP", "full_warmP", "full_coldP", "coloc_prefix", "coloc_full", "cost_warmP",
              "cost_coldP"]
# the cost plan against both fixed policies with P's cache in the same state: (cost, always, stateless)
COST_PAIRS = [("cost_coldP", "reuse_coldP", "full_coldP"), ("cost_warmP", "reuse_warmP", "full_warmP")]
COST_TOLERANCE = 0.10     # TTFT medians of one or two runs: within 10 % counts as equal


def load(d: Path, name: str) -> Any:
    p = d / name
    return json.loads(p.read_text()) if p.exists() else None


def transport_md(rows: list[dict]) -> list[str]:
    out = ["## Transport: NIXL VRAM READ between two processes on the one GPU", "",
           "256 MiB in 4096 descriptors of 64 KiB (`bench/gpu/transport.py`); GB/s is the best READ after the first "
           "(the first includes connecting and mapping), `transports` counts the transport names in UCX's "
           "protocol-selection table (`UCX_PROTO_INFO=y`). `torch_ipc` is one copy of a 256 MiB tensor that torch "
           "shares between two processes by CUDA IPC, the child's first CUDA work: proof that CUDA IPC works in "
           "this machine, not a ceiling.", "",
           "| configuration | UCX environment | NIXL UCX params | ok | first GB/s | GB/s | transports in UCX's table |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        tls = ", ".join(f"{k} {v}" for k, v in sorted((r.get("transports") or {}).items(), key=lambda kv: -kv[1]))
        out.append(f"| {r['name']} | {_kv(r.get('ucx_env'))} | {_kv(r.get('nixl_params'))} | {r.get('ok')} | "
                   f"{_num(r.get('gbps_first'))} | {_num(r.get('gbps'))} | {tls or '-'} |")
    return out + [""]


def correctness_md(res: dict) -> list[str]:
    s = res["summary"]
    kl_floor = max((r["floor"]["kl"] for r in res["turns"] + res["controls"] if "floor" in r), default=0.0)

    def kl_flags(rows: list[dict]) -> int:
        return sum(lp.flagged_kl(lp.Distance(**r["distance"]), kl_floor) for r in rows if "distance" in r)

    out = ["## Correctness: distance between next-token distributions", "",
           f"Measure: max |Δ logprob| over the union of both top-20 lists of the first generated token (a lower bound "
           f"for a token in one list only) and KL over that union (`gateway/verify/distance.py`). Reference: the "
           f"co-located engine C on the same prompt with a fresh `cache_salt`. Noise floor: C against itself with "
           f"its prefix cache (and, for the controls, fresh against fresh): largest max |Δ| = "
           f"**{s['noise_floor_max_abs']:.4f}**, largest KL = **{kl_floor:.3g}**. Flagged: max |Δ| above "
           f"max(0.05, 4 × its floor); KL above max(0.01, 4 × its floor).", "",
           "| what | n | flagged by max abs Δ / by KL | max abs Δlogprob: min / median / max | KL: median / max |",
           "|---|---|---|---|---|"]
    g, k = s["gateway_max_abs"], s["gateway_kl"]
    ok_turns = [r for r in res["turns"] if r.get("status") == 200]
    out.append(f"| through the gateway (PD, reuse on later turns) | {s['gateway_ok']} | "
               f"{s['gateway_flagged']} / {kl_flags(ok_turns)} | "
               f"{_mmm(g)} | {_sci(k.get('median'))} / {_sci(k.get('max'))} |")
    out.append(f"| C against itself (noise floor) | {s['floor']['n']} | - | {_mmm(s['floor'])} | - |")
    names = {"extend": "control, right KV: P reads D's handle for a longer prompt",
             "shorter": "**negative** control: shorter prompt, whole handle (tail alignment)",
             "foreign": "**negative** control: another conversation's handle"}
    for case, c in s["controls"].items():
        rows = [r for r in res["controls"] if r.get("case") == case]
        out.append(f"| {names[case]} | {c['n']} | {c['flagged']} / {kl_flags(rows)} | {_mmm(c['max_abs'])} | "
                   f"{_sci(c['kl'].get('median'))} / {_sci(c['kl'].get('max'))} |")
    out += ["", f"Gateway turns: plans {s['plans']}; prompt ids equal to C's on {s['gateway_prompt_ids_equal']}/"
                f"{s['gateway_ok']}; greedy tokens equal on {s['gateway_tokens_equal']}/{s['gateway_ok']} "
                f"(not a criterion: see the noise floor).", ""]
    if s.get("controls_failed"):
        out += ["Controls that failed (the engine refused or errored): " + "; ".join(s["controls_failed"]), ""]
    return out


def ttft_md(res: dict) -> list[str]:
    t = res["table"]
    modes = [m for m in MODE_ORDER if m in t]
    lengths = sorted({int(L) for m in modes for L in t[m]})
    out = ["## TTFT by history length (turn 2 of fresh two-turn conversations, median ms)", "",
           "| history | " + " | ".join(modes) + " |", "|---" * (len(modes) + 1) + "|"]
    for L in lengths:
        cells = [_num(t[m].get(str(L), {}).get("ttft_ms"), 1) for m in modes]
        p = next((t[m][str(L)]["prompt_tokens"] for m in modes if str(L) in t[m]), L)
        out.append(f"| {int(p)} | " + " | ".join(cells) + " |")
    out += ["", "vLLM's own figures beside them (medians per turn 2): tokens P / D / C computed (`local_compute`), "
                "read from their own cache (`local_cache_hit`), loaded over NIXL (`external_kv_transfer`), and NIXL's "
                "bytes and transfer time (P's and D's summed).", "",
            "| mode | history | TTFT ms | P comp / hit / loaded | D comp / hit / loaded | C comp / hit | NIXL MB | "
            "NIXL ms | gateway P leg ms | gateway D first token ms |", "|---|---|---|---|---|---|---|---|---|---|"]
    for m in modes:
        for L in lengths:
            r = t[m].get(str(L))
            if not r:
                continue
            mb = (r.get("P.nixl_bytes", 0) + r.get("D.nixl_bytes", 0)) / 1e6
            ms = (r.get("P.nixl_xfer_s", 0) + r.get("D.nixl_xfer_s", 0)) * 1e3
            out.append(f"| {m} | {int(r['prompt_tokens'])} | {r['ttft_ms']:.1f} | {_eng(r, 'P')} | {_eng(r, 'D')} | "
                       f"{_eng(r, 'C', loaded=False)} | {mb:.0f} | {ms:.0f} | {_num(r.get('gw.prefill_ms'), 1)} | "
                       f"{_num(r.get('gw.decode_ttft_ms'), 1)} |")
    out += [""] + cost_figures(res) + [""] + cost_plan_md(t)
    return out


def cost_plan_md(t: dict) -> list[str]:
    """Issue 17's target for the cost plan: TTFT never worse than stateless PD, and equal to reuse where reading
    pays; per history length, with the plan the cost gateway chose on turn 2."""
    out = []
    for cost, always, stateless in COST_PAIRS:
        if cost not in t:
            continue
        out += [f"### The cost plan ({cost}) against reading always ({always}) and stateless PD ({stateless})", "",
                "| history | always ms | stateless ms | cost ms | cost / best of both | cost's plan on turn 2 | "
                f"not worse than stateless (+{COST_TOLERANCE:.0%}) |", "|---|---|---|---|---|---|---|"]
        for L in sorted(t[cost], key=int):
            c, a, s = t[cost][L], t.get(always, {}).get(L), t.get(stateless, {}).get(L)
            best = min(x["ttft_ms"] for x in (a, s) if x) if (a or s) else None
            ok = "-" if not s else ("yes" if c["ttft_ms"] <= s["ttft_ms"] * (1 + COST_TOLERANCE) else "**no**")
            plans = ", ".join(f"{k} x{n}" for k, n in (c.get("plans") or {}).items()) or "-"
            out.append(f"| {int(c['prompt_tokens'])} | {_num(a and a['ttft_ms'], 1)} | {_num(s and s['ttft_ms'], 1)} | "
                       f"{c['ttft_ms']:.1f} | {_num(best and c['ttft_ms'] / best, 2)} | {plans} | {ok} |")
        out.append("")
    return out


def compare_md(runs: list[tuple[str, dict, dict | None]], prefill_rate: float | None,
               folder_of: dict[str, str]) -> list[str]:
    """Turn-2 TTFT of the modes each extra run measured, beside its NIXL rates."""
    out = ["## The same with other NIXL transports and block sizes", ""]
    for label, res, env in runs:
        t = res["table"]
        modes = [m for m in MODE_ORDER if m in t]
        lengths = sorted({int(L) for m in modes for L in t[m]})
        out += [f"### {label}" + (f" (transport `{env.get('transport')}`)" if env else ""), "",
                "| history | " + " | ".join(modes) + " |", "|---" * (len(modes) + 1) + "|"]
        for L in lengths:
            cells = [_num(t[m].get(str(L), {}).get("ttft_ms"), 1) for m in modes]
            p = next((t[m][str(L)]["prompt_tokens"] for m in modes if str(L) in t[m]), L)
            out.append(f"| {int(p)} | " + " | ".join(cells) + " |")
        out += [""] + cost_figures(res, prefill_rate) + [""] + cost_plan_md(t)
        corr = load(Path(folder_of[label]), "correctness.json") if label in folder_of else None
        if corr:
            out += ["Correctness in this configuration:", ""] + correctness_md(corr)[4:]
    return out


def local_md(ttft: dict, itl: dict | None, env: dict | None) -> list[str]:
    """The local path (issue 24): later-turn TTFT against one engine with its prefix cache, the P path and
    stateless PD, with D's counters; D's inter-token latency under local prefills."""
    t = ttft["table"]
    if "local" not in t:
        return []
    out = ["## Warm turns the short way: the local path", "",
           "Turn 2 with a short new user message, through the gateway with its defaults (`local`: D alone computes "
           "the new suffix from its own prefix cache) against one engine with its prefix cache (`coloc_prefix`), "
           "the P path (`reuse_warmP`: P reads what its cache lacks from D, D reads P's new blocks) and stateless PD "
           "(`full_warmP`: P's prefix cache holds the last prompt; `full_coldP`: it does not)"
           + (f"; transport `{env.get('transport')}`" if env else "") + ". Medians (ms):", "",
           "| history | local | coloc_prefix | reuse_warmP | full_warmP | full_coldP | local / coloc_prefix | "
           "full_warmP / local | full_coldP / local | local: D comp / hit / loaded | local plans |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for L in sorted(t["local"], key=int):
        row = {m: t.get(m, {}).get(L) for m in ("local", "coloc_prefix", "reuse_warmP", "full_warmP", "full_coldP")}
        ms = {m: r and r["ttft_ms"] for m, r in row.items()}
        local = ms["local"]

        def ratio(a: float | None, b: float | None) -> str:
            return _num(a / b, 2) if a and b else "-"
        plans = ", ".join(f"{k} x{n}" for k, n in (row["local"].get("plans") or {}).items()) or "-"
        out.append(f"| {int(row['local']['prompt_tokens'])} | " + " | ".join(_num(ms[m], 1) for m in row) +
                   f" | {ratio(local, ms['coloc_prefix'])} | {ratio(ms['full_warmP'], local)} | "
                   f"{ratio(ms['full_coldP'], local)} | {_eng(row['local'], 'D')} | {plans} |")
    out.append("")
    if itl:
        alone = itl["table"].get("0", {})
        out += [f"D's inter-token latency: {itl['streams']} streams of {itl['stream_tokens']} tokens straight at D, "
                f"alone and while a local prefill (a 4k-token prefix D's cache holds + N new tokens) arrives every "
                f"{itl['every_ms']:.0f} ms; medians of the repetitions' percentiles (ms):", "",
                "| local prefills | p50 | p90 | p99 | p99 / alone | prefills sent |", "|---|---|---|---|---|---|"]
        for n, r in sorted(itl["table"].items(), key=lambda kv: int(kv[0])):
            label = "none" if n == "0" else f"{n} new tokens"
            out.append(f"| {label} | {_num(r['p50_ms'], 2)} | {_num(r['p90_ms'], 2)} | {_num(r['p99_ms'], 2)} | "
                       f"{_num(r['p99_ms'] / alone['p99_ms'], 2) if alone.get('p99_ms') else '-'} | "
                       f"{r['prefills']:.0f} |")
        out.append("")
    return out


def load_md(runs: list[tuple[str, Path]]) -> list[str]:
    """The load bench (bench/gpu/load.py): each run's tables as its `load.md` has them, with its curve."""
    out = ["## Under load: many conversations at once (bench/gpu/load.py)", ""]
    for label, folder in runs:
        out += [f"### {label}", ""]
        if (folder / "load.png").exists():
            out += [f"![load: {label}]({os.path.relpath(folder / 'load.png', 'bench')})", ""]
        out += (folder / "load.md").read_text().splitlines() + [""]
    return out


def push_md(pull: dict, push: dict, env: dict | None) -> list[str]:
    """Push vs pull (issue 26): a full prefill through the gateway (stateless, P's cache cold: `full_coldP`) with
    P and D on vLLM's NixlConnector and then on its NixlPushConnector, same engines' settings, one session."""
    a, b = pull["table"].get("full_coldP", {}), push["table"].get("full_coldP", {})
    out = ["## Push vs pull: a full prefill through the gateway", "",
           "Stateless turns with a fresh `cache_salt` (`full_coldP`: P prefills everything, D receives all of it), "
           "P and D restarted between the two modes with the same settings"
           + (f" (transport `{env.get('transport')}`, vLLM {env.get('vllm')})" if env else "") +
           ". In pull mode D's leg is sent after P answers and D reads P's blocks; in push mode the gateway sends "
           "both legs at once and P writes into the blocks D registered. Medians of turn 2 (ms):", "",
           "| prompt tokens | pull | push | push / pull | speed-up (pull / push) | push plans |", "|---|---|---|---|---|---|"]
    for L in sorted(set(a) & set(b), key=int):
        plans = ", ".join(f"{k} x{n}" for k, n in (b[L].get("plans") or {}).items()) or "-"
        out.append(f"| {int(a[L]['prompt_tokens'])} | {_num(a[L]['ttft_ms'], 1)} | {_num(b[L]['ttft_ms'], 1)} | "
                   f"{_num(b[L]['ttft_ms'] / a[L]['ttft_ms'], 2)} | {_num(a[L]['ttft_ms'] / b[L]['ttft_ms'], 2)}x | "
                   f"{plans} |")
    return out + ["", "vLLM's PR reports 1.2-3.0x better TTFT for push over pull when both legs are sent together, "
                  "most where D's read is slow (fragmented KV, a full prefix hit on D); here D's pull read of the "
                  "whole prompt took 8-63 ms over CUDA IPC, the most push can hide.", ""]


def rates(res: dict) -> dict[str, float]:
    """What a cost model needs, from one run: KV bytes per token, NIXL's rate when P reads D (reuse_coldP) and
    when D reads P (full_coldP), from vLLM's own nixl_bytes_transferred / nixl_xfer_time; the co-located
    engine's prefill rate from vLLM's prefill time (coloc_full)."""
    recs = [r for r in res["records"] if r["turn"] == 2 and r["status"] == 200]
    out: dict[str, float] = {}
    reads = [r for r in recs if r["mode"] == "reuse_coldP" and r["P"]["external_kv_transfer"] > 0]
    if reads and sum(r["P"]["nixl_xfer_s"] for r in reads) > 0:
        tokens = sum(r["P"]["external_kv_transfer"] for r in reads)
        out["bytes_per_token"] = sum(r["P"]["nixl_bytes"] for r in reads) / tokens
        out["p_read_gbps"] = sum(r["P"]["nixl_bytes"] for r in reads) / sum(r["P"]["nixl_xfer_s"] for r in reads) / 1e9
    pd = [r for r in recs if r["mode"] == "full_coldP" and r["D"]["nixl_xfer_s"] > 0]
    if pd:
        out["d_read_gbps"] = sum(r["D"]["nixl_bytes"] for r in pd) / sum(r["D"]["nixl_xfer_s"] for r in pd) / 1e9
    full = [r for r in recs if r["mode"] == "coloc_full" and r["C"]["prefill_s"] > 0]
    if full:
        seconds = sum(r["C"]["prefill_s"] for r in full)
        out["prefill_tokens_per_s"] = sum(r["C"]["local_compute"] for r in full) / seconds
    return out


def cost_figures(res: dict, prefill_rate: float | None = None) -> list[str]:
    r = rates(res)
    rate = r.get("prefill_tokens_per_s") or prefill_rate
    if "p_read_gbps" not in r:
        return []
    line = (f"Cost figures (vLLM's own counters): {r['bytes_per_token'] / 1024:.1f} KiB of KV per token; NIXL "
            f"**{r['p_read_gbps']:.2f} GB/s** when P reads D's KV (reuse_coldP)"
            + (f", **{r['d_read_gbps']:.2f} GB/s** when D reads P's (full_coldP)" if "d_read_gbps" in r else ""))
    if rate:
        line += (f"; one engine prefills **{rate:.0f} tokens/s** (vLLM's prefill time, coloc_full), so reading "
                 f"KV beats recomputing it above {r['bytes_per_token'] * rate / 1e9:.2f} GB/s.")
    return [line]


def plot(res: dict | None, corr: dict | None, runs: list[tuple[str, dict, dict | None]], png: str,
         main_label: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 3, figsize=(19, 5.5))
    if res:
        t = res["table"]
        for m in [m for m in MODE_ORDER if m in t]:
            pts = sorted((t[m][L]["prompt_tokens"], t[m][L]["ttft_ms"]) for L in t[m])
            axes[0].plot([p for p, _ in pts], [v for _, v in pts], marker="o", label=m)
        axes[0].set(xscale="log", yscale="log", xlabel="prompt tokens (turn 2)", ylabel="TTFT ms (median)",
                    title=f"TTFT by history length ({main_label})")
        axes[1].set(xscale="log", yscale="log", xlabel="prompt tokens (turn 2)", ylabel="TTFT ms (median)",
                    title="P reads the history from D (reuse_coldP, solid) vs P recomputes it\n(full_coldP, dashed) "
                          "vs the cost plan choosing (cost_coldP, dots)")
        # the main run and the first compared one (the other regime): more would not read
        for i, (label, r) in enumerate([(main_label, res)] + [(lb, rr) for lb, rr, _ in runs[:1]]):
            for mode, style in (("reuse_coldP", "-"), ("full_coldP", "--"), ("cost_coldP", ":")):
                rows = r["table"].get(mode, {})
                pts = sorted((rows[L]["prompt_tokens"], rows[L]["ttft_ms"]) for L in rows)
                if pts:
                    axes[1].plot([p for p, _ in pts], [v for _, v in pts], style, marker="o", color=f"C{i}",
                                 label=f"{label}: {mode}")
        coloc = res["table"].get("coloc_full", {})
        pts = sorted((coloc[L]["prompt_tokens"], coloc[L]["ttft_ms"]) for L in coloc)
        if pts:
            axes[1].plot([p for p, _ in pts], [v for _, v in pts], ":", color="black",
                         label="one engine alone (coloc_full)")
        for ax in axes[:2]:
            ax.legend(fontsize=7)
            ax.grid(True, which="both", alpha=0.3)
    if corr:
        floor = [r["floor"]["max_abs"] for r in corr["turns"] + corr["controls"] if "floor" in r]
        groups = [("C vs C\n(floor)", floor),
                  ("gateway\nturns", [r["distance"]["max_abs"] for r in corr["turns"] if "distance" in r])]
        groups += [(f"control\n{c}", [r["distance"]["max_abs"] for r in corr["controls"] if r["case"] == c])
                   for c in ("extend", "shorter", "foreign")]
        for i, (_, ys) in enumerate(groups):
            axes[2].scatter([i] * len(ys), [max(y, 1e-3) for y in ys], alpha=0.7)
        axes[2].set_xticks(range(len(groups)), [g for g, _ in groups], fontsize=8)
        axes[2].set(yscale="log", ylabel="max |Δ logprob| of the first token (top-20 union)",
                    title="KV correctness: distance to the co-located engine")
        axes[2].axhline(max(0.05, 4 * corr["summary"]["noise_floor_max_abs"]), color="red", ls="--", lw=1,
                        label="flag threshold (4 x floor)")
        axes[2].legend(fontsize=8)
        axes[2].grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    return True


def _eng(r: dict, k: str, loaded: bool = True) -> str:
    if f"{k}.local_compute" not in r:
        return "-"
    parts = [r[f"{k}.local_compute"], r[f"{k}.local_cache_hit"]] + ([r[f"{k}.external_kv_transfer"]] if loaded else [])
    return " / ".join(str(int(x)) for x in parts)


def _mmm(s: dict) -> str:
    return " / ".join(_num(s.get(k)) for k in ("min", "median", "max")) if s.get("n") else "-"


def _num(x: Any, digits: int = 4) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _sci(x: Any) -> str:
    return "-" if x is None else f"{x:.2g}"


def _kv(d: dict | None) -> str:
    return ", ".join(f"`{k}={v}`" for k, v in (d or {}).items()) or "-"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--results", type=Path, required=True, help="the main run's folder")
    ap.add_argument("--label", default="main run")
    ap.add_argument("--compare", action="append", default=[], metavar="LABEL=DIR",
                    help="another run's folder (its ttft.json), shown beside the main one")
    ap.add_argument("--notes", type=Path, help="hand-written Markdown placed under the title (findings)")
    ap.add_argument("--correctness", type=Path, help="the folder whose correctness.json to show (default: --results)")
    ap.add_argument("--transport", type=Path, help="the folder whose transport.json to show (default: --results)")
    ap.add_argument("--local", type=Path, help="a run's folder with the local path's ttft.json and itl.json")
    ap.add_argument("--push", metavar="PULL_DIR,PUSH_DIR", help="two runs' folders (full_coldP) in pull and push mode")
    ap.add_argument("--load", action="append", default=[], metavar="LABEL=DIR",
                    help="a load bench run's folder (its load.md and load.png)")
    ap.add_argument("--md", default="bench/GPU-RESULTS.md")
    ap.add_argument("--png", default="bench/gpu-results.png")
    a = ap.parse_args()
    env, transport = load(a.results, "env.json"), load(a.transport or a.results, "transport.json")
    corr, ttft = load(a.correctness or a.results, "correctness.json"), load(a.results, "ttft.json")
    runs = []
    for item in a.compare:
        label, _, folder = item.rpartition("=")   # a label may hold "=", a folder rarely
        if load(Path(folder), "ttft.json"):
            runs.append((label, load(Path(folder), "ttft.json"), load(Path(folder), "env.json")))
    lines = ["# pd-gateway on a GPU: measured results", ""]
    if a.notes:
        lines += [a.notes.read_text().strip(), "", "# The measurements", ""]
    if env:
        lines += [f"Main run ({a.label}): " + "; ".join(f"{k}: {v}" for k, v in env.items()), ""]
    if plot(ttft, corr, runs, a.png, a.label):
        lines += [f"![TTFT by history length and KV correctness]({os.path.basename(a.png)})", ""]
    loads = [(label, Path(folder)) for label, _, folder in (i.rpartition("=") for i in a.load)]
    lines += load_md([(label, folder) for label, folder in loads if (folder / "load.md").exists()]) if loads else []
    if a.local and load(a.local, "ttft.json"):
        lines += local_md(load(a.local, "ttft.json"), load(a.local, "itl.json"), load(a.local, "env.json"))
    if a.push:
        pull_dir, push_dir = (Path(d) for d in a.push.split(","))
        if load(pull_dir, "ttft.json") and load(push_dir, "ttft.json"):
            lines += push_md(load(pull_dir, "ttft.json"), load(push_dir, "ttft.json"), load(push_dir, "env.json"))
    if transport:
        lines += transport_md(transport)
    if corr:
        lines += correctness_md(corr)
    if ttft:
        lines += ttft_md(ttft)
    if runs:
        folders = dict(item.rpartition("=")[::2] for item in a.compare)
        lines += compare_md(runs, rates(ttft).get("prefill_tokens_per_s") if ttft else None, folders)
    Path(a.md).write_text("\n".join(lines) + "\n")
    print(f"wrote {a.md}" + (f" and {a.png}" if os.path.exists(a.png) else ""))


if __name__ == "__main__":
    main()
