"""A model folder's tokenizer, chat template and end-of-sequence tokens, plus streaming text pieces.

- `Tokenizer.from_folder(path)`: `tokenizer.json` through `tokenizers`; special tokens and end ids from
  tokenizer_config.json, generation_config.json and config.json; the chat template from
  `chat_template.jinja` or tokenizer_config.json's `chat_template`, rendered in jinja2's immutable
  sandbox with the helpers Hugging Face templates expect, in a helper process bounded in time, output
  and memory (model folders are untrusted: see runtime/chat_template.py). No file linked out of the
  folder is read.
- `StreamDecoder`: turns token ids into text deltas that never end inside a UTF-8 character
  (byte-level BPE and byte-fallback tokens like <0xE2> can split one character over several tokens).

Stop strings in the streamed text: `runtime/generate.py`'s `StopMatcher`.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence

from runtime import chat_template
from runtime.errors import ContextOverflow, InvalidModel
from runtime.modelfolder import MAX_JSON_BYTES, inside, read_json
from runtime.options import MAX_PROMPT_CHARS

REPLACEMENT = "\ufffd"   # what a decoder yields for bytes that do not (yet) form a character
MAX_TEMPLATE_CHARS = 1 << 20   # a chat template's source (real ones are a few kB)


def _invalid(path: Path, problem: str) -> InvalidModel:
    return InvalidModel(path, problem)


def _read_json(folder: Path, name: str) -> dict:
    """A JSON object from an optional file of the folder ({} when absent); no link out of the folder."""
    path = inside(folder, folder / name)
    if not path.is_file():
        return {}
    data = read_json(path)
    if not isinstance(data, dict):
        raise _invalid(path, f"expected a JSON object, got {type(data).__name__}")
    return data


def _token_text(value: Any) -> Optional[str]:
    """tokenizer_config.json writes special tokens as text or as {"content": text, ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _ids(value: Any) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


# ----------------------------------------------------------------------------------------------
# Chat template

@dataclass
class ChatTemplate:
    """A model's chat template; compiled and rendered in runtime.chat_template's helper process, under bounds."""
    source: str        # where it came from, for error messages
    text: str

    def __post_init__(self):
        if len(self.text) > MAX_TEMPLATE_CHARS:
            raise _invalid(Path(self.source), f"chat template of {len(self.text)} characters; at most "
                                              f"{MAX_TEMPLATE_CHARS} are accepted")
        chat_template.run({"template": self.text}, self.source)        # syntax errors at load, by name

    def render(self, messages: Sequence[dict], should_stop: Callable[[], bool] = lambda: False,
               **variables: Any) -> str:
        chars = sum(len(str(m.get("content", ""))) for m in messages)
        return chat_template.run({"template": self.text, "conversation_chars": chars,
                                  "variables": {"messages": list(messages), **variables}}, self.source, should_stop)


def _find_template(folder: Path, tok_config: dict) -> Optional[ChatTemplate]:
    jinja_file = inside(folder, folder / "chat_template.jinja")
    if jinja_file.is_file():
        try:
            return ChatTemplate(str(jinja_file), jinja_file.read_text(encoding="utf-8"))
        except UnicodeDecodeError as e:
            raise _invalid(jinja_file, f"not UTF-8 text ({e})") from None
    value = tok_config.get("chat_template")
    source = str(folder / "tokenizer_config.json")
    if isinstance(value, list):   # [{"name": "default", "template": "..."}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default") or next(iter(named.values()), None)
    if value is None:
        return None
    if not isinstance(value, str):
        raise _invalid(Path(source), f"chat_template must be text, got {type(value).__name__}")
    return ChatTemplate(source, value)


# ----------------------------------------------------------------------------------------------
# Tokenizer

class Tokenizer:
    """Encode/decode plus the model's chat template and end-of-sequence ids."""

    def __init__(self, folder: Path, backend: Any, tok_config: dict, gen_config: dict, model_config: dict):
        self.folder = folder
        self._tok = backend
        self.bos_token = _token_text(tok_config.get("bos_token"))
        self.eos_token = _token_text(tok_config.get("eos_token"))
        self.pad_token = _token_text(tok_config.get("pad_token"))
        self.unk_token = _token_text(tok_config.get("unk_token"))
        self.template = _find_template(folder, tok_config)

        eos = set(_ids(gen_config.get("eos_token_id")))
        eos |= set(_ids(model_config.get("eos_token_id")))
        eos |= set(_ids((model_config.get("text_config") or {}).get("eos_token_id")))
        if self.eos_token is not None and backend.token_to_id(self.eos_token) is not None:
            eos.add(backend.token_to_id(self.eos_token))
        self.eos_ids: frozenset[int] = frozenset(eos)
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_folder(cls, folder: Path | str) -> "Tokenizer":
        from tokenizers import Tokenizer as HFTokenizer
        folder = Path(folder)
        tok_file = inside(folder, folder / "tokenizer.json")
        if not tok_file.is_file():
            raise _invalid(tok_file, "missing (the model folder has no tokenizer)")
        if tok_file.stat().st_size > MAX_JSON_BYTES:
            raise _invalid(tok_file, f"more than the {MAX_JSON_BYTES} bytes a model folder's JSON file may have")
        try:
            backend = HFTokenizer.from_file(str(tok_file))
        except Exception as e:   # tokenizers raises plain Exception subclasses from Rust
            raise _invalid(tok_file, f"cannot be read as a tokenizer: {e}") from None
        return cls(folder, backend, _read_json(folder, "tokenizer_config.json"),
                   _read_json(folder, "generation_config.json"), _read_json(folder, "config.json"))

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: Sequence[dict], add_generation_prompt: bool = True,
                    should_stop: Callable[[], bool] = lambda: False, tools: Optional[list] = None) -> str:
        if self.template is None:
            raise _invalid(self.folder, "the model has no chat template (neither chat_template.jinja nor "
                                        "tokenizer_config.json's chat_template); send a raw prompt instead")
        return self.template.render(messages, should_stop, add_generation_prompt=add_generation_prompt,
                                    bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                                    pad_token=self.pad_token or "", unk_token=self.unk_token or "",
                                    tools=tools or None, documents=None)

    def encode_chat(self, messages: Sequence[dict], should_stop: Callable[[], bool] = lambda: False,
                    tools: Optional[list] = None) -> list[int]:
        # The rendered template already holds the special tokens (as Hugging Face's apply_chat_template).
        return self.encode(self.render_chat(messages, should_stop=should_stop, tools=tools), add_special_tokens=False)

    def tool_format(self) -> str:
        """How the model writes tool calls, from its chat template (runtime/tool_format.py)."""
        from runtime.tool_format import detect
        return detect(self.template.text if self.template is not None else None)

    def special_id(self, text: str) -> Optional[int]:
        """The id of the one token that is exactly `text` (e.g. Mistral's [TOOL_CALLS]), else None."""
        return self._tok.token_to_id(text)

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json holds it (what the grammar library builds its view from)."""
        return self._tok.to_str()

    def encode_prompt(self, text: str) -> list[int]:
        """A raw prompt, with whatever special tokens the tokenizer itself adds (e.g. BOS)."""
        if len(text) > MAX_PROMPT_CHARS:
            raise ContextOverflow(f"the prompt is {len(text)} characters; at most {MAX_PROMPT_CHARS} are accepted")
        return self.encode(text, add_special_tokens=True)

    def vocabulary(self) -> dict[str, int]:
        return self._tok.get_vocab(with_added_tokens=True)

    def stream_decoder(self, skip_special_tokens: bool = True) -> "StreamDecoder":
        return StreamDecoder(self, skip_special_tokens)


# ----------------------------------------------------------------------------------------------
# Streaming text

class StreamDecoder:
    """Token ids in, text deltas out; never emits a partial UTF-8 character.

    Decodes a small window of recent tokens twice (with and without the new ones) and emits the
    difference, so decoders that depend on context (leading-space handling, byte fusion) stay right.
    While the new text ends in U+FFFD its bytes are incomplete: hold it back until a later token
    completes the character; `flush()` at the end emits what is left but such an incomplete character.
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True):
        self._decode = tokenizer.decode
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0   # start of the decode window
        self._read = 0     # tokens before this are emitted

    def push(self, ids: Iterable[int]) -> str:
        self._ids.extend(ids)
        window = self._ids[self._prefix:]
        before = self._decode(self._ids[self._prefix:self._read], skip_special_tokens=self._skip)
        after = self._decode(window, skip_special_tokens=self._skip)
        if len(after) <= len(before) or after.endswith(REPLACEMENT):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return after[len(before):]

    def flush(self) -> str:
        """What is left at the end of the answer, less a last character whose bytes never all came
        (an answer stopped inside a multi-byte character): U+FFFD would be saved in its place."""
        before = self._decode(self._ids[self._prefix:self._read], skip_special_tokens=self._skip)
        after = self._decode(self._ids[self._prefix:], skip_special_tokens=self._skip)
        self._prefix = self._read = len(self._ids)
        return after[len(before):].rstrip(REPLACEMENT)
