"""fla's gated delta rule kernels (runtime/backends/gdn_kernels.py) against the hybrid engine's PyTorch
forms (runtime/backends/hybrid_layers.py: delta_recurrent, delta_chunked, float32 on the GPU), at the
DeltaNet widths of Qwen3.5-MoE: 16 key heads and 64 value heads of 128 (122B-A10B), 16 and 32
(35B-A3B), 4 and 32 of 32 (the tiny test model).

- prefill through the chunked kernel (fed float16, as the engine's activations) from a non-zero state,
  at lengths around and past its 64-row blocks, up to a 2K prompt (122B-A10B and tiny widths):
  outputs and final state;
- decode and verify through the recurrent kernel, row by row, with the state after each row written
  to the snapshot ring: outputs, state and every snapshot;
- the same recurrent call captured in a CUDA graph and replayed on new inputs (what the decode graphs
  do);
- the time of a 2K prefill of one layer both ways (a figure, MOEDESK_GPU_REPORT).

fla-core is in the `gpu` extra: a machine without it fails here (pip install -e '.[gpu]').
"""
from __future__ import annotations

import time

import pytest
import torch

from gpu_figures import record as _record, rel as _rel
from runtime.backends import gdn_kernels
from runtime.backends.hybrid_layers import delta_chunked, delta_recurrent
from runtime.reference import deltanet

pytestmark = pytest.mark.gpu
WIDTHS = {"122b": (16, 64, 128, 128), "35b": (16, 32, 128, 128), "tiny": (4, 32, 32, 32)}   # HK, HV, dk, dv
TOL_CHUNK = 1e-2        # float16 inputs and intermediates against float32
TOL_REC = 1e-4          # float32 both ways


@pytest.fixture(scope="module", autouse=True)
def fla():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA")
    assert gdn_kernels.ops() is not None, "fla-core is not importable: pip install -e '.[gpu]'"


def _inputs(t: int, width: str, seed: int = 0):
    hk, hv, dk, dv = WIDTHS[width]
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev = "cuda"
    q = deltanet.l2norm(torch.randn(t, hk, dk, device=dev, generator=g))
    k = deltanet.l2norm(torch.randn(t, hk, dk, device=dev, generator=g))
    v = torch.randn(t, hv, dv, device=dev, generator=g)
    decay = -torch.rand(hv, device=dev, generator=g) - 0.05                  # -exp(A_log)
    gate = decay * torch.nn.functional.softplus(torch.randn(t, hv, device=dev, generator=g))
    beta = torch.sigmoid(torch.randn(t, hv, device=dev, generator=g))
    state = torch.randn(hv, dk, dv, device=dev, generator=g) * 0.05
    return q, k, v, gate, beta, state


def _torch_form(q, k, v, g, beta):
    """What DeltaNetLayer hands the PyTorch forms: heads repeated, q scaled."""
    rep = v.shape[1] // q.shape[1]
    return q.repeat_interleave(rep, 1) * q.shape[-1] ** -0.5, k.repeat_interleave(rep, 1), v, g, beta


@pytest.mark.parametrize("width", ["122b", "tiny"])    # each width autotunes the kernels once
@pytest.mark.parametrize("t", [9, 64, 65, 300, 2048])
def test_the_chunked_kernel_matches_the_pytorch_chunked_form(width, t):
    q, k, v, g, beta, state = _inputs(t, width)
    ref_state, fla_state = state.clone(), state.clone()
    want = delta_chunked(*_torch_form(q, k, v, g, beta), ref_state)
    got = gdn_kernels.chunked(q, k, v, g, beta, q.shape[-1] ** -0.5, fla_state, torch.float16)
    e_out, e_state = _rel(got, want), _rel(fla_state, ref_state)
    _record(test="gdn_fla_chunked", width=width, rows=t, rel_out=e_out, rel_state=e_state)
    assert e_out <= TOL_CHUNK and e_state <= TOL_CHUNK, (e_out, e_state)


@pytest.mark.parametrize("width", list(WIDTHS))
@pytest.mark.parametrize("t", [1, 3, 6])
def test_the_recurrent_kernel_matches_row_by_row_with_every_snapshot(width, t):
    q, k, v, g, beta, state = _inputs(t, width, seed=1)
    hv, dk, dv = state.shape
    ref_state, fla_state = state.clone(), state.clone()
    ref_hist, fla_hist = torch.zeros(8, hv, dk, dv, device="cuda"), torch.zeros(8, hv, dk, dv, device="cuda")
    slots = torch.arange(2, 2 + t, device="cuda")
    want = delta_recurrent(*_torch_form(q, k, v, g, beta), ref_state, ref_hist, slots)
    got = gdn_kernels.recurrent(q, k, v, g, beta, dk ** -0.5, fla_state, fla_hist, slots)
    for a, b in ((got, want), (fla_state, ref_state), (fla_hist, ref_hist)):
        assert _rel(a, b) <= TOL_REC
    # one call over the rows (a short forward that is not snapshotted) gives the same
    again = state.clone()
    assert _rel(gdn_kernels.recurrent(q, k, v, g, beta, dk ** -0.5, again), want) <= TOL_REC
    assert _rel(again, ref_state) <= TOL_REC


@pytest.mark.parametrize("t", [1, 6])
def test_the_recurrent_kernel_replays_in_a_cuda_graph(t):
    q, k, v, g, beta, state = _inputs(t, "122b", seed=2)
    hv, dk, dv = state.shape
    bufs = [x.clone() for x in (q, k, v, g, beta)]
    live, hist = state.clone(), torch.zeros(8, hv, dk, dv, device="cuda")
    slots = torch.arange(1, 1 + t, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):                      # the eager first run compiles the kernel
        gdn_kernels.recurrent(*bufs, dk ** -0.5, live, hist, slots)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gdn_kernels.recurrent(*bufs, dk ** -0.5, live, hist, slots)
    for seed in (3, 4):
        new = _inputs(t, "122b", seed=seed)
        for b, x in zip(bufs, new[:5]):
            b.copy_(x)
        live.copy_(new[5])
        graph.replay()
        ref_state, ref_hist = new[5].clone(), torch.zeros_like(hist)
        want = delta_recurrent(*_torch_form(*new[:5]), ref_state, ref_hist, slots)
        assert _rel(out, want) <= TOL_REC and _rel(live, ref_state) <= TOL_REC
        assert _rel(hist[1:1 + t], ref_hist[1:1 + t]) <= TOL_REC


def test_a_2k_prefill_of_one_layer_both_ways_agrees_and_is_recorded():
    """The time of one layer's 2K prefill through fla and through the PyTorch form, recorded (a
    figure for the notes, not asserted: speeds are benchmarks' business); the outputs agree."""
    q, k, v, g, beta, state = _inputs(2048, "122b", seed=5)
    args = _torch_form(q, k, v, g, beta)

    def timed(fn) -> float:
        fn()                                          # compile, autotune
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / 3

    t_torch = timed(lambda: delta_chunked(*args, state.clone()))
    t_fla = timed(lambda: gdn_kernels.chunked(q, k, v, g, beta, q.shape[-1] ** -0.5, state.clone(),
                                              torch.float16))
    _record(test="gdn_fla_prefill_2k", torch_ms=t_torch * 1e3, fla_ms=t_fla * 1e3)
    print(f"one DeltaNet layer, 2K prefill: PyTorch {t_torch * 1e3:.2f} ms, fla {t_fla * 1e3:.2f} ms")
    want = delta_chunked(*args, state.clone())
    got = gdn_kernels.chunked(q, k, v, g, beta, q.shape[-1] ** -0.5, state.clone(), torch.float16)
    assert _rel(got, want) <= TOL_CHUNK, _rel(got, want)
