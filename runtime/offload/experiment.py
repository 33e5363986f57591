"""Benchmark and test experiments on the expert path: one explicit argument instead of loose switches.

The app runs with `NO_EXPERIMENT`. A benchmark (bench/offload.py) or a GPU test hands an `Experiment`
to the engine (`Exl2Engine.set_experiment`), which drops captured graphs where the change reaches what
they captured and passes it on here: forced picks to the layers, the rest to the offload manager.

- **naive**: the naive baseline: every cold expert a step needs is copied into VRAM on demand after a
  host synchronisation per layer, nothing overlapped (no graphs: the caller runs the layer loop).
- **forced_routing**: per MoE layer, pick sets (routing.UniformPicks) that replace the router's picks
  after it has run (bench.offload --routing uniform or trace). It measures a placement under the
  routing the roofline assumes; what the model outputs means nothing. `routing_label` names it
  ("uniform", "trace ..."): an expert-path decision timed under forced routing is saved apart from
  the model's own (runtime/backends/expert_path.decision_key).
- **prefetch_oracle**: the decode prefetch is handed the next layer's forced picks, each kept with this
  probability, to measure what a given prediction accuracy buys (needs forced_routing).
- **prefetch**: False leaves the decode prefetch out of the step altogether (its pages stay reserved).
- **fixed_cut**: the CPU path's cut is not moved while decoding (benchmarks of fixed cuts).
- **lend_staging**: False leaves the staging pages empty between prefills (what lending gains).
- **trial_stream**: the expert-path decision's timed steps (runtime/backends/expert_path.time_decode_steps)
  decode a fixed random token stream, as bench.offload's decode does, instead of the model's own greedy
  continuation: on random weights that continuation falls into a loop over a few experts, which stay in
  VRAM, so the trial times steps the benchmark never runs (the likely reason, not confirmed, why Mixtral
  at 24 GB on the H200 was judged at 21.6 ms a trial step and measured at 75 ms a benchmark token). Its
  decision is saved apart from the model's own.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional, Sequence


@dataclass(frozen=True, eq=False)
class Experiment:
    naive: bool = False
    forced_routing: Optional[tuple[Any, ...]] = None
    routing_label: str = ""
    prefetch_oracle: Optional[float] = None
    prefetch: bool = True
    fixed_cut: bool = False
    lend_staging: bool = True
    trial_stream: bool = False

    def __post_init__(self):
        if self.forced_routing is not None:
            picks = tuple(self.forced_routing)
            if not picks:
                raise ValueError("Experiment.forced_routing: want one pick set per MoE layer, got none")
            object.__setattr__(self, "forced_routing", picks)
        q = self.prefetch_oracle
        if q is not None and not (isinstance(q, (int, float)) and 0.0 <= q <= 1.0):
            raise ValueError(f"Experiment.prefetch_oracle={q!r}: want None or a probability in 0..1")

    def replace(self, **changes) -> "Experiment":
        return dataclasses.replace(self, **changes)

    def forced(self, index: int):
        """Layer `index`'s forced picks, or None (the router's own)."""
        return self.forced_routing[index] if self.forced_routing is not None else None

    def oracle(self, index: int):
        """(forced picks, probability) the prefetch is handed for layer `index`, or None."""
        if self.prefetch_oracle is None or self.forced_routing is None:
            return None
        return self.forced_routing[index], self.prefetch_oracle

    def changes_graphs(self, other: "Experiment") -> bool:
        """Whether going to `other` changes what a captured decode step does (then graphs are dropped):
        the forced picks, the oracle, the prefetch in the step, the baseline. The cut and lending are
        decided between steps."""
        mine, theirs = self.forced_routing or (), other.forced_routing or ()
        return (self.naive != other.naive or self.prefetch != other.prefetch
                or self.prefetch_oracle != other.prefetch_oracle
                or len(mine) != len(theirs) or any(a is not b for a, b in zip(mine, theirs)))

    def check_layers(self, n: int) -> None:
        if self.forced_routing is not None and len(self.forced_routing) != n:
            raise ValueError(f"Experiment.forced_routing has {len(self.forced_routing)} pick sets for {n} MoE layers")

    @property
    def offload_only(self) -> bool:
        """Whether it asks for something only expert offload has (the rest works on any MoE layer)."""
        return (self.naive or self.prefetch_oracle is not None or not self.prefetch or self.fixed_cut
                or not self.lend_staging)


NO_EXPERIMENT = Experiment()


def apply_experiment(experiment: Experiment, layers: Sequence, offload=None) -> None:
    """Hand `experiment` to the MoE layers (runtime/experts/layer.ExpertLayer: forced picks) and to the
    offload manager if there is one; between forwards, graphs already dropped where needed."""
    experiment.check_layers(len(layers))
    if offload is None and experiment.offload_only:
        raise ValueError(f"{experiment}: needs a model loaded with expert offload")
    if offload is not None:
        offload.set_experiment(experiment)
    for i, layer in enumerate(layers):
        layer.forced = experiment.forced(i)
