"""How a model writes tool calls, and how a conversation with tools reaches its chat template. Pure Python.

Formats (`detect(template)` picks one from the chat template's own text):

- `hermes`: Qwen3 and Qwen3.5 (and other ChatML templates with tools): the template renders `tools` itself,
  and each call is `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`; results come back in
  messages of role "tool" that the template wraps in `<tool_response>`.
- `mistral`: Mistral and Mixtral: the template renders `tools` (`[AVAILABLE_TOOLS]`), and the answer is
  `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]` (a control token, then one JSON list); call ids
  must be 9 letters or digits, so other ids are mapped to such ids, the same way every time.
- `generic`: a template that knows no tools (SmolLM2's, DBRX's): the tools are described in the system
  message in hermes' syntax, an assistant's calls are written back as that text, and tool results go in
  as user messages in `<tool_response>` tags.

Messages are plain dicts in Hugging Face's convention (what templates expect): an assistant's
`tool_calls` as `{"id", "type": "function", "function": {"name", "arguments": object}}`.
"""
from __future__ import annotations

import hashlib
import json
import string
from dataclasses import dataclass
from typing import Any, Optional, Sequence

FORMATS = ("hermes", "mistral", "generic")
MISTRAL_ID_CHARS = string.ascii_letters + string.digits
GENERIC_INSTRUCTIONS = (
    "You can call functions. Their signatures, as JSON schemas, are within <tools></tools> tags:\n<tools>\n{tools}\n"
    "</tools>\nTo call one or more of them, answer with one JSON object per call, each within "
    "<tool_call></tool_call> tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n"
    "</tool_call>")


@dataclass(frozen=True)
class Syntax:
    open: str                  # what starts a call (hermes) or the list of calls (mistral)
    close: str                 # what ends a call; "" : the end of the answer
    listed: bool               # the calls are one JSON list after `open`


SYNTAX = {"hermes": Syntax("<tool_call>", "</tool_call>", False),
          "generic": Syntax("<tool_call>", "</tool_call>", False),
          "mistral": Syntax("[TOOL_CALLS]", "", True)}


def detect(template: Optional[str]) -> str:
    """The format of a chat template's source text (None: no template)."""
    text = template or ""
    if "tools" in text and "[TOOL_CALLS]" in text:
        return "mistral"
    if "tools" in text and "<tool_call>" in text:
        return "hermes"
    return "generic"


def tool_json(tool: Any) -> dict:
    """One tool as OpenAI's request writes it (what templates render into the prompt)."""
    fn = {"name": tool.name}
    if tool.description:
        fn["description"] = tool.description
    fn["parameters"] = tool.parameters or {"type": "object", "properties": {}}
    return {"type": "function", "function": fn}


def chat_inputs(messages: Sequence[Any], tools: Optional[Any], fmt: str) -> tuple[list[dict], Optional[list[dict]]]:
    """The messages (protocol ChatMessage records) and the `tools` variable for the chat template.

    `tools`: a protocol ToolRequest or None; with choice "none" the tools are left out of the prompt."""
    offered = [tool_json(t) for t in tools.tools] if tools is not None and tools.choice != "none" else None
    if fmt == "generic":
        return _generic(messages, offered), None
    ids = _mistral_id if fmt == "mistral" else (lambda i: i)
    out = []
    for m in messages:
        d: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls:
            d["tool_calls"] = [{"id": ids(c.id), "type": "function",
                                "function": {"name": c.name, "arguments": _arguments(c.arguments)}}
                               for c in m.tool_calls]
        if m.role == "tool":
            d["tool_call_id"] = ids(m.tool_call_id)
        out.append(d)
    return out, offered


def _generic(messages: Sequence[Any], offered: Optional[list[dict]]) -> list[dict]:
    out: list[dict] = []
    if offered:
        words = GENERIC_INSTRUCTIONS.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in offered))
        if messages and messages[0].role == "system":
            out.append({"role": "system", "content": f"{messages[0].content}\n\n{words}"})
            messages = messages[1:]
        else:
            out.append({"role": "system", "content": words})
    for m in messages:
        if m.role == "tool":
            piece = f"<tool_response>\n{m.content}\n</tool_response>"
            if out and out[-1].get("tool_results"):            # results of one turn's calls: one message
                out[-1]["content"] += "\n" + piece
            else:
                out.append({"role": "user", "content": piece, "tool_results": True})
            continue
        content = m.content
        if m.tool_calls:
            calls = "\n".join(call_text(c.name, c.arguments) for c in m.tool_calls)
            content = f"{content}\n{calls}" if content else calls
        out.append({"role": m.role, "content": content})
    for d in out:
        d.pop("tool_results", None)
    return out


def call_text(name: str, arguments: str) -> str:
    """One call as hermes and the generic format write it."""
    args = _arguments(arguments)
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}, ensure_ascii=False) + "\n</tool_call>"


def _arguments(text: str) -> Any:
    """A call's arguments as an object (templates expect one), or the text as sent when it is not JSON."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def _mistral_id(call_id: str) -> str:
    """A call id as Mistral's templates require it (9 letters or digits): kept when it is one already, else
    derived from it (the same id for the call and for the result that answers it)."""
    if len(call_id) == 9 and all(c in MISTRAL_ID_CHARS for c in call_id):
        return call_id
    digest = int.from_bytes(hashlib.sha256(call_id.encode("utf-8", "backslashreplace")).digest()[:8], "big")
    out = []
    for _ in range(9):
        digest, r = divmod(digest, len(MISTRAL_ID_CHARS))
        out.append(MISTRAL_ID_CHARS[r])
    return "".join(out)
