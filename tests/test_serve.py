"""`moedesk serve` with the demo model on the CPU, through the official `openai` client and raw HTTP.

One server for the whole module (loading the demo model is the slow part); answers are short and greedy.
"""
from __future__ import annotations

import asyncio
import re
import signal
import threading

import httpx
import openai
import pytest

from app.serve.api import EngineQueue, QueueFull
from tests import serve_process

pytestmark = pytest.mark.slow

KEY = "test-key-123"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(demo_model, tmp_path_factory):
    proc, line, log = serve_process.start(demo_model, tmp_path_factory.mktemp("serve-home"), "--api-key", KEY,
                                          "--max-queue", "8")
    url = line.split(" at ")[1].strip()
    yield url, log, line.split()[1]
    proc.send_signal(signal.SIGINT)             # Ctrl+C: a clean stop, the worker ended with it
    assert proc.wait(30) == 0, log.read_text()


@pytest.fixture
def client(server):
    url, _, _ = server
    return openai.OpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=120)


def ask(client, model, **kw):
    return client.chat.completions.create(model=model, messages=QUESTION, temperature=0, **kw)


def test_models_plain_and_streaming_agree(server, client):
    _, _, model = server
    assert [m.id for m in client.models.list().data] == [model]

    plain = ask(client, model, max_tokens=12)
    text = plain.choices[0].message.content
    assert "Paris" in text and plain.choices[0].finish_reason == "stop"
    assert plain.usage.prompt_tokens > 10
    assert plain.usage.total_tokens == plain.usage.prompt_tokens + plain.usage.completion_tokens

    chunks = list(ask(client, model, max_tokens=12, stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) >= 3
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == plain.usage.prompt_tokens


def test_length_stop_strings_and_completions(server, client):
    _, _, model = server
    short = ask(client, model, max_tokens=3)
    assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 3

    stopped = ask(client, model, max_tokens=12, stop=["Paris"])
    assert stopped.choices[0].finish_reason == "stop"
    assert "Paris" not in stopped.choices[0].message.content
    assert stopped.choices[0].message.content.startswith("The capital of France is")

    done = client.completions.create(model=model, prompt="The capital of France is", max_tokens=4, temperature=0)
    assert done.object == "text_completion" and done.usage.completion_tokens == 4
    assert done.choices[0].text.strip()


def test_errors_in_openais_shape(server, client):
    url, _, model = server
    with pytest.raises(openai.NotFoundError) as e:
        ask(client, "no-such-model", max_tokens=2)
    assert e.value.body["code"] == "model_not_found"
    for key in ("wrong", None):
        bad = openai.OpenAI(base_url=url, api_key=key or "x", max_retries=0,
                            default_headers={} if key else {"Authorization": ""})
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
    r = httpx.post(f"{url}/chat/completions", content=b"{not json", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = httpx.post(f"{url}/chat/completions", json={"model": model, "messages": QUESTION, "n": 2},
                   headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    r = httpx.post(f"{url}/chat/completions", content=b"x" * (5 << 20), headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 413
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, max_tokens=2,
                                       messages=[{"role": "user", "content": "word " * 5000}])
    assert e.value.body["code"] == "context_length_exceeded"


def test_client_leaving_mid_stream_cancels_and_the_worker_answers_the_next(server, client):
    url, log, model = server
    stream = ask(client, model, max_tokens=400, stream=True)
    got = [next(iter(stream)) for _ in range(3)]
    assert got
    stream.close()
    again = ask(client, model, max_tokens=12)          # the worker is free again and answers
    assert "Paris" in again.choices[0].message.content
    text = log.read_text()
    assert "client went away; cancelling" in text
    stopped = re.search(r"the engine stopped \(cancelled\) after (\d+) tokens", text)
    assert stopped and int(stopped.group(1)) < 400, text


def test_concurrent_clients_are_queued_and_none_lost(server, client):
    _, _, model = server
    answers, errors = [], []

    def one(i):
        try:
            answers.append(ask(client, model, max_tokens=6, seed=i).choices[0].message.content)
        except Exception as e:          # noqa: BLE001 - collected for the assertion
            errors.append(e)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors and len(answers) == 4
    assert len(set(answers)) == 1      # greedy: the same answer, whatever the order


def test_queue_refuses_beyond_its_bound():
    async def scenario():
        q = EngineQueue(max_waiting=1)
        order = []

        async def hold(name, seconds):
            async with q.slot():
                order.append(name)
                await asyncio.sleep(seconds)
        first = asyncio.create_task(hold("a", 0.2))
        await asyncio.sleep(0.01)
        second = asyncio.create_task(hold("b", 0))
        await asyncio.sleep(0.01)
        with pytest.raises(QueueFull):
            async with q.slot():
                pass
        await asyncio.gather(first, second)
        assert order == ["a", "b"] and q.waiting == 0
    asyncio.run(scenario())


# ---- the app's remote engine against this server, through the GUI --------------------------------

def test_the_app_chats_with_a_remote_server_through_the_gui(qtbot, server):
    from PySide6.QtCore import Qt

    from app.main import build, use_remote
    from app.serve.remote import RemoteConfig
    from app.settings import Settings
    from runtime.options import SamplingOptions

    url, _, model = server
    desk = build(Settings(sampling=SamplingOptions(temperature=0.0, max_tokens=12)), model=None)
    qtbot.addWidget(desk.window)
    try:
        use_remote(desk, RemoteConfig(url, model, "wrong-key"))
        qtbot.waitUntil(lambda: "refused the API key" in desk.window.banner.headline.text(), timeout=30000)

        use_remote(desk, RemoteConfig(url, model, KEY))
        qtbot.waitUntil(lambda: desk.window.loaded is not None, timeout=30000)
        assert "Remote server" in desk.window.banner.headline.text()
        assert desk.gauges.note_text("vram") == "not available for a remote engine"

        desk.window.chat.input.setPlainText("What is the capital of France?")
        qtbot.keyClick(desk.window.chat.input, Qt.Key.Key_Return)
        qtbot.waitUntil(lambda: not desk.session.busy, timeout=120000)
        answer = desk.session.model.items[-1]
        assert answer.state == "done" and "Paris" in answer.content, answer.error
        assert answer.stats.ttft_s > 0 and answer.stats.generated_tokens > 3
        assert desk.gauges.value_text("ttft") != "—"

        assert desk.session.regenerate()
        qtbot.waitUntil(lambda: not desk.session.busy, timeout=120000)
        assert desk.session.model.items[-1].content == answer.content       # greedy: the same again

        desk.session.default_sampling = SamplingOptions(temperature=0.0, max_tokens=400)
        desk.session.send("Tell me a long story about a dragon.")
        qtbot.waitUntil(lambda: len(desk.session.model.items[-1].content) > 10, timeout=120000)
        desk.window.chat.escape()                                            # Stop
        qtbot.waitUntil(lambda: not desk.session.busy, timeout=30000)
        stopped = desk.session.model.items[-1]
        assert stopped.state == "cancelled" and stopped.content
        exported = desk.store.export_markdown(desk.session.conversation.id)
        assert answer.content in exported and stopped.content in exported
        # The server cancelled that generation and answers the next question.
        desk.session.default_sampling = SamplingOptions(temperature=0.0, max_tokens=12)
        desk.session.send("What is the capital of France?")
        qtbot.waitUntil(lambda: not desk.session.busy, timeout=120000)
        assert "Paris" in desk.session.model.items[-1].content
    finally:
        desk.window.close()
        desk.gauges.timer.stop()
        desk.store.close()
