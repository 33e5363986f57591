"""moedesk-worker: hosts one model and answers protocol commands (JSON lines) from its parent.

Channel: commands arrive on stdin; events leave on a duplicate of the original stdout, after
which fd 1 points at stderr, so anything a library prints lands in the log, never in the channel.

Threads: a reader thread decodes commands and answers the quick ones at once (hello, stats,
cancel, and refusals such as busy); load, unload and generate run in order on the main thread.
Because the reader keeps reading while a generation runs, `cancel` sets a flag that the loop
checks before every decode step (and that stops a chat template still rendering in its helper
process). The engine's idle work (`Engine.idle_work`: decode graphs captured ahead of need, a placement
measured again) runs one bounded step at a time: after a load, all of it before `loaded` is sent (a
client usually asks for its first answer at once, and a step can take a second or more: a graph capture,
a layer's CPU copies); later, while no command waits, looking at the queue between steps, so a command
waits for one step at most. Every failure becomes an `error` event and the worker keeps serving; stdin
closing (the parent died) or `shutdown` ends it.
"""
from __future__ import annotations

import dataclasses
import os
import queue
import signal
import sys
import threading
import time
import traceback
from typing import Any, Callable, Optional, TextIO

from runtime import tuning
from runtime import protocol as P
from runtime.cpu_load import ThreadGovernor, physical_cores
from runtime.errors import BadRequest, Cancelled, EngineError, InvalidModel, NoModel
from runtime.worker_errors import error_event

TELEMETRY_INTERVAL_S = 0.5
EOF_GRACE_S = 10.0
AHEAD_MAX_STEPS = 64     # idle-work steps a load runs before it reports `loaded` (the rest: in idle time)
AHEAD = "Preparing for the first answer"
_END = object()          # the reader's "stdin closed" marker in the command queue


def bounded_lines(stream, limit: int):
    """The lines of a binary stream, each read into memory only up to `limit` bytes: a longer line is
    read on to its end in small pieces and thrown away, and yields None in its place."""
    while True:
        line = stream.readline(limit + 1)
        if not line:
            return
        if len(line) <= limit:                  # the newline included
            yield line
            continue
        newline = b"\n" if isinstance(line, bytes) else "\n"
        while not line.endswith(newline):
            line = stream.readline(1 << 20)
            if not line:
                break
        yield None


class Worker:
    def __init__(self, out: TextIO):
        self._out = out
        self._out_lock = threading.Lock()
        self._commands: "queue.Queue[Any]" = queue.Queue()
        self._state = threading.Lock()
        self._generating: Optional[str] = None      # request id of the generation queued or running
        self._gen_cmd: Any = None                   # ... and its command
        self._cancel = threading.Event()
        self._live = None                           # generate.LiveStats of the running generation
        self.engine = None
        self.draft_engine = None
        self.tokenizer = None
        self.load_options = None
        self._cache_tokens: list[int] = []
        self._backend = None                        # loader.BackendChoice, for ready
        self._idle_ok = True                        # the engine's idle work has not failed since the last command
        self.governor = None                        # cpu_load.ThreadGovernor of the loaded engine
        self._threads_due: Optional[int] = None     # a team size the governor chose mid-answer
        self.load_stages: list[dict] = []           # the last load's stages and their wall time (load_stages)
        self._idle = {"steps": 0, "seconds": 0.0, "longest_s": 0.0}   # idle work since the last command
        self.idle_before: dict = dict(self._idle)   # ... and before the command now running (telemetry)

    # -- output ------------------------------------------------------------------------------
    def send(self, event: Any) -> None:
        try:
            line = P.encode(event)
        except Exception:          # a bug in an event's data must not silence the channel
            traceback.print_exc()
            line = P.encode(P.Error(code=P.ErrorCode.INTERNAL.value, message=f"the worker could not encode "
                                    f"a {event.type!r} event (see the worker log)"))
        with self._out_lock:
            self._out.write(line)
            self._out.flush()

    def error(self, code: str, message: str, detail: str = "", request_id: Optional[str] = None) -> None:
        self.send(P.Error(code=str(code), message=message, detail=detail, request_id=request_id))

    # -- reader thread -------------------------------------------------------------------------
    def read_commands(self, stdin) -> None:
        for raw in bounded_lines(stdin, P.MAX_LINE_BYTES):
            if raw is None:
                self.error(P.ErrorCode.BAD_JSON.value, f"a command line longer than {P.MAX_LINE_BYTES} bytes was "
                           "skipped (the longest prompt fits well within that)")
                continue
            if raw.strip():
                try:
                    self.on_line(raw)
                except Exception:   # never let the reader die: that would deafen the worker
                    try:
                        self.error(P.ErrorCode.INTERNAL.value, "the worker failed to handle a command",
                                   traceback.format_exc())
                    except Exception:
                        traceback.print_exc()
        self._cancel.set()
        self._commands.put(_END)
        time.sleep(EOF_GRACE_S)     # the main thread should exit by now; a load cannot be interrupted
        os._exit(0)

    def on_line(self, raw: bytes | str) -> None:
        try:
            cmd = P.decode_command(raw)
        except P.ProtocolError as e:
            self.error(e.code.value, e.message, request_id=e.request_id)
            return
        if isinstance(cmd, P.Hello):
            self.hello(cmd)
        elif isinstance(cmd, P.Stats):
            self.send(self.telemetry(cmd.request_id))
        elif isinstance(cmd, P.CountTokens):
            self.count(cmd)      # here, not queued: the message box asks while an answer streams
        elif isinstance(cmd, P.Cancel):
            with self._state:
                if self._generating == cmd.request_id:
                    self._cancel.set()
            # Cancelling a generation that already ended is a harmless race: its finished event says so.
        elif isinstance(cmd, P.Shutdown):
            self._cancel.set()
            self._commands.put(cmd)
        else:
            with self._state:
                if self._generating is not None:
                    self.error(P.ErrorCode.BUSY.value,
                               f"a generation ({self._generating}) is running: cancel it or wait for it to finish",
                               request_id=cmd.request_id)
                    return
                if isinstance(cmd, P.Generate):
                    self._generating, self._gen_cmd = cmd.request_id, cmd
                    self._cancel.clear()
            self._commands.put(cmd)

    def hello(self, cmd: P.Hello) -> None:
        if cmd.protocol_version != P.PROTOCOL_VERSION:
            self.error(P.ErrorCode.VERSION_MISMATCH.value,
                       f"the client speaks protocol {cmd.protocol_version}, this worker speaks {P.PROTOCOL_VERSION}")
            return
        choice = self._backend
        self.send(P.Ready(protocol_version=P.PROTOCOL_VERSION, worker_version=_version(), pid=os.getpid(),
                          engine=choice.backend, engine_note=choice.note, device=choice.device,
                          libraries=_libraries()))

    def count(self, cmd: P.CountTokens) -> None:
        tokenizer, engine = self.tokenizer, self.engine     # a load may replace them meanwhile
        if tokenizer is None or engine is None:
            self.error(P.ErrorCode.NO_MODEL.value, "no model is loaded: tokens are counted with its tokenizer",
                       request_id=cmd.request_id)
            return
        try:
            n = len(tokenizer.encode_chat([{"role": m.role, "content": m.content} for m in cmd.messages]))
        except EngineError as e:
            self.send(error_event(e, cmd.request_id))
            return
        self.send(P.TokenCount(request_id=cmd.request_id, tokens=n, context_length=engine.info.context_length))

    def telemetry(self, request_id: str = "") -> P.Telemetry:
        live, engine = self._live, self.engine
        known: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        if engine is not None:
            names = {f.name for f in dataclasses.fields(P.Telemetry)}
            for key, value in (engine.telemetry() or {}).items():
                (known if key in names and key not in ("request_id", "generating", "extra") else extra)[key] = value
            extra["idle_work"] = self.idle_before      # what the running (or last) command waited behind
        draft = live.draft if live is not None else None
        return P.Telemetry(
            request_id=request_id or (self._generating or ""),
            decode_tps=live.decode_tps if live else None, ttft_s=live.ttft_s if live else None,
            prefill_tps=live.prefill_tps if live else None,
            draft_acceptance=draft.acceptance_rate if draft is not None else None,
            rss_bytes=_rss(), generating=self._generating is not None,
            cpu_busy_others=self.governor.others if self.governor is not None else None,
            extra=_plain(extra), **known)

    # -- main thread -----------------------------------------------------------------------------
    def serve(self) -> int:
        while True:
            cmd = self._next_command()
            if cmd is _END or isinstance(cmd, P.Shutdown):
                self.close()
                return 0
            self._idle_ok = True
            self.idle_before = dict(self._idle)      # the idle work the command may have waited behind
            self._idle = {"steps": 0, "seconds": 0.0, "longest_s": 0.0}
            failure = self.run_command(cmd)
            if isinstance(cmd, P.Generate):
                self._done_generating(cmd)     # before the error: the client may send the next command at once
            if failure is not None:
                self.send(failure)

    def _next_command(self) -> Any:
        """The next command; while none is waiting, the engine's idle work (graphs captured ahead
        of need, a placement re-measured), one bounded step at a time, so that a command that arrives
        waits for one step at most."""
        while True:
            try:
                return self._commands.get_nowait()
            except queue.Empty:
                pass
            if not self._idle_step():
                return self._commands.get()

    def _idle_step(self) -> bool:
        """One step of the engine's idle work; False when there is none (or it failed: logged, and
        not tried again until the next command)."""
        engine = self.engine
        work = getattr(engine, "idle_work", None)
        if work is None or not self._idle_ok:
            return False
        t0 = time.perf_counter()
        try:
            return bool(work())
        except Exception:
            self._idle_ok = False
            traceback.print_exc()          # warm-up is an optimisation: the answer captures on demand
            return False
        finally:
            dt = time.perf_counter() - t0
            idle = self._idle
            idle["steps"] += 1
            idle["seconds"] = round(idle["seconds"] + dt, 3)
            idle["longest_s"] = round(max(idle["longest_s"], dt), 3)

    def run_command(self, cmd: Any) -> Optional[P.Error]:
        """Run load / unload / generate; a failure comes back as the error event to send."""
        rid = getattr(cmd, "request_id", None)
        try:
            if isinstance(cmd, P.Load):
                self.load(cmd)
            elif isinstance(cmd, P.Unload):
                self.close()
                self.send(P.Unloaded(request_id=cmd.request_id))
            elif isinstance(cmd, P.Generate):
                self.generate(cmd)
            return None
        except Exception as e:
            return error_event(e, rid)

    def load(self, cmd: P.Load) -> None:
        from runtime.loader import open_engine
        from runtime.tokenizer import Tokenizer

        marks: list[tuple[str, str, float]] = []

        def progress(stage: str, message: str, done: int, total: int) -> None:
            marks.append((stage, message, time.perf_counter()))
            self.send(P.Progress(request_id=cmd.request_id, stage=stage, message=message, done=done, total=total))

        self.close()                   # free the old model first: two may not fit
        t0 = time.perf_counter()
        marks.append(("load", "Starting the load", t0))
        compiled_before = kernel_cache_entries()
        governor = ThreadGovernor(physical_cores(), fixed=cmd.options.offload.cpu_threads)
        engine, applied = open_engine(cmd.model, cmd.options, progress)
        marks.append(("load", "Reading the tokenizer", time.perf_counter()))
        try:
            tokenizer = Tokenizer.from_folder(engine.info.path)
            draft = cmd.options.draft
            if draft.mode == "model":
                self.draft_engine = self._load_draft(draft.model, cmd.options, tokenizer, progress)
                applied["draft.model"] = "applied"
        except BaseException:
            engine.close()
            self.close()
            raise
        self.engine, self.tokenizer, self.load_options = engine, tokenizer, cmd.options
        self.governor = governor
        self._adapt_threads()          # other programs' load, measured over the load
        t_ahead = time.perf_counter()
        if self._work_ahead(lambda n: self.send(P.Progress(cmd.request_id, "warmup", AHEAD, n, 0))):
            marks.append(("warmup", AHEAD, t_ahead))
        info = engine.info
        t_end = time.perf_counter()
        self.load_stages = load_stages(marks, t_end)
        self.send(P.Loaded(request_id=cmd.request_id, model=cmd.model, path=str(info.path),
                           architecture=info.architecture, backend=engine.backend,
                           context_length=info.context_length, vocab_size=info.vocab_size,
                           load_s=t_end - t0, applied=applied, tool_format=tokenizer.tool_format()))
        t = self.telemetry(cmd.request_id)
        compiled = kernel_cache_entries()
        compiled = compiled - compiled_before if compiled is not None and compiled_before is not None else None
        self.send(dataclasses.replace(t, extra=dict(t.extra, load_stages=self.load_stages,
                                                    kernels_compiled_in_load=compiled)))

    def _work_ahead(self, progress: Callable[[int], None]) -> int:
        """The engine's idle work, done now (at most AHEAD_MAX_STEPS steps): left to idle time it would
        delay the first answer, asked for as soon as the load is reported, by the step running then. Each
        step done is reported to `progress`; -> the steps done. A failing step is logged and ends it."""
        steps = 0
        while steps < AHEAD_MAX_STEPS and self._idle_step():
            steps += 1
            progress(steps)
        self._idle = {"steps": 0, "seconds": 0.0, "longest_s": 0.0}   # what a command waits behind: from now on
        return steps

    def _load_draft(self, model: Optional[str], options, tokenizer, progress):
        from runtime.loader import open_engine
        from runtime.options import DraftOptions, LoadOptions
        from runtime.tokenizer import Tokenizer
        if not model:
            raise BadRequest("options.draft.mode is 'model' but options.draft.model is empty")
        draft_engine, _ = open_engine(model, LoadOptions(offload=options.offload, draft=DraftOptions()),
                                      lambda stage, msg, d, t: progress("draft", f"Draft model: {msg}", d, t))
        if Tokenizer.from_folder(draft_engine.info.path).vocabulary() != tokenizer.vocabulary():
            draft_engine.close()
            raise InvalidModel(draft_engine.info.path, "the draft model's vocabulary differs from the model's; "
                               "a draft model must share the model's tokenizer")
        return draft_engine

    def generate(self, cmd: P.Generate) -> None:
        from runtime.constrained import logprob_events, steering_for
        from runtime.context import FittedPrompt, fit_prompt
        from runtime.generate import generate, make_decoder, make_generator
        from runtime.tool_format import chat_inputs
        if self.engine is None:
            raise NoModel("no model is loaded: send load first")
        if cmd.prompt is not None and cmd.messages:
            raise BadRequest("generate: give messages or prompt, not both")
        fmt = self.tokenizer.tool_format()
        if cmd.prompt is not None:
            if cmd.answer_prefix or cmd.tools is not None:
                raise BadRequest("generate: answer_prefix and tools need messages, not a prompt")
            fitted = FittedPrompt(self.tokenizer.encode_prompt(cmd.prompt), 0, 0)
        elif cmd.messages:
            t0 = time.perf_counter()
            messages, tools = chat_inputs(cmd.messages, cmd.tools, fmt)
            try:
                fitted = fit_prompt(self.tokenizer, messages, self.engine.info.context_length, cmd.sampling.max_tokens,
                                    cmd.sampling.context_overflow, cmd.answer_prefix, should_stop=self._cancel.is_set,
                                    tools=tools)
            except Cancelled:     # cancelled while the chat template rendered: nothing was generated
                self._done_generating(cmd)
                self.send(P.Finished(request_id=cmd.request_id, reason="cancelled", stats=P.GenerationStats(
                    0, 0, None, None, None, time.perf_counter() - t0)))
                return
        else:
            raise BadRequest("generate: messages is empty and no prompt was given")
        prompt = fitted.tokens
        vocab = self.engine.info.vocab_size
        steer = steering_for(cmd, self.tokenizer, vocab, prompt, fitted.prefix_tokens, fmt)   # grammar, penalties...
        generator = make_generator(cmd.sampling.seed)
        draft = cmd.draft if cmd.draft is not None else self.load_options.draft
        decoder = make_decoder(self.engine, cmd.sampling, generator, draft, self.draft_engine, steer)
        rid = cmd.request_id
        scored = steer is not None and steer.top_logprobs is not None

        def on_text(text: str, tokens: int) -> None:
            lps = tuple(P.TokenLogprob(text, lp, raw, tuple(P.TopLogprob(*alt) for alt in alts))
                        for text, lp, raw, alts in logprob_events(steer.pop_records(tokens), self.tokenizer, vocab)
                        ) if scored else ()
            self.send(P.TokenDelta(request_id=rid, text=text, tokens=tokens, logprobs=lps))

        def on_step(live) -> None:
            self._live = live
            if self._threads_due is not None:        # chosen by the ticker; applied between two steps
                self.engine.set_cpu_threads(self._threads_due)
                self._threads_due = None

        self._adapt_threads()          # other programs' load since the last answer
        self._live = None                                      # no figures of the previous answer
        cached, self._cache_tokens = self._cache_tokens, []    # unknown if the generation fails
        ticking = threading.Event()
        ticker = threading.Thread(target=self._tick, args=(rid, ticking), name="telemetry", daemon=True)
        ticker.start()
        try:
            result = generate(self.engine, self.tokenizer, prompt, cmd.sampling, decoder=decoder, on_text=on_text,
                              on_step=on_step, should_stop=self._cancel.is_set, generator=generator, cached=cached,
                              answer_prefix_tokens=fitted.prefix_tokens, steer=steer,
                              skip_special_tokens=not (cmd.tools is not None and fmt == "mistral"))
        except BaseException:
            self._reset_cache()
            raise
        finally:
            ticking.set()
            ticker.join()
        self._cache_tokens = result.cache_tokens
        self._adapt_threads()
        self._done_generating(cmd)     # before finished: the client may send the next generate at once
        # The closing figures go before `finished`: a client may stop reading at `finished`, and a short
        # answer can end before the first tick.
        self.send(self.telemetry(rid))
        stats = dataclasses.replace(result.stats, dropped_messages=fitted.dropped_messages)
        self.send(P.Finished(request_id=rid, reason=result.reason, stats=stats))

    def _tick(self, rid: str, stop: threading.Event) -> None:
        """Telemetry about twice a second while a generation runs (also during a long prefill chunk)."""
        while not stop.wait(TELEMETRY_INTERVAL_S):
            try:
                due = self.governor.observe() if self.governor is not None else None
                if due is not None and self.engine is not None and self.engine.adapts_threads:
                    self._threads_due = due
                self.send(self.telemetry(rid))
            except Exception:
                traceback.print_exc()      # a gauge failing must not stop the answer

    def _adapt_threads(self) -> None:
        """A new reading of other programs' CPU use; an automatic team follows it (cpu_load)."""
        self._threads_due = None
        if self.governor is None or self.engine is None:
            return
        threads = self.governor.observe()
        if threads is not None and self.engine.adapts_threads:
            self.engine.set_cpu_threads(threads)

    def _done_generating(self, cmd: P.Generate) -> None:
        with self._state:
            if self._gen_cmd is cmd:   # not a newer generate accepted since
                self._generating = self._gen_cmd = None

    def _reset_cache(self) -> None:
        self._cache_tokens = []
        try:
            self.engine.truncate(0)
        except Exception:
            pass               # the next load replaces the engine anyway

    def close(self) -> None:
        for engine in (self.engine, self.draft_engine):
            if engine is not None:
                engine.close()
        self.engine = self.draft_engine = self.tokenizer = self.load_options = self.governor = None
        self._cache_tokens, self._live = [], None


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("moedesk")
    except PackageNotFoundError:
        return "dev"


def _libraries() -> dict[str, str]:
    """Versions of the engine's libraries, from their installed metadata (nothing is imported)."""
    from importlib.metadata import PackageNotFoundError, version
    out = {}
    for name in ("torch", "exllamav2", "tokenizers", "triton"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            pass
    import platform
    out["python"] = platform.python_version()
    return out


def kernel_cache_entries() -> Optional[int]:
    """Kernels in Triton's on-disk cache (TRITON_CACHE_DIR, else ~/.triton/cache), one folder each;
    None without one. Their growth over a load says how many kernels it compiled (a first load on a
    machine compiles them all; later ones find them there)."""
    folder = tuning.triton_cache_dir()
    try:
        return sum(1 for _ in os.scandir(folder))
    except OSError:
        return None


def load_stages(marks: list[tuple[str, str, float]], end: float) -> list[dict]:
    """Each progress step of a load with its wall time, up to the next step (the last: up to `end`);
    a message repeated at once (a step's start and end) is one stage."""
    out: list[dict] = []
    for i, (stage, message, t) in enumerate(marks):
        seconds = (marks[i + 1][2] if i + 1 < len(marks) else end) - t
        if out and out[-1]["stage"] == stage and out[-1]["message"] == message:
            out[-1]["s"] = round(out[-1]["s"] + seconds, 3)
        else:
            out.append({"stage": stage, "message": message, "s": round(seconds, 3)})
    return out


def _rss() -> Optional[int]:
    try:
        import psutil
        return psutil.Process().memory_info().rss
    except Exception:
        return None


def _plain(values: dict) -> dict:
    """Engine figures that JSON can carry (numbers, text, flags, and lists/dicts of them)."""
    import json
    out = {}
    for key, value in values.items():
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            value = str(value)
        out[str(key)] = value
    return out


def _protocol_channel() -> TextIO:
    """Keep the real stdout for events; point fd 1 (and sys.stdout) at stderr for everything else."""
    sys.stdout.flush()
    fd = os.dup(1)
    os.dup2(2, 1)
    return os.fdopen(fd, "w", encoding="utf-8", errors="backslashreplace", newline="\n")


def name_process() -> None:
    """Show as `moedesk-worker` in process lists (ps, top, the task manager), not as `python -m ...`.
    Cosmetic: where setproctitle is missing (a Python that did not install our dependencies) the worker
    runs under its interpreter's name rather than not at all."""
    try:
        import setproctitle
    except ImportError:
        print("setproctitle is not installed: the worker keeps its interpreter's process name", file=sys.stderr)
        return
    setproctitle.setproctitle("moedesk-worker")


def main() -> int:
    from runtime import chat_template
    if chat_template.HELPER_FLAG in sys.argv[1:]:    # the same executable serves as the template helper
        return chat_template.serve()
    signal.signal(signal.SIGINT, signal.SIG_IGN)     # the parent decides when the worker ends
    name_process()
    try:
        tuning.install(tuning.Tuning.from_environment())   # once, before the engine's modules load
    except tuning.TuningError as e:
        print(f"moedesk-worker: {e}", file=sys.stderr, flush=True)
        return 2
    out = _protocol_channel()
    worker = Worker(out)
    from runtime.loader import choose_backend
    worker._backend = choose_backend("auto")
    print(f"moedesk-worker {_version()} pid {os.getpid()}: {worker._backend.note}", file=sys.stderr, flush=True)
    threading.Thread(target=worker.read_commands, args=(sys.stdin.buffer,), name="commands", daemon=True).start()
    code = worker.serve()
    out.flush()
    sys.stderr.flush()
    # Exit at once: a normal interpreter exit would wait on the reader thread, blocked in stdin.
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
