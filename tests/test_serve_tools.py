"""What agents and libraries need from `moedesk serve`, against a real server with the demo model on the CPU:
tool calls and structured output through the official `openai` client and through langchain-openai
(`bind_tools`, `with_structured_output(method="json_schema")`), streaming and not; logprobs, penalties,
logit_bias, null fields, GET /v1/models/{id} and aliases, conversations over the context, fair turns
between clients, request logs on stderr and a clean Ctrl+C.

The demo model (SmolLM2-135M) knows no tools: its template gets the generic tool prompt, and forced calls
come out right because the worker's grammar allows nothing else. Answers are greedy and short.
"""
from __future__ import annotations

import json
import threading
import time

import httpx
import jsonschema
import openai
import pytest

from tests.serve_fixtures import no_end_of_answer, running_server

pytestmark = pytest.mark.slow

WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"},
                                                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                  "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city now.",
                                           "parameters": WEATHER_SCHEMA}},
         {"type": "function", "function": {"name": "get_time", "description": "The time in a time zone.",
                                           "parameters": {"type": "object", "properties": {"zone": {"type": "string"}},
                                                          "required": ["zone"]}}}]
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
                                           "hobbies": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
          "required": ["name", "age", "hobbies"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(demo_model, tmp_path_factory):
    with running_server(demo_model, tmp_path_factory.mktemp("serve-tools-home"), quiet_stdout=True) as started:
        url, log, _ = started
        yield url, log
    text = log.read_text()
    assert '"POST /v1/chat/completions HTTP/1.1" 200' in text          # request lines: on stderr
    assert "engine process ended" not in text and "restart the server" not in text, text


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server[0], api_key="none", max_retries=0, timeout=300)


def chat(client, **kw):
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 80)
    return client.chat.completions.create(model="demo", **kw)


def streamed(chunks) -> tuple[str, dict, list]:
    """Content, tool calls by index (merged as OpenAI's clients merge them), finish reasons."""
    text, calls, finishes = "", {}, []
    for c in chunks:
        if not c.choices:
            continue
        d = c.choices[0].delta
        text += d.content or ""
        for t in d.tool_calls or []:
            call = calls.setdefault(t.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = call["id"] or t.id
            call["name"] += (t.function.name or "") if t.function else ""
            call["arguments"] += (t.function.arguments or "") if t.function else ""
        if c.choices[0].finish_reason:
            finishes.append(c.choices[0].finish_reason)
    return text, calls, finishes


# --- tool calls ------------------------------------------------------------------------------------

@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_a_forced_tool_call_parses_with_valid_arguments(client, choice):
    r = chat(client, messages=ASK_WEATHER, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content is None and len(msg.tool_calls) == 1
    call = msg.tool_calls[0]
    assert call.id.startswith("call_") and call.type == "function" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_SCHEMA)

    text, calls, finishes = streamed(chat(client, messages=ASK_WEATHER, tools=TOOLS, tool_choice=choice,
                                          parallel_tool_calls=False, stream=True))
    assert text == "" and finishes == ["tool_calls"] and list(calls) == [0]
    assert calls[0]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    assert json.loads(calls[0]["arguments"]) == json.loads(call.function.arguments)


def test_tool_results_go_back_to_the_model(client):
    first = chat(client, messages=ASK_WEATHER, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    call = first.choices[0].message.tool_calls[0]
    history = ASK_WEATHER + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18, "sky": "clear"}'}]
    r = chat(client, messages=history, tools=TOOLS, tool_choice="none", max_tokens=40)
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls
    bare = chat(client, messages=ASK_WEATHER, tools=TOOLS, tool_choice="none", max_tokens=1)
    assert r.usage.prompt_tokens > bare.usage.prompt_tokens + 20       # the call and its result were in the prompt


def test_tool_choice_auto_answers_text_or_valid_calls(client):
    r = chat(client, messages=ASK_WEATHER, tools=TOOLS)
    msg = r.choices[0].message
    for call in msg.tool_calls or []:
        assert call.function.name in ("get_weather", "get_time")
        json.loads(call.function.arguments)
    assert msg.tool_calls or msg.content


def test_langchain_bind_tools_and_structured_output(server):
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class GetWeather(BaseModel):
        """The weather in a city now."""
        city: str = Field(description="the city")
        unit: str = Field(description="celsius or fahrenheit")

    class Person(BaseModel):
        name: str
        age: int

    llm = ChatOpenAI(base_url=server[0], api_key="none", model="demo", temperature=0, max_tokens=80, max_retries=0,
                     timeout=300)
    bound = llm.bind_tools([GetWeather], tool_choice="GetWeather")
    msg = bound.invoke("What is the weather in Paris?")
    assert [c["name"] for c in msg.tool_calls] == ["GetWeather"] and isinstance(msg.tool_calls[0]["args"]["city"], str)
    chunks = list(bound.stream("What is the weather in Paris?"))
    merged = chunks[0]
    for c in chunks[1:]:
        merged = merged + c
    assert merged.tool_calls[0]["name"] == "GetWeather" and merged.tool_calls[0]["args"] == msg.tool_calls[0]["args"]

    structured = llm.with_structured_output(Person, method="json_schema")
    person = structured.invoke("Invent a person.")
    assert isinstance(person, Person) and person.name
    assert list(structured.stream("Invent a person."))[-1] == person


# --- structured output -------------------------------------------------------------------------------

def test_schema_constrained_answers_validate(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    ask = [{"role": "user", "content": "Tell me about a person."}]
    r = chat(client, messages=ask, response_format=fmt, max_tokens=120)
    assert r.choices[0].finish_reason == "stop"
    plain = json.loads(r.choices[0].message.content)
    jsonschema.validate(plain, PERSON)
    text, _, finishes = streamed(chat(client, messages=ask, response_format=fmt, max_tokens=120, stream=True))
    assert json.loads(text) == plain and finishes == ["stop"]
    any_object = chat(client, messages=ask, response_format={"type": "json_object"}, max_tokens=120)
    assert isinstance(json.loads(any_object.choices[0].message.content), dict)

    from pydantic import BaseModel

    class Person(BaseModel):                         # docs/api.md's example: the client's own parse()
        name: str
        age: int
    parsed = client.chat.completions.parse(model="demo", response_format=Person, messages=ask, temperature=0,
                                           max_tokens=120)
    assert isinstance(parsed.choices[0].message.parsed, Person)


def test_a_schema_the_library_cannot_compile_is_a_400_naming_the_part(client):
    bad = {"type": "object", "properties": {"a": {"type": "string", "pattern": "(?=x)"}}}
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, messages=ASK_WEATHER, response_format={"type": "json_schema",
                                                            "json_schema": {"name": "x", "schema": bad}})
    assert e.value.body["param"] == "response_format"
    assert "response_format.json_schema.schema" in e.value.body["message"] and "look-around" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, messages=ASK_WEATHER, tools=[{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object", "properties": {"x": {"$ref": "#/nowhere"}}}}}])
    assert "tools[0].function.parameters" in e.value.body["message"]


# --- logprobs, penalties, logit_bias -------------------------------------------------------------------

def test_logprobs_in_chat_and_completions(client, server):
    r = chat(client, messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=8,
             logprobs=True, top_logprobs=3)
    items = r.choices[0].logprobs.content
    assert len(items) == r.usage.completion_tokens
    assert "".join(t.token for t in items) == r.choices[0].message.content
    for t in items:
        assert t.logprob <= 0 and len(t.top_logprobs) == 3 and t.top_logprobs[0].logprob >= t.logprob - 1e-6
        assert bytes(t.bytes).decode() == t.token
    chunks = list(chat(client, messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=8,
                       logprobs=True, top_logprobs=3, stream=True))
    again = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [(t.token, round(t.logprob, 4)) for t in again] == [(t.token, round(t.logprob, 4)) for t in items]
    done = client.completions.create(model="demo", prompt="The capital of France is", max_tokens=4, temperature=0,
                                     logprobs=2)
    lp = done.choices[0].logprobs
    assert len(lp.tokens) == 4 and "".join(lp.tokens) == done.choices[0].text and len(lp.top_logprobs[0]) == 2
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]


def test_logit_bias_and_penalties(client, demo_model):
    from runtime.tokenizer import Tokenizer
    tok = Tokenizer.from_folder(demo_model)
    ask = [{"role": "user", "content": "What is the capital of France?"}]
    assert "Paris" in chat(client, messages=ask, max_tokens=12).choices[0].message.content
    banned = {str(t): -100 for t in set(tok.encode(" Paris") + tok.encode("Paris"))}
    assert "Paris" not in chat(client, messages=ask, max_tokens=12, logit_bias=banned).choices[0].message.content
    story = [{"role": "user", "content": "Tell me a story about a dragon."}]
    plain = chat(client, messages=story, max_tokens=60).choices[0].message.content
    assert plain.count("dragon") >= 2                                # greedy says "dragon" again...
    penalised = chat(client, messages=story, max_tokens=60, frequency_penalty=2.0, presence_penalty=1.0)
    assert penalised.choices[0].message.content.count("dragon") == 1  # ...penalised, once


# --- the small things: nulls, model ids -----------------------------------------------------------------

def test_null_fields_count_as_absent(server):
    body = {"model": "demo", "messages": ASK_WEATHER, "max_tokens": 4, "temperature": 0, "n": None, "stream": None,
            "stop": None, "top_p": None, "tools": None, "tool_choice": None, "response_format": None,
            "logprobs": None, "seed": None, "stream_options": None, "presence_penalty": None}
    r = httpx.post(f"{server[0]}/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"]


def test_one_model_id_with_aliases(server, client, demo_model):
    listed = client.models.list().data
    assert [m.id for m in listed] == [demo_model.name] and "demo" in listed[0].model_extra["aliases"]
    for name in (demo_model.name, "demo"):
        got = httpx.get(f"{server[0]}/models/{name}", timeout=30)
        assert got.status_code == 200 and got.json()["id"] == demo_model.name
    assert client.models.retrieve("demo").id == demo_model.name
    missing = httpx.get(f"{server[0]}/models/other", timeout=30)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    assert chat(client, messages=ASK_WEATHER, max_tokens=2).model == demo_model.name


# --- never dropping turns in silence ------------------------------------------------------------------

def turns(n: int, words: int) -> list[dict]:
    out = []
    for i in range(n):
        out += [{"role": "user", "content": f"Note {i}: " + "apple " * words},
                {"role": "assistant", "content": f"Noted {i}."}]
    return out + [{"role": "user", "content": "How many notes did I give you?"}]


def test_a_conversation_over_the_context_is_refused_unless_allowed(client):
    long = turns(12, 400)                                       # ~4,900 tokens: over the demo's 4,096
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, messages=long, max_tokens=4)
    assert e.value.body["code"] == "context_length_exceeded"
    r = chat(client, messages=long, max_tokens=4, extra_body={"context_overflow": "rolling"})
    assert r.usage.model_extra["dropped_messages"] > 0


def test_left_out_max_tokens_keeps_every_turn(client):
    fits = turns(6, 400)                                        # ~2,500 tokens: over half the context
    one = chat(client, messages=fits, max_tokens=1)
    whole = client.chat.completions.create(model="demo", messages=fits, temperature=0)     # no max_tokens
    assert whole.usage.prompt_tokens == one.usage.prompt_tokens
    assert "dropped_messages" not in (whole.usage.model_extra or {})


# --- fair turns ------------------------------------------------------------------------------------------

def test_a_short_request_is_not_stuck_behind_a_long_one(client, demo_model):
    eos = no_end_of_answer(demo_model)                                              # the long one never stops early
    done: dict = {}

    def long_answer():
        text, n = "", 0
        for c in chat(client, messages=[{"role": "user", "content": "Tell me a long story about a dragon."}],
                      max_tokens=160, logit_bias=eos, stream=True, stream_options={"include_usage": True}):
            if c.choices:
                text += c.choices[0].delta.content or ""
                n += 1
                done.setdefault("long_started", time.monotonic())
            elif c.usage:
                done["long_usage"] = c.usage.completion_tokens
        done["long"] = time.monotonic()
    worker = threading.Thread(target=long_answer)
    worker.start()
    deadline = time.monotonic() + 300
    while "long_started" not in done and time.monotonic() < deadline:
        time.sleep(0.1)
    short = chat(client, messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=4)
    done["short"] = time.monotonic()
    worker.join(600)
    assert short.choices[0].message.content
    assert done["short"] < done["long"], "the short request waited for the whole long answer"
    assert done["long_usage"] == 160                            # the long answer's turns add up to one answer
