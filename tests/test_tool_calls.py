"""Tool calls without a server: formats from chat templates, tools through the template, grammars that take the
model's own call syntax, the streaming parser at every split position, and the API's field checks.

The two templates here are written for these tests in the conventions of the real families (Qwen3's
`<tool_call>` JSON with role "tool" results; Mistral's `[TOOL_CALLS]` list and 9-character call ids); the
generic format runs through the demo model's own template, which knows no tools.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from app.serve import fields as F
from app.serve.tools import Call, CallParser, Text, chat_messages, tool_request
from runtime import protocol as P
from runtime.constrained import Constraint, grammar_tokenizer
from runtime.grammars import tool_grammar
from runtime.tokenizer import Tokenizer
from runtime.tool_format import chat_inputs, detect

HERMES = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
Call a function as <tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'user' or (m.role == 'system' and not loop.first) %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% elif m.role == 'assistant' %}<|im_start|>assistant
{{ m.content }}{% for c in m.tool_calls or [] %}<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

MISTRAL = """{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}{% if loop.last and tools %}\
[AVAILABLE_TOOLS] {{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}[INST] {{ m.content }}[/INST]\
{% elif m.role == 'assistant' %}{% if m.tool_calls %}[TOOL_CALLS] [{% for c in m.tool_calls %}\
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}, "id": "{{ c.id }}"}\
{% if not loop.last %}, {% endif %}{% endfor %}]{% else %}{{ m.content }}{% endif %}{{ eos_token }}\
{% elif m.role == 'tool' %}{% if m.tool_call_id | length != 9 %}\
{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{% endif %}\
[TOOL_RESULTS] {"content": {{ m.content | tojson }}, "call_id": "{{ m.tool_call_id }}"}[/TOOL_RESULTS]\
{% endif %}{% endfor %}"""

WEATHER = P.Tool("get_weather", "Weather in a city", {"type": "object", "properties": {
    "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False})
TIME = P.Tool("get_time", "", {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]})
CONVERSATION = (
    P.ChatMessage("user", "Weather in Paris and Rome?"),
    P.ChatMessage("assistant", "", (P.ToolCall("call_abc123def456", "get_weather", '{"city": "Paris", "unit": "celsius"}'),
                                    P.ToolCall("call_xyz", "get_weather", '{"city": "Rome", "unit": "celsius"}'))),
    P.ChatMessage("tool", "18 C", tool_call_id="call_abc123def456"),
    P.ChatMessage("tool", "22 C", tool_call_id="call_xyz"),
)


def folder_with(tmp_path, demo_model, template):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo_model / name, tmp_path / name)
    (tmp_path / "chat_template.jinja").write_text(template)
    return Tokenizer.from_folder(tmp_path)


@pytest.fixture(scope="module")
def demo_tokenizer(demo_model):
    return Tokenizer.from_folder(demo_model)


def test_formats_come_from_the_template(demo_model):
    assert detect(HERMES) == "hermes" and detect(MISTRAL) == "mistral"
    assert detect((demo_model / "chat_template.jinja").read_text()) == "generic" and detect(None) == "generic"


def test_hermes_tools_and_calls_go_through_the_models_template(tmp_path, demo_model):
    tok = folder_with(tmp_path, demo_model, HERMES)
    assert tok.tool_format() == "hermes"
    messages, tools = chat_inputs(CONVERSATION, P.ToolRequest((WEATHER,)), "hermes")
    text = tok.render_chat(messages, tools=tools)
    assert '"name": "get_weather", "description": "Weather in a city"' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>' in text
    assert "<tool_response>\n18 C\n</tool_response>" in text and text.endswith("<|im_start|>assistant\n")
    messages, tools = chat_inputs(CONVERSATION[:1], P.ToolRequest((WEATHER,), "none"), "hermes")
    assert tools is None and "# Tools" not in tok.render_chat(messages, tools=tools)


def test_mistral_ids_are_mapped_the_same_for_call_and_result(tmp_path, demo_model):
    tok = folder_with(tmp_path, demo_model, MISTRAL)
    messages, tools = chat_inputs(CONVERSATION, P.ToolRequest((WEATHER,)), "mistral")
    text = tok.render_chat(messages, tools=tools)          # the template raises on any id not 9 characters
    ids = [c["id"] for c in messages[1]["tool_calls"]]
    assert all(len(i) == 9 and i.isalnum() for i in ids) and ids[0] != ids[1]
    assert [messages[2]["tool_call_id"], messages[3]["tool_call_id"]] == ids
    assert '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}' in text
    assert chat_inputs(CONVERSATION, None, "mistral")[0][1]["tool_calls"][0]["id"] == ids[0]    # stable


def test_generic_format_describes_tools_in_the_system_message(demo_tokenizer):
    messages, tools = chat_inputs((P.ChatMessage("system", "Be brief."),) + CONVERSATION,
                                  P.ToolRequest((WEATHER, TIME)), "generic")
    assert tools is None and messages[0]["role"] == "system"
    assert messages[0]["content"].startswith("Be brief.\n\nYou can call functions.") and '"get_time"' in messages[0]["content"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "unit": "celsius"}}\n</tool_call>' \
        in messages[2]["content"]
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]            # results: one turn
    assert messages[3]["content"] == "<tool_response>\n18 C\n</tool_response>\n<tool_response>\n22 C\n</tool_response>"
    text = demo_tokenizer.render_chat(messages)
    assert "You are a helpful AI assistant named SmolLM" not in text and "<tools>" in text


def accepts(tok, grammar: str, text: str) -> bool:
    c = Constraint.compile(grammar, grammar_tokenizer(tok, tok.vocab_size), tok.vocab_size)
    ids = tok.encode(text)
    if c.valid_prefix(ids) != len(ids):
        return False
    for t in ids:
        c.advance(t)
    return c.matcher.is_accepting()


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'


@pytest.mark.parametrize("choice, text, ok", [
    ("required", CALL, True),
    ("required", CALL + "\n" + CALL.replace("Paris", "Rome"), True),                  # parallel calls
    ("required", "Sure! " + CALL, False),                                            # nothing but calls
    ("required", CALL.replace('"celsius"', '"kelvin"'), False),                      # the schema's enum
    ("required", CALL.replace(', "unit": "celsius"', ""), False),                    # a required argument
    ("function", CALL + "\n" + CALL, False),                                         # one call of that function
    ("auto", "It is sunny.", True),
    ("auto", "Let me look. " + CALL + " Done.", True),
    ("auto", "Let me look. <tool_call>\n{\"name\": \"nope\"}\n</tool_call>", False),  # a call once begun is valid
])
def test_tool_grammars_take_valid_calls_only(demo_tokenizer, choice, text, ok):
    request = P.ToolRequest((WEATHER, TIME), choice, "get_weather" if choice == "function" else "")
    assert accepts(demo_tokenizer, tool_grammar("generic", request, demo_tokenizer.special_id), text) == ok


def test_mistral_grammar_and_nested_definitions(demo_tokenizer):
    nested = P.Tool("add_person", "", {"type": "object", "properties": {"person": {"$ref": "#/$defs/Person"}},
                                       "required": ["person"], "$defs": {"Person": {
                                           "type": "object", "properties": {"name": {"type": "string"}},
                                           "required": ["name"], "additionalProperties": False}}})
    grammar = tool_grammar("mistral", P.ToolRequest((WEATHER, nested), "required"), lambda _text: None)
    good = '[TOOL_CALLS] [{"name": "add_person", "arguments": {"person": {"name": "Ada"}}}]'
    assert accepts(demo_tokenizer, grammar, good)
    assert not accepts(demo_tokenizer, grammar, good.replace('"name": "Ada"', '"age": 3'))
    assert tool_grammar("hermes", P.ToolRequest((WEATHER,), "none"), lambda _text: None) is None


# --- the parser ----------------------------------------------------------------------------------------

def parse_in_pieces(fmt: str, text: str, cut: list[int]) -> list:
    parser, out, last = CallParser(fmt), [], 0
    for at in cut + [len(text)]:
        out += parser.feed(text[last:at])
        last = at
    return merged(out + parser.finish())


def merged(pieces: list) -> list:
    """Adjacent text joined, call ids left out (they are random): what the client ends up with."""
    out: list = []
    for p in pieces:
        if isinstance(p, Text) and out and isinstance(out[-1], str):
            out[-1] += p.text
        else:
            out.append(p.text if isinstance(p, Text) else (p.index, p.name, json.loads(p.arguments)))
    return out


ANSWERS = {
    "hermes": ("Voilà, café <tool_calx> first. " + CALL + "\n" + CALL.replace("Paris", "Zürich") + " done",
               ["Voilà, café <tool_calx> first. ", (0, "get_weather", {"city": "Paris", "unit": "celsius"}),
                (1, "get_weather", {"city": "Zürich", "unit": "celsius"}), " done"]),
    "mistral": ('[TOOL_CALLS] [{"name": "a", "arguments": {"x": "é"}}, {"name": "b", "arguments": "{\\"y\\": 2}"}]',
                [(0, "a", {"x": "é"}), (1, "b", {"y": 2})]),
}


@pytest.mark.parametrize("fmt", sorted(ANSWERS))
def test_parser_gives_the_same_at_every_split_position(fmt):
    text, want = ANSWERS[fmt]
    assert parse_in_pieces(fmt, text, []) == want
    for i in range(len(text) + 1):
        assert parse_in_pieces(fmt, text, [i]) == want, i
    for i in range(0, len(text), 7):
        assert parse_in_pieces(fmt, text, list(range(i, len(text), 3))) == want, i


def test_parser_drops_a_cut_call_and_keeps_a_bad_one_as_text():
    assert parse_in_pieces("hermes", "Hi " + CALL[:40], []) == ["Hi "]                  # cut by max_tokens
    bad = "<tool_call>\nnot json\n</tool_call> x"
    assert parse_in_pieces("generic", bad, []) == [bad]
    calls = [p for p in CallParser("hermes").feed(CALL) if isinstance(p, Call)]
    first, rest = calls[0].deltas()
    assert first["id"].startswith("call_") and first["function"] == {"name": "get_weather", "arguments": ""}
    assert json.loads(rest["function"]["arguments"]) == {"city": "Paris", "unit": "celsius"}


# --- the API's fields ----------------------------------------------------------------------------------

def fn(name, params=None):
    return {"type": "function", "function": {"name": name, "parameters": params or {"type": "object"}}}


@pytest.mark.parametrize("body, match", [
    ({"tools": [fn("a b")]}, r"tools\[0\].function.name"),
    ({"tools": [fn("a"), fn("a")]}, "same name"),
    ({"tools": [fn("a", {"type": "object", "not": {}})]}, r"tools\[0\].function.parameters: the grammar library"),
    ({"tools": [fn("a")], "tool_choice": {"type": "function", "function": {"name": "b"}}}, "not among the tools"),
    ({"tools": [fn("a")], "tool_choice": "always"}, "tool_choice"),
    ({"tool_choice": "required"}, "needs tools"),
])
def test_bad_tool_fields_say_which(body, match):
    with pytest.raises(F.BadField, match=match):
        tool_request(body)


def test_tool_messages_and_content_null():
    msgs = chat_messages({"messages": [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "18 C"}]})
    assert msgs[0] == P.ChatMessage("system", "Be brief.")
    assert msgs[2] == P.ChatMessage("assistant", "", (P.ToolCall("c1", "get_weather", '{"city": "Paris"}'),))
    assert msgs[3] == P.ChatMessage("tool", "18 C", (), "c1")
    with pytest.raises(F.BadField, match=r"messages\[0\].tool_call_id"):
        chat_messages({"messages": [{"role": "tool", "content": "x"}]})
    with pytest.raises(F.BadField, match=r"messages\[0\].content"):
        chat_messages({"messages": [{"role": "user", "content": None}]})


@pytest.mark.parametrize("call, match", [
    (lambda: F.json_schema({"response_format": {"type": "xml"}}), "response_format.type"),
    (lambda: F.json_schema({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "string", "pattern": "(?<=a)b"}}}}),
     "response_format.json_schema.schema: the grammar library cannot use it: .*look-around"),
    (lambda: F.logprobs({"logprobs": True, "top_logprobs": 21}, "chat"), "top_logprobs"),
    (lambda: F.logprobs({"top_logprobs": 2}, "chat"), "needs logprobs"),
    (lambda: F.logprobs({"logprobs": 6}, "completion"), "logprobs"),
    (lambda: F.penalties({"presence_penalty": 3}), "presence_penalty"),
    (lambda: F.penalties({"logit_bias": {"x": 1}}), "logit_bias"),
    (lambda: F.penalties({"logit_bias": {"5": 101}}), "logit_bias"),
    (lambda: F.context_policy({"context_overflow": "drop"}), "context_overflow"),
])
def test_bad_fields_say_which(call, match):
    with pytest.raises(F.BadField, match=match):
        call()


def test_fields_read_into_the_protocol():
    assert F.present({"n": None, "stream": None, "model": "m"}) == {"model": "m"}
    assert F.json_schema({"response_format": {"type": "json_object"}}) == {"type": "object"}
    assert F.json_schema({"response_format": {"type": "text"}}) is None
    assert F.logprobs({"logprobs": True}, "chat") == 0 and F.logprobs({}, "chat") is None
    assert F.penalties({"presence_penalty": 0, "logit_bias": {}}) is None
    assert F.penalties({"frequency_penalty": 0.5, "logit_bias": {"07": -100}}) == P.Penalties(0.0, 0.5, {"7": -100.0})
    assert F.context_policy({}) == "stop"
    lp = P.TokenLogprob("ab", -0.5, (97, 98), (P.TopLogprob("ab", -0.5, (97, 98)),))
    assert F.completion_logprobs([lp, lp], 3)["text_offset"] == [3, 5]
    assert F.chat_logprobs([lp])["content"][0]["top_logprobs"][0] == {"token": "ab", "logprob": -0.5, "bytes": [97, 98]}
    assert torch is not None
