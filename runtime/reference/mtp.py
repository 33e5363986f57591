"""Qwen3.5-MoE's multi-token-prediction (MTP) head on the CPU reference engine: a speculative draft.

The checkpoints publish the head under `mtp.` (transformers drops it on load). For the model's final
hidden state h_i at position i (after the final norm: what lm_head reads) and the token t_{i+1} that
follows it:

    x   = fc([rms(embed(t_{i+1})) * (1 + w_e),  rms(h_i) * (1 + w_h)])       fc [H, 2H], embedding first
    x   = one decoder layer: gated full attention at position i over the head's own KV cache, then the MoE
    m_i = rms(x) * (1 + w_n);   lm_head(m_i) gives the distribution of t_{i+2}

The embedding and lm_head are the model's own. Drafting K tokens chains the head: its output m and the
token it drafted take the place of h and t for the next draft.

Cache slots: slot i holds the head's keys and values for (h_i, t_{i+1}) at position i. The engine
(hybrid.py) fills slots as its forwards reveal h and t, so every draft attends to the whole conversation
as the model saw it; drafted slots are overwritten by the verify forward that follows them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from runtime import qwen35
from runtime.engine import offered
from runtime.errors import BadRequest, EngineError, InvalidModel
from runtime.modelfolder import ModelFolder
from runtime.reference import model
from runtime.reference import qwen35 as q35
from runtime.reference.weights import Linear, _act_dtype

ROWS_KEPT = 80     # final hidden states of the latest positions kept (a verify window and then some)


@dataclass
class MtpWeights:
    fc: Linear                     # [H, 2H]
    norm_embedding: torch.Tensor   # [H] (1 + weight)
    norm_hidden: torch.Tensor      # [H]
    layer: q35.Layer               # gated full attention + MoE with shared expert
    norm: torch.Tensor             # [H]

    def nbytes(self) -> int:
        layer = self.layer
        return (self.fc.nbytes() + layer.proj.nbytes() + layer.out.nbytes() + layer.shared_gate_up.nbytes()
                + layer.shared_down.nbytes())


def load_weights(folder: ModelFolder, spec: q35.Spec, precision: str,
                 progress: Callable[[int, int], None] = lambda done, total: None) -> q35.Weights:
    """The model's weights (qwen35.load_weights) and, when the folder has one, its MTP head."""
    weights = q35.load_weights(folder, spec, precision, progress)
    if qwen35.has_mtp(set(folder.info.shard_of)):
        weights.mtp = load(folder, spec, precision)
    return weights


def load(folder: ModelFolder, spec: q35.Spec, precision: str) -> MtpWeights:
    """Read the head, every tensor checked against the shapes the config implies."""
    f32, dt = torch.float32, _act_dtype(precision)
    present = set(folder.info.shard_of)
    lay = qwen35.mtp_layout(folder.config, present)

    def bad(name: str, got, want) -> InvalidModel:
        return InvalidModel(folder.path / folder.info.shard_of.get(name, ""),
                                f"tensor {name!r} has shape {list(got)}, the config implies {list(want)}")

    def tensor(name: str) -> torch.Tensor:
        t = folder.tensor(name)
        if name in lay.plain and tuple(t.shape) != lay.plain[name]:
            raise bad(name, t.shape, lay.plain[name])
        return t

    def linear(prefix: str) -> torch.Tensor:
        if not folder.has(f"{prefix}.weight") and not folder.has(f"{prefix}.q_weight"):
            raise InvalidModel(folder.path, f"tensor '{prefix}.weight' is missing")
        w = folder.linear(prefix, f32)
        if prefix in lay.linears and tuple(w.shape) != lay.linears[prefix]:
            raise bad(f"{prefix}.weight", w.shape, lay.linears[prefix])
        return w

    p = f"{qwen35.MTP}.layers.0"
    layer = q35.build_layer(qwen35.FULL, p, spec, precision, linear, tensor,
                            f"{p}.mlp.experts.gate_up_proj" in present)
    norm = [(1.0 + tensor(f"{qwen35.MTP}.{n}.weight").float()).to(dt)
            for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")]
    return MtpWeights(Linear(linear(f"{qwen35.MTP}.fc"), None, precision), norm[0], norm[1], layer, norm[2])


class _KV:
    def __init__(self, spec: q35.Spec, capacity: int, dtype: torch.dtype, device: torch.device | str = "cpu"):
        shape = (1, spec.kv_heads, capacity, spec.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)


class MtpCache:
    """The head's KV cache (`slots` of them filled from the model's own hidden states) and the final
    hidden states of the latest positions, `rows` [r, H] for positions rows_start.. . The hybrid engine
    keeps its head's slots and rows in one too (runtime/backends/hybrid_mtp.py, `device` its GPU)."""

    def __init__(self, spec: q35.Spec, capacity: int, dtype: torch.dtype, device: torch.device | str = "cpu"):
        self.kv = _KV(spec, capacity, dtype, device)
        self.capacity = capacity
        self.slots = 0
        self.rows: Optional[torch.Tensor] = None
        self.rows_start = 0

    def has_row(self, position: int) -> bool:
        return self.rows is not None and self.rows_start <= position < self.rows_start + self.rows.shape[0]

    def row(self, position: int) -> torch.Tensor:
        return self.rows[position - self.rows_start]

    def keep_rows(self, start: int, rows: torch.Tensor) -> None:
        """Rows for positions start.. (after those kept before start, when they join up)."""
        if self.rows is not None and self.rows_start <= start <= self.rows_start + self.rows.shape[0]:
            rows = torch.cat([self.rows[:start - self.rows_start], rows])
            start = self.rows_start
        cut = max(rows.shape[0] - ROWS_KEPT, 0)
        self.rows, self.rows_start = rows[cut:], start + cut

    def trim(self, length: int) -> None:
        """Forget what depends on positions from `length` on."""
        self.slots = min(self.slots, max(length - 1, 0))
        if self.rows is not None:
            self.rows = self.rows[:max(length - self.rows_start, 0)]
            if self.rows.shape[0] == 0:
                self.rows = None

    def nbytes(self) -> int:
        rows = 0 if self.rows is None else self.rows.numel() * self.rows.element_size()
        return self.kv.k.numel() * self.kv.k.element_size() * 2 + rows


def run(w: q35.Weights, spec: q35.Spec, cache: MtpCache, cos: torch.Tensor, sin: torch.Tensor,
        hidden: torch.Tensor, tokens: torch.Tensor, start: int) -> torch.Tensor:
    """hidden [T, H] (h_i, or the head's own m_i) and the tokens after them [T] -> the head's output
    m [T, H] for slots start..start+T-1, written to its cache; lm_head(m) gives the next tokens' logits."""
    head, t = w.mtp, tokens.shape[0]
    end = start + t
    e = F.rms_norm(F.embedding(tokens, w.embed), (spec.hidden,), head.norm_embedding, spec.eps)
    h = F.rms_norm(hidden.to(w.dtype), (spec.hidden,), head.norm_hidden, spec.eps)
    x = head.fc(torch.cat([e, h], dim=-1))                                     # [T, H]
    rot = cos[start:end, None], sin[start:end, None]
    mask = model._mask(start, end, 0, spec.heads // spec.kv_heads)
    x = q35.layer_forward(head.layer, spec, cache, 0, x, rot, mask, start, end)
    return F.rms_norm(x, (spec.hidden,), head.norm, spec.eps)


class MtpDrafting:
    """The engine's side of the head, shared by the CPU reference engine (reference/hybrid.py) and the
    Qwen3.5 GPU engine (backends/hybrid.py, backends/hybrid_mtp.py): the slots follow the engine's
    forwards (`_mtp_follow`, called after each with the rows' final hidden states), drafts chain the head
    (`mtp_draft`), a head that missed part of the conversation is rebuilt over it. The engine provides
    `mtp` (its MtpCache, None without a head), `mtp_on`, `info`, `spec`, `tokens`, `position`, `cache`, and
        _mtp_run(hidden [T, H], tokens: list[int], start) -> m [T, H]   the head over those slots
        _mtp_logits(m [1, H]) -> [V] float32                           the model's lm_head
        _mtp_forward(tokens: list[int])    these forwarded after the cache's tokens (the head following)
        _truncate(length)                  the cache and its tokens back to `length` (0: emptied)
    `truncate` here trims the head with the cache."""

    _mtp_paused = False                    # a truncate's replay: the slots stay as they are, rows are kept

    @property
    def has_mtp(self) -> bool:
        return self.mtp is not None

    def mtp_enable(self) -> None:
        """Let the head follow every forward from now on (about one layer's work per forward)."""
        if self.mtp is None:
            raise BadRequest(f"{self.info.name} has no multi-token-prediction head (no mtp.* tensors in its folder)")
        self.mtp_on = True

    def _mtp_follow(self, start: int, ids: Sequence[int], hidden: torch.Tensor) -> None:
        """After a forward of positions start..start+T-1: fill slots start-1..start+T-2 from (h_i, t_{i+1})
        when the slots before them are filled (else they wait for mtp_draft's rebuild), keep the rows."""
        head = self.mtp
        if not self._mtp_paused:
            if start == 0:
                head.slots = 0
            if start == 0 or (head.slots == start - 1 and head.has_row(start - 1)):
                h = hidden[:-1] if start == 0 else torch.cat([head.row(start - 1)[None], hidden[:-1]])
                toks = list(ids[1:] if start == 0 else ids)
                if toks:
                    self._mtp_run(h, toks, max(start - 1, 0))
                head.slots = start + len(ids) - 1
        head.keep_rows(start, hidden)

    def mtp_draft(self, tokens: list[int], k: int, choose: Callable[[torch.Tensor], int]) -> list[int]:
        """Up to k draft tokens after `tokens` (the cache holds all but the last) from the MTP head;
        `choose(logits [V] float32) -> token` picks each (greedy or sampled, by the caller's rule)."""
        self.mtp_enable()
        n = len(tokens) - 1
        if n != self.position:
            raise EngineError(f"MTP draft after {len(tokens)} tokens: the cache holds {self.position}, "
                              f"not the {n} before the last")
        head, drafts = self.mtp, []
        if n == 0:
            return drafts
        with torch.inference_mode():
            if head.slots < n - 1 or not head.has_row(n - 1):
                self._mtp_rebuild(n)
            h, tok = head.row(n - 1)[None], tokens[-1]
            for pos in range(n - 1, min(n - 1 + k, head.capacity)):
                h = self._mtp_run(h, [tok], pos)
                tok = choose(offered(self, self._mtp_logits(h)))   # what the verify refuses: never drafted
                drafts.append(tok)
        return drafts

    def _mtp_rebuild(self, n: int) -> None:
        """The head missed part of the conversation (it was off): run the model over it again."""
        keep = self.tokens[:n]
        self.mtp.slots, self.mtp.rows = 0, None
        self._truncate(0)
        self._mtp_forward(keep)

    def truncate(self, length: int) -> None:
        """Back to the first `length` tokens (`_truncate`), the head's slots and kept rows with them; where
        the head no longer keeps the row of length-1 (what the next draft reads), that token runs again."""
        if self.cache is None or not 0 <= length <= self.position:
            raise EngineError(f"cannot truncate to {length} tokens: the cache holds {self.position}")
        head = self.mtp if self.mtp is not None and self.mtp_on else None
        slots = min(head.slots, max(length - 1, 0)) if head is not None else 0
        with torch.inference_mode():
            self._mtp_paused = True
            try:
                self._truncate(length)
                if head is not None and length >= 1 and not head.has_row(length - 1):
                    last = self.tokens[length - 1]
                    self._truncate(length - 1)
                    self._mtp_forward([last])
            finally:
                self._mtp_paused = False
        if head is not None:
            head.trim(length)
            head.slots = slots
