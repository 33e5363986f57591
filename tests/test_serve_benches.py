"""The serve benchmarks' machinery: the paced token source streamed through the real API stack (uvicorn,
Starlette, server-sent events, the `openai` client), and the side-by-side comparison on one worker.
No timing is asserted: what is checked is that every token arrives, in order, and that the figures exist."""
from __future__ import annotations

import argparse

import openai
import pytest

from bench.serve_load import ApiInThread
from bench.serve_overhead import PacedBackend, expected_text, stream, without_http


@pytest.fixture
def paced_api():
    servers = []

    def start(rate: float):
        api = ApiInThread(PacedBackend(rate))
        servers.append(api)
        return openai.OpenAI(base_url=api.url, api_key=api.key, max_retries=0, timeout=60)
    yield start
    for api in servers:
        api.stop()


@pytest.mark.parametrize("rate,tokens", [(0, 800), (4000, 200)])
def test_the_paced_stream_delivers_every_token_in_order(paced_api, rate, tokens):
    got = stream(paced_api(rate), tokens)
    assert got["text"] == expected_text(tokens)
    assert got["chunks"] == tokens                      # one chunk per token delta: none merged, none lost
    assert got["completion_tokens"] == tokens
    assert got["client_tps"] > 0


def test_without_http_counts_every_token():
    floor = without_http(0, 300)
    assert floor["tokens"] == 300 and floor["cpu_us_per_token"] >= 0


@pytest.mark.slow
def test_side_by_side_measures_both_paths_on_one_worker(demo_model):
    from bench.serve_vs_chat import side_by_side
    args = argparse.Namespace(model=str(demo_model), backend="cpu", vram_budget=None, max_tokens=6, pairs=2)
    run = side_by_side(args)
    assert [p["first"] for p in run["pairs"]] == ["direct", "api"]
    assert run["error"] is None and run["request"]["temperature"] == 0.0
    for pair in run["pairs"]:
        direct, api = pair["direct"], pair["api"]
        assert direct["completion_tokens"] == api["completion_tokens"] > 1     # the same request, greedy
        for answer in (direct, api):
            assert answer["decode_tps_client"] > 0 and answer["decode_tps_worker"] > 0 and answer["ttft_s"] > 0
