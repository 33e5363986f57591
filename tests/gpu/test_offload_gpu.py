"""Expert offload on the GPU: logits with cold experts in pinned host RAM equal the all-in-VRAM run.

Model: the Qwen3-30B-A3B shape cut to 8 layers (128 experts of 2048 x 768, top-8, 4 bits), so a
budget can hold some experts of every layer beside the double-buffered prefill staging. Every path
is exercised: a 40-row prefill (staged: 320 pairs >= 2 x 128), decode steps (graph, cold experts
read in place over PCIe), verify with 2/5/8 rows after rollbacks (split-K, in place), a 24-row
forward (grouped kernels, in place), then again after re-placements, and the naive baseline.
Offload moves bytes, not arithmetic: the same kernels add the same products. What may differ is the
order of the split-K atomics (fp32) and, from it, an fp16 rounding of the expert's intermediate h;
measured on the H200: 1.1e-3 to 2.5e-3 relative on the logits of 8 layers (the all-in-VRAM engine's
own run-to-run spread is of that order). Where a router's k-th and (k+1)-th logits nearly tie, such a
rounding picks another expert, and that row differs by a choice (~3e-2, and every row it reaches after):
so the offloaded runs take the picks and weights the all-in-VRAM run made (tests/gpu/routing_replay.py),
except under forced uniform routing, whose picks are shared by construction. TOL is the GPU engine's
tolerance (tests/gpu/test_exl2_engine.py).
With MOEDESK_GPU_REPORT=FILE set, measured figures are appended to FILE as JSON lines.
"""
from __future__ import annotations

import pytest
import torch

from gpu_figures import record as _record
from routing_replay import Picks, Routing
from runtime.options import LoadOptions, OffloadOptions

pytestmark = pytest.mark.gpu
TOL = 1e-2
SCRIPT_ROWS = 40 + 4 + 2 + 5 + 8 + 24 + 1        # the rows one _script routes in each MoE layer
GiB = 1024 ** 3


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    monkeypatch.setenv("MOEDESK_HOME", str(tmp_path))      # routing statistics go here


def _load(path, **off):
    from runtime.backends import exl2
    opts = LoadOptions(offload=OffloadOptions(context_length=512, **off))
    return exl2.load(path, opts, lambda *a: None)


def _script(eng, toks, lend: bool = False, wrap: Picks | None = None) -> dict[str, torch.Tensor]:
    """Prefill, decode, verify, rows, rollback. lend: after the first decode step, wait for the
    staging pages lent to cold experts (copies started at that step) and point them, so the steps
    after read those experts from the pages. wrap: records each forward's picks, or gives them."""
    out = {}

    def forward(key, tokens):
        run = (lambda: eng.forward(tokens))
        out[key] = wrap(key, tokens, run) if wrap is not None else run()
    eng.reset()
    forward("prefill_40", toks[:40])
    for i in range(40, 44):
        forward(f"decode_{i}", [toks[i]])
        if lend and i == 40:
            from exllamav2.device import set_device_streams
            set_device_streams()                          # table writes on the stream the steps run on
            eng.offload.staging.settle_lending()
            assert eng.telemetry()["expert_lent"] > 0
    for R in (2, 5, 8):
        forward(f"verify_{R}", toks[44:44 + R])
        eng.truncate(44)
    forward("rows_24", toks[44:68])
    eng.truncate(44)
    forward("decode_after_rollback", [toks[44]])
    return {k: v.float().cpu() for k, v in out.items()}


def _errors(got, want, label, **more) -> dict[str, float]:
    """Each forward's relative error against `want`, recorded (with `more`)."""
    errs = {k: ((got[k] - want[k]).norm() / want[k].norm()).item() for k in want}
    _record(test="offload_vs_vram", case=label, errors=errs, **more)
    return errs


def _compare(got, want, label):
    errs = _errors(got, want, label)
    bad = {k: e for k, e in errs.items() if not e < TOL}
    assert not bad, f"{label}: relative errors above {TOL}: {bad}"
    return errs


def _code_bytes(eng) -> int:
    return sum(p.qweight.numel() * 4 for m in eng.moe for p in (m.experts.w1, m.experts.w3, m.experts.w2))


def _all_in_vram(path, seed: int, uniform: bool = False, routing: Routing | None = None):
    """The reference run, every expert in VRAM: (tokens, its outputs, expert code bytes, other VRAM in
    use, prefill scratch, its picks per forward with `routing`, else None), for sizing a budget that forces
    offload. uniform: under forced uniform routing."""
    from runtime.backends.gpu_offload import prefill_scratch_bytes
    toks = torch.randint(0, 151936, (68,), generator=torch.Generator().manual_seed(seed)).tolist()
    ref, applied = _load(path)
    try:
        assert ref.offload is None and applied["offload.ram_budget_gb"].startswith("ignored")
        starts = _uniform(ref) if uniform else None
        rec = Picks(routing, ref) if routing is not None else None
        want = _script(ref, toks, wrap=rec)
        if uniform:
            _check_routed(ref, starts, "all in VRAM")
        codes = _code_bytes(ref)
        others = torch.cuda.memory_allocated() - codes
        scratch = prefill_scratch_bytes(ref.model.config)
    finally:
        ref.close()
    if routing is not None:
        routing.reset()                                   # the next engine's layers may take these addresses
    return toks, want, codes, others, scratch, rec.picks if rec is not None else None


def _finish_swaps(eng, toks) -> None:
    """Decode until every layer's promotion copy is done, then one step: the boundary that points the
    tables at the new slots."""
    m = eng.offload
    eng.reset()
    eng.forward(toks[:8])
    for t in toks[8:16]:
        eng.forward([t])
        if not any(lo.pending for lo in m.layers):
            break
    eng.forward([toks[16]])


def test_offload_matches_all_in_vram(moe_8l, routing):
    toks, want, codes, others, scratch, picks = _all_in_vram(moe_8l, seed=4, routing=routing)
    # Half the experts' codes beside everything else: every layer keeps some, staging the rest.
    budget = others + scratch + codes // 2 + (64 << 20)
    torch.cuda.reset_peak_memory_stats()
    eng, applied = _load(moe_8l, vram_budget_gb=budget / GiB, placement="stream")   # GPU paths only
    try:
        for k in ("vram_budget_gb", "ram_budget_gb", "placement"):
            assert applied[f"offload.{k}"] == "applied", applied
        assert applied["offload.cpu_threads"].startswith("ignored")
        tel = eng.telemetry()
        res = tel["expert_residents"]
        assert all(0 < r < 128 for r in res), res
        assert tel["expert_paths"] == ["stream"] * 8 and tel["expert_staging_capacity"] > 0
        assert tel["vram_budget_used_bytes"] <= tel["vram_budget_bytes"]
        got = _script(eng, toks, lend=True, wrap=Picks(routing, eng, picks))
        errs = _compare(got, want, "placed at load")
        tel = eng.telemetry()
        assert tel["decode_graphs"], tel.get("graph_error")
        assert 0 < tel["expert_hit_rate"] < 1 and tel["pcie_bytes_per_token"] > 0
        assert tel["expert_moved_bytes"]["staged"] > 0 and tel["expert_moved_bytes"]["lent"] > 0
        assert torch.cuda.max_memory_reserved() <= tel["vram_budget_bytes"] * 1.02 + (256 << 20)
        _record(test="offload_telemetry", residents=res, hit_rate=tel["expert_hit_rate"],
                pcie_bytes_per_token=tel["pcie_bytes_per_token"], budget_gb=budget / GiB, errors=errs)

        # Re-placement between steps: swap an expert in every layer, finish at later boundaries.
        m = eng.offload
        from exllamav2.device import set_device_streams
        set_device_streams()                              # table writes on the stream the steps run on
        for lo in m.layers:
            m.residency.swap(lo.index, lo.resident()[0], lo.cold()[0])
        _finish_swaps(eng, toks)
        assert not any(lo.pending for lo in m.layers)
        assert eng.telemetry()["expert_promotions"] >= 8
        _compare(_script(eng, toks, wrap=Picks(routing, eng, picks)), want, "after re-placement")

        # The naive baseline (layer loop, copies on demand) computes the same.
        graphs, eng.graphs = eng.graphs, None
        run = eng.experiment
        eng.set_experiment(run.replace(naive=True))
        try:
            _compare(_script(eng, toks, wrap=Picks(routing, eng, picks)), want, "naive")
        finally:
            eng.set_experiment(run)
            eng.graphs = graphs
    finally:
        eng.close()


def test_forced_mixed_placement_and_new_budget(moe_8l, routing):
    """place_experts (any residency) and set_vram_budget (the load-time planner again) keep logits."""
    toks, want, *_, picks = _all_in_vram(moe_8l, seed=6, routing=routing)
    eng, _ = _load(moe_8l, vram_budget_gb=100.0, placement="stream")
    try:
        assert eng.telemetry()["expert_path_counts"] == {"vram": 8}        # everything fits
        _compare(_script(eng, toks, wrap=Picks(routing, eng, picks)), want, "all resident through the tables")
        eng.place_experts([list(range(i, 128, 3)) for i in range(3)] + [[5], [], [0, 127]] + [list(range(64))] * 2)
        tel = eng.telemetry()
        assert tel["expert_residents"] == [43, 43, 42, 1, 0, 2, 64, 64]      # range(i, 128, 3)
        _compare(_script(eng, toks, wrap=Picks(routing, eng, picks)), want, "forced mixed")
        ledger = tel["vram_budget_items"]
        cb = eng.offload.layers[0].code_bytes
        small = (sum(v for k, v in ledger.items() if k not in ("hot experts", "prefill staging"))
                 + (2 * 128 + 8 * 20) * cb) / GiB                   # staging for all + ~20 per layer
        eng.set_vram_budget(small)
        tel = eng.telemetry()
        assert tel["vram_budget_used_bytes"] <= tel["vram_budget_bytes"]
        assert 0 < sum(tel["expert_residents"]) < 8 * 128
        _compare(_script(eng, toks, wrap=Picks(routing, eng, picks)), want, f"set_vram_budget({small:.2f})")
    finally:
        eng.close()


@pytest.mark.parametrize("split,balance,signal", [("experts", 0.0, "memops"), ("experts", 1.5, "memops"),
                                                  ("experts", 0.0, "hostfunc"), ("cut", 0.0, "memops"),
                                                  ("cut", 0.0, "hostfunc")],
                         ids=["static", "balanced", "static-hostfunc", "cut", "cut-hostfunc"])
def test_cpu_path_matches_all_in_vram(moe_8l, monkeypatch, routing, split, balance, signal):
    """placement 'cpu': decode steps compute part of each layer's cold experts on the CPU (a worker
    thread the step's stream signals: a doorbell written and waited for by stream memory operations,
    which must work on this GPU, or host nodes) while the GPU kernels skip them; verify rows and
    prefill keep the GPU paths. The split is forced (equal CPU and PCIe rates, no overhead) so every
    layer owns experts whatever this host measures; the measured rates are recorded. Balanced: copies
    of 1.5x the experts, each step's mask computed on the device from the token's picks
    (cpu_share.CPU_BALANCE). Cut: every cold expert's first rows on the CPU, the rest on the GPU, at
    the planned cut and at one set while the decode graphs stay captured (cpu_share.CPU_SPLIT). No routing
    prior: the experts are placed by uniform statistics, so every layer keeps some cold (the calibration
    prompt's picks in this synthetic model's layer 0 fell on 110 of its 128 experts, which the budget then
    kept in VRAM, and a layer whose cold experts no statistic picks gives the CPU nothing)."""
    from runtime import tuning
    from runtime.offload import cpu_share
    from runtime.cpu import doorbell as cpu_signal
    from runtime.offload.placement import CpuSplitCosts
    monkeypatch.setattr(cpu_share, "CPU_BALANCE", balance)
    monkeypatch.setattr(cpu_share, "CPU_SPLIT", split)
    if signal == "hostfunc":
        monkeypatch.setattr(cpu_signal, "_SIGNAL", ("hostfunc", "forced by the test"))
    toks, want, codes, others, scratch, picks = _all_in_vram(moe_8l, seed=8, routing=routing)
    measured = {}
    real_costs = cpu_share.CpuShare._split_costs

    def forced(self, resident, threads):
        measured["costs"] = real_costs(self, resident, threads)
        return CpuSplitCosts(50e9, 50e9, 0.0, measured["costs"].cpu_bytes_ratio)
    monkeypatch.setattr(cpu_share.CpuShare, "_split_costs", forced)
    budget = others + scratch + codes // 2 + (64 << 20)
    with tuning.use(tuning.with_changes(route_prior=False)):
        eng, applied = _load(moe_8l, vram_budget_gb=budget / GiB, placement="cpu", cpu_threads=4)
    try:
        assert applied["offload.placement"] == "applied" and applied["offload.cpu_threads"] == "applied", applied
        tel = eng.telemetry()
        assert tel["expert_paths"] == ["cpu+stream"] * 8 and tel["cpu_expert_path"] == "on", tel
        assert tel["cpu_expert_signal"].startswith(signal), tel["cpu_expert_signal"]
        assert all(n > 0 for n in tel["cpu_expert_owned"])
        got = _script(eng, toks, lend=True, wrap=Picks(routing, eng, picks))
        errs = _compare(got, want, "cpu path")
        tel = eng.telemetry()
        assert tel["decode_graphs"], tel.get("graph_error")
        assert any(t == 1 for _, t in eng.graphs.captured())              # the decode step was captured
        assert tel["cpu_expert_pairs"] > 0 and tel["cpu_expert_ms_per_token"] > 0
        assert "cpu_expert_errors" not in tel, tel["cpu_expert_errors"]
        c = measured["costs"]
        if balance:
            assert all(lo.cpu.share is not None for lo in eng.offload.layers)
        if split == "cut":
            m = eng.offload
            # of 768 rows; the copies a quarter of them wider (cpu_share.copy_widths: the RAM budget holds it)
            assert m.cpu.cut == 384 and all(lo.cpu.cut == 384 and lo.cpu.width == 576 for lo in m.layers)
            run = eng.experiment
            eng.set_experiment(run.replace(fixed_cut=True))
            m.cpu.set_cut(128)
            _compare(_script(eng, toks, wrap=Picks(routing, eng, picks)), want, "cpu path, cut 128 of 768")
            eng.set_experiment(run)
        _record(test="cpu_path", split=split, balance=balance, signal=tel["cpu_expert_signal"], errors=errs, cpu_ms_per_token=tel["cpu_expert_ms_per_token"],
                cpu_pairs=tel["cpu_expert_pairs"], owned=tel["cpu_expert_owned"],
                measured_cpu_gbps=c.cpu_bytes_per_s / 1e9, measured_pcie_gbps=c.pcie_bytes_per_s / 1e9)

        # Promote an expert the CPU owns in every layer: it goes back to the GPU when its copy lands.
        m = eng.offload
        from exllamav2.device import set_device_streams
        set_device_streams()
        moved = {}
        for lo in m.layers:
            e = sorted(lo.cpu.owned_set)[0]
            m.residency.swap(lo.index, lo.resident()[0], e)
            moved[lo.index] = e
        _finish_swaps(eng, toks)
        assert all(moved[lo.index] in lo.expert_slot and moved[lo.index] not in lo.cpu.owned_set
                   for lo in m.layers)
        _compare(_script(eng, toks, wrap=Picks(routing, eng, picks)), want, "cpu path after re-placement")
    finally:
        eng.close()


def _uniform(eng) -> list[int]:
    """Forced uniform routing (the benchmark's; the same pick sets in every engine), graphs dropped; each
    MoE layer's pick counter at the start."""
    from bench.offload import force_uniform_routing
    force_uniform_routing(eng)
    return [int(p.step) for p in eng.experiment.forced_routing]


def _check_routed(eng, starts: list[int], label: str) -> None:
    """Under forced routing, each layer handed out one pick set per row the script routed, no more: a
    capture's warm-up run takes none (else the picks after a capture depend on how many graphs were
    captured, and two engines' runs part)."""
    routed = [int(p.step) - s for p, s in zip(eng.experiment.forced_routing, starts)]
    assert routed == [SCRIPT_ROWS] * len(starts), f"{label}: pick sets handed out per layer {routed}"


def _picks_part(got: dict, want: dict) -> list[str]:
    """Where two runs' recorded picks (routing_replay.Picks.picks) differ: 'forward key, layer, rows'."""
    out = []
    for key, layers in want.items():
        for layer, ((ids, _), (mine, _)) in enumerate(zip(layers, got[key])):
            rows = (ids.sort(-1).values != mine.sort(-1).values).any(-1).nonzero().flatten().tolist()
            if rows:
                out.append(f"{key}, layer {layer}, rows {rows}")
    return out


@pytest.mark.parametrize("placement", ["stream", "cpu"])
def test_decode_prefetch_matches_all_in_vram(moe_8l, monkeypatch, placement, routing):
    """Decode prefetch, copying on every step: each layer's likely cold experts copied into VRAM pages
    on a side stream inside the captured decode step, read from there by the GPU kernels (and left
    out of the CPU's part). Under forced uniform routing (the same picks as all in VRAM's, checked) the
    script runs in phases on one load, each recorded before anything is asserted: copying off (the forced
    picks alone); the oracle keeping every forced pick (every copy is an expert the layer then picks, so the
    pages are read); the oracle keeping none (copies of experts not picked: the pages and step tables change,
    nothing reads them); the router's own prediction (scored, near chance); the oracle again, and eagerly (no
    decode graphs). The logits equal all in VRAM's in every phase. Until the side stream waited for the next
    attention's q/k/v (runtime/offload/prefetch.py says why), the copying phases came out 1e-2 to 2e-2 off on
    the H200 in both placements, varying from run to run, also with the copies written elsewhere and never
    read: exllamav2's q/k/v GEMMs beside the copy kernel."""
    from runtime.offload import cpu_share
    from runtime.offload import manager as mgr
    from runtime.offload.placement import CpuSplitCosts
    monkeypatch.setattr(mgr, "PREFETCH_PAGES", 4)
    if placement == "cpu":
        monkeypatch.setattr(cpu_share.CpuShare, "_split_costs",
                            lambda self, resident, threads: CpuSplitCosts(50e9, 50e9, 0.0, 1.0))
    toks, want, codes, others, scratch, picks = _all_in_vram(moe_8l, seed=10, uniform=True, routing=routing)
    budget = others + scratch + codes // 2 + (64 << 20)
    eng, _ = _load(moe_8l, vram_budget_gb=budget / GiB, placement=placement, cpu_threads=4)
    # (mode, oracle, graphs); "oracle again" tells a difference that varies run to run (an order not kept) from
    # one that does not; the last phase drops the decode graphs for good (eager steps: the capture's part)
    phases = {"copying off": ("off", None, True), "oracle": ("on", 1.0, True), "oracle again": ("on", 1.0, True),
              "oracle keeping none": ("on", 0.0, True), "router": ("on", None, True),
              "oracle, eager": ("on", 1.0, False)}
    seen = {}
    try:
        m = eng.offload
        pf = m.prefetch
        assert pf is not None and pf.P == 4 and eng.telemetry()["vram_budget_items"]["decode prefetch"] > 0
        for phase, (mode, oracle, graphs) in phases.items():
            label = f"prefetch, {phase}, {placement}"
            if not graphs:
                eng.reset_graphs()
                eng.graphs = None
            pf.set_mode(mode)
            eng.set_experiment(eng.experiment.replace(prefetch_oracle=oracle))
            starts = _uniform(eng)                     # the same pick sets from the start again
            score0, cpu0 = pf.totals(), eng.telemetry()["cpu_expert_pairs"]
            rec = Picks(routing, eng)
            got = _script(eng, toks, wrap=rec)
            _check_routed(eng, starts, label)
            part = _picks_part(rec.picks, picks)
            assert not part, f"{label}: the picks part from all in VRAM's at {part}"
            tel = eng.telemetry()
            score = [b - a for a, b in zip(score0, pf.totals())]        # candidates, picked; copies, picked
            cpu_pairs = tel["cpu_expert_pairs"] - cpu0
            errs = _errors(got, want, label, score=score, cpu_pairs=cpu_pairs)
            seen[phase] = (errs, score, cpu_pairs, tel, graphs)
    finally:
        eng.close()
    bad = {p: {k: e for k, e in errs.items() if not e < TOL} for p, (errs, *_) in seen.items()}
    bad = {p: b for p, b in bad.items() if b}
    assert not bad, f"{placement}: relative errors above {TOL} (phase: forward: error): {bad}; " \
                    f"scores and CPU pairs {[(p, s, c) for p, (_, s, c, *_) in seen.items()]}"
    for phase in ("oracle", "oracle again", "oracle, eager"):
        c, ch, k, kh = seen[phase][1]
        assert k > 0 and kh == k and ch == c, (phase, c, ch, k, kh)          # every copy picked, and read
    assert seen["copying off"][1][2] == 0, seen["copying off"][1]
    c, ch, k, kh = seen["router"][1]
    assert c > 0 and k > 0, (c, ch, k, kh)
    for _, _, cpu_pairs, tel, graphs in seen.values():
        assert tel["decode_graphs"] or not graphs, tel.get("graph_error")
        if placement == "cpu":
            assert tel["cpu_expert_path"] == "on" and cpu_pairs > 0, (tel["cpu_expert_path"], cpu_pairs)
