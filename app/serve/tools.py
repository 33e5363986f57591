"""OpenAI function calling over the engine: request fields in, the model's calls out.

    request = tool_request(body)                  # tools / tool_choice / parallel_tool_calls -> protocol ToolRequest
    messages = chat_messages(body)                # roles system, developer, user, assistant (with tool_calls), tool
    parser = CallParser("hermes")                 # the model's format (runtime/tool_format.py, Loaded.tool_format)
    for piece in parser.feed(text) + parser.finish():   # Text(...) and Call(...) in the order the model wrote them

The worker renders the tools through the model's own chat template and, for "required" and a named
function, constrains the answer to calls valid for their schemas (runtime/grammars.py); this module reads
the answer's text back into calls. The parser takes the text in any pieces (a marker split over two
deltas included) and holds back only what could still be the start of a call.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Optional, Union

from app.serve.fields import BadField
from runtime import protocol as P
from runtime.grammars import GrammarError, check_schema
from runtime.tool_format import SYNTAX

MAX_TOOLS = 128
NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
ROLES = ("system", "developer", "user", "assistant", "tool")


# ----------------------------------------------------------------------------------------------
# Requests

def tool_request(body: dict) -> Optional[P.ToolRequest]:
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise BadField("parallel_tool_calls: expected true or false", "parallel_tool_calls")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise BadField("tool_choice: needs tools to choose from", "tool_choice")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise BadField(f"tools: expected a list of at most {MAX_TOOLS} functions", "tools")
    specs = tuple(_tool(t, f"tools[{i}]") for i, t in enumerate(tools))
    names = [t.name for t in specs]
    if len(set(names)) != len(names):
        raise BadField("tools: two functions have the same name", "tools")
    name = ""
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        fn = choice.get("function") if choice.get("type") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if name not in names:
            raise BadField(f"tool_choice: names {name!r}, which is not among the tools ({', '.join(names)})",
                         "tool_choice")
        choice = "function"
    elif choice not in ("auto", "none", "required"):
        raise BadField("tool_choice: \"auto\", \"none\", \"required\" or "
                          "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")
    return P.ToolRequest(specs, choice, name, parallel)


def _tool(value: Any, where: str) -> P.Tool:
    fn = value.get("function") if isinstance(value, dict) and value.get("type") == "function" else None
    if not isinstance(fn, dict):
        raise BadField(f"{where}: expected {{\"type\": \"function\", \"function\": {{...}}}}", "tools")
    name, description = fn.get("name"), fn.get("description") or ""
    if not isinstance(name, str) or not NAME.match(name):
        raise BadField(f"{where}.function.name: 1 to 64 letters, digits, '_', '.' or '-'", "tools")
    if not isinstance(description, str):
        raise BadField(f"{where}.function.description: expected text", "tools")
    params = fn.get("parameters")
    if params is None:
        params = {"type": "object", "properties": {}}
    if not isinstance(params, dict):
        raise BadField(f"{where}.function.parameters: expected a JSON schema object", "tools")
    try:
        check_schema(params, f"{where}.function.parameters")
    except GrammarError as e:
        raise BadField(str(e), "tools") from None
    return P.Tool(name, description, params)


def _text(value: Any, where: str, nullable: bool = False) -> str:
    if isinstance(value, str):
        return value
    if value is None and nullable:
        return ""
    if isinstance(value, list):        # content parts: only text ones
        texts = []
        for i, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise BadField(f"{where}[{i}]: only text content parts are supported", "messages")
            texts.append(part["text"])
        return "".join(texts)
    raise BadField(f"{where}: expected text", "messages")


def chat_messages(body: dict) -> tuple[P.ChatMessage, ...]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadField("messages: expected a non-empty list of {role, content}", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise BadField(f"{where}: expected an object", "messages")
        role = m.get("role")
        if role not in ROLES:
            raise BadField(f"{where}.role: {role!r} is not supported ({', '.join(ROLES)})", "messages")
        calls = _calls(m.get("tool_calls"), f"{where}.tool_calls") if role == "assistant" else ()
        content = _text(m.get("content"), f"{where}.content", nullable=role == "assistant")
        call_id = ""
        if role == "tool":
            call_id = m.get("tool_call_id")
            if not isinstance(call_id, str) or not call_id:
                raise BadField(f"{where}.tool_call_id: required for a tool message", "messages")
        out.append(P.ChatMessage("system" if role == "developer" else role, content, calls, call_id))
    return tuple(out)


def _calls(value: Any, where: str) -> tuple[P.ToolCall, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise BadField(f"{where}: expected a list", "messages")
    out = []
    for i, c in enumerate(value):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(c.get("id"), str):
            raise BadField(f"{where}[{i}]: expected {{\"id\", \"type\": \"function\", "
                              "\"function\": {\"name\", \"arguments\"}}", "messages")
        args = fn.get("arguments", "{}")
        if not isinstance(args, str):
            args = json.dumps(args, ensure_ascii=False)
        out.append(P.ToolCall(c["id"], fn["name"], args))
    return tuple(out)


# ----------------------------------------------------------------------------------------------
# Answers: the model's text -> content and calls

@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class Call:
    index: int
    id: str
    name: str
    arguments: str                    # JSON text

    def whole(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}

    def deltas(self) -> list[dict]:
        """As OpenAI streams a call: its id, type and name with empty arguments, then the arguments."""
        return [{"index": self.index, "id": self.id, "type": "function",
                 "function": {"name": self.name, "arguments": ""}},
                {"index": self.index, "function": {"arguments": self.arguments}}]


Piece = Union[Text, Call]


class CallParser:
    """Streaming text in; Text and Call pieces out, in order. A call the model wrote badly (possible only
    where nothing constrained it) comes out as the text it was."""

    def __init__(self, fmt: str):
        self.syntax = SYNTAX[fmt]
        self.buf = ""
        self.inside = False
        self.count = 0
        self.space = ""

    def feed(self, text: str) -> list[Piece]:
        self.buf += text
        out: list[Piece] = []
        while True:
            if not self.inside:
                at = self.buf.find(self.syntax.open)
                if at < 0:
                    keep = _pending(self.buf, self.syntax.open)
                    self._text(out, self.buf[:len(self.buf) - keep])
                    self.buf = self.buf[len(self.buf) - keep:]
                    return out
                self._text(out, self.buf[:at])
                self.buf, self.inside, self.space = self.buf[at + len(self.syntax.open):], True, ""
            elif self.syntax.close and self.syntax.close in self.buf:
                body, _, self.buf = self.buf.partition(self.syntax.close)
                self.inside = False
                out.extend(self._parse(body))
            else:
                return out

    def finish(self) -> list[Piece]:
        """What is left at the end of the answer. A call still open there was cut by max_tokens (the
        grammar lets no answer end inside a call): it is dropped, not passed off as content."""
        out: list[Piece] = []
        if self.inside:
            out.extend(p for p in self._parse(self.buf, closed=False) if isinstance(p, Call))
        else:
            self._text(out, self.buf, last=True)
        self.buf, self.inside, self.space = "", False, ""
        return out

    def _text(self, out: list[Piece], text: str, last: bool = False) -> None:
        """Text as content; whitespace after a call is held until words follow it (the lines between
        calls, and after the last, are no content), whatever pieces the text came in."""
        if self.count and not text.strip():
            self.space = "" if last else self.space + text
            return
        if text:
            out.append(Text(self.space + text))
            self.space = ""

    def _parse(self, body: str, closed: bool = True) -> list[Piece]:
        try:
            found = json.loads(body)
        except ValueError:
            found = None
        items = found if self.syntax.listed and isinstance(found, list) else [found]
        calls = [self._call(item) for item in items]
        if found is None or not calls or any(c is None for c in calls):
            return [Text(self.syntax.open + body + (self.syntax.close if closed else ""))]
        return calls

    def _call(self, item: Any) -> Optional[Call]:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        args = item.get("arguments", item.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                return None
        if not isinstance(args, dict):
            return None
        call = Call(self.count, f"call_{uuid.uuid4().hex[:24]}", item["name"], json.dumps(args, ensure_ascii=False))
        self.count += 1
        return call


def _pending(buf: str, marker: str) -> int:
    """Length of the longest tail of `buf` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(buf)), 0, -1):
        if buf.endswith(marker[:n]):
            return n
    return 0
