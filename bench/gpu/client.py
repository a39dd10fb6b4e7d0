#!/usr/bin/env python3
"""The GPU bench's client: KV correctness by log-prob distance (with controls) and TTFT by history length.

    python3 bench/gpu/client.py correctness --out DIR --model-dir MODEL
    python3 bench/gpu/client.py ttft --out DIR --model-dir MODEL [--lengths 4000,8000,16000,32000] [--reps 2]
    python3 bench/gpu/client.py itl --out DIR --model-dir MODEL [--local-sizes 256,1024]

correctness: (1) conversations through the gateway (reuse on later turns; every other conversation with a fresh
`cache_salt` per turn, so P reads the whole history from D instead of its own cache), each turn's first-token
top-k compared with the co-located engine C computing the same prompt alone; (2) the same measure on C against
itself (prefix cache on vs off): the noise floor; (3) controls driven straight at P and D with token ids, no
gateway: a handle read for a prompt that extends D's tokens (right KV), a prompt shorter than the handle with
the whole handle (tail alignment, docs/vllm-findings.md #3: wrong KV) and another conversation's handle
(wrong KV). The wrong ones must be flagged by the measure that passes the gateway's turns.
ttft: per history length, fresh two-turn conversations in each mode (see MODES); turn 2 is timed, with each
engine's own counters (tokens computed / read from cache / loaded over NIXL, NIXL bytes and time) beside it.
itl: D's inter-token latency (p50/p99) of running streams alone, then while local prefills arrive (a prefix D's
cache holds plus N new tokens, straight at D: what the gateway's local path sends it), per N.
Stdlib HTTP; transformers only for the word list.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.gpu import logprob_distance as lp  # noqa: E402
from bench.gpu import wire  # noqa: E402

TOP_K = 20                 # vLLM's default --max-logprobs
FRESH = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
         "remote_block_ids": None, "remote_host": None, "remote_port": None}
# mode: (target, with a session id?, fresh cache_salt on every request?); "gateway" runs `--reuse-policy always`,
# "gateway_cost" the cost plan (`--reuse-policy cost`: reads D's KV only where that beats recomputing)
MODES = {
    "reuse_warmP": ("gateway", True, False),    # P reads from D what its own cache lacks (the last answer)
    "reuse_coldP": ("gateway", True, True),     # P's cache misses (salt): P reads the whole history from D
    "full_warmP": ("gateway", False, False),    # stateless PD, P's prefix cache holds the last prompt
    "full_coldP": ("gateway", False, True),     # stateless PD, P prefills everything
    "coloc_prefix": ("colocated", False, False),  # one engine alone with its prefix cache
    "coloc_full": ("colocated", False, True),   # one engine alone, full prefill
    "cost_warmP": ("gateway_cost", True, False),  # the cost plan, P's prefix cache holds the last prompt
    "cost_coldP": ("gateway_cost", True, True),   # the cost plan, P's cache misses: read or recompute, per turn
    "local": ("gateway_local", True, False),    # the local path (default settings): D alone computes the suffix
}


class Words:
    """Random one-token words of the model's tokenizer: as text (chat) or as ids (completions)."""

    def __init__(self, model_dir: str, seed: int):
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(model_dir)
        self.ids = [i for i in range(len(tok)) if _is_word(tok, i)]
        self.texts = [tok.decode([i]) for i in self.ids]
        self.rng = random.Random(seed)

    def text(self, n: int) -> str:
        return "".join(self.rng.choice(self.texts) for _ in range(n)).lstrip()

    def token_ids(self, n: int) -> list[int]:
        return [self.rng.choice(self.ids) for _ in range(n)]


def _is_word(tok, token_id: int) -> bool:
    text = tok.decode([token_id])
    return (len(text) > 2 and text[0] == " " and text[1:].isascii() and text[1:].isalpha()
            and tok.encode(text, add_special_tokens=False) == [token_id])


# -------------------------------------------------------------------------------------------------- correctness
def chat_body(a, messages: list[dict], salt: str | None) -> dict[str, Any]:
    body = {"model": a.model_name, "messages": messages, "max_tokens": a.answer_tokens, "temperature": 0,
            "logprobs": True, "top_logprobs": TOP_K, "return_token_ids": True, "return_tokens_as_token_ids": True}
    if salt:
        body["cache_salt"] = salt
    return body


def completion(url: str, a, prompt: list[int], max_tokens: int, params: dict | None = None,
               salt: str | None = None) -> dict[str, Any]:
    body = {"model": a.model_name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "logprobs": TOP_K, "return_token_ids": True, "return_tokens_as_token_ids": True}
    if params is not None:
        body["kv_transfer_params"] = params
    if salt:
        body["cache_salt"] = salt
    status, _, out = wire.post(url, "/v1/completions", body)
    if status != 200:
        raise RuntimeError(f"{url} answered {status}: {str(out)[:300]}")
    return out


def through_gateway(a, words: Words) -> list[dict]:
    rng = random.Random(5)
    records = []
    for ci in range(a.conversations):
        session, cold = f"corr{ci}-{uuid.uuid4().hex[:8]}", ci % 2 == 1
        messages = [{"role": "system", "content": f"Conversation {ci} {uuid.uuid4().hex[:12]}. "
                                                  + words.text(a.system_tokens)}]
        for t in range(a.turns):
            messages.append({"role": "user", "content": words.text(rng.randint(100, 600))})
            before = wire.metrics(a.prefill), wire.metrics(a.decode)
            status, headers, g = wire.post(a.gateway, "/v1/chat/completions",
                                           chat_body(a, messages, uuid.uuid4().hex if cold else None),
                                           {"X-Session-Id": session})
            after = wire.metrics(a.prefill), wire.metrics(a.decode)
            rec: dict[str, Any] = {"conv": ci, "turn": t + 1, "p_cold": cold, "status": status,
                                   "plan": headers.get("x-pd-plan"), "reason": headers.get("x-pd-reason"),
                                   "reused": headers.get("x-pd-reused-tokens"),
                                   "P": wire.delta(before[0], after[0]), "D": wire.delta(before[1], after[1])}
            if status != 200:
                rec["error"] = str(g)[:300]
                records.append(rec)
                print(f"gateway c{ci} t{t + 1} status={status} {rec['error']}", flush=True)
                break
            _, _, fresh = wire.post(a.colocated, "/v1/chat/completions", chat_body(a, messages, uuid.uuid4().hex))
            _, _, cached = wire.post(a.colocated, "/v1/chat/completions", chat_body(a, messages, None))
            ref = lp.from_chat(fresh)
            rec.update(prompt_tokens=len(g.get("prompt_token_ids") or []),
                       prompt_ids_equal=g.get("prompt_token_ids") == fresh.get("prompt_token_ids"),
                       tokens_equal=g["choices"][0].get("token_ids") == fresh["choices"][0].get("token_ids"),
                       distance=lp.distance(ref, lp.from_chat(g)).as_dict(),
                       floor=lp.distance(ref, lp.from_chat(cached)).as_dict())
            records.append(rec)
            print(f"gateway c{ci} t{t + 1} {'coldP' if cold else 'warmP'} plan={rec['plan']}/{rec['reason']} "
                  f"reused={rec['reused']} prompt={rec['prompt_tokens']} ids_equal={rec['prompt_ids_equal']} "
                  f"P.ext={rec['P']['external_kv_transfer']:.0f} max_abs={rec['distance']['max_abs']:.4f} "
                  f"kl={rec['distance']['kl']:.2e} floor={rec['floor']['max_abs']:.4f}", flush=True)
            messages.append({"role": "assistant", "content": g["choices"][0]["message"]["content"] or ""})
    return records


def first_turn(a, prompt: list[int]) -> tuple[list[int], dict]:
    """P then D on token ids, as the gateway's first turn: D then holds S = prompt + answer behind its handle."""
    p = completion(a.prefill, a, prompt, 1, FRESH)
    d = completion(a.decode, a, prompt, a.answer_tokens, p["kv_transfer_params"])
    return prompt + d["choices"][0]["token_ids"], d["kv_transfer_params"]


def controls(a, words: Words) -> list[dict]:
    """Handles read by P directly (a fresh cache_salt: P's own cache holds nothing of them)."""
    records = []
    for n in a.control_lengths:
        for case in ("extend", "shorter", "foreign"):
            try:
                records.append(control(a, words, n, case))
            except (RuntimeError, OSError, KeyError) as exc:       # a refusal is a finding, not the end of the run
                records.append({"case": case, "history": n, "error": f"{type(exc).__name__}: {exc}"[:400]})
                print(f"control {case} n={n} failed: {records[-1]['error']}", flush=True)
    return records


def control(a, words: Words, n: int, case: str) -> dict[str, Any]:
    """One handle read by P directly: D's tokens S behind the handle, then a prompt Q for P with it."""
    s, handle = first_turn(a, words.token_ids(n))
    if case == "extend":              # right: the prompt extends D's tokens
        q = s + words.token_ids(64)
    elif case == "shorter":           # wrong: a prefix of D's tokens with the whole handle
        q = s[: len(s) // 2 + 7]
    else:                             # wrong: other tokens of the same length and more
        q = words.token_ids(len(s) + 64)
    before = wire.metrics(a.prefill)
    got = completion(a.prefill, a, q, 1, handle, salt=uuid.uuid4().hex)
    loaded = wire.delta(before, wire.metrics(a.prefill))["external_kv_transfer"]
    ref = completion(a.colocated, a, q, 1, salt=uuid.uuid4().hex)
    again = completion(a.colocated, a, q, 1, salt=uuid.uuid4().hex)
    rec = {"case": case, "history": len(s), "prompt": len(q), "remote_num_tokens":
           handle.get("remote_num_tokens"), "P_loaded": loaded,
           "distance": lp.distance(lp.from_completion(ref), lp.from_completion(got)).as_dict(),
           "floor": lp.distance(lp.from_completion(ref), lp.from_completion(again)).as_dict()}
    print(f"control {case:8s} history={len(s)} prompt={len(q)} loaded={loaded:.0f} "
          f"max_abs={rec['distance']['max_abs']:.4f} kl={rec['distance']['kl']:.2e} "
          f"top1={rec['distance']['top1_equal']} floor={rec['floor']['max_abs']:.4f}", flush=True)
    return rec


def correctness(a) -> dict[str, Any]:
    words = Words(a.model_dir, seed=11)
    t0 = time.time()
    turns = through_gateway(a, words)
    ctrl = controls(a, words)
    floors = [r["floor"]["max_abs"] for r in turns + ctrl if "floor" in r]
    noise = max(floors) if floors else 0.0
    ok_turns = [r for r in turns if r["status"] == 200]
    failed_controls = [r for r in ctrl if "error" in r]
    ctrl = [r for r in ctrl if "error" not in r]
    for r in ok_turns + ctrl:
        r["flagged"] = lp.flagged(lp.Distance(**r["distance"]), noise)
    summary = {
        "noise_floor_max_abs": noise, "floor": lp.summary(floors),
        "gateway_turns": len(turns), "gateway_ok": len(ok_turns),
        "gateway_flagged": sum(r["flagged"] for r in ok_turns),
        "gateway_max_abs": lp.summary(r["distance"]["max_abs"] for r in ok_turns),
        "gateway_kl": lp.summary(r["distance"]["kl"] for r in ok_turns),
        "gateway_prompt_ids_equal": sum(r["prompt_ids_equal"] for r in ok_turns),
        "gateway_tokens_equal": sum(r["tokens_equal"] for r in ok_turns),
        "plans": _count(f"{r['plan']}/{r['reason']}" for r in turns),
        "controls": {case: {"n": len(rs), "flagged": sum(r["flagged"] for r in rs),
                            "max_abs": lp.summary(r["distance"]["max_abs"] for r in rs),
                            "kl": lp.summary(r["distance"]["kl"] for r in rs)}
                     for case in ("extend", "shorter", "foreign")
                     for rs in [[r for r in ctrl if r["case"] == case]]},
        "controls_failed": [f"{r['case']}@{r['history']}: {r['error'][:120]}" for r in failed_controls],
        "seconds": round(time.time() - t0, 1),
    }
    return {"summary": summary, "turns": turns, "controls": ctrl, "controls_failed": failed_controls}


def _count(keys) -> dict[str, int]:
    out: dict[str, int] = {}
    for k in keys:
        out[k] = out.get(k, 0) + 1
    return out


# ---------------------------------------------------------------------------------------------------------- ttft
def one_turn(a, mode: str, messages: list[dict], session: str) -> dict[str, Any]:
    target_name, with_session, salted = MODES[mode]
    target = {"gateway": a.gateway, "gateway_cost": a.gateway_cost, "gateway_local": a.gateway_local,
              "colocated": a.colocated}[target_name]
    through_pd = target_name != "colocated"
    engines = {"P": a.prefill, "D": a.decode} if through_pd else {"C": a.colocated}
    body = {"model": a.model_name, "messages": messages, "max_tokens": a.ttft_answer_tokens, "temperature": 0,
            "stream_options": {"include_usage": True}}
    if salted:
        body["cache_salt"] = uuid.uuid4().hex
    before = {k: wire.metrics(u) for k, u in engines.items()}
    g0 = wire.metrics(target) if through_pd else {}
    r = wire.stream_chat(target, body, {"X-Session-Id": session} if with_session else {})
    rec = {"status": r["status"], "error": r["error"], "ttft_ms": round((r["ttft"] or -1) * 1e3, 2),
           "total_ms": round(r["total"] * 1e3, 2), "prompt_tokens": (r["usage"] or {}).get("prompt_tokens"),
           "plan": r["headers"].get("x-pd-plan"), "reason": r["headers"].get("x-pd-reason"),
           "reused": r["headers"].get("x-pd-reused-tokens"), "text": r["text"]}
    for k, u in engines.items():
        rec[k] = wire.delta(before[k], wire.metrics(u))
    if through_pd:
        rec["gateway_ms"] = wire.gateway_phases(g0, wire.metrics(target))
    return rec


def conversation(a, words: Words, mode: str, length: int, rep: int) -> list[dict]:
    session = f"{mode}-{length}-{rep}-{uuid.uuid4().hex[:8]}"
    messages = [{"role": "system", "content": f"Bench {session}. " + words.text(max(10, length - 220))},
                {"role": "user", "content": words.text(200)}]
    out = []
    for turn in (1, 2):
        rec = one_turn(a, mode, messages, session)
        rec.update(mode=mode, length=length, rep=rep, turn=turn)
        out.append(rec)
        eng = rec.get("P") or rec.get("C") or {}
        print(f"ttft L={length:>6} {mode:13s} r{rep} t{turn} prompt={rec['prompt_tokens']} "
              f"ttft={rec['ttft_ms']:9.1f}ms plan={rec['plan']}/{rec['reason']} reused={rec['reused']} "
              f"ext={eng.get('external_kv_transfer', 0):.0f} hit={eng.get('local_cache_hit', 0):.0f} "
              f"comp={eng.get('local_compute', 0):.0f}"
              + (f" D.ext={rec['D']['external_kv_transfer']:.0f} D.hit={rec['D']['local_cache_hit']:.0f}"
                 f" nixl={(rec['P']['nixl_bytes'] + rec['D']['nixl_bytes']) / 1e6:.1f}MB/"
                 f"{(rec['P']['nixl_xfer_s'] + rec['D']['nixl_xfer_s']) * 1e3:.1f}ms" if "D" in rec else "")
              + (f" ERR={rec['error'][:200]}" if rec["error"] else ""), flush=True)
        if rec["status"] != 200:
            break
        messages += [{"role": "assistant", "content": rec.pop("text")},
                     {"role": "user", "content": words.text(a.suffix_words)}]
    return out


def ttft(a) -> dict[str, Any]:
    words = Words(a.model_dir, seed=23)
    modes = a.modes.split(",")
    t0 = time.time()
    for mode in ("reuse_warmP", "coloc_prefix", *(["local"] if "local" in modes else [])):   # warm-up: kernels,
        conversation(a, words, mode, min(8000, max(a.lengths)), -1)           # chunked prefill, NIXL both ways
    records: list[dict] = []
    stopped = False
    for rep in range(a.reps):
        for length in a.lengths:
            for i in range(len(modes)):
                mode = modes[(i + rep) % len(modes)]          # rotate the order between repetitions
                if time.time() - t0 > a.budget_s:
                    stopped = True
                    break
                records += conversation(a, words, mode, length, rep)
    for r in records:
        r.pop("text", None)
    return {"records": records, "table": table(records), "stopped_by_budget": stopped,
            "seconds": round(time.time() - t0, 1)}


# ----------------------------------------------------------------------------------------------------------- itl
def stream_gaps(a, prompt: list[int], tokens: int) -> list[float]:
    """One long token-id stream straight at D: the seconds between its chunks."""
    conn, base = wire._conn(a.decode, 300)
    body = {"model": a.model_name, "prompt": prompt, "max_tokens": tokens, "ignore_eos": True, "stream": True,
            "temperature": 0}
    stamps = []
    try:
        conn.request("POST", base + "/v1/completions", body=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json"})
        for line in iter(conn.getresponse().readline, b""):
            if line.startswith(b"data: {"):
                stamps.append(time.perf_counter())
    finally:
        conn.close()
    return [b - a_ for a_, b in zip(stamps[2:], stamps[3:])]       # past the stream's own prefill


def itl_run(a, words: Words, prefix: list[int], new_tokens: int) -> dict[str, Any]:
    """STREAMS streams on D; with `new_tokens`, a local prefill (the cached prefix + that many new ids) every
    `a.local_every_ms` straight at D until the streams end."""
    import threading
    gaps: list[float] = []
    lock = threading.Lock()

    def one() -> None:
        g = stream_gaps(a, words.token_ids(512), a.stream_tokens)
        with lock:
            gaps.extend(g)
    threads = [threading.Thread(target=one) for _ in range(a.streams)]
    for t in threads:
        t.start()
    prefills = 0
    time.sleep(0.3)
    while new_tokens and any(t.is_alive() for t in threads):
        wire.post(a.decode, "/v1/completions", {"model": a.model_name, "max_tokens": 1, "temperature": 0,
                                                "prompt": prefix + words.token_ids(new_tokens)})
        prefills += 1
        time.sleep(a.local_every_ms / 1e3)
    for t in threads:
        t.join()
    gaps.sort()
    def pick(q: float) -> float | None:
        return round(gaps[min(len(gaps) - 1, int(q / 100 * len(gaps)))] * 1e3, 2) if gaps else None
    return {"new_tokens": new_tokens, "prefills": prefills, "gaps": len(gaps), "p50_ms": pick(50),
            "p90_ms": pick(90), "p99_ms": pick(99)}


def itl(a) -> dict[str, Any]:
    words = Words(a.model_dir, seed=29)
    prefix = words.token_ids(4000)
    wire.post(a.decode, "/v1/completions", {"model": a.model_name, "prompt": prefix, "max_tokens": 1})   # cached
    rows = []
    for rep in range(a.reps):
        for n in [0, *a.local_sizes]:           # alone, then with local prefills of each size: taking turns
            row = itl_run(a, words, prefix, n)
            row["rep"] = rep
            rows.append(row)
            print(f"itl r{rep} local prefills of {n:>5} tokens: {row}", flush=True)
    summary = {}
    for n in [0, *a.local_sizes]:
        mine = [r for r in rows if r["new_tokens"] == n]
        summary[str(n)] = {k: statistics.median(r[k] for r in mine) for k in ("p50_ms", "p90_ms", "p99_ms", "prefills")}
    return {"rows": rows, "table": summary, "streams": a.streams, "stream_tokens": a.stream_tokens,
            "every_ms": a.local_every_ms, "summary": summary}


def table(records: list[dict]) -> dict[str, dict[str, Any]]:
    """Median turn-2 TTFT per mode and history length, with the engines' medians beside it."""
    out: dict[str, dict[str, Any]] = {}
    for r in records:
        if r["turn"] != 2 or r["status"] != 200 or r["ttft_ms"] <= 0:
            continue
        out.setdefault(r["mode"], {}).setdefault(str(r["length"]), []).append(r)
    result: dict[str, dict[str, Any]] = {}
    for mode, by_length in out.items():
        for length, rs in by_length.items():
            def med(f):
                return round(statistics.median(f(r) for r in rs), 3)
            engines = [k for k in ("P", "D", "C") if k in rs[0]]
            row = {"n": len(rs), "ttft_ms": med(lambda r: r["ttft_ms"]),
                   "prompt_tokens": med(lambda r: r["prompt_tokens"] or 0),
                   "plans": _count(f"{r['plan']}/{r['reason']}" for r in rs if r.get("plan"))}
            for k in engines:
                for field in ("external_kv_transfer", "local_cache_hit", "local_compute", "nixl_bytes", "nixl_xfer_s",
                              "prefill_s"):
                    row[f"{k}.{field}"] = med(lambda r, k=k, field=field: r[k][field])
            if "gateway_ms" in rs[0]:
                for phase in ("prefill", "decode_ttft"):
                    row[f"gw.{phase}_ms"] = med(lambda r, p=phase: r["gateway_ms"].get(p, 0))
            result.setdefault(mode, {})[length] = row
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["correctness", "ttft", "itl"])
    ap.add_argument("--out", required=True)
    ap.add_argument("--model-dir", required=True, help="the served model's folder (its tokenizer)")
    ap.add_argument("--model-name", default="pdgw-bench")
    ap.add_argument("--gateway", default="http://127.0.0.1:8000")
    ap.add_argument("--gateway-cost", default="http://127.0.0.1:8001")
    ap.add_argument("--gateway-local", default="http://127.0.0.1:8002")
    ap.add_argument("--suffix-words", type=int, default=300, help="turn 2's new user message, in one-token words")
    ap.add_argument("--local-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[256, 1024])
    ap.add_argument("--local-every-ms", type=float, default=100)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--stream-tokens", type=int, default=300)
    ap.add_argument("--prefill", default="http://127.0.0.1:8100")
    ap.add_argument("--decode", default="http://127.0.0.1:8200")
    ap.add_argument("--colocated", default="http://127.0.0.1:8300")
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--system-tokens", type=int, default=1500)
    ap.add_argument("--answer-tokens", type=int, default=24)
    ap.add_argument("--control-lengths", type=lambda s: [int(x) for x in s.split(",")], default=[1000, 4000, 12000])
    ap.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[4000, 8000, 16000, 32000])
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--ttft-answer-tokens", type=int, default=16)
    ap.add_argument("--budget-s", type=float, default=420)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    res = {"correctness": correctness, "ttft": ttft, "itl": itl}[a.what](a)
    with open(os.path.join(a.out, f"{a.what}.json"), "w") as f:
        json.dump(res, f, indent=1)
    brief = res.get("summary") or {m: {L: r["ttft_ms"] for L, r in rows.items()} for m, rows in res["table"].items()}
    print(f"{a.what.upper()} " + json.dumps(brief), flush=True)


if __name__ == "__main__":
    main()
