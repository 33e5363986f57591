"""Grammars for constrained sampling, as llguidance's Lark-like text. Pure Python (no torch, no tokenizer).

    schema_grammar(schema)                       -> the answer is one JSON value valid for `schema`
    tool_grammar(fmt, request, special_id)       -> the answer calls tools in the model's format (or None)
    check_schema(schema, where)                  -> raises GrammarError when llguidance cannot compile it

JSON is written in one style (`JSON_STYLE`: ", " and ": " between items, no other whitespace), the one
chat templates render with `tojson`: a model cannot pad an answer with whitespace for ever, and the text
it writes is the text it reads back next turn. Tool calls are objects `{"name": ..., "arguments": ...}`
with the name first; each tool's schema goes in whole, its `$defs` moved to the top under names of its own.

Why llguidance (over xgrammar and outlines-core): a self-contained wheel (xgrammar needs transformers and
its own FFI runtime in the engine process), built from the model's tokenizer.json, grammars compiled
lazily (no start-up cost per schema), `validate_tokens` to check drafted tokens, and Lark rules with
special tokens (Mistral's [TOOL_CALLS]). Measured per-token costs: docs/api.md.
"""
from __future__ import annotations

import copy
import json
from typing import Any, Callable, Optional

from runtime.tool_format import SYNTAX

JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_SCHEMA_CHARS = 1 << 20


class GrammarError(ValueError):
    """A schema or grammar llguidance cannot compile: `where` names the request's part."""

    def __init__(self, where: str, problem: str):
        super().__init__(f"{where}: {problem}")
        self.where, self.problem = where, problem


def _lit(text: str) -> str:
    return json.dumps(text)


def styled(schema: Any) -> dict:
    """`schema` with llguidance's JSON options (ours win over any the schema brings)."""
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, dict):
        raise GrammarError("schema", f"expected a JSON schema object, got {type(schema).__name__}")
    return {**schema, "x-guidance": dict(JSON_STYLE)}


def schema_grammar(schema: Any) -> str:
    body = json.dumps(styled(schema), ensure_ascii=False)
    if len(body) > MAX_SCHEMA_CHARS:
        raise GrammarError("schema", f"{len(body)} characters; at most {MAX_SCHEMA_CHARS} are accepted")
    return f"start: %json {body}\n"


def check(grammar: str, where: str) -> None:
    """Compile `grammar` without a tokenizer; GrammarError naming `where` when llguidance refuses it."""
    from llguidance import LLMatcher
    problem = LLMatcher.validate_grammar(grammar)
    if problem:
        raise GrammarError(where, f"the grammar library cannot use it: {' '.join(problem.split())}")


def check_schema(schema: Any, where: str) -> None:
    try:
        grammar = schema_grammar(schema)
    except GrammarError as e:
        raise GrammarError(where, e.problem) from None
    check(grammar, where)


def _call_schema(tools: list, defs: dict) -> dict:
    """One call of any of `tools`: {"name": const, "arguments": its parameters}; their $defs go to `defs`."""
    options = []
    for i, tool in enumerate(tools):
        params = _hoisted(tool.parameters or {"type": "object"}, f"t{i}_", defs)
        options.append({"type": "object", "properties": {"name": {"const": tool.name}, "arguments": params},
                        "required": ["name", "arguments"], "additionalProperties": False})
    return options[0] if len(options) == 1 else {"anyOf": options}


def _hoisted(schema: Any, prefix: str, defs: dict) -> Any:
    """A copy of `schema` whose `$defs` / `definitions` move into `defs` under `prefix`, references renamed."""
    if not isinstance(schema, dict):
        return schema
    schema = copy.deepcopy(schema)
    for key in ("$defs", "definitions"):
        for name, sub in (schema.pop(key, None) or {}).items():
            defs[prefix + name] = sub

    def rename(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str):
                for key in ("#/$defs/", "#/definitions/"):
                    if ref.startswith(key):
                        node = dict(node, **{"$ref": "#/$defs/" + prefix + ref[len(key):]})
            return {k: rename(v) for k, v in node.items()}
        if isinstance(node, list):
            return [rename(v) for v in node]
        return node
    for name in [n for n in defs if n.startswith(prefix)]:
        defs[name] = rename(defs[name])
    return rename(schema)


def tool_grammar(fmt: str, request: Any, special_id: Callable[[str], Optional[int]]) -> Optional[str]:
    """The grammar of an answer to a protocol ToolRequest in format `fmt`: "required" and a named function
    get one or more calls and nothing else; "auto" any text, but a call once begun is valid; "none" None.
    `special_id(text)`: the id of a special token of that text (Mistral's [TOOL_CALLS]), else None."""
    if request is None or request.choice == "none" or not request.tools:
        return None
    tools = list(request.tools)
    if request.choice == "function":
        tools = [t for t in tools if t.name == request.name]
        if not tools:
            raise GrammarError("tool_choice", f"names {request.name!r}, which is not among the tools")
    defs: dict = {}
    call = styled(_call_schema(tools, defs))
    if defs:
        call["$defs"] = defs
    body = json.dumps(call, ensure_ascii=False)
    if len(body) > MAX_SCHEMA_CHARS:
        raise GrammarError("tools", f"{len(body)} characters of schemas; at most {MAX_SCHEMA_CHARS} are accepted")
    many = request.parallel and request.choice != "function"
    syntax = SYNTAX[fmt]
    if syntax.listed:                                       # mistral: [TOOL_CALLS] [call, call, ...]
        tid = special_id(syntax.open)
        mark = f"<[{tid}]>" if tid is not None else _lit(syntax.open)
        rest = ' (", " body)*' if many else ""
        calls = f'{mark} ("[" | " [") body{rest} "]"'
        start = f"start: TEXT | {calls}" if request.choice == "auto" else f"start: {calls}"
        return f"{start}\nTEXT: /(.|\\n)*/\nbody: %json {body}\n"
    opener, closer = _lit(syntax.open), _lit("\n" + syntax.close)
    if request.choice == "auto":                            # any text; a call once opened is valid
        return (f"start: (head call)* TEXT\nTEXT: /(.|\\n)*/\nhead[lazy]: TEXT {opener}\n"
                f"call: \"\\n\" body {closer}\nbody: %json {body}\n")
    more = ' ("\\n" call)*' if many else ""
    return f"start: call{more}\ncall: {opener} \"\\n\" body {closer}\nbody: %json {body}\n"
