"""The fused expert kernels equal the plain-PyTorch oracle, run on the CPU under Triton's interpreter.

Small shapes only (the interpreter is slow); the GPU tests run the same check at real sizes."""
from __future__ import annotations

import pytest

pytest.importorskip("triton")


@pytest.fixture(scope="module")
def checks():
    """bench.check_experts's runs, one child for the module (tests/interpreted.ExpertChecks)."""
    from tests.interpreted import ExpertChecks
    c = ExpertChecks()
    yield c
    c.close()


def _results(args: list[str]) -> int:
    """Lines `bench.check_experts` prints for these arguments: one per row count, plus one more for
    2+ rows of at most 64 (token, expert) pairs (the split-K GEMVs and the grouped kernels)."""
    rows = [int(t) for t in args[-1].split(",")]
    top_k = int(args[args.index("--top-k") + 1])
    return len(rows) + sum(1 < t and t * top_k <= 64 for t in rows)


# Rows: 1 (the split-K GEMVs alone), 2+ of at most 64 pairs (the GEMVs and the grouped kernels' union read: 2 here,
# 3 twice below; 2..8 in test_verify_rows_...), more than 64 pairs (the grouped kernels alone: 17, 40, 13 x 5, 33,
# 25). A fourth row count of the first case (5: 20 pairs, as 2) added no path.
@pytest.mark.parametrize("args", [
    ["--experts", "8", "--hidden", "64", "--inter", "64", "--top-k", "4", "--bits", "4", "--rows", "1,2,17"],
    ["--experts", "6", "--hidden", "64", "--inter", "96", "--top-k", "2", "--bits", "5,4", "--rows", "3,40"],
    ["--experts", "5", "--hidden", "96", "--inter", "64", "--top-k", "5", "--bits", "3", "--rows", "1,13"],
    ["--experts", "4", "--hidden", "128", "--inter", "128", "--top-k", "2", "--bits", "3", "--group", "128",
     "--rows", "1,33"],                                     # 3-bit with tiles of >= 64 rows
    ["--experts", "6", "--hidden", "64", "--inter", "64", "--top-k", "3", "--bits", "4", "--exact",
     "--rows", "1,3,25"],                                   # imported GPTQ experts: exact scales (q_scale_exact)
])
def test_kernels_match_oracle_in_interpreter(args, checks):
    _match_oracle(checks, args)


def _match_oracle(checks, args, env=None):
    r = checks.run(["--device", "cpu", *args], env)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert r.stdout.count(" ok") == _results(args) + 1, r.stdout            # + the routing check


# 32x3 (gate/up in 32 columns and 3 K slices, down the default) on this very layer runs in
# test_decode_experts_adding_into_the_residual_match_the_oracle's last case, whose "vs gathered" line takes
# the split-K GEMVs through down's permutation as here (and once more in runs): not repeated here.
@pytest.mark.parametrize("splitk", ["128x2", "32x1"])
def test_decode_kernels_with_other_launch_shapes(splitk, checks):
    """The launch shapes the GPU may pick by timing (narrow/wide column blocks, K cut in 1, 2 or 3)
    give the oracle's result too; a shape that does not divide K falls back to the default."""
    _match_oracle(checks, ["--experts", "5", "--hidden", "96", "--inter", "64", "--top-k", "2", "--bits", "4",
                           "--rows", "1,3"], {"MOEDESK_SPLITK": splitk})


def test_the_split_k_shapes_offered_keep_whole_tiles_and_a_forced_one_alone():
    """The experts' split-K candidates: the default first (64 columns), then shapes of 32..128 columns whose
    K slices are whole tiles; a forced shape (Tuning.splitk) alone where K takes it, else the default."""
    from runtime.experts.shapes import SplitK, candidates
    got = candidates(2048, 768, 8, 128)
    assert got[0].bn == 64 and all(c.bn in (32, 64, 128) and c.warps == 4 for c in got), got
    assert all(2048 % (c.ksplit * 128) == 0 for c in got) and len(set(got)) == len(got)
    assert candidates(2048, 768, 8, 128, forced=(32, 4)) == [SplitK(32, 4)]
    assert candidates(2048, 768, 8, 128, forced=(32, 3)) == [got[0]]          # 2048 is no 3 whole tiles


@pytest.mark.parametrize("bits", ["3", "4"])
@pytest.mark.parametrize("grouped", ["16,16,32,64,4,0", "32,32,64,128,8,2"])
def test_grouped_kernels_with_k_tiles_spanning_scale_groups(bits, grouped, checks):
    """The prefill kernels' K tile may span several scale groups (groups of 32 rows, tiles of 64 and
    128: each row of the tile takes its own group's scales); other block shapes too."""
    _match_oracle(checks, ["--experts", "5", "--hidden", "128", "--inter", "128", "--top-k", "3", "--bits", bits,
                           "--rows", "40"], {"MOEDESK_GROUPED": grouped})


def test_the_k_tile_asked_for_is_used_within_a_group_or_across_whole_groups():
    from bench.check_experts import random_layer
    from runtime.experts.grouped import tile_span
    lay = random_layer(4, 256, 128, 2, 4, "cpu", group_size=128)          # K 256 (gate, up), 128 (down)
    assert [tile_span(lay.w1, lay.w3, want=w) for w in (32, 64, 128, 256)] == [32, 64, 128, 256]
    assert tile_span(lay.w2, want=256) == 128         # more than down's K (128): one whole group


@pytest.mark.parametrize("perms, aligned, order", [
    ("layer", True, "input order: one per layer | down reads h in runs"),
    ("expert", False, "input order: one per expert | down reads h through its permutation"),
    ("each", True, "input order: each its own | down reads h in runs"),
])
def test_grouped_kernels_read_the_input_as_the_layers_orders_allow(perms, aligned, order, checks):
    """One input order for every gate and up of the layer (exllamav2's converter): the input is permuted once;
    one per expert (ours): gathered once per pair; down in the intermediate's order: h (and the split-K
    GEMVs' gate/up output) read in runs. Each way gives the oracle's result and, bit for bit, what the
    per-tile gathers give."""
    args = ["--experts", "5", "--hidden", "128", "--inter", "128", "--top-k", "3", "--bits", "4", "--rows", "40,3",
            "--perms", perms] + (["--aligned"] if aligned else [])
    r = checks.run(["--device", "cpu", *args])
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert order in r.stdout, r.stdout
    same = [line for line in r.stdout.splitlines() if "vs gathered" in line]
    # grouped, grouped(union), and where down is in order the split-K GEMVs
    assert len(same) == 2 + aligned and all("rel err 0.00e+00" in line for line in same), r.stdout


def test_the_grouped_benchmark_times_each_input_order_on_one_layer():
    """bench.grouped's orders: "gathered" and "layer" are the same weights (one gate/up order, down in order)
    read two ways, "expert" one order per expert; an unknown order is refused."""
    import torch
    from bench.check_experts import random_layer
    from bench.grouped import with_order
    la = random_layer(4, 64, 64, 2, 4, "cpu")
    g1, g3, g2, none = with_order(la.w1, la.w3, la.w2, "gathered")
    l1, l3, l2, one = with_order(la.w1, la.w3, la.w2, "layer")
    e1, e3, _, each = with_order(la.w1, la.w3, la.w2, "expert")
    assert none.shared is None and not none.per_expert and not none.ordered_down
    assert one.shared is not None and one.ordered_down and torch.equal(g1.perm, l1.perm) and torch.equal(g2.perm, l2.perm)
    assert each.shared is None and each.per_expert and each.ordered_down and torch.equal(e1.perm, la.w1.perm)
    with pytest.raises(ValueError, match="order: one of gathered, layer, expert"):
        with_order(la.w1, la.w3, la.w2, "sorted")


def test_a_bad_grouped_kernel_shape_says_what_is_wrong():
    from runtime.tuning import Grouped
    assert Grouped.parse("16,64,128,64,4,0") == Grouped()
    with pytest.raises(ValueError, match="six integers"):
        Grouped.parse("16,64")
    with pytest.raises(ValueError, match="bn 48 is not a power of two"):
        Grouped.parse("16,64,48,32,4,0")
    with pytest.raises(ValueError, match="at least 16"):
        Grouped.parse("8,64,64,32,4,0")


def test_grouped_benchmark_refuses_bad_shapes_and_a_missing_gpu(capsys):
    import torch
    from bench import grouped as bench_grouped
    with pytest.raises(SystemExit):
        bench_grouped.main(["--configs", "16,64,48,32,4,0"])
    assert "bn 48 is not a power of two" in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            bench_grouped.main([])
        assert "needs a CUDA device" in capsys.readouterr().err


def test_verify_rows_read_through_the_grouped_kernels(checks):
    """Verify rows of offloaded layers take the grouped kernels (each chosen expert read once per block
    of rows): 4 experts and top-2 make 2..8 rows share experts heavily; 3-bit and 4-bit, against the
    oracle (each row count is also checked through the split-K GEMVs). 3-bit at the fewest and the most
    rows only: its codes differ from 4-bit's in the tile's load alone (the grouped kernels take it at 13, 33
    and 40 rows in the tests above)."""
    for bits, rows in (("4", "2,3,5,8"), ("3", "2,8")):
        args = ["--experts", "4", "--hidden", "96", "--inter", "64", "--top-k", "2", "--bits", bits,
                "--rows", rows]
        r = checks.run(["--device", "cpu", *args])
        assert r.returncode == 0, r.stdout + r.stderr[-3000:]
        n = len(rows.split(","))
        assert r.stdout.count("grouped(union)") == n and r.stdout.count("splitk") == n, r.stdout
        assert "FAIL" not in r.stdout


_ALIGN_CHECK = """
import torch
from bench.check_experts import align_by_torch as by_torch
from runtime.experts import grouped
grids = []


class Spy:                                                    # the grids the sort is launched with
    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        grids.append(grid)
        return self.kernel[grid]


kernels = grouped._align_count, grouped._align_place
grouped._align_count, grouped._align_place = Spy(kernels[0]), Spy(kernels[1])
g = torch.Generator().manual_seed(0)
cases = [(1, 128, 16), (7, 4, 16), (300, 128, 16), (4096, 128, 64), (50, 3, 64), (1000, 256, 64), (260, 60, 32),
         (4096 * 8, 128, 64)]
for P, E, bm in cases:
    ids = torch.randint(0, E, (P,), generator=g).to(torch.int32)
    if P > 100:
        ids[: P // 3] = 5
    for most in ((grouped.SORT_PROGRAMS,) if P > 4096 else (grouped.SORT_PROGRAMS, 3, 1)):
        grids.clear()
        pairs, bexp = grouped.align(ids, E, bm, most)
        assert grids == [grouped.align_programs(P, most)[:1]] * 2, (P, most, grids)
        assert pairs.numel() == bexp.numel() * bm
        seen = []
        for b, e in enumerate(bexp.tolist()):
            rows = pairs[b * bm:(b + 1) * bm].tolist()
            real = [r for r in rows if r < P]
            if e < 0:
                assert not real                                   # unused blocks hold only padding
                continue
            assert real and all(ids[r] == e for r in real)        # one expert per block
            assert rows == real + [P] * (bm - len(real))          # padding only at the end
            seen += real
        assert sorted(seen) == list(range(P))                     # every pair exactly once
        want = by_torch(ids, E, bm)
        assert torch.equal(want[0], pairs) and torch.equal(want[1], bexp), (P, E, bm, most)
grouped._align_count, grouped._align_place = kernels      # the module's child runs other checks after this one
print("aligned")
"""


def test_align_groups_pairs_by_expert_in_whole_blocks(checks):
    """The prefill's sort into the grouped kernels' blocks (two Triton launches, in the interpreter), over as
    many programs as it takes, three, or one: one expert per block, padding only at a block's end, every pair
    once, and, bit for bit, what the stable torch sort it replaced gives (hot experts, experts never picked, a
    single pair, more blocks than experts, 4096 rows of 8 picks)."""
    r = checks.run(_ALIGN_CHECK)
    assert r.returncode == 0 and "aligned" in r.stdout, r.stdout + r.stderr[-3000:]


def test_a_long_prefill_sorts_its_pairs_on_many_programs():
    """A prefill chunk of exllamav2's 2048 rows x 8 picks (Qwen3-30B-A3B), and 4096 rows, is sorted by 128
    programs, not one walking its chunks in turn (the first form of the sort: 0.79-0.89x the torch sort's
    4096-token prefill on the H200); a decode-sized sort stays one program; runs are whole chunks."""
    from runtime.experts.grouped import CHUNK, SORT_PROGRAMS, align_programs
    assert SORT_PROGRAMS >= 128
    assert align_programs(2048 * 8) == (128, CHUNK)
    assert align_programs(4096 * 8) == (128, 2 * CHUNK)
    assert align_programs(512 * 8) == (32, CHUNK)
    assert align_programs(65) == (1, CHUNK) and align_programs(1) == (1, CHUNK)
    assert align_programs(2048 * 8, most=1) == (1, 2048 * 8)
    for P in (1, 127, 128, 129, 5000, 16384, 40000, 1 << 20):
        programs, span = align_programs(P)
        assert span % CHUNK == 0 and programs <= SORT_PROGRAMS and (programs - 1) * span < P <= programs * span


def test_ksplit_keeps_whole_tiles():
    from runtime.experts.shapes import SM_TARGET, ksplit
    for K, bk, programs in [(2048, 128, 96), (768, 128, 256), (4096, 128, 192), (64, 32, 8), (2048, 128, 2000)]:
        ks = ksplit(K, bk, programs)
        assert K % (ks * bk) == 0 and ks >= 1
        assert ks == 1 or programs * ks <= SM_TARGET


# The offload manager's hooks do not depend on the row count (staging is forced on or off by min_pairs): more
# than 64 pairs (the grouped kernels alone, several blocks per expert) are the 40 and 30 rows of the last two.
@pytest.mark.parametrize("args", [
    ["--experts", "8", "--hidden", "64", "--inter", "64", "--top-k", "4", "--bits", "4", "--rows", "1,3"],
    ["--experts", "6", "--hidden", "64", "--inter", "96", "--top-k", "2", "--bits", "5,4", "--rows", "2,40"],
    ["--experts", "5", "--hidden", "64", "--inter", "64", "--top-k", "3", "--bits", "3", "--rows", "1,30"],
])
def test_kernels_with_cold_experts_equal_all_resident_in_interpreter(args, checks):
    """Half the experts in host memory (read in place, or staged for many rows) give the same
    output, bit for bit, as every expert in the slot stack."""
    r = checks.run(["--device", "cpu", "--offload", *args])
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert r.stdout.count(" ok") == 2 * _results(args), r.stdout             # in place and staged


# Each stored width once (3, 4, and 8 for 5,4), each launch shape once: SKIP does not depend on BITS. H 64, I 128,
# tiles of 32, the cut at 64. 32x2: gate/up and down in 32 columns (the cut skips two of gate/up's four blocks
# whole), 2 K slices (down's: two tiles each, the cut skipping the first whole); 128x2: gate/up in one block of
# 128 columns (the cut masks its first half's lanes), down 128 columns (more than H: masked lanes), 2 slices each;
# None: the defaults (gate/up 64 columns x 2 slices, down 64 x 4 slices of one tile). 4 experts, top-2, 1 and 2
# rows: a token's picks masked, kept or both (half the experts masked), one row and several (the host function,
# the oracle).
@pytest.mark.parametrize("bits,splitk", [("4", "32x2"), ("3", "128x2"), ("5,4", None)])
def test_skip_mask_leaves_out_exactly_the_masked_experts(bits, splitk, checks):
    """Split-K kernels with a skip mask (none, half, all experts masked) + the masked experts computed
    apart (one row: the CPU path's host function; two rows: the oracle) equal the unmasked kernels,
    for the default and the other launch shapes; also with experts cut between the two (the CPU's
    host function computes the first 64 of 128 intermediate features, the kernels the rest), after
    the layer is put in down's intermediate order (bit for bit the same output). The host function computes with
    int8 activations (the integer CPU kernel): its rows are held to that kernel's tolerance, the kernels' to fp16's."""
    args = ["--experts", "4", "--hidden", "64", "--inter", "128", "--top-k", "2", "--bits", bits, "--rows", "1,2"]
    r = checks.run(["--device", "cpu", "--skip", *args], {"MOEDESK_SPLITK": splitk} if splitk else None)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert "aligned intermediate    max diff 0.00e+00" in r.stdout, r.stdout
    cuts = [64]
    host = r.stdout.count("cpu host")
    assert host in (0, 3 + 3 * len(cuts)), r.stdout    # one row: the host function, whole and cut (none without a kernel)
    assert r.stdout.count(" ok") == 7 + (3 * len(cuts) if host else 0) and "FAIL" not in r.stdout, r.stdout
    for c in cuts:
        assert r.stdout.count(f"cut {c}/128+cpu host") == (3 if host else 0), r.stdout


_SHARE_MASK_CHECK = """
import torch
from runtime.cpu.device import SHARE_DEN, cpu_share_mask
g = torch.Generator().manual_seed(0)
E, A = 12, 5
cases = [(int(s), i) for i, s in enumerate(torch.randint(0, SHARE_DEN + 1, (60,), generator=g))]
cases += [(0, 60), (SHARE_DEN, 61), (SHARE_DEN // 2, 62)]
for share, i in cases:
    ids = torch.randperm(E, generator=g)[:A].view(1, A).to(torch.int32)
    resident = (torch.rand(E, generator=g) < 0.3).to(torch.int32)
    owned = ((torch.rand(E, generator=g) < 0.6) & (resident == 0)).to(torch.uint8)
    out = torch.full((E,), 7, dtype=torch.uint8)
    cpu_share_mask(ids, owned, resident, share, out)
    cold = [e for e in ids[0].tolist() if resident[e] == 0]
    target = (len(cold) * share + SHARE_DEN // 2) // SHARE_DEN
    want, k = [0] * E, 0
    for e in ids[0].tolist():                        # the owned cold picks, in pick order, up to the target
        if resident[e] == 0 and owned[e] and k < target:
            want[e], k = 1, k + 1
    assert out.tolist() == want, (i, ids.tolist(), resident.tolist(), owned.tolist(), share, out.tolist(), want)
print("share mask ok", len(cases))
"""


def test_cpu_share_mask_gives_the_cpu_its_share_of_each_tokens_cold_picks(checks):
    """The balanced split's per-token mask (one Triton program, in the interpreter) against a plain
    loop: of a token's cold picks, those the CPU has copies of, in pick order, up to round(share x cold
    picks); never a resident or uncopied expert; every other entry 0."""
    r = checks.run(_SHARE_MASK_CHECK)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert "share mask ok 63" in r.stdout


def test_cpu_share_mask_refuses_bad_arguments():
    import torch
    from runtime.cpu.device import cpu_share_mask
    owned, resident, out = torch.zeros(4, dtype=torch.uint8), torch.zeros(4, dtype=torch.int32), torch.zeros(4, dtype=torch.uint8)
    with pytest.raises(ValueError, match="one row of expert ids"):
        cpu_share_mask(torch.zeros(2, 2, dtype=torch.int32), owned, resident, 512, out)
    with pytest.raises(ValueError, match="share 2000 outside 0..1024"):
        cpu_share_mask(torch.zeros(1, 2, dtype=torch.int32), owned, resident, 2000, out)


def test_the_grouped_benchmark_counts_each_experts_codes_and_scales():
    """bench.grouped's GB/s: one expert's bytes of a projection are its int32 code words and its fp16 scales."""
    from bench.check_experts import random_layer
    from bench.grouped import _expert_bytes
    la = random_layer(4, 64, 96, 2, 4, "cpu")
    for p in (la.w1, la.w3, la.w2):
        want = p.qweight[0].numel() * 4 + (p.in_features // p.group) * p.out_features * 2
        assert _expert_bytes(p) == want > 0


@pytest.mark.parametrize("args,splitk", [
    (["--experts", "8", "--hidden", "64", "--inter", "64", "--top-k", "4", "--bits", "4", "--rows", "1,2,17"], None),
    (["--experts", "6", "--hidden", "64", "--inter", "96", "--top-k", "2", "--bits", "5,4", "--rows", "1,3"], "32x2"),
    (["--experts", "4", "--hidden", "128", "--inter", "128", "--top-k", "2", "--bits", "3", "--group", "128",
      "--rows", "1,9"], "128x1"),
    (["--experts", "5", "--hidden", "96", "--inter", "64", "--top-k", "2", "--bits", "4", "--aligned",
      "--rows", "1,3"], "32x3"),
])
def test_decode_experts_adding_into_the_residual_match_the_oracle(args, splitk, checks):
    """Layers all in VRAM decode in two launches adding into the residual (runtime/experts/decode.py:
    gate/up's last slice stores SiLU(gate) x up, down's last adds the sum into the residual): residual + the
    oracle's sum, K whole or cut, down reading h in runs or through its permutation."""
    rows = [int(t) for t in args[-1].split(",")]
    top_k = int(args[args.index("--top-k") + 1])
    r = checks.run(["--device", "cpu", "--residual", *args], {"MOEDESK_SPLITK": splitk} if splitk else None)
    assert r.returncode == 0 and "FAIL" not in r.stdout, r.stdout + r.stderr[-3000:]
    added = [line for line in r.stdout.splitlines() if "splitk+res" in line]
    assert len(added) == sum(t * top_k <= 64 for t in rows) and all(line.endswith(" ok") for line in added), r.stdout


def test_the_two_launches_leave_their_workspace_at_zero(checks):
    """experts_finish itself, K whole and cut in 2, equals the three launches plus torch's add to fp16
    rounding; its workspace and counters are zero after. K 64 in 32-row tiles: ks 1 stores h at once, ks 2
    finishes in the last slice (two column blocks, two rows' counters); more slices take the same branches."""
    r = checks.run("""
import torch
from runtime.experts import decode, shapes
from runtime.experts.layer import route
from bench.check_experts import random_layer
layer = random_layer(6, 64, 64, 3, 4, "cpu", seed=5)
g = torch.Generator().manual_seed(6)
for ks in (1, 2):
    shapes.CHOSEN.clear()
    for T in (1, 2):
        x = torch.randn(T, 64, generator=g).half()
        res = (torch.randn(T, 64, generator=g) * 0.1).half()
        r = route(x, layer.gate_w, 3)
        got = decode.experts_finish(x, r.ids, r.weights, layer.w1, layer.w3, layer.w2, res, splitk=(32, ks))
        want = torch.add(res, decode.experts_decode(x, r.ids, r.weights, layer.w1, layer.w3, layer.w2,
                                                    splitk=(32, ks)))
        err = (got.float() - want.float()).abs().max().item()
        assert got.dtype == torch.float16 and err <= 2e-3 * want.float().abs().max().item(), (ks, T, err)
        ws, counts = shapes._WORKSPACES[torch.device("cpu")][-1]
        assert not ws.any() and not counts.any(), (ks, T)
print("finish ok")
""")
    assert r.returncode == 0 and "finish ok" in r.stdout, r.stdout + r.stderr[-3000:]


def test_a_layer_given_a_residual_returns_it_added_and_offloaded_layers_refuse_one():
    """ExpertLayer(residual=): residual + the experts' sum, a new fp16 tensor rounded once (here the oracle's
    path, on the CPU); a layer with an offload manager takes no residual (its kernels add nothing)."""
    import torch

    from bench.check_experts import random_layer
    layer = random_layer(4, 64, 64, 2, 4, "cpu", seed=3)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1)).half()
    res = torch.randn(3, 64, generator=torch.Generator().manual_seed(2)).half()
    y = layer(x)
    got = layer(x, residual=res)
    assert got.dtype == torch.float16 and got.data_ptr() != res.data_ptr()
    assert torch.equal(got, (res.float() + y).half())
    layer.offload = object()
    with pytest.raises(ValueError, match="all in VRAM"):
        layer(x, residual=res)
