"""Make the tiny models the `vllm` tier serves: random-weight Qwen2s with the repo's demo tokenizer (a byte-level
BPE trained on local text, ChatML template). No download. Run with the vLLM venv's python (it has torch):

    .venv-vllm/bin/python tests/vllm/make_model.py OUT_DIR [--unconstrained]

The weights are random but seeded, with a large `initializer_range` so greedy output depends on the whole
context (wrong KV gives other tokens). By default the output layer can only pick whole words with a leading
space (" cache", " the"): such a reply re-tokenizes to exactly the ids generated, so a conversation's next
prompt, rendered from the reply's text, really extends the tokens D holds.

`--unconstrained` leaves the output layer as initialised: the model picks any token (byte pieces, word
fragments, special tokens), so its replies often re-tokenize to other ids than it generated, and sometimes end
inside a UTF-8 character. That is what a real model does now and then, and what `history_tokens` is about.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import torch
from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

TOKENIZER = Path(__file__).resolve().parents[2] / "gateway" / "tokenizers" / "demo"
SEED = 7
WORD = re.compile(r"^ [A-Za-z]{2,}$")


def speakable(tokenizer) -> list[int]:
    """Ids whose text is ` word` and which encode back to themselves alone."""
    ids = []
    for token_id in range(len(tokenizer)):
        text = tokenizer.decode([token_id])
        if WORD.match(text) and tokenizer.encode(text, add_special_tokens=False) == [token_id]:
            ids.append(token_id)
    return ids


def make(out: Path, *, constrained: bool = True) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER / name, out / name)
    config_path = out / "tokenizer_config.json"
    tok_config = json.loads(config_path.read_text())
    tok_config["clean_up_tokenization_spaces"] = False
    config_path.write_text(json.dumps(tok_config, indent=2) + "\n")
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
        initializer_range=0.25, tie_word_embeddings=False, bos_token_id=eos, eos_token_id=eos,
        torch_dtype="float32")
    torch.manual_seed(SEED)
    model = Qwen2ForCausalLM(config)
    if constrained:
        _speak_words_only(model, tokenizer)
    model.save_pretrained(str(out), safe_serialization=True)
    (out / "generation_config.json").unlink(missing_ok=True)   # vLLM would take sampling defaults from it


def _speak_words_only(model: Qwen2ForCausalLM, tokenizer) -> None:
    with torch.no_grad():
        keep = torch.zeros(len(tokenizer), dtype=torch.bool)
        keep[speakable(tokenizer)] = True
        model.lm_head.weight[~keep] = 0.0          # logit 0: never the max among hundreds of random logits
        model.lm_head.weight[keep] *= 4.0


if __name__ == "__main__":
    make(Path(sys.argv[1]), constrained="--unconstrained" not in sys.argv[2:])
