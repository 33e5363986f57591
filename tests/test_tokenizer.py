"""Tokenizer, chat template, streaming detokenizer and stop strings, at every awkward boundary."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from runtime.errors import EngineError, InvalidModel
from runtime.generate import StopMatcher
from runtime.tokenizer import REPLACEMENT, StreamDecoder, Tokenizer

TEXTS = ["hello world", "héllo wörld", "日本語のテキスト", "emoji 🙂👍🏽 and ZWJ 👨‍👩‍👧 family", "mixed: a€b😀c\nnew line"]


def _byte_level_tokenizer() -> HFTokenizer:
    """Byte-level BPE (GPT-2 / SmolLM2 style) whose vocabulary is only the 256 byte symbols + a few merges."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    merges = [("h", "e"), ("l", "l"), ("he", "ll")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = HFTokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|end|>"])
    return tok


def _byte_fallback_tokenizer() -> HFTokenizer:
    """SentencePiece-style BPE with byte fallback: characters outside the vocabulary become <0xNN> tokens."""
    vocab = {f"<0x{b:02X}>": b for b in range(256)}
    for piece in ["▁", "h", "e", "l", "o", "w", "r", "d", "▁h", "ll"]:
        vocab.setdefault(piece, len(vocab))
    tok = HFTokenizer(models.BPE(vocab, [("▁", "h"), ("l", "l")], byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return tok


def _folder(tmp_path: Path, backend: HFTokenizer, tok_config: dict | None = None, **files) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    backend.save(str(folder / "tokenizer.json"))
    if tok_config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(tok_config))
    for name, text in files.items():
        (folder / name.replace("__", ".")).write_text(text)
    return folder


@pytest.fixture(params=["byte_level", "byte_fallback"])
def tokenizer(request, tmp_path) -> Tokenizer:
    backend = _byte_level_tokenizer() if request.param == "byte_level" else _byte_fallback_tokenizer()
    return Tokenizer.from_folder(_folder(tmp_path, backend, {}))


def _stream(tok: Tokenizer, ids: list[int], sizes) -> list[str]:
    dec = StreamDecoder(tok)
    out, i = [], 0
    for n in sizes:
        out.append(dec.push(ids[i:i + n]))
        i += n
    out.append(dec.push(ids[i:]))
    out.append(dec.flush())
    return out


# ----------------------------------------------------------------------------------------------
# Streaming detokenizer

@pytest.mark.parametrize("text", TEXTS)
def test_stream_one_token_at_a_time_rebuilds_text_and_never_breaks_a_character(tokenizer, text):
    ids = tokenizer.encode(text)
    deltas = _stream(tokenizer, ids, [1] * len(ids))
    assert "".join(deltas) == tokenizer.decode(ids)
    for d in deltas:
        assert REPLACEMENT not in d
        d.encode("utf-8")   # a lone surrogate would raise


def test_multibyte_characters_really_are_split_across_tokens(tokenizer):
    """Guard: the tests above only mean something if single tokens hold partial characters."""
    ids = tokenizer.encode("日本🙂")
    assert len(ids) > 3
    assert any(REPLACEMENT in tokenizer.decode([i]) for i in ids)


@pytest.mark.parametrize("text", TEXTS)
def test_stream_in_chunks_of_every_split_point(tokenizer, text):
    ids = tokenizer.encode(text)
    expected = tokenizer.decode(ids)
    for cut in range(len(ids) + 1):
        deltas = _stream(tokenizer, ids, [cut])
        assert "".join(deltas) == expected, cut
        assert all(REPLACEMENT not in d for d in deltas)


def test_an_answer_stopped_inside_a_character_ends_before_it(tokenizer):
    ids = tokenizer.encode("a日")
    dec = StreamDecoder(tokenizer)
    # Every byte of 日 but the last: the character is not complete, nothing of it may come out.
    got = "".join(dec.push([i]) for i in ids[:-1])
    assert got == "a"
    assert dec.flush() == ""            # stopped mid-character: no U+FFFD saved in its place


def test_special_tokens_are_skipped_in_stream(tmp_path):
    tok = Tokenizer.from_folder(_folder(tmp_path, _byte_level_tokenizer(), {"eos_token": "<|end|>"}))
    end = tok._tok.token_to_id("<|end|>")
    ids = tok.encode("hello") + [end]
    assert "".join(_stream(tok, ids, [1] * len(ids))) == "hello"
    assert end in tok.eos_ids


# ----------------------------------------------------------------------------------------------
# Stop strings

def _run_stops(stops, deltas):
    m = StopMatcher(stops)
    out = []
    for d in deltas:
        text, stopped = m.feed(d)
        out.append(text)
        if stopped:
            return "".join(out), True
    out.append(m.flush())
    return "".join(out), False


@pytest.mark.parametrize("stop", ["STOP", "\n\nUser:", "é🙂", "x"])
def test_stop_string_split_at_every_position(stop):
    text = f"The answer is 42.{stop}ignored tail"
    want = "The answer is 42."
    for a in range(len(text) + 1):
        for b in range(a, len(text) + 1):
            got, stopped = _run_stops([stop], [text[:a], text[a:b], text[b:]])
            assert stopped and got == want, (a, b)


def test_stop_prefix_is_held_back_and_never_emitted():
    m = StopMatcher(["</answer>"])
    assert m.feed("yes </ans") == ("yes ", False)      # "</ans" could start the stop string
    assert m.feed("wer>") == ("", True)


def test_false_stop_prefix_is_released():
    m = StopMatcher(["STOP"])
    assert m.feed("ST") == ("", False)
    assert m.feed("ART") == ("START", False)
    assert m.feed("S") == ("", False)
    assert m.flush() == "S"                             # stream ended: the held tail was text after all


def test_earliest_of_several_stop_strings_wins():
    got, stopped = _run_stops(["world", "lo w"], ["hello world"])
    assert stopped and got == "hel"


def test_no_stops_passes_everything_through():
    for cut in range(12):
        text = "plain text!"
        assert _run_stops([], [text[:cut], text[cut:]]) == (text, False)


# ----------------------------------------------------------------------------------------------
# Chat template and special tokens

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def test_template_from_tokenizer_config(tmp_path):
    tok = Tokenizer.from_folder(_folder(tmp_path, _byte_level_tokenizer(), {"chat_template": CHATML}))
    text = tok.render_chat([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_chat_template_jinja_file_wins_and_helpers_work(tmp_path):
    tmpl = ("{% for m in messages %}{% if m.role == 'bad' %}{{ raise_exception('no bad roles') }}{% endif %}"
            "{% if loop.index > 2 %}{% break %}{% endif %}{{ m | tojson }}|{% endfor %}"
            "{{ bos_token }}{{ strftime_now('%Y') | length }}")
    folder = _folder(tmp_path, _byte_level_tokenizer(), {"chat_template": "ignored", "bos_token": {"content": "<s>"}},
                     chat_template__jinja=tmpl)
    tok = Tokenizer.from_folder(folder)
    msgs = [{"role": "user", "content": "é"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    assert tok.render_chat(msgs) == '{"role": "user", "content": "é"}|{"role": "assistant", "content": "b"}|<s>4'
    with pytest.raises(EngineError, match="no bad roles") as e:
        tok.render_chat([{"role": "bad", "content": "x"}])
    assert "chat_template.jinja" in e.value.message


def test_named_template_list_uses_default(tmp_path):
    cfg = {"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}
    assert Tokenizer.from_folder(_folder(tmp_path, _byte_level_tokenizer(), cfg)).render_chat([]) == "D"


def test_broken_template_names_the_file(tmp_path):
    folder = _folder(tmp_path, _byte_level_tokenizer(), {}, chat_template__jinja="{% for m in messages %}oops")
    with pytest.raises(EngineError) as e:
        Tokenizer.from_folder(folder)
    assert isinstance(e.value, InvalidModel)
    assert "chat_template.jinja" in e.value.message and "broken" in e.value.message


def test_sandbox_blocks_unsafe_template(tmp_path):
    evil = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    tok = Tokenizer.from_folder(_folder(tmp_path, _byte_level_tokenizer(), {"chat_template": evil}))
    with pytest.raises(EngineError, match="unsafe|tokenizer_config.json"):
        tok.render_chat([{"role": "user", "content": "x"}])


def test_sandbox_is_immutable(tmp_path):
    tmpl = "{% set x = [] %}{{ x.append(1) }}"
    tok = Tokenizer.from_folder(_folder(tmp_path, _byte_level_tokenizer(), {"chat_template": tmpl}))
    with pytest.raises(EngineError, match="unsafe"):
        tok.render_chat([])


def test_no_template_is_a_clear_error(tmp_path):
    tok = Tokenizer.from_folder(_folder(tmp_path, _byte_level_tokenizer(), {}))
    with pytest.raises(EngineError, match="no chat template"):
        tok.render_chat([{"role": "user", "content": "x"}])


def test_eos_ids_from_every_config(tmp_path):
    backend = _byte_level_tokenizer()
    end = backend.token_to_id("<|end|>")
    folder = _folder(tmp_path, backend, {"eos_token": "<|end|>"},
                     generation_config__json=json.dumps({"eos_token_id": [7, 8]}),
                     config__json=json.dumps({"eos_token_id": 9}))
    assert Tokenizer.from_folder(folder).eos_ids == {7, 8, 9, end}


def test_missing_and_corrupt_tokenizer_files_name_the_file(tmp_path):
    (tmp_path / "a").mkdir()
    with pytest.raises(EngineError, match="tokenizer.json: missing"):
        Tokenizer.from_folder(tmp_path / "a")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "tokenizer.json").write_text("{not json")
    with pytest.raises(EngineError, match="tokenizer.json"):
        Tokenizer.from_folder(tmp_path / "b")
    folder = _folder(tmp_path, _byte_level_tokenizer(), None, tokenizer_config__json="[1, 2]")
    with pytest.raises(EngineError, match="tokenizer_config.json: expected a JSON object"):
        Tokenizer.from_folder(folder)


def test_demo_model_tokenizer_and_template(demo_model):
    tok = Tokenizer.from_folder(demo_model)
    ids = tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    text = tok.decode(ids, skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert tok._tok.token_to_id("<|im_end|>") in tok.eos_ids
    for s in TEXTS:
        ids = tok.encode(s)
        assert "".join(_stream(tok, ids, [1] * len(ids))) == s
