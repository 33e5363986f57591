"""The protocol boundary: every message round-trips, and every malformed line gets a stable code."""
from __future__ import annotations

import json

import pytest

from runtime import protocol as P
from runtime.options import DraftOptions, LoadOptions, OffloadOptions, SamplingOptions

MESSAGES = [
    P.Hello(client="test"),
    P.Load(request_id="r1", model="demo",
           options=LoadOptions(offload=OffloadOptions(vram_budget_gb=24.0, kv_cache="q4"),
                               draft=DraftOptions(mode="ngram", draft_tokens=3))),
    P.Unload(request_id="r2"),
    P.Generate(request_id="r3", messages=(P.ChatMessage("system", "Be brief."), P.ChatMessage("user", "Hi ✓")),
               sampling=SamplingOptions(temperature=0.0, seed=7, stop=("\n\n",))),
    P.Generate(request_id="r4", prompt="raw text"),
    P.Cancel(request_id="r3"),
    P.Stats(request_id="r5"),
    P.Shutdown(),
    P.Ready(protocol_version=1, worker_version="0.1.0", pid=12, engine="cpu",
            engine_note="No CUDA device: using the CPU reference engine.", device="cpu"),
    P.Progress(request_id="r1", stage="loading", message="Loading layer 3 of 30", done=3, total=30),
    P.Loaded(request_id="r1", model="demo", path="x", architecture="LlamaForCausalLM", backend="cpu",
             context_length=4096, vocab_size=49152, load_s=1.5, applied={"offload.kv_cache": "ignored: CPU"}),
    P.Unloaded(request_id="r2"),
    P.TokenDelta(request_id="r3", text="Pa", tokens=2),
    P.Finished(request_id="r3", reason="eos",
               stats=P.GenerationStats(prompt_tokens=10, generated_tokens=8, ttft_s=0.1, prefill_tps=100.0,
                                       decode_tps=50.0, total_s=0.3,
                                       draft=P.DraftStats(mode="ngram", drafted_tokens=4, accepted_tokens=2,
                                                          acceptance_rate=0.5, verify_forwards=1,
                                                          verify_rows_mean=5.0, verify_step_s_mean=0.03,
                                                          plain_steps=3, plain_step_s_mean=0.01,
                                                          decisions=("step 0: measuring plain decoding (K 4)",)))),
    P.Telemetry(request_id="r3", decode_tps=51.5, rss_bytes=123, extra={"layers": {"0": "gpu"}}),
    P.Error(code=P.ErrorCode.NO_MODEL.value, message="No model is loaded.", request_id="r3"),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: m.type)
def test_round_trip(msg):
    line = P.encode(msg)
    assert line.endswith("\n") and "\n" not in line[:-1]
    decode = P.decode_command if msg.type in P.COMMANDS else P.decode_event
    assert decode(line) == msg


@pytest.mark.parametrize("line,code,needle", [
    ("{not json", P.ErrorCode.BAD_JSON, "not valid JSON"),
    ("[1, 2]", P.ErrorCode.BAD_JSON, "JSON object"),
    ('{"type": "fly"}', P.ErrorCode.UNKNOWN_COMMAND, "unknown command 'fly'"),
    ('{"type": "load", "request_id": "a"}', P.ErrorCode.BAD_FIELD, "load.model: missing"),
    ('{"type": "load", "request_id": "a", "model": 5}', P.ErrorCode.BAD_FIELD, "load.model: expected text"),
    ('{"type": "cancel", "request_id": "a", "extra": 1}', P.ErrorCode.BAD_FIELD, "unknown field(s) extra"),
    ('{"type": "generate", "request_id": "a", "sampling": {"top_p": 2}}', P.ErrorCode.BAD_FIELD,
     "generate.sampling.top_p: 2.0 is above the maximum 1.0"),
    ('{"type": "generate", "request_id": "a", "sampling": {"temprature": 1}}', P.ErrorCode.BAD_FIELD,
     "unknown option(s) temprature"),
    ('{"type": "generate", "request_id": "a", "messages": [{"role": "user"}]}', P.ErrorCode.BAD_FIELD,
     "generate.messages[0].content: missing"),
    ('{"type": "load", "request_id": "a", "model": "m", "options": {"offload": {"kv_cache": "q3"}}}',
     P.ErrorCode.BAD_FIELD, "'q3' is not one of fp16, q8, q6, q4"),
    ('{"v": 99, "type": "hello"}', P.ErrorCode.VERSION_MISMATCH, "protocol version 99"),
])
def test_bad_lines_get_stable_codes(line, code, needle):
    with pytest.raises(P.ProtocolError) as e:
        P.decode_command(line)
    assert e.value.code == code
    assert needle in e.value.message


def test_request_id_survives_a_bad_field():
    with pytest.raises(P.ProtocolError) as e:
        P.decode_command(json.dumps({"type": "generate", "request_id": "abc", "sampling": {"top_k": "x"}}))
    assert e.value.request_id == "abc"


def test_error_codes_map_back_to_exceptions():
    exc = P.exception_for(P.Error(code="out_of_memory", message="VRAM full", detail="12 GB free"))
    assert isinstance(exc, P.OutOfMemoryError) and exc.detail == "12 GB free"
    assert isinstance(P.exception_for(P.Error(code="model_invalid", message="m")), P.ModelLoadError)
    assert type(P.exception_for(P.Error(code="something_new", message="m"))) is P.WorkerError


def test_protocol_and_options_do_not_import_torch():
    import subprocess
    import sys
    code = "import runtime.protocol, runtime.options, runtime.paths, runtime.engine, sys; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_encode_always_gives_utf8_even_for_lone_surrogates():
    """Text echoed from a hostile line may hold lone surrogates: escaped, never an encoding failure."""
    line = P.encode(P.Error(code="bad_field", message="unknown \udcff", request_id="\ud800"))
    line.encode("utf-8")
    body = json.loads(line)
    assert body["message"] == "unknown \udcff" and body["request_id"] == "\ud800"


def test_deep_nesting_and_surrogates_are_named_errors():
    with pytest.raises(P.ProtocolError) as e:
        P.decode_command('{"type": "hello", "client": ' + "[" * 100_000 + "]" * 100_000 + "}")
    assert e.value.code == P.ErrorCode.BAD_JSON and "nested" in e.value.message
    with pytest.raises(P.ProtocolError) as e:
        P.decode_command('{"type": "cancel", "request_id": "\\udcff"}')
    assert e.value.code == P.ErrorCode.BAD_FIELD and "cancel.request_id" in e.value.message
    assert e.value.request_id is None
