"""The CUDA engine's side of the CPU-path decision (runtime/experts/path_judge.py): time decode
steps with the CPU expert path on and off, keep the faster; at load behind the progress, and again
in the worker's idle time when the live steps drift. Each step of a trial is bounded (one switch of
the path, one graph capture, or `TRIAL_STEPS` decode steps), so an idle-time trial delays a new
command by one of them at most. The timed steps decode random tokens past the cache's end; the cache
is rolled back after each run of them."""
from __future__ import annotations

import time
from typing import Iterator

import torch

from runtime.engine import ProgressFn
from runtime.experts.path_judge import TRIAL_STEPS, PathJudge


def make_judge(manager) -> PathJudge:
    """The judge for a manager just placed: its policy, its predicted gain, what rules the path out."""
    return PathJudge(policy=manager.cpu_policy, predicted_gain=manager.cpu_predicted_gain,
                     unavailable=manager.cpu_unavailable, running=current_path(manager))


def current_path(manager) -> str:
    return "cpu" if manager.cpu_active else "stream"


def time_decode_steps(engine, steps: int = TRIAL_STEPS, seed: int = 0) -> list[float]:
    """Wall time of `steps` one-row forwards (each read back on the host, as sampling does) from the
    cache position; the cache is rolled back afterwards."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, engine.vocab, (steps + 1,), generator=g).tolist()
    pos0 = engine.position
    room = engine.info.context_length - pos0 - 1
    out = []
    try:
        engine.forward(tokens[:1])                        # the first step after a switch: untimed
        for t in tokens[1:max(2, min(len(tokens), room))]:
            t0 = time.perf_counter()
            engine.forward([t])[-1].argmax().item()
            out.append(time.perf_counter() - t0)
    finally:
        engine.truncate(pos0)
    return out


def trial(engine, judge: PathJudge) -> Iterator[str]:
    """Measure the judge's paths (the one running first), then run the faster; yields a message after
    each bounded step."""
    from runtime.backends.exl2_graph import bucket
    manager = engine.offload
    paths = sorted(judge.plan(), key=lambda p: p != current_path(manager))
    for path in paths:
        if current_path(manager) != path:
            engine._drop_graphs()
            if not manager.set_cpu_path(path == "cpu", "measuring the GPU-only path", keep=True):
                if path == "cpu":
                    judge.record("cpu", None)
                    yield "the CPU path could not be built"
                    continue
            yield f"switched to the {'CPU' if path == 'cpu' else 'GPU-only'} expert path"
        engine._prepare_graph(bucket(engine.position, 1, engine.info.context_length), 1)
        yield "decode graph captured"
        judge.record(path, time_decode_steps(engine))
        yield f"timed {'with' if path == 'cpu' else 'without'} the CPU path"
    best = judge.decide()
    if current_path(manager) != best:
        engine._drop_graphs()
        manager.set_cpu_path(best == "cpu", judge.reason)
        yield "kept the faster path"
    if best == "stream":
        manager.cpu_reason = judge.reason


def settle_cpu_path(engine, progress: ProgressFn, measure: bool = False) -> None:
    """At load, after the warm-up: decide the CPU path (timing both where the prediction is close,
    or always with `measure`), then capture again the graphs a switch dropped."""
    from runtime.backends.exl2_offload import cpu_path_applied
    judge = engine.path_judge = make_judge(engine.offload)
    if measure:
        judge.ask_again()
    if judge.plan():
        n = 2 * len(judge.plan()) + 3
        for i, msg in enumerate(trial(engine, judge)):
            progress("warmup", f"Choosing the expert path {i + 1}/{n}: {msg}", i, n)
        engine.prepare_graphs(progress)
    else:
        judge.decide()
        if judge.path == "stream" and current_path(engine.offload) == "cpu":     # cannot happen today
            engine._drop_graphs()
            engine.offload.set_cpu_path(False, judge.reason)
    cpu_path_applied(engine.budget, engine.offload, judge.summary())
