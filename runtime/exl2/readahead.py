"""Reading the converter's next layer from disk while it quantizes this one.

The converter reads a layer's tensors through safetensors' memory map when the layer starts; for a model
larger than the RAM (Qwen3.5-122B-A10B: 244 GB in bf16, ~5 GB a layer) that is a disk read the GPU waits for.
`Readahead.start(i)` reads the byte ranges of layer i's tensors in a thread with plain file reads (which
release the GIL), so the operating system's page cache holds them when the layer starts. The converter's
own reading is unchanged: the thread only warms the cache, and a header it cannot make sense of only
means that nothing is read ahead.
"""
from __future__ import annotations

import json
import re
import threading
from pathlib import Path
from typing import Mapping

HEADER_MAX = 100 << 20        # bytes of a safetensors header at most (safetensors' own limit)
CHUNK = 16 << 20              # bytes per read
LAYER = re.compile(r"(?:^|\.)(?:layers|blocks)\.(\d+)\.")


def layer_of(name: str) -> int | None:
    """The decoder layer a checkpoint tensor belongs to (`model.layers.3.`, `transformer.blocks.3.`; the MTP
    head's own layers are not the decoder's)."""
    m = None if name.startswith("mtp.") else LAYER.search(name)
    return int(m.group(1)) if m else None


def tensor_ranges(path: Path) -> dict[str, tuple[int, int]]:
    """Byte ranges [start, end) of the tensors of a safetensors file, from its header; {} where the header is not
    one (too long, not JSON, offsets outside the file)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if not 0 < n <= min(HEADER_MAX, size - 8):
                return {}
            header = json.loads(f.read(n))
    except (OSError, ValueError):
        return {}
    out = {}
    for name, info in header.items() if isinstance(header, dict) else ():
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if (isinstance(offsets, list) and len(offsets) == 2 and all(type(v) is int for v in offsets)
                and 0 <= offsets[0] <= offsets[1] <= size - 8 - n):
            out[name] = (8 + n + offsets[0], 8 + n + offsets[1])
    return out


class Readahead:
    """Reads one layer's tensors ahead at a time (start(i) stops a read still going for another layer)."""

    def __init__(self, shard_of: Mapping[str, Path]):
        self.shard_of = shard_of
        self._ranges: dict[Path, dict[str, tuple[int, int]]] = {}
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.bytes_read = 0

    def _spans(self, layer: int) -> list[tuple[Path, int, int]]:
        """(file, start, end) of the layer's tensors, neighbours in a file merged."""
        spans: dict[Path, list[tuple[int, int]]] = {}
        for name, shard in self.shard_of.items():
            if layer_of(name) != layer:
                continue
            if shard not in self._ranges:
                self._ranges[shard] = tensor_ranges(Path(shard))
            if name in self._ranges[shard]:
                spans.setdefault(Path(shard), []).append(self._ranges[shard][name])
        out = []
        for shard, ranges in spans.items():
            ranges.sort()
            start, end = ranges[0]
            for s, e in ranges[1:]:
                if s > end + CHUNK:
                    out.append((shard, start, end))
                    start = s
                end = max(end, e)
            out.append((shard, start, end))
        return out

    def _read(self, spans: list[tuple[Path, int, int]], stop: threading.Event) -> None:
        buf = memoryview(bytearray(CHUNK))
        for shard, start, end in spans:
            try:
                with open(shard, "rb", buffering=0) as f:
                    f.seek(start)
                    while start < end and not stop.is_set():
                        got = f.readinto(buf[:min(CHUNK, end - start)])
                        if not got:
                            break
                        start += got
                        self.bytes_read += got
            except OSError:
                return

    def start(self, layer: int) -> None:
        self.close()
        spans = self._spans(layer)
        if spans:
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._read, args=(spans, self._stop), daemon=True,
                                            name=f"readahead-layer-{layer}")
            self._thread.start()

    def close(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
