"""The routing prior at load (runtime/offload/route_prior.py), for any engine with expert offload.

`saved_statistics` reads a model's saved routing statistics for the offload's start and says whether
this load measures a prior; `measure_at_load` then runs the calibration prefill (after the warm-up's
kernels, before the expert path is timed: the paths are timed on the placement the answers get),
hands its routing counts to the manager and lets it place the experts again, once. Behind the load's
progress: "Placing experts: from a calibration prompt". The engine's part is `prefill`, `truncate`,
`position`, `vocab`, `info` and `offload`: the exllamav2 engine (runtime/backends/exl2.py, through
expert_path.settle_cpu_path) and the Qwen3.5 hybrid engine (hybrid.py) run the same.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

from runtime.engine import ProgressFn
from runtime.errors import BadRequest
from runtime.offload.route_prior import MAX_TOKENS, MIN_TOKENS, calibration_ids, prior_reason
from runtime.offload.routing_stats import RoutingStats, stats_path

log = logging.getLogger(__name__)
MESSAGE = "Placing experts: from a calibration prompt"


def saved_statistics(model_dir: Path, layers: int, experts: int, cache: Optional[Path] = None,
                     route_prior: bool = True):
    """(statistics or None, their file, a warning or None, why a prior is measured or None) for a
    model about to be placed; `cache`: the user cache (default runtime.paths.cache_dir()); route_prior:
    False measures none (Tuning.route_prior: the experts placed as if routing were uniform)."""
    if cache is None:
        from runtime.paths import cache_dir
        cache = cache_dir()
    stats_file = stats_path(cache, model_dir)
    stats, warning = RoutingStats.load(stats_file, layers, experts)
    reason = prior_reason(stats, warning) if route_prior else None
    return stats, stats_file, warning, reason


def measure_at_load(engine, progress: ProgressFn) -> bool:
    """Where the manager is owed a prior (`prior_reason`) and some experts are cold: one prefill of
    the calibration prompt at the cache position (rolled back after), its routing into the statistics,
    the experts placed again. Call it before the load's graphs are captured (any captured before are
    dropped). True when it ran."""
    manager = engine.offload
    if manager is None or manager.prior_reason is None:
        return False
    room = min(MAX_TOKENS, engine.info.context_length - engine.position - 1)
    if manager.all_in_vram or room < MIN_TOKENS:
        # every expert resident (nothing to choose), or no room for the prompt (and a prefill-sized
        # forward: no decode graph is captured): no prior at this load, and no placement waits for one
        manager.prior_not_measured("every expert is in VRAM" if manager.all_in_vram
                                   else f"{room} tokens of room in the context (fewer than {MIN_TOKENS})")
        return False
    progress("load", MESSAGE, 0, 1)
    info = engine.info
    ids, source = calibration_ids(Path(info.path) if info.path else None, info.vocab_size, room)
    refused = set(getattr(engine, "refused_tokens", ()))
    ids = [t for t in ids if t not in refused] or ids        # random ids: none the engine refuses
    log.info("routing prior: %s; %d tokens of %s", manager.prior_reason, len(ids), source)
    before = manager.routing_counts()
    pos0 = engine.position
    try:
        engine.prefill(ids)
    except BadRequest as e:                 # ids the engine refuses (a random one on an image placeholder)
        log.warning("no routing prior: %s", e)
        engine.truncate(pos0)
        manager.prior_not_measured(str(e))
        progress("load", MESSAGE, 1, 1)
        return False
    finally:
        engine.truncate(pos0)
    drop_graphs = getattr(engine, "_drop_graphs", None)
    if drop_graphs is not None:             # none captured at load yet; any would hold the old slots
        drop_graphs()
    manager.on_stage = lambda message: progress("load", message, 0, 1)
    try:
        manager.learn_prior(before, manager.routing_counts(), source)
    finally:
        manager.on_stage = lambda message: None
    progress("load", MESSAGE, 1, 1)
    return True
