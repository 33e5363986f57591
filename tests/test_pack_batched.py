"""The load's batched expert repacking (runtime/experts/pack.py) writes the same bits as the per-expert
repacking it replaced (tests/pack_per_expert.py), from tensors read over the mapped model files
(runtime/experts/st_read.py), on a synthetic model's real tensors too."""
from __future__ import annotations

import json
import struct

import pytest
import torch

from runtime.exl2 import format as exl2
from runtime.experts import pack
from runtime.experts.pack import HostArena, PackError, pack_experts, pack_layer
from runtime.experts.st_read import MappedFiles
from tests.pack_per_expert import pack_experts_v1


def _q(out, inp, bits, gs=32, seed=0, bits_prop=None):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=g) * 0.05
    return exl2.quantize(w, bits, gs, perm=torch.randperm(inp, generator=g), bits_prop=bits_prop)


def _same(a, b):
    assert (a.bits, a.group, a.in_features, a.out_features) == (b.bits, b.group, b.in_features, b.out_features)
    assert torch.equal(a.qweight, b.qweight) and torch.equal(a.scales, b.scales) and torch.equal(a.perm, b.perm)
    assert torch.equal(a.woff, b.woff) and (a.cold is None) == (b.cold is None)


@pytest.mark.parametrize("chunk", [pack.CHUNK_ELEMENTS, 3 * 96 * 64, 40 * 64])
@pytest.mark.parametrize("bits,props", [(3, None), (4, None), ([4, 3], [0.5, 0.5]), ([6, 4], [0.25, 0.75])])
def test_batched_repack_equals_the_per_expert_repack_bit_for_bit(monkeypatch, chunk, bits, props):
    """Experts of two layouts (a run of one bit mix, then another, then the first again), batches cut
    by CHUNK_ELEMENTS and by layout changes, with and without column orders, in host-arena stacks too;
    with a CHUNK_ELEMENTS below one expert's codes, each expert in ranges of 40 columns (40, 40, 16)."""
    monkeypatch.setattr(pack, "CHUNK_ELEMENTS", chunk)
    E, N, K = 9, 96, 64
    experts = [_q(N, K, bits if e % 5 < 3 else 4, seed=e, bits_prop=props if e % 5 < 3 else None)
               for e in range(E)]
    g = torch.Generator().manual_seed(1)
    cols = [torch.randperm(N, generator=g) for _ in range(E)]
    for columns in (None, cols):
        for host in (None, HostArena(block_bytes=1 << 20)):
            got = pack_experts(experts, "layer.1.up_proj", host=host, columns=columns)
            ref = pack_experts_v1(experts, "layer.1.up_proj", host=HostArena(1 << 20) if host else None,
                                  columns=columns)
            _same(got, ref)


def test_experts_of_one_layout_are_unpacked_in_batches(monkeypatch):
    """One unpacking per batch of experts (bounded by CHUNK_ELEMENTS), not one per expert."""
    calls = []
    real = pack._unpack_scales
    monkeypatch.setattr(pack, "_unpack_scales", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    experts = [_q(64, 64, 4, seed=e) for e in range(10)]
    pack_experts(experts, "x")
    assert calls == [10]
    calls.clear()
    monkeypatch.setattr(pack, "CHUNK_ELEMENTS", 4 * 64 * 64)
    pack_experts(experts, "x")
    assert calls == [4, 4, 2]


@pytest.mark.parametrize("columns", [False, True])
def test_an_expert_larger_than_a_chunk_is_unpacked_a_range_of_columns_at_a_time(monkeypatch, columns):
    """Mixtral-8x22B's experts hold 100M codes each (6144 x 16384), three times CHUNK_ELEMENTS: unpacked
    whole, their int64 temporaries (0.8 GB each) and the packing's took more than a tight VRAM budget
    left the load. Every unpacking stays within CHUNK_ELEMENTS codes, and the result is the same bits."""
    experts = [_q(224, 64, 3, seed=e) for e in range(3)]
    g = torch.Generator().manual_seed(2)
    cols = [torch.randperm(224, generator=g) for _ in range(3)] if columns else None
    whole = pack_experts(experts, "x", columns=cols)
    shapes = []
    real = pack._unpack_codes
    monkeypatch.setattr(pack, "_unpack_codes", lambda qw, lay: shapes.append(tuple(qw.shape)) or real(qw, lay))
    monkeypatch.setattr(pack, "CHUNK_ELEMENTS", 64 * 64)          # 64 of an expert's 224 columns
    _same(pack_experts(experts, "x", columns=cols), whole)
    assert [s[2] for s in shapes] == [64, 64, 64, 32] * 3 and all(s[0] == 1 for s in shapes)


def test_batched_repack_keeps_the_errors_that_name_the_tensor():
    good = _q(64, 64, 4)
    with pytest.raises(PackError, match=r"x\[1\]: tensor q_invperm missing"):
        pack_experts([good, {k: v for k, v in good.items() if k != "q_invperm"}], "x")
    with pytest.raises(PackError, match=r"x\[1\]: shape \(128, 64\) differs from expert 0's \(64, 64\)"):
        pack_experts([good, _q(64, 128, 4)], "x")


def _header(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return 8 + n, json.loads(f.read(n))


def test_mapped_tensors_equal_safetensors_and_a_damaged_entry_is_named(tmp_path):
    from safetensors.torch import load_file, save_file
    want = {"a": torch.arange(12, dtype=torch.int32).view(3, 4), "b": torch.randn(5).half(),
            "c": torch.tensor([7, -3], dtype=torch.int16), "d": torch.zeros((0, 4), dtype=torch.int32)}
    save_file(want, tmp_path / "m.safetensors")
    start, header = _header(tmp_path / "m.safetensors")
    files = MappedFiles()
    for k, v in load_file(tmp_path / "m.safetensors").items():
        got = files.tensor(str(tmp_path / "m.safetensors"), start, header[k], k)
        assert got.dtype == v.dtype and torch.equal(got, v)
    bad = dict(header["a"], data_offsets=[0, 40])
    with pytest.raises(ValueError, match=r"a in .*m.safetensors: bytes 0..40 .* \[3, 4\] I32"):
        files.tensor(str(tmp_path / "m.safetensors"), start, bad, "a")
    with pytest.raises(ValueError, match="dtype 'F8' is not supported"):
        files.tensor(str(tmp_path / "m.safetensors"), start, dict(header["a"], dtype="F8"), "a")
    files.close()


@pytest.mark.parametrize("shape,names", [("tiny-moe", ("gate_proj", "up_proj", "down_proj")),
                                         ("tiny-dbrx", ("w1", "v1", "w2"))])
def test_synthetic_layer_repacks_bit_for_bit_from_the_mapped_files(tmp_path, monkeypatch, shape, names):
    """A synthetic model's MoE layer, read over the mapped file and repacked in batches (as the CUDA
    load does, on the CPU here), equals the per-expert repacking of the tensors safetensors reads; its
    experts share one input order."""
    from safetensors.torch import load_file

    from runtime.exl2 import synth
    synth.write_synthetic(shape, 3.0, tmp_path / "m", layers=1)
    path = next((tmp_path / "m").glob("*.safetensors"))
    start, header = _header(path)
    whole = load_file(path)
    files = MappedFiles()
    experts = {k.rsplit(".", 2)[0] for k in header if ".experts." in k and k.endswith("q_weight")}   # [...].experts.e
    E = len(experts)
    prefix = next(iter(experts)).rsplit(".", 1)[0]
    proj = dict(zip(("gate_proj", "up_proj", "down_proj"), names))
    keys = ("q_weight", "q_scale", "q_scale_max", "q_groups", "q_invperm")

    def mapped(p):
        return [{k: files.tensor(str(path), start, header[f"{prefix}.{e}.{proj[p]}.{k}"], k) for k in keys}
                for e in range(E)]

    def read(p):
        return [{k: whole[f"{prefix}.{e}.{proj[p]}.{k}"] for k in keys} for e in range(E)]

    monkeypatch.setattr(pack, "CHUNK_ELEMENTS", 5 * 128 * 256)     # batches of 5 and a remainder
    w1, w3, w2 = pack_layer(mapped, "layer.0", host=HostArena(1 << 20))
    ref2 = pack_experts_v1(read("down_proj"), "d", host=HostArena(1 << 20))
    I = ref2.in_features
    cols = [torch.cat([ref2.perm[e].long(), torch.arange(I, w1.out_features)]) for e in range(E)]
    _same(w1, pack_experts_v1(read("gate_proj"), "g", host=HostArena(1 << 20), columns=cols))
    _same(w3, pack_experts_v1(read("up_proj"), "u", host=HostArena(1 << 20), columns=cols))
    ref2.perm.copy_(torch.arange(I, dtype=torch.int32).expand_as(ref2.perm))
    _same(w2, ref2)
    assert E > 5
    # every expert's gate and up read the input in one order (as exllamav2's converter writes MoE layers), and
    # down reads the intermediate in order: the grouped kernels permute the input once and read h in runs
    from runtime.experts.grouped import input_order
    order = input_order(w1, w3, w2)
    assert order.shared is not None and order.ordered_down
    assert torch.equal(order.shared, w1.perm[E - 1].long())


def test_batches_gathered_on_threads_under_inference_mode(monkeypatch):
    """The CUDA load repacks under torch.inference_mode(): the gathering threads write its buffers
    (inference tensors) under that mode too; every copy on a thread, batches of 4, 4, 1."""
    monkeypatch.setattr(pack, "COPY_MIN_BYTES", 1 << 10)
    monkeypatch.setattr(pack, "CHUNK_ELEMENTS", 4 * 96 * 64)
    experts = [_q(96, 64, [4, 3], seed=e, bits_prop=[0.5, 0.5]) for e in range(9)]
    with torch.inference_mode():
        got = pack_experts(experts, "x", host=HostArena(1 << 20))
    _same(got, pack_experts_v1(experts, "x", host=HostArena(1 << 20)))


def test_views_of_the_files_are_copied_by_reading_the_file(tmp_path, monkeypatch):
    """copy_into reads a mapped view's bytes from the file itself (no page faults on the mapping),
    in pieces on threads for large buffers; other tensors, and views after close, are plainly copied."""
    import os

    from safetensors.torch import save_file

    from runtime.experts import st_read
    want = {"w": torch.arange(3 * 1024, dtype=torch.int32).view(3, 1024), "s": torch.randn(7).half()}
    save_file(want, tmp_path / "m.safetensors")
    start, header = _header(tmp_path / "m.safetensors")
    reads = []
    real = os.preadv
    monkeypatch.setattr(st_read.os, "preadv", lambda fd, bufs, off: reads.append(off) or real(fd, bufs, off))
    files = MappedFiles()
    w = files.tensor(str(tmp_path / "m.safetensors"), start, header["w"], "w")
    out = torch.full((2, 3, 1024), -1, dtype=torch.int32)
    monkeypatch.setattr(pack, "COPY_MIN_BYTES", 1 << 12)          # 4 KiB pieces: 3 per tensor
    pack._copy_into(out, [w, want["w"]])
    assert torch.equal(out[0], want["w"]) and torch.equal(out[1], want["w"])
    assert sorted(reads) == [start + header["w"]["data_offsets"][0] + i * 4096 for i in range(3)]
    files.close()
    reads.clear()
    out.fill_(-1)
    st_read.copy_into(out[0], w)                                   # closed: copied from the mapping
    assert torch.equal(out[0], want["w"]) and reads == []


def test_without_preadv_views_are_copied_through_the_mapping(tmp_path, monkeypatch):
    """Windows has no os.preadv: copy_into copies from the mapping there, with the same bytes."""
    from safetensors.torch import save_file

    from runtime.experts import st_read
    want = {"w": torch.arange(2 * 512, dtype=torch.int32).view(2, 512)}
    save_file(want, tmp_path / "m.safetensors")
    start, header = _header(tmp_path / "m.safetensors")
    monkeypatch.setattr(st_read, "_PREADV", False)
    monkeypatch.delattr(st_read.os, "preadv")
    files = MappedFiles()
    w = files.tensor(str(tmp_path / "m.safetensors"), start, header["w"], "w")
    out = torch.full((2, 512), -1, dtype=torch.int32)
    st_read.copy_into(out, w)
    assert torch.equal(out, want["w"])
    files.close()


def test_the_copy_pool_s_threads_grow_no_torch_team_of_their_own():
    """The gathering's copy threads live as long as the process: torch's CPU work on them runs on the
    thread itself. A team grown there (during a load every new thread starts with every core) stayed
    docked with each of them, more OpenMP threads than CPUs for good (cpu_load.on_cores says what that
    costs the CPU expert path)."""
    import threading

    import psutil
    if "OpenMP" not in torch.__config__.parallel_info():
        pytest.skip("torch's CPU threads are not OpenMP here")
    before, proc = torch.get_num_threads(), psutil.Process()

    def native() -> set[int]:          # threads that are not Python's: OpenMP's (the pool's are Python's)
        return {t.id for t in proc.threads()} - {t.native_id for t in threading.enumerate()}
    try:
        torch.set_num_threads(4)                               # what a load's helper thread sets
        src = [torch.arange(2 << 20, dtype=torch.int32) + i for i in range(3)]
        out = torch.empty(3, 2 << 20, dtype=torch.int32)
        out.copy_(torch.stack(src))        # this thread's own team of 4 grown now, not counted below
        n0 = native()
        pack._copy_into(out, src)                              # 8 MiB rows in 4 MiB pieces, on the pool
        assert all(torch.equal(o, s) for o, s in zip(out, src))
        grown = native() - n0              # a team on each copy thread that took a piece: 6 or more
        assert not grown, f"torch teams docked on the copy threads: {len(grown)} OpenMP threads more"
    finally:
        torch.set_num_threads(before)
