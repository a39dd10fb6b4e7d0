#!/usr/bin/env python3
"""Build the model the GPU bench serves, at run time (no download): a random-weight Qwen2 of real size with the
project's demo tokenizer (byte-level BPE, ChatML template), saved as bf16 safetensors.

    python3 bench/gpu/make_model.py OUT_DIR [--tokenizer gateway/tokenizers/demo] [--size 3b|8b|tiny]

- Sizes: `3b` is shaped like Qwen2.5-3B (36 layers, hidden 2048, 16 query / 2 KV heads of 128: 36 KiB of KV
  per token in bf16), `8b` like Qwen2.5-7B (28 layers, hidden 3584, 28 / 4 heads: 56 KiB per token), `tiny`
  for a CPU smoke test. Real sizes make prefill and KV transfer times real; the weights are random.
- The output head can only pick ` word` tokens (every other row is zero), so an answer re-tokenizes to the ids
  generated and the gateway's rendering of a history matches the engine's.
- `--init` (weight scale) is raised from Qwen's 0.02 so that the next-token distribution depends strongly on the
  context: KV of the wrong positions then moves it far, which the correctness check measures.
- Positions up to `--max-positions` (default 40960): histories of 32k tokens plus a turn.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

WORD = re.compile(r"^ [A-Za-z]{2,}$")
SHAPES = {
    "3b": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
               num_key_value_heads=2, head_dim=128),
    "8b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, head_dim=128),
    "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64),
}


def word_ids(tokenizer) -> list[int]:
    """Tokens that decode to one space-led word and encode back to themselves."""
    out = []
    for token_id in range(len(tokenizer)):
        text = tokenizer.decode([token_id])
        if WORD.match(text) and tokenizer.encode(text, add_special_tokens=False) == [token_id]:
            out.append(token_id)
    return out


def copy_tokenizer(src: Path, out: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, out / name)
    path = out / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["clean_up_tokenization_spaces"] = False      # vLLM and the gateway must detokenize alike
    path.write_text(json.dumps(config, indent=2) + "\n")


def build(out: Path, tokenizer_dir: Path, size: str, init: float, seed: int, max_positions: int) -> None:
    t0 = time.time()
    out.mkdir(parents=True, exist_ok=True)
    copy_tokenizer(tokenizer_dir, out)
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = Qwen2Config(vocab_size=len(tokenizer), max_position_embeddings=max_positions, rope_theta=1e6,
                         initializer_range=init, tie_word_embeddings=False, bos_token_id=eos, eos_token_id=eos,
                         torch_dtype="bfloat16", **SHAPES[size])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen2ForCausalLM(config)
    model = model.to(torch.bfloat16 if device == "cuda" else torch.float32).eval()
    keep_ids = word_ids(tokenizer)
    with torch.no_grad():
        keep = torch.zeros(len(tokenizer), dtype=torch.bool, device=device)
        keep[keep_ids] = True
        model.lm_head.weight[~keep] = 0.0
        model.lm_head.weight[keep] *= 4.0          # a sharper, context-dependent next-token distribution
    params = sum(p.numel() for p in model.parameters())
    kv_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 2
    print(f"model {size}: {params / 1e9:.2f} B params, vocab {len(tokenizer)}, {len(keep_ids)} word tokens, "
          f"{kv_per_token} KV bytes per token (bf16), device {device}", flush=True)
    model.save_pretrained(str(out), safe_serialization=True)
    (out / "generation_config.json").unlink(missing_ok=True)
    (out / "bench_model.json").write_text(json.dumps({"size": size, "params": params, "kv_bytes_per_token":
                                                      kv_per_token, "init": init, "seed": seed}) + "\n")
    print(f"saved {out} in {time.time() - t0:.1f}s", flush=True)


def main() -> None:
    root = Path(__file__).resolve().parents[2]
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--tokenizer", type=Path, default=root / "gateway" / "tokenizers" / "demo")
    ap.add_argument("--size", choices=sorted(SHAPES), default="3b")
    ap.add_argument("--init", type=float, default=0.04)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--max-positions", type=int, default=40960)
    a = ap.parse_args()
    build(a.out, a.tokenizer, a.size, a.init, a.seed, a.max_positions)


if __name__ == "__main__":
    main()
