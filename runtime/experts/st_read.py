"""Tensors of a safetensors file as host tensors over the file mapped in memory: no read until used.

The CUDA engine's expert load (runtime/experts/exl2_module.py) reads the experts' EXL2 tensors
through this instead of exllamav2's loader, which reads every tensor into a fresh pageable buffer,
copies it to the GPU and waits for the device twice (per tensor: 5 for each expert's projection,
~92,000 for a 128-expert, 48-layer model). Here a tensor is a read-only view of the mapping
(never written: only copied from); runtime/experts/pack.py gathers a batch of experts
from it on a few threads into page-locked memory (`copy_into`: read from the file itself, not through
the mapping's page faults) and copies the batch to the GPU at once.

The header (offsets, dtype, shape) is the caller's: exllamav2's STFile parsed it (its key map
applied). `tensor` checks the entry against the file, so a truncated file is an error naming it.
"""
from __future__ import annotations

import ctypes
import math
import mmap
import os
import warnings
from typing import Mapping

import torch

DTYPES = {"I32": torch.int32, "I16": torch.int16, "F16": torch.float16, "BF16": torch.bfloat16,
          "F32": torch.float32, "I64": torch.int64, "U8": torch.uint8, "I8": torch.int8}


_REGIONS: dict[int, tuple[int, int]] = {}     # open mappings: base address -> (file descriptor, length)


class MappedFiles:
    """Open mappings by file name; tensors keep their mapping alive after `close`."""

    def __init__(self):
        self._maps: dict[str, tuple[mmap.mmap, int, int]] = {}     # name -> (mapping, descriptor, base address)

    def _map(self, filename: str) -> mmap.mmap:
        if filename not in self._maps:
            fd = os.open(filename, os.O_RDONLY)
            try:
                m = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
            except BaseException:
                os.close(fd)
                raise
            base = _view(m, 1, 0).data_ptr() if len(m) else 0
            self._maps[filename] = (m, fd, base)
            _REGIONS[base] = (fd, len(m))
        return self._maps[filename][0]

    def tensor(self, filename: str, data_start: int, entry: Mapping, name: str) -> torch.Tensor:
        """The tensor `entry` (a safetensors header entry: dtype, shape, data_offsets relative to
        `data_start`, the first byte after the header) of `filename`, named `name` in errors."""
        dtype = DTYPES.get(entry.get("dtype"))
        if dtype is None:
            raise ValueError(f"{name} in {filename}: dtype {entry.get('dtype')!r} is not supported")
        shape = [int(d) for d in entry["shape"]]
        beg, end = (int(x) for x in entry["data_offsets"])
        size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        m = self._map(filename)
        if end - beg != size or beg < 0 or data_start + end > len(m):
            raise ValueError(f"{name} in {filename}: bytes {beg}..{end} after the header do not hold {shape} "
                             f"{entry['dtype']} within the file's {len(m)} bytes (truncated or damaged?)")
        if size == 0:
            return torch.empty(shape, dtype=dtype)
        return _view(m, size, data_start + beg).view(dtype).view(shape)

    def close(self) -> None:
        """Forget the mappings (each is unmapped once no tensor uses it) and close the files."""
        for _, fd, base in self._maps.values():
            _REGIONS.pop(base, None)
            os.close(fd)
        self._maps.clear()


_PREADV = hasattr(os, "preadv")          # not on Windows: there the bytes come through the mapping


def _view(m: mmap.mmap, count: int, offset: int) -> torch.Tensor:
    with warnings.catch_warnings():           # a read-only buffer: torch warns that writes would fail
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(m, dtype=torch.uint8, count=count, offset=offset)


def copy_into(out: torch.Tensor, t: torch.Tensor) -> None:
    """out.copy_(t); where `t` is a view of an open mapping and `out` contiguous host memory of its
    bytes, read from the file straight into `out` (no page faults on the mapping: ~2-4x faster)."""
    n = t.numel() * t.element_size()
    if _PREADV and out.device.type == "cpu" and out.dtype == t.dtype and out.shape == t.shape \
            and out.is_contiguous() and t.is_contiguous() and n:
        addr = t.data_ptr()
        for base, (fd, length) in list(_REGIONS.items()):
            if base <= addr and addr + n <= base + length:
                dst = memoryview((ctypes.c_char * n).from_address(out.data_ptr())).cast("B")
                done = 0
                while done < n:
                    got = os.preadv(fd, [dst[done:]], addr - base + done)
                    if got <= 0:
                        break
                    done += got
                if done == n:
                    return
                break
    out.copy_(t)
