"""Build the builtin demo tokenizers shipped in gateway/tokenizers/ (run once; the output is committed).

A byte-level BPE trained on text that ships with Python itself, plus ChatML special tokens and two chat
templates: `demo` (plain ChatML) and `demo-reasoning` (drops <think>...</think> from past assistant turns,
as Qwen3-style templates do).
"""

import json
import pydoc
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

VOCAB_SIZE = 4096
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ADDED = ["<think>", "</think>"]
MODULES = ["asyncio", "json", "collections", "pathlib", "typing", "re", "os", "argparse", "logging",
           "itertools", "functools", "dataclasses", "http.client", "urllib.request", "email", "string"]

CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Past assistant turns (before the last user message) lose their reasoning, like Qwen3's template.
REASONING = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for message in messages %}{%- if message['role'] == 'user' %}{%- set ns.last_user = loop.index0 %}"
    "{%- endif %}{%- endfor %}"
    "{%- for message in messages %}"
    "{%- set content = message['content'] %}"
    "{%- if message['role'] == 'assistant' and loop.index0 < ns.last_user and '</think>' in content %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def corpus() -> list[str]:
    texts = []
    for name in MODULES:
        __import__(name)
        texts.append(pydoc.render_doc(sys.modules[name], renderer=pydoc.plaintext))
    return texts


def train() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer)
    tok.add_tokens(ADDED)
    return tok


def write(tok: Tokenizer, out: Path, template: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "unk_token": None, "model_max_length": 131072, "add_bos_token": False,
        "chat_template": template,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


if __name__ == "__main__":
    root = Path(__file__).resolve().parent.parent / "gateway" / "tokenizers"
    tokenizer = train()
    write(tokenizer, root / "demo", CHATML)
    write(tokenizer, root / "demo-reasoning", REASONING)
    print("vocab", tokenizer.get_vocab_size())
