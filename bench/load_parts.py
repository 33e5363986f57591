"""Where the expert load's time goes, one MoE layer of an EXL2 folder at a time, projected to the model.

    python -m bench.load_parts --model DIR [--layer 0] [--device cuda|cpu] [--out bench/results]

Parts, each timed on the layer's real tensors (the folder's files are read as they lie in the page cache):
- per_tensor_read: every expert tensor read on its own, as the load read them before: exllamav2's
  reader to the device where exllamav2 imports (a fresh pageable buffer, a copy, two device waits per
  tensor), else safetensors' (a copy into fresh host memory);
- per_expert_repack: those tensors repacked one expert per batch (a wait per expert: the old path's
  pattern) into a host arena whose blocks are page-locked before the clock starts (the load does that
  ahead, on a thread);
- mapped_gather: the new path's host side alone: views of the mapped file gathered batch by batch
  (threads) into (page-locked) host buffers, nothing unpacked;
- batched_load: the load as it is now, end to end for the layer: tensors read as views of the mapped
  file, gathered a batch at a time (threads) into page-locked memory, repacked on the device, copied
  into the arena.
The page-locking of the arena itself (~2.7 s per 4 GiB on the H200, overlapped) is not in these parts.
"""
from __future__ import annotations

import argparse
import json
import struct
import time
from pathlib import Path

import torch

from bench.engine import git_commit, machine
from runtime import cpu_load
from runtime.experts import pack
from runtime.experts.pack import HostArena, pack_layer
from runtime.experts.st_read import MappedFiles

KEYS = ("q_weight", "q_scale", "q_scale_max", "q_groups", "q_invperm", "q_scale_exact")   # the last: where stored
ROLES = {"down_proj": ("down_proj", "w2"), "gate_proj": ("gate_proj", "w1"), "up_proj": ("up_proj", "w3", "v1")}


def _headers(folder: Path) -> dict[str, tuple[Path, int, dict]]:
    """Tensor name -> (file, first data byte, header entry), over the folder's safetensors files."""
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with open(f, "rb") as fp:
            n = struct.unpack("<Q", fp.read(8))[0]
            header = json.loads(fp.read(n))
        header.pop("__metadata__", None)
        out.update({k: (f, 8 + n, v) for k, v in header.items()})
    return out


def layer_experts(index: dict, layer: int) -> dict[str, list[str]]:
    """Projection -> the layer's expert prefixes (`...experts.<e>.<name>`), in expert order."""
    found: dict[str, dict[int, str]] = {r: {} for r in ROLES}
    for key in index:
        parts = key.split(".")
        if key.endswith(".q_weight") and ".experts." in key and f".{layer}." in f".{'.'.join(parts[:3])}.":
            prefix = key[: -len(".q_weight")]
            e, name = int(parts[-3]), parts[-2]
            for role, names in ROLES.items():
                if name in names:
                    found[role][e] = prefix
    if not all(found.values()):
        raise SystemExit(f"layer {layer}: no EXL2 experts found (projections {[r for r, v in found.items() if v]})")
    return {r: [v[e] for e in sorted(v)] for r, v in found.items()}


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _arena(dev: torch.device, nbytes: int) -> HostArena:
    """An arena with its block page-locked already (the load page-locks ahead, on a thread)."""
    arena = HostArena(block_bytes=1 << max(20, (nbytes + (1 << 20)).bit_length()))
    arena.empty((16,))
    arena.used = 0
    return arena


def measure(folder: Path, layer: int, dev: torch.device, first: int = 0) -> dict:
    """The parts' seconds for the layer's experts (the first `first` of them only, when given: slow
    machines; `per_layer` then scales the times to the whole layer)."""
    index = _headers(folder)
    experts = layer_experts(index, layer)
    total = len(experts["down_proj"])
    if first:
        experts = {r: v[:first] for r, v in experts.items()}
    nbytes = sum(index[f"{p}.{k}"][2]["data_offsets"][1] - index[f"{p}.{k}"][2]["data_offsets"][0]
                 for ps in experts.values() for p in ps for k in KEYS if f"{p}.{k}" in index)
    try:
        from exllamav2.stloader import STFile
        reader = "exllamav2" if dev.type == "cuda" else None
    except Exception:
        reader = None
    if reader is None:
        from safetensors import safe_open
        opened = {f: safe_open(str(f), "pt") for f, _, _ in index.values()}
        reader = "safetensors"

    def read_old(role: str) -> list[dict]:
        out = []
        for p in experts[role]:
            t = {}
            for k in (k for k in KEYS if f"{p}.{k}" in index):
                f, _, _ = index[f"{p}.{k}"]
                t[k] = (STFile.open(str(f)).get_tensor(f"{p}.{k}", device=dev) if reader == "exllamav2"
                        else opened[f].get_tensor(f"{p}.{k}"))
            out.append(t)
        return out

    cores = cpu_load.physical_cores()
    res = {"experts": len(experts["down_proj"]), "expert_bytes": nbytes, "reader": reader,
           "torch_threads_before": torch.get_num_threads(), "load_threads": max(cores, torch.get_num_threads())}
    for role in ROLES:                                # untimed: the files' pages warm, kernels loaded
        read_old(role)
    _sync(dev)
    t = time.perf_counter()
    old = {r: read_old(r) for r in ROLES}
    _sync(dev)
    res["per_tensor_read_s"] = time.perf_counter() - t
    keep = pack.CHUNK_ELEMENTS
    files = MappedFiles()                             # the new path's host side alone: views gathered in batches
    t = time.perf_counter()

    def gather_all() -> None:
        for role in ROLES:
            ts = [{k: files.tensor(str(index[f"{p}.{k}"][0]), index[f"{p}.{k}"][1], index[f"{p}.{k}"][2], k)
                   for k in KEYS if f"{p}.{k}" in index} for p in experts[role]]
            K, N = ts[0]["q_invperm"].numel(), ts[0]["q_weight"].shape[-1]
            step = max(1, keep // (K * N))
            for e0 in range(0, len(ts), step):
                pack._gather(ts[e0:e0 + step], dev, pack._layout(ts[e0], "gather").unpacked)
    cpu_load.on_cores(cores, gather_all)
    res["mapped_gather_s"] = time.perf_counter() - t
    files.close()
    for label, chunk, load in (("per_expert_repack_s", 1, old.__getitem__), ("batched_load_s", keep, None)):
        files = MappedFiles()
        if load is None:
            def load(role, files=files):
                return [{k: files.tensor(str(index[f"{p}.{k}"][0]), index[f"{p}.{k}"][1], index[f"{p}.{k}"][2],
                                         f"{p}.{k}") for k in KEYS if f"{p}.{k}" in index} for p in experts[role]]
        arena = _arena(dev, 2 * nbytes)
        pack.CHUNK_ELEMENTS = chunk
        try:
            _sync(dev)
            t = time.perf_counter()
            packs = cpu_load.on_cores(cores, pack_layer, load, f"layer {layer}", device=dev, host=arena)
            _sync(dev)
            res[label] = time.perf_counter() - t
        finally:
            pack.CHUNK_ELEMENTS = keep
        res.setdefault("packed_bytes", sum(p.cold.numel() * 4 for p in packs))
        del packs, arena
        files.close()
    res["old_s"] = res["per_tensor_read_s"] + res["per_expert_repack_s"]
    res["speedup"] = res["old_s"] / res["batched_load_s"]
    scale = total / res["experts"]
    res["per_layer"] = {k: res[k] * scale for k in ("per_tensor_read_s", "per_expert_repack_s", "old_s",
                                                    "mapped_gather_s", "batched_load_s")}
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Time one MoE layer's expert load, part by part")
    ap.add_argument("--model", required=True, help="EXL2 model folder")
    ap.add_argument("--layer", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--experts", type=int, default=0, help="time the first N experts only (scaled to the layer)")
    ap.add_argument("--label", default=None)
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args(argv)
    folder = Path(a.model)
    cfg = json.loads((folder / "config.json").read_text())
    layers = cfg.get("num_hidden_layers") or cfg.get("n_layers")
    r = measure(folder, a.layer, torch.device(a.device), a.experts)
    r["model_layers_in_folder"] = layers
    label = a.label or folder.name
    print(json.dumps(r, indent=1))
    result = {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "git_commit": git_commit(), "machine": machine(),
              "device": torch.cuda.get_device_name(0) if a.device.startswith("cuda") else "cpu",
              "benchmark": "expert load parts, one MoE layer", "model": label, "layer": a.layer, "parts": r,
              "notes": "seconds for one layer's experts (gate, up, down of every expert); old = per_tensor_read + "
                       "per_expert_repack (the load's pattern before batching), batched_load = the load now. "
                       "per_layer: scaled to all the layer's experts; multiply by the model's MoE layers for a "
                       "whole load's expert part."}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"load-parts-{label}-{a.device.split(':')[0]}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(result, indent=1, default=str))
    print("wrote", path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
