"""The CUDA engine's router picks, recorded or replayed, for tests that compare two computations row by row.

Where a row's k-th and (k+1)-th router logits nearly tie, two computations that round apart (fp16 against
the float32 reference, or a cold expert's path against all in VRAM) may pick different experts. That row
then differs by a choice, not an error, and so does every later row that attends to it in a later layer:
on synthetic weights such rows are common (Mixtral-8x22B's real width: 7 of 36 positions within 2% of a
standard deviation), and leaving out the near ties alone does not remove the rows they reach. So the
comparisons share the picks instead:
- mode "record": after each forward, each MoE layer's picks and weights (`take`), to hand to the float32
  reference (runtime/reference/model._route's `expert`, see `reference_forward`) or to another engine;
- mode "replay": every MoE layer takes the picks and weights given (`give`) before the forward, in
  place of its router's (which still runs: its counts and launches stay as they are; what it picked is
  kept beside them, `take_own`, for tests that check the router against the one whose picks it took).
Both work under CUDA graphs: the copies are captured with the step, reading and writing buffers of a fixed
address per layer. Install before the engine loads (`monkeypatch`), so that graphs captured at load hold
the copies; after switching to replay, `engine.reset_graphs()`."""
from __future__ import annotations

from typing import NamedTuple

import torch

MAX_ROWS = 8192         # the largest forward routed through it (a load's warm-up prefill included): its buffers' rows


class Routing:
    def __init__(self, monkeypatch):
        from runtime.experts import layer
        self.real, self.real_normed = layer.route_fused, layer.route_normed
        self.mode = "record"
        self.ids: dict[int, torch.Tensor] = {}      # gate_w's address -> int32 [MAX_ROWS, A]
        self.weights: dict[int, torch.Tensor] = {}  # fp32 [MAX_ROWS, A]
        self.own: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}   # replay: the router's own (ids, weights)
        self.left: set[int] = set()                 # gate_w addresses of layers that route themselves (`leave`)
        self.followed: dict[int, list] = {}         # gate_w address -> every eager call's (ids, weights) (`follow`)
        self.cursor: dict[int, int] = {}
        self.monkeypatch = monkeypatch
        # where the layers call them (runtime/experts/layer.py)
        monkeypatch.setattr(layer, "route_fused", self._route)
        monkeypatch.setattr(layer, "route_normed", self._route_normed)     # the norm in the routing's launch

    def undo(self) -> None:
        self.monkeypatch.undo()

    def _buffers(self, gate_w: torch.Tensor, top_k: int):
        key = gate_w.data_ptr()
        if key not in self.ids:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError("routing_replay: a layer's first routing inside a graph capture")
            # distinct picks, equal weights until given (a graph captured at load in replay mode runs them)
            self.ids[key] = torch.arange(top_k, dtype=torch.int32, device=gate_w.device).repeat(MAX_ROWS, 1)
            self.weights[key] = torch.full((MAX_ROWS, top_k), 1 / top_k, dtype=torch.float32, device=gate_w.device)
            self.own[key] = (torch.zeros_like(self.ids[key]), torch.zeros_like(self.weights[key]))
        return self.ids[key], self.weights[key]

    def _route(self, x, gate_w, top_k, counts, renormalize=True, forced=None):
        ids, w = self.real(x, gate_w, top_k, counts, renormalize, forced=forced)
        return self._share(gate_w, top_k, ids, w)

    def _route_normed(self, h, norm_w, eps, gate_w, top_k, counts, counters, renormalize=True, forced=None):
        x, ids, w = self.real_normed(h, norm_w, eps, gate_w, top_k, counts, counters, renormalize, forced=forced)
        return (x, *self._share(gate_w, top_k, ids, w))

    def _share(self, gate_w, top_k, ids, w):
        """ids, w of a routing: recorded, or overwritten by the ones given."""
        T = ids.shape[0]
        key = gate_w.data_ptr()
        if key in self.left:
            return ids, w
        if key in self.followed:
            return self._follow_call(key, ids, w)
        if T > MAX_ROWS:
            raise RuntimeError(f"routing_replay: {T} rows, more than its buffers' {MAX_ROWS}")
        bi, bw = self._buffers(gate_w, top_k)
        if self.mode == "record":
            bi[:T].copy_(ids)
            bw[:T].copy_(w)
        else:
            oi, ow = self.own[key]
            oi[:T].copy_(ids)
            ow[:T].copy_(w)
            ids.copy_(bi[:T])
            w.copy_(bw[:T])
        return ids, w

    def reset(self) -> None:
        """Before another engine loads (its layers' addresses may be the last one's)."""
        self.ids.clear(), self.weights.clear(), self.own.clear(), self.left.clear()
        self.followed.clear(), self.cursor.clear()
        self.mode = "record"

    def leave(self, gate_w: torch.Tensor) -> None:
        """This router (an MoE layer outside `engine.moe`: Qwen3.5's MTP head) keeps its own picks in both
        modes (until `reset`)."""
        self.followed.pop(gate_w.data_ptr(), None)
        self.left.add(gate_w.data_ptr())

    def follow(self, gate_w: torch.Tensor, given: list | None = None) -> list:
        """This router (an MoE layer outside `engine.moe`, run eagerly any number of times a step: Qwen3.5's
        MTP head) shares its picks call by call (until `reset`): in record mode every call's (ids, weights)
        is appended to the list returned; in replay mode each call takes the next of `given`."""
        key = gate_w.data_ptr()
        self.left.discard(key)
        self.followed[key] = [] if given is None else list(given)
        self.cursor[key] = 0
        return self.followed[key]

    def followed_left(self, gate_w: torch.Tensor) -> int:
        """Replay mode: the given calls of a followed router not taken yet."""
        key = gate_w.data_ptr()
        return len(self.followed[key]) - self.cursor[key]

    def _follow_call(self, key: int, ids: torch.Tensor, w: torch.Tensor):
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("routing_replay: a followed router inside a graph capture")
        calls = self.followed[key]
        if self.mode == "record":
            calls.append((ids.to("cpu", torch.int32, copy=True), w.to("cpu", torch.float32, copy=True)))
            return ids, w
        i = self.cursor[key]
        if i >= len(calls):
            raise RuntimeError(f"routing_replay: a followed router's call {i + 1}, {len(calls)} given")
        self.cursor[key] = i + 1
        ids.copy_(calls[i][0].to(ids.device, ids.dtype))
        w.copy_(calls[i][1].to(w.device, w.dtype))
        return ids, w

    def take(self, engine, rows: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """After a forward of `rows` rows: per MoE layer, (picks int32 [rows, A], weights fp32 [rows, A]) on
        the CPU."""
        out = []
        for m in engine.moe:
            bi, bw = self._buffers(m.experts.gate_w, m.experts.top_k)
            out.append((bi[:rows].to("cpu", copy=True), bw[:rows].to("cpu", copy=True)))
        return out

    def take_own(self, engine, rows: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """After a forward in replay mode: per MoE layer, what its router picked itself (as `take`)."""
        out = []
        for m in engine.moe:
            self._buffers(m.experts.gate_w, m.experts.top_k)
            oi, ow = self.own[m.experts.gate_w.data_ptr()]
            out.append((oi[:rows].to("cpu", copy=True), ow[:rows].to("cpu", copy=True)))
        return out

    def give(self, engine, picks: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Before a forward: the picks and weights (as `take` returns them) every MoE layer is to use."""
        assert len(picks) == len(engine.moe), (len(picks), len(engine.moe))
        with torch.inference_mode():            # the buffers were made in the engine's forward (inference mode)
            for m, (ids, w) in zip(engine.moe, picks):
                bi, bw = self._buffers(m.experts.gate_w, m.experts.top_k)
                bi[:ids.shape[0]].copy_(ids)
                bw[:w.shape[0]].copy_(w)
                self.own[m.experts.gate_w.data_ptr()][0][:ids.shape[0]].fill_(-1)   # until its router runs (`missed`)

    def missed(self, engine, rows: int) -> list[int]:
        """After a forward that `give` prepared: the MoE layers whose router never ran through the replay
        (their own picks still read -1), so never took the picks given: a replay that did not hold."""
        return [i for i, m in enumerate(engine.moe)
                if bool((self.own[m.experts.gate_w.data_ptr()][0][:rows] < 0).any())]


class Picks:
    """Wraps each forward of a test's script on `engine` (`__call__(key, tokens, run)`, run() the forward):
    records its picks (`picks[key]`: per MoE layer (ids, weights), as `Routing.take`), or, with `given`
    (another run's `picks`, by the same keys), gives them and keeps what the engine's routers picked
    themselves (`own[key]`). With `given` the routing goes to replay mode; graphs the engine holds are
    captured again with the replay in them (from a record mode: a replay mode set before the engine loaded
    needs none)."""

    def __init__(self, routing: Routing, engine, given=None):
        self.routing, self.engine, self.given = routing, engine, given
        self.picks: dict = {}
        self.own: dict = {}
        if given is not None and routing.mode != "replay":
            routing.mode = "replay"
            if getattr(engine, "graphs", None) is not None:
                engine.reset_graphs()

    def __call__(self, key, tokens, run):
        if self.given is not None:
            self.routing.give(self.engine, self.given[key])
        out = run()
        if self.given is None:
            self.picks[key] = self.routing.take(self.engine, len(tokens))
        else:
            missed = self.routing.missed(self.engine, len(tokens))
            assert not missed, f"{key}: MoE layers {missed} did not take the picks given (the replay did not hold)"
            self.own[key] = self.routing.take_own(self.engine, len(tokens))
        return out


class RouterView(NamedTuple):
    """What a reference MoE layer's router made of a forward's rows, whichever picks it was then given."""
    own: torch.Tensor       # int64 [T, A]: its own top-A experts, sorted
    gap: torch.Tensor       # float32 [T]: its A-th minus (A+1)-th logit
    spread: float           # its logits' standard deviation over the rows and experts


def _routed(ref, tokens, expert_of, routers: list | None = None) -> list:
    """The reference's forward of `tokens`, each MoE layer's picks `expert_of(layer index)` (None: its own);
    -> per layer, what _route returned (weights [T, A], picks [T, A]). `routers` (if given) gets each MoE
    layer's RouterView."""
    from runtime.reference import model
    from tests.router_ties import router_view
    real, seen = model._route, []

    def route(layer, spec, h, expert=None):
        if routers is not None:
            own, gap, spread = router_view(layer, spec, h)
            routers.append(RouterView(own.cpu(), gap.cpu(), spread))
        seen.append(real(layer, spec, h, expert_of(len(seen))))
        return seen[-1]
    model._route = route
    try:
        seen.append(ref.forward(tokens))
    finally:
        model._route = real
    return seen


def reference_forward(ref, tokens, picks: list[tuple[torch.Tensor, torch.Tensor]], weights: list | None = None,
                      routers: list | None = None):
    """The float32 reference's forward of `tokens` ([T, V] logits), each MoE layer routed to the engine's
    picks (as `Routing.take` returns them); the weights are the reference's own over those experts, appended
    per layer to `weights` (float32 [T, A]) if given; what its routers would have picked on the way, given
    the picks before (the same history as the engine's), to `routers` (RouterView per layer)."""
    def expert_of(i: int):
        assert i < len(picks), f"the reference ran more MoE layers than the engine recorded ({len(picks)})"
        return picks[i][0]
    *routes, out = _routed(ref, tokens, expert_of, routers)
    assert len(routes) == len(picks), f"the reference ran {len(routes)} MoE layers, the engine {len(picks)}"
    if weights is not None:
        weights += [w.float().cpu() for w, _ in routes]
    return out


def reference_picks(ref, tokens) -> list[list[list[int]]]:
    """The reference's own picks for `tokens` from an empty cache: [layer][position] -> sorted expert ids."""
    ref.reset()
    try:
        *routes, _ = _routed(ref, tokens, lambda i: None)
    finally:
        ref.reset()
    return [[sorted(r) for r in e.tolist()] for _, e in routes]


class Compared(NamedTuple):
    errors: dict[str, float]      # check -> relative error (router_weights_<check>: the router weights')
    router_factor: float          # the router weights' tolerance over the logits' (router_factor)
    differ: list                  # (position, layer, the reference's gap there in stds, what) where picks part
    near_ties: int                # rows x layers under TIE, counted in every check's forward


def compare_with_reference(engine, ref, toks, routing: Routing, tie: float, rows: tuple[int, ...]) -> Compared:
    """The engine's checks against the float32 reference routed as the engine routed (`walk_script`), and where
    the engine's picks are not what the reference's router would have picked given the same picks before (its
    gaps in units of the first forward's logit spread per layer). `routing` installed before the engine loaded."""
    from gpu_figures import rel as _rel
    errs, differ, near, scale = {}, set(), 0, []

    def both(key, tokens, got, last):
        nonlocal near
        p = routing.take(engine, len(tokens))
        weights: list = []
        routers: list = []
        want = reference_forward(ref, tokens, p, weights, routers)
        scale[:] = scale or [r.spread for r in routers]
        errs[key] = _rel(got, want[-1:] if last else want)
        errs[f"router_weights_{key}"] = max(_rel(w, rw) for (_, w), rw in zip(p, weights))
        start = engine.position - len(tokens)
        for layer, ((ids, _), r) in enumerate(zip(p, routers)):
            gaps = r.gap / scale[layer]
            near += int((gaps < tie).sum())
            for row, mine in enumerate(ids.sort(dim=-1).values.tolist()):
                if mine != r.own[row].tolist():
                    differ.add((start + row, layer, round(float(gaps[row]), 4),
                                f"{mine}, the reference {r.own[row].tolist()}"))
    walk_script(engine, ref, toks, rows, both)
    return Compared(errs, router_factor(min(scale)), sorted(differ), near)


def walk_script(engine, ref, toks, rows: tuple[int, ...], check) -> None:
    """The reference comparisons' script over 40 tokens: prefill 24 (the head on the last row, then every row),
    decode 3, verify `rows` each after a rollback to 27, decode again. After each of the engine's forwards,
    check(key, tokens, got, last) (which runs the reference's forward of `tokens`: `last`, its last row
    only); the reference is reset and truncated with the engine."""
    engine.reset(), ref.reset()
    check("prefill_last_24", toks[:24], engine.prefill(toks[:24]), True)
    engine.reset(), ref.reset()
    check("prefill_24", toks[:24], engine.forward(toks[:24]), False)
    for i in range(24, 27):
        check(f"decode_{i}", [toks[i]], engine.forward([toks[i]]), False)
    for R in rows:
        check(f"verify_{R}", toks[27:27 + R], engine.forward(toks[27:27 + R]), False)
        engine.truncate(27), ref.truncate(27)
        assert engine.position == 27
    check("decode_after_rollback", [toks[27]], engine.forward([toks[27]]), False)


def router_factor(spread: float) -> float:
    """The router weights' tolerance over the logits': a relative error e of the router's input moves its
    logits by about e x their standard deviation `spread` (an error in no particular direction), and a
    renormalised top-k weight w_i by (z_i - sum_j w_j z_j)'s change: up to sqrt(2) x e x spread. Synthetic
    routers N(0, 0.02) over a normed input of width 6144 have logits of std ~1.6 (a factor ~2.2); the
    miniatures' (width 256) ~0.3 (a factor 1)."""
    return max(1.0, 2 ** 0.5 * spread)
