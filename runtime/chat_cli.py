"""moedesk-cli chat: ask a model one question through a real worker process, streaming the answer.

    moedesk-cli chat --model NAME_OR_DIR [--temperature T] [--max-tokens N] [--seed S]
                     [--draft none|ngram|mtp|DIR] [--draft-tokens K] [--vram-budget GB] [--cpu-threads N] [--json] PROMPT

Exit status 0 on success; otherwise one line on stderr saying what went wrong, and status 1
(2 for bad arguments, as argparse does).
"""
from __future__ import annotations

import argparse
import sys

from runtime import protocol as P
from runtime.options import DraftOptions, LoadOptions, OffloadOptions, OptionError, SamplingOptions, from_dict


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """The model and how to load it (shared with `moedesk serve`)."""
    p.add_argument("--model", required=True, help="model name in the models folder, 'demo', or a folder path")
    p.add_argument("--draft", default="none",
                   help="speculative decoding: none, ngram, mtp (the model's own head: Qwen3.5-MoE), or a draft "
                        "model folder/name")
    p.add_argument("--draft-tokens", type=int, help="tokens drafted ahead per step")
    p.add_argument("--vram-budget", type=float, metavar="GB", help="GPU memory the engine may use")
    p.add_argument("--backend", choices=("auto", "cuda", "cpu"), default="auto", help="engine backend")
    p.add_argument("--cpu-threads", type=int, help="CPU threads of the engine (default 0: automatic)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_arguments(p)
    p.add_argument("--temperature", type=float, help="sampling temperature (0 = greedy)")
    p.add_argument("--max-tokens", type=int, help="longest answer in tokens")
    p.add_argument("--seed", type=int, help="random seed for reproducible sampling")
    p.add_argument("--system", help="a system message before the question")
    p.add_argument("--json", action="store_true", help="print every worker event as a JSON line instead of text")
    p.add_argument("prompt", help="the question")


def draft_options(draft: str, draft_tokens: int | None) -> DraftOptions:
    """`--draft none|ngram|mtp|DIR` and `--draft-tokens K` as validated draft options (chat and bench)."""
    fields: dict = {}
    if draft in ("ngram", "mtp"):
        fields["mode"] = draft
    elif draft not in ("none", "off", ""):
        fields.update(mode="model", model=draft)
    if draft_tokens is not None:
        fields["draft_tokens"] = draft_tokens
    return from_dict(DraftOptions, fields, "draft")


def load_options(args: argparse.Namespace) -> LoadOptions:
    """The engine flags (`add_engine_arguments`) as validated load options."""
    offload = {"backend": args.backend}
    if args.vram_budget is not None:
        offload["vram_budget_gb"] = args.vram_budget
    if args.cpu_threads is not None:
        offload["cpu_threads"] = args.cpu_threads
    return LoadOptions(offload=from_dict(OffloadOptions, offload, "offload"),
                       draft=draft_options(args.draft, args.draft_tokens))


def build_options(args: argparse.Namespace) -> tuple[LoadOptions, SamplingOptions]:
    """The flags as validated option dataclasses (an OptionError names a bad one)."""
    load = load_options(args)
    sampling = {k: v for k, v in (("temperature", args.temperature), ("max_tokens", args.max_tokens),
                                  ("seed", args.seed)) if v is not None}
    return load, from_dict(SamplingOptions, sampling, "sampling")


def run(args: argparse.Namespace) -> int:
    from runtime.client import WorkerClient, new_id
    try:
        load_opts, sampling = build_options(args)
    except OptionError as e:
        return _fail(f"bad option {e}")
    messages = ([P.ChatMessage("system", args.system)] if args.system else []) + [P.ChatMessage("user", args.prompt)]
    request = P.Generate(request_id=new_id("chat"), messages=tuple(messages), sampling=sampling)
    show = _print_json if args.json else _print_text
    client = WorkerClient(client_name="moedesk-cli chat")
    try:
        show(client.start())
        show(client.load(args.model, load_opts, on_progress=show if args.json else None))
        for ev in client.generate(request):
            show(ev)
            if isinstance(ev, P.Error):
                raise P.exception_for(ev)
        if not args.json:
            sys.stdout.write("\n")
        return 0
    except P.WorkerError as e:
        if not args.json:
            sys.stdout.write("\n")
        tail = client.stderr_tail(1)
        extra = f" (worker log: {tail[-1]})" if e.code in ("worker_died", "internal") and tail else ""
        return _fail(f"{e.code}: {e.message}{extra}")
    except TimeoutError as e:
        return _fail(f"timeout: {e}")
    finally:
        client.stop()


def _print_text(ev) -> None:
    if isinstance(ev, P.TokenDelta):
        sys.stdout.write(ev.text)
        sys.stdout.flush()
    elif isinstance(ev, P.Ready) and ev.engine == "cpu":
        print(ev.engine_note, file=sys.stderr)


def _print_json(ev) -> None:
    sys.stdout.write(P.encode(ev))
    sys.stdout.flush()


def _fail(message: str) -> int:
    print("moedesk-cli chat: " + " ".join(message.split()), file=sys.stderr)
    return 1
