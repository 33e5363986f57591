"""Engine tuning switches and the other environment variables: the one module that reads the environment.

`Tuning` holds every MOEDESK_ tuning switch, typed, with its default, description and allowed values
(in the style of runtime/options.py, whose options the user sets in the app; these are for experiments,
comparisons and tests). `Tuning.from_environment()` builds one and refuses a bad value with a message
naming the variable and what it allows. The worker builds it once at start (`install`); an engine's load
reads the installed one once (`current()`) and hands its fields to the constructors of what it builds, so
no forward reads a global (a captured CUDA graph keeps what it saw). Tests build their own and install it
with `use`, or hand it to a load.

Switches that chose between implementations of the same math were measured and cut (docs/engine-notes.md,
"Tuning"): what is left are launch shapes, what a measurement showed winning somewhere, and load steps.

The accessor functions below read the variables that are not tuning (where the app keeps its files,
the CUDA toolchain, the server's API key, ...). Pure Python: the GUI imports this module too.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional

from runtime.options import TEMPLATE_TIMEOUT_S


class TuningError(ValueError):
    """An environment variable has a value outside what it allows; the message names both."""


def knob(default: Any, env: str, help: str, *, choices: tuple | None = None, min: float | None = None,
         max: float | None = None, flag: bool = False):
    """A Tuning field read from the environment variable `env`. `flag`: the variable being set at all
    (to anything) turns the switch off (MOEDESK_NO_...)."""
    return field(default=default, metadata={"env": env, "help": help, "choices": choices, "min": min,
                                            "max": max, "flag": flag})


@dataclass(frozen=True)
class Grouped:
    """Launch shape of the grouped (prefill) kernels: rows per block (below / from 4096 pairs), columns
    per block, K tile (it may span several scale groups), warps, pipeline stages (0: Triton's default).

    The default is the fastest of 14 shapes that bench.grouped timed on the H200 for
    q125-a11 at 3 bits, 2048 rows: 16.6 ms per layer (37 TFLOP/s) against 32.5 ms for the shape
    before it (16,64,64,64,4,0: 64 columns per block)."""
    bm_small: int = 16
    bm_large: int = 64
    bn: int = 128
    bk: int = 64
    warps: int = 4
    stages: int = 0

    @staticmethod
    def parse(text: str) -> "Grouped":
        """'bm_small,bm_large,bn,bk,warps,stages', e.g. '16,64,128,64,4,0' (MOEDESK_GROUPED)."""
        try:
            v = [int(t) for t in text.split(",")]
            if len(v) != 6:
                raise ValueError
            g = Grouped(*v)
        except (TypeError, ValueError):
            raise ValueError(f"grouped kernel shape {text!r}: want six integers "
                             "bm_small,bm_large,bn,bk,warps,stages, e.g. 16,64,128,64,4,0") from None
        for name in ("bm_small", "bm_large", "bn", "bk", "warps"):
            n = getattr(g, name)
            if n < 1 or n & (n - 1):
                raise ValueError(f"grouped kernel shape {text!r}: {name} {n} is not a power of two")
        if g.bm_small < 16 or g.bm_large < 16 or g.bn < 16 or g.bk < 16:
            raise ValueError(f"grouped kernel shape {text!r}: blocks and tiles of at least 16 (tensor-core dots)")
        return g


def parse_splitk(text: str) -> tuple[int, int]:
    """'BNxKSPLIT' (MOEDESK_SPLITK): output columns per program and the K range's parts, e.g. 64x2."""
    m = re.fullmatch(r"(\d+)x(\d+)", text)
    if not m or int(m[1]) not in (16, 32, 64, 128, 256) or int(m[2]) < 1:
        raise ValueError(f"split-K shape {text!r}: want BNxKSPLIT, BN 16, 32, 64, 128 or 256 and KSPLIT "
                         "at least 1, e.g. 64x2")
    return int(m[1]), int(m[2])


@dataclass(frozen=True)
class Tuning:
    # launch shapes of the expert kernels (runtime/experts/): the same kernels, timed in other shapes
    grouped: Grouped = knob(Grouped(), "MOEDESK_GROUPED", "Launch shape of the grouped (prefill) kernels: "
                            "bm_small,bm_large,bn,bk,warps,stages (bench.grouped times others).")
    splitk: Optional[tuple[int, int]] = knob(None, "MOEDESK_SPLITK", "One split-K GEMV launch shape BNxKSPLIT "
                                             "instead of the fastest timed (empty: timed; tests cut K with it).")
    cpu_kernel_isa: str = knob("auto", "MOEDESK_CPU_KERNEL_ISA", "The vector path of the CPU kernels: the best "
                               "this CPU runs (auto), or a lower one forced (docs/cpu-kernel.md).",
                               choices=("auto", "avx512_vnni", "avx2", "scalar"))
    # expert offload (runtime/offload/)
    lend_staging: bool = knob(True, "MOEDESK_LEND_STAGING", "Lend the staging pages to cold experts between "
                              "prefills (0: off; it lost in two of four runs, docs/engine-notes.md).")
    route_prior: bool = knob(True, "MOEDESK_ROUTE_PRIOR", "Measure a routing prior from a calibration prompt at "
                             "a load without saved routing statistics (0: experts placed as if uniform).")
    pin_ahead: int = knob(1, "MOEDESK_PIN_AHEAD", "Blocks of page-locked host RAM for offloaded experts (4 GiB "
                          "each) prepared ahead of the load, on as many threads.", min=0, max=4)
    # the load (runtime/backends/)
    warmup: bool = knob(True, "MOEDESK_NO_WARMUP", "Warm the kernels up at load (set the variable to turn off).",
                        flag=True)
    # chat templates (runtime/chat_template.py)
    template_timeout_s: float = knob(TEMPLATE_TIMEOUT_S, "MOEDESK_TEMPLATE_TIMEOUT_S", "Seconds a chat "
                                     "template may take to compile or render once.", min=0.001, max=3600.0)

    @staticmethod
    def from_environment(env: Optional[Mapping[str, str]] = None) -> "Tuning":
        """The tuning the variables in `env` (the process's environment by default) ask for; unset or
        empty variables keep their defaults. A bad value raises TuningError naming the variable."""
        env = os.environ if env is None else env
        hints = typing.get_type_hints(Tuning)
        values = {}
        for f in dataclasses.fields(Tuning):
            name, text = f.metadata["env"], env.get(f.metadata["env"])
            if f.metadata["flag"]:
                if text is not None:
                    values[f.name] = False
            elif text:
                values[f.name] = _parse(hints[f.name], f, name, text)
        return Tuning(**values)

    def describe(self) -> list[tuple[str, Any, str]]:
        """(variable, value, description) for each switch, in declaration order."""
        return [(f.metadata["env"], getattr(self, f.name), f.metadata["help"]) for f in dataclasses.fields(self)]


def _allowed(f: dataclasses.Field) -> str:
    m = f.metadata
    if m["choices"]:
        return "one of " + ", ".join(map(str, m["choices"]))
    if m["min"] is not None:
        return f"{m['min']} to {m['max']}"
    return ""


def _parse(tp: Any, f: dataclasses.Field, name: str, text: str) -> Any:
    def bad(why: str) -> TuningError:
        return TuningError(f"{name}={text!r}: {why}")
    if tp is Grouped or f.name == "splitk":
        try:
            return Grouped.parse(text) if tp is Grouped else parse_splitk(text)
        except ValueError as e:
            raise bad(str(e)) from None
    if tp is bool:
        low = text.strip().lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise bad("want 1 (on) or 0 (off)")
    m = f.metadata
    try:
        value = tp(text)
    except ValueError:
        raise bad(f"want {'a whole number' if tp is int else 'a number'}, {_allowed(f)}") from None
    if m["choices"] and value not in m["choices"]:
        raise bad(f"want {_allowed(f)}")
    if m["min"] is not None and not (m["min"] <= value <= m["max"]):
        raise bad(f"want {_allowed(f)}")
    return value


_CURRENT: Optional[Tuning] = None


def current() -> Tuning:
    """The tuning installed for this process (built from the environment on first use)."""
    global _CURRENT
    if _CURRENT is None:
        _CURRENT = Tuning.from_environment()
    return _CURRENT


def install(tuning: Tuning) -> Tuning:
    """Make `tuning` the process's tuning (the worker at start, before the engine loads)."""
    global _CURRENT
    _CURRENT = tuning
    return tuning


@contextlib.contextmanager
def use(tuning: Tuning) -> Iterator[Tuning]:
    """`tuning` installed for the block, the previous one back after it (tests, benchmarks)."""
    global _CURRENT
    before = _CURRENT
    _CURRENT = tuning
    try:
        yield tuning
    finally:
        _CURRENT = before


def with_changes(**changes: Any) -> Tuning:
    """The current tuning with some fields changed (for `use`)."""
    return dataclasses.replace(current(), **changes)


# -- the other environment variables ------------------------------------------------------------------

def home() -> Optional[Path]:
    """MOEDESK_HOME: one folder for all the app's files (tests, portable installs); None: the user dirs."""
    h = os.environ.get("MOEDESK_HOME")
    return Path(h) if h else None


def models_folder() -> Optional[Path]:
    """MOEDESK_MODELS: where the models are, if not under the app's data folder."""
    h = os.environ.get("MOEDESK_MODELS")
    return Path(h) if h else None


def cuda_toolchain() -> str:
    """MOEDESK_CUDA_TOOLCHAIN: "wheels" or "system" leaves the other kind out; "" considers both."""
    only = os.environ.get("MOEDESK_CUDA_TOOLCHAIN", "")
    if only not in ("", "wheels", "system"):
        raise TuningError(f"MOEDESK_CUDA_TOOLCHAIN={only!r}: want wheels or system (or unset: both)")
    return only


def cuda_homes() -> list[str]:
    """CUDA_HOME and CUDA_PATH, where set (in that order)."""
    return [h for h in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")) if h]


def smoke_test_question() -> Optional[str]:
    """MOEDESK_SMOKE_TEST: the question of `moedesk --smoke-test`, when given this way."""
    return os.environ.get("MOEDESK_SMOKE_TEST") or None


def api_key(variable: str = "MOEDESK_API_KEY") -> Optional[str]:
    """The local server's API key (kept out of the process list)."""
    return os.environ.get(variable) or None


def commit() -> Optional[str]:
    """MOEDESK_COMMIT: the source revision benchmarks record where git cannot say."""
    return os.environ.get("MOEDESK_COMMIT") or None


def triton_interpret() -> bool:
    """TRITON_INTERPRET=1: Triton kernels run in its interpreter (on the CPU)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_cache_dir() -> str:
    """Triton's on-disk kernel cache: TRITON_CACHE_DIR, else ~/.triton/cache."""
    return os.environ.get("TRITON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".triton", "cache")


def xdg_data_home() -> Path:
    return Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share")


def hf_endpoint() -> Optional[str]:
    """HF_ENDPOINT: another Hugging Face hub."""
    return os.environ.get("HF_ENDPOINT") or None


def environment() -> Mapping[str, str]:
    """The process's environment, for code that looks several variables up (PATH, CXX, ...) or hands
    a copy to a child process."""
    return os.environ
