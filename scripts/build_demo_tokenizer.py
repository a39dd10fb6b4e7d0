"""Build the builtin demo tokenizers shipped in gateway/tokenizers/ (run once; the output is committed).

A byte-level BPE trained on text that ships with Python itself, plus ChatML special tokens and two chat
templates: `demo` (plain ChatML) and `demo-reasoning` (drops <think>...</think> from past assistant turns,
as Qwen3-style templates do).
"""

import json
import pydoc
import sys
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

VOCAB_SIZE = 4096
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ADDED = ["<think>", "</think>"]
# Matched on the raw text and not special (kept by decode), as in Qwen2.5/Qwen3: vLLM's hermes tool parser
# finds them in the detokenized output.
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
MODULES = ["asyncio", "json", "collections", "pathlib", "typing", "re", "os", "argparse", "logging",
           "itertools", "functools", "dataclasses", "http.client", "urllib.request", "email", "string"]

# Tool calling the way Qwen2.5/Qwen3 (Hermes-style) templates do it: `tools` go into the system turn inside
# <tools></tools>, an assistant's `tool_calls` become <tool_call>{"name": ..., "arguments": ...}</tool_call>,
# consecutive `tool` messages become <tool_response> blocks inside one user turn. Without tools, tool_calls
# or tool messages, the text is byte-identical to the plain ChatML template (tests/sim/test_template.py).
TOOLS_SYSTEM = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, "
    "\"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
)
TOOL_MESSAGES = (
    "{%- if tools and loop.first and message['role'] == 'system' %}"
    "{%- elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "{{- '<|im_start|>assistant\\n' + content }}"
    "{%- for tool_call in message['tool_calls'] %}"
    "{%- if not loop.first or content %}{{- '\\n' }}{%- endif %}"
    "{%- if tool_call['function'] is defined %}{%- set tool_call = tool_call['function'] %}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + tool_call['name'] + '\", \"arguments\": ' }}"
    "{%- if tool_call['arguments'] is string %}{{- tool_call['arguments'] }}"
    "{%- else %}{{- tool_call['arguments'] | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endif %}"
)
GENERATION_PROMPT = "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"

CHATML = (
    TOOLS_SYSTEM
    + "{%- for message in messages %}"
    "{%- set content = message['content'] if message['content'] is string else '' %}"
    + TOOL_MESSAGES
    + "{%- endfor %}"
    + GENERATION_PROMPT
)

# Past assistant turns (before the last user message) lose their reasoning, like Qwen3's template.
REASONING = (
    TOOLS_SYSTEM
    + "{%- set ns = namespace(last_user=-1) %}"
    "{%- for message in messages %}{%- if message['role'] == 'user' %}{%- set ns.last_user = loop.index0 %}"
    "{%- endif %}{%- endfor %}"
    "{%- for message in messages %}"
    "{%- set content = message['content'] if message['content'] is string else '' %}"
    "{%- if message['role'] == 'assistant' and loop.index0 < ns.last_user and '</think>' in content %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    + TOOL_MESSAGES
    + "{%- endfor %}"
    + GENERATION_PROMPT
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
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in TOOL_TOKENS])
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
