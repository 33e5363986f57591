"""The API's newer request fields, read into the protocol's terms, and log-probabilities shaped as OpenAI's.

    present(body)                -> the body less fields sent as null (OpenAI's clients send "n": null etc.)
    json_schema(body)            -> response_format as a JSON schema for the worker's grammar (or None)
    logprobs(body, kind)         -> how many alternatives per token (None: no logprobs)
    penalties(body)              -> presence / frequency penalties and logit_bias (or None when neutral)
    context_policy(body)         -> "stop" unless the client allows turns to be left out (an extension field)

Each raises BadField (message and the field's name) for a bad value; the API answers it with 400.
"""
from __future__ import annotations

from typing import Any, Optional

from runtime import protocol as P
from runtime.grammars import GrammarError, check_schema

MAX_TOP_LOGPROBS = {"chat": 20, "completion": 5}
MAX_LOGIT_BIAS = 300
CONTEXT_POLICIES = ("stop", "rolling", "keep_first")


class BadField(ValueError):
    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def present(body: dict) -> dict:
    return {k: v for k, v in body.items() if v is not None}


def json_schema(body: dict) -> Optional[dict]:
    fmt = body.get("response_format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind != "json_schema":
        raise BadField("response_format.type: \"text\", \"json_object\" or \"json_schema\"", "response_format")
    spec = fmt.get("json_schema")
    schema = spec.get("schema", {}) if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        raise BadField("response_format.json_schema.schema: expected a JSON schema object", "response_format")
    try:
        check_schema(schema, "response_format.json_schema.schema")
    except GrammarError as e:
        raise BadField(str(e), "response_format") from None
    return schema


def logprobs(body: dict, kind: str) -> Optional[int]:
    """Chat: `logprobs: true` with `top_logprobs` 0-20; completions: `logprobs` 0-5 (the alternatives)."""
    most = MAX_TOP_LOGPROBS[kind]
    if kind == "completion":
        value = body.get("logprobs")
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= most:
            raise BadField(f"logprobs: a whole number from 0 to {most}", "logprobs")
        return value
    on, top = body.get("logprobs", False), body.get("top_logprobs")
    if not isinstance(on, bool):
        raise BadField("logprobs: expected true or false", "logprobs")
    if top is not None:
        if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= most:
            raise BadField(f"top_logprobs: a whole number from 0 to {most}", "top_logprobs")
        if not on:
            raise BadField("top_logprobs: needs logprobs: true", "top_logprobs")
    return (top or 0) if on else None


def _number(body: dict, name: str, low: float, high: float) -> float:
    value = body.get(name, 0)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise BadField(f"{name}: a number from {low:g} to {high:g}", name)
    return float(value)


def penalties(body: dict) -> Optional[P.Penalties]:
    presence = _number(body, "presence_penalty", -2, 2)
    frequency = _number(body, "frequency_penalty", -2, 2)
    bias = body.get("logit_bias") or {}
    if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS:
        raise BadField(f"logit_bias: an object of at most {MAX_LOGIT_BIAS} token ids to numbers", "logit_bias")
    out = {}
    for key, value in bias.items():
        if not key.isdigit() or isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not -100 <= value <= 100:
            raise BadField(f"logit_bias[{key!r}]: a token id mapped to a number from -100 to 100", "logit_bias")
        out[str(int(key))] = float(value)
    if not presence and not frequency and not out:
        return None
    return P.Penalties(presence, frequency, out)


def context_policy(body: dict) -> str:
    """What to do with a conversation over the context: "stop" (context_length_exceeded), unless the
    request's extension field `context_overflow` allows "rolling" or "keep_first" (turns left out, counted
    in `usage.dropped_messages`)."""
    value = body.get("context_overflow", "stop")
    if value not in CONTEXT_POLICIES:
        raise BadField(f"context_overflow: one of {', '.join(CONTEXT_POLICIES)}", "context_overflow")
    return value


# ----------------------------------------------------------------------------------------------
# Log-probabilities in OpenAI's shapes

def chat_logprobs(items: list[P.TokenLogprob]) -> dict:
    return {"content": [{"token": t.token, "logprob": t.logprob, "bytes": list(t.bytes),
                         "top_logprobs": [{"token": a.token, "logprob": a.logprob, "bytes": list(a.bytes)}
                                          for a in t.top]} for t in items], "refusal": None}


def completion_logprobs(items: list[P.TokenLogprob], offset: int = 0) -> dict:
    """The legacy shape: parallel lists, and text_offset counted from `offset` (the text so far)."""
    offsets = []
    for t in items:
        offsets.append(offset)
        offset += len(t.token)
    return {"tokens": [t.token for t in items], "token_logprobs": [t.logprob for t in items],
            "top_logprobs": [{a.token: a.logprob for a in t.top} for t in items], "text_offset": offsets}


def shaped(kind: str, items: list[Any], offset: int = 0) -> Optional[dict]:
    return chat_logprobs(items) if kind == "chat" else completion_logprobs(items, offset)
