"""Chat templates, compiled and rendered in a separate process that is killed when it runs too long.

A chat template is code from an untrusted model folder. jinja2's immutable sandbox stops attribute escapes,
but not a template that loops for ever (nested `range`s), writes gigabytes, or computes `9**9**9` - and jinja
folds constant expressions while it compiles, so that can happen at load already. So every compile and render
runs in a helper process (started once, reused) under these bounds:

- wall clock: `TEMPLATE_TIMEOUT_S` (runtime/options.py; the environment variable MOEDESK_TEMPLATE_TIMEOUT_S
  overrides it, for tests); past it, or on cancel, the helper is killed and the next call starts a fresh one;
- output: at most `MAX_PROMPT_CHARS` characters, counted while the template writes;
- operators: `**`, `*` and `+` are intercepted (which also keeps jinja from folding them at compile time):
  integers of more than `MAX_INT_BITS` bits, and text or lists past the output bound, are refused;
- the optimizer is off; the helper's address space is capped (`MAX_MEMORY_BYTES`) where the OS allows;
- CPU time: each request may use the render's timeout and `CPU_MARGIN_S` more (RLIMIT_CPU, where the OS has it),
  so a helper nobody waits for any more stops on its own;
- its parent: the helper dies with the process that started it. A thread of the helper reads its requests and
  ends the helper the moment stdin closes, which happens however the parent ends (SIGKILL included), on every OS;
  on Linux the kernel also kills it when its parent does (PR_SET_PDEATHSIG, asked for where the helper is started
  from the main thread: the signal follows the thread that started it).

Failures come back as exceptions of runtime/errors.py naming the template's file: TemplateError for a
broken or runaway template, TemplateRefused when it refuses the messages (raise_exception), ContextOverflow
for a prompt too long, Cancelled when the request was cancelled while the template rendered.
"""
from __future__ import annotations

import datetime
import json
import math
import os
import queue
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Optional

from runtime import tuning
from runtime.errors import Cancelled, ContextOverflow, EngineError, TemplateError, TemplateRefused
from runtime.options import MAX_PROMPT_CHARS, TEMPLATE_TIMEOUT_S

HELPER_FLAG = "--chat-templates"      # runs the worker executable as the template helper
MAX_INT_BITS = 1 << 16                 # ~20,000 decimal digits
MAX_LIST_ITEMS = 1 << 20
MAX_MEMORY_BYTES = 2 << 30
START_TIMEOUT_S = 60.0                 # starting the helper (not counted in the render's time)
CPU_MARGIN_S = 2.0                     # CPU seconds a request may use beyond the render's timeout
PDEATHSIG_FLAG = "--die-with-parent"   # Linux: the helper asks the kernel to kill it when its parent dies
PR_SET_PDEATHSIG = 1                   # <linux/prctl.h>


def timeout_s() -> float:
    return tuning.current().template_timeout_s


# ----------------------------------------------------------------------------------------------
# The parent's side: one helper process per process that renders, and a request with a deadline

class _Helper:
    def __init__(self):
        from runtime.client import worker_command, worker_env
        tied = sys.platform.startswith("linux") and threading.current_thread() is threading.main_thread()
        command = worker_command() + [HELPER_FLAG] + ([PDEATHSIG_FLAG] if tied else [])
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None,
                                     env=worker_env())
        self.lines: "queue.Queue[Optional[bytes]]" = queue.Queue()
        threading.Thread(target=self._read, daemon=True, name="chat-template-helper").start()
        if self._answer(time.monotonic() + START_TIMEOUT_S, lambda: False) != {"ready": True}:
            self.kill()
            raise EngineError("the chat template helper process did not start (see the log above)")

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def _answer(self, deadline: float, should_stop: Callable[[], bool]) -> Any:
        """The helper's next answer; "timeout" / "stopped" / "died" when there is none."""
        while True:
            try:
                line = self.lines.get(timeout=0.02)
            except queue.Empty:
                if should_stop():
                    return "stopped"
                if time.monotonic() > deadline:
                    return "timeout"
                continue
            return "died" if line is None else json.loads(line)

    def ask(self, request: dict, should_stop: Callable[[], bool]) -> Any:
        request = {**request, "cpu_s": timeout_s() + CPU_MARGIN_S}
        self.proc.stdin.write(json.dumps(request).encode() + b"\n")
        self.proc.stdin.flush()
        return self._answer(time.monotonic() + timeout_s(), should_stop)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


_helper: Optional[_Helper] = None
_lock = threading.Lock()


def run(request: dict, source: str, should_stop: Callable[[], bool] = lambda: False) -> str:
    """Compile (and render, when `request` holds variables) a template in the helper; the rendered text."""
    global _helper
    with _lock:
        if _helper is None or _helper.proc.poll() is not None:
            _helper = _Helper()
        try:
            answer = _helper.ask(request, should_stop)
        except (OSError, ValueError):          # the helper died between two requests
            answer = "died"
        if isinstance(answer, str):            # timeout, stopped or died: this helper is done
            _helper.kill()
            _helper = None
    if answer == "stopped":
        raise Cancelled(f"{source}: rendering was cancelled")
    if answer == "timeout":
        raise TemplateError(source, f"the chat template ran for more than {timeout_s():g} s (does it loop for ever?); "
                                    f"stopped")
    if answer == "died":
        raise TemplateError(source, "the chat template crashed its helper process (out of memory?)")
    if "text" in answer:
        try:
            answer["text"].encode("utf-8")
        except UnicodeEncodeError as e:
            raise TemplateError(source, f"the chat template wrote text that is not "
                                        f"valid Unicode (a lone surrogate at {e.start})") from None
        return answer["text"]
    kind, message = answer["error"], answer["message"]
    words = {"syntax": "chat template is broken", "raised": "the chat template refused the messages",
             "unsafe": "chat template tried an unsafe operation", "too_long": "chat template output is too long",
             "failed": "chat template failed"}[kind]
    if kind == "raised":
        raise TemplateRefused(source, f"{words}: {message}")
    if kind == "too_long" and request.get("conversation_chars", 0) >= MAX_PROMPT_CHARS // 2:
        raise ContextOverflow(f"{source}: {words}: {message}")
    raise TemplateError(source, f"{words}: {message}")    # too long from a short conversation: the template's doing


# ----------------------------------------------------------------------------------------------
# The helper's side (no protocol, no torch): read a request line, answer a line

class TemplateRaised(Exception):
    """A template called raise_exception(...)."""


class _Bounded(Exception):
    """A bound of this module was passed."""


def _environment():
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedEnvironment(ImmutableSandboxedEnvironment):
        # Intercepted operators are also never folded at compile time (jinja checks this list).
        intercepted_binops = frozenset({"**", "*", "+"})

        def call_binop(self, context, operator, left, right):
            if operator == "**" and isinstance(left, int) and isinstance(right, int):
                if right > 0 and abs(left) > 1 and left.bit_length() * right > MAX_INT_BITS:
                    raise _Bounded(f"{left} ** {right} has more than {MAX_INT_BITS} bits")
            elif operator == "*" and isinstance(left, int) and isinstance(right, int):
                if left.bit_length() + right.bit_length() > MAX_INT_BITS:
                    raise _Bounded(f"a product of more than {MAX_INT_BITS} bits")
            elif operator == "*":
                seq, n = (left, right) if isinstance(right, int) else (right, left)
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > _limit(seq):
                    raise _Bounded(f"repeating {len(seq)} items {n} times passes {_limit(seq)}")
            elif operator == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, type(left)):
                if len(left) + len(right) > _limit(left):
                    raise _Bounded(f"joining passes {_limit(left)} items")
            return super().call_binop(context, operator, left, right)

    def raise_exception(message):
        raise TemplateRaised(str(message))

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.datetime.now().strftime(fmt)

    env = BoundedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols], optimized=False)
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def _limit(seq: Any) -> int:
    return MAX_PROMPT_CHARS if isinstance(seq, str) else MAX_LIST_ITEMS


def _handle(env, compiled: dict, request: dict) -> dict:
    import jinja2
    text = request["template"]
    try:
        if text not in compiled:
            compiled.clear()                   # one model's template at a time
            compiled[text] = env.from_string(text)
        if "variables" not in request:
            return {"text": ""}
        out, size = [], 0
        for piece in compiled[text].generate(**request["variables"]):
            size += len(piece)
            if size > MAX_PROMPT_CHARS:
                return {"error": "too_long", "message": f"more than {MAX_PROMPT_CHARS} characters; stopped"}
            out.append(piece)
        return {"text": "".join(out)}
    except jinja2.TemplateSyntaxError as e:
        return {"error": "syntax", "message": f"line {e.lineno}: {e.message}"}
    except TemplateRaised as e:
        return {"error": "raised", "message": str(e)}
    except jinja2.exceptions.SecurityError as e:
        return {"error": "unsafe", "message": str(e)}
    except _Bounded as e:
        return {"error": "failed", "message": f"over a bound: {e}"}
    except MemoryError:
        return {"error": "failed", "message": "it needed more memory than a template may have"}
    except Exception as e:            # anything a template can raise (TypeError, RecursionError, ...)
        return {"error": "failed", "message": f"{type(e).__name__}: {e}"}


def serve() -> int:
    """The helper's loop: one JSON request per line on stdin, one JSON answer per line on stdout."""
    if PDEATHSIG_FLAG in sys.argv[1:]:
        _die_with_parent()
    try:
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (MAX_MEMORY_BYTES, MAX_MEMORY_BYTES))
        resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))
    except (ImportError, ValueError, OSError):
        pass                                    # no such limit on this OS: the wall clock still holds
    requests: "queue.Queue[bytes]" = queue.Queue()
    threading.Thread(target=_read_requests, args=(sys.stdin.buffer, requests), daemon=True,
                     name="requests").start()
    out = sys.stdout.buffer
    env, compiled = _environment(), {}
    out.write(b'{"ready": true}\n')
    out.flush()
    while True:
        request = json.loads(requests.get())
        _limit_cpu(request.get("cpu_s", TEMPLATE_TIMEOUT_S + CPU_MARGIN_S))
        answer = _handle(env, compiled, request)
        out.write(json.dumps(answer, ensure_ascii=True).encode() + b"\n")
        out.flush()


def _read_requests(stdin, requests: "queue.Queue[bytes]") -> None:
    """Requests to the main thread; stdin closing means the parent is gone: the helper ends now, even while a
    template renders."""
    try:
        for line in stdin:
            requests.put(line)
    finally:
        os._exit(0)


def _die_with_parent() -> None:
    """Linux: SIGKILL from the kernel when the parent (the thread that started the helper) ends."""
    try:
        import ctypes
        import signal
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass                                    # stdin closing still ends the helper


def _limit_cpu(seconds: float) -> None:
    """The helper may use `seconds` more CPU time from now (then SIGXCPU ends it), where the OS has RLIMIT_CPU."""
    try:
        import resource
        usage = resource.getrusage(resource.RUSAGE_SELF)
        hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
        soft = math.ceil(usage.ru_utime + usage.ru_stime + max(seconds, 1.0))
        resource.setrlimit(resource.RLIMIT_CPU, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))
    except (ImportError, ValueError, OSError):
        pass


if __name__ == "__main__":
    sys.exit(serve())
