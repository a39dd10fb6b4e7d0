"""history_tokens "generated": answers spliced in as D's own ids, everything else encoded as usual."""

from tokenizers.decoders import DecodeStream

from gateway.turns.intake.generated import MAX_ANSWER_TOKENS, answer, remember
from gateway.turns.intake.render import Renderer

MESSAGES = [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "General Kenobi"},
            {"role": "user", "content": "You are a bold one"}]


def test_canonical_answers_render_exactly_as_the_text_does():
    r = Renderer("builtin:demo")
    ids = r.tokenizer.encode("General Kenobi", add_special_tokens=False)
    assert r.render_chat(MESSAGES, answers=[answer("General Kenobi", ids)]) == r.render_chat(MESSAGES)


def test_non_canonical_ids_are_sent_as_generated():
    r = Renderer("builtin:demo")
    split = [t for ch in "General Kenobi" for t in r.tokenizer.encode(ch, add_special_tokens=False)]
    assert r.decode(split) == "General Kenobi" and split != r.tokenizer.encode("General Kenobi")
    spliced = r.render_chat(MESSAGES, answers=[answer("General Kenobi", split)])
    plain = r.render_chat(MESSAGES)
    header = r.render_chat(MESSAGES[:1])                   # ... "<|im_start|>assistant\n": the previous prompt
    assert spliced[:len(header) + len(split)] == header + split
    assert spliced != plain and r.decode(spliced) == r.decode(plain)


def test_answer_needs_ids_that_decode_to_the_text():
    r = Renderer("builtin:demo")
    ids = r.tokenizer.encode("General Kenobi", add_special_tokens=False)
    eos = r.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert r.answer([*ids, eos], "General Kenobi").ids == ids       # the end-of-turn token is not part of it
    assert r.answer(ids, "Something else") is None                  # e.g. reasoning split out of the content


def test_remember_keeps_the_newest_within_the_bound():
    old = [answer("a", [1] * (MAX_ANSWER_TOKENS // 2)), answer("b", [2] * (MAX_ANSWER_TOKENS // 2))]
    kept = remember(old, answer("c", [3] * 10))
    assert [a.ids[0] for a in kept] == [2, 3]


# -- an answer that stops inside a UTF-8 character ----------------------------------------------------------
# vLLM decodes incrementally with tokenizers' DecodeStream, which emits nothing while the text ends in U+FFFD: the
# bytes of a character not yet complete. An answer cut there (max_tokens, or the end-of-turn token right after a
# byte piece) reaches the client without that tail, while decoding its ids whole ends in U+FFFD.
def engine_text(r: Renderer, prompt: list[int], ids: list[int]) -> str:
    """The text vLLM's detokenizer gives a client for `ids` (FastIncrementalDetokenizer, JSON and streamed)."""
    stream = DecodeStream(ids=prompt, skip_special_tokens=True)
    return "".join(stream.step(r.tokenizer.backend_tokenizer, t) or "" for t in ids)


def cut_inside_a_character(r: Renderer) -> list[int]:
    """'Kenobi' then the first byte of 'é' (C3 A9): the byte-level token for 0xC3 alone."""
    return [*r.tokenizer.encode("General Kenobi", add_special_tokens=False), r.tokenizer.convert_tokens_to_ids("Ã")]


def test_an_answer_cut_inside_a_character_reaches_the_client_without_its_last_bytes():
    r = Renderer("builtin:demo")
    ids = cut_inside_a_character(r)
    text = engine_text(r, r.render_chat(MESSAGES[:1]), ids)
    assert text == "General Kenobi" and r.decode(ids) == "General Kenobi\ufffd"


def test_an_answer_cut_inside_a_character_is_kept_and_spliced_as_generated():
    r = Renderer("builtin:demo")
    eos = r.tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = cut_inside_a_character(r)
    header = r.render_chat(MESSAGES[:1])
    kept = r.answer([*ids, eos], engine_text(r, header, ids))
    assert kept is not None and kept.ids == ids
    messages = [*MESSAGES[:1], {"role": "assistant", "content": engine_text(r, header, ids)}, *MESSAGES[2:]]
    spliced = r.render_chat(messages, answers=[kept])
    assert spliced[:len(header) + len(ids)] == header + ids      # the next prompt extends what D holds


def test_only_a_withheld_partial_character_is_forgiven():
    r = Renderer("builtin:demo")
    ids = cut_inside_a_character(r)
    assert r.answer(ids, "General Kenobi") is not None
    assert r.answer(ids, "General Keno") is None                 # a shorter text is another answer
    assert r.answer(ids, "General Kenobi\ufffd") is not None     # a decode that kept the tail: plain equality
    words = r.tokenizer.encode("General Kenobi", add_special_tokens=False)
    assert r.answer(words, "General Keno") is None               # dropped text that was whole characters


# -- an answer whose text holds a token of its own ---------------------------------------------------------
def test_an_answer_holding_an_added_token_is_spliced_whole():
    """Seen with the unconstrained model on vLLM: a plain answer whose text holds `<tool_response>` (a token of
    its own) spans several pieces, so no piece ended with its text: it was encoded again from its text, and the
    next prompt left D's ids (prefix_diverged). Now it is spliced as a span, like a tool call's text."""
    r = Renderer("builtin:demo")
    text = "General <tool_response> Kenobi"
    split = [t for ch in "General " for t in r.tokenizer.encode(ch, add_special_tokens=False)]
    split += r.tokenizer.encode("<tool_response> Kenobi", add_special_tokens=False)
    assert r.decode(split) == text and split != r.tokenizer.encode(text, add_special_tokens=False)
    kept = r.answer(split, text)
    messages = [*MESSAGES[:1], {"role": "assistant", "content": text}, *MESSAGES[2:]]
    spliced = r.render_chat(messages, answers=[kept])
    header = r.render_chat(MESSAGES[:1])
    assert spliced[:len(header) + len(split)] == header + split   # the next prompt extends what D holds


def test_whether_an_answer_splits_is_kept_per_tokenizer():
    """Parsed messages keep whether a past answer splits into pieces (generated.py), under a name of each
    renderer's own: a token of one tokenizer is plain text to another, and the message cache is shared."""
    import msgspec

    from gateway.api.schemas import ChatRequest, parse
    from gateway.turns.intake.message_cache import MessageCache
    from tests.unit.test_render_incremental import TOKENIZERS

    demo, deepseek = Renderer("builtin:demo"), Renderer(*TOKENIZERS["deepseek"]())
    assert demo._splits_memo != deepseek._splits_memo
    text = "General <tool_response> Kenobi"            # <tool_response>: a token of demo's, text to deepseek
    messages = [*MESSAGES[:1], {"role": "assistant", "content": text}, *MESSAGES[2:]]
    cache = MessageCache()
    for r in (demo, deepseek, demo):
        body, _ = parse(msgspec.json.encode({"messages": messages}), ChatRequest, cache=cache)
        split = r.tokenizer.encode(text, add_special_tokens=False)
        kept = r.answer(split, text)
        fresh = Renderer(*(("builtin:demo", None) if r is demo else TOKENIZERS["deepseek"]()))
        assert list(r.render_chat(body["messages"], answers=[kept])) == \
            list(fresh.render_chat(messages, answers=[fresh.answer(split, text)]))
