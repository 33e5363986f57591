"""Fitting a conversation into the context (runtime/context.py) with the demo model's real tokenizer."""
from __future__ import annotations

import pytest

from runtime.context import answer_room, fit_prompt
from runtime.errors import ContextOverflow, EngineError
from runtime.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok(demo_model):
    return Tokenizer.from_folder(demo_model)


def chat(turns: int, words: int = 60) -> list[dict]:
    out = [{"role": "system", "content": "You are terse."}]
    for i in range(turns):
        out.append({"role": "user", "content": f"question {i} " + "word " * words})
        out.append({"role": "assistant", "content": f"answer {i} " + "text " * words})
    out.append({"role": "user", "content": "last question"})
    return out


def test_a_conversation_that_fits_is_left_whole(tok):
    msgs = chat(2)
    fitted = fit_prompt(tok, msgs, context=4096, max_tokens=100, policy="rolling")
    assert fitted.dropped_messages == 0 and fitted.tokens == tok.encode_chat(msgs)


@pytest.mark.parametrize("policy", ["rolling", "keep_first"])
def test_oldest_turns_go_first_keeping_the_system_prompt_and_room_for_the_answer(tok, policy):
    msgs = chat(8)
    whole = len(tok.encode_chat(msgs))
    context, max_tokens = whole // 2, 64
    fitted = fit_prompt(tok, msgs, context=context, max_tokens=max_tokens, policy=policy)
    assert len(fitted.tokens) + answer_room(context, max_tokens) <= context
    assert fitted.dropped_messages % 2 == 0 and fitted.dropped_messages > 0      # whole turns
    text = tok.decode(fitted.tokens, skip_special_tokens=False)
    assert "You are terse." in text and "last question" in text
    assert ("question 0" in text) == (policy == "keep_first")       # keep_first keeps the first exchange
    assert "question 7" in text                                      # the newest turns stay
    if policy == "rolling":      # one turn fewer left out would not fit: the smallest cut
        fewer = msgs[:1] + msgs[1 + fitted.dropped_messages - 2:]
        assert len(tok.encode_chat(fewer)) + answer_room(context, max_tokens) > context


def test_stop_leaves_everything_and_refuses_what_cannot_fit(tok):
    msgs = chat(8)
    whole = len(tok.encode_chat(msgs))
    fitted = fit_prompt(tok, msgs, context=whole + 10, max_tokens=1000, policy="stop")
    assert fitted.dropped_messages == 0                              # the answer gets what is left
    with pytest.raises(EngineError) as e:
        fit_prompt(tok, msgs, context=whole // 2, max_tokens=10, policy="stop")
    assert isinstance(e.value, ContextOverflow) and str(whole) in e.value.message


def test_a_last_message_longer_than_the_context_is_an_error(tok):
    msgs = [{"role": "user", "content": "word " * 400}]
    with pytest.raises(EngineError, match="the last message alone"):
        fit_prompt(tok, msgs, context=256, max_tokens=10, policy="rolling")


def test_answer_prefix_is_counted_and_kept_at_the_end(tok):
    msgs = chat(1)
    fitted = fit_prompt(tok, msgs, context=4096, max_tokens=10, policy="rolling", answer_prefix="The capital")
    prefix = tok.encode("The capital")
    assert fitted.prefix_tokens == len(prefix) and fitted.tokens[-len(prefix):] == prefix


def test_answer_room_is_at_most_half_the_context():
    assert answer_room(4096, 100) == 100 and answer_room(4096, 100_000) == 2048
