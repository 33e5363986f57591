"""Benchmark of the CPU expert path: weight GB/s and milliseconds per token, per format and row count.

One call = one MoE layer's routed experts for T rows (top-k experts each, uniform routing over a pool of
experts larger than the CPU's last-level cache, so weights come from RAM as they would for cold experts).
Figures per (shape, bits, format, threads, T), medians over the timed calls:
  ms_per_call          one layer, T rows
  gb_per_s             weight bytes read (each distinct expert once) / time: per call
  gb_per_s_per_thread  the same over the team's threads: per core
  gb_per_cpu_s         the same bytes / process CPU time: what one core sustains, robust to a loaded box
  read_gbps            this machine's read bandwidth for a team of the same size, measured just before the
                       row (csrc/qdot.cpp read_gbps: a stream of 256 MB, best of 3)
  bandwidth_fraction   gb_per_s / read_gbps
  ms_per_token_layer   ms_per_call / T
  bpw                  bits per weight the format reads (codes + scales)
  bytes_ratio          bytes of an expert in the format / as EXL2 stores it (placement's cpu_bytes_ratio)
The JSON records the machine (CPU, cores, NUMA nodes, load average before and after), the kernel's vector
path (isa; --isa forces a lower one, e.g. avx2 on a machine with VNNI) and the read bandwidth per team size.
With --pcie-load (a GPU machine), a thread keeps page-locked host -> device copies running the whole time,
as the decode kernels' reads of cold experts over PCIe do beside the CPU path; the rows then also give the
copies' rate during the run (pcie_gb_per_s), and the JSON the rate alone. Both read host RAM: the pair of
figures against each alone says whether they share its bandwidth.
The experts are synthetic EXL2 (random codes, sane scales; runtime/exl2/synth.py writes them the same way),
converted by the same code the engine uses. Speed only depends on bytes and shapes, not on the values.

    python -m bench.cpu_experts [--shapes q125-a11 qwen3-30b-a3b] [--formats ...] [--rows 1 4]
                                        [--bits 2.5 3.0 4.0] [--pool-mb 1024] [--calls 30] [--threads 1 2]
                                        [--isa auto] [--json OUT] [--pcie-load]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import threading
import time
from dataclasses import asdict, dataclass
from typing import Callable, Sequence

import torch

from runtime.cpu import experts as ce
from runtime.exl2.shapes import SHAPES
from runtime.exl2.synth import _random_linear      # synthetic EXL2 linears, written in the quantized domain

DEFAULT_SHAPES = ("q125-a11", "qwen3-30b-a3b")


@dataclass
class BenchRow:
    shape: str
    hidden: int
    inter: int
    format: str
    rows: int
    top_k: int
    bpw: float
    bytes_ratio: float           # bytes per expert in this format / as EXL2 stores it (PathCosts.cpu_bytes_ratio)
    pool_experts: int
    ms_per_call: float
    ms_per_call_min: float
    cpu_ms_per_call: float       # CPU time of the process per call (all threads; spin-waits included)
    gb_per_s: float
    gb_per_cpu_s: float          # weight bytes per second of process CPU time (per-core speed, load-proof)
    ms_per_token_layer: float
    threads: int
    calls: int
    pcie_gb_per_s: float | None = None   # --pcie-load: the host -> device copies' rate during these calls
    bits: float | None = None            # the EXL2 bits per weight asked for (bpw above: what is read)
    gb_per_s_per_thread: float | None = None
    read_gbps: float | None = None       # the machine's read bandwidth for this team size, just before
    bandwidth_fraction: float | None = None
    kernel: str = "torch"                # what computed it: the CPU kernel's vector path, or torch


def _pool(shape: str, format: str, bits: float, pool_bytes: int, templates: int, seed: int) -> tuple[ce.CpuExperts, float]:
    """A store of distinct copies of a few synthetic experts, at least pool_bytes in `format`."""
    s = SHAPES[shape]
    h, i = s.hidden, s.expert_intermediate
    gen = torch.Generator().manual_seed(seed)
    src = [{"gate": _random_linear(i, h, bits, gen), "up": _random_linear(i, h, bits, gen),
            "down": _random_linear(h, i, bits, gen)} for _ in range(templates)]
    tmpl = [ce.convert_expert(e, format, f"{shape}.expert{j}") for j, e in enumerate(src)]
    per = ce.CpuExperts(format, h, i, [tmpl[0].clone()]).expert_bytes()
    n = max(templates, -(-pool_bytes // per), s.experts_per_token * 2)
    store = ce.CpuExperts(format, h, i, [tmpl[j % templates].clone() for j in range(n)])
    return store, per / ce.stored_expert_bytes(src[0])


def bench_store(store: ce.CpuExperts, rows: int, top_k: int, calls: int, seed: int = 0) -> tuple[list[float], list[int]]:
    """Times `calls` forwards with random routing -> (wall s, process CPU s, bytes read) per call."""
    gen = torch.Generator().manual_seed(seed)
    times, cpu, nbytes = [], [], []
    for c in range(calls + 3):                      # three warm-up calls
        x = torch.randn(rows, store.hidden, generator=gen)
        ids = torch.stack([torch.randperm(store.num_experts, generator=gen)[:top_k] for _ in range(rows)])
        w = torch.softmax(torch.randn(rows, top_k, generator=gen), dim=1)
        c0, t0 = time.process_time(), time.perf_counter()
        store.forward(x, ids, w)
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        if c >= 3:
            times.append(dt)
            cpu.append(dc)
            nbytes.append(len(torch.unique(ids)) * store.expert_bytes())
    return times, cpu, nbytes


class PcieLoad:
    """Page-locked host -> device copies of `nbytes`, back to back on a side stream, from a thread,
    while the block runs; `gb_per_s()` is their rate over a window (`mark()` starts one)."""

    def __init__(self, nbytes: int = 256 << 20):
        if not torch.cuda.is_available():
            raise RuntimeError("--pcie-load needs a CUDA device")
        self.src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self.dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        self.stream = torch.cuda.Stream()
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.bytes = 0
        self.t0 = self.b0 = 0.0
        self.error: BaseException | None = None

    def _run(self) -> None:
        try:
            with torch.cuda.stream(self.stream):
                while not self.stop.is_set():
                    for _ in range(4):
                        self.dst.copy_(self.src, non_blocking=True)
                    self.stream.synchronize()            # releases the GIL while the copies run
                    with self.lock:
                        self.bytes += 4 * self.src.numel()
        except BaseException as e:                       # reported by gb_per_s
            self.error = e

    def mark(self) -> None:
        with self.lock:
            self.t0, self.b0 = time.perf_counter(), self.bytes

    def gb_per_s(self) -> float:
        if self.error is not None:
            raise RuntimeError(f"PCIe load failed: {self.error}")
        with self.lock:
            return (self.bytes - self.b0) / max(time.perf_counter() - self.t0, 1e-9) / 1e9

    def __enter__(self) -> "PcieLoad":
        self.thread = threading.Thread(target=self._run, name="pcie-load", daemon=True)
        self.thread.start()
        time.sleep(0.5)                                  # past the first copies
        self.mark()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()


def pcie_alone(seconds: float = 2.0) -> float:
    """The copies' rate with nothing else running (GB/s)."""
    with PcieLoad() as load:
        time.sleep(seconds)
        return load.gb_per_s()


def run_bench(shapes: Sequence[str] = DEFAULT_SHAPES, formats: Sequence[str] = ce.FORMATS,
              rows: Sequence[int] = (1, 4), bits: float | Sequence[float] = 3.0, pool_mb: int = 1024, calls: int = 30,
              threads: int | Sequence[int] | None = None, progress: Callable[[str], None] | None = None,
              load: PcieLoad | None = None, read_mb: int = 0) -> list[BenchRow]:
    """Rows for every shape, bits, format, team size (threads: one, several, or None for torch's) and row
    count; read_mb > 0: the read bandwidth of a team of the same size is measured over that many MB just
    before each row, and the row's bandwidth_fraction computed (the CPU kernel's read_gbps)."""
    before = torch.get_num_threads()
    teams = [before] if threads is None else [threads] if isinstance(threads, int) else list(threads)
    widths = [bits] if isinstance(bits, (int, float)) else list(bits)
    out = []
    try:
        for shape in shapes:
            if shape not in SHAPES or not SHAPES[shape].is_moe:
                raise ValueError(f"shape {shape!r} is not an MoE shape; choose from "
                                 f"{[k for k, v in SHAPES.items() if v.is_moe]}")
            for b in widths:
                for f in formats:
                    if f == "exl2" and (why := ce.kernel_unavailable_reason()):
                        if progress:
                            progress(f"{shape} exl2 skipped: {why}")
                        continue
                    store, ratio = _pool(shape, f, b, pool_mb << 20, templates=2, seed=0)
                    for team in teams:
                        torch.set_num_threads(team)
                        out += _rows(shape, store, ratio, f, b, rows, calls, progress, load, read_mb)
                    del store
    finally:
        torch.set_num_threads(before)
    return out


def _rows(shape, store, ratio, f, bits, rows, calls, progress, load, read_mb) -> list[BenchRow]:
    top_k, team, out = SHAPES[shape].experts_per_token, torch.get_num_threads(), []
    kernel = ce.load_kernel().isa() if f == "exl2" else "torch"
    for t in rows:
        read = ce.load_kernel().read_gbps(team, read_mb << 20, 3) if read_mb else None
        if load is not None:
            load.mark()
        times, cpu, nbytes = bench_store(store, t, top_k, calls)
        med = statistics.median(times)
        gbs = statistics.median(nbytes) / med / 1e9
        r = BenchRow(shape, store.hidden, store.inter, f, t, top_k, round(store.bits_per_weight(), 3), round(ratio, 3),
                     store.num_experts, med * 1e3, min(times) * 1e3, statistics.median(cpu) * 1e3, gbs,
                     statistics.median(nbytes) / statistics.median(cpu) / 1e9, med * 1e3 / t, team, calls,
                     load.gb_per_s() if load is not None else None, bits, gbs / team, read,
                     gbs / read if read else None, kernel)
        out.append(r)
        if progress:
            progress(format_row(r))
    return out


def format_row(r: BenchRow) -> str:
    return (f"{r.shape:14s} {r.format:5s} {r.threads:2d} thr T={r.rows}  {r.bpw:5.2f} bpw (x{r.bytes_ratio:4.2f})  "
            f"{r.ms_per_call:8.3f} ms/call (min {r.ms_per_call_min:7.3f}, cpu {r.cpu_ms_per_call:7.3f})  "
            f"{r.gb_per_s:6.1f} GB/s ({r.gb_per_cpu_s:5.1f}/cpu-s)  {r.ms_per_token_layer:7.3f} ms/token/layer"
            + (f"  read {r.read_gbps:5.1f} GB/s: {r.bandwidth_fraction:4.0%}" if r.read_gbps else "")
            + (f"  PCIe copies beside it {r.pcie_gb_per_s:5.1f} GB/s" if r.pcie_gb_per_s is not None else ""))


def numa_nodes() -> int:
    """NUMA nodes of this machine (Linux sysfs; 1 where it cannot tell)."""
    import glob
    return max(1, len(glob.glob("/sys/devices/system/node/node[0-9]*")))


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    ok = ce.kernel_unavailable_reason() is None
    return {"cpu": cpu, "cores": os.cpu_count(), "numa_nodes": numa_nodes(), "torch": torch.__version__,
            "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
            "kernel_isa": ce.load_kernel().isa() if ok else None,
            "kernel_isa_supported": ce.load_kernel().isa_supported() if ok else None}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.cpu_experts", description=__doc__.split("\n")[0])
    p.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES))
    p.add_argument("--formats", nargs="+", default=list(ce.FORMATS), choices=ce.FORMATS)
    p.add_argument("--rows", nargs="+", type=int, default=[1, 4])
    p.add_argument("--bits", nargs="+", type=float, default=[3.0],
                   help="EXL2 bits per weight of the experts (default 3.0; several: one pass each)")
    p.add_argument("--pool-mb", type=int, default=1024, help="bytes of experts per format (beyond the LLC)")
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--threads", nargs="+", type=int, default=None, help="team sizes (default torch's)")
    p.add_argument("--isa", default="auto", choices=("auto", "avx512_vnni", "avx2", "scalar"),
                   help="the CPU kernel's vector path (default the best this CPU runs)")
    p.add_argument("--read-mb", type=int, default=256, help="MB streamed to measure the read bandwidth (0: not)")
    p.add_argument("--json", default=None, help="write the figures to this JSON file")
    p.add_argument("--pcie-load", action="store_true",
                   help="keep host -> device copies running beside the CPU kernel (needs a CUDA device)")
    a = p.parse_args(argv)
    if a.isa != "auto" and not ce.load_kernel().set_isa(a.isa):
        p.error(f"--isa {a.isa}: this CPU runs {ce.load_kernel().isa_supported()} at best")
    info = machine()
    read_mb = a.read_mb if ce.kernel_unavailable_reason() is None else 0
    print(f"# {info['cpu']}, {info['cores']} cores, {info['numa_nodes']} NUMA node(s), threads "
          f"{a.threads or torch.get_num_threads()}, load {info['load_average']}, kernel {info['kernel_isa']}", flush=True)
    say = lambda s: print(s, flush=True)                 # noqa: E731
    if read_mb:
        info["read_gbps"] = {str(t): ce.load_kernel().read_gbps(t, read_mb << 20, 3)
                             for t in (a.threads or [torch.get_num_threads()])}
        say("# read bandwidth: " + ", ".join(f"{t} threads {g:.1f} GB/s" for t, g in info["read_gbps"].items()))
    if a.pcie_load:
        if not torch.cuda.is_available():
            p.error("--pcie-load needs a CUDA device")
        info["pcie_alone_gb_per_s"] = pcie_alone()
        say(f"# host -> device copies alone: {info['pcie_alone_gb_per_s']:.1f} GB/s")
        with PcieLoad() as load:
            rows = run_bench(a.shapes, a.formats, a.rows, a.bits, a.pool_mb, a.calls, a.threads, say, load, read_mb)
    else:
        rows = run_bench(a.shapes, a.formats, a.rows, a.bits, a.pool_mb, a.calls, a.threads, say, read_mb=read_mb)
    info["load_average_end"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    if a.json:
        from datetime import datetime, timezone
        with open(a.json, "w") as f:
            from bench.engine import git_commit
            json.dump({"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "git_commit": git_commit(),
                       "machine": info, "device": "cpu", "model": a.shapes, "bits": a.bits, "pool_mb": a.pool_mb,
                       "threads": a.threads, "isa": info["kernel_isa"],
                       "notes": "synthetic EXL2 experts, uniform routing over a pool beyond the LLC; "
                                "bandwidth_fraction = gb_per_s / read_gbps of a team of the same size, "
                                "measured just before each row",
                       "results": [asdict(r) for r in rows]}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
