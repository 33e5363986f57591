"""A byte-level BPE tokenizer of exactly a model's vocabulary size, for synthetic models.

Ids [0, 256) are the byte alphabet (GPT-2's byte-to-unicode map), then merged pairs and triples of
bytes (printable ASCII first) up to the first special id, then Qwen's special tokens (<|endoftext|>,
<|im_start|>, <|im_end|>, <think>, </think>), or Mistral's (<unk>, <s>, </s>, [INST], [/INST]), and reserved
specials up to the vocabulary size. Any text round-trips; the chat template is ChatML (Qwen3, DBRX) or
Mistral's [INST] one (Mixtral).
"""
from __future__ import annotations

import json
from pathlib import Path

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
MISTRAL_SPECIALS = ("<unk>", "<s>", "</s>", "[INST]", "[/INST]")
# The system, user and assistant part of Mixtral-8x22B-Instruct-v0.1's template (its tool calls left out):
# a system message goes before the last user message; roles must alternate
MISTRAL_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- set system_message = messages[0]['content'] %}{%- set loop_messages = messages[1:] %}"
    "{%- else %}{%- set loop_messages = messages %}{%- endif %}"
    "{{- bos_token }}"
    "{%- for message in loop_messages %}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{- raise_exception('After the optional system message, conversation roles must alternate "
    "user/assistant/user/assistant/...') }}"
    "{%- endif %}"
    "{%- if message['role'] == 'user' %}"
    "{%- if loop.last and system_message is defined %}"
    "{{- '[INST] ' + system_message + '\\n\\n' + message['content'] + '[/INST]' }}"
    "{%- else %}{{- '[INST] ' + message['content'] + '[/INST]' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' %}{{- ' ' + message['content'] | trim + eos_token }}"
    "{%- else %}{{- raise_exception('Only user, assistant and system roles are supported') }}"
    "{%- endif %}"
    "{%- endfor %}"
)
# chat -> (specials, template, bos, eos, pad); bos is special id +1 for Mistral, eos +2 for both
CHATS = {"chatml": (SPECIALS, CHATML_TEMPLATE, None, "<|im_end|>", "<|endoftext|>"),
         "mistral": (MISTRAL_SPECIALS, MISTRAL_TEMPLATE, "<s>", "</s>", None)}


def _byte_chars() -> list[str]:
    """GPT-2's reversible byte -> printable character map, in byte order."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def build_tokenizer(vocab_size: int, first_special: int, specials: tuple[str, ...] = SPECIALS):
    """-> tokenizers.Tokenizer with exactly vocab_size ids; specials start at first_special."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    if not 256 + len(specials) <= first_special + len(specials) <= vocab_size:
        raise ValueError(f"vocabulary of {vocab_size} cannot hold 256 bytes and specials from id {first_special}")
    chars = _byte_chars()
    order = list(range(32, 127)) + [b for b in range(256) if not 32 <= b < 127]   # ASCII first
    alphabet = [chars[b] for b in order]
    vocab = {c: i for i, c in enumerate(chars)}
    merges: list[tuple[str, str]] = []

    def add(left: str, right: str) -> bool:
        if len(vocab) >= first_special:
            return False
        tok = left + right
        if tok not in vocab:
            vocab[tok] = len(vocab)
            merges.append((left, right))
        return True

    pairs = [a + b for a in alphabet for b in alphabet]
    for p in pairs:
        if not add(p[0], p[1]):
            break
    for p in pairs:                                   # triples, built on the pairs
        if len(vocab) >= first_special:
            break
        for c in alphabet:
            if not add(p, c):
                break

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    reserved = [f"<|reserved_special_token_{i}|>" for i in range(vocab_size - first_special - len(specials))]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (*specials, *reserved)])
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"built {tok.get_vocab_size()} tokens instead of {vocab_size}")
    return tok


def write_tokenizer(out_dir: Path, vocab_size: int, first_special: int, max_length: int, chat: str = "chatml") -> None:
    """tokenizer.json, tokenizer_config.json (the chat's template), generation_config.json."""
    specials, template, bos, eos, pad = CHATS[chat]
    tok = build_tokenizer(vocab_size, first_special, specials)
    tok.save(str(out_dir / "tokenizer.json"))
    added = {str(first_special + i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                      "single_word": False, "special": True}
             for i, t in enumerate(specials)}
    config = {
        "added_tokens_decoder": added,
        "bos_token": bos,
        "chat_template": template,
        "clean_up_tokenization_spaces": False,
        "eos_token": eos,
        "errors": "replace",
        "model_max_length": max_length,
        "pad_token": pad,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    gen = {"bos_token_id": first_special + (1 if bos else 0),
           "eos_token_id": [first_special + 2] + ([] if bos else [first_special]),
           "pad_token_id": first_special, "do_sample": False}
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2))
