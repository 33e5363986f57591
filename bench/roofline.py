"""The roofline a benchmark reports beside its speeds: tokens/s if a decode step only had to read its
weights once, at the bandwidth measured on the machine it ran on.

- CPU engines: host memory read bandwidth (`memory_read_gbps` below) / the weight bytes per
  token the engine reports (`weight_bytes_per_token`).
- CUDA engines: HBM copy bandwidth, read plus write (`hbm_bandwidth` below) / the same bytes
  (for the EXL2 engine, which reports none, from the folder's tensor sizes: bench/weight_bytes.py). With expert offload, where the telemetry gives the expert hit rate and the bytes
  per token by part, the placement's bound too (runtime/offload/placement.py `bytes_roofline`): the
  resident share of the top-k experts and the dense weights from HBM, the cold share over PCIe (pinned
  host->device bandwidth, `pinned_h2d_bandwidth` below) or, the CPU path's share, from host RAM.

The ceilings are measured before the model loads (`measure_ceilings`); the worker benchmark measures
them in a child process (`measure_ceilings_apart`), so that its own process holds no CUDA context (a few
hundred MB of VRAM) while the worker runs: the worker meets the GPU as the app's would.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

GB = 1e9


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def memory_read_gbps() -> float:
    """Host memory read bandwidth, GB/s: best of a few sums over a 256 MB tensor."""
    import torch
    x = torch.ones(64 * 2**20, dtype=torch.float32)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best / 1e9


def sync_time(fn) -> float:
    """Seconds `fn` takes on the GPU, synchronised before and after."""
    import torch
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t


def hbm_bandwidth(nbytes: int = 4 << 30, reps: int = 10) -> float:
    """Device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    import torch
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)

    def copies():
        for _ in range(reps):
            dst.copy_(src)
    dt = sync_time(copies) / reps
    src = dst = None
    torch.cuda.empty_cache()
    return 2 * nbytes / dt


def pinned_h2d_bandwidth(nbytes: int = 1 << 30, reps: int = 5) -> float:
    """Host (page-locked) to device copy bandwidth in bytes/s."""
    import torch
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst.copy_(src, non_blocking=True)

    def copies():
        for _ in range(reps):
            dst.copy_(src, non_blocking=True)
    dt = sync_time(copies) / reps
    src = dst = None
    torch.cuda.empty_cache()
    return nbytes / dt


def measure_ceilings(cuda: bool) -> dict[str, float]:
    """Bandwidths in GB/s: host memory read; with `cuda`, HBM copy and pinned host->device too."""
    out = {"host_read_gbps": memory_read_gbps()}
    if cuda:
        out["hbm_copy_gbps"] = hbm_bandwidth() / GB
        out["pinned_h2d_gbps"] = pinned_h2d_bandwidth() / GB
    return out


def measure_ceilings_apart(backend: str, timeout: float = 300.0) -> dict[str, float]:
    """`measure_ceilings` in a child process (CUDA's when `backend` is not "cpu" and a GPU is there);
    what it could not measure is left out and the roofline then says it is not computed."""
    code = ("import json, sys; from bench.roofline import cuda_available, measure_ceilings; "
            f"print(json.dumps(measure_ceilings(cuda={backend != 'cpu'!r} and cuda_available())))")
    root = Path(__file__).resolve().parent.parent
    try:
        out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                             timeout=timeout, check=True).stdout
        got = json.loads(out.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as e:
        print(f"bench-worker: bandwidths not measured ({type(e).__name__}): no roofline", file=sys.stderr)
        return {}
    return {k: float(v) for k, v in got.items() if isinstance(v, (int, float))}


def _placement(tel: dict, ceilings: dict) -> Optional[dict[str, Any]]:
    """The offloaded placement's bound from the telemetry's hit rate, or None where it lacks what is needed."""
    from runtime.offload.placement import bytes_roofline
    hit, parts = tel.get("expert_hit_rate"), tel.get("weight_bytes_per_token_parts") or {}
    if hit is None or not parts.get("experts") or "pinned_h2d_gbps" not in ceilings:
        return None
    experts, total = parts["experts"], parts["total"]
    cold = experts * (1.0 - hit)
    cpu = min(cold, tel.get("cpu_expert_bytes_per_token") or 0.0)    # the CPU path's share of the cold picks
    r = bytes_roofline(total - cold, cold - cpu, cpu, ceilings["hbm_copy_gbps"] * GB,
                       ceilings["pinned_h2d_gbps"] * GB, ceilings["host_read_gbps"] * GB)
    return dict(r, hit_rate=hit, hbm_bytes_per_token=total - cold, pcie_bytes_per_token=cold - cpu,
                cpu_bytes_per_token=cpu)


def roofline(tel: dict, backend: str, ceilings: dict) -> dict[str, Any]:
    """`roofline_tps` and how it was computed (`roofline_note`), from an engine's telemetry and the
    measured ceilings (GB/s, `measure_ceilings`); with offload also the all-resident bound and the
    placement's (`roofline_all_resident_tps`, `roofline_placement`)."""
    out: dict[str, Any] = {"roofline_tps": None, "roofline_all_resident_tps": None, "roofline_placement": None}
    weight_bytes = tel.get("weight_bytes_per_token") or tel.get("weight_bytes")
    if not weight_bytes:
        return dict(out, roofline_note="roofline not computed (the engine reports no weight bytes per token)")
    per = f"{weight_bytes / 1e6:.1f} MB of weights read per token"
    if backend == "cpu":
        if "host_read_gbps" not in ceilings:
            return dict(out, roofline_note=f"roofline not computed (host memory bandwidth not measured); {per}")
        gbps = ceilings["host_read_gbps"]
        return dict(out, roofline_tps=gbps * GB / weight_bytes,
                    roofline_note=f"roofline = host memory read {gbps:.1f} GB/s (measured now) / {per}")
    if "hbm_copy_gbps" not in ceilings:
        return dict(out, roofline_note=f"roofline not computed (no CUDA device in the benchmark's process to "
                                       f"measure HBM bandwidth on); {per}")
    hbm = ceilings["hbm_copy_gbps"]
    resident = hbm * GB / weight_bytes
    note = (f"roofline = HBM copy bandwidth {hbm:.0f} GB/s (read+write, measured before the load) / {per} "
            "(dense weights, one embedding row, the head, top-k experts per MoE layer; KV cache not counted)")
    if "expert_hit_rate" not in tel:
        return dict(out, roofline_tps=resident, roofline_all_resident_tps=resident, roofline_note=note)
    place = _placement(tel, ceilings)
    if place is None:
        return dict(out, roofline_tps=resident, roofline_all_resident_tps=resident,
                    roofline_note=note + "; experts are offloaded and the telemetry does not say enough for the "
                                         "placement's bound: this all-resident roofline is an upper bound")
    return dict(out, roofline_tps=place["overlapped_tps"], roofline_all_resident_tps=resident,
                roofline_placement=place,
                roofline_note=(f"roofline = the offloaded placement's bound, overlapped: expert hit rate "
                               f"{place['hit_rate']:.1%} (the worker's telemetry); dense weights and resident "
                               f"experts from HBM ({hbm:.0f} GB/s), cold experts over PCIe (pinned host->device "
                               f"{ceilings['pinned_h2d_gbps']:.1f} GB/s) or read by the CPU path from RAM "
                               f"({ceilings['host_read_gbps']:.1f} GB/s), all measured before the load; "
                               f"serial {place['serial_tps']:.1f} tok/s; all experts resident {resident:.1f} "
                               f"tok/s. {note}"))
