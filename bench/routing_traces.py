"""Routing traces with the statistics published for real Qwen-family MoEs, for offload benchmarks.

    python -m bench.routing_traces            # the traces' own statistics, and LRU vs frequency placement

Published figures (the project's reference notes on real models and on offload, which cite them):
- popularity: on Qwen3-30B-A3B (128 experts, top-8) about half the experts cover 90% of routing picks
  over a long text (~51% on diverse text, 45% on Python), the most popular expert taking 4-6%;
- reuse between nearby tokens: on a 512-expert model (top-10), per-layer LRU caches of 64 and 128
  experts (1/8 and 1/4 of them) hit ~67% and ~81% (llama.cpp PR #27861 discussion);
- a fixed hot set learned on half the text covers little more than its share on the other half.

The generator, per layer: a popularity over the experts with log-normal weights (a Zipf law steep
enough for the coverage figure gives the top expert 25% of picks, far above the published 4-6%)
and, for each of a token's top-k picks, with probability
`reuse` an expert picked by one of the last `window` tokens of that layer instead of a fresh draw from
the popularity. `PROFILES` are calibrated so that the traces' own statistics hit the figures above
(tests/test_routing_traces.py measures them).

The placement check (`compare_policies`): per layer, a cache of C expert slots run over a trace by
LRU (every miss copied in, the least recently used out), by the manager's frequency placement (the
most routed experts of a calibration prefix resident, then swaps when a cold expert's decayed count
beats the weakest resident's by the manager's margin, at most 2 per 16 tokens:
runtime/offload/residency.Residency.decide), and by the same rule on recent counts (a short
half-life, more swaps: a mix of the two). Hit rates alone favour recency; what the GPU pays is the
PCIe traffic, where every LRU miss is read in place and copied in as well. Pure numpy.
"""
from __future__ import annotations

import argparse
import sys
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class TraceProfile:
    spread: float        # popularity: log-normal weights exp(spread * z), z standard normal
    reuse: float         # chance that a pick repeats one of the last `window` tokens' experts
    window: int          # tokens whose picks can be reused


# Calibrated against the published figures (see the module docstring and the tests).
PROFILES = {
    # 128 experts, top-8 (Qwen3-30B-A3B, and the shape of q125-a11): ~51% of experts cover 90% of picks
    # (no published LRU figure at 128 experts: the reuse of the 512-expert profile)
    "qwen3-30b-a3b": TraceProfile(spread=1.35, reuse=0.45, window=4),
    # 512 experts, top-10: LRU caches of 64 / 128 experts hit ~67% / ~81% (~42% of experts cover 90%)
    "qwen-512": TraceProfile(spread=1.5, reuse=0.45, window=4),
}


def generate(num_tokens: int, num_experts: int, top_k: int, profile: TraceProfile, layers: int = 1,
             seed: int = 0) -> np.ndarray:
    """Picks int32 [layers, tokens, top_k], distinct within a token."""
    rng = np.random.default_rng(seed)
    out = np.empty((layers, num_tokens, top_k), dtype=np.int32)
    for layer in range(layers):
        w = np.exp(profile.spread * rng.standard_normal(num_experts))
        p = w / w.sum()
        recent: list[np.ndarray] = []
        fresh = rng.choice(num_experts, size=(num_tokens, 4 * top_k), p=p)     # draws to take from
        coins = rng.random((num_tokens, top_k))
        for t in range(num_tokens):
            pool = np.unique(np.concatenate(recent)) if recent else np.empty(0, dtype=np.int64)
            picks: list[int] = []
            chosen = set()
            f = 0
            for j in range(top_k):
                if coins[t, j] < profile.reuse and len(pool) > len(chosen & set(pool.tolist())):
                    while True:
                        e = int(pool[rng.integers(len(pool))])
                        if e not in chosen:
                            break
                else:
                    while True:
                        e = int(fresh[t, f]) if f < fresh.shape[1] else int(rng.choice(num_experts, p=p))
                        f += 1
                        if e not in chosen:
                            break
                chosen.add(e)
                picks.append(e)
            out[layer, t] = picks
            recent.append(out[layer, t].astype(np.int64))
            if len(recent) > profile.window:
                recent.pop(0)
    return out


# -- statistics ----------------------------------------------------------------------------------------

def coverage(picks: np.ndarray, num_experts: int, share: float = 0.9) -> float:
    """Fraction of the experts that cover `share` of a layer's picks (mean over layers)."""
    out = []
    for layer in picks:
        counts = np.sort(np.bincount(layer.reshape(-1), minlength=num_experts))[::-1]
        covered = np.cumsum(counts) / counts.sum()
        out.append((int(np.searchsorted(covered, share)) + 1) / num_experts)
    return float(np.mean(out))


def lru_hit_rate(picks: np.ndarray, capacity: int) -> float:
    """Per-layer LRU caches of `capacity` experts: hits / picks (mean over layers)."""
    rates = []
    for layer in picks:
        cache: OrderedDict[int, None] = OrderedDict()
        hits = n = 0
        for token in layer:
            for e in token.tolist():
                n += 1
                if e in cache:
                    hits += 1
                    cache.move_to_end(e)
                else:
                    cache[e] = None
                    if len(cache) > capacity:
                        cache.popitem(last=False)
        rates.append(hits / n)
    return float(np.mean(rates))


def frequency_placement(picks: np.ndarray, capacity: int, num_experts: int, calibrate: int = 512,
                        replace_every: int = 16, max_promotions: int = 2, margin: float = 0.25,
                        half_life: float = 8192.0, sigmas: float = 4.0) -> dict[str, float]:
    """The manager's placement on a trace: the `capacity` most routed experts of the first `calibrate`
    tokens resident, then swaps every `replace_every` tokens by decayed counts (half-life in tokens;
    the manager's rule: a gain beyond the margin and 4 sigma, at most `max_promotions` per round).
    Hit rate and promotions per pick over the tokens after the calibration (mean over layers)."""
    decay = 0.5 ** (replace_every / half_life)
    hit_rates, promoted = [], []
    for layer in picks:
        counts = np.bincount(layer[:calibrate].reshape(-1), minlength=num_experts).astype(np.float64)
        order = np.argsort(-counts, kind="stable")
        resident = np.zeros(num_experts, dtype=bool)
        resident[order[:capacity]] = True
        hits = n = moves = 0
        window = np.zeros(num_experts)
        for t in range(calibrate, len(layer)):
            ids = layer[t]
            n += len(ids)
            hits += int(resident[ids].sum())
            np.add.at(window, ids, 1)
            if (t + 1) % replace_every:
                continue
            counts = counts * decay + window
            window[:] = 0
            for _ in range(max_promotions):
                cold = np.where(~resident)[0]
                hot = np.where(resident)[0]
                best, victim = cold[np.argmax(counts[cold])], hot[np.argmin(counts[hot])]
                gain = counts[best] - counts[victim]
                if not gain > max(1.0, margin * counts[victim], sigmas * np.sqrt(counts[best] + counts[victim])):
                    break
                resident[victim], resident[best] = False, True
                moves += 1
        hit_rates.append(hits / n if n else 0.0)
        promoted.append(moves / n if n else 0.0)
    return {"hit_rate": float(np.mean(hit_rates)), "promotions_per_pick": float(np.mean(promoted))}


# The policies compared; PCIe traffic in experts' bytes per pick, as the offload path moves them: a miss
# is read in place over PCIe by the decode kernels; LRU also copies each missed expert into a slot (the
# kernels do not wait for a copy inside a captured step), a promotion copies one expert. Were the copy
# made in the step's own stream before the expert kernels and read by them, an LRU miss would cost one
# crossing (`pcie_per_pick_if_the_copy_served`); the engine has no such path today.
POLICIES = {
    "lru": None,
    "frequency": {},                                                   # the manager today
    "recency_mix": {"half_life": 32.0, "replace_every": 4, "max_promotions": 4, "margin": 0.25, "sigmas": 1.0},
}


def compare_policies(picks: np.ndarray, num_experts: int, capacities, calibrate: int = 512) -> dict:
    """Per cache size and policy: hit rate and PCIe traffic per pick (see POLICIES), measured on the
    same tokens (those after the frequency placements' calibration prefix)."""
    out = {}
    for c in capacities:
        row = {}
        for name, kw in POLICIES.items():
            if kw is None:
                hit = lru_hit_rate(picks[:, calibrate:], c)
                row[name] = {"hit_rate": hit, "pcie_per_pick": 2 * (1 - hit),
                             "pcie_per_pick_if_the_copy_served": 1 - hit}
            else:
                r = frequency_placement(picks, c, num_experts, calibrate, **kw)
                row[name] = dict(r, pcie_per_pick=(1 - r["hit_rate"]) + r["promotions_per_pick"])
        out[c] = row
    return out


# -- as the offload benchmark uses them ----------------------------------------------------------------

def forced_picks(num_layers: int, num_experts: int, top_k: int, device, tokens: int = 8192,
                 profile: str = "qwen3-30b-a3b", seed: int = 0) -> list:
    """One routing.UniformPicks per layer whose table is that layer's trace (the forced-pick mechanism
    of `--routing uniform`, fed a trace instead of uniform draws; each routed row takes the next row)."""
    import torch
    from runtime.experts.routing import UniformPicks
    picks = generate(tokens, num_experts, top_k, PROFILES[profile], layers=num_layers, seed=seed)
    return [UniformPicks(torch.from_numpy(picks[i]).to(device), torch.zeros(1, dtype=torch.int64, device=device))
            for i in range(num_layers)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.routing_traces", description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=4)
    a = ap.parse_args(argv)
    for name, (E, k) in (("qwen3-30b-a3b", (128, 8)), ("qwen-512", (512, 10))):
        picks = generate(a.tokens, E, k, PROFILES[name], layers=a.layers)
        print(f"{name} ({E} experts, top-{k}): {coverage(picks, E):.0%} of experts cover 90% of picks; "
              f"LRU of {E // 8}: {lru_hit_rate(picks, E // 8):.0%}, of {E // 4}: {lru_hit_rate(picks, E // 4):.0%}")
        for c, row in compare_policies(picks, E, (E // 8, E // 4, E // 2)).items():
            print(f"  cache of {c:3d}: " + ", ".join(f"{name} hits {r['hit_rate']:.1%} PCIe {r['pcie_per_pick']:.3f}"
                                                     for name, r in row.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
