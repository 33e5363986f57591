"""The batched GPTQ path (gptq.quantize_stacked: experts x parts x candidate widths in one column loop, the scale
search for all of them at once, the errors measured on the device, a heap for the allocation) against the
per-weight path written out plainly here: one weight, one width, one group's scales at a time, as the converter
did it before batching. The two must agree (codes, scales, measured errors, chosen widths); a batch that mixes
up its members' Hessians, widths or scales does not."""
from __future__ import annotations

import random

import pytest
import torch

from runtime.exl2 import allocate
from runtime.exl2 import format as fmt
from runtime.exl2.gptq import prepare, prepare_many, quantize_stacked

GROUP = 32


# ---------------------------------------------------------------------------------------------
# The per-weight path, as the converter ran it weight by weight

def _old_search(w: torch.Tensor, bits: int):
    """One group's scales: 11 multipliers, 8 more around the best, each column's qscale nudged by one."""
    zero = 1 << (bits - 1)

    def clip_error(step):
        q = torch.div(w, step).round_().clamp_(-zero, zero - 1)
        return (w - q * step).abs_().pow_(fmt.ERROR_NORM).sum(dim=0)

    def best(grid):
        qsms = (top * torch.tensor(grid)).to(torch.float16)
        total = [float(clip_error(fmt.group_steps(qscale, q)).sum()) for q in qsms]
        return grid[min(range(len(grid)), key=total.__getitem__)]

    base = (w.abs().amax(dim=0) + 1e-12) / ((2 ** bits - 1) / 2)
    top = base.max().clamp(min=2.0 ** -14)
    qscale = torch.clamp(torch.round(torch.sqrt(base / top) * 16), 1, 16)
    coarse = best(fmt.SCALE_GRID)
    qsm = (top * best((coarse, *(coarse + f for f in fmt.SCALE_FINE)))).to(torch.float16)
    err = clip_error(fmt.group_steps(qscale, qsm))
    for delta in (-1, 1):
        cand = (qscale + delta).clamp(1, 16)
        cerr = clip_error(fmt.group_steps(cand, qsm))
        qscale, err = torch.where(cerr < err, cand, qscale), torch.where(cerr < err, cerr, err)
    return qscale, qsm


def _old_gptq(w: torch.Tensor, h: torch.Tensor, tokens: int, plan) -> dict[str, torch.Tensor]:
    """GPTQ of one weight [out, in] with its Hessian at one plan of group widths, column by column."""
    p = prepare(h, tokens=tokens)
    out, n_in = w.shape
    n = out + (-out % 32)
    wp = torch.zeros((n, n_in))
    wp[:out] = w[:, p.perm]
    wp[:, p.dead[p.perm]] = 0.0
    codes, qscale, qsm = torch.empty_like(wp), torch.empty((len(plan), n)), torch.empty(len(plan), dtype=torch.float16)
    b0 = 0
    for g, (b, rows) in enumerate(plan):
        b1, zero = b0 + rows, 1 << (b - 1)
        qscale[g], qsm[g] = _old_search(wp[:, b0:b1].t(), b)
        step = fmt.group_steps(qscale[g], qsm[g])
        wb, err = wp[:, b0:b1].clone(), torch.zeros((n, rows))
        for j in range(rows):
            q = torch.clamp(torch.round(wb[:, j] / step), -zero, zero - 1)
            codes[:, b0 + j] = q
            e = (wb[:, j] - q * step) / p.u[b0 + j, b0 + j]
            wb[:, j:] -= e.unsqueeze(1) * p.u[b0 + j, b0 + j:b1].unsqueeze(0)
            err[:, j] = e
        wp[:, b1:] -= err @ p.u[b0:b1, b1:]
        b0 = b1
    codes[out:] = 0
    qscale[:, out:] = 16
    return fmt.assemble(codes.t().to(torch.int64), qscale, qsm, plan, p.perm)


def _hessian(g, n_in, tokens, dead=None):
    x = torch.randn(tokens, n_in, generator=g) * torch.linspace(0.2, 2.0, n_in)[torch.randperm(n_in, generator=g)]
    if dead is not None:
        x[:, dead] = 0                                       # a channel that never saw input
    return 2 * x.double().t() @ x.double(), tokens


def _plans(n_in, out, widths):
    """The converter's groups at each candidate width (format.stored_target's mixes, GROUP rows each)."""
    plans = []
    for b in widths:
        mix, props = fmt.resolve_bits(*fmt.stored_target(b, n_in, out, GROUP))
        plans.append(fmt.plan_groups(n_in, mix, props, {w: GROUP for w in mix}))
    return plans


def _agree(got: dict, want: dict, out: int, what: str) -> None:
    """Same layout and (nearly) the same codes: batched reductions may round differently, so a rare group may
    take the neighbouring scale; the dequantized weights agree to a small fraction of a step."""
    assert {k: (v.dtype, v.shape) for k, v in got.items()} == {k: (v.dtype, v.shape) for k, v in want.items()}, what
    assert torch.equal(got["q_groups"], want["q_groups"]) and torch.equal(got["q_invperm"], want["q_invperm"]), what
    a, b = fmt.dequantize(got, out_features=out), fmt.dequantize(want, out_features=out)
    same = (a == b).float().mean().item()
    assert same > 0.99, (what, same)
    assert (a - b).abs().mean() < 0.01 * b.abs().mean(), what


# ---------------------------------------------------------------------------------------------
# Tests

@pytest.mark.parametrize("shared", [False, True], ids=["own-hessians", "one-shared-hessian"])
def test_experts_parts_and_widths_in_one_loop_match_the_per_weight_path(shared):
    """3 experts x (gate, up) x 3 candidate widths in one loop: each of the 18 tensor sets is what the plain
    per-weight GPTQ gives it, with the expert's own Hessian (act order, a dead channel) or the shared one."""
    g = torch.Generator().manual_seed(5)
    n_in, out, n_e = 96, 40, 3
    hs = [_hessian(g, n_in, 400, dead=e) for e in range(1 if shared else n_e)]
    weights = [[torch.randn(out, n_in, generator=g) * 0.02 for _ in range(2)] for _ in range(n_e)]
    widths = (2.5, 3.0, 4.5)
    plans = _plans(n_in, out, widths)
    if shared:
        prep = prepare(hs[0][0], tokens=hs[0][1])
    else:
        prep = prepare_many(torch.stack([h for h, _ in hs]), tokens=[t for _, t in hs], names=["a", "b", "c"])
        assert not torch.equal(prep.perm[0], prep.perm[1])
    names = [[f"e{e}.gate", f"e{e}.up"] for e in range(n_e)]
    raw = torch.stack([h for h, _ in hs])
    sets, errors = quantize_stacked(weights, prep, plans, names, keep=raw)
    assert len(sets) == n_e and all(len(s) == 2 and len(s[0]) == len(widths) for s in sets)
    for e in range(n_e):
        h, tokens = hs[0 if shared else e]
        for p in range(2):
            for k, plan in enumerate(plans):
                want = _old_gptq(weights[e][p], h, tokens, plan)
                _agree(sets[e][p][k], want, out, (e, p, widths[k]))
                deq = fmt.dequantize(sets[e][p][k], out_features=out)
                assert errors[e, p, k].item() == pytest.approx(allocate.relative_error(weights[e][p], deq, h),
                                                               rel=1e-9)


def test_a_batch_that_swaps_its_members_hessians_is_caught():
    """The check above is not blind to the batch: experts whose error feedback runs through each other's inverse
    Hessians (a batch that mixed up its members) no longer match what each gets alone."""
    g = torch.Generator().manual_seed(7)
    n_in, out = 64, 32
    hs = [_hessian(g, n_in, 300) for _ in range(2)]
    weights = [[torch.randn(out, n_in, generator=g) * 0.02] for _ in range(2)]
    plans = _plans(n_in, out, (3.0,))
    prep = prepare_many(torch.stack([h for h, _ in hs]), tokens=[t for _, t in hs], names=["a", "b"])
    prep.u = prep.u.flip(0)
    sets, _ = quantize_stacked(weights, prep, plans, [["a"], ["b"]])
    with pytest.raises(AssertionError):
        _agree(sets[0][0][0], _old_gptq(weights[0][0], hs[0][0], hs[0][1], plans[0]), out, "swapped")


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_one_scale_search_for_a_batch_is_each_groups_own(bits):
    """format.search_scales on [rows, E, M, N] groups at once (per-copy widths) gives each group the scales the
    search of that group alone gives (the multipliers' errors summed in another order: a near tie may fall
    the other way, so all but a rare column agree)."""
    g = torch.Generator().manual_seed(bits)
    w = torch.randn(32, 3, 2, 64, generator=g) * 0.02
    w[torch.rand(w.shape, generator=g) < 0.01] *= 6                 # heavy tails: clipping pays
    widths = torch.tensor([bits, {2: 2, 3: 2, 4: 3, 5: 4, 6: 5, 8: 6}[bits]])
    qscale, qsm, step = fmt.search_scales(w, widths)
    assert qscale.shape == (3, 2, 64) and qsm.shape == (3, 2) and torch.equal(step, fmt.group_steps(qscale, qsm[..., None]))
    agree = []
    for e in range(3):
        for m in range(2):
            q1, m1 = _old_search(w[:, e, m], int(widths[m]))
            agree.append(bool(m1 == qsm[e, m]) and (q1 == qscale[e, m]).float().mean().item() > 0.95)
    assert sum(agree) >= 5, agree


@pytest.mark.parametrize("sliced", [False, True], ids=["one-slice", "slices-of-two"])
def test_prepared_in_a_batch_as_one_at_a_time(sliced, monkeypatch):
    from runtime.exl2 import gptq
    if sliced:                                              # a batch factorised a few Hessians at a time
        monkeypatch.setattr(gptq, "PREPARE_BYTES", 2 * 48 * 48 * 8)
    g = torch.Generator().manual_seed(11)
    hs = [_hessian(g, 48, 60 + 100 * i, dead=i) for i in range(3)]       # few tokens: the damping floor differs
    h = hs[1][0]                                     # b is indefinite: 10x the damping for it alone
    h[-1, :], h[:, -1] = 0.0, 0.0
    h[-1, -1] = -2.0 * torch.diagonal(h).mean()
    many = prepare_many(torch.stack([h for h, _ in hs]), tokens=[t for _, t in hs], names=["a", "b", "c"])
    for i, (h, t) in enumerate(hs):
        one = prepare(h, tokens=t)
        assert torch.equal(many.perm[i], one.perm) and torch.equal(many.dead[i], one.dead)
        assert torch.allclose(many.u[i], one.u, rtol=1e-6, atol=1e-7), i


def _old_allocate(options, sizes, bits):
    """The greedy allocation as a scan of every linear per step."""
    chosen = {k: min(opts, key=lambda c: opts[c][0]) for k, opts in options.items()}
    budget = bits * sum(sizes.values()) + 1e-6
    spent = sum(options[k][chosen[k]][0] * sizes[k] for k in chosen)
    while True:
        best, best_gain = None, 0.0
        for k, opts in options.items():
            now_bits, now_err = opts[chosen[k]]
            for c, (b, err) in opts.items():
                cost = (b - now_bits) * sizes[k]
                if cost <= 0 or err >= now_err or spent + cost > budget:
                    continue
                gain = (now_err - err) / cost
                if best is None or gain > best_gain:
                    best, best_gain = (k, c, cost), gain
        if best is None:
            return chosen
        k, c, cost = best
        chosen[k], spent = c, spent + cost


@pytest.mark.parametrize("seed", range(6))
def test_heap_allocation_chooses_what_the_scan_chose(seed):
    rng = random.Random(seed)
    options, sizes = {}, {}
    for i in range(rng.randint(5, 120)):
        widths = sorted(rng.sample([2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0], 5))
        err = rng.uniform(0.01, 0.2)
        opts = {}
        for b in widths:
            opts[b] = (b + rng.uniform(0.0, 0.3), err)
            err *= rng.choice([0.5, 0.6, 0.6, 1.0, 1.2])            # ties and errors that grow with width too
        options[f"l{i}"] = opts
        sizes[f"l{i}"] = rng.choice([4096, 4096, 8192, 16384])       # equal sizes: equal gains, ties
    for bits in (2.6, 3.0, 3.7, 4.5):
        assert allocate.allocate(options, sizes, bits) == _old_allocate(options, sizes, bits), (seed, bits)
